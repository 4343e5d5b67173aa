"""`oomless estimate`: per-GPU memory of a fine-tune (or inference) before running it."""

from __future__ import annotations

import argparse
from typing import Any

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

    from ..api import cluster_for
    from ..errors import ConfigError
    from ..memory import estimate_generate
    from ..models.catalog import resolve_model

    spec = resolve_model(cfg.model).spec
    new_tokens = cfg.eval.max_new_tokens or 512
    cluster = cluster_for(cfg)
    if args.engine == "hf":
        est = estimate_generate(spec, cfg.micro_batch_size, cfg.seq_len, new_tokens)
        if args.json:
            print(json.dumps({"engine": "hf", **est.to_dict()}, indent=2))
            return 0
        from ._render_infer import render_generate

        render_generate(spec.name, est, cluster.gpu if cluster else None)
        return 0
    if cluster is None:
        raise ConfigError("--inference --engine vllm needs --gpu (vLLM's budget is a "
                          "fraction of the card's memory); e.g. --gpu a100-80gb")
    engine, budget, hint = vllm_estimate(args, cfg, spec, cluster)
    if args.json:
        print(json.dumps({"engine": "vllm", **budget.to_dict(), "engine_args": engine,
                          "suggested_parallel": hint}, indent=2))
        return 0
    from ._render_infer import render_vllm

    render_vllm(spec.name, cluster.gpu.display_name, budget, engine, hint)
    return 0


def vllm_estimate(args: argparse.Namespace, cfg, spec, cluster) -> tuple[dict, Any, dict | None]:
    """vLLM's engine arguments, per-GPU budget and the parallel sizes that would fit (or
    None) for `estimate --inference --engine vllm`'s options; the web page calls it too."""
    from ..memory.inference import EngineRequest, parallel_hint, vllm_engine_args
    from ..memory.vllm_parallel import check_parallel

    new_tokens = cfg.eval.max_new_tokens or 512
    # LoRA slots only for an adapter the run says it trains (--method lora/qlora or the YAML)
    adapter = cfg.method != "full" and "method" in cfg.model_fields_set
    req = EngineRequest(model=cfg.model, max_model_len=args.max_model_len or cfg.seq_len + new_tokens,
                        max_num_seqs=args.max_num_seqs,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        lora_rank=cfg.lora.r if adapter else 0, kv_cache_dtype=args.kv_cache_dtype,
                        trust_remote_code=cfg.training.trust_remote_code,
                        tensor_parallel_size=args.tensor_parallel_size,
                        pipeline_parallel_size=args.pipeline_parallel_size,
                        data_parallel_size=args.data_parallel_size, nodes=cluster.nodes,
                        # --stack-version names the vLLM release (its profiling rule)
                        engine_version=cfg.stack_options.stack_version)
    check_parallel(spec, req.parallel, cluster.world_size)
    engine, budget = vllm_engine_args(spec, cluster.gpu, req)
    return engine, budget, parallel_hint(spec, cluster, req, budget)
