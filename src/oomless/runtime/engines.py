"""How the gradients of one optimizer step are reduced and applied.

- :class:`ReplicaEngine` (``zero: 0``): one full replica per process; oomless
  sums the gradients itself after the step's micro batches and the OOM
  agreement, so no collective runs inside forward/backward.
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

from ..config import RunConfig


class ReplicaEngine:
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

    def gathered(self) -> Any:
        """Context in which every weight is whole (all ranks enter it)."""
        import contextlib

        return contextlib.nullcontext()

    def save_state(self, folder: Path) -> None:
        """Rank 0 only: the optimizer is replicated."""
        import torch

        if self.tr.dist.is_main:
            torch.save(self.tr.optimizer.state_dict(), folder / "optimizer.pt")

    def load_state(self, folder: Path) -> None:
        import torch

        self.tr.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))


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


class DeepSpeedEngine:
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

    def gathered(self) -> Any:
        """ZeRO-3: gather the parameters to save (trainable ones for LoRA) on every rank."""
        import contextlib

        if self.tr.cfg.zero != 3:
            return contextlib.nullcontext()
        import deepspeed

        params = [p for p in self.engine.module.parameters()
                  if p.requires_grad or self.tr.cfg.method == "full"]
        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

    def save_state(self, folder: Path) -> None:
        """Every rank: DeepSpeed writes each rank's optimizer partition (collective)."""
        self.engine.save_checkpoint(str(folder / "deepspeed"), tag="state",
                                    save_latest=False, exclude_frozen_parameters=True)

    def load_state(self, folder: Path) -> None:
        self.engine.load_checkpoint(str(folder / "deepspeed"), tag="state",
                                    load_module_strict=False, load_optimizer_states=True,
                                    load_lr_scheduler_states=False)


def make_engine(tr: Any) -> Any:
    cfg = tr.cfg
    if cfg.zero > 0 or cfg.training.engine == "deepspeed":
        return DeepSpeedEngine(tr)
    if cfg.training.engine == "fsdp":
        from ..errors import ConfigError

        raise ConfigError("training.engine: fsdp is launched through accelerate with the FSDP "
                          "config (oomless train writes it), but oomless's own loop drives "
                          "DeepSpeed ZeRO only; use zero: 1-3 (engine: deepspeed) for sharding")
    return ReplicaEngine(tr)
