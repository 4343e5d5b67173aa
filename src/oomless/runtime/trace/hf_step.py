"""The training step that ``trace`` and ``measure`` run: HF Trainer's, written out.

What HF Trainer (with accelerate) does per optimizer step, with the same
library calls: the model's forward under ``torch.autocast`` with accelerate's
``convert_outputs_to_fp32`` around it (accelerate.Accelerator.prepare_model
for bf16/fp16 mixed precision), the loss taken from the outputs and the
outputs dropped before backward (Trainer.compute_loss returns the loss only),
``loss.backward()`` (through a GradScaler for fp16), gradient clipping at
``training.max_grad_norm``, ``optimizer.step()`` and
``zero_grad(set_to_none=True)``. AdamW is torch's fused implementation
(transformers' default ``adamw_torch_fused``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...config import RunConfig
from ...knobs import OPTIMIZERS
from ..build import autocast_dtype
from ..loading import build_optimizer


def make_optimizer(params: list[torch.nn.Parameter], cfg: RunConfig, device_type: str) -> Any:
    """The optimizer HF Trainer builds for ``cfg.optimizer`` (TrainingArguments.optim).

    paged-adamw: bitsandbytes keeps the same fp32 states in CUDA unified memory; on a
    CPU trace it is AdamW, and the states count outside PyTorch's allocator
    (category paged_optimizer). 8-bit optimizers run only on CUDA.
    """
    if OPTIMIZERS[cfg.optimizer].needs_cuda and device_type != "cuda":
        if cfg.optimizer != "paged-adamw":
            raise NotImplementedError(f"{cfg.optimizer} runs only on CUDA (bitsandbytes kernels)")
        cfg = cfg.replace(optimizer="adamw")
    return build_optimizer(cfg, params, device_type, fused=True)


def optimizer_state_tensors(optimizer: Any) -> list[torch.Tensor]:
    out = []
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out


def vocab_size_of(model: torch.nn.Module) -> int:
    return model.get_input_embeddings().num_embeddings


def make_batch(model: torch.nn.Module, batch: int, seq: int, device: str) -> dict[str, torch.Tensor]:
    """Full-length samples, no padding: no attention mask (all ones), so
    transformers drops the mask and SDPA runs causal flash attention."""
    vocab = vocab_size_of(model)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    return {"input_ids": ids, "labels": ids.clone()}


def _noop(name: str, iteration: int) -> None:
    return None


def training_forward(model: torch.nn.Module, cfg: RunConfig) -> Callable[..., Any]:
    """The model's forward as accelerate wraps it for mixed precision."""
    if autocast_dtype(cfg) is None:
        return model.forward
    from accelerate.utils import convert_outputs_to_fp32

    return convert_outputs_to_fp32(model.forward)


LossFn = Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor]


def run_steps(model: torch.nn.Module, cfg: RunConfig, batch: dict[str, torch.Tensor], *,
              device_type: str, iterations: int = 2,
              on_phase: Callable[[str, int], None] = _noop,
              on_grads: Callable[[list[torch.nn.Parameter]], None] | None = None,
              on_states: Callable[[Any], None] | None = None,
              eval_batch: dict[str, torch.Tensor] | None = None,
              loss_fn: LossFn | None = None,
              before_step: Callable[[int], None] | None = None,
              after_step: Callable[[int], None] | None = None) -> list[float]:
    """``iterations`` optimizer steps; returns the losses. ``on_grads`` gets the trained
    parameters after backward, ``on_states`` the optimizer after its step. ``loss_fn``:
    a trainer's loss on (model, batch) in place of the causal-LM loss (training stages);
    ``before_step``/``after_step``: what a trainer does around each optimizer step (PPO's
    rollout before, its statistics after)."""
    from .stacks import model_loss, stack_loss, step_context

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, cfg, device_type)
    scaler = torch.amp.GradScaler(device_type) if cfg.precision == "fp16" else None
    forward, compute_loss = training_forward(model, cfg), stack_loss(cfg)
    if loss_fn is not None:  # a training stage: the trainer's loss replaces the stack's
        forward, compute_loss = _trainer_loss(model, cfg, loss_fn), model_loss
    losses: list[float] = []
    held: list[Any] = []  # outputs a stack keeps until its next forward (stacks.py)
    # with gradient accumulation, a second micro batch runs while the first one's
    # gradients are held: two micro batches show every state a longer run reaches
    micro_batches = min(cfg.grad_accum, 2)
    with step_context(cfg):
        for it in range(iterations):
            if before_step:
                before_step(it)
            for _ in range(micro_batches):
                losses.append(_micro_step(forward, compute_loss, batch, cfg, device_type,
                                          scaler, on_phase, it, held))
            if on_grads:
                on_grads(params)
            on_phase("optimizer", it)
            _optimizer_step(optimizer, params, cfg, scaler)
            if on_states:
                on_states(optimizer)
            optimizer.zero_grad(set_to_none=True)
            if after_step:
                after_step(it)
        if eval_batch is not None:
            on_phase("evaluation", iterations)
            evaluate(model, cfg, eval_batch, device_type)
    return losses


def _trainer_loss(model: torch.nn.Module, cfg: RunConfig, loss_fn: LossFn) -> Callable[..., Any]:
    """A forward that returns the trainer's loss as ``outputs.loss``; the model's own
    forward is wrapped as accelerate's prepare_model does for mixed precision."""
    from types import SimpleNamespace

    if autocast_dtype(cfg) is not None and not getattr(model, "_oomless_fp32_outputs", False):
        from accelerate.utils import convert_outputs_to_fp32

        model.forward = convert_outputs_to_fp32(model.forward)
        model._oomless_fp32_outputs = True

    def forward(**batch: Any) -> Any:
        return SimpleNamespace(loss=loss_fn(model, batch))

    return forward


def _micro_step(forward: Callable[..., Any], compute_loss: Callable[..., tuple[Any, Any]],
                batch: dict[str, torch.Tensor], cfg: RunConfig,
                device_type: str, scaler: Any, on_phase: Callable[[str, int], None],
                iteration: int, held: list[Any]) -> Any:
    """Forward (autocast) and backward of one micro batch; the loss, detached.
    ``compute_loss`` is the stack's (stacks.stack_loss) or a trainer's; a stack that
    keeps its outputs holds them in ``held`` until the next forward has returned."""
    from .stacks import keeps_outputs

    ac = autocast_dtype(cfg)
    on_phase("forward", iteration)
    with torch.autocast(device_type, dtype=ac or torch.bfloat16, enabled=ac is not None):
        loss, outputs = compute_loss(forward, batch)
    held.clear()
    if keeps_outputs(cfg):
        held.append(outputs)
    loss = loss / cfg.grad_accum  # Trainer scales the loss for accumulation
    del outputs
    on_phase("backward", iteration)
    (scaler.scale(loss) if scaler else loss).backward()
    return loss.detach()


def _optimizer_step(optimizer: Any, params: list[torch.nn.Parameter], cfg: RunConfig,
                    scaler: Any) -> None:
    if scaler is not None:
        scaler.unscale_(optimizer)
    if cfg.training.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(params, cfg.training.max_grad_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()


def evaluate(model: torch.nn.Module, cfg: RunConfig, batch: dict[str, torch.Tensor],
             device_type: str) -> None:
    """Trainer.prediction_step without generation: a no-grad forward with labels."""
    ac = autocast_dtype(cfg)
    model.eval()
    try:
        with torch.no_grad(), torch.autocast(device_type, dtype=ac or torch.bfloat16,
                                             enabled=ac is not None):
            outputs = training_forward(model, cfg)(**batch)
        del outputs
    finally:
        model.train()
