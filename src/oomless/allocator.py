"""A model of PyTorch's CUDA caching allocator, replayed over an alloc/free stream.

Pure Python, torch-free. It follows ``c10/cuda/CUDACachingAllocator.cpp``
(DeviceCachingAllocator: ``malloc``, ``get_free_block``, ``should_split``,
``alloc_found_block``, ``free_block``, ``try_merge_blocks``,
``release_available_cached_blocks``, ``release_cached_blocks`` and the
expandable-segment functions ``find_expandable_block``, ``map_block``,
``try_allocate_expandable_block``, ``unmap_block``) for one device and one
stream:

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
  (small) / 20 MiB (large) pages; any block splits when ≥ 512 B remain.

Not modelled: several streams (training runs on one), CUDA graphs' private
pools, ``garbage_collection_threshold``. ``allocated`` counts block sizes, as
``torch.cuda.memory_allocated`` does, so an unsplit 20 MiB block serving a
19.5 MiB request counts 20 MiB.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .units import MiB

# Constants of c10/cuda/CUDACachingAllocator.cpp
MIN_BLOCK_BYTES = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
SMALL_SIZE_BYTES = 1 * MiB  # kSmallSize: largest "small" allocation
SMALL_BUFFER_BYTES = 2 * MiB  # kSmallBuffer: small allocations are packed in 2 MiB segments
LARGE_BUFFER_BYTES = 20 * MiB  # kLargeBuffer: 1-10 MiB requests share 20 MiB segments
MIN_LARGE_ALLOC_BYTES = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE_BYTES = 2 * MiB  # kRoundLarge: large segments round up to 2 MiB
# ExpandableSegment reserves address space for 1 1/8 of the GPU's memory.
_NO_CAPACITY_ADDRESS_SPACE = 1 << 48


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
            elif key in ("garbage_collection_threshold", "backend", "release_lock_on_cudamalloc",
                         "pinned_use_cuda_host_register", "pinned_num_register_threads",
                         "roundup_power2_divisions"):
                continue  # accepted by PyTorch, not modelled here
            else:
                raise ConfigError(
                    f"PYTORCH_CUDA_ALLOC_CONF: unknown option '{key}'; expected "
                    "expandable_segments, max_split_size_mb or roundup_power2_divisions"
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
        return ",".join(parts) or "default"


def _int_option(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(
            f"PYTORCH_CUDA_ALLOC_CONF: '{key}' needs an integer, got '{value}'"
        ) from None


class _Block:
    __slots__ = ("size", "addr", "allocated", "prev", "next", "small", "mapped", "segment",
                 "requested")

    def __init__(self, size: int, addr: int, small: bool, segment: _Segment):
        self.size = size
        self.addr = addr
        self.small = small
        self.segment = segment
        self.allocated = False
        self.mapped = True
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.requested = 0

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


@dataclass(eq=False)
class _Segment:
    base: int
    expandable: bool
    page_bytes: int = 0


@dataclass(eq=False)
class _Pool:
    """Free blocks sorted by (size, address); unmapped ranges by address."""

    small: bool
    keys: list[tuple[int, int]] = field(default_factory=list)
    blocks: dict[tuple[int, int], _Block] = field(default_factory=dict)
    unmapped: dict[int, _Block] = field(default_factory=dict)

    def insert(self, block: _Block) -> None:
        key = (block.size, block.addr)
        bisect.insort(self.keys, key)
        self.blocks[key] = block

    def remove(self, block: _Block) -> None:
        key = (block.size, block.addr)
        del self.blocks[key]
        del self.keys[bisect.bisect_left(self.keys, key)]


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


class CachingAllocator:
    """One device, one stream. ``malloc`` returns a handle that ``free`` takes back."""

    def __init__(self, config: AllocatorConfig | None = None):
        self.config = config or AllocatorConfig()
        self.small_pool = _Pool(small=True)
        self.large_pool = _Pool(small=False)
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.requested_bytes = 0
        self.peak_allocated_bytes = 0
        self.peak_reserved_bytes = 0
        self.peak_requested_bytes = 0
        self.num_segments = 0
        self.num_alloc_retries = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        self._next_addr = 1 << 40
        self._max_split = self.config.max_split_size_bytes or (1 << 62)

    # ---- public ------------------------------------------------------------
    def malloc(self, orig_size: int) -> _Block:
        size = round_size(orig_size, self.config.roundup_power2_divisions)
        pool = self.small_pool if size <= SMALL_SIZE_BYTES else self.large_pool
        block = self._get_free_block(pool, size)
        if block is None:
            block = (
                self._alloc_block(pool, size)
                or (self._release_available_cached_blocks(pool, size)
                    and self._alloc_block(pool, size))
                or (self._release_cached_blocks() and self._alloc_block(pool, size, retry=True))
            )
        if not block:
            raise SimulatedOOM(allocation_size(size), self.allocated_bytes, self.reserved_bytes)
        return self._alloc_found_block(pool, block, size, orig_size)

    def free(self, block: _Block) -> None:
        block.allocated = False
        self.allocated_bytes -= block.size
        self.requested_bytes -= block.requested
        pool = self.small_pool if block.small else self.large_pool
        for neighbour in (block.prev, block.next):
            self._try_merge(block, neighbour, pool)
        pool.insert(block)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache``: release every unsplit cached segment."""
        self._release_cached_blocks()

    # ---- finding and splitting blocks ---------------------------------------
    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        i = bisect.bisect_left(pool.keys, (size, -1))
        if i == len(pool.keys):
            return None
        block = pool.blocks[pool.keys[i]]
        if block.segment.expandable:
            # best fit counts an expandable block as the size it can grow to
            def grow(b: _Block) -> int:
                return b.size + (b.next.size if b.next and not b.next.mapped else 0)

            while block.segment.expandable and i + 1 < len(pool.keys):
                nxt = pool.blocks[pool.keys[i + 1]]
                if grow(nxt) >= grow(block):
                    break
                i, block = i + 1, nxt
        if size < self._max_split <= block.size:
            return None  # do not return an oversized block for a normal request
        if size >= self._max_split and block.size >= size + LARGE_BUFFER_BYTES:
            return None  # an oversized block may be rounded up, but only by 20 MiB
        pool.remove(block)
        return block

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK_BYTES
        return size < self._max_split and remaining > SMALL_SIZE_BYTES

    def _alloc_found_block(self, pool: _Pool, block: _Block, size: int, orig: int) -> _Block:
        if self._should_split(block, size):
            rest = block
            block = _Block(size, rest.addr, rest.small, rest.segment)
            block.prev, block.next = rest.prev, rest
            if block.prev:
                block.prev.next = block
            rest.prev = block
            rest.addr += size
            rest.size -= size
            pool.insert(rest)
        block.allocated = True
        block.requested = orig
        self.allocated_bytes += block.size
        self.requested_bytes += orig
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        self.peak_requested_bytes = max(self.peak_requested_bytes, self.requested_bytes)
        return block

    def _try_merge(self, dst: _Block, src: _Block | None, pool: _Pool) -> int:
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next:
                dst.next.prev = dst
        dst.size += src.size
        if src.mapped:
            pool.remove(src)
        else:
            del pool.unmapped[src.addr]
        return src.size

    # ---- segments --------------------------------------------------------------
    def _fits(self, extra_bytes: int) -> bool:
        cap = self.config.capacity_bytes
        return cap is None or self.reserved_bytes + extra_bytes <= cap

    def _grow_reserved(self, n_bytes: int) -> None:
        self.reserved_bytes += n_bytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        self.num_device_alloc += 1

    def _alloc_block(self, pool: _Pool, size: int, retry: bool = False) -> _Block | None:
        if retry:
            self.num_alloc_retries += 1
        if self.config.expandable_segments:
            return self._try_allocate_expandable(pool, size)
        alloc = allocation_size(size)
        if not self._fits(alloc):
            return None
        segment = _Segment(self._next_addr, expandable=False)
        self._next_addr += alloc + ROUND_LARGE_BYTES
        self.num_segments += 1
        self._grow_reserved(alloc)
        return _Block(alloc, segment.base, pool.small, segment)

    def _release_block(self, block: _Block, pool: _Pool) -> None:
        pool.remove(block)
        self.reserved_bytes -= block.size
        self.num_segments -= 1
        self.num_device_free += 1

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """Free oversize cached blocks (only with max_split_size set)."""
        if self.config.max_split_size_bytes is None:
            return False
        key = max(size, self._max_split)
        i = bisect.bisect_left(pool.keys, (key, -1))
        if i < len(pool.keys):
            self._release_block(pool.blocks[pool.keys[i]], pool)
            return True
        released = 0
        for k in reversed(list(pool.keys)):  # largest first
            if released >= key or k[0] < self._max_split:
                break
            released += k[0]
            self._release_block(pool.blocks[k], pool)
        return released >= key

    def _release_cached_blocks(self) -> bool:
        """Free every unsplit cached segment; unmap free pages of expandable ones."""
        for pool in (self.large_pool, self.small_pool):
            to_unmap = []
            for key in list(pool.keys):
                block = pool.blocks[key]
                if block.segment.expandable:
                    to_unmap.append(block)
                elif not block.is_split:
                    self._release_block(block, pool)
            for block in to_unmap:
                self._unmap_block(block, pool)
        return True

    # ---- expandable segments ---------------------------------------------------
    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        def allocatable(b: _Block | None) -> bool:
            return b is not None and not b.allocated

        for addr in sorted(pool.unmapped):
            c = pool.unmapped[addr]
            if allocatable(c.prev):
                c = c.prev
            room, b = 0, c
            while room < size and allocatable(b):
                room += b.size
                b = b.next
            if room >= size:
                return c
        page = SMALL_BUFFER_BYTES if pool.small else LARGE_BUFFER_BYTES
        cap = self.config.capacity_bytes
        space = _NO_CAPACITY_ADDRESS_SPACE if cap is None else cap + cap // 8
        space = page * -(-space // page)
        segment = _Segment(self._next_addr, expandable=True, page_bytes=page)
        self._next_addr += space + page
        self.num_segments += 1
        block = _Block(space, segment.base, pool.small, segment)
        block.mapped = False
        pool.unmapped[block.addr] = block
        return block

    def _map_block(self, block: _Block, size: int, pool: _Pool) -> bool:
        seg = block.segment
        begin = (block.addr - seg.base) // seg.page_bytes
        end = -(-(block.addr + size - seg.base) // seg.page_bytes)
        mapped = (end - begin) * seg.page_bytes
        if not self._fits(mapped):
            return False
        del pool.unmapped[block.addr]
        block.mapped = True
        if mapped < block.size:
            rest = _Block(block.size - mapped, block.addr + mapped, block.small, seg)
            rest.mapped = False
            rest.prev, rest.next = block, block.next
            if block.next:
                block.next.prev = rest
            block.next = rest
            pool.unmapped[rest.addr] = rest
            block.size = mapped
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        pool.insert(block)
        self._grow_reserved(mapped)
        return True

    def _try_allocate_expandable(self, pool: _Pool, size: int) -> _Block | None:
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size), pool):
            return None
        while candidate.size < size:
            nxt = candidate.next
            assert nxt is not None
            if not self._map_block(nxt, min(size - candidate.size, nxt.size), pool):
                return None
            candidate = nxt
        pool.remove(candidate)
        return candidate

    def _unmap_block(self, block: _Block, pool: _Pool) -> None:
        seg = block.segment
        first = -(-(block.addr - seg.base) // seg.page_bytes)
        last = (block.addr + block.size - seg.base) // seg.page_bytes
        if first >= last:
            return
        pool.remove(block)
        start, stop = seg.base + first * seg.page_bytes, seg.base + last * seg.page_bytes
        if start > block.addr:
            before = _Block(start - block.addr, block.addr, block.small, seg)
            before.prev, before.next = block.prev, block
            if block.prev:
                block.prev.next = before
            block.prev = before
            pool.insert(before)
        if stop < block.addr + block.size:
            after = _Block(block.addr + block.size - stop, stop, block.small, seg)
            after.prev, after.next = block, block.next
            if block.next:
                block.next.prev = after
            block.next = after
            pool.insert(after)
        block.addr, block.size, block.mapped = start, stop - start, False
        self.reserved_bytes -= block.size
        self.num_device_free += 1
        pool.unmapped[block.addr] = block
        self._try_merge(block, block.prev, pool)
        self._try_merge(block, block.next, pool)
        # _try_merge moves the block's start when it absorbs its predecessor
        if block.addr != start:
            del pool.unmapped[start]
            pool.unmapped[block.addr] = block


# ---- replaying a stream ----------------------------------------------------------
ALLOC = "alloc"
FREE = "free"


@dataclass(frozen=True)
class AllocatorReport:
    """What replaying a stream through the allocator gave."""

    config: str
    peak_allocated_bytes: int  # max of memory_allocated (block sizes)
    peak_reserved_bytes: int  # max of memory_reserved (segments)
    peak_requested_bytes: int  # max of the sum of requested sizes
    reserved_at_peak_allocated_bytes: int
    final_allocated_bytes: int
    final_reserved_bytes: int
    num_events: int
    num_alloc_retries: int
    num_segments_at_end: int
    oom_at_event: int | None = None  # index of the request that did not fit
    oom_request_bytes: int | None = None
    timeline: tuple[tuple[int, int, int], ...] = ()  # (event index, allocated, reserved)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["timeline"] = [list(p) for p in self.timeline]
        return d


def replay(
    events: Iterable[tuple[str, int, int]],
    config: AllocatorConfig | None = None,
    timeline_points: int = 0,
) -> AllocatorReport:
    """Replay ``(ALLOC, key, size_bytes)`` / ``(FREE, key, 0)`` events.

    Zero-byte requests take no block (PyTorch returns a null pointer for them).
    ``timeline_points`` > 0 records (event, allocated, reserved) after every
    event and keeps about that many points, each bucket's highest.
    """
    alloc = CachingAllocator(config)
    live: dict[int, _Block] = {}
    points: list[tuple[int, int, int]] = []
    reserved_at_peak = 0
    oom_at = oom_bytes = None
    n = 0
    for n, (kind, key, size) in enumerate(events):
        if kind == ALLOC:
            if size <= 0:
                continue
            try:
                live[key] = alloc.malloc(size)
            except SimulatedOOM as err:
                oom_at, oom_bytes = n, err.size_bytes
                break
            if alloc.allocated_bytes == alloc.peak_allocated_bytes:
                reserved_at_peak = alloc.reserved_bytes
        else:
            block = live.pop(key, None)
            if block is not None:
                alloc.free(block)
        if timeline_points:
            points.append((n, alloc.allocated_bytes, alloc.reserved_bytes))
    return AllocatorReport(
        config=alloc.config.describe(),
        peak_allocated_bytes=alloc.peak_allocated_bytes,
        peak_reserved_bytes=alloc.peak_reserved_bytes,
        peak_requested_bytes=alloc.peak_requested_bytes,
        reserved_at_peak_allocated_bytes=reserved_at_peak,
        final_allocated_bytes=alloc.allocated_bytes,
        final_reserved_bytes=alloc.reserved_bytes,
        num_events=n + 1 if oom_at is None else n,
        num_alloc_retries=alloc.num_alloc_retries,
        num_segments_at_end=alloc.num_segments,
        oom_at_event=oom_at,
        oom_request_bytes=oom_bytes,
        timeline=tuple(downsample(points, timeline_points)) if timeline_points else (),
    )


def downsample(points: list[tuple[int, ...]], target: int) -> list[tuple[int, ...]]:
    """About ``target`` points: per bucket the point with the highest second field,
    so every peak survives."""
    if len(points) <= target:
        return list(points)
    size = -(-len(points) // target)
    out = []
    for i in range(0, len(points), size):
        bucket = points[i : i + size]
        out.append(max(bucket, key=lambda p: p[1]))
    if out[-1] != points[-1]:
        out.append(points[-1])
    return out


def stream_from_sizes(sizes_and_frees: Iterable[int]) -> list[tuple[str, int, int]]:
    """Test helper: positive n allocates n bytes under the next key; negative -k
    frees key k (keys count from 1)."""
    keys = itertools.count(1)
    out: list[tuple[str, int, int]] = []
    for v in sizes_and_frees:
        out.append((ALLOC, next(keys), v) if v > 0 else (FREE, -v, 0))
    return out
