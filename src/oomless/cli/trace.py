"""`oomless trace`: run two real training steps on fake tensors and track every tensor."""

from __future__ import annotations

import argparse

from ._options import NON_NEGATIVE

ORDER = 20


def register(sub: argparse._SubParsersAction) -> None:
    from ._options import add_run_options

    p = sub.add_parser(
        "trace",
        help="predict memory by running the real model on fake tensors (no GPU, no weights)",
        description="Build the real transformers model from its config with no weights, apply "
        "PEFT LoRA/QLoRA, run two training steps on fake tensors, track every tensor "
        "allocation and replay them through a simulation of PyTorch's CUDA caching allocator. "
        "Falls back to the analytic estimate, with the reason, where a trace is impossible.",
    )
    add_run_options(p)
    p.add_argument("--full", action="store_true",
                   help="trace every layer instead of two and extrapolating (slower)")
    p.add_argument("--alloc-conf", metavar="CONF",
                   help="PYTORCH_CUDA_ALLOC_CONF to simulate (default: the environment's)")
    p.add_argument("--modules", type=NON_NEGATIVE, default=0, metavar="N",
                   help="also list the N modules with the highest peak")
    p.add_argument("--json", action="store_true", help="print the MemoryEstimate as JSON")
    p.add_argument("--assumptions", action="store_true", help="list every approximation")
    p.set_defaults(func=run)


def alloc_conf_from_args(args: argparse.Namespace) -> str | None:
    import os

    conf = args.alloc_conf if args.alloc_conf is not None else os.environ.get(
        "PYTORCH_CUDA_ALLOC_CONF")
    if args.expandable_segments:
        conf = ",".join(filter(None, [conf, "expandable_segments:True"]))
    return conf


def run(args: argparse.Namespace) -> int:
    from ..api import cluster_for
    from ._options import run_config_from_args

    cfg = run_config_from_args(args)
    from ..runtime.trace.fake import trace_training

    est = trace_training(cfg, cluster_for(cfg), full=args.full,
                         alloc_conf=alloc_conf_from_args(args))
    if args.json:
        print(est.to_json())
        return 0
    from ._render import render_estimate

    render_estimate(est, show_assumptions=args.assumptions)
    render_trace_extra(est, args.modules)
    return 0


def render_trace_extra(est, top: int) -> None:
    from ..units import fmt_bytes
    from ._render import console, esc

    out = console()
    extra = est.extra
    if "layers_traced" in extra:
        out.print(f"[dim]traced layers {extra['layers_traced']} in {extra['trace_seconds']} s; "
                  f"allocator {extra['allocator']['config']}[/]")
    if extra.get("trace_fallback"):
        out.print(f"[yellow]no trace:[/] {esc(extra['trace_fallback'])}")
    modules = extra.get("per_module_peak") or {}
    if top and modules:
        from rich.table import Table

        table = Table(title="Memory a module's run adds on top of what was live",
                      title_justify="left")
        table.add_column("module")
        table.add_column("forward", justify="right")
        table.add_column("backward", justify="right")
        ranked = sorted(modules.items(), key=lambda kv: -max(kv[1].values()))[:top]
        for name, added in ranked:
            table.add_row(name, fmt_bytes(added["forward_added_bytes"]),
                          fmt_bytes(added["backward_added_bytes"]))
        out.print(table)
