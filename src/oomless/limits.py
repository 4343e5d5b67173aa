"""Caps on every numeric input: one table read by the CLI's option types
(``cli/_options.py``), RunConfig's validation (oomless.config: every ``oomless.yaml`` and
the web page, whose requests become RunConfigs) and the planner's request
(``planner/request.py``: the effective batch, the GPU count, the plans shown).

A cap lies far above any real run and far below what makes the arithmetic or the
search misbehave (a micro batch of 10^35 overflows nothing in Python but is no run, and
its divisors are no search). Each row says why its value is safe to refuse.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class Cap:
    high: int
    why: str  # what a value above it would mean


_SAMPLES = Cap(2**20, "a million samples in one step is no training run; GPT-3's batch was "
                      "3.2 million tokens, about 1,600 sequences")
_TOKENS = Cap(2**24, "16.8 million tokens is beyond every model's context; the longest "
                     "published hold 1 to 10 million")

# Keys are RunConfig's dotted keys, plus the planner's own inputs (effective_batch,
# world_size, top).
CAPS: dict[str, Cap] = {
    "micro_batch_size": _SAMPLES,
    "grad_accum": _SAMPLES,
    "effective_batch": _SAMPLES,
    "eval.batch_size": _SAMPLES,
    "rlhf.rollout_batch_size": _SAMPLES,
    "seq_len": _TOKENS,
    "data.max_input_length": _TOKENS,
    "data.max_output_length": _TOKENS,
    "data.image_tokens": _TOKENS,
    "eval.max_new_tokens": _TOKENS,
    "rlhf.response_length": _TOKENS,
    "lora.r": Cap(2**16, "a rank above the hidden size of every model; "
                         "Llama-3.1-405B's is 16,384"),
    "data.images_per_sample": Cap(2**12, "more images than one sample holds"),
    "vision.image_size": Cap(2**16, "wider than any camera's image"),
    "vision.max_pixels": Cap(2**32, "more than any vision tower reads"),
    "vision.min_pixels": Cap(2**32, "more than any vision tower reads"),
    "hardware.gpus_per_node": Cap(2**10, "more GPUs than a node holds; an NVL72 rack has 72"),
    "hardware.nodes": Cap(2**16, "more nodes than any cluster has"),
    "world_size": Cap(2**20, "more GPUs than any cluster has"),
    "hardware.host_ram_gb": Cap(2**20, "a petabyte of host RAM per node is no machine"),
    "gpu_memory_gb": Cap(2**14, "16 TB on one GPU; the largest hold 288 GB"),
    "top": Cap(1000, "more plans than anyone reads"),
}


# plan's search stops after this long and says so (PlanResult.complete, its notes): a
# usual plan takes under a second; an open search over many GPUs, lengths and methods
# a few seconds.
PLAN_TIME_BUDGET_S = 30.0


def cap_of(key: str) -> int:
    return CAPS[key].high


def cap_message(key: str, value: float) -> str:
    """Why ``value`` is refused for ``key`` (no position: callers add the flag or line)."""
    cap = CAPS[key]
    return f"at most {cap.high:,}, got {value:,.15g} ({cap.why})"


def check_cap(key: str, value: float | None, what: str | None = None) -> None:
    """A ConfigError naming ``what`` (default: the key) when ``value`` exceeds its cap."""
    if value is not None and value > CAPS[key].high:
        raise ConfigError(f"{what or key}: {cap_message(key, value)}")
