"""Cutting a Trainer batch into row chunks, weighing them, and joining prediction outputs.

A batch is the mapping a data collator returns (a dict or a BatchEncoding):
tensors whose first dimension is the batch (rows) are cut; everything else
(scalars, ``cu_seq_lens`` of padding-free batches, flags) goes to every
chunk unchanged. Chunks are shallow copies of the mapping, so code that
pops keys from its inputs (LLaMA-Factory's ``prediction_step`` pops
``labels``) cannot change the batch a retry starts from.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

IGNORE_INDEX = -100  # transformers' label padding (CrossEntropyLoss ignore_index)


def batch_rows(inputs: Any) -> int | None:
    """Rows of a batch: the first dimension of its ``input_ids`` (else its first tensor)."""
    import torch

    if not isinstance(inputs, Mapping):
        return None
    first = inputs.get("input_ids")
    if not isinstance(first, torch.Tensor):
        first = next((v for v in inputs.values() if isinstance(v, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        return None
    return int(first.shape[0])


@dataclass(frozen=True)
class Layout:
    """How a trainer's batch is cut and its chunks weighed.

    ``pairs``: rows 0..B-1 are the chosen and rows B..2B-1 the rejected answers of B
    pairs (LLaMA-Factory's pairwise collator), so a chunk takes pair i's two rows.
    ``weight``: what the trainer's (unscaled) loss is a mean over: "tokens" (label
    tokens, transformers' causal-LM loss) or "rows" (samples or pairs: preference losses).
    """

    pairs: bool = False
    weight: str = "tokens"

    def units(self, rows: int) -> int:
        return rows // 2 if self.pairs else rows


# Preference trainers whose batch holds B chosen rows then B rejected rows and whose loss
# is the mean over the B pairs: TRL's DPOTrainer ("batch is [chosen, rejected]",
# per_sequence_loss.mean(), trl/trainer/dpo_trainer.py 1.16) and LLaMA-Factory's
# CustomDPOTrainer (PairwiseDataCollatorWithPadding; all_logps.split(batch_size) and
# losses.mean(), src/llamafactory/train/dpo/trainer.py).
_PAIR_MEAN_MODULES = ("trl.trainer.dpo_trainer", "llamafactory.train.dpo")


def layout_of(trainer: Any) -> Layout:
    modules = [c.__module__ for c in type(trainer).__mro__]
    if any(m.startswith(_PAIR_MEAN_MODULES) for m in modules):
        return Layout(pairs=True, weight="rows")
    return Layout()


def row_chunks(inputs: Mapping, rows: int, start: int, size: int,
               layout: Layout = Layout()) -> list[tuple[int, Any]]:
    """(units, chunk) for units ``start..`` in pieces of ``size`` units — rows, or pairs of
    rows in the pairwise layout — (the whole batch itself, uncopied, when one piece covers it)."""
    import torch

    units = layout.units(rows)
    if start == 0 and size >= units:
        return [(units, inputs)]
    out = []
    for lo in range(start, units, size):
        hi = min(units, lo + size)
        chunk = copy.copy(inputs)
        for key, value in inputs.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            if value.shape[0] == rows:
                chunk[key] = (torch.cat([value[lo:hi], value[units + lo:units + hi]])
                              if layout.pairs else value[lo:hi])
            elif layout.pairs and value.shape[0] == units:  # one value per pair
                chunk[key] = value[lo:hi]
        out.append((hi - lo, chunk))
    return out


def loss_items(inputs: Mapping, units: int, shifts_labels: bool,
               layout: Layout = Layout()) -> int:
    """What a mean loss averages over: the units (rows or pairs) for a per-sample mean,
    else the label tokens that count (after the causal shift when the model's loss
    shifts), else the units."""
    import torch

    if layout.weight == "rows":
        return units
    labels = inputs.get("shift_labels")
    if not isinstance(labels, torch.Tensor):
        labels = inputs.get("labels")
        if isinstance(labels, torch.Tensor) and labels.dim() >= 2 and shifts_labels:
            labels = labels[..., 1:]
    if isinstance(labels, torch.Tensor) and labels.dim() >= 2:
        return int(labels.ne(IGNORE_INDEX).sum())
    return units


# ---- joining prediction_step outputs ------------------------------------------------
def _pad_cat(tensors: list[Any], pad: int | float) -> Any:
    import torch

    if tensors[0].dim() >= 2:
        width = max(t.shape[1] for t in tensors)
        tensors = [t if t.shape[1] == width else torch.cat(
            [t, t.new_full((t.shape[0], width - t.shape[1], *t.shape[2:]), pad)], dim=1)
            for t in tensors]
    return torch.cat(tensors, dim=0)


def join_outputs(parts: list[Any], pad: int | float) -> Any:
    """Rows of ``parts`` (tensors, or tuples/lists/dicts of them) concatenated; the
    second dimension padded to the widest part with ``pad``."""
    import torch

    first = parts[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return torch.stack(parts)
        return _pad_cat(parts, pad)
    if isinstance(first, (tuple, list)):
        return type(first)(join_outputs([p[i] for p in parts], pad) for i in range(len(first)))
    if isinstance(first, Mapping):
        joined = copy.copy(first)
        for key in first:
            joined[key] = join_outputs([p[key] for p in parts], pad)
        return joined
    return first


def weighted_loss(losses: list[Any], weights: list[int]) -> Any:
    """The batch's mean loss from its chunks' means (weights: loss items per chunk)."""
    present = [(loss, w) for loss, w in zip(losses, weights, strict=True) if loss is not None]
    if not present:
        return None
    total = sum(w for _, w in present) or 1
    return sum(loss.float() * (w / total) for loss, w in present)
