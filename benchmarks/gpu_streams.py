"""The caching allocator's own event stream on a GPU, against the allocator model and the trace.

On the GPU (one configuration per process, so each has a fresh CUDA context):
    python3 benchmarks/gpu_streams.py record '{"model": ..., "method": ...}' OUT.json.gz
runs ``oomless measure`` in-process with ``torch.cuda.memory._record_memory_history``
on and writes, as gzipped JSON (never a pickle), every alloc / free / segment event
the allocator logged with the few Python frames from transformers, PEFT, bitsandbytes,
accelerate, torch.nn or oomless that asked for it, the final segments and the
measurement. The files are kept in benchmarks/results/gpu_streams/.

Here (no GPU needed):
    .venv/bin/python benchmarks/gpu_streams.py compare
replays each recorded stream through oomless.allocator.CachingAllocator (a
``segment_free`` run is an ``empty_cache()``), compares its peaks with the measured
``max_memory_allocated`` / ``max_memory_reserved``, traces the same configuration here
(oomless.runtime.trace.fake ``trace_training``) and lists the allocation sizes the two
streams keep alive over the first step's forward in different numbers. Writes
benchmarks/results/gpu_streams.md.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).parent
STREAMS = HERE / "results" / "gpu_streams"
PREDICT_GPU = "h200"
KEEP_FRAMES = ("site-packages", "oomless")
MIB = 2**20


def record(cfg_json: str, out_path: str) -> None:
    import torch

    torch.cuda.memory._record_memory_history(max_entries=3_000_000, context="alloc",
                                             stacks="python")
    from oomless.config import RunConfig
    from oomless.models.hardware import Cluster, get_gpu
    from oomless.runtime.trace.measure import measure_training

    config = json.loads(cfg_json)
    cfg = RunConfig.model_validate({**config, "hardware": {"gpu": PREDICT_GPU}})
    est = measure_training(cfg, Cluster(get_gpu(PREDICT_GPU)), device="cuda", steps=3)
    snap = torch.cuda.memory._snapshot()
    events = [[e["action"], e["addr"], e["size"], _frames(e.get("frames"))]
              for e in snap["device_traces"][0]]
    segments = [{"address": s["address"], "total_size": s["total_size"],
                 "blocks": [[b["size"], b["state"]] for b in s["blocks"]]}
                for s in snap["segments"]]
    with gzip.open(out_path, "wt") as f:
        json.dump({"config": config, "gpu": torch.cuda.get_device_name(0),
                   "torch": torch.__version__, "measured": est.to_dict(),
                   "events": events, "segments": segments}, f)


def _frames(frames: list[dict[str, Any]] | None) -> list[str]:
    out = []
    for f in frames or []:
        name = f.get("filename", "")
        if any(k in name for k in KEEP_FRAMES):
            short = name.split("site-packages/")[-1].split("/src/")[-1]
            out.append(f"{short}:{f.get('line')}:{f.get('name')}")
        if len(out) == 4:
            break
    return out


def replay_recorded(events: list[list[Any]], device_addresses: bool = True) -> tuple[int, int]:
    """(peak allocated, peak reserved) of the allocator model over a recorded stream, its
    segments placed where the device put them (``device_addresses``) or numbered upward
    as the model does on its own."""
    from oomless.allocator import AllocatorConfig, CachingAllocator

    alloc = CachingAllocator(AllocatorConfig())
    live: dict[int, Any] = {}
    previous = None
    for action, addr, size, _ in events:
        if action == "segment_alloc" and device_addresses:
            alloc.place_next_segment(addr)  # logged just before the alloc that made it
        elif action == "alloc":
            live[addr] = alloc.malloc(size)
        elif action == "free_completed" and addr in live:
            alloc.free(live.pop(addr))
        elif action == "segment_free" and previous != "segment_free":
            alloc.empty_cache()  # the device released its cached segments
        previous = action
    return alloc.peak_allocated_bytes, alloc.peak_reserved_bytes


def _live_at_peak(allocs: list[tuple[str, Any, int]]) -> collections.Counter:
    """Sizes (rounded as the allocator rounds) of what is live at the allocated peak of a
    stream of ("alloc" | "free", key, size) events."""
    from oomless.allocator import round_size

    live: dict[Any, int] = {}
    now = best = 0
    best_live: dict[Any, int] = {}
    for kind, key, size in allocs:
        if kind == "alloc":
            live[key] = round_size(size)
            now += live[key]
            if now > best:
                best, best_live = now, dict(live)
        elif key in live:
            now -= live.pop(key)
    return collections.Counter(best_live.values())


def _trace(config: dict[str, Any]) -> tuple[Any, list[tuple[str, Any, int]]]:
    import oomless.runtime.trace.fake as fake
    from oomless.config import RunConfig
    from oomless.models.catalog import resolve_model

    seen: dict[str, Any] = {}
    analyze = fake.analyze

    def keep(stream: Any, *args: Any, **kwargs: Any) -> Any:
        seen["stream"] = stream
        return analyze(stream, *args, **kwargs)

    fake.analyze = keep
    try:
        cfg = RunConfig.model_validate({**config, "hardware": {"gpu": PREDICT_GPU}})
        est = fake.trace_training(cfg, resolved=resolve_model(cfg.model))
    finally:
        fake.analyze = analyze
    s = seen["stream"]
    events = [(kind, key, size) for kind, key, size in s.events
              if s.category[key] != "paged" and (kind != "alloc" or size > 0)]
    return est, events


def compare() -> None:
    lines = ["# The allocator's event stream on a GPU against the allocator model and the trace",
             "", "Recorded with `benchmarks/gpu_streams.py record` (torch.cuda.memory history); "
             "GiB; the model replays the GPU's own stream, the trace is this machine's fake-"
             "tensor trace of the same configuration.", "",
             "| configuration | GPU | measured alloc / reserved | model on the GPU's stream "
             "(device addresses) | the same, model's own addresses | trace alloc / reserved |",
             "|---|---|---|---|---|---|"]
    diffs = []
    for path in sorted(STREAMS.glob("*.json.gz")):
        with gzip.open(path, "rt") as f:
            rec = json.load(f)
        measured = rec["measured"]
        model_alloc, model_reserved = replay_recorded(rec["events"])
        own_alloc, own_reserved = replay_recorded(rec["events"], device_addresses=False)
        traced, trace_events = _trace(rec["config"])
        gpu_events = [("alloc" if a == "alloc" else "free", addr, size)
                      for a, addr, size, _ in rec["events"] if a in ("alloc", "free_completed")]
        g, t = _live_at_peak(gpu_events), _live_at_peak(trace_events)
        gib = 2**30
        lines.append(
            f"| {path.name.removesuffix('.json.gz')} | {rec['gpu']}, torch {rec['torch']} | "
            f"{measured['peak_allocated_bytes'] / gib:.3f} / "
            f"{measured['peak_reserved_bytes'] / gib:.3f} | {model_alloc / gib:.3f} / "
            f"{model_reserved / gib:.3f} | {own_alloc / gib:.3f} / {own_reserved / gib:.3f} | "
            f"{traced.peak_allocated_bytes / gib:.3f} / "
            f"{traced.peak_reserved_bytes / gib:.3f} |")
        diffs.append((path.name, sorted(((size, g[size], t[size]) for size in set(g) | set(t)
                                         if g[size] != t[size]), reverse=True)))
    lines += ["", "Live at each stream's allocated peak, sizes the two streams hold in different "
              "numbers (MiB: GPU × count vs trace × count):", ""]
    for name, rows in diffs:
        shown = ", ".join(f"{s / MIB:.3f}: {a} vs {b}" for s, a, b in rows[:12]) or "none"
        lines.append(f"- {name}: {shown}")
    (HERE / "results" / "gpu_streams.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "record":
        record(sys.argv[2], sys.argv[3])
    elif sys.argv[1:] == ["compare"]:
        sys.path.insert(0, str(HERE.parent / "src"))
        compare()
    else:
        sys.exit(__doc__)
