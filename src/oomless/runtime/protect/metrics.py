"""Training metrics a Trainer subclass adds up per ``compute_loss`` call, kept exact across
a recovery.

TRL's trainers count in ``compute_loss`` itself (trl/trainer/sft_trainer.py 1.16,
``compute_loss`` and ``log``; dpo_trainer.py, kto_trainer.py and reward_trainer.py the
same way):

- ``self._total_train_tokens += <tokens of this call's batch>``, logged as ``num_tokens``;
- ``self._metrics["train"][name].append(<this call's value>)`` (``mean_token_accuracy``,
  ``entropy``, DPO's ``rewards/*`` and ``logps/*``), averaged over the calls at logging.

A call that runs out of memory after counting (in its backward) is redone, and in one
process the step's earlier micro batches are redone too: their tokens and values would
count twice. A snapshot is taken before every attempt and at the start of every
optimizer step; the failed attempt's one (or, when the step is redone, the step's) is
put back, so every row counts once. What a split still changes is said in docs/hf.md:
the per-call lists get one value per chunk instead of one per micro batch.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Counters:
    tokens: Any = None  # ``_total_train_tokens`` (None: the trainer has none)
    lengths: dict[str, int] = field(default_factory=dict)  # ``_metrics["train"]`` list sizes


def _train_metrics(trainer: Any) -> MutableMapping | None:
    metrics = getattr(trainer, "_metrics", None)
    train = metrics.get("train") if isinstance(metrics, MutableMapping) else None
    return train if isinstance(train, MutableMapping) else None


def snapshot(trainer: Any) -> Counters:
    train = _train_metrics(trainer)
    lengths = {k: len(v) for k, v in train.items() if isinstance(v, list)} if train else {}
    return Counters(getattr(trainer, "_total_train_tokens", None), lengths)


def restore(trainer: Any, counters: Counters | None) -> None:
    """Put the counters back as they were at the snapshot."""
    if counters is None:
        return
    if counters.tokens is not None:
        trainer._total_train_tokens = counters.tokens
    train = _train_metrics(trainer)
    if train is None:
        return
    for key in list(train):
        value = train[key]
        if key == "num_tokens" and counters.tokens is not None:
            train[key] = [counters.tokens]  # TRL sets it to the running total
        elif key not in counters.lengths:
            del train[key]  # first appended by the failed attempt
        elif isinstance(value, list):
            del value[counters.lengths[key]:]
