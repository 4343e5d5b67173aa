"""Why an event happened, from its numbers, its phase and the other events.

Each rule returns a :class:`Cause` with the numbers that show it, or None.
Causes come back most likely first; the weights only order them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..units import GiB, MiB, fmt_bytes
from .events import (
    BNB_OOM,
    CUDA_ERROR_OOM,
    CUDA_OOM,
    GPU_KINDS,
    HOST_KINDS,
    NCCL_OOM,
    PROCESS_KILLED,
    VLLM_FREE_MEMORY,
    VLLM_MAX_LEN,
    VLLM_NO_KV,
    VLLM_SAMPLER,
    Cause,
    OomEvent,
    RunHints,
)
from .view import GpuView, gpu_view
from .vision import vision_attention

# The caching allocator rounds requests up to 2 MiB and packs them into 2/20 MiB
# segments (c10/cuda/CUDACachingAllocator.cpp), so a few hundred MiB of slack is
# normal; below this it is not worth an allocator setting.
FRAGMENTATION_MIN_BYTES = 256 * MiB
# CUDA context plus cuBLAS/cuDNN workspaces of the process itself take ~0.3-1 GiB
# (docs/memory-model.md §7, outside PyTorch); more than this outside PyTorch is someone else.
OUTSIDE_PYTORCH_EXPECTED_BYTES = 2 * GiB
OTHER_PROCESS_MIN_FRACTION = 0.10
# "Steps ran fine before": enough steps that the batch shapes were seen before.
LONG_SAMPLE_MIN_STEPS = 10
# Ranks whose allocations agree within this fraction hold the same (replicated) state.
REPLICA_TOLERANCE = 0.10
LOGITS_TOLERANCE = 0.10
_LOGITS_FRAMES = re.compile(r"lm_head|cross_entropy|log_softmax|ForCausalLMLoss|loss_function|logits")


@dataclass(frozen=True)
class Situation:
    """What classification may use besides the event itself."""

    events: tuple[OomEvent, ...]
    hints: RunHints
    zero_stage: int | None = None  # from the run config, else from the log
    micro_batch_size: int | None = None
    eval_batch_size: int | None = None
    logits_tokens: tuple[int, ...] = ()  # tokens per micro batch (train, eval) when known
    vocab_size: int | None = None
    # From the run config and the estimator: GPUs, and model states per GPU now / with ZeRO-3
    world_size: int = 1
    replica_states: tuple[int, int] | None = None
    vision_heads: int | None = None  # attention heads of the model's vision tower, when known


def _c(code: str, title: str, evidence: str, **numbers: int | float) -> Cause:
    return Cause(code, title, evidence, {k: v for k, v in numbers.items() if v is not None})


def fragmentation(view: GpuView) -> tuple[float, Cause] | None:
    u, free, req = view.unallocated_bytes, view.available_bytes, view.requested_bytes
    if u is None or u < FRAGMENTATION_MIN_BYTES:
        return None
    if req is not None and free is not None and u + free >= req:
        return 3.0, _c("fragmentation", "Fragmentation: the memory was there, but not in one piece",
                       f"{fmt_bytes(u)} reserved by PyTorch but unallocated + {fmt_bytes(free)} free "
                       f"would hold the {fmt_bytes(req)} request",
                       reserved_unallocated_bytes=u, free_bytes=free, requested_bytes=req)
    if view.reserved_bytes and u >= max(GiB, 0.1 * view.reserved_bytes):
        return 1.0, _c("fragmentation", "Fragmentation adds to it",
                       f"{fmt_bytes(u)} of PyTorch's {fmt_bytes(view.reserved_bytes)} is reserved "
                       "but unallocated", reserved_unallocated_bytes=u)
    return None


def memory_fraction(view: GpuView) -> tuple[float, Cause] | None:
    """torch.cuda.set_per_process_memory_fraction caps the process below the device."""
    cap, reserved, req = view.allowed_bytes, view.reserved_bytes, view.requested_bytes
    if cap is None or reserved is None or req is None or reserved + req <= cap:
        return None
    return 4.5, _c("memory_fraction", "The process is capped by set_per_process_memory_fraction",
                   f"{fmt_bytes(reserved)} reserved + the {fmt_bytes(req)} request exceed the "
                   f"{fmt_bytes(cap)} this process is allowed, while {fmt_bytes(view.free_bytes or 0)} "
                   "of the GPU is free", allowed_bytes=cap, reserved_bytes=reserved, requested_bytes=req)


def other_process(view: GpuView) -> tuple[float, Cause] | None:
    total = view.total_bytes
    if total is None:
        return None
    limit = max(512 * MiB, OTHER_PROCESS_MIN_FRACTION * total)
    if view.others and view.others_bytes >= limit:
        listed = ", ".join(f"process {p.pid} {fmt_bytes(p.memory_bytes)}" for p in view.big_others(total))
        mine = f"; this process {fmt_bytes(view.self_bytes)}" if view.self_bytes else ""
        return 4.0, _c("other_process", "Another process holds GPU memory",
                       f"{fmt_bytes(view.others_bytes)} of {fmt_bytes(total)} belong to other "
                       f"processes ({listed}){mine}",
                       others_bytes=view.others_bytes, self_bytes=view.self_bytes, total_bytes=total)
    outside = view.outside_pytorch_bytes
    if not view.others and view.self_bytes is None and outside is not None and \
            outside >= max(OUTSIDE_PYTORCH_EXPECTED_BYTES, 0.15 * total):
        return 3.5, _c("other_process", "Memory outside this process's PyTorch: another process?",
                       f"{fmt_bytes(view.used_bytes or 0)} of {fmt_bytes(total)} in use, but PyTorch "
                       f"reserved only {fmt_bytes(view.reserved_bytes or 0)}: {fmt_bytes(outside)} "
                       "is held elsewhere (another process, or CUDA context and libraries)",
                       outside_pytorch_bytes=outside, total_bytes=total)
    return None


def _frames_text(event: OomEvent) -> str:
    return " ".join(event.frames)


def logits(event: OomEvent, view: GpuView, s: Situation) -> tuple[float, Cause] | None:
    req = view.requested_bytes
    if req and s.vocab_size and s.logits_tokens:
        for tokens in s.logits_tokens:
            for elem in (4, 2):  # fp32 upcast in the loss, or the 16-bit logits themselves
                expected = tokens * s.vocab_size * elem
                if abs(req - expected) <= LOGITS_TOLERANCE * expected:
                    return 3.2, _c("logits", "Logits: the vocabulary-sized output of the micro batch",
                                   f"the {fmt_bytes(req)} request ≈ {tokens} tokens × {s.vocab_size} "
                                   f"vocabulary × {elem} bytes = {fmt_bytes(expected)}",
                                   requested_bytes=req, logits_bytes=expected, tokens=tokens)
    if _LOGITS_FRAMES.search(_frames_text(event)):
        size = f" ({fmt_bytes(req)} requested)" if req else ""
        return 2.5, _c("logits", "Logits and loss: the vocabulary-sized tensors",
                       f"the allocation failed in the loss / lm_head{size}", requested_bytes=req)
    return None


def _configured_replicas(event: OomEvent, s: Situation) -> tuple[float, Cause] | None:
    """The run config says N GPUs without ZeRO-3: each one holds the full model state."""
    if s.replica_states is None or event.kind not in GPU_KINDS:
        return None
    now, sharded = s.replica_states
    stage = "no ZeRO" if not s.zero_stage else f"ZeRO-{s.zero_stage}"
    return 2.6, _c("replicas", "Full replicas on every GPU where sharding was meant",
                   f"{s.world_size} GPUs ({stage}) each hold {fmt_bytes(now)} of weights, gradients and "
                   f"optimizer states; sharded over {s.world_size} (ZeRO-3) it would be {fmt_bytes(sharded)}",
                   states_bytes=now, sharded_states_bytes=sharded, world_size=s.world_size)


def replicas(event: OomEvent, s: Situation) -> tuple[float, Cause] | None:
    if s.zero_stage is not None and s.zero_stage >= 3:
        return None
    if event.rank is None:
        return _configured_replicas(event, s)
    per_rank: dict[int, int] = {}
    for e in s.events:
        alloc = e.numbers.get("allocated_bytes")
        if e.kind == CUDA_OOM and e.rank is not None and alloc:
            per_rank.setdefault(e.rank, int(alloc))
    mine = per_rank.get(event.rank)
    if len(per_rank) < 2 or not mine:
        return _configured_replicas(event, s)
    same = [r for r, a in per_rank.items() if abs(a - mine) <= REPLICA_TOLERANCE * mine]
    if len(same) < 2:
        return _configured_replicas(event, s)
    stage = "no ZeRO" if s.zero_stage in (None, 0) else f"ZeRO-{s.zero_stage}"
    return 2.8, _c("replicas", "Full replicas on every GPU where sharding was meant",
                   f"{len(same)} ranks each hold ≈{fmt_bytes(mine)} allocated ({stage}): every GPU "
                   "keeps its own full copy of the model state instead of a 1/N share",
                   ranks=len(same), allocated_bytes=mine)


def long_sample(event: OomEvent, s: Situation) -> tuple[float, Cause] | None:
    done = s.hints.steps_done
    if event.phase not in ("forward", "backward") or not done or done < LONG_SAMPLE_MIN_STEPS:
        return None
    return 2.0, _c("long_sample", "One long sample (or batch) at this step",
                   f"{done} steps ran before this one with the same settings: this batch was "
                   "larger than the ones before", steps_done=done)


def _phase_cause(event: OomEvent, view: GpuView, s: Situation) -> tuple[float, Cause] | None:
    short = view.shortfall_bytes
    need = f"; it needed {fmt_bytes(short)} more than was free" if short else ""
    if event.phase == "evaluation":
        eb = s.eval_batch_size
        batch = f" at eval batch {eb}" if eb else ""
        return 2.6, _c("evaluation", "Evaluation", f"the out-of-memory came in evaluation{batch}{need}",
                       eval_batch_size=eb, shortfall_bytes=short)
    if event.phase == "generation":
        new = s.hints.max_new_tokens
        tokens = f", up to {new} new tokens" if new else ""
        return 2.7, _c("generation", "Generation: the KV cache grows with batch × length",
                       f"the out-of-memory came in generate(){tokens}{need}",
                       max_new_tokens=new, shortfall_bytes=short)
    if event.phase == "model_load":
        return 2.4, _c("model_too_large", "Loading the model: the weights do not fit",
                       f"the out-of-memory came while loading or placing the weights{need}",
                       shortfall_bytes=short)
    if event.phase in ("optimizer_step", "zero_init"):
        where = "DeepSpeed ZeRO initialisation" if event.phase == "zero_init" else "the optimizer step"
        return 2.3, _c("optimizer_states", "Optimizer states and master weights",
                       f"the out-of-memory came in {where}, where fp32 states are created{need}",
                       shortfall_bytes=short)
    if event.phase in ("forward", "backward", "unknown") and event.kind in GPU_KINDS:
        mb = s.micro_batch_size
        batch = f" of micro batch {mb}" if mb else ""
        return 1.5, _c("activations", "Activations of the micro batch",
                       f"the {event.phase if event.phase != 'unknown' else 'step'}{batch} needs more "
                       f"than the GPU has left{need}", micro_batch_size=mb, shortfall_bytes=short)
    return None


def vllm_in_charge(event: OomEvent, s: Situation) -> tuple[float, Cause] | None:
    util = s.hints.gpu_memory_utilization
    if event.kind != CUDA_OOM or util is None or "vllm" not in _frames_text(event):
        return None
    view = gpu_view(event)
    total = view.total_bytes or s.hints.vllm_profile.get("total_bytes")
    if not total:
        return None
    left = int((1 - util) * total)
    return 3.8, _c("vllm_utilization", "vLLM's gpu_memory_utilization leaves too little for the rest",
                   f"vLLM takes {util:g} × {fmt_bytes(total)} = {fmt_bytes(util * total)} up front; "
                   f"{fmt_bytes(left)} is left for everything outside its budget",
                   gpu_memory_utilization=util, total_bytes=int(total), left_bytes=left)


def _vllm_event(event: OomEvent, s: Situation) -> list[tuple[float, Cause]]:
    n = event.numbers
    prof = s.hints.vllm_profile
    if event.kind == VLLM_FREE_MEMORY:
        held = int(n["total_bytes"] - n["free_bytes"])
        return [(5.0, _c("vllm_utilization", "vLLM's gpu_memory_utilization is more than is free",
                         f"only {fmt_bytes(n['free_bytes'])} of {fmt_bytes(n['total_bytes'])} was free at "
                         f"start ({fmt_bytes(held)} held by other processes); utilization "
                         f"{n['gpu_memory_utilization']:g} asks for {fmt_bytes(n['requested_bytes'])}",
                         held_bytes=held, **n))]
    if event.kind == VLLM_NO_KV:
        parts = [f"{k.removesuffix('_bytes').replace('_', ' ')} {fmt_bytes(v)}"
                 for k, v in prof.items() if k in ("weights_bytes", "activation_bytes", "non_torch_bytes")]
        detail = f" ({', '.join(parts)})" if parts else ""
        return [(5.0, _c("vllm_no_kv_cache", "Nothing left for vLLM's KV cache",
                         f"weights, profile-run activations and non-torch memory fill vLLM's budget"
                         f"{detail}", **{k: v for k, v in prof.items() if isinstance(v, (int, float))}))]
    if event.kind == VLLM_SAMPLER:
        n = event.numbers.get("dummy_requests")
        reqs = f"{n} dummy requests (max_num_seqs)" if n else "max_num_seqs dummy requests"
        return [(5.0, _c("vllm_sampler", "vLLM's sampler warm-up ran out of memory",
                         f"at start-up vLLM samples {reqs} at once to reserve the sampler's memory "
                         "(logits of every sequence over the vocabulary); the GPU had no room "
                         "left for them outside the weights and the KV cache", dummy_requests=n))]
    if event.kind == VLLM_MAX_LEN:
        need = n.get("kv_needed_bytes")
        have = n.get("kv_available_bytes")
        length = n.get("max_model_len") or s.hints.max_model_len
        wanted = f"max_model_len {length}" if length else "the model's max seq len"
        detail = (f"one sequence of {length} tokens needs {fmt_bytes(need)} of KV cache, "
                  f"{fmt_bytes(have)} is available" if need and have else
                  f"{wanted} > {n.get('kv_cache_tokens')} tokens the KV cache holds")
        return [(5.0, _c("vllm_max_len", "max_model_len is longer than the KV cache holds", detail, **n))]
    return []


def vllm_runtime(event: OomEvent, view: GpuView) -> tuple[float, Cause] | None:
    """vLLM itself failed while serving (outside its start-up budget's profile)."""
    if event.library != "vllm" or event.kind not in (CUDA_OOM, CUDA_ERROR_OOM):
        return None
    if event.phase == "vllm_cuda_graphs":
        return 3.9, _c("vllm_cuda_graphs", "vLLM's CUDA graph capture ran out of memory",
                       "the graphs are captured after the KV cache took its share of "
                       "gpu_memory_utilization; their memory is outside that budget (vLLM: \"If "
                       "out-of-memory error occurs during cudagraph capture, consider decreasing "
                       "`gpu_memory_utilization` or switching to eager mode\")",
                       requested_bytes=view.requested_bytes)
    cumem = "cumem_allocator" in event.message
    where = ("vLLM's CuMemAllocator (sleep mode, an engine beside a training job) could not map "
             "its memory" if cumem else "the allocation failed inside vLLM's model runner or "
             "sampler")
    return 3.7, _c("vllm_runtime", "vLLM ran out of memory while serving",
                   f"{where}: a batch of more tokens (or a larger sampler) than its start-up "
                   "profile measured, or memory other work took since start-up",
                   requested_bytes=view.requested_bytes, shortfall_bytes=view.shortfall_bytes)


def oversized_request(view: GpuView) -> tuple[float, Cause] | None:
    """One allocation larger than the whole GPU: no batch size makes a tensor that big
    fit; its size is a bug's (a sample far longer than meant, packing without a length
    cap, an attention matrix materialised in full)."""
    req, total = view.requested_bytes, view.total_bytes
    if req is None or total is None or req <= total:
        return None
    return 6.0, _c("oversized_request", "One request larger than the whole GPU: a bug-shaped size",
                   f"the {fmt_bytes(req)} request is {req / total:.1f}× the {fmt_bytes(total)} GPU: "
                   "halving the batch cannot make it fit; a sequence far longer than intended "
                   "(packing or concatenation without a length cap, a missing truncation), or a "
                   "full attention matrix (eager attention on a long sequence) asks for this",
                   requested_bytes=req, total_bytes=total)


def free_but_failed(view: GpuView) -> tuple[float, Cause] | None:
    """The GPU had far more free than was asked: not a capacity problem."""
    free, req = view.free_bytes, view.requested_bytes
    if free is None or req is None or free < max(GiB, 4 * req):
        return None
    return 4.2, _c("free_but_failed", "The GPU had room: this is not the model's size",
                   f"{fmt_bytes(free)} was free and {fmt_bytes(req)} was asked for: the allocation "
                   "failed for another reason (a limit outside PyTorch: WSL2's share of the GPU, a "
                   "container or MIG slice, the driver)", free_bytes=free, requested_bytes=req)


def _host_causes(event: OomEvent) -> list[tuple[float, Cause]]:
    rss = event.numbers.get("rss_bytes")
    held = f": the killed process held {fmt_bytes(rss)} of host RAM" if rss else ""
    if event.kind == PROCESS_KILLED:
        code = event.numbers.get("exit_code", -9)
        return [(3.0, _c("host_ram", "Killed by SIGKILL: most likely the host's OOM killer",
                         f"exit code {code} (signal 9); the Linux OOM killer sends SIGKILL when host RAM "
                         "runs out (confirm with `dmesg | grep -i 'killed process'`)", exit_code=code))]
    where = {"data_loading": "in the DataLoader workers", "model_load": "while loading the model",
             "checkpoint_save": "while saving a checkpoint"}.get(event.phase, "")
    text = " ".join(part for part in ("host memory ran out", where) if part) + held
    return [(4.0, _c("host_ram", "Host RAM ran out", text, rss_bytes=rss))]


def classify(event: OomEvent, s: Situation) -> tuple[Cause, ...]:
    """Causes of one event, most likely first."""
    found: list[tuple[float, Cause] | None] = []
    if event.kind in HOST_KINDS:
        found += _host_causes(event)
    elif event.kind in (VLLM_FREE_MEMORY, VLLM_NO_KV, VLLM_MAX_LEN, VLLM_SAMPLER):
        found += _vllm_event(event, s)
    else:
        view = gpu_view(event)
        vllm = vllm_in_charge(event, s) or vllm_runtime(event, view)
        other = [free_but_failed(view), vision_attention(event, view, s.vision_heads)]
        if not any(other):
            other.append(oversized_request(view))
        found += [vllm, *other, memory_fraction(view), other_process(view), fragmentation(view)]
        if not any(other):  # else the batch, logits and replicas are not what ran out here
            phase = _phase_cause(event, view, s)
            found += [logits(event, view, s)]
            if vllm is None:  # a serving engine has no micro batch or replicas of training
                found += [replicas(event, s), long_sample(event, s), phase]
            elif phase is not None and phase[1].code != "activations":
                found.append(phase)
        if event.kind == NCCL_OOM:
            stated = event.numbers.get("oom_stated", 1)
            found.append((3.0, _c("nccl_buffers", "NCCL could not allocate its buffers",
                                  "NCCL allocates communication buffers at the first collective; the GPU "
                                  "was already full" + ("" if stated else
                                                       " (NCCL reported an unhandled CUDA error; on a "
                                                       "full GPU that is its allocation failing)"))))
        if event.kind in (CUDA_ERROR_OOM, BNB_OOM):
            who = "bitsandbytes' kernel" if event.kind == BNB_OOM else "a CUDA call outside PyTorch's allocator"
            found.append((0.5, _c("outside_allocator", "Allocation outside PyTorch's caching allocator",
                                  f"{who} failed (CUDA context, cuBLAS/cuDNN workspace, custom kernel)")))
    ranked = sorted((f for f in found if f is not None), key=lambda wc: -wc[0])
    return tuple(c for _, c in ranked)
