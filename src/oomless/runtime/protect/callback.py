"""The protected Trainer's callback: preflight, per-step memory log, events.

``RUN/memlog.jsonl`` gets one line per optimizer step (the record format of
``oomless train``: step, loss when the Trainer logged it, allocated /
reserved / peak bytes per GPU, the device's used bytes as nvidia-smi counts
them, the predicted peak, rows per forward); ``RUN/events.jsonl`` gets the
preflight, OOMs and recoveries, evaluations, checkpoints, start and end.
Several ranks: every rank's numbers are gathered after each step (one small
all-gather) and rank 0 writes.
"""

from __future__ import annotations

import time
from typing import Any

from ..train.memlog import RunLog, device_memory, truncate_after
from .context import ProtectContext, say
from .preflight import run_preflight


def _device_used_bytes(device: Any) -> int | None:
    """What nvidia-smi shows for this GPU (every process), from cudaMemGetInfo."""
    import torch

    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)


class _Callback:
    """The callback's methods; make_callback mixes them into a ``TrainerCallback``."""

    def __init__(self, ctx: ProtectContext, preflight: str, gpu: str | None) -> None:
        self.ctx, self.preflight, self.gpu = ctx, preflight, gpu
        self.pending: dict[str, Any] | None = None
        self.started = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        c = self.ctx
        if state.global_step and c.dist.is_main:
            truncate_after(c.run_dir, state.global_step)
        elif not c.supervised:  # a fresh run starts fresh logs
            c.log = RunLog(c.run_dir, enabled=c.dist.is_main)
        c.event("train_begin", f"protected Trainer starts at step {state.global_step} of "
                f"{state.max_steps}", output_dir=str(args.output_dir), engine=c.kind,
                world_size=args.world_size, protect=c.enabled,
                per_device_train_batch_size=args.per_device_train_batch_size,
                gradient_accumulation_steps=args.gradient_accumulation_steps,
                effective_batch=args.per_device_train_batch_size
                * args.gradient_accumulation_steps * args.world_size,
                resumed=state.global_step > 0)
        run_preflight(c, self.preflight, self.gpu)

    def on_step_begin(self, args, state, control, **kwargs):
        self._flush()
        self.ctx.micro_index = -1
        self.ctx.step_inputs.clear()
        self.ctx.step_peak_bytes = 0
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.ctx.step_inputs.clear()
        self.pending = self._record(args, state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.pending and self.pending["step"] == state.global_step and logs:
            for key in ("loss", "learning_rate", "grad_norm"):
                if isinstance(logs.get(key), (int, float)):
                    self.pending["lr" if key == "learning_rate" else key] = logs[key]
            self._flush()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.ctx.event("eval", f"evaluation round {self.ctx.eval_round}",
                       eval_loss=(metrics or {}).get("eval_loss"),
                       eval_rows=self.ctx.eval_rows or args.per_device_eval_batch_size)

    def on_save(self, args, state, control, **kwargs):
        self.ctx.event("checkpoint", f"checkpoint-{state.global_step} written",
                       checkpoint=f"{args.output_dir}/checkpoint-{state.global_step}")

    def on_train_end(self, args, state, control, **kwargs):
        self._flush()
        summary = change_summary(self.ctx, args)
        self.ctx.event("train_end", f"training ended at step {state.global_step}",
                       micro_batch_size=self.ctx.chunk_rows or args.per_device_train_batch_size,
                       grad_ckpt=self.ctx.grad_ckpt, summary=summary)
        if self.ctx.dist.is_main:
            say(f"oomless: {summary}")

    def _flush(self) -> None:
        if self.pending is not None:
            if self.ctx.dist.is_main:
                self.ctx.log.step(self.pending)
            self.pending = None

    def _record(self, args, state) -> dict[str, Any]:
        c = self.ctx
        mem = device_memory(args.device)
        used = _device_used_bytes(args.device)
        if used is not None:
            mem["device_bytes"] = used
        keys = sorted(mem)
        per_rank = c.dist.gather([float(mem[k]) for k in keys])
        rec: dict[str, Any] = {"step": state.global_step}
        for i, key in enumerate(keys):
            values = [int(r[i]) for r in per_rank]
            rec[key] = max(values) if key == "host_rss_bytes" else values
        rec.update(micro_batch_size=c.chunk_rows or args.per_device_train_batch_size,
                   grad_ckpt=c.grad_ckpt,
                   per_device_train_batch_size=args.per_device_train_batch_size,
                   grad_accum=args.gradient_accumulation_steps,
                   step_time_s=round(time.perf_counter() - self.started, 6),
                   predicted_peak_bytes=c.predicted_peak_bytes)
        if c.budget_gb:
            rec["simulated_peak_bytes"] = c.step_peak_bytes
        return rec


def change_summary(ctx: ProtectContext, args: Any) -> str:
    """What the protection changed in this training (printed at its end)."""
    train, evals = ctx.recoveries.count("oom"), ctx.recoveries.count("eval_oom")
    where = f"logs in {ctx.run_dir} (events.jsonl, memlog.jsonl)"
    if not (train or evals):
        return f"protect: no out-of-memory error, nothing changed; {where}"
    parts = []
    if train:
        unit = "pairs" if ctx.layout.pairs else "rows"
        effective = (args.per_device_train_batch_size * args.gradient_accumulation_steps
                     * args.world_size)
        parts.append(f"{train} training OOM(s) recovered: {ctx.chunk_rows} of "
                     f"{args.per_device_train_batch_size} {unit} per forward"
                     + (", gradient checkpointing switched on" if ctx.grad_ckpt else "")
                     + f"; the effective batch ({effective}) and its samples unchanged")
    if evals:
        parts.append(f"{evals} evaluation OOM(s) recovered: {ctx.eval_rows} of "
                     f"{args.per_device_eval_batch_size} rows per prediction step")
    return "protect: " + "; ".join(parts) + f"; {where}"


def make_callback(ctx: ProtectContext, preflight: str, gpu: str | None) -> Any:
    """A ``TrainerCallback`` instance bound to ``ctx`` (transformers imported here)."""
    from transformers import TrainerCallback

    cls = type("OomlessCallback", (_Callback, TrainerCallback), {})
    return cls(ctx, preflight, gpu)
