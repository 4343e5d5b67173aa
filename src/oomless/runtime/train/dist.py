"""Process-group helpers: one process, or several started by torchrun/accelerate.

With several processes and no sharding engine, oomless keeps one full
replica per rank and sums gradients itself after every optimizer step's
micro batches (one coalesced all_reduce). Doing the reduction after the OOM
agreement, not inside backward as DDP does, means no rank can be stuck in a
gradient collective while another one is recovering from an OOM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: Any = None
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    # ---- collectives (no-ops in one process) ------------------------------
    def any_true(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank (all_reduce MAX): the OOM agreement."""
        if not self.active:
            return flag
        return bool(self.all_reduce([1.0 if flag else 0.0], op="max")[0])

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        if not self.active:
            return list(values)
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return t.tolist()

    def gather(self, values: list[float]) -> list[list[float]]:
        """Every rank's ``values`` (same length on all ranks), in rank order."""
        if not self.active:
            return [list(values)]
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        out = [torch.zeros_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t)
        return [o.tolist() for o in out]

    def gather_objects(self, obj: object) -> list[object]:
        """Every rank's picklable ``obj``, in rank order (small objects only)."""
        if not self.active:
            return [obj]
        import torch.distributed as dist

        out: list[object] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def sum_gradients(self, params: list[Any]) -> None:
        """Sum the gradients of ``params`` over ranks, in one flat buffer."""
        if not self.active:
            return
        import torch
        import torch.distributed as dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p, g in zip(params, grads, strict=True):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(g).clone()
            offset += n

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.barrier()

    def broadcast_str(self, text: str | None) -> str | None:
        if not self.active:
            return text
        import torch.distributed as dist

        box = [text]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _comm_device(self) -> Any:
        import torch.distributed as dist

        return self.device if dist.get_backend() == "nccl" else "cpu"

    def close(self) -> None:
        """Destroy the process groups this process created (see release_process_groups)."""
        if self.owns_group:
            self.owns_group = False
            _LEFT_BEHIND.extend(release_process_groups())


_LEFT_BEHIND: list[str] = []  # groups Dist.close could not shut down (still referenced)


def groups_left_behind() -> list[str]:
    """Names of the process groups whose backends outlived Dist.close: something (a
    library's cache) still references them, so their worker threads live on into
    interpreter shutdown, where they can abort the process (release_process_groups).
    ``oomless train`` then ends its process without that shutdown (oomless.cli.run)."""
    return list(_LEFT_BEHIND)


# Module globals in which a library keeps process groups it created, with the value each
# has before any group exists (deepspeed/utils/groups.py: the clone of the world group
# `_clone_world_group` makes, the ZeRO, model and expert parallel groups). One row per library.
LIBRARY_GROUP_CACHES: dict[str, dict[str, Any]] = {
    "deepspeed.utils.groups": {
        "_WORLD_GROUP": None, "_ZERO_PARAM_INTRA_PARALLEL_GROUP": None,
        "_DATA_PARALLEL_GROUP": None, "_MODEL_PARALLEL_GROUP": None,
        "_TENSOR_MODEL_PARALLEL_GROUP": None, "_EXPERT_PARALLEL_GROUP": {},
        "_EXPERT_DATA_PARALLEL_GROUP": {}, "_ALL_TO_ALL_GROUP": {},
    },
}


def release_process_groups() -> list[str]:
    """Destroy every process group now, while the interpreter is whole; returns the names
    of those that something still references (empty when all are gone).

    Why: a gloo process group runs its collectives on worker threads
    (ProcessGroupGloo::runLoop), and a worker drops the finished work — and the tensors
    in it — after the caller has already returned. When Python had let go of such a
    tensor first, its Python object is owned by the tensor and freeing it takes the GIL
    (TensorImpl::decref_pyobject). Once interpreter shutdown has begun, a thread that
    asks for the GIL is ended with pthread_exit; that unwinds through the work's
    noexcept destructor and std::terminate aborts the process ("terminate called without
    an active exception") after a completed run. torch.distributed.destroy_process_group
    only unregisters groups: the backend, and its worker threads, go when the last
    reference does — the ProcessGroupGloo destructor then waits for its workers. So the
    engines' own references are dropped by the caller before this; here torch's
    registry, the libraries' group caches (LIBRARY_GROUP_CACHES), default arguments
    bound to a group (_unbind_default_arguments) and the reference cycles left
    (modules, parameters holding their group) go too.
    """
    import gc
    import weakref

    import torch.distributed as dist

    if not dist.is_initialized():
        return []
    groups = [weakref.ref(pg) for pg in list(dist.distributed_c10d._world.pg_map)]
    dist.destroy_process_group()
    _forget_library_groups()
    _unbind_default_arguments({id(pg) for pg in (ref() for ref in groups) if pg is not None})
    gc.collect()
    return [_group_name(pg) for pg in (ref() for ref in groups) if pg is not None]


def _forget_library_groups() -> None:
    import sys

    for module_name, defaults in LIBRARY_GROUP_CACHES.items():
        module = sys.modules.get(module_name)
        for name, empty in defaults.items():
            if module is not None and hasattr(module, name):
                setattr(module, name, type(empty)() if isinstance(empty, dict) else empty)


def _unbind_default_arguments(group_ids: set[int]) -> None:
    """Functions written ``def f(..., group=group.WORLD)`` hold the default group from
    the moment their module is imported, if a group existed then: torch's own
    torch.distributed.nn.functional (imported by transformers' model modules through
    torch.distributed.fsdp) and deepspeed.comm.torch.TorchBackend.barrier. Such a
    default now names a destroyed group; None, the default group at call time, is what
    the signature means."""
    import gc
    import types

    for fn in gc.get_objects():
        if not isinstance(fn, types.FunctionType):
            continue
        if fn.__defaults__ and any(id(v) in group_ids for v in fn.__defaults__):
            fn.__defaults__ = tuple(None if id(v) in group_ids else v for v in fn.__defaults__)
        if fn.__kwdefaults__ and any(id(v) in group_ids for v in fn.__kwdefaults__.values()):
            fn.__kwdefaults__ = {k: None if id(v) in group_ids else v
                                 for k, v in fn.__kwdefaults__.items()}


def _group_name(pg: Any) -> str:
    try:
        return str(pg.group_name)
    except Exception:  # a group whose name torch no longer knows
        return repr(pg)


def init_dist() -> Dist:
    """Join the process group that torchrun / accelerate launch set up in the environment."""
    import torch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and os.environ.get("OOMLESS_DEVICE", "") != "cpu"
    device = torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    owns = False
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if cuda else "gloo")
            owns = True
    return Dist(rank, world, local_rank, device, owns)
