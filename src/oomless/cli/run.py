"""``oomless run [--auto-fit] [--max-restarts N] -- COMMAND ...``: supervise a training command."""

from __future__ import annotations

import argparse

from ._options import number

ORDER = 41


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="run your own training command (llamafactory-cli, finetune.py, deepspeed, "
        "torchrun, python) with OOM protection, restarts and a report",
        description="Checks the command's configuration before the start, protects every "
        "transformers Trainer it builds (an OOM is redone in smaller pieces, same effective "
        "batch), samples GPU memory, and when the command still dies of an OOM writes the "
        "smallest fix into a copy of your configuration and relaunches from the last "
        "checkpoint. Your files are never written. Everything is in the run folder "
        "(events.jsonl, memlog.jsonl, attempt logs, report.html).",
        epilog="examples: oomless run -- llamafactory-cli train llama3_lora_sft.yaml | "
        "oomless run --model glm-4-9b-chat -- python finetune.py data THUDM/glm-4-9b-chat "
        "configs/lora.yaml | oomless run -- deepspeed train.py --deepspeed ds.json ...")
    p.add_argument("--auto-fit", action="store_true",
                   help="when the check predicts an OOM, start with its smallest fix (a copy)")
    p.add_argument("--max-restarts", type=int, default=2, metavar="N",
                   help="relaunches after an OOM (default 2)")
    p.add_argument("--gpu", help="GPU to check against, e.g. 4090 or 'a100-80gb x8' "
                   "(default: none; the protected Trainer checks against the GPU it runs on)")
    p.add_argument("--model", help="the model, where the configuration does not name it")
    p.add_argument("--run-dir", metavar="DIR",
                   help="run folder (default: OUTPUT_DIR/oomless, else ./oomless-run)")
    p.add_argument("--no-protect", action="store_true",
                   help="do not change the Trainers (logging and resume only)")
    p.add_argument("--no-check", action="store_true", help="skip the check before the start")
    p.add_argument("--no-report", action="store_true", help="do not write report.html")
    p.add_argument("--stop-grace", type=number(0.0, 3600.0), default=10.0, metavar="SECONDS",
                   help="SIGINT/SIGTERM/SIGHUP to oomless run go to every process of the "
                   "command; one that is still running this long after gets SIGTERM, then "
                   "SIGKILL as long again after (default 10)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the training command, after --")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from ..errors import ConfigError
    from ..runtime.supervise import RunOptions, supervise
    from .train import utf8_path

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError("no command: oomless run [options] -- COMMAND ..., e.g. "
                          "oomless run -- llamafactory-cli train config.yaml")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts}: must be 0 or more")
    if args.run_dir is not None:
        utf8_path(args.run_dir, "--run-dir")
    result = supervise(RunOptions(
        command=command, auto_fit=args.auto_fit, max_restarts=args.max_restarts, gpu=args.gpu,
        model=args.model, run_dir=args.run_dir, protect=not args.no_protect,
        check=not args.no_check, report=not args.no_report, stop_grace_s=args.stop_grace))
    lines = [f"oomless run: {result.verdict} after {result.attempts} attempt(s)"]
    lines += [f"  change: {c}" for c in result.changes]
    lines.append(f"  run folder {result.run_dir}" + (f", report {result.report}"
                                                      if result.report else ""))
    print("\n".join(lines), flush=True)
    return result.returncode
