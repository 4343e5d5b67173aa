"""`oomless check`: will this training configuration run out of memory, where, and the
smallest fix as a diff of the same file (printed raw: it applies with patch -p1)."""

from __future__ import annotations

import argparse

from ._options import FILE, FRACTION, GPU_TEXT, capped, capped_gib

ORDER = 31


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check", help="check an existing training config for OOM; print the smallest fix as a diff",
        description="Read a LLaMA-Factory YAML, WeClone settings, a GLM-4 finetune YAML, a TRL "
        "/ alignment-handbook recipe, an axolotl YAML, a LLaVA / MoE-LLaVA launch script, a "
        "TrainingArguments JSON with a DeepSpeed JSON, a configuration with its accelerate "
        "config, or an oomless.yaml; predict each phase's memory; when it does not fit within "
        "the headroom, print the smallest change (same effective batch) as a unified diff of "
        "the same file(s). The diff is printed unwrapped: `oomless check X > fix.patch; "
        "patch -p1 < fix.patch` applies it. Exit code 0: fits (within the headroom, and the upper bound "
        "of the estimate's uncertainty band fits the GPU); 1: tight (the GPU's memory lies "
        "inside the band, or only the headroom is missed) or out of memory (even the band's "
        "lower bound does not fit): the fix is printed; 2: bad input.")
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="the configuration (two files: TrainingArguments JSON and DeepSpeed "
                   "JSON, or a configuration and its accelerate config)")
    p.add_argument("--gpu", type=GPU_TEXT, help="GPU and count: 4090x8, 'a100-40gb x8' (see `oomless gpus`); "
                   "a bare name takes the count from the file (accelerate, launcher)")
    p.add_argument("--nodes", type=capped("hardware.nodes"))
    p.add_argument("--model", help="the model, where the file does not name it (GLM-4, "
                   "DeepSpeed/TrainingArguments) or to override it")
    p.add_argument("--seq-len", type=capped("seq_len"), help="tokens per sample (DeepSpeed/TrainingArguments)")
    p.add_argument("--method", choices=["full", "lora", "qlora"],
                   help="DeepSpeed/TrainingArguments/accelerate only (default full)")
    p.add_argument("--images", type=capped("data.images_per_sample", 0), help="images per sample (vision-language)")
    p.add_argument("--data", metavar="FILE", help="the training data (.json/.jsonl/.parquet): "
                   "estimate at its longest sample instead of the cutoff")
    p.add_argument("--headroom", type=FRACTION, default=0.10,
                   help="fraction of GPU memory the fix keeps free (default 0.10)")
    p.add_argument("--host-ram-gb", type=capped_gib("hardware.host_ram_gb"), help="host RAM per node (offload)")
    p.add_argument("--strict", action="store_true",
                   help="refuse keys that no version of the file's tool knows (default: warn)")
    p.add_argument("--write", action="store_true",
                   help="apply the fix to the file(s), keeping the original as FILE.orig")
    p.add_argument("--diff-out", type=FILE, metavar="PATH", help="also write the diff to PATH")
    p.add_argument("--force", action="store_true",
                   help="with --write / --diff-out: replace an existing FILE.orig / PATH")
    p.add_argument("--json", action="store_true", help="print the CheckResult as JSON")
    p.set_defaults(func=run)


def _refuse_existing(path, force: bool, what: str) -> None:
    from pathlib import Path

    from ..errors import ConfigError

    if Path(path).exists() and not force:
        raise ConfigError(f"{what} '{path}' exists; pass --force to replace it")


def write_outputs(result, args: argparse.Namespace) -> list[str]:
    """--diff-out and --write; returns what was written, for the report."""
    from pathlib import Path

    from ..fileio import write_atomic

    done: list[str] = []
    if args.diff_out is not None and result.diffs:
        _refuse_existing(args.diff_out, args.force, "--diff-out")
        write_atomic(args.diff_out, "".join(result.diffs.values()))
        done.append(f"wrote the diff to {args.diff_out}")
    if args.write and result.new_texts:
        for path in result.new_texts:
            _refuse_existing(f"{path}.orig", args.force, "backup")
        for path, text in result.new_texts.items():
            original = Path(path).read_bytes()
            write_atomic(f"{path}.orig", original)
            write_in_place(path, text, original)
            done.append(f"applied the fix to {path} (the original is {path}.orig)")
    return done


def write_in_place(path, text: str, original: bytes) -> None:
    """The edited text over the file a user named: through a symlink to its target (the
    link stays), with the original's byte-order mark and permission bits (a launch
    script stays executable)."""
    import os
    import stat

    from ..fileio import write_atomic

    target = os.path.realpath(path)
    mode = stat.S_IMODE(os.stat(target).st_mode)
    bom = "\ufeff" if original.startswith(b"\xef\xbb\xbf") else ""
    write_atomic(target, bom + text)
    os.chmod(target, mode)


def run(args: argparse.Namespace) -> int:
    from ..check.checker import CheckOptions, check

    result = check(CheckOptions(
        files=tuple(args.files), gpu=args.gpu, nodes=args.nodes, model=args.model,
        seq_len=args.seq_len, method=args.method, images=args.images, headroom=args.headroom,
        host_ram_gb=args.host_ram_gb, strict=args.strict, data=args.data))
    done = write_outputs(result, args)
    if args.json:
        import json

        print(json.dumps({**result.to_dict(), "written": done}, indent=2))
    else:
        from ._render_check import render_check

        render_check(result, done)
    return result.exit_code
