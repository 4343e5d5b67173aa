"""Predicted peaks for changed run configurations, through the analytic estimator.

The GPU is the one the user names (``--gpu``), else the run configuration's
``hardware.gpu``, else a GPU of the total the out-of-memory message printed.
The budget a fix must fit in is that GPU's memory minus what other processes
held when the event happened.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import RunConfig
from ..errors import ConfigError
from ..models.hardware import Cluster, GPUSpec, gpu_catalog, parse_gpu_arg
from ..models.spec import ModelSpec
from ..units import fmt_bytes

# A catalog GPU whose memory is within this fraction of the printed total is that GPU.
_SAME_GPU_TOLERANCE = 0.01


def gpu_from_total(total_bytes: int) -> GPUSpec:
    """The catalog GPU with this much memory, or a GPU described by the log alone."""
    for gpu in gpu_catalog().values():
        if abs(gpu.memory_bytes - total_bytes) <= _SAME_GPU_TOLERANCE * gpu.memory_bytes:
            return gpu
    return GPUSpec(
        name="gpu-from-log",
        display_name=f"GPU with {fmt_bytes(total_bytes)} (from the log)",
        memory_bytes=total_bytes,
        bf16=True,
        bf16_tflops=0.0,
        fp16_tflops=0.0,
        memory_bandwidth_gbs=0.0,
        compute_capability="8.0",  # unknown: Ampere assumed (cuBLAS workspace size only)
        interconnect="pcie",
        interconnect_gbs=0.0,
        pcie_gbs=0.0,
        source="total capacity printed in the out-of-memory message",
    )


def choose_cluster(cfg: RunConfig | None, gpu_arg: str | None, total_bytes: int | None) -> Cluster | None:
    """``--gpu`` first, then the configuration's GPU, then the printed total."""
    from ..api import cluster_for

    configured = cluster_for(cfg) if cfg else None
    per_node = cfg.hardware.gpus_per_node if cfg else 1
    nodes = cfg.hardware.nodes if cfg else 1
    host = configured.host_ram_bytes if configured else None
    if gpu_arg:
        cluster = parse_gpu_arg(gpu_arg, nodes=nodes, host_ram_bytes=host)
        if cfg and cluster.gpus_per_node == 1:  # "--gpu a100-80gb": the config says how many
            cluster = Cluster(cluster.gpu, per_node, nodes, host)
        return cluster
    if configured:
        return configured
    if total_bytes:
        return Cluster(gpu_from_total(total_bytes), per_node, nodes, host)
    return None


@dataclass
class Predictor:
    """Peaks of the run configuration with some keys changed (cached)."""

    spec: ModelSpec
    cfg: RunConfig
    cluster: Cluster
    others_bytes: int = 0
    _cache: dict[tuple, Any] = field(default_factory=dict)

    @property
    def gpu_bytes(self) -> int:
        return self.cluster.gpu.memory_bytes

    @property
    def budget_bytes(self) -> int:
        return self.gpu_bytes - self.others_bytes

    def estimate(self, expandable: bool = False, **changes: Any):
        """The MemoryEstimate with ``changes`` applied; None when the change is invalid."""
        from ..memory import estimate_training

        key = (expandable, tuple(sorted(changes.items())))
        if key not in self._cache:
            try:
                cfg = self.cfg.replace(**changes) if changes else self.cfg
            except ConfigError:
                self._cache[key] = None  # the change contradicts the rest of the config
            else:
                self._cache[key] = estimate_training(self.spec, cfg, self.cluster,
                                                     expandable_segments=expandable)
        return self._cache[key]

    def peak(self, expandable: bool = False, **changes: Any) -> int | None:
        est = self.estimate(expandable, **changes)
        return None if est is None else est.device_peak_bytes

    def fits(self, peak_bytes: int) -> bool:
        return peak_bytes <= self.budget_bytes
