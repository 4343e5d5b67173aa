"""Quantified fixes for vLLM and host-memory causes, from the logged numbers.

vLLM reserves ``gpu_memory_utilization × total`` at start-up (docs/memory-model.md §8,
vllm/v1/worker/gpu_worker.py): weights, the profile run's activation peak and
non-torch memory come out of that budget and the rest becomes KV cache.
Everything outside vLLM (another process, a sampler's logits for scoring, a
training job on the same card) must fit in ``(1 - u) × total``.
"""

from __future__ import annotations

import math

from ..units import GiB, MiB, fmt_bytes
from .causes import Situation
from .events import Cause, Fix, OomEvent
from .view import gpu_view

# vLLM accepts utilization as a fraction; we suggest values on a 0.05 grid
# (what people type), rounded towards the safe side.
_UTIL_STEP = 0.05
# Margin left free beyond the measured shortfall: the next request or batch is
# rarely the same size, and CUDA graphs/NCCL allocate lazily.
_MARGIN_BYTES = 1 * GiB
# vLLM's own check (MemorySnapshot) compares against free memory at start; keep
# half a GiB for the CUDA context that the engine creates after the check.
_CONTEXT_BYTES = 512 * MiB


def _down(u: float, step: float = _UTIL_STEP) -> float:
    return max(step, math.floor(u / step + 1e-9) * step)


def _up(u: float, step: float = 0.01) -> float:
    return math.ceil(u / step - 1e-9) * step


def _util_text(u: float, was: float | None) -> str:
    return f"gpu_memory_utilization {u:.2f}" + (f" (was {was:g})" if was is not None else "")


def vllm_runtime(event: OomEvent, cause: Cause) -> list[Fix]:
    """A CUDA OOM while vLLM runs: lower u so the failed request and a margin fit outside."""
    v = gpu_view(event)
    u = float(cause.numbers["gpu_memory_utilization"])
    total = int(cause.numbers["total_bytes"])
    req = v.requested_bytes or 0
    short = v.shortfall_bytes or 0
    new_u = _down(u - (short + req + _MARGIN_BYTES) / total)
    used = v.used_bytes if v.used_bytes is not None else int(u * total)
    after = used - int((u - new_u) * total) + req
    text = (f"{_util_text(new_u, u)}: vLLM's budget becomes {fmt_bytes(new_u * total)}, leaving "
            f"{fmt_bytes((1 - new_u) * total)} for the rest (the failed step needed {fmt_bytes(short)} more)")
    return [Fix("gpu_memory_utilization", text, {"gpu_memory_utilization": round(new_u, 2)}, True,
                after, total, "arithmetic", after <= total, domain="serving")]


def vllm_free_memory(event: OomEvent) -> list[Fix]:
    n = event.numbers
    total, free = int(n["total_bytes"]), int(n["free_bytes"])
    if total <= 0:
        return []
    held = total - free
    u = float(n["gpu_memory_utilization"])
    new_u = _down((free - _CONTEXT_BYTES) / total, 0.01)  # free memory was measured: finer grid
    after = held + int(new_u * total)
    fixes = [Fix("gpu_memory_utilization",
                 f"{_util_text(new_u, u)}: vLLM takes {fmt_bytes(new_u * total)} next to the "
                 f"{fmt_bytes(held)} already in use", {"gpu_memory_utilization": round(new_u, 2)},
                 True, after, total, "arithmetic", after <= total, domain="serving")]
    fixes.append(Fix("free_gpu", f"or free the {fmt_bytes(held)} other processes hold (nvidia-smi) "
                     f"and keep utilization {u:g}", {}, True, int(u * total), total, "arithmetic",
                     int(u * total) <= total, domain="environment"))
    return fixes


def _profile(event: OomEvent, s: Situation) -> dict[str, int | float]:
    """The memory profile vLLM logged before this event (else the log's first one)."""
    own = {k.removeprefix("profile_"): v for k, v in event.numbers.items() if k.startswith("profile_")}
    return own or dict(s.hints.vllm_profile)


_MAX_UTIL = 0.95  # the most we suggest: the CUDA context and the display need the rest


def _raise_util(prof: dict, fixed: int, total: int) -> Fix | None:
    """The utilization that leaves KV cache after weights, activations and non-torch memory."""
    was = prof.get("gpu_memory_utilization")
    need_u = _up((fixed + _MARGIN_BYTES) / total)
    if need_u <= _MAX_UTIL:
        return Fix("gpu_memory_utilization",
                   f"{_util_text(need_u, was)}: {fmt_bytes(fixed)} of weights, activations and "
                   f"non-torch memory plus {fmt_bytes(_MARGIN_BYTES)} of KV cache",
                   {"gpu_memory_utilization": need_u}, True, int(need_u * total), total,
                   "arithmetic", True, domain="serving")
    kv = _MAX_UTIL * total - fixed
    if kv <= 0 or (was is not None and was >= _MAX_UTIL):
        return None
    return Fix("gpu_memory_utilization",
               f"{_util_text(_MAX_UTIL, was)} when nothing else uses this {fmt_bytes(total)} GPU: "
               f"{fmt_bytes(kv)} of KV cache after {fmt_bytes(fixed)} of weights, activations and "
               "non-torch memory (with a smaller profile batch below, more)",
               {"gpu_memory_utilization": _MAX_UTIL}, True, int(_MAX_UTIL * total), total,
               "arithmetic", True, domain="serving")


def vllm_no_kv(event: OomEvent, s: Situation) -> list[Fix]:
    prof = _profile(event, s)
    total = prof.get("total_bytes")
    fixed = sum(int(prof.get(k, 0)) for k in ("weights_bytes", "activation_bytes", "non_torch_bytes"))
    fixes: list[Fix] = []
    raised = _raise_util(prof, fixed, int(total)) if total and fixed else None
    if raised is not None:
        fixes.append(raised)
    elif not total:  # no profile in the log: the budget is what is known to be too small
        fixes.append(Fix("gpu_memory_utilization", "raise gpu_memory_utilization (0.9 when nothing "
                         "else uses the GPU): the budget left nothing for the KV cache after the "
                         "weights and the profile run", {}, True, domain="serving"))
    act = prof.get("activation_bytes")
    detail = f" (profile-run activations {fmt_bytes(act)})" if act else ""
    fixes.append(Fix("max_num_batched_tokens", "lower max_num_batched_tokens / max_num_seqs: a "
                     "smaller profile run leaves more for the KV cache" + detail, {}, True,
                     domain="serving"))
    fixes.append(Fix("quantize", "a quantized checkpoint (AWQ/GPTQ/FP8) to shrink the weights "
                     "per GPU", {}, False, domain="serving"))
    fixes.append(Fix("tensor_parallel_size", "tensor_parallel_size 2 on two GPUs: each holds half "
                     "the weights and half the KV heads (`oomless estimate MODEL --inference "
                     "--gpu GPUx2 --tensor-parallel-size 2` sizes it)",
                     {"tensor_parallel_size": 2}, True, domain="serving"))
    return fixes


def vllm_serving_runtime(event: OomEvent, s: Situation) -> list[Fix]:
    """A vLLM worker ran out of memory while serving: the engine's settings, not training's."""
    h = s.hints
    seqs = f" (was {h.max_num_seqs})" if h.max_num_seqs else ""
    util = h.gpu_memory_utilization
    fixes = [Fix("max_num_seqs", f"lower max_num_seqs{seqs} and max_num_batched_tokens: fewer "
                 "tokens per step than the batch that failed", {}, True, domain="serving"),
             Fix("max_model_len", "lower max_model_len (prompt + generated tokens) to what the "
                 "requests need", {}, False, domain="serving")]
    if util:
        fixes.append(Fix("gpu_memory_utilization", f"{_util_text(_down(util - 0.05), util)}: more "
                         "room outside vLLM's budget for what its profile did not count",
                         {"gpu_memory_utilization": round(_down(util - 0.05), 2)}, True,
                         domain="serving"))
    else:
        fixes.append(Fix("gpu_memory_utilization", "lower gpu_memory_utilization by the missing "
                         "amount: more room outside vLLM's budget", {}, True, domain="serving"))
    return fixes


def vllm_cuda_graphs(s: Situation) -> list[Fix]:
    """vLLM's start-up advice for a capture OOM (v0 model_runner.py / v1 gpu_model_runner.py
    log line "Capturing cudagraphs for decoding")."""
    util = s.hints.gpu_memory_utilization
    lower = round(_down(util - 0.05), 2) if util else None
    return [Fix("gpu_memory_utilization", (_util_text(lower, util) if lower else
                                           "lower gpu_memory_utilization")
                + ": the graphs' memory is outside vLLM's budget",
                {"gpu_memory_utilization": lower} if lower else {}, True, domain="serving"),
            Fix("enforce_eager", "enforce_eager=True (--enforce-eager): no CUDA graphs, slower "
                "decoding", {"enforce_eager": True}, True, domain="serving"),
            Fix("max_num_seqs", "lower max_num_seqs (or cudagraph_capture_sizes): fewer, smaller "
                "graphs to capture", {}, True, domain="serving")]


def vllm_sampler(event: OomEvent, s: Situation) -> list[Fix]:
    """What vLLM's own message says: lower max_num_seqs or gpu_memory_utilization
    (vllm/v1/worker/gpu_model_runner.py _dummy_sampler_run)."""
    n = event.numbers.get("dummy_requests") or s.hints.max_num_seqs
    util = s.hints.gpu_memory_utilization
    seqs = Fix("max_num_seqs", f"lower max_num_seqs{f' (was {n})' if n else ''}: the sampler "
               "warm-up samples that many sequences at once",
               {"max_num_seqs": max(1, n // 2)} if n else {}, True, domain="serving")
    lower = round(_down(util - 0.05), 2) if util else None
    room = Fix("gpu_memory_utilization", (_util_text(lower, util) if lower else
                                          "lower gpu_memory_utilization")
               + ": leaves room outside vLLM's budget for the sampler's tensors",
               {"gpu_memory_utilization": lower} if lower else {}, True, domain="serving")
    return [seqs, room]


def vllm_max_len(event: OomEvent, s: Situation) -> list[Fix]:
    n = event.numbers
    fits_len = n.get("estimated_max_model_len") or n.get("kv_cache_tokens")
    fixes: list[Fix] = []
    if fits_len:
        was = n.get("max_model_len") or s.hints.max_model_len
        fixes.append(Fix("max_model_len", f"max_model_len {int(fits_len)}"
                         + (f" (was {was})" if was else "") + "; for generation: prompt cutoff + "
                         "max_new_tokens within it", {"max_model_len": int(fits_len)}, False,
                         domain="serving"))
    prof = _profile(event, s)
    total, u = prof.get("total_bytes"), prof.get("gpu_memory_utilization") or s.hints.gpu_memory_utilization
    need, have = n.get("kv_needed_bytes"), n.get("kv_available_bytes")
    if (need is None or have is None) and n.get("kv_cache_tokens") and prof.get("kv_cache_bytes"):
        have = prof["kv_cache_bytes"]  # V0 gives tokens only: scale the profiled KV bytes
        need = have * n["max_model_len"] / n["kv_cache_tokens"] if n.get("max_model_len") else None
    if not (total and u and need and have):
        fixes.append(Fix("gpu_memory_utilization", "raise gpu_memory_utilization (more KV cache) "
                         "when nothing else uses the GPU, or add GPUs (tensor_parallel_size)", {},
                         True, domain="serving"))
    else:
        new_u = _up(u + (need - have) / total)
        fixes.append(Fix("gpu_memory_utilization",
                         f"{_util_text(new_u, u)}: {fmt_bytes(need - have)} more KV cache",
                         {"gpu_memory_utilization": new_u}, True, int(new_u * total), int(total),
                         "arithmetic", new_u <= 1.0, domain="serving"))
    return fixes


def host_fixes(event: OomEvent, s: Situation) -> list[Fix]:
    if event.phase == "data_loading" or event.source == "dataloader":
        return [Fix("dataloader_workers", "fewer DataLoader workers (dataloader_num_workers 2 or 0): "
                    "each worker holds its own copy of the dataset's Python objects", {}, True)]
    if event.phase == "model_load":
        return [Fix("load_to_gpu", "load safetensors shard by shard straight to the GPU "
                    "(from_pretrained(..., device_map=...), low_cpu_mem_usage=True) instead of "
                    "materialising the model in host RAM first", {}, True)]
    offload = s.zero_stage is not None and s.zero_stage >= 2
    extra = " (ZeRO offload keeps optimizer states in host RAM: pass --config to size it)" if offload else ""
    return [Fix("host_ram", "more host RAM or swap, fewer processes per node, or a container memory "
                f"limit raised to what the job needs{extra}", {}, True)]


def serving_fixes(event: OomEvent, cause: Cause, s: Situation) -> list[Fix]:
    if cause.code == "vllm_utilization" and "total_bytes" in cause.numbers and event.kind == "cuda_oom":
        return vllm_runtime(event, cause)
    if cause.code == "vllm_utilization":
        return vllm_free_memory(event)
    if cause.code == "vllm_no_kv_cache":
        return vllm_no_kv(event, s)
    if cause.code == "vllm_max_len":
        return vllm_max_len(event, s)
    if cause.code == "vllm_cuda_graphs":
        return vllm_cuda_graphs(s)
    if cause.code == "vllm_sampler":
        return vllm_sampler(event, s)
    if cause.code == "vllm_runtime":
        return vllm_serving_runtime(event, s)
    if cause.code == "host_ram":
        return host_fixes(event, s)
    return []
