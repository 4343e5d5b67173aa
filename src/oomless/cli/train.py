"""``oomless train oomless.yaml [--resume] [--auto-fit]``: fine-tune without OOM surprises."""

from __future__ import annotations

import argparse
from typing import Any

from ._options import NON_NEGATIVE, count

ORDER = 40


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="fine-tune (LoRA, QLoRA, full): preflight, OOM recovery, memory log, checkpoints",
        description="Supervised fine-tuning with transformers + PEFT as oomless.yaml says. "
        "Checks the predicted memory before loading weights, recovers from OOM by halving "
        "the micro batch while keeping the effective batch, logs memory per step, and "
        "checkpoints atomically. Several GPUs: started through `accelerate launch`.",
    )
    p.add_argument("config", metavar="CONFIG.yaml", help="run configuration (see docs/config.md)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in training.output_dir")
    p.add_argument("--start-over", action="store_true",
                   help="the output_dir holds another run: delete its checkpoints, logs and "
                   "final weights and start a new run there")
    p.add_argument("--auto-fit", action="store_true",
                   help="if the run is predicted not to fit, apply the best plan that does")
    p.add_argument("--output-dir", metavar="DIR", help="override training.output_dir")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="also write each step's memory (oomless/ peaks, prediction, micro "
                   "batch, OOM splits) as TensorBoard scalars to DIR (needs tensorboard)")
    p.add_argument("--dry-run", action="store_true",
                   help="with several GPUs: write the launch files, print the command, stop")
    m = p.add_argument_group("several nodes (hardware.nodes > 1; run on every node)")
    m.add_argument("--machine-rank", type=NON_NEGATIVE, default=0, help="this node's rank (0 = main)")
    m.add_argument("--main-process-ip", metavar="IP", help="address of the rank-0 node")
    m.add_argument("--main-process-port", type=count(1, 65535), default=29500, metavar="PORT")
    p.set_defaults(func=_run)


def utf8_path(path: str, option: str) -> str:
    """``path`` when it is text oomless can write into its run files (UTF-8), else a
    ConfigError: a name in another encoding arrives as undecodable bytes."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        from ..errors import ConfigError

        shown = path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        raise ConfigError(f"{option} '{shown}' is not valid UTF-8; oomless records the folder "
                          "in its run files (JSON, YAML), which hold UTF-8 text: choose a "
                          "folder name in UTF-8") from None
    return path


def quiet_libraries() -> None:
    """Hide transformers' per-load progress bars and advisory warnings."""
    import os
    import warnings

    import torch

    if not torch.cuda.is_available():  # DeepSpeed would warn that it fell back to CPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")


def render_summary(out: Any, result: Any) -> None:
    from ..runtime.train.memlog import read_events
    from ..units import fmt_bytes
    from ._render import esc

    losses = result.losses
    if losses:
        first = result.first_loss if result.first_loss is not None else losses[0]
        out.print(f"  loss {first:.3f} -> {losses[-1]:.3f} over {result.steps} steps "
                  f"(micro batch now {result.micro_batch_size}"
                  f"{', gradient checkpointing on' if result.grad_ckpt else ''})")
    for e in read_events(result.run_dir):
        if e["event"] in ("oom", "eval_oom", "auto_fit", "resume"):
            out.print(f"  [yellow]{e['event']}[/] step {e['step']}: {esc(e['message'])}")
    if result.eval_losses:
        out.print(f"  eval loss {result.eval_losses[-1]:.3f}")
    predicted = fmt_bytes(result.predicted_peak_bytes) if result.predicted_peak_bytes else "n/a"
    if result.measured_peak_bytes:
        out.print(f"  peak memory: predicted {predicted}, measured "
                  f"{fmt_bytes(result.measured_peak_bytes)}")
    else:
        out.print(f"  peak memory: predicted {predicted} per GPU; measured: n/a on CPU "
                  "(set training.memory_budget_gb to track a simulated GPU)")
    out.print(f"  run folder {esc(result.run_dir)} (memlog.jsonl, events.jsonl, checkpoints/, final/)")


def _run(args: argparse.Namespace) -> int:
    import os

    from ..config import load_run_config

    cfg = load_run_config(args.config)
    if args.output_dir:
        utf8_path(args.output_dir, "--output-dir")
        cfg = cfg.replace(**{"training.output_dir": args.output_dir})
    if cfg.world_size > 1 and "WORLD_SIZE" not in os.environ:
        from ..runtime.train.launch import launch

        return launch(cfg, args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    quiet_libraries()
    from ..runtime.train.loop import train
    from ._render import console, esc

    out = console()
    if args.resume and args.start_over:
        from ..errors import ConfigError

        raise ConfigError("--resume continues the run in output_dir, --start-over deletes it: "
                          "give one of them")
    board = None
    if args.tensorboard:
        from ..runtime.protect.dashboards import TensorBoardSteps

        board = TensorBoardSteps(args.tensorboard)
    try:
        result = train(cfg, resume=args.resume, auto_fit=args.auto_fit,
                       progress=not args.no_progress, start_over=args.start_over,
                       on_step_end=board)
    finally:
        if board is not None:
            board.close()
    if int(os.environ.get("RANK", "0")) == 0:
        render_summary(out, result)
        out.print(f"next: oomless report {esc(result.run_dir)}")
    return 0
