"""Logits-path bytes per token per vocabulary entry, by transformers release.

Runs ``oomless.runtime.trace.loss_probe`` (a tiny Llama at two vocabulary sizes, two
training steps on real CPU tensors under the storage tracker) under every transformers
release found in a side environment, and compares the slope of the step's peak with
the analytic loss path (oomless/memory/loss_paths.py) for the HF-Trainer and the
custom-loop conventions. Results: benchmarks/results/loss_versions.json and .md.

The side environment holds one ``--target`` directory per release, for example::

    python3 -m venv /tmp/side && /tmp/side/bin/pip install torch==2.13.0 pydantic pyyaml \
        "accelerate==1.2.1" "huggingface_hub<1.0" safetensors regex requests tqdm
    /tmp/side/bin/pip install --no-deps --target /tmp/side/tf/4.46.3 transformers==4.46.3 \
        "tokenizers>=0.20,<0.21"

    python benchmarks/loss_versions.py --side /tmp/side

The release installed beside oomless (5.x) runs in this interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CONVENTIONS = ("hf-trainer", "custom-loop")


def probe(python: str, extra_path: str | None) -> dict:
    path = [str(ROOT / "src")] + ([extra_path] if extra_path else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(reversed(path))}
    proc = subprocess.run([python, "-m", "oomless.runtime.trace.loss_probe"], env=env,
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"probe failed ({extra_path or python}): {proc.stderr[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def analytic(version: str, convention: str) -> float:
    """The analytic model's logits-path slope: the larger of the forward's and the
    backward's logits bytes per token per vocabulary entry."""
    sys.path.insert(0, str(ROOT / "src"))
    from oomless.config import RunConfig
    from oomless.memory.loss_paths import logits_bytes
    from oomless.memory.precision import dtypes_for
    from oomless.models.catalog import resolve_model

    spec = resolve_model("llama-3.2-1b-instruct").spec
    cfg = RunConfig(model=spec.name, method="lora", precision="bf16", stack=convention,
                    stack_options={"transformers_version": version})
    parts = logits_bytes(spec, cfg, dtypes_for(cfg), 1)
    return max(parts["forward"], parts["backward"]) / spec.vocab_size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", type=Path, help="side venv with tf/<version> target dirs")
    args = ap.parse_args()
    runs = [probe(sys.executable, None)]
    if args.side:
        python = str(args.side / "bin" / "python")
        for target in sorted((args.side / "tf").iterdir(),
                             key=lambda p: tuple(int(x) for x in p.name.split("."))):
            runs.append(probe(python, str(target)))
    rows = []
    for run in sorted(runs, key=lambda r: tuple(int(x) for x in r["transformers"].split(".")[:3])):
        for conv in CONVENTIONS:
            traced = run[conv]["allocated_bytes_per_token_vocab"]
            model = analytic(run["transformers"], conv)
            rows.append({"transformers": run["transformers"], "convention": conv,
                         "traced_allocated": traced, "analytic": model,
                         "error": round(model / traced - 1, 4),
                         "traced_reserved": run[conv]["reserved_bytes_per_token_vocab"]})
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "loss_versions.json").write_text(json.dumps(
        {"date": date.today().isoformat(), "torch": runs[0]["torch"], "rows": rows},
        indent=2) + "\n")
    lines = [f"# Logits-path bytes per token × vocabulary entry ({date.today().isoformat()})", "",
             "Slope of a training step's peak with the vocabulary, traced with each release's "
             "real code (benchmarks/loss_versions.py), against the analytic loss path.", "",
             "| transformers | convention | traced (allocated) | analytic | error | "
             "traced (reserved, allocator simulation) |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['transformers']} | {r['convention']} | {r['traced_allocated']:.2f} | "
              f"{r['analytic']:.2f} | {r['error']:+.1%} | {r['traced_reserved']:.2f} |"
              for r in rows]
    (RESULTS / "loss_versions.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
