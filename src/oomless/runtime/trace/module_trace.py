"""Trace the training step of a model oomless does not build itself.

``oomless trace`` builds transformers models from their configs. A model that
transformers lacks (remote code such as GLM-4V's EVA2-CLIP tower) can still be
traced if the caller builds it on fake tensors (``runtime.build.fake_mode``) and
says how its loss is computed: the same tracked steps, CUDA emulation and
allocator simulation run on it.
"""

from __future__ import annotations

from typing import Any

from ...allocator import AllocatorConfig
from ...config import RunConfig
from ...models.hardware import Cluster
from .analysis import TraceStats, analyze, module_peaks


def trace_module(model: Any, cfg: RunConfig, batch: dict[str, Any], *, num_layers: int,
                 loss_fn: Any, cluster: Cluster | None = None, alloc_conf: str | None = None,
                 full_batch_values: bool = True) -> TraceStats:
    """Two HF-Trainer steps of ``model`` (fake tensors) with ``loss_fn(model, batch)``."""
    from ..build import count_params, count_trainable, fake_mode
    from .cuda_emulation import CudaEmulation
    from .expansion import stream_of
    from .fake import _cublas_bytes
    from .tracked_run import run_tracked

    tracker = run_tracked(model, cfg, batch, None, device_type="cpu", fake=fake_mode(),
                          num_layers=num_layers, loss_fn=loss_fn,
                          emulation=CudaEmulation(cublas_bytes=_cublas_bytes(cluster)),
                          full_batch_values=full_batch_values)
    stats = analyze(stream_of(tracker), AllocatorConfig.from_conf(alloc_conf),
                    num_layers=num_layers, param_count=count_params(model),
                    trainable_params=count_trainable(model), module_peaks=module_peaks(tracker))
    stats.traced_layers = num_layers
    return stats
