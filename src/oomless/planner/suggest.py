"""When nothing fits: which hardware (or method) would, found by the same search."""

from __future__ import annotations

from dataclasses import replace

from ..models.hardware import Cluster, gpu_catalog
from ..models.spec import ModelSpec
from ..units import fmt_bytes
from .candidates import PlanRequest
from .plan import PlanResult, search
from .request import build_request

MAX_GPU_TRIES = 3  # bigger cards searched, smallest first
GPU_COUNTS = (2, 4, 8, 16, 32, 64)
GPUS_PER_NODE = 8


def _retry(spec: ModelSpec, req: PlanRequest, cluster: Cluster, **changes) -> PlanResult:
    """The same request on other hardware (top 1, no nested suggestions)."""
    sub = build_request(spec, req.base, cluster, effective_batch=req.effective_batch,
                        method_auto=changes.get("method_auto", req.method_auto),
                        headroom=req.headroom, objective=req.objective, top=1, data=req.data,
                        fixed=req.fixed)
    return search(spec, sub)


def _summary(result: PlanResult) -> str:
    best = result.best
    c = best.config
    return (f"{best.family}, micro batch {c['micro_batch_size']} × accumulation "
            f"{c['grad_accum']}{', checkpointing' if c['grad_ckpt'] else ''}: "
            f"{fmt_bytes(best.device_peak_bytes)} per GPU, "
            f"{best.tokens_per_s:,.0f} tokens/s")


def bigger_gpu(spec: ModelSpec, req: PlanRequest, need_bytes: int) -> str | None:
    """The smallest catalog GPU (same count) on which something fits."""
    cur = req.cluster.gpu
    cards = sorted((g for g in gpu_catalog().values()
                    if g.memory_bytes > cur.memory_bytes
                    and (1 - req.headroom) * g.memory_bytes >= 0.9 * need_bytes),
                   key=lambda g: (g.memory_bytes, -g.bf16_tflops))
    for gpu in cards[:MAX_GPU_TRIES]:
        result = _retry(spec, req, replace(req.cluster, gpu=gpu))
        if result.plans:
            return f"{result.hardware}: {_summary(result)}"
    return None


def more_gpus(spec: ModelSpec, req: PlanRequest) -> str | None:
    """The fewest GPUs of the same kind (multiples the effective batch allows)."""
    for n in GPU_COUNTS:
        if n <= req.cluster.world_size or req.effective_batch % n:
            continue
        per_node = min(n, GPUS_PER_NODE)
        cluster = Cluster(req.cluster.gpu, per_node, n // per_node, req.cluster.host_ram_bytes)
        result = _retry(spec, req, cluster)
        if result.plans:
            return f"{result.hardware}: {_summary(result)}"
    return None


def suggestions(spec: ModelSpec, req: PlanRequest, result: PlanResult) -> list[str]:
    """Hardware that fits the request when nothing fits on the given GPUs."""
    if result.plans:
        return []
    need = min((m.device_peak_bytes for m in result.misses), default=req.cluster.gpu.memory_bytes)
    out = []
    if not req.method_auto:
        other = _retry(spec, req, req.cluster, method_auto=True)
        if other.plans:
            why = next((c["why"] for c in other.best.changes if c.get("why")), "")
            out.append(f"another method on the same GPUs: {_summary(other)} "
                       f"(--method auto){'; ' + why if why else ''}")
    for found in (bigger_gpu(spec, req, need), more_gpus(spec, req)):
        if found:
            out.append(found)
    if not out:
        out.append("no catalog GPU up to 64 of them fits this request; shorten the sequences "
                   "or use a smaller model")
    return out


def plan(spec: ModelSpec, req: PlanRequest) -> PlanResult:
    """search() plus, when nothing fits, what would."""
    result = search(spec, req)
    if result.plans:
        return result
    return replace(result, suggestions=suggestions(spec, req, result))
