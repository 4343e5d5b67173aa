"""Report data: what ``oomless report`` shows, read from a run folder or an estimate.

A run folder (``training.output_dir`` of ``oomless train``) holds:

- the per-step memory log (JSON lines, one object per logged step): ``step``,
  ``loss``, ``lr``, ``tokens``, ``step_time_s``, ``tokens_per_s``,
  ``allocated_bytes``, ``reserved_bytes``, ``peak_bytes`` (each an integer or
  a list with one integer per GPU), ``host_rss_bytes`` and
  ``predicted_peak_bytes``;
- ``events.jsonl``: OOM and recovery events (``step``, ``event`` or ``kind``,
  ``message`` and any numbers);
- the run configuration (``oomless.yaml`` or ``config.json``) and, when the
  run was estimated first, ``estimate.json`` (a MemoryEstimate).

Everything here is torch-free and returns frozen, JSON-serialisable values.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import DataError
from ..fileio import read_json
from ..fileio import read_jsonl as read_jsonl_file
from ..result import MemoryEstimate

MEMLOG_NAMES = ("memlog.jsonl", "memory.jsonl", "steps.jsonl")
EVENT_NAMES = ("events.jsonl",)
CONFIG_NAMES = ("oomless.yaml", "config.yaml", "config.json", "run_config.json")
ESTIMATE_NAMES = ("estimate.json",)
_PER_DEVICE_KEYS = ("allocated_bytes", "reserved_bytes", "peak_bytes")


@dataclass(frozen=True)
class StepRecord:
    """One logged step; byte fields hold one value per GPU (host: one value)."""

    step: int
    allocated_bytes: tuple[int, ...] = ()
    reserved_bytes: tuple[int, ...] = ()
    peak_bytes: tuple[int, ...] = ()
    host_rss_bytes: int | None = None
    simulated_peak_bytes: int | None = None  # CPU runs: tracked tensor bytes (train's budget)
    predicted_peak_bytes: int | None = None
    loss: float | None = None
    lr: float | None = None
    tokens: int | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None


@dataclass(frozen=True)
class RunEvent:
    """An OOM, a recovery (smaller micro batch, offload, ...) or another notable event."""

    step: int | None
    kind: str
    message: str
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def is_routine(self) -> bool:
        """Checkpoints and the like: listed, but not drawn on the memory chart."""
        return self.kind.lower() in {"checkpoint", "save", "eval", "evaluation", "log"}

    @property
    def is_oom(self) -> bool:
        return "oom" in self.kind.lower() or "out of memory" in self.message.lower()


@dataclass(frozen=True)
class ReportData:
    """Everything one report shows."""

    title: str
    source: str
    steps: tuple[StepRecord, ...] = ()
    events: tuple[RunEvent, ...] = ()
    estimate: MemoryEstimate | None = None
    config: dict[str, Any] = field(default_factory=dict)
    gpu_memory_bytes: int | None = None
    notes: tuple[str, ...] = ()  # what the readers skipped (a torn last line)

    @property
    def num_devices(self) -> int:
        return max((len(s.peak_bytes) or len(s.allocated_bytes) for s in self.steps), default=0)

    @property
    def measured_peak_bytes(self) -> int | None:
        """Highest per-GPU peak over all steps (falls back to reserved, allocated, and on
        CPU to the simulated peak of tracked tensors)."""
        values = [
            v for s in self.steps for v in (s.peak_bytes or s.reserved_bytes or s.allocated_bytes)
        ]
        if not values:
            values = [s.simulated_peak_bytes for s in self.steps if s.simulated_peak_bytes]
        return max(values) if values else None

    @property
    def measured_peak_label(self) -> str:
        """What ``measured_peak_bytes`` is: GPU allocator counters, or a CPU simulation."""
        if any(s.peak_bytes or s.reserved_bytes or s.allocated_bytes for s in self.steps):
            return "measured peak"
        return "simulated peak (CPU)"

    @property
    def predicted_peak_bytes(self) -> int | None:
        logged = [s.predicted_peak_bytes for s in self.steps if s.predicted_peak_bytes]
        if logged:
            return logged[-1]
        return self.estimate.peak_allocated_bytes if self.estimate else None

    @property
    def timeline(self) -> list[dict[str, Any]]:
        """The trace timeline (``extra["timeline"]`` of ``oomless trace``), or [].

        Points are objects (index or time_s, allocated_bytes, reserved_bytes,
        phase) or the allocator replay's ``[event index, allocated, reserved]``.
        """
        if self.estimate is None:
            return []
        points = []
        for p in self.estimate.extra.get("timeline") or []:
            if isinstance(p, dict):
                points.append(p)
            elif isinstance(p, list | tuple) and len(p) >= 3:
                points.append({"index": p[0], "allocated_bytes": p[1], "reserved_bytes": p[2]})
        return points

    @property
    def run(self) -> dict[str, Any] | None:
        """The predicted run over the data (``estimate --data/--lengths``), if any."""
        return self.estimate.extra.get("run") if self.estimate else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["estimate"] = self.estimate.to_dict() if self.estimate else None
        return d


# ---- readers ---------------------------------------------------------------
def _per_device(value: Any, where: str, key: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, bool):
        raise DataError(f"{where}: '{key}' is {value!r}; expected bytes (an integer or a list)")
    if isinstance(value, int | float):
        return (int(value),)
    if isinstance(value, list) and all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in value
    ):
        return tuple(int(v) for v in value)
    raise DataError(
        f"{where}: '{key}' is {value!r}; expected bytes as an integer or a list of integers per GPU"
    )


def _optional_number(value: Any, kind: type) -> Any:
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return kind(value)


def parse_step(obj: dict[str, Any], where: str) -> StepRecord:
    """One memory-log line → StepRecord; the step number is required."""
    step = obj.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        raise DataError(f"{where}: missing integer 'step' in {json.dumps(obj)[:120]}")
    per_device = {k: _per_device(obj.get(k), where, k) for k in _PER_DEVICE_KEYS}
    return StepRecord(
        step=step,
        **per_device,
        host_rss_bytes=_optional_number(obj.get("host_rss_bytes", obj.get("rss_bytes")), int),
        simulated_peak_bytes=_optional_number(obj.get("simulated_peak_bytes"), int),
        predicted_peak_bytes=_optional_number(obj.get("predicted_peak_bytes"), int),
        loss=_optional_number(obj.get("loss"), float),
        lr=_optional_number(obj.get("lr"), float),
        tokens=_optional_number(obj.get("tokens"), int),
        step_time_s=_optional_number(obj.get("step_time_s"), float),
        tokens_per_s=_optional_number(obj.get("tokens_per_s"), float),
    )


def parse_event(obj: dict[str, Any]) -> RunEvent:
    kind = str(obj.get("event") or obj.get("kind") or obj.get("type") or "event")
    step = obj.get("step")
    skip = {"event", "kind", "type", "step", "message", "time"}
    data = {k: v for k, v in obj.items() if k not in skip}
    return RunEvent(
        step=step if isinstance(step, int) and not isinstance(step, bool) else None,
        kind=kind,
        message=str(obj.get("message", "")),
        data=data,
    )


def read_jsonl(path: Path, notes: list[str] | None = None) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of every line (fileio.read_jsonl); a torn last line (a crash
    mid-write) is skipped and noted in ``notes``; any other bad line is a DataError."""
    log = read_jsonl_file(path, "memory log", DataError)
    if log.bad:
        raise DataError(f"{log.bad[0]}; each line of a run log is one JSON object"
                        + (f" ({len(log.bad) - 1} more bad lines)" if len(log.bad) > 1 else ""))
    if log.torn_line is not None and notes is not None:
        notes.append(f"{path}:{log.torn_line}: a line torn by an interrupted write was skipped")
    return log.rows


def read_memlog(path: Path, notes: list[str] | None = None) -> tuple[StepRecord, ...]:
    return tuple(parse_step(obj, f"{path}:{n}") for n, obj in read_jsonl(path, notes))


def read_events(path: Path, notes: list[str] | None = None) -> tuple[RunEvent, ...]:
    return tuple(parse_event(obj) for _, obj in read_jsonl(path, notes))


def read_estimate(path: Path) -> MemoryEstimate:
    data = read_json(path, "the output of `oomless estimate --json`", DataError,
                     max_bytes=None)
    if not isinstance(data, dict) or "breakdown" not in data or "peak_phase" not in data:
        raise DataError(f"'{path}' is not a MemoryEstimate; expected the output of "
                        "`oomless estimate --json` or `oomless trace --json`")
    try:
        return MemoryEstimate.from_dict(data)
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        raise DataError(f"'{path}': MemoryEstimate fields do not match ({err})") from None


def read_config(path: Path) -> dict[str, Any]:
    if path.suffix in {".yaml", ".yml"}:
        from ..config import load_yaml_with_lines

        return load_yaml_with_lines(path)[0]
    data = read_json(path, "a run configuration (JSON object)", DataError)
    return data if isinstance(data, dict) else {}


def _first(folder: Path, names: tuple[str, ...]) -> Path | None:
    return next((folder / n for n in names if (folder / n).is_file()), None)


def _gpu_memory(estimate: MemoryEstimate | None, config: dict[str, Any]) -> int | None:
    if estimate and estimate.gpu_memory_bytes:
        return estimate.gpu_memory_bytes
    hardware = config.get("hardware") if isinstance(config, dict) else None
    gpu = hardware.get("gpu") if isinstance(hardware, dict) else None
    if not gpu:
        return None
    from ..errors import UnknownGPUError
    from ..models.hardware import get_gpu

    try:
        return get_gpu(str(gpu)).memory_bytes
    except UnknownGPUError:
        return None


def load_run_dir(folder: Path, estimate_path: Path | None = None) -> ReportData:
    memlog = _first(folder, MEMLOG_NAMES)
    events = _first(folder, EVENT_NAMES)
    estimate_path = estimate_path or _first(folder, ESTIMATE_NAMES)
    if memlog is None and estimate_path is None:
        raise DataError(
            f"'{folder}' has no memory log ({', '.join(MEMLOG_NAMES)}) and no estimate.json; "
            "give the output_dir of an `oomless train` run or an `oomless estimate --json` file"
        )
    estimate = read_estimate(estimate_path) if estimate_path else None
    config_path = _first(folder, CONFIG_NAMES)
    config = read_config(config_path) if config_path else (estimate.config if estimate else {})
    notes: list[str] = []
    return ReportData(
        title=f"oomless run {folder.name}",
        source=str(folder),
        steps=read_memlog(memlog, notes) if memlog else (),
        events=read_events(events, notes) if events else (),
        estimate=estimate,
        config=config,
        gpu_memory_bytes=_gpu_memory(estimate, config),
        notes=tuple(notes),
    )


def report_inputs(source: str | Path, estimate_path: str | Path | None = None) -> tuple[Path, ...]:
    """Every file a report reads (and must never write over)."""
    path = Path(source)
    found = [Path(estimate_path)] if estimate_path else []
    if path.is_dir():
        names = MEMLOG_NAMES + EVENT_NAMES + CONFIG_NAMES + ESTIMATE_NAMES
        found += [path / n for n in names if (path / n).exists()]
    else:
        found.append(path)
    return tuple(found)


def load_report_data(source: str | Path, estimate_path: str | Path | None = None) -> ReportData:
    """A run folder or a MemoryEstimate JSON file → ReportData."""
    path = Path(source)
    extra = Path(estimate_path) if estimate_path else None
    if path.is_dir():
        return load_run_dir(path, extra)
    if not path.exists():
        raise DataError(f"'{path}' does not exist; give a run folder or an estimate JSON file")
    estimate = read_estimate(path)
    return ReportData(
        title=f"oomless estimate: {estimate.model}",
        source=str(path),
        estimate=estimate,
        config=estimate.config,
        gpu_memory_bytes=_gpu_memory(estimate, estimate.config),
    )
