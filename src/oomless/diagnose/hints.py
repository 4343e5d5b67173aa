"""Run settings written in the log itself: launch command lines and argument dumps.

Hugging Face ``TrainingArguments`` appear as ``--per_device_train_batch_size 8``
(command lines), ``per_device_train_batch_size=8`` (the dataclass repr) or
``per_device_train_batch_size: 8`` (LLaMA-Factory YAML); DeepSpeed JSON as
``"train_micro_batch_size_per_gpu": 8``; vLLM engine arguments as
``gpu_memory_utilization=0.95`` or ``--gpu-memory-utilization 0.95``.
The first value found wins (the launch line precedes later echoes).
"""

from __future__ import annotations

import re

from .events import RunHints
from .text import scan
from .vllm import vllm_profile

_SEP = r"""["']?\s*(?:=|:|\s)\s*["']?"""


def _key(*names: str) -> str:
    alternatives = "|".join(n.replace("_", "[_-]") for n in names)
    return rf"(?<![\w-])-{{0,2}}(?:{alternatives})\b{_SEP}"


class _Setting:
    """A setting's regex, tried only when one of its names (either spelling) is in the text."""

    def __init__(self, pattern: str, names: tuple[str, ...]) -> None:
        self.pattern = re.compile(pattern)
        self.words = tuple({n for name in names for n in (name, name.replace("_", "-"))})

    def search(self, text: str) -> re.Match[str] | None:
        """The first match in text order, looking only at lines that hold a name."""
        pos = 0
        while True:
            hits = [i for w in self.words if (i := text.find(w, pos)) >= 0]
            if not hits:
                return None
            first = min(hits)
            start = text.rfind("\n", 0, first) + 1
            end = text.find("\n", first)
            end = len(text) if end < 0 else end
            m = self.pattern.search(text, start, end)
            if m:
                return m
            pos = end + 1


def _int_pattern(*names: str) -> _Setting:
    return _Setting(_key(*names) + r"(\d{1,7})\b", names)


_MICRO = _int_pattern("per_device_train_batch_size", "train_micro_batch_size_per_gpu",
                      "micro_batch_size", "per_gpu_train_batch_size")
_ACCUM = _int_pattern("gradient_accumulation_steps", "grad_accum", "gradient_accumulation")
_EVAL = _int_pattern("per_device_eval_batch_size", "eval_batch_size", "per_gpu_eval_batch_size")
_SEQ = _int_pattern("model_max_length", "max_seq_length", "cutoff_len", "max_length", "seq_len",
                    "max_seq_len", "block_size")
_NEW = _int_pattern("max_new_tokens")
_MAX_MODEL_LEN = _int_pattern("max_model_len")
_MAX_NUM_SEQS = _int_pattern("max_num_seqs")
_WORLD = _int_pattern("nproc_per_node", "num_processes", "world_size", "num_gpus", "num_local_procs")
# HF Trainer's banner: "***** Running Evaluation *****" then "  Batch size = 16"
_EVAL_BANNER = re.compile(r"Running (?:Evaluation|Prediction) \*+(?:\n[^\n]*){0,4}?\n\s*Batch size = (\d+)")
_UTIL = _Setting(_key("gpu_memory_utilization") + r"(0?\.\d{1,4}|1(?:\.0{1,4})?)\b",
                 ("gpu_memory_utilization",))
_ZERO_FILE = re.compile(r"\bzero_?(?:stage_?)?([0-3])(?:[_-]\w+)?\.json\b", re.IGNORECASE)
_ZERO_STAGE = re.compile(r"""(?:zero_stage|"stage")\s*[:=]\s*([0-3])\b""")
_CKPT = _Setting(_key("gradient_checkpointing", "grad_ckpt") + r"(True|False|true|false|1|0)\b",
                 ("gradient_checkpointing", "grad_ckpt"))
_PROGRESS = re.compile(r"(?<![\d/])(\d{1,7})/(\d{1,7}) \[[\d:]+<")
_STEP = re.compile(r"\{'loss': [^}]*'epoch': ")


def _first_int(pattern: _Setting | re.Pattern[str], text: str) -> int | None:
    m = pattern.search(text)
    return int(m.group(1)) if m else None


def _first(pattern: re.Pattern[str], text: str, *words: str) -> re.Match[str] | None:
    return next(scan(pattern, text, words), None)


def _zero_stage(text: str) -> int | None:
    m = _first(_ZERO_FILE, text, "zero", "ZeRO", "Zero") or _first(_ZERO_STAGE, text, "stage")
    return int(m.group(1)) if m else None


def _grad_ckpt(text: str) -> bool | None:
    m = _CKPT.search(text)
    return None if m is None else m.group(1).lower() in ("true", "1")


def steps_done(text: str, before: int) -> int | None:
    """Training steps finished before position ``before``: tqdm counters or logged losses."""
    region = text[:before]
    last = None
    for m in scan(_PROGRESS, region, ("<",), before=60, after=10):
        done, total = int(m.group(1)), int(m.group(2))
        if total > 0 and done <= total:
            last = done
    logged = sum(1 for _ in scan(_STEP, region, ("{'loss': ",), before=0, after=400))
    if last is None:
        return logged or None
    return max(last, logged)


def _banner_eval_batch(text: str) -> int | None:
    m = _first(_EVAL_BANNER, text, "Running Evaluation", "Running Prediction")
    return int(m.group(1)) if m else None


def read_hints(text: str, first_event_pos: int | None) -> RunHints:
    """Settings found anywhere in ``text``; progress counted up to the first event."""
    util = _UTIL.search(text)
    profile = vllm_profile(text, first_event_pos)
    utilization = float(util.group(1)) if util else profile.get("gpu_memory_utilization")
    return RunHints(
        micro_batch_size=_first_int(_MICRO, text),
        grad_accum=_first_int(_ACCUM, text),
        eval_batch_size=_first_int(_EVAL, text) or _banner_eval_batch(text),
        seq_len=_first_int(_SEQ, text),
        max_new_tokens=_first_int(_NEW, text),
        zero_stage=_zero_stage(text),
        grad_ckpt=_grad_ckpt(text),
        world_size=_first_int(_WORLD, text),
        gpu_memory_utilization=float(utilization) if utilization is not None else None,
        max_model_len=_first_int(_MAX_MODEL_LEN, text),
        max_num_seqs=_first_int(_MAX_NUM_SEQS, text),
        steps_done=steps_done(text, first_event_pos) if first_event_pos is not None else None,
        vllm_profile=profile,
    )


_ROOT_CAUSE = re.compile(
    r"Root Cause \(first observed failure\):\s*\n\s*\[\d+\]:\s*\n(?:[^\n]*\n){0,3}?\s*rank\s*:\s*(\d+)"
    r"[^\n]*\n\s*exitcode\s*:\s*(-?\d+)"
)
_FLUSHES = re.compile(r"(\d+) pytorch allocator cache flushes since last step")


def context_notes(text: str) -> list[str]:
    """What launchers and DeepSpeed said around the failure, in words."""
    notes: list[str] = []
    root = _first(_ROOT_CAUSE, text, "Root Cause")
    if root:
        notes.append(f"torchrun: rank {root.group(1)} failed first (exit code {root.group(2)})")
    flushes = [int(m.group(1)) for m in scan(_FLUSHES, text, ("cache flushes",), before=40, after=10)]
    if flushes:
        notes.append(
            f"DeepSpeed warned {len(flushes)} time(s) of allocator cache flushes (up to {max(flushes)} "
            "per step): the allocator was already freeing its cache to keep going, a sign of memory "
            "pressure and fragmentation (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True helps)"
        )
    return notes
