"""Allocator constants, ``PYTORCH_CUDA_ALLOC_CONF`` options and request rounding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..units import MiB

MIN_BLOCK_BYTES = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
SMALL_SIZE_BYTES = 1 * MiB  # kSmallSize: largest "small" allocation
SMALL_BUFFER_BYTES = 2 * MiB  # kSmallBuffer: small allocations are packed in 2 MiB segments
LARGE_BUFFER_BYTES = 20 * MiB  # kLargeBuffer: 1-10 MiB requests share 20 MiB segments
MIN_LARGE_ALLOC_BYTES = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE_BYTES = 2 * MiB  # kRoundLarge: large segments round up to 2 MiB
# ExpandableSegment reserves address space for 1 1/8 of the GPU's memory.
_NO_CAPACITY_ADDRESS_SPACE = 1 << 48


def fresh_block_bytes(n_bytes: float) -> float:
    """Bytes a request occupies (what ``memory_allocated`` counts) when it gets a new
    segment: requests above kMinLargeAlloc get a segment rounded up to kRoundLarge, and
    a remainder of at most kSmallSize is not split off, so it stays in the block
    (c10/cuda/CUDACachingAllocator.cpp ``get_allocation_size``, ``should_split``)."""
    if n_bytes <= MIN_LARGE_ALLOC_BYTES:
        return n_bytes
    segment = -(-n_bytes // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES
    return segment if segment - n_bytes <= SMALL_SIZE_BYTES else n_bytes


class SimulatedOOM(Exception):
    """The simulated allocator could not serve a request within its capacity."""

    def __init__(self, size_bytes: int, allocated_bytes: int, reserved_bytes: int):
        super().__init__(
            f"simulated CUDA OOM: tried to allocate {size_bytes} bytes with "
            f"{allocated_bytes} allocated and {reserved_bytes} reserved"
        )
        self.size_bytes = size_bytes
        self.allocated_bytes = allocated_bytes
        self.reserved_bytes = reserved_bytes


@dataclass(frozen=True)
class AllocatorConfig:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` options the simulation honours.

    ``capacity_bytes``: the most the allocator may reserve (GPU memory minus
    CUDA context and other non-PyTorch memory); None: unlimited.
    """

    max_split_size_bytes: int | None = None
    expandable_segments: bool = False
    roundup_power2_divisions: int = 0
    capacity_bytes: int | None = None
    garbage_collection_threshold: float = 0.0
    # torch.cuda.set_per_process_memory_fraction was called: the only case in which
    # PyTorch's allocator runs its garbage collection (``set_fraction``)
    memory_fraction_set: bool = False

    @classmethod
    def from_conf(cls, text: str | None, capacity_bytes: int | None = None) -> AllocatorConfig:
        """Parse ``"expandable_segments:True,max_split_size_mb:128"``."""
        opts: dict[str, Any] = {"capacity_bytes": capacity_bytes}
        for item in filter(None, (p.strip() for p in (text or "").split(","))):
            key, _, value = item.partition(":")
            key, value = key.strip(), value.strip()
            if key == "expandable_segments":
                opts["expandable_segments"] = value.lower() == "true"
            elif key == "max_split_size_mb":
                mb = _int_option(key, value)
                if mb <= LARGE_BUFFER_BYTES // MiB:
                    raise ConfigError(
                        f"PYTORCH_CUDA_ALLOC_CONF: max_split_size_mb:{value} is too small; "
                        "PyTorch requires more than 20 (MiB)"
                    )
                opts["max_split_size_bytes"] = mb * MiB
            elif key == "roundup_power2_divisions" and not value.startswith("["):
                opts["roundup_power2_divisions"] = _int_option(key, value)
            elif key == "garbage_collection_threshold":
                opts["garbage_collection_threshold"] = _gc_threshold(value)
            elif key in ("backend", "release_lock_on_cudamalloc",
                         "pinned_use_cuda_host_register", "pinned_num_register_threads",
                         "roundup_power2_divisions"):
                continue  # accepted by PyTorch, not modelled here
            else:
                raise ConfigError(
                    f"PYTORCH_CUDA_ALLOC_CONF: unknown option '{key}'; expected "
                    "expandable_segments, max_split_size_mb, roundup_power2_divisions or "
                    "garbage_collection_threshold"
                )
        return cls(**opts)

    def describe(self) -> str:
        parts = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size_bytes is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size_bytes // MiB}")
        if self.roundup_power2_divisions:
            parts.append(f"roundup_power2_divisions:{self.roundup_power2_divisions}")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold:g}")
        return ",".join(parts) or "default"


def _int_option(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(
            f"PYTORCH_CUDA_ALLOC_CONF: '{key}' needs an integer, got '{value}'"
        ) from None


def _gc_threshold(value: str) -> float:
    """PyTorch accepts a fraction strictly between 0 and 1 (``parseGarbageCollectionThreshold``)."""
    try:
        threshold = float(value)
    except ValueError:
        threshold = -1.0
    if not 0.0 < threshold < 1.0:
        raise ConfigError(
            f"PYTORCH_CUDA_ALLOC_CONF: garbage_collection_threshold:{value} is not a fraction; "
            "PyTorch requires a value greater than 0.0 and less than 1.0, e.g. 0.8"
        )
    return threshold


def round_size(size: int, divisions: int = 0) -> int:
    """``round_size``: at least 512 B, a multiple of 512 B, or the next power-of-2 division."""
    if size < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    if divisions > 1 and size > MIN_BLOCK_BYTES * divisions:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        base = size & ~(step - 1)
        return size if base == size else base + step
    return MIN_BLOCK_BYTES * -(-size // MIN_BLOCK_BYTES)


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment cudaMalloc gets for a rounded request."""
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return ROUND_LARGE_BYTES * -(-size // ROUND_LARGE_BYTES)
