"""Optimizer-state bytes tensor by tensor, for the rules that look at a tensor's size.

bitsandbytes decides per parameter tensor (bitsandbytes 0.50 ``optim/optimizer.py``):

- ``Optimizer2State.init_state``: a tensor of fewer than ``min_8bit_size`` elements
  (default 4096) keeps both Adam states in fp32 even in an 8-bit optimizer; a larger
  one gets two uint8 states plus an fp32 absmax per block of 256 elements.
- ``Optimizer8bit.get_state_buffer``: a paged optimizer puts a state in CUDA unified
  memory only when its tensor has at least 100,000 elements; smaller states are
  ordinary device tensors in PyTorch's allocator.

So norms, biases and narrow LoRA matrices escape 8-bit states and paging. The trainable
tensors come from the model's shapes (:func:`trainable_tensors`); what the shapes do not
cover (vision towers, fused-expert adapters, score heads, ``other_params``) is counted
as large tensors, and the estimate says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import RunConfig
from ..knobs import OptimizerKind
from ..models.spec import ModelSpec
from . import constants as C


@dataclass(frozen=True)
class OptimizerBytes:
    device: float  # states in PyTorch's allocator
    paged: float  # states in CUDA unified memory (paged optimizers)


def _adapter_tensors(spec: ModelSpec, r: int, targets: set[str], roles: set[str]
                     ) -> dict[int, int]:
    """elements → tensors: PEFT's lora_A (r × in) and lora_B (out × r) per wrapped linear."""
    out: dict[int, int] = {}
    for n_layers, is_moe in _layer_kinds(spec):
        for lin in spec.layer_linears(is_moe):
            if lin.name in targets and lin.role in roles:
                for size in (r * lin.in_features, r * lin.out_features):
                    out[size] = out.get(size, 0) + n_layers * lin.count
    return out


def _full_tensors(spec: ModelSpec) -> dict[int, int]:
    """elements → tensors of the language model's own parameters."""
    out: dict[int, int] = {}

    def add(size: int, n: int) -> None:
        if size and n:
            out[size] = out.get(size, 0) + n

    norm_tensors = spec.norm_params // spec.hidden_size  # LayerNorm: weight and bias
    for n_layers, is_moe in _layer_kinds(spec):
        for lin in spec.layer_linears(is_moe):
            if lin.role == "expert":  # transformers ≥ 5: one 3-D parameter for all experts
                add(lin.weight_params, n_layers)
                add(lin.out_features * lin.count if lin.bias else 0, n_layers)
            else:
                add(lin.in_features * lin.out_features, n_layers * lin.count)
                add(lin.out_features if lin.bias else 0, n_layers * lin.count)
        add(spec.hidden_size, n_layers * spec.norms_per_layer * norm_tensors)
        add(spec.head_dim if spec.qk_norm else 0, 2 * n_layers)
    add(spec.embedding_params, 1)
    add(spec.vocab_size * spec.hidden_size if spec.lm_head_params else 0, 1)
    add(spec.vocab_size if spec.lm_head_params and spec.lm_head_bias else 0, 1)
    add(spec.hidden_size, norm_tensors)  # the final norm
    return out


def _layer_kinds(spec: ModelSpec) -> list[tuple[int, bool]]:
    moe = spec.num_moe_layers
    return [(n, is_moe) for n, is_moe in ((spec.num_layers - moe, False), (moe, True)) if n]


def trainable_tensors(spec: ModelSpec, cfg: RunConfig, targets: set[str], roles: set[str],
                      trainable: int) -> dict[int, int]:
    """elements → count of the trainable tensors; what the shapes do not name (vision
    tower, fused-expert adapters, score head, other parameters) is one large tensor."""
    shapes = (_full_tensors(spec) if cfg.method == "full"
              else _adapter_tensors(spec, cfg.lora.r, targets, roles))
    named = sum(size * n for size, n in shapes.items())
    rest = max(0, trainable - named)
    if rest:
        shapes[rest] = shapes.get(rest, 0) + 1
    return shapes


def optimizer_state_bytes(kind: OptimizerKind, tensors: dict[int, int],
                          elem_bytes: float) -> OptimizerBytes:
    """States of ``kind`` over the trainable tensors (elements → count)."""
    device = paged = 0.0
    for size, n in tensors.items():
        absmax = 0.0  # fp32 per block of an 8-bit state: torch.zeros on the device, never paged
        if kind.eight_bit and size >= C.ADAM8BIT_MIN_SIZE:
            per = kind.full_states * size  # uint8 states
            absmax = kind.full_states * 4 * math.ceil(size / C.ADAM8BIT_BLOCK)
        elif kind.eight_bit or kind.paged:
            per = kind.full_states * 4 * size  # bitsandbytes' 32-bit states are fp32
        else:
            per = kind.full_states * elem_bytes * size
        if kind.paged and size >= C.PAGED_MIN_SIZE:
            paged += per * n
        else:
            device += per * n
        device += absmax * n
    return OptimizerBytes(device, paged)


def adafactor_bytes(spec: ModelSpec, cfg: RunConfig, targets: set[str], roles: set[str]) -> int:
    """Adafactor (HF, beta1=None): fp32 row + column second-moment factors per
    matrix, a full fp32 second moment per vector (Shazeer & Stern 2018, §3)."""
    total = 0
    for n_layers, is_moe in _layer_kinds(spec):
        for lin in spec.layer_linears(is_moe):
            if cfg.method == "full":
                total += n_layers * (lin.in_features + lin.out_features) * lin.count
            elif lin.name in targets and lin.role in roles:
                r = cfg.lora.r
                total += n_layers * lin.count * ((r + lin.in_features) + (lin.out_features + r))
    if cfg.method == "full":
        total += spec.vocab_size + spec.hidden_size  # embedding
        total += spec.num_layers * spec.norms_per_layer * spec.hidden_size
    return 4 * total
