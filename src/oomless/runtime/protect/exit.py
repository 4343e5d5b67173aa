"""The restart exit: an OOM that cannot be recovered in-process ends the process on purpose.

What it saves: the event (why, where, the micro batch to relaunch with) in
events.jsonl and the same words on stderr, where ``oomless diagnose`` and the
supervisor read them. With one process it also writes a Trainer checkpoint
of the state before the failed step (weights, optimizer, scheduler, RNG: the
optimizer has not stepped yet), unless one exists for that step; with
several ranks it cannot (saving is a collective, and the other ranks are
inside another one), and the relaunch starts from the last checkpoint the
Trainer wrote. Exit code 75 (EX_TEMPFAIL); ``torchrun`` and ``deepspeed``
report their own code but stop the other ranks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from ..train.oom import first_line
from .context import checkpointing_on, say
from .env import EXIT_OOM_RESTART


def _suggested(ctx: Any, phase: str) -> dict[str, int]:
    """The batch to relaunch with: half of what ran out of memory."""
    args = ctx.trainer.args
    if phase == "eval":
        return {"eval_batch_after": max(1, (ctx.eval_rows or args.per_device_eval_batch_size) // 2)}
    return {"micro_batch_after": max(1, (ctx.chunk_rows or args.per_device_train_batch_size) // 2)}


def _save_checkpoint(ctx: Any) -> str | None:
    """One process: a Trainer checkpoint of the state before the failed step."""
    t = ctx.trainer
    if ctx.dist.active or t.state.global_step == 0:
        return None
    folder = Path(t.args.output_dir) / f"checkpoint-{t.state.global_step}"
    if (folder / "trainer_state.json").is_file():
        return str(folder)
    try:
        from ..train.oom import release_memory

        release_memory(lambda: None, t.args.device)
        t._save_checkpoint(t.model_wrapped, trial=None)
    except Exception as err:  # noqa: BLE001 - a best effort; the reason is logged
        ctx.event("oom_save_failed", f"could not write a checkpoint before exiting: "
                  f"{first_line(err)}", ctx.step)
        return None
    return str(folder)


def exit_for_restart(ctx: Any, err: BaseException, reason: str,
                     phase: str = "train") -> NoReturn:
    saved = _save_checkpoint(ctx) if phase == "train" else None
    suggested = _suggested(ctx, phase)
    batch = (f"eval batch {suggested['eval_batch_after']}" if phase == "eval" else
             f"micro batch {suggested['micro_batch_after']} (same effective batch)")
    message = (f"out of memory at step {ctx.step} on rank {ctx.dist.rank} ({phase}): {reason}. "
               f"Exiting with code {EXIT_OOM_RESTART} so that a supervisor (oomless run) "
               f"relaunches from the last checkpoint with {batch}")
    data = {"error": first_line(err), "exit_code": EXIT_OOM_RESTART, "engine": ctx.kind,
            "rank": ctx.dist.rank, "phase": phase, "checkpoint": saved, **suggested}
    if phase == "train":  # the setting that ran out of memory: a relaunch skips it
        data["failed"] = {"micro_batch_size": ctx.chunk_rows
                          or ctx.trainer.args.per_device_train_batch_size,
                          "grad_ckpt": ctx.grad_ckpt or checkpointing_on(ctx.trainer.model)}
    # rank 0 may be blocked in a collective: each rank writes its own line
    ctx.log.run_dir.mkdir(parents=True, exist_ok=True)
    ctx.log.enabled = True
    ctx.log.event("oom_exit", message, ctx.step, **data)
    say(f"oomless: {message}\n  last error: {first_line(err)}")
    sys.stdout.flush()
    if ctx.dist.active:
        os._exit(EXIT_OOM_RESTART)  # no atexit handlers: they may wait on collectives
    raise SystemExit(EXIT_OOM_RESTART)
