"""The run folder: one training run's files, written atomically, owned by one run.

    RUN/run.json             the run's identity (run id, start time, host)
    RUN/run.lock             held (flock) by the training process; pid and host inside
    RUN/oomless.yaml         the configuration trained (after any auto-fit)
    RUN/estimate.json        the analytic prediction (when the model is modelled)
    RUN/memlog.jsonl         per-step memory (memlog.py)
    RUN/events.jsonl         start, OOMs, evaluations, checkpoints, finish (memlog.py)
    RUN/checkpoints/step-N/  resumable checkpoints (checkpoint.py)
    RUN/final/               the trained weights and the tokenizer
    RUN/summary.json         steps, losses, predicted vs measured peak

A folder belongs to one run: every checkpoint and log line carries the run id;
a new run refuses a folder that holds another run's files unless told to start
over (then it removes them, and only them); a folder that holds files no run
wrote is refused. Only rank 0 writes (``is_main``); the other ranks hold the
same object so that code paths stay the same on every rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...config import RunConfig, dump_run_config
from ...errors import ConfigError
from ...fileio import new_temp_dir, publish_dir, write_atomic, write_json_atomic
from . import checkpoint as ckpt
from .memlog import EVENTS, MEMLOG

CONFIG = "oomless.yaml"
ESTIMATE = "estimate.json"
SUMMARY = "summary.json"
FINAL = "final"
IDENTITY = "run.json"
LOCK = "run.lock"
# What a training run (and `oomless report` on it) writes: the only entries
# --start-over removes, and the only ones a new run accepts in its folder.
RUN_FILES = (IDENTITY, LOCK, CONFIG, ESTIMATE, SUMMARY, MEMLOG, EVENTS, "eval.jsonl",
             "token_stats.json", "eval_token_stats.json", "rejected.jsonl",
             "eval_rejected.jsonl", "report.html", "accelerate.yaml", "deepspeed.json")
RUN_DIRS = (ckpt.CHECKPOINTS, FINAL)
# Entries that show a run trained here (the launch files alone do not).
_RUN_TRACES = (IDENTITY, MEMLOG, EVENTS, SUMMARY, ckpt.CHECKPOINTS, FINAL)
# Written by the launcher of a multi-GPU run just before its processes start: kept.
_LAUNCH_FILES = ("accelerate.yaml", "deepspeed.json")


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
    first_loss: float | None = None  # the run's first step, also across resumes


def _ours(name: str) -> bool:
    return (name in RUN_FILES or name in RUN_DIRS or name.startswith(".")
            or (name.startswith("predictions-step") and name.endswith(".jsonl")))


class RunLock:
    """An exclusive lock on the run folder: ``flock`` on RUN/run.lock (released by the
    kernel when the process dies, also on kill -9), whose text names the holder."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / LOCK
        self._fd: int | None = None

    def acquire(self, run_id: str) -> None:
        import fcntl

        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as err:
            raise ConfigError(f"cannot lock the run folder ('{self.path}'): "
                              f"{err.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace")
            os.close(fd)
            raise ConfigError(f"'{self.path.parent}' is in use by another training run "
                              f"({_describe(holder)}); wait for it to finish or choose another "
                              "training.output_dir") from None
        self._fd = fd
        info = {"pid": os.getpid(), "host": socket.gethostname(), "run_id": run_id,
                "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:  # who holds it, for a second run's message; the flock alone is the lock
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
            os.fsync(fd)
        except OSError:  # a full disk: the leftovers removed next may free it
            pass

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def _describe(holder: str) -> str:
    try:
        info = json.loads(holder)
        return f"pid {info['pid']} on {info['host']}, since {info['since']}"
    except (ValueError, KeyError, TypeError):
        return "its lock file is being written"


class RunFolder:
    """Paths, ownership and writes of one run's folder."""

    def __init__(self, path: str | Path, is_main: bool = True) -> None:
        self.path = Path(path)
        self.is_main = is_main
        self.run_id: str | None = None
        self._lock = RunLock(self.path)

    @property
    def checkpoints(self) -> Path:
        return self.path / ckpt.CHECKPOINTS

    @property
    def final(self) -> Path:
        return self.path / FINAL

    # ---- ownership -----------------------------------------------------------------
    def claim(self, resume: bool, start_over: bool) -> str:
        """Rank 0: lock the folder and return the run id (resume: the folder's; else a new
        one, after refusing — or, with ``start_over``, clearing — another run's files)."""
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(f"training.output_dir '{self.path}' is a file; give a folder")
        if resume and not (self.path / IDENTITY).is_file():
            raise ConfigError(f"--resume: no checkpoint of a run in '{self.path}' (no "
                              f"{IDENTITY}); start without --resume")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"cannot create training.output_dir '{self.path}': "
                              f"{err.strerror}") from None
        run_id = self.identity().get("run_id") if resume else uuid.uuid4().hex
        self._lock.acquire(str(run_id))
        try:
            self._remove_leftovers()
            if resume:
                if not run_id:
                    raise ConfigError(f"--resume: '{self.path / IDENTITY}' names no run id; "
                                      "start over with --start-over")
            else:
                self._make_room(start_over)
                write_json_atomic(self.path / IDENTITY, {
                    "run_id": run_id, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "host": socket.gethostname()})
        except BaseException:
            self._lock.release()
            raise
        self.run_id = str(run_id)
        return self.run_id

    def release(self) -> None:
        self._lock.release()

    def check_free(self) -> None:
        """Refuse (ConfigError naming the holder) when a run is training in this folder."""
        if (self.path / LOCK).is_file():
            self._lock.acquire("probe")
            self._lock.release()

    def identity(self) -> dict[str, Any]:
        path = self.path / IDENTITY
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _remove_leftovers(self) -> None:
        """Temporary folders and files of writers that died (we hold the lock: no live
        writer is left): half-written checkpoints, final weights, files."""
        for folder in (self.path, self.checkpoints):
            if not folder.is_dir():
                continue
            for entry in folder.iterdir():
                if entry.name.startswith(".") and entry.name.endswith((".tmp", ".old")):
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink(missing_ok=True)

    def _make_room(self, start_over: bool) -> None:
        entries = sorted(p.name for p in self.path.iterdir())
        foreign = [n for n in entries if not _ours(n)]
        if foreign:
            listed = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
            raise ConfigError(f"training.output_dir '{self.path}' holds files that are not a "
                              f"training run's ({listed}); choose an empty or new folder")
        traces = [n for n in entries if n in _RUN_TRACES]
        if not traces:
            return
        if not start_over:
            latest = ckpt.latest_checkpoint(self.path)
            what = f"checkpoints up to {latest.name}" if latest else ", ".join(traces)
            raise ConfigError(
                f"training.output_dir '{self.path}' holds another run ({what}); continue "
                "it with --resume, start over with --start-over (deletes that run's "
                "checkpoints, logs and final weights), or choose another output_dir")
        for name in entries:
            entry = self.path / name
            if name in (LOCK, *_LAUNCH_FILES) or (name.startswith(".")
                                                  and not name.endswith((".tmp", ".old"))):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()

    # ---- writes ------------------------------------------------------------------------
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
    first = result.first_loss if result.first_loss is not None else (
        result.losses[0] if result.losses else None)
    return {"steps": result.steps, "first_loss": first,
            "final_loss": result.losses[-1] if result.losses else None,
            "eval_losses": result.eval_losses, "micro_batch_size": result.micro_batch_size,
            "grad_ckpt": result.grad_ckpt, "effective_batch": effective_batch,
            "predicted_peak_bytes": result.predicted_peak_bytes,
            "measured_peak_bytes": result.measured_peak_bytes,
            "measured_peak_kind": kind,
            "final_dir": str(result.final_dir) if result.final_dir else None}
