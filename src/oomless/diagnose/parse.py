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
  cuBLAS "CUBLAS_STATUS_ALLOC_FAILED"; PyTorch ≤ 0.4's THC "cuda runtime error (2) :
  out of memory".
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
from .sizes import NUM, group_bytes, size
from .text import LogText, scan, squeeze

_S = r"\s+"
_EXC = r"(?:[\w.]*(?:Error|Exception)\s*:\s*)?"
_DEVICE_WORD = r"(?:CUDA|HIP|XPU|MUSA|NPU|MLU|DPCPP)?\s?"


def _sizer(s: str):
    """size() for the strict patterns (words separated by whitespace) or the relaxed
    ones (``s`` = \\s*, lines joined without breaks)."""
    return lambda name: size(name, strict=s == _S)


def torch2_pattern(s: str) -> re.Pattern[str]:
    sz = _sizer(s)
    return re.compile(
        rf"{_DEVICE_WORD}[Oo]ut{s}of{s}memory\.(?:{s}Tried{s}to{s}allocate{s}{sz('req')}\.)?"
        rf"{s}GPU\s?(?P<dev>\d+)?\s*has{s}a{s}total{s}capac(?:i)?ty{s}of{s}{sz('total')}"
        rf"{s}of{s}which{s}{sz('free')}{s}is{s}free\."
        rf"(?P<procs>(?:{s}(?:Process{s}\d+|Including{s}non-PyTorch{s}memory,{s}this{s}process)"
        rf"{s}has{s}{NUM}\s*(?:bytes|byte|[KMGT]i?B|B){s}memory{s}in{s}use\.)*)"
        rf"(?:{s}{sz('allowed')}{s}allowed;)?"
        rf"(?:{s}Of{s}the{s}allocated{s}memory{s}{sz('alloc')}{s}is{s}allocated{s}by{s}PyTorch,"
        rf"(?:{s}with{s}{sz('private')}{s}allocated{s}in{s}private{s}pools(?:{s}\([^)]{{0,40}}\))?,)?"
        rf"{s}and{s}{sz('unalloc')}{s}is{s}reserved{s}by{s}PyTorch{s}but{s}unallocated\.)?"
    )


def torch1_pattern(s: str) -> re.Pattern[str]:
    sz = _sizer(s)
    return re.compile(
        rf"{_DEVICE_WORD}out{s}of{s}memory\.{s}Tried{s}to{s}allocate{s}{sz('req')}"
        rf"{s}\((?:GPU|NPU)\s*(?P<dev>\d+)?;{s}{sz('total')}{s}total{s}capacity;"
        rf"{s}{sz('alloc')}{s}already{s}allocated;"
        rf"(?:{s}{sz('active')}{s}current{s}active;)?"
        rf"(?:{s}{sz('free')}{s}free;)?"
        rf"(?:{s}{sz('allowed')}{s}allowed;)?"
        rf"{s}{sz('reserved')}{s}(?P<word>reserved{s}in{s}total{s}by{s}PyTorch|cached)\)"
    )


def malloc_async_pattern(s: str) -> re.Pattern[str]:
    sz = _sizer(s)
    return re.compile(
        rf"Allocation{s}on{s}device{s}(?P<dev>\d+){s}would{s}exceed{s}allowed{s}memory\.{s}"
        rf"\(out{s}of{s}memory\)"
        rf"(?:{s}Currently{s}allocated\s*:\s*{sz('alloc')})?"
        rf"(?:{s}Requested\s*:\s*{sz('req')})?"
        rf"(?:{s}Device{s}limit\s*:\s*{sz('total')})?"
        rf"(?:{s}Free{s}\(according{s}to{s}CUDA\)\s*:\s*{sz('free')})?"
    )


def bare_torch_pattern(s: str) -> re.Pattern[str]:
    """'CUDA out of memory.' anywhere on a line (not inside quotes: code that tests for it)."""
    return re.compile(rf"(?m)(?<![\"'\w])(?:CUDA|HIP){s}out{s}of{s}memory(?:\.|\s*$)")


_PROC = re.compile(
    rf"(?:Process\s*(?P<pid>\d+)|(?P<self>Including\s*non-PyTorch\s*memory,\s*this\s*process))"
    rf"\s*has\s*{size('mem')}\s*memory\s*in\s*use"
)
TORCH2 = torch2_pattern(_S)
TORCH1 = torch1_pattern(_S)
MALLOC_ASYNC = malloc_async_pattern(_S)
# A bare "CUDA out of memory." that the patterns above did not read (truncated, re-raised).
BARE_TORCH = bare_torch_pattern(_S)
# The numbers a cut-off message still holds, each on its own
_PARTIAL = (
    ("requested_bytes", re.compile(rf"Tried{_S}to{_S}allocate{_S}{size('v')}")),
    ("total_bytes", re.compile(rf"total{_S}capac(?:i)?ty{_S}of{_S}{size('v')}")),
    ("total_bytes", re.compile(rf"{size('v')}{_S}total{_S}capacity")),
    ("free_bytes", re.compile(rf"of{_S}which{_S}{size('v')}{_S}is{_S}free")),
    ("free_bytes", re.compile(rf"{size('v')}{_S}free;")),
)
_PARTIAL_DEVICE = re.compile(r"(?:GPU|NPU)\s?(\d+)")
CUDA_ERROR = re.compile(
    rf"(?im)(?:^|(?<=[\s:]))(?<![\"'])(?:CUDA|HIP|CUDA{_S}driver){_S}error:{_S}out{_S}of{_S}memory"
    r"|CUBLAS_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation"
    # PyTorch ≤ 0.4 (THC): "cuda runtime error (2) : out of memory at …/THCStorage.cu:65"
    rf"|cuda{_S}runtime{_S}error{_S}\(2\){_S}:{_S}out{_S}of{_S}memory"
)
BNB = re.compile(r"Error out of memory at line (?P<line>\d+) in file (?P<file>\S+)")
NCCL_WARN = re.compile(
    r"(?:\[(?P<dev>\d+)\][^\n]{0,200}?)?NCCL WARN (?:Cuda failure (?:\d+ )?'?out of memory'?"
    r"|Failed to CUDA calloc (?P<calloc>\d+)(?: / \d+)? bytes)"
)
NCCL_UNHANDLED = re.compile(r"ncclUnhandledCudaError(?P<tail>(?:[^\n]*\n?){0,4})")


Fields = tuple[str, str, dict]  # (kind, source, OomEvent keyword arguments)


def _oom_event(log: LogText, match: re.Match[str], fields: Fields) -> OomEvent:
    kind, source, extra = fields
    text = match.group(0)
    # the line where the message's text starts (a pattern may begin with whitespace,
    # e.g. the line break before an "out of memory" that lost its device word)
    index = log.line_index(match.start() + len(text) - len(text.lstrip()))
    return OomEvent(kind=kind, source=source, line=index + 1, message=squeeze(match.group(0)),
                    rank=log.rank_at(index), **extra)


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


def torch2_fields(m: re.Match[str], _text: str = "") -> Fields:
    numbers = _numbers(m, {
        "req": "requested_bytes", "total": "total_bytes", "free": "free_bytes",
        "allowed": "allowed_bytes", "alloc": "allocated_bytes",
        "private": "private_pool_bytes", "unalloc": "reserved_unallocated_bytes",
    })
    procs = _processes(m.group("procs") or "")
    if "allocated_bytes" in numbers and "reserved_unallocated_bytes" in numbers:
        numbers["reserved_bytes"] = numbers["allocated_bytes"] + numbers["reserved_unallocated_bytes"]
    return CUDA_OOM, "pytorch-2.x", {"device": _device(m), "numbers": numbers, "processes": procs}


def torch1_fields(m: re.Match[str], _text: str = "") -> Fields:
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
    return CUDA_OOM, "pytorch-1.x", {"device": _device(m), "numbers": numbers}


def malloc_async_fields(m: re.Match[str], _text: str = "") -> Fields:
    numbers = _numbers(m, {
        "alloc": "allocated_bytes", "req": "requested_bytes",
        "total": "total_bytes", "free": "free_bytes",
    })
    return CUDA_OOM, "cuda-malloc-async", {"device": _device(m), "numbers": numbers}


def _bnb(m: re.Match[str], _text: str) -> Fields:
    return BNB_OOM, "bitsandbytes", {"numbers": {"source_line": int(m.group("line"))}}


def _nccl_warn(m: re.Match[str], _text: str) -> Fields:
    numbers: dict[str, int | float] = {}
    if m.group("calloc"):
        numbers["requested_bytes"] = int(m.group("calloc"))
    return NCCL_OOM, "nccl", {"device": _device(m), "numbers": numbers}


def _nccl_unhandled(m: re.Match[str], _text: str) -> Fields:
    stated = 1 if "out of memory" in (m.group("tail") or "") else 0
    return NCCL_OOM, "torch-nccl", {"numbers": {"oom_stated": stated}}


def _cuda_error(m: re.Match[str], text: str) -> Fields:
    tail = text[m.start(): m.start() + 300]
    # vLLM's CuMemAllocator (sleep mode, RL colocation) allocates outside torch's allocator
    library = {"library": "vllm"} if "cumem_allocator" in tail else {}
    return CUDA_ERROR_OOM, "cuda", library


def partial_numbers(text: str) -> tuple[dict[str, int | float], int | None]:
    """The sizes a cut-off or re-worded message still holds ('Tried to allocate 6.56 GiB')."""
    numbers: dict[str, int | float] = {}
    for key, pattern in _PARTIAL:
        m = pattern.search(text)
        if m and key not in numbers:
            numbers[key] = group_bytes(m, "v") or 0
    dev = _PARTIAL_DEVICE.search(text)
    return numbers, int(dev.group(1)) if dev else None


def bare_fields(m: re.Match[str], text: str) -> Fields:
    numbers, device = partial_numbers(text[m.start(): m.start() + 400].split("\n\n", 1)[0])
    return CUDA_OOM, "pytorch", {"numbers": numbers, "device": device}


# Specific patterns first: a span they read is not read again by the generic ones.
# Each runs only when one of its words is in the text (long logs rarely hold any).
_SPECIFIC = (
    (TORCH2, torch2_fields, ("capac",)), (TORCH1, torch1_fields, ("capacity",)),
    (MALLOC_ASYNC, malloc_async_fields, ("exceed",)), (BNB, _bnb, ("Error out of memory",)),
)
_GENERIC = (
    (NCCL_WARN, _nccl_warn, ("NCCL WARN",)), (NCCL_UNHANDLED, _nccl_unhandled, ("ncclUnhandled",)),
    (CUDA_ERROR, _cuda_error, ("rror", "CUBLAS_STATUS_ALLOC_FAILED", "cudaErrorMemoryAllocation")),
    (BARE_TORCH, bare_fields, ("out of memory",)),
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
            yield _oom_event(log, m, build(m, log.text))
    read = _Spans(spans)
    for pattern, build, words in _GENERIC:
        for m in scan(pattern, log.text, words):
            if m.start() not in read and m.end() - 1 not in read:
                yield _oom_event(log, m, build(m, log.text))

