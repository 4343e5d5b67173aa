"""The protected ``training_step``: a micro batch that runs out of memory is redone in halves.

``Trainer._run_epoch`` hands ``training_step`` one micro batch and the
``num_items_in_batch`` it counted over the whole optimizer step. The guard
calls the Trainer's own ``training_step`` (the subclass's, if it overrides
it) on row chunks of that batch with the same ``num_items_in_batch``:

- when the loss is normalised by ``num_items_in_batch`` (transformers' rule:
  the model accepts loss kwargs, or a ``compute_loss_func`` is set, or the
  subclass says ``loss_is_scaled_for_ga``), chunk losses add up to the batch's
  loss and their gradients to the batch's gradient;
- otherwise the loss is a per-batch mean that ``training_step`` divides by
  ``current_gradient_accumulation_steps``; each chunk then runs with that
  divisor scaled by (batch items / chunk items) — items are the label tokens
  the loss averages (after the causal shift), else rows — which weighs the
  chunk means back into the batch mean.

Recovery, per OOM: halve the chunk (kept for later steps), at one row switch
gradient checkpointing on, after that give up (the OOM propagates). An OOM
before the backward leaves the gradients untouched: the rows not done yet go
on in smaller chunks. An OOM in the backward leaves some gradients half
accumulated: in one process the step's gradients are dropped and its micro
batches so far (the Trainer holds them anyway) are redone, so nothing is
counted twice. Several ranks: see context.py; an OOM after the agreement
(loss, backward) cannot be matched by the other ranks in-process and ends in
the restart exit (exit.py), as does any OOM under DeepSpeed or FSDP, whose
engines hold collectives and micro-step counters inside forward and backward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from ..loading import enable_grad_ckpt
from ..train.oom import (
    budget_mode,
    first_line,
    next_setting,
    release_memory,
    state_tensors,
    storage_bytes,
)
from . import metrics
from .batch import batch_rows, loss_items, row_chunks
from .context import PeerOOM, ProtectContext, checkpointing_on
from .exit import exit_for_restart


@dataclass
class _Progress:
    rows_done: int = 0
    loss: Any = None


def oom_types() -> tuple[type[BaseException], ...]:
    import torch

    return (torch.OutOfMemoryError, PeerOOM)


def loss_scaled_for_ga(trainer: Any, num_items_in_batch: Any) -> bool:
    """transformers' own decision in ``Trainer.training_step`` (whether it divides by
    the accumulation steps)."""
    fixed = getattr(trainer, "loss_is_scaled_for_ga", None)
    if fixed is not None:
        return bool(fixed)
    return bool((getattr(trainer, "model_accepts_loss_kwargs", False)
                 and num_items_in_batch is not None)
                or getattr(trainer, "compute_loss_func", None) is not None)


class StepGuard:
    def __init__(self, ctx: ProtectContext, original: Any) -> None:
        self.ctx = ctx
        self.original = original
        self.oom_types = oom_types()
        self.scaled = True  # whether chunk losses add up (num_items_in_batch normalisation)
        self.step_counters: metrics.Counters | None = None  # TRL's counters (metrics.py)
        self.attempt_counters: metrics.Counters | None = None

    def __call__(self, model: Any, inputs: Any, num_items_in_batch: Any = None,
                 *args: Any, **kwargs: Any) -> Any:
        c = self.ctx
        c.micro_index += 1
        if c.micro_index == 0:
            self.step_counters = metrics.snapshot(c.trainer)
        c.count_micro_batches()
        c.hook_model(model)
        if c.keeps_step_inputs:
            c.step_inputs.append(inputs)
        call = (model, num_items_in_batch, args, kwargs)
        self.scaled = loss_scaled_for_ga(c.trainer, num_items_in_batch)
        progress, redo = _Progress(), False
        while True:
            try:
                if redo:
                    for earlier in c.step_inputs[:-1]:
                        self._run(call, earlier, _Progress())
                    redo = False
                return self._run(call, inputs, progress)
            except self.oom_types as err:
                if self._recover(err, model, self._units(inputs)):
                    progress, redo = _Progress(), True

    def _units(self, inputs: Any) -> int | None:
        rows = batch_rows(inputs)
        return None if rows is None else self.ctx.layout.units(rows)

    # ---- running chunks -----------------------------------------------------------------
    def _run(self, call: tuple, inputs: Any, progress: _Progress) -> Any:
        model, num_items, _args, _kwargs = call
        rows = batch_rows(inputs)
        size, layout = self.ctx.chunk_rows, self.ctx.layout
        units = None if rows is None else layout.units(rows)
        if units is None or size is None or (progress.rows_done == 0 and size >= units):
            return self._attempt(call, inputs, None)
        chunks = row_chunks(inputs, rows, progress.rows_done, size, layout)
        weights = None
        if not loss_scaled_for_ga(self.ctx.trainer, num_items):  # a per-batch mean
            shifts = getattr(self.ctx.trainer, "_loss_shifts_labels", True)
            total = loss_items(inputs, units, shifts, layout)
            weights = [(loss_items(ch, n, shifts, layout), total) for n, ch in chunks]
        for i, (n, chunk) in enumerate(chunks):
            last = progress.rows_done + n == units
            if weights and not weights[i][0] and not self.ctx.dist.active:
                progress.rows_done += n  # no label token: a mean over none, no gradient
                continue
            sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") \
                else model.no_sync()
            with sync:
                loss = self._attempt(call, chunk, weights[i] if weights else None)
            progress.rows_done += n
            progress.loss = loss if progress.loss is None else progress.loss + loss
        if progress.loss is None:  # every chunk was without label tokens
            import torch

            progress.loss = torch.zeros((), device=self.ctx.trainer.args.device)
        return progress.loss

    def _attempt(self, call: tuple, inputs: Any, weight: tuple[int, int] | None) -> Any:
        """One call of the Trainer's training_step (a weighted chunk: its divisor scaled)."""
        model, num_items, args, kwargs = call
        c = self.ctx
        t = c.trainer
        c.in_step, c.in_backward, c.agreed = True, False, False
        saved = getattr(t, "current_gradient_accumulation_steps", None)
        if weight is not None:
            part, whole = weight
            base = saved or t.args.gradient_accumulation_steps
            t.current_gradient_accumulation_steps = base * whole / max(part, 1) if part else base
        mode = self._budget(model)
        self.attempt_counters = metrics.snapshot(t)
        try:
            with mode:
                loss = self.original(model, inputs, num_items, *args, **kwargs)
        finally:
            c.in_step = False
            if weight is not None:
                t.current_gradient_accumulation_steps = saved
        if c.budget_gb:
            c.step_peak_bytes = max(c.step_peak_bytes, mode.peak_bytes)
        return loss

    def _budget(self, model: Any) -> Any:
        c = self.ctx
        if not c.budget_gb:
            return contextlib.nullcontext()
        opt = c.trainer.optimizer
        opt = getattr(opt, "optimizer", opt)
        base = storage_bytes(state_tensors(getattr(model, "module", model), opt))
        return budget_mode(c.budget_gb, base)

    # ---- recovery -----------------------------------------------------------------------
    def _recover(self, err: BaseException, model: Any, rows: int | None) -> bool:
        """New settings on every rank; True when this step's gradients were dropped."""
        c = self.ctx
        in_backward, agreed = c.in_backward, c.agreed
        c.in_backward = c.agreed = False
        ranks = [c.dist.rank]
        if not c.enabled:
            raise err
        if c.kind in ("deepspeed", "fsdp"):
            exit_for_restart(c, err, f"an OOM inside the {c.kind} engine cannot be undone "
                             "in-process (its collectives and micro-step count are mid-step)")
        if c.dist.active:
            if isinstance(err, PeerOOM):
                ranks = err.ranks
            elif not agreed:
                ranks = c.agree(True)
            else:
                exit_for_restart(c, err, "this rank ran out of memory after the forward "
                                 f"({'backward' if in_backward else 'loss'}); the other ranks "
                                 "are already past the point where they could join the recovery")
        release_memory(lambda: None, c.trainer.args.device)
        before = c.chunk_rows or rows or 1
        failed = {"micro_batch_size": before,
                  "grad_ckpt": c.grad_ckpt or checkpointing_on(c.trainer.model)}
        rec = next_setting(before, c.grad_ckpt)
        error = first_line(err)
        if rec is None:
            c.event("oom_unrecoverable", f"out of memory at step {c.step} with one row per "
                    "forward and gradient checkpointing: no recovery left that keeps the "
                    "training; lower the sequence length, quantize or shard the model",
                    c.step, ranks=ranks, error=error, phase="train", failed=failed)
            raise err
        c.chunk_rows = rec.micro_batch_size
        if rec.grad_ckpt and not c.grad_ckpt:
            enable_grad_ckpt(c.trainer.model)
            c.grad_ckpt = True
        redo = in_backward and c.keeps_step_inputs
        if redo:
            model.zero_grad(set_to_none=True)
        metrics.restore(c.trainer, self.step_counters if redo else self.attempt_counters)
        self._log_oom(ranks, error, failed, rows, in_backward)
        return redo

    def _log_oom(self, ranks: list[int], error: str, failed: dict[str, Any], rows: int | None,
                 in_backward: bool) -> None:
        c = self.ctx
        before = failed["micro_batch_size"]
        args = c.trainer.args
        per_device = args.per_device_train_batch_size
        unit = "pairs" if c.layout.pairs else "rows"
        what = "backward: the step's gradients were dropped and its micro batches redone" \
            if in_backward else f"forward: the {unit} not done yet go on"
        c.event("oom", f"OOM at step {c.step} on rank(s) {ranks} ({what}); {rows or '?'} {unit} "
                f"now run {c.chunk_rows} at a time"
                f"{' with gradient checkpointing' if c.grad_ckpt else ''}; the effective batch "
                "is unchanged", c.step, ranks=ranks, error=error, phase="train",
                micro_batch_before=before, micro_batch_after=c.chunk_rows,
                grad_ckpt=c.grad_ckpt, in_backward=in_backward, failed=failed,
                unit=unit, weighting="num_items_in_batch" if self.scaled else
                f"mean over {c.layout.weight}",
                per_device_train_batch_size=per_device,
                gradient_accumulation_steps=args.gradient_accumulation_steps,
                effective_batch=per_device * args.gradient_accumulation_steps * args.world_size)
