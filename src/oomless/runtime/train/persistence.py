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

# What may change on --resume: where files go, how often they are written, fault
# injection and the simulated OOM budget (recovery keeps the training exact), and
# the data files' paths (their content is compared instead). Any other key —
# model, method, LoRA, precision, batch, optimizer, schedule, seed, data options
# — makes the resumed run another run, and is refused.
RESUME_MAY_CHANGE = ("training.output_dir", "training.save_steps", "training.save_total_limit",
                     "training.logging_steps", "training.inject_oom", "training.auto_fit",
                     "training.memory_budget_gb", "eval.batch_size", "data.train_file",
                     "data.eval_file")
# A longer run: allowed, and noted in the resume event (the schedule spans the new length).
RESUME_EXTENDS = ("training.max_steps", "training.epochs")


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def changed_keys(before: dict[str, Any], after: dict[str, Any],
                 keys: tuple[str, ...] | None = None) -> list[str]:
    """'key: old → new' for every differing key (only ``keys`` when given)."""
    a, b = _flat(before), _flat(after)
    names = keys if keys is not None else tuple(sorted(set(a) | set(b)))
    return [f"{k}: {a.get(k)!r} → {b.get(k)!r}" for k in names if a.get(k) != b.get(k)]


def config_differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The differences that make a checkpoint another run's (see RESUME_MAY_CHANGE)."""
    allowed = set(RESUME_MAY_CHANGE) | set(RESUME_EXTENDS)
    return [d for d in changed_keys(before, after)
            if d.split(":", 1)[0] not in allowed
            and not any(d.startswith(k + ".") for k in RESUME_MAY_CHANGE)]


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
        """Continue from the newest usable checkpoint of this run (weights, optimizer, RNG,
        position); a corrupt one is skipped for the one before it, a different
        configuration is refused, and the logs are cut back to the checkpoint."""
        from ..loading import enable_grad_ckpt

        candidates = ckpt.checkpoints_newest_first(self.folder.path)
        if not candidates:
            raise ConfigError(f"--resume: no checkpoint in '{self.folder.checkpoints}'; "
                              "start without --resume")
        skipped: list[str] = []
        for folder in candidates:
            problem = self._checkpoint_problem(folder)
            if not self.dist.any_true(problem is not None):
                problem = self._load_checkpoint(folder)
                if not self.dist.any_true(problem is not None):
                    break
            skipped.append(f"{folder.name}: {problem or 'unusable on another rank'}")
        else:
            raise ConfigError(f"--resume: no usable checkpoint in '{self.folder.checkpoints}':"
                              "\n  " + "\n  ".join(skipped) + "\nstart again with --start-over")
        state = ckpt.read_state(folder)
        self.step = state["step"]
        self.eval_round = state.get("eval_round", 0)
        self.micro_batch_size = state["micro_batch_size"]
        self.eval_batch_size = state["eval_batch_size"]
        self.first_loss = state.get("first_loss")
        self.injector.load_state_dict(state.get("fault_injection", {}))
        if state["grad_ckpt"] and not self.grad_ckpt:
            enable_grad_ckpt(self.model)
            self.grad_ckpt = True
        dropped = {}
        if self.dist.is_main:
            dropped = truncate_after(self.folder.path, self.step, self.folder.run_id)
        extended = changed_keys(state["config"], self.cfg.to_dict(), RESUME_EXTENDS)
        self.log.event("resume", f"resumed from {folder.name}", self.step,
                       micro_batch_size=self.micro_batch_size, grad_ckpt=self.grad_ckpt,
                       skipped_checkpoints=skipped, dropped_log_lines=dropped,
                       extended=extended)

    def _checkpoint_problem(self: Any, folder: Path) -> str | None:
        """Why ``folder`` is damaged (None: usable). A checkpoint of another run or
        configuration is a ConfigError: an older one of the same run would differ too."""
        try:
            state = ckpt.read_state(folder)
        except ConfigError as err:
            return str(err)
        if state.get("run_id") != self.folder.run_id:
            raise ConfigError(f"--resume: checkpoint '{folder}' belongs to run "
                              f"{state.get('run_id')}, not to this folder's run "
                              f"{self.folder.run_id}; start again with --start-over")
        if state.get("schedule") != self.schedule_dict():
            raise ConfigError(f"--resume: checkpoint '{folder}' was made with a different data "
                              f"size or effective batch ({state.get('schedule')}); resume with "
                              "the same data and batch settings")
        diffs = config_differences(state.get("config") or {}, self.cfg.to_dict())
        if state.get("data") != self.data_fingerprints:
            diffs.append("the data files' content changed (SHA-256)")
        if diffs:
            raise ConfigError(f"--resume: checkpoint '{folder}' was trained with another "
                              "configuration: " + "; ".join(diffs) + ". Resume with the "
                              "configuration it was made with, or start again with --start-over")
        return ckpt.verify(folder) if self.dist.is_main else None

    def _load_checkpoint(self: Any, folder: Path) -> str | None:
        try:
            self.engine.load_weights(folder)
            ckpt.restore(folder, self.scheduler, self.dist.rank)
            self.engine.load_state(folder)
        except Exception as err:  # noqa: BLE001 - any failure: try the checkpoint before it
            first = (str(err).splitlines() or [""])[0][:200]
            return f"cannot be loaded ({type(err).__name__}: {first})"
        return None

    def save_checkpoint(self: Any) -> Path | None:
        """Every rank's RNG plus rank 0's weights/optimizer/state; atomic rename at the end."""
        d = self.dist
        tmp = ckpt.prepare_tmp(self.folder.path, self.step) if d.is_main else None
        d.barrier()
        tmp = Path(d.broadcast_str(str(tmp) if tmp else None))
        final = None
        with ckpt.writing(tmp, f"checkpoint step-{self.step:06d}", self.folder.path):
            ckpt.write_rank_rng(tmp, d.rank)
            self.engine.save_state(tmp)
            d.barrier()
            self.engine.save_weights(tmp)
            if d.is_main:
                ckpt.write_main(tmp, self.scheduler, self._checkpoint_state())
                final = ckpt.publish(self.folder.path, tmp, self.step,
                                     self.cfg.training.save_total_limit)
        if final is not None:
            self.log.event("checkpoint", f"checkpoint {final.name}", self.step, path=str(final))
        d.barrier()
        return final

    def _checkpoint_state(self: Any) -> dict[str, Any]:
        return {"run_id": self.folder.run_id, "step": self.step,
                "eval_round": self.eval_round, "micro_batch_size": self.micro_batch_size,
                "eval_batch_size": self.eval_batch_size, "grad_ckpt": self.grad_ckpt,
                "first_loss": self.first_loss, "schedule": self.schedule_dict(),
                "data_position": self.schedule.position(self.step),
                "fault_injection": self.injector.state_dict(),
                "config": self.cfg.to_dict(), "data": self.data_fingerprints}

    def finish(self: Any, result: TrainResult) -> TrainResult:
        """Last checkpoint, the final weights + tokenizer in RUN/final, summary.json."""
        self.save_checkpoint()
        result.steps = self.step
        result.first_loss = self.first_loss
        result.micro_batch_size, result.grad_ckpt = self.micro_batch_size, self.grad_ckpt
        result.predicted_peak_bytes = self.predicted_peak_bytes
        result.measured_peak_bytes = self.measured_peak()
        d = self.dist
        tmp = self.folder.new_final_dir() if d.is_main else None
        tmp = Path(d.broadcast_str(str(tmp) if tmp else None))
        with ckpt.writing(tmp, "the final weights", self.folder.path):
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
