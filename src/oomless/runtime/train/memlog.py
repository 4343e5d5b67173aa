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

from ...fileio import write_atomic

MEMLOG = "memlog.jsonl"
EVENTS = "events.jsonl"


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
    """Appends steps and events to the run folder (rank 0 writes)."""

    def __init__(self, run_dir: Path, enabled: bool = True, resume: bool = False) -> None:
        self.run_dir = run_dir
        self.enabled = enabled
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            if not resume:
                for name in (MEMLOG, EVENTS):
                    (run_dir / name).unlink(missing_ok=True)

    def _append(self, name: str, obj: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.run_dir / name, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(obj) + "\n")
            fh.flush()

    def step(self, record: dict[str, Any]) -> None:
        self._append(MEMLOG, record)

    def event(self, kind: str, message: str, step: int | None = None, **data: Any) -> None:
        self._append(EVENTS, {"time": round(time.time(), 3), "step": step, "event": kind,
                              "message": message, **data})


def truncate_after(run_dir: Path, step: int) -> None:
    """On resume: drop memlog lines of steps after the checkpoint (they are redone)."""
    path = run_dir / MEMLOG
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    write_atomic(path, "".join(k + "\n" for k in kept))


def read_steps(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / MEMLOG
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / EVENTS
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


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
