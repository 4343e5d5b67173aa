"""`oomless check`: will this training configuration run out of memory, where, and the
smallest fix as a diff of the same file (printed raw: it applies with patch -p1)."""

from __future__ import annotations

import argparse

from ._options import (
    FILE,
    FRACTION,
    GPU_TEXT,
    add_run_sim_options,
    capped,
    capped_gib,
)

ORDER = 31


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check", help="check an existing training config for OOM; print the smallest fix as a diff",
        description="Read a LLaMA-Factory YAML, WeClone settings, a GLM-4 finetune YAML, a TRL "
        "/ alignment-handbook recipe, an axolotl YAML, a launch script (read with a shell "
        "parser, never run: torchrun, deepspeed, accelerate, python, llamafactory-cli, swift, "
        "tune run, axolotl), a Python training script (read with ast), a torchtune config, a "
        "TrainingArguments JSON with a DeepSpeed JSON, a configuration with its accelerate "
        "config, or an oomless.yaml; predict each phase's memory; when it does not fit within "
        "the headroom, print the smallest change (same effective batch) as a unified diff of "
        "the same file(s). The diff is printed unwrapped: `oomless check X > fix.patch; "
        "patch -p1 < fix.patch` applies it. When no change the file can express keeps the "
        "band's upper bound on the card, the smallest one that keeps the headroom is printed, "
        "labelled tight. Exit code 0: fits (within the headroom, and the upper bound "
        "of the estimate's uncertainty band fits the GPU); 1: tight (the GPU's memory lies "
        "inside the band, or only the headroom is missed) or out of memory (even the band's "
        "lower bound does not fit): the fix is printed; 2: bad input, or can't tell (a setting "
        "that changes memory is not understood or only known when the script runs: the "
        "message names it and the option that settles it).")
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="the configuration (two files: TrainingArguments JSON and DeepSpeed "
                   "JSON, or a configuration and its accelerate config)")
    p.add_argument("--gpu", type=GPU_TEXT, help="GPU and count: 4090x8, 'a100-40gb x8' (see `oomless gpus`); "
                   "a bare name takes the count from the file (accelerate, launcher)")
    p.add_argument("--nodes", type=capped("hardware.nodes"))
    p.add_argument("--model", help="the model, where the file does not name it (GLM-4, "
                   "DeepSpeed/TrainingArguments) or to override it")
    p.add_argument("--seq-len", type=capped("seq_len"), help="tokens per sample "
                   "(DeepSpeed/TrainingArguments, scripts and configs that do not state it)")
    p.add_argument("--method", choices=["full", "lora", "qlora"],
                   help="DeepSpeed/TrainingArguments/accelerate (default full), or where check "
                   "cannot tell the method of a script")
    p.add_argument("--images", type=capped("data.images_per_sample", 0),
                   help="images per sample (vision-language)")
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
    add_run_sim_options(p, check=True)
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
            if Path(path).exists():
                _refuse_existing(f"{path}.orig", args.force, "backup")
        for path, text in result.new_texts.items():
            if not Path(path).exists():  # a DeepSpeed file the fix points to
                write_atomic(path, text)
                done.append(f"wrote {path} (new: the DeepSpeed file the fix points to)")
                continue
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
    run_sim = _run(result, args) if args.steps else None
    if args.json:
        import json

        print(json.dumps({**result.to_dict(), "written": done,
                          **({"run": run_sim} if run_sim else {})}, indent=2))
    else:
        from ._render_check import render_check, render_run

        render_check(result, done)
        if run_sim:
            render_run(run_sim)
    # a run that fails on the card (fragmentation included) does not fit
    return max(result.exit_code, int(bool(run_sim) and run_sim["verdict"] != "fits"))


def _run(result, args: argparse.Namespace) -> dict:
    """--steps: the run over --data through the caching-allocator model."""
    from ..config import RunConfig
    from ..errors import ConfigError
    from ..runtime.trace.run_stream import run_over
    from ._options import run_alloc_conf

    if not args.data:
        raise ConfigError("--steps replays a run over the training data: give --data FILE")
    cfg = RunConfig.model_validate(result.config)
    return run_over(cfg, data=args.data, steps=args.steps, order=args.order, seed=args.seed,
                    cap=cfg.seq_len, empty_cache_every=args.empty_cache_steps,
                    alloc_conf=run_alloc_conf(args))
