"""How the gradients of one optimizer step are reduced and applied.

- :class:`ReplicaEngine` (``zero: 0``): one full replica per process; oomless
  sums the gradients itself after the step's micro batches and the OOM
  agreement, so no collective runs inside forward/backward.
- :class:`FSDPEngine` (``training.engine: fsdp``): PyTorch FSDP2.
- :class:`DeepSpeedEngine` (``zero: 1..3``): DeepSpeed's ZeRO engine
  (``deepspeed.initialize``) in processes started by ``accelerate launch``.
  DeepSpeed communicates inside backward (ZeRO-2 reduce-scatters every micro
  step, ZeRO-3 also gathers parameters in forward), so the ranks agree on an
  OOM after every micro batch's forward and loss, before its backward: an OOM
  there — where the activations and fp32 logits peak — is recovered exactly.
  An OOM that hits only some ranks *inside* a ZeRO collective cannot be:
  the others wait in that collective; the run then stops (NCCL timeout) and
  ``--resume`` continues from the last checkpoint.

Loss scaling: the replica engine sums gradients over ranks, DeepSpeed
averages them, so the loss is multiplied by ``grad_scale`` (1 or the world
size) before dividing by the step's label tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...config import RunConfig


class _Engine:
    """What every engine shares: weights saved whole by rank 0."""

    tr: Any

    def gathered(self, modify: bool = False) -> Any:
        """Context in which every weight is whole (all ranks enter it)."""
        import contextlib

        return contextlib.nullcontext()

    def save_weights(self, folder: Path) -> None:
        """Every rank calls this; rank 0 writes the adapter or the model."""
        from .checkpoint import save_weights

        with self.gathered():
            if self.tr.dist.is_main:
                save_weights(self.module, folder)

    def load_weights(self, folder: Path) -> None:
        from .checkpoint import load_weights

        with self.gathered(modify=True):
            load_weights(self.module, folder)

    def close(self) -> None:
        """End of the run: drop what references the process groups."""
        self.__dict__.clear()


class ReplicaEngine(_Engine):
    name = "replica"
    agree_each_micro = False

    def __init__(self, tr: Any) -> None:
        self.tr = tr
        self.grad_scale = 1.0

    @property
    def module(self) -> Any:
        return self.tr.model

    def forward(self, batch: dict[str, Any]) -> Any:
        return self.tr.model(**batch).logits

    def backward(self, loss: Any, last: bool) -> None:
        loss.backward()

    def step(self) -> float | None:
        import torch

        tr = self.tr
        tr.dist.sum_gradients(tr.params)
        norm = None
        if tr.cfg.training.max_grad_norm > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(tr.params, tr.cfg.training.max_grad_norm))
        tr.optimizer.step()
        tr.optimizer.zero_grad(set_to_none=True)
        return norm

    def discard(self) -> None:
        self.tr.optimizer.zero_grad(set_to_none=True)

    def save_state(self, folder: Path) -> None:
        """Rank 0 only: the optimizer is replicated."""
        import torch

        if self.tr.dist.is_main:
            torch.save(self.tr.optimizer.state_dict(), folder / "optimizer.pt")

    def load_state(self, folder: Path) -> None:
        from .checkpoint import safe_load

        self.tr.optimizer.load_state_dict(safe_load(folder / "optimizer.pt"))


def deepspeed_config(cfg: RunConfig, world_size: int) -> dict[str, Any]:
    """The DeepSpeed JSON for a run: ZeRO stage and offload from the plan, no "auto"."""
    zero: dict[str, Any] = {"stage": cfg.zero, "overlap_comm": False,
                            "contiguous_gradients": True}
    if cfg.offload in ("optimizer", "all"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if cfg.offload == "all":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        # offload with the torch optimizer oomless built (DeepSpeedCPUAdam needs a C++ build)
        "zero_force_ds_cpu_optimizer": False,
        # oomless cuts steps into micro batches itself and marks the last one as the
        # accumulation boundary, so DeepSpeed sees one "micro step" per boundary.
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": cfg.micro_batch_size * world_size,
        "gradient_clipping": cfg.training.max_grad_norm,
        "bf16": {"enabled": cfg.precision in ("bf16", "pure-bf16")},
        "fp16": {"enabled": cfg.precision == "fp16"},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def deepspeed_state_classes() -> tuple[Any, ...]:
    """The classes DeepSpeed pickles into its checkpoint files besides plain data (found
    with torch.serialization.get_unsafe_globals_in_checkpoint on ZeRO checkpoints):
    plain state holders whose unpickling runs none of the file's code."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return (LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address)


class DeepSpeedEngine(_Engine):
    name = "deepspeed"
    agree_each_micro = True

    def __init__(self, tr: Any) -> None:
        import deepspeed

        self.tr = tr
        self.grad_scale = float(tr.dist.world_size)  # ZeRO averages over data-parallel ranks
        config = deepspeed_config(tr.cfg, tr.dist.world_size)
        self.engine, optimizer, _, _ = deepspeed.initialize(
            model=tr.model, optimizer=tr.optimizer, config=config, dist_init_required=False)
        tr.optimizer = optimizer

    @property
    def module(self) -> Any:
        return self.engine.module

    def forward(self, batch: dict[str, Any]) -> Any:
        return self.engine(**batch).logits

    def backward(self, loss: Any, last: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss)

    def step(self) -> float | None:
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def discard(self) -> None:
        self.engine.zero_grad()
        self.engine.optimizer.zero_grad(set_to_none=True)

    def gathered(self, modify: bool = False) -> Any:
        """ZeRO-3: gather the parameters (trainable ones for LoRA) on every rank;
        ``modify``: rank 0's values are scattered back on exit."""
        import contextlib

        if self.tr.cfg.zero != 3:
            return contextlib.nullcontext()
        import deepspeed

        params = [p for p in self.engine.module.parameters()
                  if p.requires_grad or self.tr.cfg.method == "full"]
        return deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modify else None)

    def close(self) -> None:
        """DeepSpeedEngine.destroy releases the optimizer's and the engine's state."""
        engine = self.__dict__.pop("engine", None)
        if engine is not None:
            engine.destroy()
        self.__dict__.clear()

    def save_state(self, folder: Path) -> None:
        """Every rank: DeepSpeed writes each rank's optimizer partition (collective)."""
        self.engine.save_checkpoint(str(folder / "deepspeed"), tag="state",
                                    save_latest=False, exclude_frozen_parameters=True)

    def load_state(self, folder: Path) -> None:
        from .checkpoint import check_pickles

        # DeepSpeed unpickles with weights_only=False: read its files safely first
        check_pickles(folder / "deepspeed", deepspeed_state_classes())
        self.engine.load_checkpoint(str(folder / "deepspeed"), tag="state",
                                    load_module_strict=False, load_optimizer_states=True,
                                    load_lr_scheduler_states=False)


class FSDPEngine(_Engine):
    """PyTorch FSDP2 (``fully_shard`` per decoder layer, then the whole model).

    ``zero: 2`` keeps parameters gathered between forward and backward
    (reshard_after_forward=False, like ZeRO-2 / SHARD_GRAD_OP); otherwise they
    are resharded after forward (ZeRO-3 / FULL_SHARD). The optimizer is built
    on the sharded parameters. FSDP gathers in forward and reduce-scatters in
    backward, so, as with DeepSpeed, ranks agree on an OOM before each backward.
    """

    name = "fsdp"
    agree_each_micro = True

    def __init__(self, tr: Any) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from ...errors import ConfigError
        from ..loading import build_optimizer, build_scheduler

        if tr.cfg.offload != "none" or tr.cfg.method == "qlora":
            raise ConfigError("engine fsdp: offload and QLoRA are not wired to FSDP in oomless; "
                              "use zero: 2/3 with DeepSpeed (engine: deepspeed)")
        self.tr = tr
        self.grad_scale = float(tr.dist.world_size)  # FSDP averages the reduced gradients
        self.mesh = init_device_mesh(tr.device.type, (tr.dist.world_size,))
        reshard = tr.cfg.zero != 2
        for layer in _decoder_layers(tr.model):
            fully_shard(layer, mesh=self.mesh, reshard_after_forward=reshard)
        fully_shard(tr.model, mesh=self.mesh, reshard_after_forward=reshard)
        tr.params = [p for p in tr.model.parameters() if p.requires_grad]
        tr.optimizer = build_optimizer(tr.cfg, tr.params, tr.device.type)
        tr.scheduler = build_scheduler(tr.cfg, tr.optimizer, tr.total_steps)

    @property
    def module(self) -> Any:
        return self.tr.model

    def forward(self, batch: dict[str, Any]) -> Any:
        return self.tr.model(**batch).logits

    def backward(self, loss: Any, last: bool) -> None:
        self.tr.model.set_requires_gradient_sync(last)
        loss.backward()

    def step(self) -> float | None:
        """Clip (DTensor-aware: the norm is over all shards), step, zero the gradients."""
        import torch

        tr = self.tr
        norm = None
        if tr.cfg.training.max_grad_norm > 0:
            total = torch.nn.utils.clip_grad_norm_(tr.params, tr.cfg.training.max_grad_norm)
            norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
        tr.optimizer.step()
        tr.optimizer.zero_grad(set_to_none=True)
        return norm

    def discard(self) -> None:
        self.tr.optimizer.zero_grad(set_to_none=True)

    def _options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, cpu_offload=True)

    def save_weights(self, folder: Path) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        full = get_model_state_dict(self.tr.model, options=self._options())  # collective
        if self.tr.dist.is_main:
            self.tr.model.save_pretrained(str(folder), state_dict=full, safe_serialization=True)

    def load_weights(self, folder: Path) -> None:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        peft = hasattr(self.tr.model, "peft_config")
        files = ["adapter_model.safetensors"] if peft else sorted(
            p.name for p in folder.glob("model*.safetensors"))
        state: dict[str, Any] = {}
        for name in files:
            state.update(load_file(str(folder / name)))
        if peft:  # the adapter file drops the adapter name PEFT puts in module keys
            state = {k.replace(".weight", ".default.weight") if ".lora_" in k else k: v
                     for k, v in state.items()}
        set_model_state_dict(self.tr.model, state,
                             options=StateDictOptions(full_state_dict=True, strict=False))

    def save_state(self, folder: Path) -> None:
        import torch
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        full = get_optimizer_state_dict(self.tr.model, self.tr.optimizer, options=self._options())
        if self.tr.dist.is_main:
            torch.save(full, folder / "optimizer.pt")

    def load_state(self, folder: Path) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        from .checkpoint import safe_load

        full = safe_load(folder / "optimizer.pt")
        set_optimizer_state_dict(self.tr.model, self.tr.optimizer, full,
                                 options=StateDictOptions(full_state_dict=True))


def _decoder_layers(model: Any) -> list[Any]:
    """The modules transformers marks as not to be split (decoder layers)."""
    names = set()
    for m in model.modules():
        names |= set(getattr(m, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        from ...errors import ConfigError

        raise ConfigError(f"engine fsdp: no decoder layers found in {type(model).__name__} "
                          "(no _no_split_modules); use engine: deepspeed")
    return layers


def make_engine(tr: Any) -> Any:
    """FSDP when training.engine says so, DeepSpeed for ZeRO ≥ 1, else replicas."""
    cfg = tr.cfg
    if cfg.training.engine == "fsdp":
        return FSDPEngine(tr)
    if cfg.zero > 0 or cfg.training.engine == "deepspeed":
        return DeepSpeedEngine(tr)
    return ReplicaEngine(tr)
