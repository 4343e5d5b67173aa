"""``oomless demo [--out DIR]``: plan → train → report on a tiny local model, offline."""

from __future__ import annotations

import argparse

from ._options import FOLDER

ORDER = 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="try it: plan, train (with one injected OOM) and report on a tiny local model",
        description="Builds a tiny random-weight model and a tokenizer locally, fine-tunes it "
        "with LoRA on a shipped instruction dataset on the CPU (one OOM is injected to show "
        "the recovery), and writes the memory log and an HTML report. Offline; about a minute.",
    )
    p.add_argument("--out", type=FOLDER, default="oomless-demo", metavar="DIR",
                   help="folder for the model, data, oomless.yaml and run (default: ./oomless-demo)")
    p.add_argument("--force", action="store_true",
                   help="DIR may hold files the demo did not write; those in its way are "
                   "kept as NAME.orig")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from ..runtime.demo import DEMO_STEPS, NEXT_STEPS, OOM_STEP, estimate_demo, prepare_demo
    from ._render import console, esc, render_estimate
    from .train import quiet_libraries, render_summary

    out = console()
    quiet_libraries()
    out.print("[bold]1/3 plan[/]: tiny model, tokenizer and data, built locally")
    files = prepare_demo(args.out, force=args.force)
    out.print(f"  model  {esc(files.model_dir)}\n  data   {esc(files.train_file)} (200 records)\n"
              f"  config {esc(files.config_file)}")
    render_estimate(estimate_demo(files))
    out.print(f"\n[bold]2/3 train[/]: LoRA, {DEMO_STEPS} steps on the CPU; an OOM is injected "
              f"at step {OOM_STEP} (micro batch 4 -> 2, same samples, same effective batch)")
    from ..runtime.train.loop import train

    result = train(files.config, progress=True, start_over=True)  # the run folder is the demo's
    render_summary(out, result)
    out.print("\n[bold]3/3 report[/]")
    from ..runtime.demo import report_demo

    html = report_demo(result.run_dir)
    if html is not None:
        out.print(f"  wrote {esc(html)} (open it in a browser; works offline)")
    else:
        out.print(f"  plotly is not installed: the memory log is "
                  f"{esc(result.run_dir / 'memlog.jsonl')}")
    out.print("\n" + esc(NEXT_STEPS.format(run_dir=result.run_dir)))
    return 0
