"""`oomless estimate`: per-GPU memory of a fine-tune (or inference) before running it."""

from __future__ import annotations

import argparse

ORDER = 10


def register(sub: argparse._SubParsersAction) -> None:
    from ._options import (
        POSITIVE,
        UTILIZATION,
        add_run_options,
        add_run_sim_options,
        add_vllm_parallel_options,
    )

    p = sub.add_parser(
        "estimate",
        help="predict per-GPU memory of a fine-tune, instantly from formulas",
        description="Predict per-GPU memory of a fine-tuning run (or, with --inference, "
        "of generation / a vLLM engine) at its peak, by component and phase. Exit code 0: "
        "estimated (the verdict against --gpu is printed, FITS or OUT OF MEMORY); 2: bad "
        "input. `oomless check` exits 1 when a configuration does not fit.",
    )
    add_run_options(p)
    p.add_argument("--json", action="store_true", help="print the MemoryEstimate as JSON")
    p.add_argument("--assumptions", action="store_true", help="list every approximation")
    add_run_sim_options(p)
    inf = p.add_argument_group("inference (--inference)")
    inf.add_argument("--inference", action="store_true", help="estimate inference instead")
    inf.add_argument("--engine", choices=["hf", "vllm"], default="vllm")
    inf.add_argument("--max-model-len", type=POSITIVE, help="vLLM: default seq-len + max-new-tokens")
    inf.add_argument("--max-num-seqs", type=POSITIVE, default=256)
    inf.add_argument("--gpu-memory-utilization", type=UTILIZATION)
    inf.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    add_vllm_parallel_options(inf)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ._options import run_config_from_args

    cfg = run_config_from_args(args)
    if args.inference:
        return _inference(args, cfg)
    from ..api import estimate

    est = estimate(cfg, expandable_segments=args.expandable_segments)
    if args.data or args.lengths:
        est = _with_run(est, cfg, args)
    if args.json:
        print(est.to_json())
    else:
        from ._render import render_estimate

        render_estimate(est, show_assumptions=args.assumptions)
        if "run" in est.extra:
            from ._render_check import render_run

            render_run(est.extra["run"])
    return 0


def _with_run(est, cfg, args: argparse.Namespace):
    """The estimate with the run over the data (``extra["run"]``)."""
    import dataclasses

    from ..runtime.trace.run_stream import run_over
    from ._options import run_alloc_conf

    run = run_over(cfg, data=args.data, lengths=args.lengths, steps=args.steps,
                   order=args.order, seed=args.seed,
                   cap=cfg.seq_len if "seq_len" in cfg.model_fields_set else None,
                   alloc_conf=run_alloc_conf(args),
                   empty_cache_every=args.empty_cache_steps)
    return dataclasses.replace(est, extra={**est.extra, "run": run},
                               assumptions=(*est.assumptions, run["assumption"]))


def _inference(args: argparse.Namespace, cfg) -> int:
    import json

    from ..api import estimate_inference
    from ._options import inference_options

    inf = estimate_inference(cfg, inference_options(args))
    if inf.generate is not None:
        if args.json:
            print(json.dumps({"engine": "hf", **inf.generate.to_dict()}, indent=2))
            return 0
        from ._render_infer import render_generate

        render_generate(inf.model_name, inf.generate, inf.cluster.gpu if inf.cluster else None)
        return 0
    if args.json:
        print(json.dumps({"engine": "vllm", **inf.budget.to_dict(),
                          "engine_args": inf.engine_args,
                          "suggested_parallel": inf.suggested_parallel}, indent=2))
        return 0
    from ._render_infer import render_vllm

    render_vllm(inf.model_name, inf.cluster.gpu.display_name, inf.budget, inf.engine_args,
                inf.suggested_parallel)
    return 0
