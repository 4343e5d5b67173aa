"""Run-folder bookkeeping of a Trainer: run files, checkpoints, resume, the final result.

Split from train.py to keep the loop readable; every function takes the
Trainer (``tr``) whose state it saves or restores.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...config import RunConfig
from ...errors import ConfigError
from ..loading import enable_grad_ckpt
from . import checkpoint as ckpt
from .memlog import truncate_after

if TYPE_CHECKING:
    from .loop import Trainer, TrainResult


def write_run_files(tr: Trainer) -> None:
    from ...config import dump_run_config
    from ...dataset.records import write_json_atomic

    if not tr.dist.is_main:
        return
    (tr.run_dir / "oomless.yaml").write_text(dump_run_config(tr.cfg))
    if tr.estimate is not None:
        write_json_atomic(tr.run_dir / "estimate.json", tr.estimate.to_dict())
    tr.log.event("start", f"training steps {tr.step + 1}..{tr.total_steps}: {tr.preflight_note}",
                 tr.step, engine=tr.engine.name, world_size=tr.dist.world_size,
                 effective_batch=tr.schedule.effective_batch,
                 micro_batch_size=tr.micro_batch_size, device=str(tr.device),
                 predicted_peak_bytes=tr.predicted_peak_bytes)


def resume(tr: Trainer) -> None:
    """Load the latest checkpoint into the trainer (weights, optimizer, RNG, position)."""
    folder = ckpt.latest_checkpoint(tr.run_dir)
    if folder is None:
        raise ConfigError(f"--resume: no checkpoint in '{tr.run_dir / ckpt.CHECKPOINTS}'; "
                          "start without --resume")
    tr.engine.load_weights(folder)
    state = ckpt.restore(folder, tr.scheduler, tr.dist.rank)
    tr.engine.load_state(folder)
    if state["schedule"] != tr.schedule_dict():
        raise ConfigError(f"--resume: checkpoint '{folder}' was made with a different data "
                          f"size or effective batch ({state['schedule']}); resume with the "
                          "same data and batch settings")
    tr.step = state["step"]
    tr.eval_round = state.get("eval_round", 0)
    tr.micro_batch_size = state["micro_batch_size"]
    tr.eval_batch_size = state["eval_batch_size"]
    tr.injector.load_state_dict(state.get("fault_injection", {}))
    if state["grad_ckpt"] and not tr.grad_ckpt:
        enable_grad_ckpt(tr.model)
        tr.grad_ckpt = True
    if tr.dist.is_main:
        truncate_after(tr.run_dir, tr.step)
    tr.log.event("resume", f"resumed from {folder.name}", tr.step,
                 micro_batch_size=tr.micro_batch_size, grad_ckpt=tr.grad_ckpt)


def save_checkpoint(tr: Trainer) -> Path | None:
    """Every rank's RNG plus rank 0's weights/optimizer/state; atomic rename at the end."""
    tmp = ckpt.prepare_tmp(tr.run_dir, tr.step) if tr.dist.is_main else None
    tr.dist.barrier()
    tmp = Path(tr.dist.broadcast_str(str(tmp) if tmp else None))
    ckpt.write_rank_rng(tmp, tr.dist.rank)
    tr.engine.save_state(tmp)
    tr.dist.barrier()
    final = None
    tr.engine.save_weights(tmp)
    if tr.dist.is_main:
        state = {"step": tr.step, "eval_round": tr.eval_round,
                 "micro_batch_size": tr.micro_batch_size,
                 "eval_batch_size": tr.eval_batch_size, "grad_ckpt": tr.grad_ckpt,
                 "schedule": tr.schedule_dict(),
                 "data_position": tr.schedule.position(tr.step),
                 "fault_injection": tr.injector.state_dict()}
        ckpt.write_main(tmp, tr.scheduler, state)
        final = ckpt.publish(tr.run_dir, tmp, tr.step, tr.cfg.training.save_total_limit)
        tr.log.event("checkpoint", f"checkpoint {final.name}", tr.step, path=str(final))
    tr.dist.barrier()
    return final


def finish(tr: Trainer, result: TrainResult) -> TrainResult:
    """Last checkpoint, the final weights + tokenizer in RUN/final, summary.json."""
    from ...dataset.records import write_json_atomic

    save_checkpoint(tr)
    result.steps = tr.step
    result.micro_batch_size, result.grad_ckpt = tr.micro_batch_size, tr.grad_ckpt
    result.predicted_peak_bytes = tr.predicted_peak_bytes
    result.measured_peak_bytes = measured_peak(tr)
    tmp = ckpt.prepare_tmp(tr.run_dir, 0) if tr.dist.is_main else None
    tmp = Path(tr.dist.broadcast_str(str(tmp) if tmp else None))
    tr.engine.save_weights(tmp)
    if tr.dist.is_main:
        final = tr.run_dir / "final"
        tr.tokenizer.save_pretrained(str(tmp))
        if final.exists():
            import shutil

            shutil.rmtree(final)
        tmp.rename(final)
        result.final_dir = final
        summary = summary_dict(result, tr)
        write_json_atomic(tr.run_dir / "summary.json", summary)
        tr.log.event("finish", "training finished; predicted vs measured peak in summary.json",
                     tr.step, **{k: summary[k] for k in ("predicted_peak_bytes",
                                                         "measured_peak_bytes",
                                                         "measured_peak_kind", "final_loss")})
    return result


def measured_peak(tr: Trainer) -> int | None:
    import torch

    if tr.device.type == "cuda":
        return int(tr.dist.all_reduce([float(torch.cuda.max_memory_allocated())],
                                      op="max")[0])
    if tr.cfg.training.memory_budget_gb:
        return int(tr.dist.all_reduce([float(tr.tracked_peak_bytes)], op="max")[0])
    return None


def summary_dict(result: TrainResult, trainer: Trainer) -> dict[str, Any]:
    return {"steps": result.steps, "first_loss": result.losses[0] if result.losses else None,
            "final_loss": result.losses[-1] if result.losses else None,
            "eval_losses": result.eval_losses, "micro_batch_size": result.micro_batch_size,
            "grad_ckpt": result.grad_ckpt, "effective_batch": trainer.schedule.effective_batch,
            "predicted_peak_bytes": result.predicted_peak_bytes,
            "measured_peak_bytes": result.measured_peak_bytes,
            "measured_peak_kind": ("cuda max_memory_allocated" if trainer.device.type == "cuda"
                                   else "simulated (tracked tensors)" if
                                   result.measured_peak_bytes else None),
            "final_dir": str(result.final_dir) if result.final_dir else None}


class Signals:
    """SIGINT/SIGTERM set a flag; the loop checkpoints after the current step."""

    def __init__(self) -> None:
        self.caught: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> Signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: leave handlers alone
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.caught = signum

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def predicted_estimate(cfg: RunConfig, model_dir: Path, cluster: Any = None) -> Any:
    """The analytic estimate of this run (None where the model is not modelled)."""
    from ...errors import ModelConfigError, UnknownModelError
    from ...memory import estimate_training
    from ...models.catalog import resolve_model

    try:
        spec = resolve_model(str(model_dir)).spec
    except (UnknownModelError, ModelConfigError):
        return None
    return estimate_training(spec, cfg, cluster)


def seed_everything(seed: int) -> None:
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
