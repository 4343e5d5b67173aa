"""Supervised fine-tuning data: read, validate, tokenize, mask, truncate, pack.

Files: JSON (an array of records), JSONL (one record a line) or Parquet (one
record a row). Formats: ``alpaca`` (instruction/input/output/system/history),
``sharegpt`` (``conversations`` of from/value) and OpenAI ``messages``
(role/content); ``auto`` picks per record. Every record becomes chat messages,
rendered with the tokenizer's chat template; only assistant tokens carry
labels (prompt tokens are -100). Every bad record is reported with its file,
line (row for Parquet) and reason; ``on_bad_record: skip`` writes each one to
``rejected.jsonl`` in the run folder instead of stopping.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..config import DataConfig
from ..errors import DataError
from ..fileio import read_text, split_lines, write_atomic, write_json_atomic
from .formats import CHAT_TEMPLATE, FORMATS, RecordError, detect_format, record_to_messages

__all__ = ["FORMATS", "IGNORE_INDEX", "BadRecord", "Example", "LoadedData", "RecordError",
           "detect_format", "encode_messages", "load_examples", "pack_examples",
           "record_to_messages", "token_length_stats"]

IGNORE_INDEX = -100  # the label value torch.nn.CrossEntropyLoss ignores (its ignore_index default)
MAX_LISTED_BAD = 50  # bad records printed in an error message; all go to rejected.jsonl


@dataclass(frozen=True)
class BadRecord:
    file: str
    line: int  # 1-based line of the record (Parquet: row)
    reason: str
    record: Any = None
    raw: str | None = None  # the text of a line that is not JSON

    def describe(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


@dataclass(frozen=True)
class Example:
    """One tokenized training sequence (several records when packed)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    lines: tuple[int, ...]  # source line(s) of the record(s) inside
    position_ids: tuple[int, ...] | None = None  # packed: restart at 0 per record
    prompt_tokens: int = 0
    response_tokens: int = 0
    truncated: bool = False
    images: tuple[str, ...] = ()  # vision-language: image files, in order

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def label_tokens(self) -> int:
        return sum(1 for t in self.labels if t != IGNORE_INDEX)


@dataclass(frozen=True)
class LoadedData:
    file: str
    examples: list[Example]
    bad: list[BadRecord] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)


# ---- reading ----------------------------------------------------------------
def _invalid(message: str, raw: str) -> RecordError:
    """A record that is not JSON, carrying its text (written to the rejected file)."""
    err = RecordError(message)
    err.raw = raw  # type: ignore[attr-defined]
    return err


def _json_array_records(text: str, path: str) -> Iterator[tuple[int, Any]]:
    """Elements of a top-level JSON array with the line each starts on."""
    decoder = json.JSONDecoder()
    idx = len(text) - len(text.lstrip())
    if not text.startswith("[", idx):
        raise DataError(f"'{path}': a .json file must hold an array of records "
                        "([{...}, ...]); use .jsonl for one record per line")
    idx, line, counted = idx + 1, 1, 0
    while True:
        while idx < len(text) and text[idx] in " \t\r\n,":
            idx += 1
        if idx >= len(text) or text[idx] == "]":
            return
        line += text.count("\n", counted, idx)
        counted = idx
        try:
            obj, idx = decoder.raw_decode(text, idx)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}: invalid JSON ({err.msg}); "
                            "the rest of the array cannot be read") from None
        except (ValueError, RecursionError) as err:
            reason = "nested too deeply" if isinstance(err, RecursionError) else str(err)
            raise DataError(f"{path}:{line}: unreadable JSON ({reason}); "
                            "the rest of the array cannot be read") from None
        yield line, obj


def _jsonl_records(text: str) -> Iterator[tuple[int, Any]]:
    """Records of JSON-lines text, split on "\\n" only (fileio.split_lines)."""
    for line_no, line in split_lines(text):
        try:
            yield line_no, json.loads(line)
        except json.JSONDecodeError as err:
            yield line_no, _invalid(f"invalid JSON ({err.msg} at column {err.colno})", line)
        except (ValueError, RecursionError) as err:
            reason = "nested too deeply" if isinstance(err, RecursionError) else str(err)
            yield line_no, _invalid(f"invalid JSON ({reason})", line)


def _parquet_rows(p: Path) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(p).to_pylist()
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"'{p}' is not a readable Parquet file ({err})") from None


def iter_raw_records(path: str | os.PathLike[str]) -> Iterator[tuple[int, Any]]:
    """(line, record) pairs; a JSONL line that is not JSON yields a RecordError
    (its ``raw`` attribute holds the line's text)."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"data file '{p}' not found; set data.train_file to a "
                        ".json, .jsonl or .parquet file")
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        yield from enumerate(_parquet_rows(p), start=1)
        return
    if suffix not in (".json", ".jsonl"):
        raise DataError(f"data file '{p}': unsupported extension '{suffix}'; "
                        "expected .json, .jsonl or .parquet")
    text = read_text(p, "data file", DataError)
    if suffix == ".json":
        yield from _json_array_records(text, str(p))
    else:
        yield from _jsonl_records(text)


# ---- tokenization -----------------------------------------------------------------
def _render(tokenizer: Any, msgs: list[dict[str, str]], gen_prompt: bool) -> str:
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(msgs, tokenize=False,
                                             add_generation_prompt=gen_prompt)
    except TemplateError as err:
        raise RecordError(f"the chat template rejected this conversation: {err}") from None


def _segments(tokenizer: Any, msgs: list[dict[str, str]]) -> list[tuple[bool, str]]:
    """(is_response, text) pieces whose concatenation is the rendered conversation."""
    out: list[tuple[bool, str]] = []
    done = ""
    for k, msg in enumerate(msgs):
        if msg["role"] != "assistant":
            continue
        prompt = _render(tokenizer, msgs[:k], True)
        full = _render(tokenizer, msgs[: k + 1], False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise RecordError("the tokenizer's chat template is not prefix-consistent "
                              "across turns; multi-turn masking cannot be computed")
        out += [(False, prompt[len(done):]), (True, full[len(prompt):])]
        done = full
    return out


def encode_messages(tokenizer: Any, msgs: list[dict[str, str]], line: int,
                    max_input: int | None, max_output: int | None, seq_len: int,
                    expand: Callable[[list[int]], list[int]] | None = None) -> Example:
    """Token ids and labels (-100 on prompt tokens), truncated to the budgets.

    Prompt pieces share the ``max_input`` budget and responses ``max_output``
    (in order: turns after a spent budget are cut); the whole is cut at seq_len.
    """
    ids: list[int] = []
    labels: list[int] = []
    left = {False: max_input, True: max_output}
    used = {False: 0, True: 0}
    truncated = False
    for is_response, text in _segments(tokenizer, msgs):
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        if expand is not None and not is_response:
            piece = expand(piece)  # vision: one image token -> the image's run of tokens
        budget = left[is_response]
        if budget is not None and len(piece) > budget - used[is_response]:
            piece, truncated = piece[: max(0, budget - used[is_response])], True
        used[is_response] += len(piece)
        ids += piece
        labels += piece if is_response else [IGNORE_INDEX] * len(piece)
    if len(ids) > seq_len:
        ids, labels, truncated = ids[:seq_len], labels[:seq_len], True
    if all(t == IGNORE_INDEX for t in labels):
        raise RecordError(f"no response tokens left after truncation (prompt {used[False]} "
                          f"tokens, seq_len {seq_len}); raise seq_len or data.max_input_length")
    n_resp = sum(1 for t in labels if t != IGNORE_INDEX)
    return Example(tuple(ids), tuple(labels), (line,), None, len(ids) - n_resp, n_resp, truncated)


def ensure_chat_template(tokenizer: Any) -> bool:
    """Give a template-less (base-model) tokenizer ChatML; True when we did."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = CHAT_TEMPLATE
    return True


# ---- packing and statistics ---------------------------------------------------------
def pack_examples(examples: list[Example], seq_len: int) -> list[Example]:
    """Concatenate consecutive examples into sequences of at most seq_len tokens.

    position_ids restart at 0 for each record: transformers then builds a
    block-diagonal causal mask (masking_utils.find_packed_sequence_indices)
    when no attention_mask is passed, so records never attend to each other.
    """
    packed: list[Example] = []
    bucket: list[Example] = []

    def flush() -> None:
        if bucket:
            packed.append(Example(
                tuple(t for e in bucket for t in e.input_ids),
                tuple(t for e in bucket for t in e.labels),
                tuple(n for e in bucket for n in e.lines),
                tuple(i for e in bucket for i in range(len(e))),
                sum(e.prompt_tokens for e in bucket), sum(e.response_tokens for e in bucket),
                any(e.truncated for e in bucket), tuple(i for e in bucket for i in e.images)))
            bucket.clear()

    for ex in examples:
        if bucket and sum(len(e) for e in bucket) + len(ex) > seq_len:
            flush()
        bucket.append(ex)
    flush()
    return packed


def _percentiles(values: list[int]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    ordered = sorted(values)

    def pct(q: float) -> int:  # nearest-rank percentile
        return ordered[min(len(ordered) - 1, max(0, int(-(-q * len(ordered) // 100)) - 1))]

    return {"count": len(ordered), "mean": round(sum(ordered) / len(ordered), 2),
            "p50": pct(50), "p95": pct(95), "p99": pct(99), "max": ordered[-1]}


def token_length_stats(examples: list[Example]) -> dict[str, Any]:
    """p50/p95/p99/max of total, prompt and response tokens (after truncation)."""
    return {
        "total": _percentiles([len(e) for e in examples]),
        "prompt": _percentiles([e.prompt_tokens for e in examples]),
        "response": _percentiles([e.response_tokens for e in examples]),
        "truncated_records": sum(1 for e in examples if e.truncated),
    }


def rejected_name(stats_name: str) -> str:
    """rejected.jsonl for the training file, eval_rejected.jsonl for the eval file."""
    return stats_name.replace("token_stats.json", "rejected.jsonl")


def _write_rejected(path: Path, bad: list[BadRecord]) -> Path:
    """Every rejected record with its line, reason and text; written (empty when none
    were) on every load, so a file from an earlier run never survives."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for b in bad:
        row = {"file": b.file, "line": b.line, "reason": b.reason, "record": b.record}
        if b.raw is not None:
            row["raw"] = b.raw
        rows.append(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    return write_atomic(path, "".join(rows))


# ---- the entry point ---------------------------------------------------------------------
def _encode_vision(tokenizer: Any, vision: Any, raw: dict[str, Any], msgs: list[dict[str, str]],
                   line: int, data: DataConfig, seq_len: int, data_dir: Path) -> Example:
    from .vision import expand_image_tokens, image_token_counts, place_markers, record_images

    paths = record_images(raw, data_dir)
    msgs = place_markers(msgs, len(paths), vision)
    counts = image_token_counts(vision, _render(tokenizer, msgs, False), paths)
    total = sum(counts)
    ex = encode_messages(tokenizer, msgs, line, data.max_input_length, data.max_output_length,
                         seq_len, lambda ids: expand_image_tokens(ids, vision, counts))
    if ex.input_ids.count(vision.image_token_id) != total:
        raise RecordError("truncation would cut an image's tokens; raise seq_len or "
                          "data.max_input_length")
    return replace(ex, images=tuple(paths))


def load_examples(path: str | os.PathLike[str], tokenizer: Any, data: DataConfig,
                  seq_len: int, run_dir: str | os.PathLike[str] | None = None,
                  stats_name: str = "token_stats.json", vision: Any = None) -> LoadedData:
    """Read, validate and tokenize a data file; statistics go to the run folder.

    ``data.on_bad_record == "error"`` raises one DataError naming every bad
    record; ``"skip"`` writes them to ``run_dir/rejected.jsonl``. ``vision``
    (oomless.dataset.vision.VisionProcessor): image+text records are accepted.
    """
    ensure_chat_template(tokenizer)
    examples: list[Example] = []
    bad: list[BadRecord] = []
    for line, raw in iter_raw_records(path):
        try:
            if isinstance(raw, RecordError):
                raise raw
            msgs = record_to_messages(raw, data.format, allow_images=vision is not None)
            if vision is not None and (raw.get("images") or raw.get("image")):
                examples.append(_encode_vision(tokenizer, vision, raw, msgs, line, data,
                                               seq_len, Path(path).parent))
            else:
                examples.append(encode_messages(tokenizer, msgs, line, data.max_input_length,
                                                data.max_output_length, seq_len))
        except RecordError as err:
            bad.append(BadRecord(str(path), line, str(err),
                                 None if isinstance(raw, RecordError) else raw,
                                 getattr(raw, "raw", None)))
    rejected = None
    if run_dir is not None:
        rejected = _write_rejected(Path(run_dir) / rejected_name(stats_name), bad)
    if bad and data.on_bad_record == "error":
        listed = "\n  ".join(b.describe() for b in bad[:MAX_LISTED_BAD])
        more = f"\n  ... and {len(bad) - MAX_LISTED_BAD} more" if len(bad) > MAX_LISTED_BAD else ""
        raise DataError(f"{len(bad)} bad record(s) in '{path}':\n  {listed}{more}\n"
                        "fix them, or set data.on_bad_record: skip to train without them "
                        f"(each is then written with its reason to {rejected_name(stats_name)})")
    if not examples:
        raise DataError(f"'{path}' holds no usable records"
                        + (f" (all {len(bad)} rejected)" if bad else ""))
    stats = {"file": str(path), "records": len(examples) + len(bad), "rejected": len(bad),
             **token_length_stats(examples)}
    if data.packing:
        examples = pack_examples(examples, seq_len)
        stats["packed_sequences"] = len(examples)
    if run_dir is not None:
        stats["rejected_file"] = str(rejected)
        write_json_atomic(Path(run_dir) / stats_name, stats)
    return LoadedData(str(path), examples, bad, stats)


def load_tokenizer(model_path: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer of a local folder or cached hub id, offline."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code,
                                        local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
