"""Published runs over variable-length data, against the run oomless predicts.

Each row is a published training run that reports reserved memory over the run
(maximum, 99th percentile, average) and allocated memory, with its source. The
prediction replays the run through the caching-allocator model
(oomless.runtime.trace.run_stream ``predict_run_for``): the step traced at three
lengths, the run's step lengths from the dataset's token lengths in the
loader's order. It needs those token lengths: ``--lengths-file ROW_ID=PATH``
(one token count per line, in dataset order, tokenized as the run did). A row
without them is written as a miss with the reason; nothing is guessed.

    .venv/bin/python benchmarks/run_published.py [--lengths-file ID=PATH ...] [--steps N]

Writes benchmarks/results/run_published.json and .md.
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

ROOT = Path(__file__).parent
RESULTS = ROOT / "results"

_PEFT = "https://github.com/huggingface/peft/blob/{commit}/method_comparison/MetaMathQA/results/{file}"
_LOOP = ("PEFT method-comparison MetaMathQA loop (method_comparison/MetaMathQA/run.py): "
         "Llama-3.2-3B in bf16 without autocast, batch 4 padded to the longest sample "
         "(max_seq_length 768), 5000 steps, AdamW, no checkpointing, SDPA; 1x L40S; "
         "batches from utils.BucketIterator (buckets sorted longest first, as group_by_length); "
         "the maximum includes the validation generation (batch 50), which is not a training step; "
         "torch.cuda.empty_cache() every 10 steps (run.py ACCELERATOR_EMPTY_CACHE_SCHEDULE = 10 at "
         "huggingface/peft@026d1e0164165fcb4a2a98cd9b37af619745d8b3, a later commit than the runs)")
ROWS = [
    {"id": "peft-lora-r32-qv-run",
     "source": _PEFT.format(commit="0a179c1e8659ab4f7df0369b9b03943cfe470ff1",
                            file="lora--llama-3.2-3B-rank32.json"),
     "quote": '"cuda_memory_reserved_avg": 11868689976, "cuda_memory_max": 22273851392, '
              '"cuda_memory_reserved_99th": 17710763212; step 250: "mem allocated avg": '
              '6925580957.696',
     "published": {"reserved_max": 22273851392, "reserved_99th": 17710763212,
                   "reserved_avg": 11868689976, "allocated_avg": 6925580957},
     "config": "published/peft-lora-r32-qv.yaml", "order": "group_by_length", "steps": 5000, "empty_cache_every": 10,
     "setup": _LOOP},
    {"id": "peft-lora-r64-qv-run",
     "source": _PEFT.format(commit="18e07f189c06cbc6472e4e3ec180358319de8175",
                            file="lora--llama-3.2-3B-rank64.json"),
     "quote": '"accelerator_memory_reserved_avg": 12128055669, "accelerator_memory_max": '
              '22540189696, "accelerator_memory_reserved_99th": 17953927987; step 250: '
              '"mem allocated avg": 7072427177.984',
     "published": {"reserved_max": 22540189696, "reserved_99th": 17953927987,
                   "reserved_avg": 12128055669, "allocated_avg": 7072427177},
     "config": "published/peft-lora-r64-qv.yaml", "order": "group_by_length", "steps": 5000, "empty_cache_every": 10,
     "setup": _LOOP},
]
_SWIFT = ("https://github.com/modelscope/ms-swift/blob/46922151e06cdfc110882e182757674f12352f2c/"
          "docs/source_en/LLM/Benchmark.md")
_SWIFT_SETUP = ("ms-swift benchmark (docs/source_en/LLM/Benchmark.md, 'Model Type & Max Length', "
                "LoRA): swift sft on cls-fudan-news-zh (token lengths with Qwen's tokenizer "
                "3234.4±2547.5, min 91, max 19548; samples longer than --max_length left out), "
                "batch 1, gradient accumulation 16, checkpointing, flash attention, LoRA r8 on "
                "c_attn; 1x A100, torch 2.1.1")
_SWIFT_MISS = ("not predicted: Qwen (v1) runs remote code (model_type 'qwen', not in "
               "transformers), so the step cannot be traced here; and the dataset's lengths are "
               "published only as mean ± std, min and max, not as a distribution")
for _model, _values in (("qwen-1_8b-chat", (6.99, 10.71, 16.35)),
                        ("qwen-7b-chat", (18.01, 21.73, 27.74))):
    for _length, _gib in zip((512, 1024, 2048), _values, strict=True):
        ROWS.append({"id": f"swift-{_model}-lora-{_length}", "source": _SWIFT,
                     "quote": f"{_model} | {_length} | … | {_gib} (GPU Memory (GiB))",
                     "published": {"reserved_max": round(_gib * 2**30)},
                     "setup": _SWIFT_SETUP + f"; --max_length {_length}", "order": "random",
                     "miss": _SWIFT_MISS})
MISS_NO_LENGTHS = ("not predicted: the run's token lengths (MetaMathQA, Llama-3.2 tokenizer, "
                   "query template) are not shipped and cannot be downloaded here; "
                   "--lengths-file {id}=PATH predicts it")


def predict(row: dict, lengths: list[int], steps: int) -> dict:
    from oomless.allocator import AllocatorConfig
    from oomless.allocator.run import simulate_run
    from oomless.api import cluster_for
    from oomless.config import load_run_config
    from oomless.planner.runsim import micro_lengths
    from oomless.runtime.trace.run_stream import capacity_bytes, scaled_step_stream

    cfg = load_run_config(str(ROOT / row["config"]))
    cluster = cluster_for(cfg)
    lens = micro_lengths(lengths, batch=cfg.micro_batch_size, grad_accum=cfg.grad_accum,
                         steps=steps, order=row["order"], cap=cfg.seq_len)
    stream = scaled_step_stream(cfg, max(max(m) for m in lens), cluster)
    run = simulate_run(stream, lens, AllocatorConfig(capacity_bytes=capacity_bytes(cluster, 1)),
                       curve_points=0, empty_cache_every=row["empty_cache_every"])
    # the loop logs memory_reserved() after each step (before its empty_cache)
    logged = sorted(p.reserved_end_bytes for p in run.curve)
    return {"reserved_max": run.high_water_bytes,
            "reserved_99th": logged[min(len(logged) - 1, int(0.99 * len(logged)))],
            "reserved_avg": round(sum(logged) / len(logged)),
            "allocated_max": run.peak_allocated_bytes,
            "traced_lengths": list(stream.lengths), "steps": run.steps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths-file", action="append", default=[], metavar="ROW_ID=PATH")
    ap.add_argument("--steps", type=int, default=0, help="steps to replay (default: the row's)")
    args = ap.parse_args()
    files = dict(item.split("=", 1) for item in args.lengths_file)
    rows = []
    for row in ROWS:
        rec = {k: row[k] for k in ("id", "source", "quote", "setup", "published", "order")}
        path = files.get(row["id"])
        if "miss" in row:
            rec["miss"] = row["miss"]
        elif path is None:
            rec["miss"] = MISS_NO_LENGTHS.format(id=row["id"])
        else:
            lengths = [int(x) for x in Path(path).read_text().split()]
            rec["predicted"] = predict(row, lengths, args.steps or row["steps"])
            rec["errors"] = {k: (rec["predicted"][k] - v) / v
                             for k, v in row["published"].items() if k in rec["predicted"]}
        rows.append(rec)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "run_published.json").write_text(
        json.dumps({"date": date.today().isoformat(), "rows": rows}, indent=1) + "\n")
    (RESULTS / "run_published.md").write_text(markdown(rows))
    print(markdown(rows))


def markdown(rows: list[dict]) -> str:
    out = ["# Published runs over variable-length data", "",
           "| row | published reserved max / 99th / avg | predicted | error (max) | source |",
           "|---|---|---|---|---|"]
    for r in rows:
        pub = r["published"]
        published = " / ".join(f"{pub[k] / 2**30:.2f} GiB"
                               for k in ("reserved_max", "reserved_99th", "reserved_avg")
                               if k in pub)
        if "predicted" in r:
            p = r["predicted"]
            pred = " / ".join(f"{p[k] / 2**30:.2f} GiB"
                              for k in ("reserved_max", "reserved_99th", "reserved_avg"))
            err = f"{r['errors']['reserved_max']:+.1%}"
        else:
            pred, err = "miss", "—"
        out.append(f"| {r['id']} | {published} | {pred} | {err} | [source]({r['source']}) |")
    out.append("")
    for r in rows:
        out.append(f"- **{r['id']}** — {r['setup']}. Quote: “{r['quote']}”."
                   + (f" {r['miss']}" if "miss" in r else ""))
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
