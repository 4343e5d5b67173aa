"""``oomless demo``: plan → train → report on a tiny local model, offline, on CPU.

Everything the demo needs is made here or shipped with the package: a tiny
random-weight Qwen2-style model and a tokenizer trained locally
(runtime/tiny.py), and ~200 instruction records (oomless/data/demo_sft.jsonl).
One OOM is injected on purpose at step 10 so that the recovery shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import RunConfig, dump_run_config
from ..fileio import OutputFolder, write_atomic
from .tiny import build_tiny_model, demo_data_path

DEMO_STEPS = 30
OOM_STEP = 10
EVAL_RECORDS = 16


@dataclass(frozen=True)
class DemoFiles:
    out_dir: Path
    model_dir: Path
    train_file: Path
    eval_file: Path
    config_file: Path
    config: RunConfig


def demo_config(model_dir: Path, train_file: Path, eval_file: Path, run_dir: Path) -> RunConfig:
    """LoRA on the tiny model: micro batch 4 x accumulation 2, fp32 on CPU."""
    return RunConfig.model_validate({
        "model": str(model_dir), "method": "lora", "precision": "fp32",
        "micro_batch_size": 4, "grad_accum": 2, "seq_len": 128, "attn": "sdpa",
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "targets": "all-linear"},
        "data": {"train_file": str(train_file), "eval_file": str(eval_file)},
        "eval": {"batch_size": 8, "predict_with_generate": True, "max_new_tokens": 12},
        "training": {"output_dir": str(run_dir), "max_steps": DEMO_STEPS,
                     "learning_rate": 1e-2, "warmup_ratio": 0.1, "lr_scheduler": "cosine",
                     "seed": 0, "inject_oom": [{"step": OOM_STEP, "rank": 0}]},
    })


DEMO_ENTRIES = ("tiny-qwen2", "data", "oomless.yaml", "run")


def prepare_demo(out_dir: str | Path, force: bool = False) -> DemoFiles:
    """Write the tiny model, the data and ``oomless.yaml`` under ``out_dir``.

    The folder is an :class:`~oomless.fileio.OutputFolder`: an earlier demo's
    entries are reused or replaced; anything else there is refused unless
    ``force`` (then entries in the way are kept as NAME.orig, others left alone).
    """
    folder = OutputFolder(Path(out_dir).resolve(), force, "--out")
    folder.prepare(list(DEMO_ENTRIES), known=DEMO_ENTRIES)
    out = folder.path
    model_dir = build_tiny_model(folder.own_dir("tiny-qwen2"))
    data_dir = folder.own_dir("data")
    data_dir.mkdir(exist_ok=True)
    text = demo_data_path().read_text(encoding="utf-8")
    train_file = write_atomic(data_dir / "demo_sft.jsonl", text)
    lines = text.split("\n")[:EVAL_RECORDS]
    eval_file = write_atomic(data_dir / "demo_eval.jsonl", "".join(x + "\n" for x in lines))
    cfg = demo_config(model_dir, train_file, eval_file, folder.own_dir("run"))
    config_file = folder.write("oomless.yaml", dump_run_config(cfg))
    folder.finish()
    return DemoFiles(out, model_dir, train_file, eval_file, config_file, cfg)


def estimate_demo(files: DemoFiles) -> Any:
    """The analytic per-GPU estimate of the demo run (a MemoryEstimate)."""
    from ..memory import estimate_training
    from ..models.catalog import resolve_model

    return estimate_training(resolve_model(str(files.model_dir)).spec, files.config)


def report_demo(run_dir: Path) -> Path | None:
    """``oomless report`` of the run, when plotly is installed (else None)."""
    from ..errors import OomlessError

    try:
        from ..report import load_report_data, require_plotly, write_report

        require_plotly()
    except (ImportError, OomlessError):
        return None
    return write_report(load_report_data(run_dir), run_dir / "report.html")


NEXT_STEPS = """\
Next, for a real model (download it first; oomless itself never goes online):
  oomless estimate Qwen/Qwen2.5-7B-Instruct --method qlora --gpu 4090 --grad-ckpt
  oomless plan Qwen/Qwen2.5-7B-Instruct --gpu 4090 --data your_data.jsonl --out plan/
  oomless train plan/oomless.yaml          # add --auto-fit to apply the best plan if it won't fit
  oomless report {run_dir}"""
