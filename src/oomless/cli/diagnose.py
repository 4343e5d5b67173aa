"""``oomless diagnose FILE|-``: explain the out-of-memory events in a log or traceback."""

from __future__ import annotations

import argparse

ORDER = 50


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "diagnose",
        help="explain out-of-memory errors in a log or traceback, with quantified fixes",
        description="Find every out-of-memory event in a training or serving log (PyTorch, "
        "bitsandbytes, DeepSpeed, vLLM, NCCL, the host OOM killer, multi-rank logs), its phase "
        "and cause, and fixes with the predicted peak after each one. Exit code 0: the log was "
        "read (with or without events: see the output, or `found` in --json); 2: the log or "
        "the configuration cannot be read.",
    )
    p.add_argument("file", metavar="FILE|-", help="log or traceback file; '-' reads standard input")
    p.add_argument("--config", metavar="oomless.yaml",
                   help="the run configuration: every fix then carries the estimator's predicted peak")
    p.add_argument("--gpu", help="GPU to predict for, e.g. a100-40gb or '4090x8' "
                   "(default: the config's, else the total printed in the message)")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from ..diagnose import diagnose_log

    cfg = cluster = None
    if args.config:
        from ..config import load_run_config

        cfg = load_run_config(args.config)
    if args.gpu:
        from ..diagnose.predict import choose_cluster

        cluster = choose_cluster(cfg, args.gpu, None)
    diagnosis = diagnose_log(args.file, cfg, cluster)
    if args.json:
        print(json.dumps(diagnosis.to_dict(), indent=2))
    else:
        from ..diagnose.render import render

        render(diagnosis)
    return 0
