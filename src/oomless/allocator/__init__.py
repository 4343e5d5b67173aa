"""A model of PyTorch's CUDA caching allocator, replayed over an alloc/free stream.

Pure Python, torch-free. It follows ``c10/cuda/CUDACachingAllocator.cpp``
(DeviceCachingAllocator: ``malloc``, ``get_free_block``, ``should_split``,
``alloc_found_block``, ``free_block``, ``try_merge_blocks``,
``release_available_cached_blocks``, ``release_cached_blocks`` and the
expandable-segment functions ``find_expandable_block``, ``map_block``,
``try_allocate_expandable_block``, ``unmap_block``; compared function by
function with pytorch/pytorch@001074d25084fdb87a799823e395a50f5ec044d3) for one
device and one stream:

- requests round up to 512 bytes (``round_size``; optional power-of-2 divisions);
- ≤ 1 MiB goes to the small pool, served from 2 MiB segments; larger requests
  to the large pool: < 10 MiB from 20 MiB segments, else rounded up to 2 MiB;
- best fit by (size, address); a small block splits when ≥ 512 B remain, a
  large one when the request is below ``max_split_size`` and > 1 MiB remains;
- blocks ≥ ``max_split_size`` serve only requests ≥ ``max_split_size`` and
  within 20 MiB of their size;
- when a new segment does not fit in ``capacity_bytes``: free oversize cached
  blocks and retry, then free every unsplit cached block and retry, then OOM;
- ``expandable_segments``: one growing segment per pool, mapped in 2 MiB
  (small) / 20 MiB (large) pages; any block splits when ≥ 512 B remain;
- ``garbage_collection_threshold`` (``garbage_collect_cached_blocks``): with
  the process's memory fraction set, before a new segment is requested, unsplit
  cached large blocks at least as old as the average (in ``get_free_block``
  calls) are released until reserved memory is back under the threshold.

A training run, not one step: ``oomless.allocator.stepstream`` scales a traced
step's stream to any length and ``oomless.allocator.run`` replays many steps.

Not modelled: several streams (training runs on one), CUDA graphs' private
pools. ``allocated`` counts block sizes, as
``torch.cuda.memory_allocated`` does, so an unsplit 20 MiB block serving a
19.5 MiB request counts 20 MiB.
"""

from .caching import CachingAllocator
from .config import (
    LARGE_BUFFER_BYTES,
    MIN_BLOCK_BYTES,
    MIN_LARGE_ALLOC_BYTES,
    ROUND_LARGE_BYTES,
    SMALL_BUFFER_BYTES,
    SMALL_SIZE_BYTES,
    AllocatorConfig,
    SimulatedOOM,
    allocation_size,
    fresh_block_bytes,
    round_size,
)
from .replay import ALLOC, FREE, AllocatorReport, downsample, replay, stream_from_sizes

__all__ = [
    "ALLOC", "FREE", "LARGE_BUFFER_BYTES", "MIN_BLOCK_BYTES", "MIN_LARGE_ALLOC_BYTES",
    "ROUND_LARGE_BYTES", "SMALL_BUFFER_BYTES", "SMALL_SIZE_BYTES", "AllocatorConfig",
    "AllocatorReport", "CachingAllocator", "SimulatedOOM", "allocation_size",
    "fresh_block_bytes", "downsample",
    "replay", "round_size", "stream_from_sizes",
]
