"""The training loss, as transformers computes it for causal LMs."""

from __future__ import annotations

from typing import Any


def token_loss_sum(logits: Any, labels: Any) -> Any:
    """Sum of next-token cross-entropy over label tokens, in fp32.

    The labels are shifted (padded with -100 at the end), not the logits, so
    no copy of the logits is made — as transformers' ForCausalLMLoss does.
    """
    import torch.nn.functional as F

    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), shifted.reshape(-1),
                           ignore_index=-100, reduction="sum")
