"""Length statistics of a training file for ``oomless plan --data`` (torch-free).

With the model's tokenizer on this machine (a local model folder, or the
model in the local Hugging Face cache) the records are tokenized exactly as
``oomless train`` does (oomless.dataset.records: chat template, masking). Without
it, lengths are approximated from the text: one token per CJK character and
one per 4 other characters (the usual rule of thumb for Latin-script BPE
vocabularies), plus 4 tokens of chat-template markup per message and 3 per
conversation. Image tokens are added per image with the model's
tokens_per_image.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import DataError
from ..models.spec import ModelSpec
from .speed import TokenLoad

CHARS_PER_TOKEN = 4  # Latin-script text, BPE vocabularies of 32k–150k tokens
TEMPLATE_TOKENS_PER_MESSAGE = 4  # role markers and separators (ChatML: <|im_start|>role\n … <|im_end|>\n)
TEMPLATE_TOKENS_PER_SAMPLE = 3
MAX_CUT_FRACTION = 0.01  # truncation is proposed only where it cuts at most 1% of the samples
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af]")


def approx_tokens(text: str) -> int:
    cjk = len(_CJK.findall(text))
    return cjk + math.ceil((len(text) - cjk) / CHARS_PER_TOKEN)


@dataclass(frozen=True)
class Cutoff:
    """A maximum length and how many samples it truncates."""

    length: int
    cut: int
    total: int

    def describe(self) -> str:
        if not self.cut:
            return f"max length {self.length} (no sample truncated)"
        return (f"truncate to {self.length} tokens: cuts {self.cut} of {self.total} samples "
                f"({self.cut / self.total:.1%})")


@dataclass(frozen=True)
class DataProfile:
    """Token lengths of the samples (sorted), with where they came from."""

    file: str
    source: str  # "tokenizer <path>" or "approximation (…)"
    lengths: tuple[int, ...]  # tokens per sample incl. image tokens, ascending, untruncated
    records: int
    rejected: int = 0
    images_per_sample: float = 0.0
    max_images: int = 0
    cutoffs: tuple[Cutoff, ...] = ()
    file_order: tuple[int, ...] = ()  # the same lengths in file order (packing follows it)
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def percentile(self, q: float) -> int:
        """Nearest-rank percentile (as oomless.dataset.records does)."""
        n = len(self.lengths)
        return self.lengths[min(n - 1, max(0, math.ceil(q * n / 100) - 1))]

    def summary(self) -> dict[str, Any]:
        return {"file": self.file, "source": self.source, "samples": len(self.lengths),
                "records": self.records, "rejected": self.rejected,
                "p50": self.percentile(50), "p95": self.percentile(95),
                "p99": self.percentile(99), "max": self.lengths[-1],
                "mean": round(sum(self.lengths) / len(self.lengths), 1),
                "images_per_sample": self.images_per_sample,
                "cutoffs": [c.describe() for c in self.cutoffs]}

    def rows(self, length: int, packing: bool) -> tuple[list[int], list[int]]:
        """(row lengths, Σ segment² per row): samples, or greedy packed rows as
        oomless.dataset.records.pack_examples builds them (consecutive, in file order)."""
        key = ("rows", length, packing)
        if key not in self._cache:
            capped = [min(x, length) for x in (self.file_order or self.lengths)]
            if not packing:
                self._cache[key] = (capped, [x * x for x in capped])
            else:
                self._cache[key] = _pack(capped, length)
        return self._cache[key]

    def token_load(self, micro_batch: int, length: int, packing: bool, varlen: bool) -> TokenLoad:
        """Expected cost and content of one micro batch drawn at random, padded
        to its longest row. ``varlen``: attention skips padding (flash)."""
        key = ("load", micro_batch, length, packing, varlen)
        if key not in self._cache:
            rows, seg_sq = self.rows(length, packing)
            ordered = sorted(rows)
            n = len(ordered)
            b = micro_batch
            e_max = e_max_sq = 0.0
            prev = 0.0
            for i, x in enumerate(ordered, start=1):
                w = (i / n) ** b
                e_max += x * (w - prev)
                e_max_sq += x * x * (w - prev)
                prev = w
            mean = sum(rows) / n
            attn = b * (sum(seg_sq) / n if varlen else e_max_sq)
            per_row = len(self.lengths) / n
            self._cache[key] = TokenLoad(b * e_max, b * mean, attn, b * per_row,
                                         b * per_row * self.images_per_sample)
        return self._cache[key]

    def samples_per_epoch(self, length: int, packing: bool) -> int:
        return len(self.rows(length, packing)[0])


def _pack(lengths: list[int], capacity: int) -> tuple[list[int], list[int]]:
    rows: list[int] = []
    sq: list[int] = []
    cur = cur_sq = 0
    for x in lengths:
        if cur and cur + x > capacity:
            rows.append(cur)
            sq.append(cur_sq)
            cur = cur_sq = 0
        cur += x
        cur_sq += x * x
    if cur:
        rows.append(cur)
        sq.append(cur_sq)
    return rows, sq


def choose_cutoffs(lengths: list[int], cap: int) -> tuple[Cutoff, ...]:
    """The untruncated length (capped by ``cap``) and, where they cut at most
    MAX_CUT_FRACTION of the samples, the 99.9th and 99th percentiles."""
    ordered = sorted(lengths)
    n = len(ordered)
    full = min(ordered[-1], cap)
    out = [Cutoff(full, sum(1 for x in ordered if x > full), n)]
    for q in (99.9, 99.0):
        length = ordered[min(n - 1, max(0, math.ceil(q * n / 100) - 1))]
        cut = sum(1 for x in ordered if x > length)
        if length < out[-1].length and cut <= MAX_CUT_FRACTION * n and length > 0:
            out.append(Cutoff(length, cut, n))
    return tuple(out)


def _record_images(record: Any) -> tuple[Any, int]:
    """The record without its image fields, and how many images it has."""
    if not isinstance(record, dict):
        return record, 0
    images = record.get("images") or []
    count = len(images) if isinstance(images, list) else 1
    if record.get("image"):
        count += 1
    rest = {k: v for k, v in record.items() if k not in ("images", "image")}
    return rest, count


def _approx_lengths(path: str, fmt: str) -> tuple[list[int], list[int], int]:
    from ..dataset.records import RecordError, iter_raw_records, record_to_messages

    lengths: list[int] = []
    images: list[int] = []
    bad = 0
    for _line, raw in iter_raw_records(path):
        if isinstance(raw, RecordError):
            bad += 1
            continue
        record, n_images = _record_images(raw)
        try:
            msgs = record_to_messages(record, fmt)
        except RecordError:
            bad += 1
            continue
        tokens = sum(approx_tokens(m["content"]) + TEMPLATE_TOKENS_PER_MESSAGE for m in msgs)
        lengths.append(tokens + TEMPLATE_TOKENS_PER_SAMPLE)
        images.append(n_images)
    return lengths, images, bad


def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(Path.home(), ".cache", "huggingface")
    return Path(home) / "hub"


def local_tokenizer_dir(resolved: Any) -> str | None:
    """A folder on this machine holding the model's tokenizer, or None."""
    source: str = resolved.source
    candidates: list[Path] = []
    if source.startswith(("file:", "hf-cache:")):
        p = Path(source.split(":", 1)[1])
        candidates.append(p if p.is_dir() else p.parent)
    elif resolved.entry is not None:
        repo = hf_cache_dir() / ("models--" + resolved.entry.hf_id.replace("/", "--"))
        candidates += sorted((repo / "snapshots").glob("*")) if repo.is_dir() else []
    for folder in candidates:
        if (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file():
            return str(folder)
    return None


def _tokenizer_lengths(path: str, folder: str, fmt: str) -> tuple[list[int], int]:
    from ..config import DataConfig
    from ..dataset.records import load_examples, load_tokenizer

    tok = load_tokenizer(folder)
    data = DataConfig(format=fmt, on_bad_record="skip")
    loaded = load_examples(path, tok, data, seq_len=10**9)
    return [len(e) for e in loaded.examples], len(loaded.bad)


def profile_data(path: str, spec: ModelSpec, resolved: Any = None, fmt: str = "auto",
                 seq_cap: int | None = None, images_per_sample: int | None = None) -> DataProfile:
    """Read a training file and describe its token lengths."""
    if not Path(path).is_file():
        raise DataError(f"--data '{path}': no such file; give a .json, .jsonl or .parquet "
                        "training file (alpaca, sharegpt or messages records)")
    folder = local_tokenizer_dir(resolved) if resolved is not None else None
    lengths, images, bad = _approx_lengths(path, fmt)
    source = (f"approximation: 1 token per CJK character, {CHARS_PER_TOKEN} characters per "
              f"token otherwise, {TEMPLATE_TOKENS_PER_MESSAGE} template tokens per message")
    if folder and not any(images):
        lengths, bad = _tokenizer_lengths(path, folder, fmt)
        source = f"tokenizer {folder}"
        images = [0] * len(lengths)
    if not lengths:
        raise DataError(f"--data '{path}': no usable records ({bad} rejected); expected "
                        "alpaca, sharegpt or messages records")
    if spec.vision:
        if images_per_sample is not None:
            images = [images_per_sample] * len(lengths)
        lengths = [x + n * spec.vision.tokens_per_image for x, n in zip(lengths, images, strict=True)]
    cap = min(seq_cap or spec.max_position_embeddings, spec.max_position_embeddings)
    return DataProfile(path, source, tuple(sorted(lengths)), len(lengths) + bad, bad,
                       round(sum(images) / len(images), 3) if spec.vision else 0.0,
                       max(images) if spec.vision else 0, choose_cutoffs(lengths, cap),
                       tuple(lengths))
