"""Derived quantities of one GPU event: who holds the memory, how much was missing."""

from __future__ import annotations

from dataclasses import dataclass

from .events import OomEvent, ProcessMemory


@dataclass(frozen=True)
class GpuView:
    total_bytes: int | None
    free_bytes: int | None
    requested_bytes: int | None
    allocated_bytes: int | None
    unallocated_bytes: int | None  # reserved by PyTorch but not allocated
    reserved_bytes: int | None
    self_bytes: int | None  # this process, non-PyTorch memory included (NVML)
    others: tuple[ProcessMemory, ...]
    allowed_bytes: int | None = None  # set_per_process_memory_fraction's cap

    def big_others(self, total: int, limit: int = 6) -> tuple[ProcessMemory, ...]:
        """Other processes worth naming (≥ 1% of the GPU), largest first."""
        big = sorted((p for p in self.others if p.memory_bytes >= 0.01 * total),
                     key=lambda p: -p.memory_bytes)
        return tuple(big[:limit])

    @property
    def used_bytes(self) -> int | None:
        if self.total_bytes is None or self.free_bytes is None:
            return None
        return self.total_bytes - self.free_bytes

    @property
    def others_bytes(self) -> int:
        return sum(p.memory_bytes for p in self.others)

    @property
    def available_bytes(self) -> int | None:
        """Free device memory this process could still take (under its cap, if any)."""
        if self.free_bytes is None:
            return None
        if self.allowed_bytes is not None and self.reserved_bytes is not None:
            return min(self.free_bytes, max(0, self.allowed_bytes - self.reserved_bytes))
        return self.free_bytes

    @property
    def shortfall_bytes(self) -> int | None:
        """How much more the failed request needed than was free (under the cap, if any)."""
        if self.requested_bytes is None or self.available_bytes is None:
            return None
        return max(0, self.requested_bytes - self.available_bytes)

    @property
    def outside_pytorch_bytes(self) -> int | None:
        """Device memory in use that this process's allocator does not hold."""
        if self.used_bytes is None or self.reserved_bytes is None:
            return None
        return max(0, self.used_bytes - self.reserved_bytes)


def _split_processes(event: OomEvent, reserved: int | None) -> tuple[int | None, tuple[ProcessMemory, ...]]:
    """This process and the others. Inside a container NVML reports host pids, so
    PyTorch cannot recognise itself and lists itself as "Process N": then the
    smallest listed process that can hold PyTorch's reserved memory is taken as self."""
    procs = event.processes
    mine = [p for p in procs if p.is_self]
    if mine:
        return mine[0].memory_bytes, tuple(p for p in procs if not p.is_self)
    if not procs or reserved is None:
        return None, procs
    candidates = [p for p in procs if p.memory_bytes >= reserved]
    if not candidates:
        return None, procs
    me = min(candidates, key=lambda p: p.memory_bytes)
    return me.memory_bytes, tuple(p for p in procs if p is not me)


def _int(event: OomEvent, key: str) -> int | None:
    value = event.numbers.get(key)
    return int(value) if value is not None else None


def gpu_view(event: OomEvent) -> GpuView:
    reserved = _int(event, "reserved_bytes")
    self_bytes, others = _split_processes(event, reserved)
    total = _int(event, "total_bytes")
    return GpuView(
        total_bytes=total,
        free_bytes=_int(event, "free_bytes"),
        requested_bytes=_int(event, "requested_bytes"),
        allocated_bytes=_int(event, "allocated_bytes"),
        unallocated_bytes=_int(event, "reserved_unallocated_bytes"),
        reserved_bytes=reserved,
        self_bytes=self_bytes,
        others=others,
        allowed_bytes=_int(event, "allowed_bytes"),
    )
