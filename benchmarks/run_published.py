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
# ms-swift's dataset table (docs, 'Supported models and datasets'): damo/zh_cls_fudan-news,
# train split, 4959 rows, tokens 3234.4±2547.5, min=91, max=19548 (Qwen's tokenizer).
# The benchmark's script (scripts/benchmark/test_memory_time/run_single.py) trains on all of
# it (train_dataset_sample -1 for max_length <= 2048); swift's default truncation_strategy
# 'delete' leaves out the samples longer than max_length. The rows themselves (one token
# length each) are on ModelScope only: no copy of damo/zh_cls_fudan-news (nor of its
# swift/zh_cls_fudan-news re-export, text/category/output) was found in the public GitHub
# repositories searched (2026-11-26; tutorials that train on it download train.jsonl
# from ModelScope and do not commit it), so its lengths stay drawn from these statistics.
SWIFT_DATA = {"n": 4959, "mean": 3234.4, "std": 2547.5, "min": 91, "max": 19548}
SWIFT_SHAPES = ("truncnorm", "lognormal")  # the row's prediction, then the sensitivity
_SWIFT_SETUP = ("ms-swift benchmark (docs/source_en/LLM/Benchmark.md, 'Model Type & Max Length', "
                "LoRA): swift sft on cls-fudan-news-zh (4959 samples; token lengths with Qwen's "
                "tokenizer 3234.4±2547.5, min 91, max 19548; samples longer than --max_length "
                "left out), one epoch, batch 1, gradient accumulation 16, checkpointing, flash "
                "attention, LoRA r8 on c_attn; 1x A100, torch 2.1.1")
SWIFT_ASSUMPTIONS = (
    "model: Qwen-1 runs remote code; traced as a Qwen2ForCausalLM of the same dimensions "
    "(benchmarks/published/qwen1-standin/README.md: same parameter bytes; Qwen-1's fused "
    "c_attn output is one [s, 3h] block instead of three; LoRA on q/k/v instead of c_attn, "
    "+2.1M trainable parameters; Qwen-1's fp32 rotary transients; Qwen-1's own loss keeps "
    "one more bf16 [s, vocab] copy of the logits, 2 bytes x 151936 per token, which the "
    "stand-in does not have — none corrected for)",
    "lengths: only mean, std, min and max are published; the samples are drawn (4959, seed 0) "
    "from a normal truncated to [min, max] with those truncated moments; the prediction "
    "under a log-normal of the same mean and std is reported beside it",
    "order: HF Trainer's random sampler, one epoch of the samples no longer than max_length, "
    "steps = kept samples // 16 (the last partial accumulation left out)",
)
for _model, _values in (("qwen-1_8b", (6.99, 10.71, 16.35)),
                        ("qwen-7b", (18.01, 21.73, 27.74))):
    for _length, _gib in zip((512, 1024, 2048), _values, strict=True):
        ROWS.append({"id": f"swift-{_model}-chat-lora-{_length}", "source": _SWIFT,
                     "quote": f"{_model}-chat | {_length} | … | {_gib} (GPU Memory (GiB))",
                     "published": {"reserved_max": round(_gib * 2**30)},
                     "setup": _SWIFT_SETUP + f"; --max_length {_length}", "order": "random",
                     "config": f"published/swift-{_model}-lora.yaml", "max_length": _length,
                     "assumptions": list(SWIFT_ASSUMPTIONS)})
# What would predict the PEFT rows: the token length of each training sample, i.e.
# meta-math/MetaMathQA (395k rows, one JSON file of about 400 MB on the Hugging Face hub)
# filtered by data.py (CHAR_LIMIT), split by its StratifiedKFold, formatted with the
# run's query template and tokenized with Llama-3.2's tokenizer. Neither the dataset (nor a
# sample of it) nor that tokenizer was found in the public GitHub repositories searched
# (2026-11-26); a partial sample would in any case not give the longest of the run's 20000
# samples, which set the high water.
MISS_NO_LENGTHS = (
    "not predicted: the run's token lengths are not published as a distribution. What the "
    "PEFT repository publishes: method_comparison/MetaMathQA/data.py keeps the samples whose "
    "'query response' text has at most 1300 characters (CHAR_LIMIT; 93.8% of MetaMathQA, "
    "its comment says, with 99% of queries at most 529 characters) and truncates to "
    "max_seq_length 768 tokens; the results file gives 'train total tokens' 4198051 over "
    "20000 training samples (a mean of about 210 tokens a sample, the padding counted or "
    "not as run.py counts it). A mean and two caps do not fix the lengths of the longest "
    "batches, which set the high water, and the run's MetaMathQA text (Llama-3.2 tokenizer, "
    "query template) is not shipped here to tokenize; --lengths-file {id}=PATH predicts it")

NOT_RUN = ("not predicted in this run of the benchmark: its replay had not finished on the "
           "shared 2-CPU machine that wrote these results; "
           "benchmarks/run_published.py --only {id} predicts it")


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


def predict_swift(row: dict, steps: int = 0, seeds: int = 0) -> list[dict]:
    """An ms-swift row under each length shape (SWIFT_SHAPES): lengths drawn from the
    published statistics, the samples longer than max_length left out, one epoch through
    the allocator model. The step is traced once, up to max_length. ``seeds`` N > 0: the
    first shape's run is also replayed under the shuffle seeds 1..N (the run's own order,
    torch's RandomSampler under swift's seed, is not reproduced here: Python's generator
    gives other orders of the same distribution), to show how much the order moves it."""
    from length_shapes import sample_lengths

    from oomless.api import cluster_for
    from oomless.config import load_run_config
    from oomless.planner.runsim import predict_run
    from oomless.runtime.trace.run_stream import capacity_bytes, scaled_step_stream

    d, cap = SWIFT_DATA, row["max_length"]
    cfg = load_run_config(str(ROOT / row["config"]))
    cfg = cfg.replace(seq_len=cap, model=str((ROOT / row["config"]).parent / cfg.model))
    cluster = cluster_for(cfg)
    stream = scaled_step_stream(cfg, cap, cluster)
    out = []
    for shape in SWIFT_SHAPES:
        drawn = sample_lengths(shape, d["n"], d["mean"], d["std"], d["min"], d["max"], seed=0)
        kept = [x for x in drawn if x <= cap]
        pred = predict_run(stream, kept, batch=cfg.micro_batch_size, grad_accum=cfg.grad_accum,
                           steps=steps or max(1, len(kept) // cfg.grad_accum),
                           order=row["order"], cap=cap,
                           capacity_bytes=capacity_bytes(cluster, 1), fixes=False)
        run = pred.default
        out.append({"shape": shape, "reserved_max": run.high_water_bytes,
                    "high_water_step": run.high_water_step,
                    "allocated_max": run.peak_allocated_bytes,
                    "fragmentation_at_high_water": run.fragmentation_bytes,
                    "expandable_reserved_max": pred.expandable.high_water_bytes,
                    "samples_kept": len(kept), "steps": run.steps,
                    "traced_lengths": list(stream.lengths)})
        if seeds and shape == SWIFT_SHAPES[0]:
            out[0]["by_seed"] = {seed: predict_run(
                stream, kept, batch=cfg.micro_batch_size, grad_accum=cfg.grad_accum,
                steps=out[0]["steps"], order=row["order"], cap=cap,
                capacity_bytes=capacity_bytes(cluster, 1), seed=seed,
                fixes=False).default.high_water_bytes for seed in range(1, seeds + 1)}
    return out


def _predict_row(row: dict, rec: dict, files: dict, steps: int, seeds: int = 0) -> None:
    if "max_length" in row:
        preds = predict_swift(row, steps, seeds)
        rec["predicted"], rec["sensitivity"] = preds[0], preds[1:]
        rec["assumptions"] = row["assumptions"]
        pub = row["published"]["reserved_max"]
        rec["errors"] = {"reserved_max": (preds[0]["reserved_max"] - pub) / pub}
        rec["errors_by_shape"] = {p["shape"]: (p["reserved_max"] - pub) / pub for p in preds}
        return
    path = files.get(row["id"])
    if path is None:
        rec["miss"] = MISS_NO_LENGTHS.format(id=row["id"])
        return
    lengths = [int(x) for x in Path(path).read_text().split()]
    rec["predicted"] = predict(row, lengths, steps or row["steps"])
    rec["errors"] = {k: (rec["predicted"][k] - v) / v
                     for k, v in row["published"].items() if k in rec["predicted"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths-file", action="append", default=[], metavar="ROW_ID=PATH")
    ap.add_argument("--steps", type=int, default=0, help="steps to replay (default: the row's)")
    ap.add_argument("--only", action="append", default=[], metavar="ROW_ID",
                    help="predict only these rows; the others keep their committed results")
    ap.add_argument("--seeds", type=int, default=0, metavar="N",
                    help="ms-swift rows: also replay under the shuffle seeds 1..N")
    ap.add_argument("--not-run", action="append", default=[], metavar="ROW_ID",
                    help="write these rows as not predicted by this run (a replay not finished)")
    args = ap.parse_args()
    files = dict(item.split("=", 1) for item in args.lengths_file)
    out = RESULTS / "run_published.json"
    RESULTS.mkdir(exist_ok=True)
    for row in ROWS:
        if (args.only or args.not_run) and row["id"] not in args.only + args.not_run:
            continue
        rec = {k: row[k] for k in ("id", "source", "quote", "setup", "published", "order")}
        if row["id"] in args.not_run:
            rec["miss"] = NOT_RUN.format(id=row["id"])
        else:
            _predict_row(row, rec, files, args.steps, args.seeds)
        print(rec["id"], rec.get("errors", rec.get("miss")), flush=True)
        _write(out, rec, keep_others=bool(args.only or args.not_run))
    print(markdown(json.loads(out.read_text())["rows"]))


def _write(out: Path, rec: dict, keep_others: bool) -> None:
    """Put one row's record into the results (read again first: --only runs of other
    rows may be writing beside this one), in ROWS order, and rewrite the table."""
    done = ({r["id"]: r for r in json.loads(out.read_text())["rows"]}
            if out.exists() else {})
    if not keep_others and rec["id"] == ROWS[0]["id"]:
        done = {}
    done[rec["id"]] = rec
    rows = [done[r["id"]] for r in ROWS if r["id"] in done]
    out.write_text(json.dumps({"date": date.today().isoformat(), "rows": rows}, indent=1) + "\n")
    (RESULTS / "run_published.md").write_text(markdown(rows))


def markdown(rows: list[dict]) -> str:
    out = ["# Published runs over variable-length data", "",
           "| row | published reserved max / 99th / avg | predicted | error (max) "
           "| other length shape: predicted (error) | source |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        pub = r["published"]
        published = " / ".join(f"{pub[k] / 2**30:.2f} GiB"
                               for k in ("reserved_max", "reserved_99th", "reserved_avg")
                               if k in pub)
        if "predicted" in r:
            p = r["predicted"]
            pred = " / ".join(f"{p[k] / 2**30:.2f} GiB"
                              for k in ("reserved_max", "reserved_99th", "reserved_avg") if k in p)
            err = f"{r['errors']['reserved_max']:+.1%}"
        else:
            pred = "not run" if r["miss"].startswith(NOT_RUN[:30]) else "miss"
            err = "—"
        other = "; ".join(f"{q['shape']}: {q['reserved_max'] / 2**30:.2f} GiB "
                          f"({r['errors_by_shape'][q['shape']]:+.1%})"
                          for q in r.get("sensitivity", ())) or "—"
        out.append(f"| {r['id']} | {published} | {pred} | {err} | {other} "
                   f"| [source]({r['source']}) |")
    out.append("")
    for r in rows:
        out.append(f"- **{r['id']}** — {r['setup']}. Quote: “{r['quote']}”."
                   + (f" {r['miss']}" if "miss" in r else ""))
        if "predicted" in r and "shape" in r["predicted"]:
            p = r["predicted"]
            out.append(f"  Predicted ({p['shape']}): {p['samples_kept']} samples kept, "
                       f"{p['steps']} steps, traced at {p['traced_lengths']}; high water at "
                       f"step {p['high_water_step']}, "
                       f"{p['fragmentation_at_high_water'] / 2**30:.2f} GiB of it reserved but "
                       f"unallocated; peak allocated {p['allocated_max'] / 2**30:.2f} GiB; with "
                       f"expandable_segments {p['expandable_reserved_max'] / 2**30:.2f} GiB.")
            if p.get("by_seed"):
                pub = r["published"]["reserved_max"]
                per = sorted(p["by_seed"].values())
                out.append(f"  Order: under the shuffle seeds 1–{len(per)} instead of the default "
                           f"(42) the high water is {per[0] / 2**30:.2f}–{per[-1] / 2**30:.2f} GiB "
                           f"({(per[0] - pub) / pub:+.1%} to {(per[-1] - pub) / pub:+.1%}), median "
                           f"{per[len(per) // 2] / 2**30:.2f} GiB.")
        for a in r.get("assumptions", ()):
            out.append(f"  Assumption — {a}.")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
