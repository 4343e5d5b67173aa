"""`oomless plan`: the fastest configuration that fits, and the files to run it."""

from __future__ import annotations

import argparse

from ._options import FRACTION, GIB, NON_NEGATIVE, POSITIVE, add_run_sim_options

ORDER = 30


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="search the fastest configuration that fits your GPUs; write its files",
        description="Search method, precision, optimizer, checkpointing, attention, micro "
        "batch x accumulation (same effective batch), ZeRO/offload and length for the "
        "fastest configuration that fits every phase within the headroom. Exit code 0: "
        "plans found; 1: nothing fits (the nearest misses and hardware that fits are "
        "shown); 2: bad input.")
    p.add_argument("model", metavar="MODEL|CONFIG.yaml",
                   help="catalog name, HF id in the local cache, config.json/folder, or an "
                   "oomless.yaml whose run is kept (its method stays unless --method)")
    p.add_argument("--gpu", help="GPU and count: 4090, 'a100-80gb x8' (see `oomless gpus`)")
    p.add_argument("--nodes", type=POSITIVE, help="number of nodes (default 1)")
    p.add_argument("--data", help="training file (.json/.jsonl/.parquet): real lengths")
    p.add_argument("--seq-len", type=POSITIVE,
                   help="tokens per sample (with --data: the longest allowed)")
    p.add_argument("--effective-batch", type=POSITIVE,
                   help="samples per optimizer step over all GPUs (default 16)")
    p.add_argument("--method", choices=["auto", "full", "lora", "qlora"], default="auto")
    p.add_argument("--headroom", type=FRACTION, default=0.10,
                   help="fraction of GPU memory kept free (default 0.10)")
    p.add_argument("--objective", choices=["speed", "memory"], default="speed")
    p.add_argument("--top", type=POSITIVE, default=5, help="plans shown (default 5)")
    p.add_argument("--out", metavar="DIR", help="write the best plan's files here")
    p.add_argument("--force", action="store_true",
                   help="--out may hold files oomless did not write; those it replaces are "
                   "kept as NAME.orig")
    p.add_argument("--json", action="store_true", help="print the PlanResult as JSON")
    p.add_argument("--assumptions", action="store_true", help="list every assumption")
    add_run_sim_options(p, check=True)
    more = p.add_argument_group("the run to keep")
    more.add_argument("--host-ram-gb", type=GIB, help="host RAM per node (offload)")
    more.add_argument("--images", type=NON_NEGATIVE, help="images per sample (vision-language)")
    more.add_argument("--eval-batch-size", type=POSITIVE)
    more.add_argument("--max-new-tokens", type=NON_NEGATIVE, help="generation during evaluation")
    more.add_argument("--lora-r", type=POSITIVE, help="LoRA rank (fixed)")
    from ._options import add_stack_options

    add_stack_options(more)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..planner import PlanOptions, plan, request_from_options
    from ..planner.options import write_best

    opts = PlanOptions(
        model=args.model, gpu=args.gpu, nodes=args.nodes, data=args.data, seq_len=args.seq_len,
        effective_batch=args.effective_batch, method=args.method, headroom=args.headroom,
        objective=args.objective, top=args.top, host_ram_gb=args.host_ram_gb,
        images=args.images, eval_batch_size=args.eval_batch_size,
        max_new_tokens=args.max_new_tokens, lora_r=args.lora_r, stack=args.stack,
        transformers_version=args.transformers_version, stack_version=args.stack_version)
    spec, req = request_from_options(opts)
    result = plan(spec, req)
    written = (write_best(result, req, spec, args.out, args.force, (args.model, args.data))
               if args.out else [])
    run_sim = _run(result, args) if args.steps and result.plans else None
    if args.json:
        import json

        print(json.dumps({**result.to_dict(), "written": written,
                          **({"run": run_sim} if run_sim else {})}, indent=2))
    else:
        from ._render_plan import render_plan

        render_plan(result, written, show_assumptions=args.assumptions)
        if run_sim:
            from ._render_check import render_run

            render_run(run_sim)
    return 0 if result.plans else 1


def _run(result, args: argparse.Namespace) -> dict:
    """--steps: the best plan's run over --data through the caching-allocator model."""
    from ..errors import ConfigError
    from ..runtime.trace.run_stream import run_over
    from ._options import run_alloc_conf

    if not args.data:
        raise ConfigError("--steps replays a run over the training data: give --data FILE")
    cfg = result.plans[0].run_config()
    return run_over(cfg, data=args.data, steps=args.steps, order=args.order, seed=args.seed,
                    cap=cfg.seq_len, empty_cache_every=args.empty_cache_steps,
                    alloc_conf=run_alloc_conf(args))
