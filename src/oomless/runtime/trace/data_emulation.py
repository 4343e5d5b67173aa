"""Values that fake tensors do not have, answered as a full-length batch would.

A trace runs on fake tensors: shapes without values. Training code sometimes
reads a value — trainers log metrics (``.item()``), check masks
(``if mask.all()``), or select the positions a mask keeps (``x[mask]``,
``nonzero``). The batches a trace runs are full-length samples without
padding in which every position is a completion token (the estimate's
assumption), so those questions have known answers: every mask is all true,
every selection keeps every element. ``FullBatchMode`` answers them so:

- ``_local_scalar_dense`` (``.item()``, ``bool(t)``, ``.tolist()``) of a fake
  tensor without a known constant: 1 (True, 1.0);
- ``nonzero`` / ``argwhere``: the indices of every element;
- ``masked_select`` and ``x[mask]``: every element (row).

Fake tensors that carry a constant (small integer tensors made from Python
numbers, such as an image grid) keep their real value: FakeTensorMode
answers those itself. Memory never depends on these values, only control flow
and metric logging do, and one such branch decides memory: transformers'
masking_utils asks ``is_tracing(tensor)`` before it reads a mask, and counts a fake
tensor as tracing, so a trace would keep the packed-sequence mask
(``find_packed_sequence_indices``: ``(packed_sequence_mask[:, -1] == 0).all()``) that a
run on the GPU drops for an unpacked batch, and build (batch, 1, s, s) boolean masks
where the GPU builds (1, 1, s, s). ``FullBatchMode`` makes masking_utils see the
trace's tensors as the GPU's (real, readable) and answers the read.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten


def _unknown(t: Any) -> bool:
    """A fake tensor whose value FakeTensorMode cannot give."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) and t.constant is None


_ACTIVE = [0]  # FullBatchMode contexts open now


def full_batch_active() -> bool:
    """Whether value reads are answered as for a full batch (an attention mask of all
    ones is then no padding: transformers would drop it)."""
    return _ACTIVE[0] > 0


class FullBatchMode(TorchDispatchMode):
    """Answer value reads of fake tensors as for a full, unpadded batch."""

    def __enter__(self) -> FullBatchMode:
        _ACTIVE[0] += 1
        self._masking = _masks_read_as_real()
        self._masking.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE[0] -= 1
        super().__exit__(*exc)
        self._masking.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if func is _aten._local_scalar_dense.default and _unknown(first):
            if first.dtype is torch.bool:
                return True
            return 1.0 if first.dtype.is_floating_point else 1
        if func in (_aten.nonzero.default, _aten.argwhere.default) and _unknown(first):
            return torch.empty((first.numel(), first.dim()), dtype=torch.long)
        if func is _aten.index.Tensor and len(args) > 1:
            out = _bool_index(first, args[1])
            if out is not None:
                return out
        if func is _aten.masked_select.default and _unknown(first):
            shape = torch.broadcast_shapes(first.shape, args[1].shape)
            return torch.empty((int(torch.Size(shape).numel()),), dtype=first.dtype)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _masks_read_as_real() -> Any:
    """transformers.masking_utils ``is_tracing`` without its fake-tensor test (compile,
    jit and stream capture still count)."""
    try:
        from transformers import masking_utils
    except ImportError:  # no transformers: nothing reads masks
        yield
        return
    original = masking_utils.is_tracing
    masking_utils.is_tracing = lambda tensor=None: original(None)
    try:
        yield
    finally:
        masking_utils.is_tracing = original


def _bool_index(x: Any, indices: list[Any]) -> Any:
    """``x[mask]`` with one boolean mask over x's leading dimensions: every row kept."""
    bools = [i for i in indices if isinstance(i, torch.Tensor) and i.dtype is torch.bool]
    if len(indices) != 1 or len(bools) != 1 or not _unknown(bools[0]):
        return None
    mask = bools[0]
    rest = tuple(x.shape[mask.dim():])
    return torch.empty((mask.numel(), *rest), dtype=x.dtype)
