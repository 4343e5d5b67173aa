"""``oomless infer`` and ``oomless score`` as library calls (see oomless.runtime.infer.core)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import ConfigError, DataError, OutputError
from ...fileio import check_output_file, keep_orig, read_jsonl, refuse_inputs, write_atomic
from .core import (
    DEFAULT_JUDGE_PROMPT,
    Backend,
    Generation,
    InferOptions,
    Item,
    ResultLog,
    RunSummary,
    judge_messages,
    parse_score,
    prompt_messages,
    read_items,
    run_records,
)

Progress = Callable[[int, int], None]


def choose_backend(requested: str) -> str:
    """auto: vLLM where it is installed and a GPU is visible, transformers elsewhere."""
    if requested not in {"auto", "vllm", "hf"}:
        raise ConfigError(f"--backend '{requested}': expected auto, vllm or hf")
    if requested != "auto":
        return requested
    from .vllm import vllm_usable

    return "vllm" if vllm_usable() else "hf"


def open_backend(opts: InferOptions) -> Backend:
    if choose_backend(opts.backend) == "vllm":
        from .vllm import VllmBackend

        return VllmBackend(opts)
    from .hf import HFBackend

    return HFBackend(opts)


def _base_row(item: Item, opts: InferOptions) -> dict[str, Any]:
    row: dict[str, Any] = {"line": item.line}
    if opts.id_field:
        row[opts.id_field] = item.key
    return row


def _check_options(opts: InferOptions) -> None:
    checks = [
        (opts.cutoff_len >= 1, f"--cutoff-len {opts.cutoff_len}: expected ≥ 1 token"),
        (opts.max_new_tokens >= 1, f"--max-new-tokens {opts.max_new_tokens}: expected ≥ 1"),
        (opts.chunk_size >= 1, f"--chunk-size {opts.chunk_size}: expected ≥ 1 record"),
        (opts.temperature >= 0, f"--temperature {opts.temperature}: expected ≥ 0"),
        (0 < opts.top_p <= 1, f"--top-p {opts.top_p}: expected in (0, 1]"),
        (opts.gpu_memory_utilization is None or 0 < opts.gpu_memory_utilization <= 1,
         f"--gpu-memory-utilization {opts.gpu_memory_utilization}: expected in (0, 1]"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def infer_file(data: str | Path, out: str | Path, opts: InferOptions, overwrite: bool = False,
               backend: Backend | None = None, on_chunk: Progress | None = None,
               force: bool = False) -> RunSummary:
    """Generate an answer for every record of ``data``; rows: line, prompt, predict, label."""
    _check_options(opts)
    items = read_items(data, opts.id_field)
    key = opts.id_field or "line"
    log = ResultLog(out, key, {"task": "infer", **opts.output_settings()}, overwrite, data,
                    force)

    def build_row(item: Item, gen: Generation | None, error: str | None) -> dict[str, Any]:
        row = _base_row(item, opts)
        if error:
            return {**row, "error": error}
        assert gen is not None
        label = prompt_messages(item.record)[1]
        return {**row, "predict": gen.text, "label": label,
                "prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
                "truncated": gen.truncated}

    backend = backend or open_backend(opts)
    return run_records(items, backend, log, opts, lambda r: prompt_messages(r)[0], build_row,
                       on_chunk)


def score_file(data: str | Path, out: str | Path, opts: InferOptions, min_score: int = 4,
               kept: str | Path | None = None, template: str = DEFAULT_JUDGE_PROMPT,
               overwrite: bool = False, backend: Backend | None = None,
               on_chunk: Progress | None = None, force: bool = False) -> RunSummary:
    """Score every record 1–5 with a judge model; write the records scoring ≥ min_score.

    ``out`` gets one row per record (line, score, judge output, the record);
    ``kept`` (default OUT.kept.jsonl) the original records that passed, in
    input order, rewritten from the complete ``out`` after every run.
    """
    _check_options(opts)
    if not 1 <= min_score <= 5:
        raise ConfigError(f"--min-score {min_score}: scores run from 1 to 5")
    items = read_items(data, opts.id_field)
    settings = {"task": "score", "judge_prompt": template, **opts.output_settings()}
    kept_path = check_output_file(Path(kept) if kept else Path(out).with_suffix(".kept.jsonl"))
    refuse_inputs(kept_path, [data, out], "--kept")
    log = ResultLog(out, opts.id_field or "line", settings, overwrite, data, force)
    refuse_inputs(kept_path, [log.meta_path], "--kept")
    if kept_path.exists() and not log.owns(kept_path):
        if not force:
            raise OutputError(f"--kept '{kept_path}' exists and was not written by oomless "
                              "score; choose another --kept, or pass --force (it is then kept "
                              f"as {kept_path.name}.orig)")
        keep_orig(kept_path)
    log.record(kept=str(kept_path.resolve()))

    def build_row(item: Item, gen: Generation | None, error: str | None) -> dict[str, Any]:
        row = _base_row(item, opts)
        if error:
            return {**row, "score": None, "error": error, "record": item.record}
        assert gen is not None
        return {**row, "score": parse_score(gen.text), "judge_output": gen.text,
                "truncated": gen.truncated, "record": item.record}

    backend = backend or open_backend(opts)
    summary = run_records(items, backend, log, opts, lambda r: judge_messages(r, template),
                          build_row, on_chunk)
    summary.kept, summary.unparsed = write_kept(Path(out), kept_path, min_score)
    summary.kept_file = str(kept_path)
    return summary


def write_kept(scored: Path, kept: Path, min_score: int) -> tuple[int, int]:
    """(kept, unparsed): records with score ≥ min_score, in input order, written atomically."""
    rows = read_jsonl(scored, "results file", DataError).objects()
    rows.sort(key=lambda r: r.get("line", 0))
    good = [r["record"] for r in rows if isinstance(r.get("score"), int)
            and r["score"] >= min_score]
    unparsed = sum(1 for r in rows if r.get("score") is None and not r.get("error"))
    kept.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(kept, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in good))
    return len(good), unparsed
