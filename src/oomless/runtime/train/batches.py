"""Which samples each optimizer step uses, and how they become tensors.

The schedule is a pure function of (seed, dataset size, effective batch,
step): step k of epoch e takes the next ``effective_batch`` indices of a
seeded permutation of the dataset; each rank takes its contiguous share.
It never depends on the micro batch, so an OOM retry with smaller micro
batches, or a resumed run, sees exactly the same samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...dataset.records import IGNORE_INDEX, Example
from ...errors import ConfigError


@dataclass(frozen=True)
class SampleSchedule:
    num_samples: int
    effective_batch: int  # samples per optimizer step, all ranks together
    world_size: int
    seed: int

    def __post_init__(self) -> None:
        if self.effective_batch % self.world_size:
            raise ConfigError(f"effective batch {self.effective_batch} is not divisible by "
                              f"{self.world_size} processes")
        if self.num_samples < self.effective_batch:
            raise ConfigError(
                f"the training data has {self.num_samples} usable samples, fewer than one "
                f"optimizer step needs (effective batch {self.effective_batch} = micro_batch_size"
                " x grad_accum x GPUs); lower grad_accum or micro_batch_size, or add data")

    @property
    def steps_per_epoch(self) -> int:
        """Full optimizer steps per pass; the remainder is dropped (drop_last)."""
        return self.num_samples // self.effective_batch

    def total_steps(self, epochs: float, max_steps: int | None) -> int:
        if max_steps:
            return max_steps
        return max(1, math.floor(epochs * self.steps_per_epoch))

    def _permutation(self, epoch: int) -> list[int]:
        import torch

        gen = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=gen).tolist()

    def step_indices(self, step: int, rank: int = 0) -> list[int]:
        """Dataset indices of 0-based optimizer step ``step`` on ``rank``."""
        epoch, pos = divmod(step, self.steps_per_epoch)
        perm = self._permutation(epoch)
        chunk = perm[pos * self.effective_batch:(pos + 1) * self.effective_batch]
        per_rank = self.effective_batch // self.world_size
        return chunk[rank * per_rank:(rank + 1) * per_rank]

    def position(self, step: int) -> dict[str, int]:
        epoch, pos = divmod(step, self.steps_per_epoch)
        return {"epoch": epoch, "step_in_epoch": pos,
                "samples_consumed": step * self.effective_batch}


def micro_batches(indices: list[int], micro_batch_size: int) -> list[list[int]]:
    return [indices[i:i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]


def label_tokens(examples: list[Example]) -> int:
    """Tokens that contribute to the loss: labels after the one-token shift."""
    return sum(sum(1 for t in e.labels[1:] if t != IGNORE_INDEX) for e in examples)


def collate(examples: list[Example], pad_id: int, device: Any,
            vision: Any = None) -> dict[str, Any]:
    """Right-padded tensors; packed examples carry position_ids and no attention mask.

    With ``vision`` (a VisionProcessor), the images of the batch become the
    processor's pixel tensors, in the order their tokens appear.
    """
    import torch

    width = max(len(e) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    packed = any(e.position_ids is not None for e in examples)
    positions = torch.zeros((len(examples), width), dtype=torch.long)
    for row, ex in enumerate(examples):
        n = len(ex)
        ids[row, :n] = torch.tensor(ex.input_ids)
        labels[row, :n] = torch.tensor(ex.labels)
        mask[row, :n] = 1
        pos = ex.position_ids if ex.position_ids is not None else range(n)
        positions[row, :n] = torch.tensor(list(pos))
        positions[row, n:] = torch.arange(width - n)  # padding: its own block
    batch = {"input_ids": ids, "labels": labels}
    if packed:
        batch["position_ids"] = positions
    else:
        batch["attention_mask"] = mask
    out = {k: v.to(device) for k, v in batch.items()}
    images = [p for e in examples for p in e.images]
    if images and vision is not None:
        from ...dataset.vision import pixel_inputs

        out.update(pixel_inputs(vision, images, device))
    return out
