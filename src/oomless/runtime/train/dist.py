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
        if self.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.owns_group = False


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
