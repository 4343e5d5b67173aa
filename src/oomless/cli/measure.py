"""`oomless measure`: run the configuration for real and report the memory it used."""

from __future__ import annotations

import argparse

from ._options import count

ORDER = 21


def register(sub: argparse._SubParsersAction) -> None:
    from ._options import add_run_options

    p = sub.add_parser(
        "measure",
        help="run a few real training steps (random weights) and measure their memory",
        description="Build the model from its config with random weights, run a few HF-Trainer "
        "steps and report torch.cuda peak allocated/reserved per phase and the device memory "
        "NVML saw (CUDA context measured on its own). Without a GPU (or with --device cpu) the "
        "storage tracker runs on real CPU tensors, for small models.",
    )
    add_run_options(p)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--steps", type=count(2, 10_000), default=3, help="optimizer steps to run (≥ 2)")
    p.add_argument("--alloc-conf", metavar="CONF",
                   help="CPU only: PYTORCH_CUDA_ALLOC_CONF to simulate")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--assumptions", action="store_true", help="list every approximation")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..api import cluster_for
    from ._options import run_config_from_args
    from .trace import alloc_conf_from_args

    cfg = run_config_from_args(args)
    from ..runtime.trace.measure import measure_training

    est = measure_training(cfg, cluster_for(cfg), device=args.device, steps=args.steps,
                           alloc_conf=alloc_conf_from_args(args))
    if args.json:
        print(est.to_json())
        return 0
    from ._render import render_estimate

    render_estimate(est, show_assumptions=args.assumptions)
    return 0
