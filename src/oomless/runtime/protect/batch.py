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


def row_chunks(inputs: Mapping, rows: int, start: int, size: int) -> list[tuple[int, Any]]:
    """(row count, chunk) for rows ``start..rows`` in pieces of ``size`` (the whole batch
    itself, uncopied, when one piece covers it)."""
    import torch

    if start == 0 and size >= rows:
        return [(rows, inputs)]
    out = []
    for lo in range(start, rows, size):
        hi = min(rows, lo + size)
        chunk = copy.copy(inputs)
        for key, value in inputs.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
                chunk[key] = value[lo:hi]
        out.append((hi - lo, chunk))
    return out


def loss_items(inputs: Mapping, rows: int, shifts_labels: bool) -> int:
    """What a mean loss averages over: label tokens that count (after the causal
    shift when the model's loss shifts), else rows."""
    import torch

    labels = inputs.get("shift_labels")
    if not isinstance(labels, torch.Tensor):
        labels = inputs.get("labels")
        if isinstance(labels, torch.Tensor) and labels.dim() >= 2 and shifts_labels:
            labels = labels[..., 1:]
    if isinstance(labels, torch.Tensor) and labels.dim() >= 2:
        return int(labels.ne(IGNORE_INDEX).sum())
    return rows


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
