"""Fixtures shared across the test folders."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from oomless.allocator import ALLOC


def _born_once_freed_once(events: Iterable[tuple]) -> tuple[set, set]:
    """Walk a run's (step, kind, key, size) events (oomless.allocator.run.run_events):
    every key is allocated once, and freed at most once, after its allocation.
    Returns the keys allocated and the keys freed."""
    born, freed = set(), set()
    for _step, kind, key, _size in events:
        if kind == ALLOC:
            assert key not in born
            born.add(key)
        else:
            assert key in born and key not in freed
            freed.add(key)
    return born, freed


@pytest.fixture
def born_once_freed_once():
    """The check above, for the tests of runs through the allocator model."""
    return _born_once_freed_once
