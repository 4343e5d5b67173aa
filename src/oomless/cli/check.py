"""`oomless check`: will this LLaMA-Factory / GLM-4 / DeepSpeed+TrainingArguments /
oomless configuration run out of memory, where, and the smallest fix as a diff."""

from __future__ import annotations

import argparse

from ._options import FRACTION, GIB, NON_NEGATIVE, POSITIVE

ORDER = 31


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check", help="check an existing training config for OOM; print the smallest fix as a diff",
        description="Read a LLaMA-Factory YAML, a GLM-4 finetune YAML, a DeepSpeed JSON plus "
        "a TrainingArguments JSON, or an oomless.yaml; predict each phase's memory; when it "
        "does not fit within the headroom, print the smallest change (same effective batch) "
        "as a unified diff of the same file. Exit code 0: fits the GPU; 1: predicted out of "
        "memory; 2: bad input.")
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="the configuration (two files: DeepSpeed JSON and TrainingArguments JSON)")
    p.add_argument("--gpu", help="GPU and count: 4090x8, 'a100-40gb x8' (see `oomless gpus`)")
    p.add_argument("--nodes", type=POSITIVE)
    p.add_argument("--model", help="the model, where the file does not name it (GLM-4, "
                   "DeepSpeed/TrainingArguments) or to override it")
    p.add_argument("--seq-len", type=POSITIVE, help="tokens per sample (DeepSpeed/TrainingArguments)")
    p.add_argument("--method", choices=["full", "lora", "qlora"],
                   help="DeepSpeed/TrainingArguments only (default full)")
    p.add_argument("--images", type=NON_NEGATIVE, help="images per sample (vision-language)")
    p.add_argument("--headroom", type=FRACTION, default=0.10,
                   help="fraction of GPU memory the fix keeps free (default 0.10)")
    p.add_argument("--host-ram-gb", type=GIB, help="host RAM per node (offload)")
    p.add_argument("--json", action="store_true", help="print the CheckResult as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..check.checker import CheckOptions, check

    result = check(CheckOptions(
        files=tuple(args.files), gpu=args.gpu, nodes=args.nodes, model=args.model,
        seq_len=args.seq_len, method=args.method, images=args.images, headroom=args.headroom,
        host_ram_gb=args.host_ram_gb))
    if args.json:
        import json

        print(json.dumps(result.to_dict(), indent=2))
    else:
        from ._render_plan import render_check

        render_check(result)
    return 0 if result.fits else 1
