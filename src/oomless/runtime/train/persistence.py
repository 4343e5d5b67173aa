"""The trainer's state on disk: run files, checkpoints, resume, the final result.

A mixin of :class:`~oomless.runtime.train.loop.Trainer`: the methods use the
trainer's attributes (``run``, ``engine``, ``scheduler``, ``dist``, ``step``, ...)
and keep the loop module about the loop.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from . import checkpoint as ckpt
from .memlog import truncate_after
from .run_folder import TrainResult, summary_dict


class CheckpointedRun:
    """Save, resume and finish a run (mixed into Trainer)."""

    def write_run_files(self: Any) -> None:
        if not self.dist.is_main:
            return
        self.folder.write_config(self.cfg)
        self.folder.write_estimate(self.estimate)
        self.log.event("start", f"training steps {self.step + 1}..{self.total_steps}: "
                       f"{self.preflight_note}", self.step, engine=self.engine.name,
                       world_size=self.dist.world_size,
                       effective_batch=self.schedule.effective_batch,
                       micro_batch_size=self.micro_batch_size, device=str(self.device),
                       predicted_peak_bytes=self.predicted_peak_bytes)

    def resume_from_checkpoint(self: Any) -> None:
        """Load the latest checkpoint (weights, optimizer, RNG, position)."""
        from ..loading import enable_grad_ckpt

        folder = self.folder.latest_checkpoint()
        if folder is None:
            raise ConfigError(f"--resume: no checkpoint in '{self.folder.checkpoints}'; "
                              "start without --resume")
        self.engine.load_weights(folder)
        state = ckpt.restore(folder, self.scheduler, self.dist.rank)
        self.engine.load_state(folder)
        if state["schedule"] != self.schedule_dict():
            raise ConfigError(f"--resume: checkpoint '{folder}' was made with a different data "
                              f"size or effective batch ({state['schedule']}); resume with the "
                              "same data and batch settings")
        self.step = state["step"]
        self.eval_round = state.get("eval_round", 0)
        self.micro_batch_size = state["micro_batch_size"]
        self.eval_batch_size = state["eval_batch_size"]
        self.injector.load_state_dict(state.get("fault_injection", {}))
        if state["grad_ckpt"] and not self.grad_ckpt:
            enable_grad_ckpt(self.model)
            self.grad_ckpt = True
        if self.dist.is_main:
            truncate_after(self.folder.path, self.step)
        self.log.event("resume", f"resumed from {folder.name}", self.step,
                       micro_batch_size=self.micro_batch_size, grad_ckpt=self.grad_ckpt)

    def save_checkpoint(self: Any) -> Path | None:
        """Every rank's RNG plus rank 0's weights/optimizer/state; atomic rename at the end."""
        d = self.dist
        tmp = ckpt.prepare_tmp(self.folder.path, self.step) if d.is_main else None
        d.barrier()
        tmp = Path(d.broadcast_str(str(tmp) if tmp else None))
        ckpt.write_rank_rng(tmp, d.rank)
        self.engine.save_state(tmp)
        d.barrier()
        final = None
        self.engine.save_weights(tmp)
        if d.is_main:
            state = {"step": self.step, "eval_round": self.eval_round,
                     "micro_batch_size": self.micro_batch_size,
                     "eval_batch_size": self.eval_batch_size, "grad_ckpt": self.grad_ckpt,
                     "schedule": self.schedule_dict(),
                     "data_position": self.schedule.position(self.step),
                     "fault_injection": self.injector.state_dict()}
            ckpt.write_main(tmp, self.scheduler, state)
            final = ckpt.publish(self.folder.path, tmp, self.step,
                                 self.cfg.training.save_total_limit)
            self.log.event("checkpoint", f"checkpoint {final.name}", self.step, path=str(final))
        d.barrier()
        return final

    def finish(self: Any, result: TrainResult) -> TrainResult:
        """Last checkpoint, the final weights + tokenizer in RUN/final, summary.json."""
        self.save_checkpoint()
        result.steps = self.step
        result.micro_batch_size, result.grad_ckpt = self.micro_batch_size, self.grad_ckpt
        result.predicted_peak_bytes = self.predicted_peak_bytes
        result.measured_peak_bytes = self.measured_peak()
        d = self.dist
        tmp = self.folder.new_final_dir() if d.is_main else None
        tmp = Path(d.broadcast_str(str(tmp) if tmp else None))
        self.engine.save_weights(tmp)
        if d.is_main:
            self.tokenizer.save_pretrained(str(tmp))
            result.final_dir = self.folder.publish_final(tmp)
            summary = summary_dict(result, self.schedule.effective_batch, self.device.type)
            self.folder.write_summary(summary)
            self.log.event("finish", "training finished; predicted vs measured peak in "
                           "summary.json", self.step,
                           **{k: summary[k] for k in ("predicted_peak_bytes",
                                                      "measured_peak_bytes",
                                                      "measured_peak_kind", "final_loss")})
        return result

    def measured_peak(self: Any) -> int | None:
        import torch

        if self.device.type == "cuda":
            return int(self.dist.all_reduce([float(torch.cuda.max_memory_allocated())],
                                            op="max")[0])
        if self.cfg.training.memory_budget_gb:
            return int(self.dist.all_reduce([float(self.tracked_peak_bytes)], op="max")[0])
        return None


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
