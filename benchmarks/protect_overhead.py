"""Step time of a transformers Trainer protected by ``oomless.hf.protect`` against the plain one.

Same model (a small random Qwen2 built by oomless.runtime.tiny), same data
(the shipped demo records), LoRA r16 on all linear layers, fp32, AdamW,
micro batch 8 x accumulation 2, dynamic padding, on the CPU, one intra-op
thread (a shared machine's spin-waiting threads otherwise dominate). Time
per optimizer step is the wall time between consecutive ``on_step_end``
callbacks, so the protection's callback (memory log line, bookkeeping) and
its ``training_step`` / ``prediction_step`` wrappers are included. Nothing
runs out of memory: this is the price of being protected. The first steps
are warm-up; the two Trainers alternate round by round so that load on the
machine hits both.

Run: .venv/bin/python benchmarks/protect_overhead.py [--steps 40] [--rounds 3]
→ prints and writes benchmarks/results/protect_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

RESULTS = Path(__file__).parent / "results" / "protect_overhead.json"
MODEL = {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4,
         "intermediate_size": 688}
MICRO, ACCUM, SEQ, WARMUP = 8, 2, 128, 5


def _rows(model_dir: Path) -> list[dict]:
    from oomless.config import DataConfig
    from oomless.dataset.records import load_examples, load_tokenizer
    from oomless.runtime.tiny import demo_data_path

    tok = load_tokenizer(str(model_dir))
    examples = load_examples(demo_data_path(), tok, DataConfig(), SEQ).examples
    return [{"input_ids": list(e.input_ids), "labels": list(e.labels),
             "attention_mask": [1] * len(e)} for e in examples]


def time_trainer(model_dir: Path, rows: list[dict], out: Path, steps: int,
                 protected: bool) -> list[float]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        DataCollatorForSeq2Seq,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from oomless.dataset.records import load_tokenizer
    from oomless.hf import protect

    tok = load_tokenizer(str(model_dir))
    torch.manual_seed(42)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM,
        max_steps=steps, learning_rate=1e-3, lr_scheduler_type="constant", max_grad_norm=1.0,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=42,
        dataloader_num_workers=0, optim="adamw_torch", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[Clock()],
                      data_collator=DataCollatorForSeq2Seq(tok, padding=True,
                                                           label_pad_token_id=-100))
    if protected:
        protect(trainer, preflight="off")
    trainer.train()
    return [b - a for a, b in zip(ends, ends[1:], strict=False)][WARMUP:]


def main() -> None:
    import torch
    from transformers.utils import logging as hf_logging

    from oomless.runtime.tiny import build_tiny_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of each")
    args = parser.parse_args()
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    plain: list[float] = []
    ours: list[float] = []
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = build_tiny_model(root / "model", **MODEL)
        rows = _rows(model_dir)
        for r in range(args.rounds):
            p = time_trainer(model_dir, rows, root / f"plain{r}", args.steps, protected=False)
            o = time_trainer(model_dir, rows, root / f"protected{r}", args.steps, protected=True)
            plain += p
            ours += o
            rounds.append({"protected_s": round(statistics.median(o), 5),
                           "plain_s": round(statistics.median(p), 5)})
    med_ours, med_plain = statistics.median(ours), statistics.median(plain)
    result = {
        "benchmark": "protect_overhead", "date": date.today().isoformat(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
                   f"{torch.get_num_threads()} thread",
        "model": MODEL, "micro_batch_size": MICRO, "grad_accum": ACCUM, "seq_len": SEQ,
        "method": "lora r16 all-linear, fp32, AdamW, CPU, transformers Trainer",
        "steps_timed_per_trainer": len(ours),
        "protected_step_s_median": round(med_ours, 5),
        "plain_step_s_median": round(med_plain, 5),
        "overhead_pct": round(100 * (med_ours / med_plain - 1), 2),
        "rounds": rounds,
        "note": "shared 2-core machine with other jobs running: compare the rounds' spread "
                "with the overhead before reading it; not yet measured on a GPU",
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp_file = RESULTS.with_suffix(".json.tmp")
    tmp_file.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp_file, RESULTS)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
