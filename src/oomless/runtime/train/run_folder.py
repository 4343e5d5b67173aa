"""The run folder: one training run's files, written atomically.

    RUN/oomless.yaml         the configuration trained (after any auto-fit)
    RUN/estimate.json        the analytic prediction (when the model is modelled)
    RUN/memlog.jsonl         per-step memory (memlog.py)
    RUN/events.jsonl         start, OOMs, evaluations, checkpoints, finish (memlog.py)
    RUN/checkpoints/step-N/  resumable checkpoints (checkpoint.py)
    RUN/final/               the trained weights and the tokenizer
    RUN/summary.json         steps, losses, predicted vs measured peak

Only rank 0 writes (``is_main``); the other ranks hold the same object so that
code paths stay the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...config import RunConfig, dump_run_config
from ...fileio import new_temp_dir, publish_dir, write_atomic, write_json_atomic
from . import checkpoint as ckpt

CONFIG = "oomless.yaml"
ESTIMATE = "estimate.json"
SUMMARY = "summary.json"
FINAL = "final"


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    losses: list[float] = field(default_factory=list)
    eval_losses: list[float] = field(default_factory=list)
    micro_batch_size: int = 1
    grad_ckpt: bool = False
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    final_dir: Path | None = None


class RunFolder:
    """Paths and writes of one run's folder."""

    def __init__(self, path: str | Path, is_main: bool = True) -> None:
        self.path = Path(path)
        self.is_main = is_main

    @property
    def checkpoints(self) -> Path:
        return self.path / ckpt.CHECKPOINTS

    @property
    def final(self) -> Path:
        return self.path / FINAL

    def latest_checkpoint(self) -> Path | None:
        return ckpt.latest_checkpoint(self.path)

    def write_config(self, cfg: RunConfig) -> None:
        if self.is_main:
            self.path.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path / CONFIG, dump_run_config(cfg))

    def write_estimate(self, estimate: Any) -> None:
        if self.is_main and estimate is not None:
            write_json_atomic(self.path / ESTIMATE, estimate.to_dict())

    def new_final_dir(self) -> Path:
        """Rank 0: a temporary folder to save the final weights into."""
        return new_temp_dir(self.path, FINAL)

    def publish_final(self, tmp: Path) -> Path:
        return publish_dir(tmp, self.final)

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.is_main:
            write_json_atomic(self.path / SUMMARY, summary)


def summary_dict(result: TrainResult, effective_batch: int, device_type: str) -> dict[str, Any]:
    """What summary.json holds (``oomless report`` and the CLI read it)."""
    kind = ("cuda max_memory_allocated" if device_type == "cuda"
            else "simulated (tracked tensors)" if result.measured_peak_bytes else None)
    return {"steps": result.steps, "first_loss": result.losses[0] if result.losses else None,
            "final_loss": result.losses[-1] if result.losses else None,
            "eval_losses": result.eval_losses, "micro_batch_size": result.micro_batch_size,
            "grad_ckpt": result.grad_ckpt, "effective_batch": effective_batch,
            "predicted_peak_bytes": result.predicted_peak_bytes,
            "measured_peak_bytes": result.measured_peak_bytes,
            "measured_peak_kind": kind,
            "final_dir": str(result.final_dir) if result.final_dir else None}
