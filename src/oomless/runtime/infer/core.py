"""Batch generation and LLM-judge scoring of a dataset, resumable.

Records are processed in chunks; each finished chunk is appended to the output
JSONL and fsync'ed, so a crash or an OOM loses at most the chunk in flight and
a rerun with the same ``--out`` skips every record already written (keyed by
the record's line, or by ``--id-field``). A sidecar ``OUT.meta.json`` holds
the settings that shape the outputs; a rerun with different ones is refused
rather than mixing two models' answers in one file.

Backends (same interface): vLLM on a GPU, with engine arguments from the
memory model (runtime/infer_vllm.py), and transformers ``generate`` elsewhere
(runtime/infer_hf.py). torch is imported by the backends only.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ...errors import ConfigError, DataError, OutputError
from ...fileio import (
    ORIG,
    check_output_file,
    cut_torn_tail,
    ensure_folder,
    keep_orig,
    open_append,
    read_json,
    read_jsonl,
    refuse_inputs,
    write_json_atomic,
)

DEFAULT_JUDGE_PROMPT = (
    "You are a strict judge of instruction-tuning data. Rate how good the response is as an "
    "answer to the request, from 1 (wrong, useless or harmful) to 5 (correct, complete, "
    "helpful and well written).\n\n[Request]\n{instruction}\n\n[Response]\n{response}\n\n"
    "Reply with one line: 'Score: N', where N is 1, 2, 3, 4 or 5."
)
_PLACEHOLDER = "\u2026"  # stands in for a missing answer while a prompt-only record is parsed


@dataclass(frozen=True)
class InferOptions:
    model: str
    adapter: str | None = None
    backend: str = "auto"  # auto | vllm | hf
    cutoff_len: int = 1024  # prompt tokens kept (the end of longer prompts)
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 42
    chunk_size: int = 64  # records per written chunk
    batch_size: int | None = None  # transformers: sequences per generate call
    max_num_seqs: int = 256  # vLLM: concurrent sequences
    gpu_memory_utilization: float | None = None  # vLLM: None = from the memory model
    dtype: str = "auto"
    chat_template: bool = True
    system: str | None = None
    trust_remote_code: bool = False
    id_field: str | None = None
    limit: int | None = None  # process at most this many new records
    tensor_parallel_size: int = 1  # vLLM's parallel sizes (memory.vllm_parallel)
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1

    @property
    def max_model_len(self) -> int:
        return self.cutoff_len + self.max_new_tokens

    def output_settings(self) -> dict[str, Any]:
        """The settings that change what is written (compared on resume)."""
        keys = ("model", "adapter", "cutoff_len", "max_new_tokens", "temperature", "top_p",
                "seed", "chat_template", "system", "id_field")
        return {k: getattr(self, k) for k in keys}


@dataclass(frozen=True)
class Generation:
    text: str
    prompt_tokens: int
    completion_tokens: int
    truncated: bool = False  # the prompt was cut to cutoff_len


class Backend(Protocol):
    name: str
    tokenizer: Any

    def generate(self, prompts: list[list[int]]) -> list[Generation]: ...

    def engine_info(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


@dataclass
class RunSummary:
    output: str
    total: int
    skipped_done: int = 0
    written: int = 0
    errors: int = 0
    kept: int | None = None
    unparsed: int | None = None
    kept_file: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- records → prompts ------------------------------------------------------------
def _answer_field(record: dict[str, Any]) -> str | None:
    for key in ("output", "label", "response", "completion"):
        if isinstance(record.get(key), str) and record[key]:
            return record[key]
    return None


def prompt_messages(record: Any) -> tuple[list[dict[str, str]], str | None]:
    """(messages to answer, reference answer or None) of one record.

    Formats: ``prompt`` (a string), alpaca, sharegpt ``conversations``, OpenAI
    ``messages``; a final assistant turn is the reference, not part of the prompt.
    """
    from ...dataset.records import RecordError, detect_format, record_to_messages

    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        if not record["prompt"].strip():
            raise RecordError("'prompt' is empty")
        return [{"role": "user", "content": record["prompt"]}], _answer_field(record)
    if not isinstance(record, dict):
        raise RecordError(f"a record must be a JSON object, got {type(record).__name__}")
    fmt = detect_format(record)
    padded = dict(record)  # a prompt-only record gets a stand-in answer to pass validation
    if fmt == "alpaca" and not record.get("output"):
        padded["output"] = _PLACEHOLDER
    elif fmt == "messages" and _last_role(record["messages"], "role") != "assistant":
        padded["messages"] = [*record["messages"], {"role": "assistant", "content": _PLACEHOLDER}]
    elif fmt == "sharegpt" and _last_role(record["conversations"], "from") not in {"gpt",
                                                                                 "assistant"}:
        padded["conversations"] = [*record["conversations"],
                                   {"from": "gpt", "value": _PLACEHOLDER}]
    msgs = record_to_messages(padded)
    stand_in = padded != record
    return msgs[:-1], None if stand_in else msgs[-1]["content"]


def _last_role(turns: Any, key: str) -> Any:
    if isinstance(turns, list) and turns and isinstance(turns[-1], dict):
        return turns[-1].get(key)
    return None


def judge_messages(record: Any, template: str) -> list[dict[str, str]]:
    """The judge's prompt for one record: its request and its response filled in."""
    from ...dataset.records import RecordError

    msgs, answer = prompt_messages(record)
    if answer is None:
        raise RecordError("the record has no response to score (no output / assistant turn)")
    request = "\n\n".join(
        m["content"] if m["role"] == "user" else f"({m['role']}) {m['content']}" for m in msgs
    )
    text = template.replace("{instruction}", request).replace("{response}", answer)
    return [{"role": "user", "content": text.replace("{record}", json.dumps(record,
                                                                             ensure_ascii=False))}]


def check_judge_template(template: str, where: str) -> str:
    if "{response}" not in template and "{record}" not in template:
        raise ConfigError(f"judge prompt {where} has no '{{response}}' (or '{{record}}') "
                          "placeholder; the judge would not see what it scores")
    return template


_SCORE_PATTERNS = (
    re.compile(r"(?i)\b(?:score|rating)\b\s*(?:is|of)?\s*[:：=]?\s*\**\s*([1-5])(?![\d.])"),
    re.compile(r"(?i)(?<![\d.])([1-5])\s*(?:/|out of)\s*5\b"),
    re.compile(r"^\W*([1-5])\W*$"),
)


def parse_score(text: str) -> int | None:
    """The 1–5 score in a judge's reply; None when it gives none (never guessed)."""
    for pattern in _SCORE_PATTERNS:
        match = pattern.search(text.strip())
        if match:
            return int(match.group(1))
    return None


def encode_prompt(tokenizer: Any, msgs: list[dict[str, str]], opts: InferOptions
                  ) -> tuple[list[int], bool]:
    """Token ids of a prompt (chat template when the tokenizer has one), cut to cutoff_len.

    A long prompt keeps its end: the generation prompt and the question come last.
    """
    if opts.system and not any(m["role"] == "system" for m in msgs):
        msgs = [{"role": "system", "content": opts.system}, *msgs]
    if opts.chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer("\n\n".join(m["content"] for m in msgs))["input_ids"]
    if len(ids) > opts.cutoff_len:
        return list(ids[-opts.cutoff_len:]), True
    return list(ids), False


# ---- the resumable output ----------------------------------------------------------------
def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def input_fingerprint(path: str | Path, size: int | None = None) -> dict[str, Any]:
    """Size and SHA-256 of a dataset's first ``size`` bytes (all of it by default): a
    rerun continues only on the same records (records appended at the end are fine)."""
    import hashlib

    digest, left = hashlib.sha256(), Path(path).stat().st_size if size is None else size
    total = left
    with open(path, "rb") as fh:
        while left > 0:
            block = fh.read(min(left, 1 << 20))
            if not block:
                break
            digest.update(block)
            left -= len(block)
    return {"input_bytes": total - left, "input_sha256": digest.hexdigest()}


class ResultLog:
    """An append-only JSONL of results; each chunk is flushed and fsync'ed.

    ``OUT.meta.json`` marks the file as ours and records the settings and the input
    (its size and SHA-256): a rerun continues only with the same settings and, for
    records keyed by line, an input that starts with the same bytes (records
    appended at its end are new work). An OUT that is not ours is refused unless ``force`` (kept as .orig);
    OUT is never one of ``inputs``.
    """

    def __init__(self, path: str | Path, key_field: str, settings: dict[str, Any],
                 overwrite: bool = False, source: str | Path | None = None,
                 force: bool = False):
        self.path = check_output_file(path)
        self.key_field = key_field
        self.meta_path = check_output_file(self.path.with_name(self.path.name + ".meta.json"))
        refuse_inputs(self.path, [source], "--out")
        ensure_folder(self.path.parent, "--out")
        if self.path.exists() and not self.meta_path.is_file():
            if not force:
                raise OutputError(f"--out '{self.path}' exists and was not written by oomless "
                                  "(no .meta.json beside it); choose another --out, or pass "
                                  f"--force (it is then kept as {self.path.name}{ORIG})")
            keep_orig(self.path)
        if overwrite:
            self.path.unlink(missing_ok=True)
        self._check_settings(settings, source)
        self.done: set[str] = set()
        if self.path.exists():
            cut_torn_tail(self.path)
            log = read_jsonl(self.path, "results file", DataError)
            if log.bad:
                raise DataError(f"{log.bad[0]}; the output file was edited or is not ours: "
                                "use another --out or --overwrite")
            self.done = {_key(row.get(key_field)) for row in log.objects()}

    def _check_settings(self, settings: dict[str, Any], source: str | Path | None) -> None:
        meta = dict(settings)
        before: Any = {}
        if self.meta_path.exists():
            before = read_json(self.meta_path, "an oomless results meta file", DataError)
            before = before if isinstance(before, dict) else {}
            if before.get("kept"):
                meta["kept"] = before["kept"]  # score's --kept file stays ours
        if self.path.exists() and before:
            changed = {k: (before.get(k), v) for k, v in settings.items() if before.get(k) != v}
            if changed:
                what = ", ".join(f"{k} {a!r} → {b!r}" for k, (a, b) in changed.items())
                raise ConfigError(f"'{self.path}' holds results made with other settings ({what});"
                                  " use another --out, or --overwrite to start again")
            by_line = settings.get("id_field") is None  # ids find their records anywhere
            if by_line and source and "input_sha256" in before and input_fingerprint(
                    source, before.get("input_bytes"))["input_sha256"] != before["input_sha256"]:
                raise ConfigError(f"'{self.path}' holds results of another input than "
                                  f"'{source}' (the first {before.get('input_bytes')} bytes "
                                  "differ); use another --out, or --overwrite to start again")
        if source:
            meta.update(input_fingerprint(source), input=str(Path(source).resolve()))
        write_json_atomic(self.meta_path, meta)

    def owns(self, path: str | Path) -> bool:
        """Whether ``path`` is a file an earlier run recorded as its own (score's --kept)."""
        before = read_json(self.meta_path, "meta", DataError) if self.meta_path.is_file() else {}
        return isinstance(before, dict) and before.get("kept") == str(Path(path).resolve())

    def record(self, **fields: Any) -> None:
        """Add ``fields`` to the meta file."""
        meta = read_json(self.meta_path, "meta", DataError)
        write_json_atomic(self.meta_path, {**meta, **fields})

    def is_done(self, key: Any) -> bool:
        return _key(key) in self.done

    def append(self, rows: list[dict[str, Any]]) -> None:
        with open_append(self.path) as fh:
            fh.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
            fh.flush()
            os.fsync(fh.fileno())
        self.done.update(_key(r.get(self.key_field)) for r in rows)


# ---- the loop ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Item:
    key: Any
    line: int
    record: Any


def read_items(path: str | Path, id_field: str | None) -> list[Item]:
    """Every record with its key (line, or ``id_field``); duplicate ids are an error."""
    from ...dataset.records import RecordError, iter_raw_records

    if not Path(path).is_file():
        raise DataError(f"dataset '{path}' not found; give a .jsonl, .json or .parquet file")
    items, seen = [], {}
    for line, record in iter_raw_records(path):
        key: Any = line
        if id_field and not isinstance(record, RecordError):
            if not isinstance(record, dict) or id_field not in record:
                raise DataError(f"{path}:{line}: no '{id_field}' field; every record needs "
                                "one with --id-field, or leave it out to key by line")
            key = record[id_field]
            if _key(key) in seen:
                raise DataError(f"{path}:{line}: id {key!r} repeats line {seen[_key(key)]}; "
                                f"--id-field '{id_field}' must be unique")
            seen[_key(key)] = line
        items.append(Item(key, line, record))
    return items


RowBuilder = Callable[[Item, Generation | None, str | None], dict[str, Any]]
PromptBuilder = Callable[[Any], list[dict[str, str]]]


def _chunks(items: list[Item], size: int) -> Iterable[list[Item]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _process_chunk(chunk: list[Item], backend: Backend, opts: InferOptions,
                   build_prompt: PromptBuilder, build_row: RowBuilder) -> list[dict[str, Any]]:
    from ...dataset.records import RecordError

    prompts, errors = {}, {}
    for item in chunk:
        try:
            if isinstance(item.record, RecordError):
                raise item.record
            prompts[item.line] = encode_prompt(backend.tokenizer, build_prompt(item.record), opts)
        except RecordError as err:
            errors[item.line] = str(err)
    ready = [i for i in chunk if i.line in prompts]
    outputs = backend.generate([prompts[i.line][0] for i in ready])
    by_line = {}
    for item, gen in zip(ready, outputs, strict=True):
        by_line[item.line] = Generation(gen.text, gen.prompt_tokens, gen.completion_tokens,
                                        prompts[item.line][1])
    return [build_row(i, by_line.get(i.line), errors.get(i.line)) for i in chunk]


def run_records(items: list[Item], backend: Backend, log: ResultLog, opts: InferOptions,
                build_prompt: PromptBuilder, build_row: RowBuilder,
                on_chunk: Callable[[int, int], None] | None = None) -> RunSummary:
    """Generate for every record not in ``log`` yet, one written chunk at a time."""
    pending = [i for i in items if not log.is_done(i.key)]
    summary = RunSummary(output=str(log.path), total=len(items),
                         skipped_done=len(items) - len(pending), engine=backend.engine_info())
    if opts.limit is not None:
        pending = pending[:opts.limit]
    for chunk in _chunks(pending, opts.chunk_size):
        rows = _process_chunk(chunk, backend, opts, build_prompt, build_row)
        log.append(rows)
        summary.written += len(rows)
        summary.errors += sum(1 for r in rows if r.get("error"))
        if on_chunk:
            on_chunk(summary.written, len(pending))
    return summary
