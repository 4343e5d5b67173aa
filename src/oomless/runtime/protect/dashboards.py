"""Memory in the dashboards people already watch: the protected Trainer's own logs
(and, for `oomless train`'s own loop, TensorBoard event files: :class:`TensorBoardSteps`).

``attach(ctx)`` wraps ``trainer.log`` on the instance (the class is not touched), so
every training log the Trainer writes — and so every ``report_to`` integration
(TensorBoard, Weights & Biases, MLflow, …) and ``trainer.state.log_history`` —
also holds, under :data:`PREFIX`:

- ``oomless/peak_allocated_gib``, ``oomless/peak_reserved_gib``: this process's
  allocator peaks since the previous log (CUDA; see :func:`measured_peaks`);
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


def predicted_band(run_dir: Any) -> dict[str, float] | None:
    """The run folder's estimate.json (written before the first step by the protected
    Trainer's preflight and by `oomless train`): its device peak and band, in GiB;
    None while there is none."""
    path = run_dir / "estimate.json"
    if not path.is_file():
        return None
    try:
        est = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {name: _gib(est[key]) for key, name in (
        ("device_peak_bytes", "predicted_device_peak_gib"), ("low_bytes", "predicted_low_gib"),
        ("high_bytes", "predicted_high_gib")) if isinstance(est.get(key), (int, float))}


def measured_peaks(device: Any) -> dict[str, float]:
    """This process's allocator peaks since the last call (CUDA: the peak counters are
    reset after reading, so memlog.jsonl's ``peak_bytes`` is then per step too — the
    run's maximum is unchanged), or the host RSS on CPU."""
    import torch

    if device.type == "cuda":
        out = {"peak_allocated_gib": _gib(torch.cuda.max_memory_allocated(device)),
               "peak_reserved_gib": _gib(torch.cuda.max_memory_reserved(device))}
        torch.cuda.reset_peak_memory_stats(device)
        return out
    from ..train.memlog import host_rss_bytes

    return {"host_rss_gib": _gib(host_rss_bytes())}


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
            self.estimate = predicted_band(self.ctx.run_dir)
        return {**out, **(self.estimate or {})}

    def _measured(self) -> dict[str, float]:
        out = measured_peaks(self.ctx.trainer.args.device)
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


# ---- `oomless train`: its own loop (not a Trainer) writes the same values to TensorBoard ----
class TensorBoardSteps:
    """``oomless train --tensorboard DIR``: each step's memory record (memlog.jsonl's
    fields) and the run's OOM splits as the same ``oomless/`` scalars, written to
    TensorBoard event files in DIR (``torch.utils.tensorboard``; rank 0 writes).
    Called by the training loop after each step (its ``on_step_end``)."""

    def __init__(self, log_dir: str) -> None:
        from ...errors import ConfigError

        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("--tensorboard needs the tensorboard package: "
                              "pip install tensorboard") from None
        self.writer = SummaryWriter(log_dir)
        self.ooms = 0
        self.band: dict[str, float] | None = None

    def values(self, trainer: Any, record: dict[str, Any]) -> dict[str, float]:
        """The ``oomless/`` values of one step of the loop (names as the Trainer's)."""
        from ..train.memlog import read_events

        out = measured_peaks(trainer.device)
        for key, name in (("simulated_peak_bytes", "simulated_peak_gib"),
                          ("predicted_peak_bytes", "predicted_peak_allocated_gib")):
            value = record.get(key)
            value = max(value) if isinstance(value, list) and value else value
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[name] = _gib(value)
        if self.band is None:
            self.band = predicted_band(trainer.run_dir)
        out.update(self.band or {})
        splits = [e for e in read_events(trainer.run_dir)
                  if e.get("event") == "oom" and e.get("step") == record["step"]]
        self.ooms += len(splits)
        out.update(micro_batch=float(record["micro_batch_size"]),
                   grad_ckpt=float(bool(record.get("grad_ckpt"))), oom_count=float(self.ooms))
        if splits:
            last, first = splits[-1], splits[0]
            out.update(oom_micro_batch_before=float(first["micro_batch_before"]),
                       oom_micro_batch_after=float(last["micro_batch_after"]),
                       oom_in_backward=float(bool(last.get("in_backward"))))
        return {PREFIX + k: v for k, v in out.items()}

    def __call__(self, trainer: Any, record: dict[str, Any]) -> None:
        if not trainer.dist.is_main:
            return
        for name, value in self.values(trainer, record).items():
            self.writer.add_scalar(name, value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
