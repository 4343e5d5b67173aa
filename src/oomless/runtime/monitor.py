"""Live GPU memory through NVML (nvidia-ml-py's ``pynvml``): per GPU and per process.

NVML is what nvidia-smi reads: ``used`` is everything on the card (every
process's PyTorch reserved memory, CUDA contexts, other libraries), not just
``torch.cuda.memory_allocated``. Processes that share a launcher (torchrun,
deepspeed, accelerate) form one job; the GPUs of one job should hold about
the same memory, and a large spread is reported (rank 0 evaluating or
gathering a state dict alone, a ``device_map="auto"`` split, a stray process).
"""

from __future__ import annotations

import csv
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import GPUUnavailableError
from ..units import GiB, fmt_bytes

# A spread below this is noise: CUDA context and cuBLAS workspaces differ per
# rank by a few hundred MiB (docs/memory-model.md §7: nvidia-smi =
# reserved + context + libraries), and allocator segments are 2/20 MiB.
UNBALANCED_MIN_BYTES = 1 * GiB
UNBALANCED_FRACTION = 0.10  # of the GPU's total memory
_SHELLS = {"bash", "sh", "zsh", "fish", "dash", "tmux", "screen", "sshd", "init", "systemd"}


@dataclass(frozen=True)
class GPUProcess:
    pid: int
    used_bytes: int | None  # None: NVML does not say (some containers, MIG)
    name: str = ""
    parent_pid: int | None = None
    parent_name: str = ""

    @property
    def job(self) -> str:
        """Processes started by one launcher (not a shell) are one job."""
        if self.parent_pid and self.parent_name and self.parent_name not in _SHELLS:
            return f"{self.parent_name} (pid {self.parent_pid})"
        return f"{self.name or 'process'} (pid {self.pid})"


@dataclass(frozen=True)
class GPUSample:
    index: int
    name: str
    used_bytes: int
    total_bytes: int
    utilization_pct: int | None  # SM busy over the last sample period
    memory_utilization_pct: int | None  # memory controller busy
    processes: tuple[GPUProcess, ...] = ()

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self.used_bytes


@dataclass(frozen=True)
class Snapshot:
    timestamp: float
    gpus: tuple[GPUSample, ...] = field(default_factory=tuple)


# ---- NVML ------------------------------------------------------------------
@contextmanager
def nvml() -> Iterator[object]:
    """pynvml, initialised; GPUUnavailableError without an NVIDIA driver or GPU."""
    try:
        import pynvml
    except ImportError:
        raise GPUUnavailableError(
            "no NVML: nvidia-ml-py is not installed (pip install nvidia-ml-py)"
        ) from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise GPUUnavailableError(
            f"no NVIDIA GPU found (NVML: {err}); this needs an NVIDIA GPU and its driver"
        ) from None
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            raise GPUUnavailableError("no NVIDIA GPU found: the driver reports 0 devices")
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def _proc_name(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:  # another container's pid, or the process just ended
        return ""
    words = [os.path.basename(a.decode(errors="replace")) for a in argv if a][:2]
    if words and words[0].startswith("python") and len(words) > 1:
        return words[1]
    return words[0] if words else ""


def _parent_pid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command may hold spaces and parentheses: fields follow the last ')'
    return int(stat.rsplit(")", 1)[1].split()[1])


def _process(pid: int, used: int | None) -> GPUProcess:
    parent = _parent_pid(pid)
    return GPUProcess(pid=pid, used_bytes=used, name=_proc_name(pid), parent_pid=parent,
                      parent_name=_proc_name(parent) if parent else "")


def _device_processes(nv, handle) -> tuple[GPUProcess, ...]:
    seen: dict[int, int | None] = {}
    for query in (nv.nvmlDeviceGetComputeRunningProcesses,
                  nv.nvmlDeviceGetGraphicsRunningProcesses):
        try:
            entries = query(handle)
        except nv.NVMLError_NotSupported:
            continue
        for entry in entries:
            used = entry.usedGpuMemory
            seen[entry.pid] = used if isinstance(used, int) and used >= 0 else None
    return tuple(_process(pid, used) for pid, used in sorted(seen.items()))


def _utilization(nv, handle) -> tuple[int | None, int | None]:
    try:
        rates = nv.nvmlDeviceGetUtilizationRates(handle)
    except nv.NVMLError:  # MIG instances and some vGPUs do not report it
        return None, None
    return int(rates.gpu), int(rates.memory)


def sample_gpus(nv) -> Snapshot:
    """One reading of every GPU (``nv`` from :func:`nvml`)."""
    gpus = []
    for index in range(nv.nvmlDeviceGetCount()):
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        memory = nv.nvmlDeviceGetMemoryInfo(handle)
        name = nv.nvmlDeviceGetName(handle)
        gpu_util, mem_util = _utilization(nv, handle)
        gpus.append(GPUSample(
            index=index, name=name.decode() if isinstance(name, bytes) else str(name),
            used_bytes=int(memory.used), total_bytes=int(memory.total),
            utilization_pct=gpu_util, memory_utilization_pct=mem_util,
            processes=_device_processes(nv, handle),
        ))
    return Snapshot(timestamp=time.time(), gpus=tuple(gpus))


# ---- analysis ----------------------------------------------------------------
def job_memory(snapshot: Snapshot) -> dict[str, dict[int, int]]:
    """{job: {gpu index: bytes}} for jobs whose processes report their memory."""
    jobs: dict[str, dict[int, int]] = {}
    for gpu in snapshot.gpus:
        for proc in gpu.processes:
            if proc.used_bytes is None:
                continue
            per_gpu = jobs.setdefault(proc.job, {})
            per_gpu[gpu.index] = per_gpu.get(gpu.index, 0) + proc.used_bytes
    return jobs


def imbalance_warnings(snapshot: Snapshot, fraction: float = UNBALANCED_FRACTION,
                       min_bytes: int = UNBALANCED_MIN_BYTES) -> list[str]:
    """One line per job whose GPUs differ by more than ``fraction`` of a GPU (≥ min_bytes)."""
    totals = {g.index: g.total_bytes for g in snapshot.gpus}
    warnings = []
    for job, per_gpu in sorted(job_memory(snapshot).items()):
        if len(per_gpu) < 2:
            continue
        high = max(per_gpu, key=per_gpu.__getitem__)
        low = min(per_gpu, key=per_gpu.__getitem__)
        spread = per_gpu[high] - per_gpu[low]
        limit = max(min_bytes, int(fraction * min(totals[i] for i in per_gpu)))
        if spread > limit:
            warnings.append(
                f"unbalanced job {job}: GPU {high} holds {fmt_bytes(per_gpu[high])}, GPU {low} "
                f"{fmt_bytes(per_gpu[low])} ({fmt_bytes(spread)} apart over {len(per_gpu)} "
                "GPUs); the fullest GPU OOMs first: look for work only one rank does "
                "(evaluation, logging, saving a gathered state dict) or an uneven device_map"
            )
    return warnings


# ---- CSV log -----------------------------------------------------------------
CSV_FIELDS = ("timestamp", "gpu", "name", "used_bytes", "total_bytes", "utilization_pct",
              "memory_utilization_pct", "processes")


def csv_rows(snapshot: Snapshot) -> list[dict[str, object]]:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(snapshot.timestamp))
    return [{
        "timestamp": stamp, "gpu": g.index, "name": g.name, "used_bytes": g.used_bytes,
        "total_bytes": g.total_bytes, "utilization_pct": g.utilization_pct,
        "memory_utilization_pct": g.memory_utilization_pct,
        "processes": " ".join(f"{p.pid}:{'' if p.used_bytes is None else p.used_bytes}"
                              for p in g.processes),
    } for g in snapshot.gpus]


class CsvLog:
    """Appends one row per GPU and sample; each sample is flushed to disk."""

    def __init__(self, path: str | Path):
        from ..errors import OutputError
        from ..fileio import check_output_file, cut_torn_tail, open_append

        self.path = check_output_file(path)
        new = not self.path.exists() or self.path.stat().st_size == 0
        if not new:
            with open(self.path, encoding="utf-8", errors="replace", newline="") as fh:
                header = fh.readline().rstrip("\r\n")
            if header != ",".join(CSV_FIELDS):
                raise OutputError(f"--csv '{self.path}' exists and is not a monitor log (its "
                                  "first line is not our header); oomless appends only to "
                                  "its own logs: choose another file")
            cut_torn_tail(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open_append(self.path)
        self._writer = csv.DictWriter(self._fh, fieldnames=CSV_FIELDS)
        if new:
            self._writer.writeheader()

    def write(self, snapshot: Snapshot) -> None:
        self._writer.writerows(csv_rows(snapshot))
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()
