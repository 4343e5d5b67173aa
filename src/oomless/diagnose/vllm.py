"""vLLM's start-up memory failures and its memory-profiling log lines.

Messages (vllm/v1/core/kv_cache_utils.py ``check_enough_kv_cache_memory``,
vllm/worker/worker.py and vllm/v1/worker/gpu_worker.py, vllm/utils ``MemorySnapshot``):

- "No available memory for the cache blocks. Try increasing
  `gpu_memory_utilization` when initializing the engine."
- "The model's max seq len (N) is larger than the maximum number of tokens
  that can be stored in KV cache (M)." (V0)
- "To serve at least one request with the model's max seq len (N), (X GiB
  KV cache is needed, which is larger than the available KV cache memory
  (Y GiB). Based on the available memory, the estimated maximum model length
  is M." (V1; older releases write "models's")
- "Free memory on device [cuda:0] (F/T GiB) on startup is less than desired
  GPU memory utilization (u, B GiB)."

A failure whose final line is missing from the log (pasted fragments) is still
read from what vLLM printed before it: "the rest of the memory reserved for
KV Cache is -1.05GiB", "# cuda blocks: 0" / "# GPU blocks: 0", "Maximum
concurrency for N tokens per request: 0.00x", "Available KV cache memory: -X
GiB", or a traceback through ``raise_if_cache_size_invalid`` (or V0's "Error
executing method initialize_cache") after "# GPU
blocks: N" (N > 0: max_model_len is longer than N × 16 tokens, vLLM's default
block size).

Profiling lines read as context: "the current vLLM instance can use
total_gpu_memory (T GiB) x gpu_memory_utilization (u) = B GiB", "model
weights take W GiB; non_torch_memory takes N GiB; PyTorch activation peak
memory takes A GiB; the rest of the memory reserved for KV Cache is K GiB",
"Available KV cache memory: K GiB", "Loading model weights took W GB" (vLLM
divides by 2**30 there, so GB is read as GiB).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace

from .events import VLLM_FREE_MEMORY, VLLM_MAX_LEN, VLLM_NO_KV, VLLM_SAMPLER, OomEvent
from .sizes import NUM, group_bytes, size, to_bytes
from .text import LogText, scan, squeeze

_S = r"\s+"
_GIB = 1024**3

NO_KV = re.compile(rf"No{_S}available{_S}memory{_S}for{_S}the{_S}cache{_S}blocks")
MAX_LEN_V0 = re.compile(
    rf"max{_S}seq{_S}len{_S}\((?P<len>\d+)\){_S}is{_S}larger{_S}than{_S}the{_S}maximum{_S}number"
    rf"{_S}of{_S}tokens{_S}that{_S}can{_S}be{_S}stored{_S}in{_S}KV{_S}cache{_S}\((?P<tokens>\d+)\)"
)
MAX_LEN_V1 = re.compile(
    rf"To{_S}serve{_S}at{_S}least{_S}one{_S}request{_S}with{_S}the{_S}models?'s{_S}max{_S}seq{_S}len"
    rf"{_S}\((?P<len>\d+)\),?{_S}\(?{size('need')}{_S}KV{_S}cache{_S}is{_S}needed,{_S}which{_S}is"
    rf"{_S}larger{_S}than{_S}the{_S}available{_S}KV{_S}cache{_S}memory{_S}\({size('avail')}\)\.?"
    rf"(?:{_S}Based{_S}on{_S}the{_S}available{_S}memory,{_S}the{_S}estimated{_S}maximum{_S}model"
    rf"{_S}length{_S}is{_S}(?P<est>\d+))?"
)
MAX_LEN_DEV = re.compile(
    rf"KV{_S}cache{_S}needed{_S}\((?P<need>{NUM}){_S}GB\){_S}to{_S}store{_S}one{_S}request{_S}with"
    rf"{_S}the{_S}models?'s{_S}max{_S}seq{_S}len{_S}\((?P<len>\d+)\){_S}is{_S}larger{_S}than{_S}the"
    rf"{_S}available{_S}KV{_S}Cache{_S}memory{_S}\((?P<avail>{NUM}){_S}GB\)"
)
FREE_MEMORY = re.compile(
    rf"Free{_S}memory{_S}on{_S}device(?:{_S}[\w:]+)?{_S}\((?P<free>{NUM})/(?P<total>{NUM}){_S}GiB\)"
    rf"{_S}on{_S}startup{_S}is{_S}less{_S}than{_S}desired{_S}GPU{_S}memory{_S}utilization"
    rf"{_S}\((?P<util>{NUM}),{_S}(?P<want>{NUM}){_S}GiB\)"
)

_BUDGET = re.compile(
    rf"total_gpu_memory\s*\((?P<total>{NUM})\s*GiB\)\s*x\s*gpu_memory_utilization"
    rf"\s*\((?P<util>{NUM})\)\s*=\s*(?P<budget>{NUM})\s*GiB"
)
_SPLIT = re.compile(
    rf"model{_S}weights{_S}take{_S}(?P<weights>-?{NUM})\s*GiB;{_S}non_torch_memory{_S}takes"
    rf"{_S}(?P<non_torch>-?{NUM})\s*GiB;{_S}PyTorch{_S}activation{_S}peak{_S}memory{_S}takes"
    rf"{_S}(?P<activation>-?{NUM})\s*GiB;{_S}the{_S}rest{_S}of{_S}the{_S}memory{_S}reserved{_S}for"
    rf"{_S}KV{_S}Cache{_S}is{_S}(?P<kv>-?{NUM})\s*GiB"
)
_AVAILABLE_KV = re.compile(rf"Available{_S}KV{_S}cache{_S}memory:\s*(?P<kv>-?{NUM})\s*GiB")
_WEIGHTS_TOOK = re.compile(rf"(?:Loading{_S}model{_S}weights|Model{_S}loading){_S}took{_S}(?P<weights>{NUM})\s*G(?:i)?B")
_KV_TOKENS = re.compile(rf"GPU{_S}KV{_S}cache{_S}size:\s*(?P<tokens>[\d,]+){_S}tokens")


_BLOCKS = re.compile(r"#\s*(?:cuda|GPU)\s+blocks:\s*(?P<blocks>\d+)")
_CONCURRENCY = re.compile(rf"Maximum{_S}concurrency{_S}for{_S}(?P<len>\d+){_S}tokens{_S}per"
                          rf"{_S}request:\s*(?P<x>{NUM})x")
# vLLM V0: worker.initialize_cache → raise_if_cache_size_invalid raises one of the two
# KV-cache errors; a fragment may show only the call or the executor's error line
# vLLM V1 gpu_model_runner.py _dummy_sampler_run re-raises the sampler's torch OOM as
# RuntimeError("CUDA out of memory occurred when warming up sampler with N dummy requests.
# Please try lowering `max_num_seqs` or `gpu_memory_utilization` when initializing the engine.")
SAMPLER = re.compile(rf"CUDA{_S}out{_S}of{_S}memory{_S}occurred{_S}when{_S}warming{_S}up{_S}"
                     rf"sampler(?:{_S}with{_S}(?P<n>\d+){_S}dummy{_S}requests)?")
_CACHE_CHECK = re.compile(r"raise_if_cache_size_invalid|Error executing method initialize_cache")
VLLM_BLOCK_SIZE = 16  # vLLM's default KV block size (tokens)
_FRAGMENT_WINDOW = 60  # lines: the final error of a start-up failure follows its profile


def _gib(text: str) -> int:
    return int(round(float(text) * _GIB))


def _event(log: LogText, m: re.Match[str], kind: str, numbers: dict) -> OomEvent:
    index = log.line_index(m.start())
    return OomEvent(kind=kind, source="vllm", line=index + 1, message=squeeze(m.group(0)),
                    rank=log.rank_at(index), numbers=numbers, phase="vllm_startup")


def find_vllm_events(log: LogText) -> Iterator[OomEvent]:
    text = log.text
    for m in scan(NO_KV, text, ("cache blocks", "cache\nblocks")):
        yield _event(log, m, VLLM_NO_KV, {})
    for m in scan(MAX_LEN_V0, text, ("stored in KV cache",), before=600):
        yield _event(log, m, VLLM_MAX_LEN, {"max_model_len": int(m.group("len")),
                                            "kv_cache_tokens": int(m.group("tokens"))})
    for m in scan(MAX_LEN_V1, text, ("To serve at least one request",)):
        numbers: dict[str, int | float] = {"max_model_len": int(m.group("len"))}
        numbers["kv_needed_bytes"] = group_bytes(m, "need") or 0
        numbers["kv_available_bytes"] = group_bytes(m, "avail") or 0
        if m.group("est"):
            numbers["estimated_max_model_len"] = int(m.group("est"))
        yield _event(log, m, VLLM_MAX_LEN, numbers)
    for m in scan(MAX_LEN_DEV, text, ("KV cache needed",)):
        yield _event(log, m, VLLM_MAX_LEN, {  # this message divides by 1024**3 and says GB
            "max_model_len": int(m.group("len")),
            "kv_needed_bytes": to_bytes(m.group("need"), "GB", binary_gb=True),
            "kv_available_bytes": to_bytes(m.group("avail"), "GB", binary_gb=True),
        })
    for m in scan(SAMPLER, text, ("warming up sampler", "warming up\nsampler")):
        numbers = {"dummy_requests": int(m.group("n"))} if m.group("n") else {}
        yield replace(_event(log, m, VLLM_SAMPLER, numbers), phase="vllm_sampler_warmup",
                      library="vllm")
    for m in scan(FREE_MEMORY, text, ("Free memory on device",)):
        yield _event(log, m, VLLM_FREE_MEMORY, {
            "free_bytes": _gib(m.group("free")), "total_bytes": _gib(m.group("total")),
            "gpu_memory_utilization": float(m.group("util")),
            "requested_bytes": _gib(m.group("want")),
        })


def _fragment_events(log: LogText) -> Iterator[OomEvent]:
    """Start-up failures whose final error line is not in the log (see the docstring)."""
    text = log.text
    for m in scan(_SPLIT, text, ("model weights take",)):
        if float(m.group("kv")) <= 0:
            yield _event(log, m, VLLM_NO_KV, {"kv_cache_bytes": _gib(m.group("kv"))})
    for m in scan(_AVAILABLE_KV, text, ("Available KV cache memory",)):
        if float(m.group("kv")) <= 0:
            yield _event(log, m, VLLM_NO_KV, {"kv_cache_bytes": _gib(m.group("kv"))})
    blocks = {log.line_index(m.start()): int(m.group("blocks"))
              for m in scan(_BLOCKS, text, ("blocks:",))}
    for m in scan(_BLOCKS, text, ("blocks:",)):
        if int(m.group("blocks")) == 0:
            yield _event(log, m, VLLM_NO_KV, {"num_gpu_blocks": 0})
    for m in scan(_CONCURRENCY, text, ("Maximum concurrency",)):
        if float(m.group("x")) == 0:
            yield _event(log, m, VLLM_NO_KV, {"max_model_len": int(m.group("len"))})
    for m in scan(_CACHE_CHECK, text, ("raise_if_cache_size_invalid", "initialize_cache")):
        at = log.line_index(m.start())
        before = [b for line, b in blocks.items() if at - _FRAGMENT_WINDOW <= line < at]
        if before and before[-1] > 0:
            yield _event(log, m, VLLM_MAX_LEN, {
                "kv_cache_tokens": before[-1] * VLLM_BLOCK_SIZE, "num_gpu_blocks": before[-1]})
        else:
            yield _event(log, m, VLLM_NO_KV, {})


def _near(event: OomEvent, others: list[OomEvent]) -> bool:
    return any(0 <= o.line - event.line <= _FRAGMENT_WINDOW for o in others)


def find_vllm_fragments(log: LogText, complete: list[OomEvent]) -> list[OomEvent]:
    """The first fragment event of each start-up failure that has no complete message."""
    out: list[OomEvent] = []
    for event in sorted(_fragment_events(log), key=lambda e: e.line):
        if _near(event, complete) or any(abs(event.line - o.line) <= _FRAGMENT_WINDOW
                                         for o in out):
            continue
        out.append(replace(event, source="vllm (the error line is not in the log)"))
    return out


def vllm_profile(text: str, before: int | None = None) -> dict[str, int | float]:
    """The last memory-profiling numbers vLLM logged (before position ``before``)."""
    region = text if before is None else text[:before]
    out: dict[str, int | float] = {}
    for m in scan(_BUDGET, region, ("total_gpu_memory",)):
        out["total_bytes"] = _gib(m.group("total"))
        out["gpu_memory_utilization"] = float(m.group("util"))
        out["budget_bytes"] = _gib(m.group("budget"))
    for m in scan(_WEIGHTS_TOOK, region, ("loading took", "weights took")):
        out["weights_bytes"] = _gib(m.group("weights"))
    for m in scan(_SPLIT, region, ("model weights take",)):
        for key in ("weights", "non_torch", "activation", "kv"):
            name = "kv_cache_bytes" if key == "kv" else f"{key}_bytes"
            out[name] = _gib(m.group(key))
    for m in scan(_AVAILABLE_KV, region, ("Available KV cache memory",)):
        out["kv_cache_bytes"] = _gib(m.group("kv"))
    for m in scan(_KV_TOKENS, region, ("KV cache size",)):
        out["kv_cache_tokens"] = int(m.group("tokens").replace(",", ""))
    return out
