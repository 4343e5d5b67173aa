"""Estimates against memory that others measured on real GPUs.

Reads benchmarks/published_rows.yaml (each row: source with commit or URL, the exact
quote, the configuration, which counter was measured), writes the run configuration of
each training row to benchmarks/published/<id>.yaml, runs the `oomless estimate` command
of every row, and compares the figure that matches the measured counter:

- reserved → peak_reserved_bytes; allocated → peak_allocated_bytes (HF generate:
  weights + KV cache + activations + logits); vLLM's profiler → weights + non-torch +
  activation peak (vllm-non-kv) or the KV cache the budget leaves (vllm-kv), per GPU; unknown and limits → device_peak_bytes (a limit row compares with the
  card's memory: the configuration was the longest that fitted).

Error = predicted / measured − 1 (negative: under-estimate). Writes
benchmarks/results/published.json and published.md, and prints the band the rows imply
(oomless/memory/band.py must hold the same numbers).

The fit verdict is scored on the card each measurement ran on (``measured_on``, with what
happened there, ``outcome``: ran or oom): the row's command again with ``--gpu <measured_on>``.
oomless's verdict there is the estimate's ``verdict`` (fits / tight / out of memory, the band
rule of oomless/memory/band.py), vLLM's start-up check (``fits``: one full-length sequence fits
the KV cache the budget leaves) or, for HF generate, the CLI's rule (the device peak within the
card). A run that ran is judged right when oomless says fits, an out-of-memory when it says oom;
tight is neither right nor wrong (strict: right only; lenient: right or tight).

    python benchmarks/published.py
    python benchmarks/published.py --rows torchtune-   # only the rows whose id starts so;
                                                       # the others keep their committed results
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from datetime import date
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
ROWS = ROOT / "benchmarks" / "published_rows.yaml"
CONFIGS = ROOT / "benchmarks" / "published"
RESULTS = ROOT / "benchmarks" / "results"
GiB = 1024**3
KNOWN_COUNTERS = ("allocated", "reserved", "vllm-profiler")


def measured_bytes(row: dict) -> int:
    value, unit = row["measured"]["value"], row["measured"]["unit"]
    if unit == "bytes":
        return int(value)
    if unit == "MiB":
        return round(value * 2**20)
    if unit in ("GiB", "GB"):  # "GB" in these sources is read as GiB: the larger reading
        return round(value * GiB)
    if unit == "gpu":  # a limit: the card's memory from the GPU catalog
        sys.path.insert(0, str(ROOT / "src"))
        from oomless.models.hardware import get_gpu

        return get_gpu(value).memory_bytes
    raise ValueError(f"{row['id']}: unknown unit {unit}")


def command(row: dict) -> list[str]:
    """The oomless arguments of a row (writing its run configuration first)."""
    if "run" in row:
        path = CONFIGS / f"{row['id']}.yaml"
        CONFIGS.mkdir(exist_ok=True)
        path.write_text(f"# {row['source']}\n" + yaml.safe_dump(row["run"], sort_keys=False))
        return ["estimate", str(path.relative_to(ROOT))]
    return list(row["argv"])


def predicted_bytes(row: dict, out: dict) -> tuple[int, int | None, int | None]:
    """(point, low, high) in the measured counter's terms."""
    kind = row["compare"]
    if kind == "hf-allocated":
        point = sum(out[k] for k in ("weights_bytes", "kv_cache_bytes", "activations_bytes",
                                     "logits_bytes"))
        return point, None, None
    if kind == "vllm-non-kv":
        return out["weights_bytes"] + out["profile_peak_bytes"] + out["non_torch_bytes"], None, None
    if kind == "vllm-kv":
        return out["kv_cache_bytes"], None, None
    field = {"reserved": "peak_reserved_bytes", "allocated": "peak_allocated_bytes",
             "device": "device_peak_bytes"}[kind]
    point = out[field]
    scale = point / out["device_peak_bytes"]  # the band is relative: carry it to this counter
    return point, round(out["low_bytes"] * scale), round(out["high_bytes"] * scale)


def oomless_json(row: dict, argv: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "-m", "oomless", *argv, "--json"], cwd=ROOT,
                          capture_output=True, text=True, env={"PYTHONPATH": str(ROOT / "src"),
                                                               "PATH": "/usr/bin:/bin"})
    if proc.returncode:
        raise SystemExit(f"{row['id']}: oomless failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def verdict_of(out: dict, gpu: str) -> str:
    """fits / tight / oom of an `oomless estimate --json` output on ``gpu``."""
    if out.get("engine") == "vllm":
        return "fits" if out["fits"] else "oom"
    if out.get("engine") == "hf":  # the CLI's rule (oomless.cli._render_infer.render_generate)
        sys.path.insert(0, str(ROOT / "src"))
        from oomless.models.hardware import parse_gpu_arg

        return "fits" if out["device_peak_bytes"] <= parse_gpu_arg(gpu).gpu.memory_bytes else "oom"
    return {"fits": "fits", "tight": "tight", "out of memory": "oom"}[out["verdict"]]


def judged(outcome: str, verdict: str) -> str:
    """right / tight / wrong: a run that ran needs fits, an out-of-memory needs oom."""
    if verdict == "tight":
        return "tight"
    return "right" if (verdict == "fits") == (outcome == "ran") else "wrong"


def verdict_fields(row: dict, argv: list[str]) -> dict:
    """The fit verdict on the card the row was measured on (none where the card is unknown)."""
    card, outcome = row["measured_on"], row["outcome"]
    if card is None:
        return {"measured_on": None, "outcome": outcome, "verdict_command": None,
                "verdict": None, "verdict_right": None}
    vargv = [*argv, "--gpu", card]
    verdict = verdict_of(oomless_json(row, vargv), card)
    return {"measured_on": card, "outcome": outcome,
            "verdict_command": "oomless " + " ".join(vargv), "verdict": verdict,
            "verdict_right": judged(outcome, verdict)}


def run_row(row: dict) -> dict:
    argv = command(row)
    out = oomless_json(row, argv)
    point, low, high = predicted_bytes(row, out)
    measured = measured_bytes(row)
    return {
        "id": row["id"], "group": row["group"], "source": row["source"], "quote": row["quote"],
        "setup": row["setup"], "counter": row["counter"], "compare": row["compare"],
        "command": "oomless " + " ".join(argv), "measured_bytes": measured,
        "predicted_bytes": point, "low_bytes": low, "high_bytes": high,
        "error": round(point / measured - 1, 4), "band_row": bool(row.get("band")),
        "inside_band": None if low is None else low <= measured <= high,
        "peak_phase": out.get("peak_phase"), "note": row.get("note", ""),
        **verdict_fields(row, argv),
    }


def verdict_summary(results: list[dict]) -> dict:
    scored = [r for r in results if r["verdict"] is not None]
    right = [r["id"] for r in scored if r["verdict_right"] == "right"]
    tight = [r["id"] for r in scored if r["verdict_right"] == "tight"]
    return {"rows": len(scored), "ran": sum(r["outcome"] == "ran" for r in scored),
            "oom": sum(r["outcome"] == "oom" for r in scored), "strict_right": len(right),
            "lenient_right": len(right) + len(tight), "tight": tight,
            "wrong": [r["id"] for r in scored if r["verdict_right"] == "wrong"],
            "card_unknown": [r["id"] for r in results if r["verdict"] is None]}


def summary(results: list[dict]) -> dict:
    def stats(rows: list[dict]) -> dict:
        errs = [r["error"] for r in rows]
        if not errs:
            return {"rows": 0}
        return {"rows": len(errs), "median_abs_error": round(statistics.median(map(abs, errs)), 4),
                "worst_error": max(errs, key=abs), "under_estimates": sum(e < 0 for e in errs),
                "under_by_more_than_10pct": sum(e < -0.10 for e in errs)}

    known = [r for r in results if r["counter"] in KNOWN_COUNTERS]
    band_rows = [r["error"] for r in results if r["band_row"]]
    return {
        "all": stats(results), "counter_known": stats(known),
        "training": stats([r for r in results if r["group"] == "training"]),
        "inference": stats([r for r in results if r["group"] == "inference"]),
        "band": {"rows": len(band_rows), "worst_under_estimate": min(band_rows),
                 "worst_over_estimate": max(band_rows)},
        "inside_band": sum(bool(r["inside_band"]) for r in results if r["low_bytes"] is not None),
        "with_band": sum(r["low_bytes"] is not None for r in results),
        "verdicts": verdict_summary(results),
    }


def verdict_line(v: dict) -> str:
    wrong, tight, unknown = (", ".join(v[k]) or "none" for k in ("wrong", "tight", "card_unknown"))
    return (f"Fit verdict on the card each row was measured on ({v['rows']} rows: {v['ran']} ran, "
            f"{v['oom']} out of memory): right on {v['strict_right']} (strict: fits for a run that "
            f"ran, oom for one that did not), {v['lenient_right']} counting tight as not wrong "
            f"(lenient; tight: {tight}); wrong: {wrong}. Card not known: {unknown}.")


def verdict_cell(r: dict) -> str:
    if r["verdict"] is None:
        return f"card not known ({r['outcome']})"
    return f"{r['outcome']} on {r['measured_on']}: {r['verdict']} — {r['verdict_right']}"


def markdown(results: list[dict], summ: dict) -> str:
    k, a = summ["counter_known"], summ["all"]
    lines = [
        f"# Published GPU measurements vs oomless ({date.today().isoformat()})", "",
        f"{a['rows']} rows; counter known on {k['rows']}: median |error| "
        f"{k['median_abs_error']:.1%}, worst {k['worst_error']:+.1%}, "
        f"{k['under_estimates']} under-estimates. All rows: median |error| "
        f"{a['median_abs_error']:.1%}, worst {a['worst_error']:+.1%}, {a['under_estimates']} "
        f"under-estimates, {a['under_by_more_than_10pct']} by more than 10%.", "",
        verdict_line(summ["verdicts"]), "",
        "| row | counter | measured | oomless | error | verdict on the measured card | command "
        "| source |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['id']} | {r['counter']} | {r['measured_bytes'] / GiB:.2f} GiB | "
            f"{r['predicted_bytes'] / GiB:.2f} GiB | {r['error']:+.1%} | {verdict_cell(r)} | "
            f"`{r['command']}` | [source]({r['source']}) |")
    lines += ["", "Notes per row:", ""]
    lines += [f"- **{r['id']}** — {r['setup']}. Quote: “{r['quote']}”. {r['note']}".rstrip()
              for r in results]
    return "\n".join(lines) + "\n"


def stale(row: dict, committed: dict | None) -> bool:
    """A committed result that the row's card or outcome no longer matches (or none at all)."""
    return committed is None or any(committed.get(k, "?") != row[k]
                                    for k in ("measured_on", "outcome"))


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    prefix = args[args.index("--rows") + 1] if "--rows" in args else None
    rows = yaml.safe_load(ROWS.read_text())
    if prefix is None:
        results = [run_row(r) for r in rows]
    else:  # rerun the selected rows; the others keep their committed results
        committed = {r["id"]: r for r in json.loads((RESULTS / "published.json").read_text())[
            "rows"]}
        results = [run_row(r) if r["id"].startswith(prefix) or stale(r, committed.get(r["id"]))
                   else committed[r["id"]] for r in rows]
    summ = summary(results)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "published.json").write_text(json.dumps(
        {"date": date.today().isoformat(), "summary": summ, "rows": results}, indent=2) + "\n")
    (RESULTS / "published.md").write_text(markdown(results, summ))
    for r in results:
        print(f"{r['id']:34s} {r['counter']:14s} {r['measured_bytes'] / GiB:7.2f} "
              f"{r['predicted_bytes'] / GiB:7.2f} {r['error']:+.1%}  {verdict_cell(r)}")
    print(json.dumps(summ, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
