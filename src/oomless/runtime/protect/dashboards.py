"""Memory in the dashboards people already watch: the protected Trainer's own logs.

``attach(ctx)`` wraps ``trainer.log`` on the instance (the class is not touched), so
every training log the Trainer writes — and so every ``report_to`` integration
(TensorBoard, Weights & Biases, MLflow, …) and ``trainer.state.log_history`` —
also holds, under :data:`PREFIX`:

- ``oomless/peak_allocated_gib``, ``oomless/peak_reserved_gib``: this process's
  allocator peaks since the previous log (CUDA; the peak counters are reset after
  each reading, so each log shows its own steps' peak);
  ``oomless/simulated_peak_gib`` under a simulated budget (``memory_budget_gb``);
  ``oomless/host_rss_gib`` on CPU;
- ``oomless/predicted_peak_allocated_gib`` and, from the preflight's estimate,
  ``oomless/predicted_device_peak_gib``, ``oomless/predicted_low_gib`` and
  ``oomless/predicted_high_gib`` (its uncertainty band, nvidia-smi view);
- ``oomless/micro_batch`` (rows per forward now), ``oomless/grad_ckpt`` (0/1),
  ``oomless/oom_count``; and in the first log after each OOM split,
  ``oomless/oom_micro_batch_before``, ``oomless/oom_micro_batch_after`` and
  ``oomless/oom_in_backward`` (1: the step's backward was redone) — the why of
  the split, as numbers every integration can plot.

Values are GiB (2^30 bytes) floats: TensorBoard stores scalars as float32, which
holds GiB to a few bytes' worth of precision but not byte counts. Only training
logs (those with ``loss``) get them; evaluation logs and the final summary do not.
The integrations may prefix the names (TensorBoard and W&B show ``train/oomless/…``).
"""

from __future__ import annotations

import json
from typing import Any

PREFIX = "oomless/"
GIB = 2**30


def _gib(n_bytes: int | float) -> float:
    return float(n_bytes) / GIB


class Dashboard:
    """What one protected Trainer adds to its logs (see the module's docstring)."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.ooms: list[dict[str, Any]] = []
        self.reported_ooms = 0
        self.estimate: dict[str, Any] | None = None

    def record_event(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "oom":
            self.ooms.append(data)

    def _prediction(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.ctx.predicted_peak_bytes:
            out["predicted_peak_allocated_gib"] = _gib(self.ctx.predicted_peak_bytes)
        if self.estimate is None:  # the preflight writes it before the first step
            path = self.ctx.run_dir / "estimate.json"
            if path.is_file():
                try:
                    self.estimate = json.loads(path.read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    self.estimate = {}
        est = self.estimate or {}
        for key, name in (("device_peak_bytes", "predicted_device_peak_gib"),
                          ("low_bytes", "predicted_low_gib"),
                          ("high_bytes", "predicted_high_gib")):
            if isinstance(est.get(key), (int, float)):
                out[name] = _gib(est[key])
        return out

    def _measured(self) -> dict[str, float]:
        import torch

        device = self.ctx.trainer.args.device
        out: dict[str, float] = {}
        if device.type == "cuda":
            out["peak_allocated_gib"] = _gib(torch.cuda.max_memory_allocated(device))
            out["peak_reserved_gib"] = _gib(torch.cuda.max_memory_reserved(device))
            torch.cuda.reset_peak_memory_stats(device)
        else:
            from ..train.memlog import host_rss_bytes

            out["host_rss_gib"] = _gib(host_rss_bytes())
        if self.ctx.budget_gb:
            out["simulated_peak_gib"] = _gib(self.ctx.step_peak_bytes)
        return out

    def _splits(self) -> dict[str, float]:
        args = self.ctx.trainer.args
        out = {"micro_batch": float(self.ctx.chunk_rows or args.per_device_train_batch_size),
               "grad_ckpt": float(bool(self.ctx.grad_ckpt)), "oom_count": float(len(self.ooms))}
        if len(self.ooms) > self.reported_ooms:
            last = self.ooms[-1]
            self.reported_ooms = len(self.ooms)
            for key in ("micro_batch_before", "micro_batch_after", "in_backward"):
                if isinstance(last.get(key), (int, float, bool)):
                    out[f"oom_{key}"] = float(last[key])
        return out

    def scalars(self) -> dict[str, float]:
        """The ``oomless/`` values of one training log."""
        values = {**self._measured(), **self._prediction(), **self._splits()}
        return {PREFIX + k: v for k, v in values.items()}


def attach(ctx: Any) -> Dashboard:
    """Add the ``oomless/`` values to ``ctx.trainer``'s training logs; the OOM events
    reach the dashboard through ``ctx.event`` (wrapped on the instance)."""
    dashboard = Dashboard(ctx)
    trainer, original_log, original_event = ctx.trainer, ctx.trainer.log, ctx.event

    def event(kind: str, message: str, step: int | None = None, **data: Any) -> None:
        dashboard.record_event(kind, data)
        original_event(kind, message, step, **data)

    def log(logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "loss" in logs:  # a training log (not evaluation's, not the final summary)
            logs.update(dashboard.scalars())
        return original_log(logs, *args, **kwargs)

    ctx.event = event
    trainer.log = log
    return dashboard
