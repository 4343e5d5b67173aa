"""Building a PlanRequest from what the user gave (CLI options or a RunConfig)."""

from __future__ import annotations

import math
from dataclasses import replace

from ..config import RunConfig
from ..errors import ConfigError
from ..limits import PLAN_TIME_BUDGET_S, check_cap
from ..models.hardware import Cluster
from ..models.spec import ModelSpec
from .candidates import KNOBS, PlanRequest

DEFAULT_EFFECTIVE_BATCH = 16
# Host RAM per node when not stated: 1.5 × the node's GPU memory, at least
# 64 GB (DGX A100: 1 TB for 8 × 80 GB; workstations: 64–128 GB).
HOST_RAM_PER_GPU_MEMORY = 1.5
HOST_RAM_MIN_BYTES = 64 * 10**9


def default_effective_batch(world_size: int) -> int:
    """16 samples per step, rounded up to a multiple of the GPU count."""
    return world_size * math.ceil(DEFAULT_EFFECTIVE_BATCH / world_size)


def usable_cluster(cluster: Cluster, effective_batch: int) -> tuple[Cluster, list[str]]:
    """Use fewer GPUs per node when the effective batch is not a multiple of the
    GPU count (micro × accumulation × GPUs must equal it exactly)."""
    if effective_batch < 1:
        raise ConfigError(f"--effective-batch {effective_batch}: must be at least 1")
    if effective_batch % cluster.world_size == 0:
        return cluster, []
    for per_node in range(cluster.gpus_per_node - 1, 0, -1):
        if effective_batch % (per_node * cluster.nodes) == 0:
            note = (f"effective batch {effective_batch} is not a multiple of "
                    f"{cluster.world_size} GPUs: the plans use {per_node} GPU(s) per node")
            return replace(cluster, gpus_per_node=per_node), [note]
    raise ConfigError(
        f"--effective-batch {effective_batch} cannot be split over {cluster.nodes} nodes; "
        f"use a multiple of {cluster.nodes * cluster.gpus_per_node}")


def host_ram_for(cluster: Cluster) -> tuple[int, bool]:
    """(usable host RAM per node, assumed?)."""
    if cluster.host_ram_bytes:
        return cluster.host_ram_bytes, False
    node_gpu = cluster.gpus_per_node * cluster.gpu.memory_bytes
    return max(HOST_RAM_MIN_BYTES, int(HOST_RAM_PER_GPU_MEMORY * node_gpu)), True


def build_request(spec: ModelSpec, base: RunConfig, cluster: Cluster, *,
                  effective_batch: int | None = None, method_auto: bool = False,
                  headroom: float = 0.10, objective: str = "speed", top: int = 5,
                  data=None, fixed: frozenset[str] = frozenset(),
                  notes: tuple[str, ...] = (),
                  shardings: tuple[tuple[int, str], ...] | None = None,
                  time_budget_s: float = PLAN_TIME_BUDGET_S) -> PlanRequest:
    """A PlanRequest whose base configuration names the cluster's GPUs; the numbers are
    checked against limits.CAPS as the CLI's flags are (the web page comes here too)."""
    if not 0 <= headroom < 1:
        raise ConfigError(f"--headroom {headroom}: expected a fraction in [0, 1), e.g. 0.10")
    if top < 1:
        raise ConfigError(f"--top {top}: expected at least 1")
    check_cap("top", top, "--top")
    check_cap("world_size", cluster.world_size, "--gpu × --nodes (GPUs in all)")
    check_cap("hardware.gpus_per_node", cluster.gpus_per_node, "--gpu (GPUs per node)")
    check_cap("hardware.nodes", cluster.nodes, "--nodes")
    unknown = set(fixed) - set(KNOBS)
    if unknown:
        raise ConfigError(f"unknown fixed knob(s) {sorted(unknown)}; known: {', '.join(KNOBS)}")
    batch = effective_batch if effective_batch is not None else (
        base.micro_batch_size * base.grad_accum * cluster.world_size)
    check_cap("effective_batch", batch, "--effective-batch")
    cluster, more = usable_cluster(cluster, batch)
    per_gpu = batch // cluster.world_size
    hw = base.hardware.model_copy(update={
        "gpu": cluster.gpu.name, "gpus_per_node": cluster.gpus_per_node,
        "nodes": cluster.nodes})
    base = base.model_copy(update={"hardware": hw})
    if base.effective_batch != batch:  # a new effective batch, or fewer GPUs used
        base = base.model_copy(update={"micro_batch_size": per_gpu, "grad_accum": 1})
    host, assumed = host_ram_for(cluster)
    return PlanRequest(base=base, cluster=cluster, effective_batch=batch, headroom=headroom,
                       objective=objective, top=top, method_auto=method_auto,
                       fixed=frozenset(fixed), data=data, host_ram_bytes=host,
                       host_ram_assumed=assumed, notes=tuple(notes) + tuple(more),
                       shardings=shardings, time_budget_s=time_budget_s)
