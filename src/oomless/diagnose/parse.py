"""Find GPU out-of-memory messages and read their numbers.

Message formats, with where they are written:

- PyTorch 2.1+ (c10/cuda/CUDACachingAllocator.cpp, ``malloc``): "CUDA out of
  memory. Tried to allocate X. GPU d has a total capacity of T of which F is
  free. [Process p has M memory in use. …] [Including non-PyTorch memory, this
  process has M memory in use.] [A allowed;] Of the allocated memory A is
  allocated by PyTorch, [with P allocated in private pools (e.g., CUDA
  Graphs),] and U is reserved by PyTorch but unallocated." 2.1 spells
  "capacty"; a DeviceIndex printed as a char gives "GPU  has".
- PyTorch 1.x: "Tried to allocate X (GPU d; T total capacity; A already
  allocated; F free; [L allowed;] R reserved in total by PyTorch)"; before 1.5
  "R cached)"; Ascend NPU adds "C current active;".
- cudaMallocAsync backend (c10/cuda/CUDAMallocAsyncAllocator.cpp):
  "Allocation on device d would exceed allowed memory. (out of memory)" and
  "Currently allocated / Requested / Device limit / Free (according to CUDA)".
- "CUDA error: out of memory" (any CUDA call outside the caching allocator),
  cuBLAS "CUBLAS_STATUS_ALLOC_FAILED".
- bitsandbytes' CUDA_CHECK_RETURN: "Error out of memory at line N in file F".
- NCCL (src/include/alloc.h): "NCCL WARN Cuda failure 'out of memory'",
  "Failed to CUDA calloc N bytes"; torch: "ncclUnhandledCudaError".
- vLLM: see :mod:`oomless.diagnose.vllm`; host memory: :mod:`.host`.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterator

from .events import BNB_OOM, CUDA_ERROR_OOM, CUDA_OOM, NCCL_OOM, OomEvent, ProcessMemory
from .sizes import ANY_SIZE, group_bytes, size
from .text import LogText, scan, squeeze

_S = r"\s+"
_EXC = r"(?:[\w.]*(?:Error|Exception)\s*:\s*)?"
_DEVICE_WORD = r"(?:CUDA|HIP|XPU|MUSA|NPU|MLU|DPCPP)?\s?"

TORCH2 = re.compile(
    rf"{_DEVICE_WORD}[Oo]ut{_S}of{_S}memory\.(?:{_S}Tried{_S}to{_S}allocate{_S}{size('req')}\.)?"
    rf"{_S}GPU\s?(?P<dev>\d+)?\s*has{_S}a{_S}total{_S}capac(?:i)?ty{_S}of{_S}{size('total')}"
    rf"{_S}of{_S}which{_S}{size('free')}{_S}is{_S}free\."
    rf"(?P<procs>(?:{_S}(?:Process{_S}\d+|Including{_S}non-PyTorch{_S}memory,{_S}this{_S}process)"
    rf"{_S}has{_S}{ANY_SIZE}{_S}memory{_S}in{_S}use\.)*)"
    rf"(?:{_S}{size('allowed')}{_S}allowed;)?"
    rf"(?:{_S}Of{_S}the{_S}allocated{_S}memory{_S}{size('alloc')}{_S}is{_S}allocated{_S}by{_S}PyTorch,"
    rf"(?:{_S}with{_S}{size('private')}{_S}allocated{_S}in{_S}private{_S}pools(?:{_S}\([^)]{{0,40}}\))?,)?"
    rf"{_S}and{_S}{size('unalloc')}{_S}is{_S}reserved{_S}by{_S}PyTorch{_S}but{_S}unallocated\.)?"
)
_PROC = re.compile(
    rf"(?:Process{_S}(?P<pid>\d+)|(?P<self>Including{_S}non-PyTorch{_S}memory,{_S}this{_S}process))"
    rf"{_S}has{_S}{size('mem')}{_S}memory{_S}in{_S}use"
)
TORCH1 = re.compile(
    rf"{_DEVICE_WORD}out{_S}of{_S}memory\.{_S}Tried{_S}to{_S}allocate{_S}{size('req')}"
    rf"{_S}\((?:GPU|NPU)\s*(?P<dev>\d+)?;{_S}{size('total')}{_S}total{_S}capacity;"
    rf"{_S}{size('alloc')}{_S}already{_S}allocated;"
    rf"(?:{_S}{size('active')}{_S}current{_S}active;)?"
    rf"(?:{_S}{size('free')}{_S}free;)?"
    rf"(?:{_S}{size('allowed')}{_S}allowed;)?"
    rf"{_S}{size('reserved')}{_S}(?P<word>reserved{_S}in{_S}total{_S}by{_S}PyTorch|cached)\)"
)
MALLOC_ASYNC = re.compile(
    rf"Allocation{_S}on{_S}device{_S}(?P<dev>\d+){_S}would{_S}exceed{_S}allowed{_S}memory\.{_S}\(out{_S}of{_S}memory\)"
    rf"(?:{_S}Currently{_S}allocated\s*:\s*{size('alloc')})?"
    rf"(?:{_S}Requested\s*:\s*{size('req')})?"
    rf"(?:{_S}Device{_S}limit\s*:\s*{size('total')})?"
    rf"(?:{_S}Free{_S}\(according{_S}to{_S}CUDA\)\s*:\s*{size('free')})?"
)
# A bare "CUDA out of memory." that the patterns above did not read (truncated, re-raised).
BARE_TORCH = re.compile(rf"(?m)^\s*{_EXC}(?:CUDA|HIP){_S}out{_S}of{_S}memory\b")
CUDA_ERROR = re.compile(
    rf"(?m)^\s*{_EXC}(?:CUDA|HIP|CUDA{_S}driver){_S}error:{_S}out{_S}of{_S}memory"
    r"|CUBLAS_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation"
)
BNB = re.compile(r"Error out of memory at line (?P<line>\d+) in file (?P<file>\S+)")
NCCL_WARN = re.compile(
    r"(?:\[(?P<dev>\d+)\][^\n]{0,200}?)?NCCL WARN (?:Cuda failure (?:\d+ )?'?out of memory'?"
    r"|Failed to CUDA calloc (?P<calloc>\d+)(?: / \d+)? bytes)"
)
NCCL_UNHANDLED = re.compile(r"ncclUnhandledCudaError(?P<tail>(?:[^\n]*\n?){0,4})")


def _oom_event(log: LogText, match: re.Match[str], kind: str, source: str, **fields) -> OomEvent:
    index = log.line_index(match.start())
    return OomEvent(
        kind=kind,
        source=source,
        line=index + 1,
        message=squeeze(match.group(0)),
        rank=log.rank_at(index),
        **fields,
    )


def _processes(block: str) -> tuple[ProcessMemory, ...]:
    out = []
    for m in _PROC.finditer(block):
        pid = int(m.group("pid")) if m.group("pid") else None
        out.append(ProcessMemory(pid, group_bytes(m, "mem") or 0, m.group("self") is not None))
    return tuple(out)


def _device(match: re.Match[str]) -> int | None:
    dev = match.group("dev")
    return int(dev) if dev else None


def _numbers(match: re.Match[str], names: dict[str, str]) -> dict[str, int | float]:
    out: dict[str, int | float] = {}
    for group, key in names.items():
        value = group_bytes(match, group)
        if value is not None:
            out[key] = value
    return out


def _torch2(log: LogText, m: re.Match[str]) -> OomEvent:
    numbers = _numbers(m, {
        "req": "requested_bytes", "total": "total_bytes", "free": "free_bytes",
        "allowed": "allowed_bytes", "alloc": "allocated_bytes",
        "private": "private_pool_bytes", "unalloc": "reserved_unallocated_bytes",
    })
    procs = _processes(m.group("procs") or "")
    if "allocated_bytes" in numbers and "reserved_unallocated_bytes" in numbers:
        numbers["reserved_bytes"] = numbers["allocated_bytes"] + numbers["reserved_unallocated_bytes"]
    return _oom_event(log, m, CUDA_OOM, "pytorch-2.x", device=_device(m), numbers=numbers, processes=procs)


def _torch1(log: LogText, m: re.Match[str]) -> OomEvent:
    numbers = _numbers(m, {
        "req": "requested_bytes", "total": "total_bytes", "alloc": "allocated_bytes",
        "free": "free_bytes", "allowed": "allowed_bytes", "reserved": "reserved_bytes",
    })
    if "reserved_bytes" in numbers and "allocated_bytes" in numbers:
        unalloc = numbers["reserved_bytes"] - numbers["allocated_bytes"]
        if m.group("word") == "cached":  # before 1.5 "cached" meant reserved minus allocated
            unalloc = numbers["reserved_bytes"]
            numbers["reserved_bytes"] = numbers["allocated_bytes"] + unalloc
        numbers["reserved_unallocated_bytes"] = max(0, unalloc)
    return _oom_event(log, m, CUDA_OOM, "pytorch-1.x", device=_device(m), numbers=numbers)


def _malloc_async(log: LogText, m: re.Match[str]) -> OomEvent:
    numbers = _numbers(m, {
        "alloc": "allocated_bytes", "req": "requested_bytes",
        "total": "total_bytes", "free": "free_bytes",
    })
    return _oom_event(log, m, CUDA_OOM, "cuda-malloc-async", device=_device(m), numbers=numbers)


def _bnb(log: LogText, m: re.Match[str]) -> OomEvent:
    return _oom_event(log, m, BNB_OOM, "bitsandbytes", numbers={"source_line": int(m.group("line"))})


def _nccl_warn(log: LogText, m: re.Match[str]) -> OomEvent:
    numbers: dict[str, int | float] = {}
    if m.group("calloc"):
        numbers["requested_bytes"] = int(m.group("calloc"))
    return _oom_event(log, m, NCCL_OOM, "nccl", device=_device(m), numbers=numbers)


def _nccl_unhandled(log: LogText, m: re.Match[str]) -> OomEvent:
    tail = m.group("tail") or ""
    stated = 1 if "out of memory" in tail else 0
    return _oom_event(log, m, NCCL_OOM, "torch-nccl", numbers={"oom_stated": stated})


def _cuda_error(log: LogText, m: re.Match[str]) -> OomEvent:
    return _oom_event(log, m, CUDA_ERROR_OOM, "cuda")


def _bare(log: LogText, m: re.Match[str]) -> OomEvent:
    return _oom_event(log, m, CUDA_OOM, "pytorch")


# Specific patterns first: a span they read is not read again by the generic ones.
# Each runs only when one of its words is in the text (long logs rarely hold any).
_SPECIFIC = (
    (TORCH2, _torch2, ("capac",)), (TORCH1, _torch1, ("capacity",)),
    (MALLOC_ASYNC, _malloc_async, ("exceed",)), (BNB, _bnb, ("Error out of memory",)),
)
_GENERIC = (
    (NCCL_WARN, _nccl_warn, ("NCCL WARN",)), (NCCL_UNHANDLED, _nccl_unhandled, ("ncclUnhandled",)),
    (CUDA_ERROR, _cuda_error, ("error", "CUBLAS_STATUS_ALLOC_FAILED", "cudaErrorMemoryAllocation")),
    (BARE_TORCH, _bare, ("out of memory",)),
)


class _Spans:
    """Character ranges already read, merged, for O(log n) membership tests."""

    def __init__(self, spans: list[tuple[int, int]]) -> None:
        merged: list[tuple[int, int]] = []
        for start, end in sorted(spans):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        self.starts = [s for s, _ in merged]
        self.ends = [e for _, e in merged]

    def __contains__(self, pos: int) -> bool:
        i = bisect.bisect_right(self.starts, pos) - 1
        return i >= 0 and pos < self.ends[i]


def find_gpu_events(log: LogText) -> Iterator[OomEvent]:
    """Every GPU out-of-memory message of the log, in no particular order."""
    spans: list[tuple[int, int]] = []
    for pattern, build, words in _SPECIFIC:
        for m in scan(pattern, log.text, words):
            spans.append((m.start(), max(m.end(), m.start() + 1)))
            yield build(log, m)
    read = _Spans(spans)
    for pattern, build, words in _GENERIC:
        for m in scan(pattern, log.text, words):
            if m.start() not in read and m.end() - 1 not in read:
                yield build(log, m)

