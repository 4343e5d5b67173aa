"""The caching allocator itself: pools, blocks, segments (see the package docstring)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .config import (
    _NO_CAPACITY_ADDRESS_SPACE,
    LARGE_BUFFER_BYTES,
    MIN_BLOCK_BYTES,
    ROUND_LARGE_BYTES,
    SMALL_BUFFER_BYTES,
    SMALL_SIZE_BYTES,
    AllocatorConfig,
    SimulatedOOM,
    allocation_size,
    round_size,
)


class _Block:
    __slots__ = ("size", "addr", "allocated", "prev", "next", "small", "mapped", "segment",
                 "requested", "gc_count")

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
        self.gc_count = 0  # get_free_block calls since the block was last used

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
        # garbage_collection_threshold acts only under set_per_process_memory_fraction
        # (``set_fraction`` in the allocator); the allowed maximum is then the capacity
        self._gc_enabled = bool(self.config.garbage_collection_threshold
                                and self.config.memory_fraction_set
                                and self.config.capacity_bytes is not None)
        self.num_gc_releases = 0

    # ---- public ------------------------------------------------------------
    def malloc(self, orig_size: int) -> _Block:
        size = round_size(orig_size, self.config.roundup_power2_divisions)
        pool = self.small_pool if size <= SMALL_SIZE_BYTES else self.large_pool
        block = self._get_free_block(pool, size)
        if block is None:
            if self._gc_enabled:
                self._garbage_collect_cached_blocks()
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
        if self._gc_enabled:  # track block reuse intervals only when GC is on
            for cached in pool.blocks.values():
                cached.gc_count += 1
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
        block.gc_count = 0
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

    def place_next_segment(self, address: int) -> None:
        """Put the next segment at ``address``, where the device put it in a recorded
        stream. The driver's choice of addresses (it reuses released ranges, not always
        upward) decides best-fit ties between free blocks of equal size; without this the
        model numbers its segments upward."""
        self._next_addr = address

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

    def _garbage_collect_cached_blocks(self) -> None:
        """``garbage_collect_cached_blocks``: above threshold × allowed maximum, release
        unsplit cached large blocks at least as old as the average, oldest rounds
        first, until the excess is reclaimed (the whole round finishes)."""
        allowed = self.config.capacity_bytes or 0
        gc_threshold = int(self.config.garbage_collection_threshold * allowed)
        if self.reserved_bytes <= gc_threshold:
            return
        target, reclaimed = self.reserved_bytes - gc_threshold, 0
        pool = self.large_pool
        freeable = [b for b in pool.blocks.values()
                    if not b.is_split and not b.segment.expandable]
        total_age = sum(b.gc_count for b in freeable)
        freed = True
        while reclaimed < target and freed and freeable:
            age_threshold = total_age / len(freeable)
            freed = False
            for block in [pool.blocks[k] for k in pool.keys]:
                if block in freeable and block.gc_count >= age_threshold:
                    freed = True
                    reclaimed += block.size
                    total_age -= block.gc_count
                    freeable.remove(block)
                    self._release_block(block, pool)
                    self.num_gc_releases += 1

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
