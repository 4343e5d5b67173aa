"""OOM protection for a transformers Trainer (and its subclasses) that is already built.

``install(trainer, ...)`` (public as ``oomless.hf.protect``) wires, on the
instance only — the class and other Trainers are not touched:

- ``trainer.training_step`` → :class:`guard.StepGuard` around the Trainer's own;
- ``trainer.prediction_step`` → :class:`evaluate.EvalGuard` around the Trainer's own;
- ``trainer.evaluation_loop`` → counts evaluation rounds (fault injection, events);
- ``trainer.accelerator.backward`` → marks "inside the backward" (what a
  recovery must undo) and fires ``:backward`` fault injection;
- a callback (callback.py) for the preflight, memlog.jsonl and events.jsonl;
- ``trainer.log`` → adds the ``oomless/`` memory values to every training log
  (dashboards.py), so TensorBoard, W&B, MLflow… show them.

Nothing here costs time per step when nothing runs out of memory: the
guard calls the original ``training_step`` with the same arguments; with
several ranks one all-reduce of a flag per forward is added (context.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .env import (
    GPU_ENV,
    PROTECT_ENV,
    RUN_DIR_ENV,
    RUN_SUBDIR,
    budget_gb,
    inject_specs,
    preflight_mode,
)

_ATTR = "_oomless_protect"


def _dist(trainer: Any) -> Any:
    from ..train.dist import Dist

    args = trainer.args
    return Dist(rank=args.process_index, world_size=args.world_size,
                local_rank=max(0, args.local_process_index), device=args.device)


def _wrap_backward(ctx: Any) -> None:
    accelerator = ctx.trainer.accelerator
    original = accelerator.backward

    def backward(loss: Any, **kwargs: Any) -> Any:
        ctx.in_backward = True
        out = original(loss, **kwargs)
        if ctx.in_step:
            ctx.injector.check("train", ctx.step, ctx.micro_index, ctx.micro_count, "backward")
        return out

    accelerator.backward = backward


def _wrap_evaluation_loop(ctx: Any) -> None:
    original = ctx.trainer.evaluation_loop

    def evaluation_loop(*args: Any, **kwargs: Any) -> Any:
        ctx.eval_round += 1
        ctx.eval_batch = -1
        return original(*args, **kwargs)

    ctx.trainer.evaluation_loop = evaluation_loop


def install(trainer: Any, *, preflight: str | None = None, gpu: str | None = None,
            run_dir: str | os.PathLike[str] | None = None,
            memory_budget_gb: float | None = None, inject: str | None = None) -> Any:
    """Protect ``trainer`` in place and return it (a second call changes nothing)."""
    if getattr(trainer, _ATTR, None) is not None:
        return trainer
    from ..train.memlog import RunLog
    from ..train.oom import FaultInjector
    from .batch import layout_of
    from .callback import make_callback
    from .context import ProtectContext, engine_kind
    from .dashboards import attach as attach_dashboard
    from .evaluate import EvalGuard
    from .guard import StepGuard

    folder = Path(run_dir or os.environ.get(RUN_DIR_ENV)
                  or Path(trainer.args.output_dir) / RUN_SUBDIR)
    dist = _dist(trainer)
    ctx = ProtectContext(
        trainer=trainer, run_dir=folder, dist=dist, kind=engine_kind(trainer),
        log=RunLog(folder, enabled=dist.is_main, resume=True),
        supervised=bool(os.environ.get(RUN_DIR_ENV)) and run_dir is None,
        injector=FaultInjector(inject_specs(text=inject), dist.rank),
        budget_gb=budget_gb(value=memory_budget_gb), layout=layout_of(trainer),
        enabled=os.environ.get(PROTECT_ENV, "1") != "0")
    setattr(trainer, _ATTR, ctx)
    if ctx.enabled:
        trainer.training_step = StepGuard(ctx, trainer.training_step)
        trainer.prediction_step = EvalGuard(ctx, trainer.prediction_step)
        _wrap_backward(ctx)
    _wrap_evaluation_loop(ctx)
    attach_dashboard(ctx)  # oomless/ memory scalars in the Trainer's own logs (report_to)
    if dist.active:
        _release_groups_at_exit()
    trainer.add_callback(make_callback(ctx, preflight_mode(preflight),
                                       gpu or os.environ.get(GPU_ENV)))
    return trainer


def _release_groups_at_exit() -> None:
    """Several ranks: shut the process groups down when the script ends, while the
    interpreter is still whole (atexit runs before its shutdown), unless the script did.
    A gloo worker thread still alive in that shutdown can abort the process after a
    completed run (oomless.runtime.train.dist.release_process_groups)."""
    import atexit

    atexit.unregister(_release_gloo_groups)  # once, however many Trainers
    atexit.register(_release_gloo_groups)


def _release_gloo_groups() -> None:
    """gloo only: its destroy_process_group waits for no peer, while NCCL's may, after a
    failure on another rank (torchtitan destroys only after a successful run)."""
    import torch.distributed as dist

    from ..train.dist import release_process_groups

    if dist.is_initialized() and dist.get_backend() == "gloo":
        release_process_groups()


def context_of(trainer: Any) -> Any:
    """The ProtectContext of a protected Trainer (None when it is not protected)."""
    return getattr(trainer, _ATTR, None)
