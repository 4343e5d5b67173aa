"""Preflight: before loading weights, estimate the run; stop or auto-fit when it won't fit.

The GPU to check against is ``hardware.gpu`` from the configuration, or the
CUDA device this process runs on. Without either (CPU runs) there is nothing
to check and the preflight says so.

The plan that fits comes from the planner (``oomless.planner.best_fit``): the
fastest configuration that fits and keeps the effective batch and what is
trained (method, precision, LoRA, optimizer, sequence length); it may change
the micro batch × accumulation split, checkpointing and the evaluation batch,
and ZeRO stage / offload only for runs that already use DeepSpeed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...config import RunConfig
from ...errors import ConfigError
from ...units import fmt_bytes


class PreflightError(ConfigError):
    """The run will not fit on its GPU; the message holds the breakdown and a plan."""


@dataclass(frozen=True)
class Preflight:
    estimate: Any  # MemoryEstimate | None
    cluster: Any  # Cluster | None
    note: str
    proposal: RunConfig | None = None
    changes: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def fits(self) -> bool | None:
        return None if self.estimate is None else self.estimate.fits


def detect_cluster(cfg: RunConfig) -> Any:
    """The configured GPUs, else the CUDA device we run on, else None."""
    from ...api import cluster_for

    cluster = cluster_for(cfg)
    if cluster is not None:
        return cluster
    import torch

    if not torch.cuda.is_available():
        return None
    from ...errors import UnknownGPUError
    from ...models.hardware import Cluster, get_gpu

    name = torch.cuda.get_device_name(0)
    total = torch.cuda.mem_get_info(0)[1]
    try:
        gpu = get_gpu(name)
    except UnknownGPUError:
        major, minor = torch.cuda.get_device_capability(0)
        gpu = dataclasses.replace(get_gpu("a100-80gb"), name=name, display_name=name,
                                  compute_capability=f"{major}.{minor}")
    gpu = dataclasses.replace(gpu, memory_bytes=total)
    return Cluster(gpu, cfg.hardware.gpus_per_node, cfg.hardware.nodes)


def predicted_estimate(cfg: RunConfig, model_dir: Path, cluster: Any = None) -> Any:
    """The analytic estimate of this run (None where the model is not modelled)."""
    from ...api import estimate
    from ...errors import ModelConfigError, UnknownModelError

    try:
        return estimate(cfg, model=str(model_dir), cluster=cluster)
    except (UnknownModelError, ModelConfigError):
        return None


def fitting_proposal(cfg: RunConfig, model_dir: Path, cluster: Any) -> RunConfig | None:
    """The planner's fastest fitting configuration with the same effective batch."""
    from ...planner import best_fit

    fit = best_fit(cfg.replace(model=str(model_dir)), cluster)
    return None if fit is None else fit.model_copy(update={"model": cfg.model})


def config_changes(old: RunConfig, new: RunConfig) -> dict[str, list[Any]]:
    """Dotted keys whose values differ (model excluded), as [old, new]."""
    def flat(d: dict, prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    a, b = flat(old.to_dict()), flat(new.to_dict())
    return {k: [a.get(k), b[k]] for k in b if k != "model" and a.get(k) != b[k]}


def run_preflight(cfg: RunConfig, model_dir: Path) -> Preflight:
    cluster = detect_cluster(cfg)
    if cluster is None:
        return Preflight(None, None, "no GPU configured (hardware.gpu) or present: "
                         "memory not checked before training")
    from ...api import estimate
    from ...errors import ModelConfigError, UnknownModelError

    try:
        est = estimate(cfg, model=str(model_dir), cluster=cluster)
    except (UnknownModelError, ModelConfigError) as err:
        return Preflight(None, cluster, f"memory not checked: the estimator cannot model "
                         f"this model ({err})")
    if est.fits:
        return Preflight(est, cluster, f"fits on {cluster.describe()}: predicted "
                         f"{fmt_bytes(est.device_peak_bytes)} of {fmt_bytes(est.gpu_memory_bytes)}")
    proposal = fitting_proposal(cfg, model_dir, cluster)
    changes = config_changes(cfg, proposal) if proposal else {}
    return Preflight(est, cluster, "does not fit", proposal, changes)


def explain(pre: Preflight) -> str:
    est = pre.estimate
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in
                      sorted(est.components.items(), key=lambda kv: -kv[1]))
    text = (f"predicted OUT OF MEMORY on {pre.cluster.describe()}: the {est.peak_phase} phase "
            f"needs {fmt_bytes(est.device_peak_bytes)} of {fmt_bytes(est.gpu_memory_bytes)} "
            f"({parts}).")
    if pre.proposal is None:
        return text + " No setting with the same effective batch and training fits; run " \
                      "`oomless plan` for other methods, GPUs or sharding."
    diff = ", ".join(f"{k}: {a} -> {b}" for k, a, b in
                     ((k, *v) for k, v in pre.changes.items()))
    return text + f" Best plan that fits (same effective batch): {diff}. " \
                  "Rerun with --auto-fit (or training.auto_fit: true) to apply it."


def apply(pre: Preflight, cfg: RunConfig, auto_fit: bool) -> RunConfig:
    """The configuration to train with, or PreflightError when it won't fit."""
    if pre.fits is not False:
        return cfg
    if not auto_fit or pre.proposal is None:
        raise PreflightError(explain(pre))
    return pre.proposal
