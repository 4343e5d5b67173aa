"""The run folder's logs: per-step memory (memlog.jsonl) and events (events.jsonl).

One JSON object a line, appended and flushed as the run goes, so a crashed
run still leaves its history. Field names are what ``oomless report`` reads
(oomless/report/data.py): byte fields end in ``_bytes`` and hold one value
per GPU (a list) on GPUs; on CPU ``host_rss_bytes`` is the process RSS.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from ...fileio import cut_torn_tail, open_append, read_jsonl, write_atomic

MEMLOG = "memlog.jsonl"
EVENTS = "events.jsonl"
EVAL_LOG = "eval.jsonl"


def host_rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; ru_maxrss elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def device_memory(device: Any) -> dict[str, int]:
    """This process's allocator counters on its GPU, or host RSS on CPU."""
    import torch

    if device.type == "cuda":
        return {"allocated_bytes": torch.cuda.memory_allocated(device),
                "reserved_bytes": torch.cuda.memory_reserved(device),
                "peak_bytes": torch.cuda.max_memory_allocated(device)}
    return {"host_rss_bytes": host_rss_bytes()}


class RunLog:
    """Appends steps and events to the run folder (rank 0 writes).

    Every line carries the run id. Files are opened without following links
    (fileio.open_append); a line torn by a killed writer is cut before the first
    append, so the next line never glues onto it.
    """

    def __init__(self, run_dir: Path, enabled: bool = True, resume: bool = False,
                 run_id: str | None = None) -> None:
        self.run_dir = run_dir
        self.enabled = enabled
        self.run_id = run_id
        self._repaired: set[str] = set()
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            if not resume:
                for name in (MEMLOG, EVENTS):
                    (run_dir / name).unlink(missing_ok=True)

    def append(self, name: str, obj: dict[str, Any]) -> None:
        """One JSON line to RUN/name (memlog, events, eval.jsonl, ...)."""
        if not self.enabled:
            return
        path = self.run_dir / name
        if name not in self._repaired:
            cut_torn_tail(path)
            self._repaired.add(name)
        if self.run_id is not None:
            obj = {**obj, "run_id": self.run_id}
        with open_append(path) as fh:
            fh.write(json.dumps(obj) + "\n")
            fh.flush()

    _append = append  # the name before run ids (kept for callers of the base API)

    def step(self, record: dict[str, Any]) -> None:
        self.append(MEMLOG, record)

    def event(self, kind: str, message: str, step: int | None = None, **data: Any) -> None:
        self.append(EVENTS, {"time": round(time.time(), 3), "step": step, "event": kind,
                             "message": message, **data})


def truncate_after(run_dir: Path, step: int, run_id: str | None = None,
                   names: tuple[str, ...] = (MEMLOG, EVENTS, EVAL_LOG)) -> dict[str, int]:
    """On resume: drop the log lines of steps after the checkpoint (they are redone) —
    memlog, events and eval — plus a torn last line and lines of another run id.
    Returns the lines dropped per file."""
    dropped = {}
    for name in names:
        path = run_dir / name
        if not path.is_file():
            continue
        log = read_jsonl(path, name)
        kept = [obj for _, obj in log.rows if _keep(obj, step, run_id)]
        lost = len(log.rows) - len(kept) + (log.torn_line is not None) + len(log.bad)
        if lost:
            write_atomic(path, "".join(json.dumps(obj) + "\n" for obj in kept))
            dropped[name] = lost
    return dropped


# Events that end an attempt (a rank exiting for a restart): the relaunch does not redo
# them (it runs with the changed configuration), so they stay as the run's history.
ATTEMPT_END_EVENTS = ("oom_exit", "oom_unrecoverable")


def _keep(obj: dict[str, Any], step: int, run_id: str | None) -> bool:
    line_step = obj.get("step")
    if run_id is not None and obj.get("run_id") not in (None, run_id):
        return False
    if obj.get("event") in ATTEMPT_END_EVENTS:
        return True
    return not (isinstance(line_step, int | float) and line_step > step)


def read_steps(run_dir: Path) -> list[dict[str, Any]]:
    """The memory log's records (a torn last line skipped; see fileio.read_jsonl)."""
    path = Path(run_dir) / MEMLOG
    return read_jsonl(path, "memory log").objects() if path.is_file() else []


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """The event log's records (a torn last line skipped)."""
    path = Path(run_dir) / EVENTS
    return read_jsonl(path, "event log").objects() if path.is_file() else []


class Progress:
    """A rich progress bar on rank 0 when attached to a terminal (no-op otherwise)."""

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self._bar = None
        if not enabled:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as RichProgress

        self._bar = RichProgress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                                 transient=False)
        self._task = self._bar.add_task("train", total=total, completed=start, info="")
        self._bar.start()

    def update(self, step: int, info: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
