"""MemoryEstimate: the frozen, JSON-serialisable result of an estimate or trace.

JSON schema (``schema_version`` 1), all byte fields are integers:

- ``method``: "analytic" | "trace" | "measure"
- ``model``, ``param_count``, ``trainable_params``
- ``peak_phase``: phase whose allocation is highest (forward, backward,
  optimizer, evaluation, generation, or inference phases prefill/decode)
- ``peak_allocated_bytes`` (≈ torch.cuda.max_memory_allocated),
  ``peak_reserved_bytes`` (≈ max_memory_reserved), ``device_peak_bytes``
  (≈ nvidia-smi: reserved + CUDA context and other non-PyTorch memory)
- ``breakdown``: {phase: {category: bytes}} where the categories of a phase
  add up to that phase's allocated peak
- ``components``: breakdown of the peak phase
- ``non_pytorch_bytes``: {name: bytes} memory outside PyTorch's allocator
- ``gpu``, ``gpu_memory_bytes``, ``fits``, ``headroom_bytes`` (null without a GPU)
- ``low_bytes``, ``high_bytes``: the uncertainty band around ``device_peak_bytes``
  (memory/band.py: from the errors on published GPU measurements; equal to the
  device peak for a measurement)
- ``verdict``: "fits" (the upper bound fits the GPU), "tight" (the band straddles it)
  or "out of memory" (even the lower bound does not fit); null without a GPU
- ``host_ram_bytes``: host memory the run needs (offload, pinned buffers)
- ``assumptions``: every approximation made, in words
- ``config``: the run configuration, ``extra``: method-specific data
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA_VERSION = 1

EVAL_PHASES = ("evaluation", "generation")  # run by the trainer between steps
TRAIN_PHASES = ("forward", "backward", "optimizer", *EVAL_PHASES)

FITS = "fits"
TIGHT = "tight"
OUT_OF_MEMORY = "out of memory"


def fit_verdict(low_bytes: int, high_bytes: int, gpu_memory_bytes: int) -> str:
    """fits (the upper bound fits), out of memory (not even the lower bound), or tight."""
    if high_bytes <= gpu_memory_bytes:
        return FITS
    if low_bytes > gpu_memory_bytes:
        return OUT_OF_MEMORY
    return TIGHT


@dataclass(frozen=True)
class MemoryEstimate:
    method: str
    model: str
    param_count: int
    trainable_params: int
    peak_phase: str
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_peak_bytes: int
    breakdown: dict[str, dict[str, int]]
    non_pytorch_bytes: dict[str, int]
    assumptions: tuple[str, ...]
    config: dict[str, Any]
    gpu: str | None = None
    gpu_memory_bytes: int | None = None
    host_ram_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    low_bytes: int | None = None  # band around device_peak_bytes (None: no band computed)
    high_bytes: int | None = None
    schema_version: int = SCHEMA_VERSION

    @property
    def components(self) -> dict[str, int]:
        return self.breakdown[self.peak_phase]

    @property
    def fits(self) -> bool | None:
        if self.gpu_memory_bytes is None:
            return None
        return self.device_peak_bytes <= self.gpu_memory_bytes

    @property
    def headroom_bytes(self) -> int | None:
        if self.gpu_memory_bytes is None:
            return None
        return self.gpu_memory_bytes - self.device_peak_bytes

    @property
    def verdict(self) -> str | None:
        """fits / tight / out of memory from the band (null without a GPU)."""
        if self.gpu_memory_bytes is None:
            return None
        low = self.device_peak_bytes if self.low_bytes is None else self.low_bytes
        high = self.device_peak_bytes if self.high_bytes is None else self.high_bytes
        return fit_verdict(low, high, self.gpu_memory_bytes)

    def phase_peaks(self) -> dict[str, int]:
        return {phase: sum(parts.values()) for phase, parts in self.breakdown.items()}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["assumptions"] = list(self.assumptions)
        d["components"] = dict(self.components)
        d["fits"] = self.fits
        d["headroom_bytes"] = self.headroom_bytes
        d["verdict"] = self.verdict
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryEstimate:
        skip = {"components", "fits", "headroom_bytes", "verdict"}
        kwargs = {k: v for k, v in data.items() if k not in skip}
        kwargs["assumptions"] = tuple(kwargs.get("assumptions", ()))
        return cls(**kwargs)
