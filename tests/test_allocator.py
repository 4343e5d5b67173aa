"""The caching-allocator simulation against hand-worked streams.

Each expectation below is worked out by hand from the rules of
c10/cuda/CUDACachingAllocator.cpp (see the module docstring of
oomless.allocator); MiB = 1048576 bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomless.allocator import (
    AllocatorConfig,
    CachingAllocator,
    SimulatedOOM,
    allocation_size,
    downsample,
    replay,
    round_size,
    stream_from_sizes,
)
from oomless.errors import ConfigError

MiB = 1 << 20


def run(sizes, **cfg):
    return replay(stream_from_sizes(sizes), AllocatorConfig(**cfg))


def test_round_size_and_segment_sizes():
    assert round_size(1) == 512
    assert round_size(512) == 512
    assert round_size(513) == 1024
    # power-of-2 divisions: 1_200_000 lies in [2^20, 2^21); 4 divisions of 2^18
    assert round_size(1_200_000, 4) == 2**20 + 2**18
    assert round_size(1200, 4) == 1536  # below 512 × 4: plain 512 rounding
    assert allocation_size(512) == 2 * MiB  # small pool: 2 MiB segments
    assert allocation_size(1 * MiB) == 2 * MiB
    assert allocation_size(1 * MiB + 512) == 20 * MiB  # 1-10 MiB: 20 MiB segments
    assert allocation_size(10 * MiB) == 10 * MiB  # ≥ 10 MiB: rounded to 2 MiB
    assert allocation_size(11 * MiB) == 12 * MiB


def test_small_requests_share_a_2mib_segment():
    r = run([100, 700])
    assert r.peak_allocated_bytes == 512 + 1024
    assert r.peak_reserved_bytes == 2 * MiB
    assert r.peak_requested_bytes == 800


def test_medium_request_splits_a_20mib_segment():
    r = run([3 * MiB // 2])
    assert r.peak_allocated_bytes == 3 * MiB // 2
    assert r.peak_reserved_bytes == 20 * MiB


def test_unsplit_remainder_counts_as_allocated():
    # 19.5 MiB → 20 MiB segment; 0.5 MiB left is not > 1 MiB: no split, so
    # memory_allocated shows the whole 20 MiB block
    r = run([19 * MiB + MiB // 2])
    assert r.peak_allocated_bytes == 20 * MiB
    assert r.peak_reserved_bytes == 20 * MiB
    # 25 MiB → 26 MiB segment, 1 MiB left: not split either
    assert run([25 * MiB]).peak_allocated_bytes == 26 * MiB


def test_cached_block_is_reused_and_split():
    # 12 MiB segment, freed, then 8 MiB takes it: 4 MiB > 1 MiB remains → split
    r = run([12 * MiB, -1, 8 * MiB])
    assert r.final_allocated_bytes == 8 * MiB
    assert r.peak_reserved_bytes == 12 * MiB


def test_fragmentation_needs_a_new_segment():
    # A, B 12 MiB; free A; C 14 MiB does not fit the cached 12 MiB → 14 MiB more
    r = run([12 * MiB, 12 * MiB, -1, 14 * MiB])
    assert r.peak_reserved_bytes == 38 * MiB
    assert r.final_allocated_bytes == 26 * MiB


def test_growing_requests_fragment_without_expandable_segments():
    grow = [11 * MiB, -1, 12 * MiB, -2, 13 * MiB]
    # 11 → 12 MiB segment, reused by 12; 13 → new 14 MiB segment
    assert run(grow).peak_reserved_bytes == 26 * MiB
    # expandable: one 20 MiB page holds all three in turn
    assert run(grow, expandable_segments=True).peak_reserved_bytes == 20 * MiB


def test_expandable_segment_grows_by_20mib_pages():
    # A 12 MiB maps page 0 (20 MiB); B 12 MiB uses the 8 MiB left plus a new page
    r = run([12 * MiB, 12 * MiB], expandable_segments=True)
    assert r.peak_reserved_bytes == 40 * MiB
    assert r.peak_allocated_bytes == 24 * MiB  # expandable blocks always split


def test_free_cached_and_retry_before_oom():
    # capacity 40 MiB: the cached 30 MiB segment is released, then 32 MiB fits
    r = run([30 * MiB, -1, 32 * MiB], capacity_bytes=40 * MiB)
    assert r.oom_at_event is None
    assert r.num_alloc_retries == 1
    assert r.final_reserved_bytes == 32 * MiB


def test_oom_when_nothing_cached_can_be_released():
    r = run([30 * MiB, 12 * MiB], capacity_bytes=40 * MiB)
    assert r.oom_at_event == 1
    assert r.oom_request_bytes == 12 * MiB
    with pytest.raises(SimulatedOOM, match="tried to allocate"):
        a = CachingAllocator(AllocatorConfig(capacity_bytes=MiB))
        a.malloc(4 * MiB)


def test_max_split_size_keeps_oversize_blocks_for_large_requests():
    cfg = {"max_split_size_bytes": 32 * MiB}
    # cached 40 MiB oversize block does not serve a 30 MiB (< max_split) request
    assert run([40 * MiB, -1, 30 * MiB], **cfg).peak_reserved_bytes == 70 * MiB
    # ... it serves a 45 MiB? no: 40 < 45. A cached 70 MiB block serves 45 MiB? no: 70 ≥ 45 + 20
    assert run([70 * MiB, -1, 45 * MiB], **cfg).peak_reserved_bytes == 116 * MiB
    # within 20 MiB it is reused as is (no split of oversize blocks)
    r = run([50 * MiB, -1, 45 * MiB], **cfg)
    assert r.peak_reserved_bytes == 50 * MiB
    assert r.final_allocated_bytes == 50 * MiB
    # without max_split_size the 70 MiB block is split for 45 MiB
    assert run([70 * MiB, -1, 45 * MiB]).peak_reserved_bytes == 70 * MiB


def test_max_split_size_releases_oversize_blocks_first():
    cfg = {"max_split_size_bytes": 32 * MiB, "capacity_bytes": 100 * MiB}
    # 40 MiB cached; 70 MiB request: 110 > 100, the oversize block is released
    r = run([40 * MiB, -1, 70 * MiB], **cfg)
    assert r.oom_at_event is None
    assert r.final_reserved_bytes == 70 * MiB


def test_freed_neighbours_merge_back():
    # three 4 MiB blocks split from one 20 MiB segment; freeing all merges them,
    # so a 16 MiB request fits the same segment
    r = run([4 * MiB, 4 * MiB, 4 * MiB, -1, -2, -3, 16 * MiB])
    assert r.peak_reserved_bytes == 20 * MiB
    assert r.final_allocated_bytes == 16 * MiB


def test_best_fit_takes_the_smallest_cached_block_that_fits():
    # get_free_block: pool.blocks.lower_bound(search_key) in a set ordered by
    # BlockComparatorSize (stream, size, address): the smallest block >= the request.
    # A 30 MiB and B 14 MiB cached; 12 MiB takes B (2 MiB > 1 MiB left: split), so
    # 28 MiB still finds A: nothing new is reserved. Taking A first would need 28 MiB more
    r = run([30 * MiB, 14 * MiB, -1, -2, 12 * MiB, 28 * MiB])
    assert r.peak_reserved_bytes == 44 * MiB
    assert r.final_allocated_bytes == 40 * MiB


def test_equal_sizes_go_to_the_lower_address():
    # BlockComparatorSize's last key is the block's address (ptr)
    alloc = CachingAllocator()
    a, b = alloc.malloc(12 * MiB), alloc.malloc(12 * MiB)
    low = min(a.addr, b.addr)
    alloc.free(b)
    alloc.free(a)
    assert alloc.malloc(12 * MiB).addr == low


def test_split_thresholds_of_both_pools():
    # should_split: a small block splits when >= kMinBlockSize (512 B) remains, so a
    # 2 MiB segment serves 1 MiB, 1 MiB - 512 and then exactly 512 B
    r = run([MiB, MiB - 512, 512])
    assert r.peak_reserved_bytes == 2 * MiB
    assert r.final_allocated_bytes == 2 * MiB
    # a large block splits only when more than kSmallSize (1 MiB) remains: 25 MiB - 512
    # in a 26 MiB segment leaves 1 MiB + 512, split off (25 MiB left 1 MiB: not split,
    # test_unsplit_remainder_counts_as_allocated)
    assert run([25 * MiB - 512]).peak_allocated_bytes == 25 * MiB - 512


def test_a_freed_block_merges_with_both_neighbours_at_once():
    # free_block tries {block->prev, block->next} in turn (try_merge_blocks): freeing
    # the middle of three 4 MiB blocks last joins A, B, C and the 8 MiB tail into the
    # whole 20 MiB segment, which a 20 MiB request then takes without a new segment
    r = run([4 * MiB, 4 * MiB, 4 * MiB, -1, -3, -2, 20 * MiB])
    assert r.peak_reserved_bytes == 20 * MiB
    assert r.final_allocated_bytes == 20 * MiB


def test_freeing_the_cache_keeps_segments_with_a_live_block():
    # release_cached_blocks -> release_blocks frees only blocks with no prev and no
    # next (unsplit): A's 20 MiB segment (split, A live) stays, B's cached 30 MiB goes,
    # and 40 MiB then fits in 60 MiB after one retry
    r = run([4 * MiB, 30 * MiB, -2, 40 * MiB], capacity_bytes=60 * MiB)
    assert r.oom_at_event is None and r.num_alloc_retries == 1
    assert r.final_reserved_bytes == 60 * MiB


def test_alloc_conf_parsing():
    cfg = AllocatorConfig.from_conf("expandable_segments:True, max_split_size_mb:128")
    assert cfg.expandable_segments and cfg.max_split_size_bytes == 128 * MiB
    assert cfg.describe() == "expandable_segments:True,max_split_size_mb:128"
    assert AllocatorConfig.from_conf(None) == AllocatorConfig()
    with pytest.raises(ConfigError, match="more than 20"):
        AllocatorConfig.from_conf("max_split_size_mb:16")
    with pytest.raises(ConfigError, match="unknown option 'foo'"):
        AllocatorConfig.from_conf("foo:1")
    with pytest.raises(ConfigError, match="needs an integer"):
        AllocatorConfig.from_conf("max_split_size_mb:big")


def test_downsample_keeps_the_peak():
    pts = [(i, (i * 7919) % 1000, 0) for i in range(10_000)]
    small = downsample(pts, 100)
    assert len(small) <= 101
    assert max(p[1] for p in small) == max(p[1] for p in pts)


def test_timeline_is_recorded():
    r = replay(stream_from_sizes([MiB, 2 * MiB, -1]), timeline_points=10)
    assert [p[1] for p in r.timeline] == [MiB, 3 * MiB, 2 * MiB]


_sizes = st.integers(min_value=1, max_value=64 * MiB)


@st.composite
def _streams(draw):
    n = draw(st.integers(min_value=1, max_value=60))
    live: list[int] = []
    out, key = [], 0
    for _ in range(n):
        if live and draw(st.booleans()):
            out.append(-live.pop(draw(st.integers(0, len(live) - 1))))
        else:
            key += 1
            live.append(key)
            out.append(draw(_sizes))
    return out + [-k for k in live]


@settings(max_examples=150, deadline=None)
@given(_streams(), st.booleans(), st.sampled_from([None, 64 * MiB]))
def test_invariants_on_random_streams(sizes, expandable, max_split):
    cfg = AllocatorConfig(expandable_segments=expandable, max_split_size_bytes=max_split)
    alloc = CachingAllocator(cfg)
    blocks: dict[int, object] = {}
    key = 0
    for v in sizes:
        if v > 0:
            key += 1
            blocks[key] = alloc.malloc(v)
        else:
            alloc.free(blocks.pop(-v))
        assert alloc.requested_bytes <= alloc.allocated_bytes <= alloc.reserved_bytes
        assert alloc.allocated_bytes % 512 == 0
    assert alloc.allocated_bytes == 0
    alloc.empty_cache()
    assert alloc.reserved_bytes == 0  # every segment merged back and was released


GC = {"capacity_bytes": 100 * MiB, "garbage_collection_threshold": 0.5,
      "memory_fraction_set": True}


def test_garbage_collection_releases_blocks_older_than_average():
    # A 30 MiB and B 40 MiB cached; each failed lookup ages them (A twice, B once).
    # D 50 MiB: reserved 70 > 0.5 × 100 → GC frees blocks with age ≥ 1.5: only A,
    # which reclaims the 20 MiB excess; D then gets a new segment without a retry
    r = run([30 * MiB, -1, 40 * MiB, -2, 50 * MiB], **GC)
    assert r.final_reserved_bytes == 90 * MiB and r.num_alloc_retries == 0
    # without GC the 120 MiB do not fit: every cached segment is freed and retried
    r = run([30 * MiB, -1, 40 * MiB, -2, 50 * MiB], capacity_bytes=100 * MiB)
    assert r.final_reserved_bytes == 50 * MiB and r.num_alloc_retries == 1


def test_garbage_collection_needs_the_memory_fraction():
    # PyTorch runs it only under set_per_process_memory_fraction (set_fraction)
    cfg = {**GC, "memory_fraction_set": False}
    r = run([30 * MiB, -1, 40 * MiB, -2, 50 * MiB], **cfg)
    assert r.final_reserved_bytes == 50 * MiB and r.num_alloc_retries == 1


def test_garbage_collection_threshold_parsing():
    cfg = AllocatorConfig.from_conf("garbage_collection_threshold:0.8")
    assert cfg.garbage_collection_threshold == 0.8
    assert cfg.describe() == "garbage_collection_threshold:0.8"
    for bad in ("0", "1.0", "x"):
        with pytest.raises(ConfigError, match="greater than 0.0 and less than 1.0"):
            AllocatorConfig.from_conf(f"garbage_collection_threshold:{bad}")


GPU_STREAMS = Path(__file__).parents[1] / "benchmarks" / "results" / "gpu_streams"


@pytest.mark.parametrize("path", sorted(GPU_STREAMS.glob("*.json.gz")), ids=lambda p: p.name)
def test_the_model_replays_a_gpu_allocator_stream_to_the_measured_peaks(path):
    """Event streams the CUDA caching allocator itself logged on a GPU
    (benchmarks/gpu_streams.py record; torch.cuda.memory history, every alloc, free
    and segment event), replayed through the model with each segment where the device
    put it, give the peaks measured in the same run to the byte: allocated and
    reserved memory follow from the stream and the allocator's rules, nothing tuned.
    (With the model's own upward addresses, best-fit ties between equal free blocks
    can go the other way: one 128 MiB segment more on one stream.)"""
    import gzip
    import json
    import sys

    sys.path.insert(0, str(GPU_STREAMS.parents[1]))
    from gpu_streams import replay_recorded

    with gzip.open(path, "rt") as f:
        rec = json.load(f)
    allocated, reserved = replay_recorded(rec["events"])
    assert reserved == rec["measured"]["peak_reserved_bytes"]
    assert allocated == rec["measured"]["peak_allocated_bytes"]
