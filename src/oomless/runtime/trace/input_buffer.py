"""The autograd engine's in-place gradient sums, which a dispatch mode turns off.

When two gradients flow into the same input of a node (a tensor used twice: a tied
embedding's weight, a residual stream, q/k/v reading one norm output), the engine sums
them in its input buffer (torch/csrc/autograd/input_buffer.cpp, ``accumulate``): with
grad mode off it runs ``old_var.add_(var)`` when ``can_accumulate_inplace(old_var)``
(a plain dense tensor whose TensorImpl and storage the buffer alone holds) and ``var``
is no tensor subclass, else ``old_var + var``, a new tensor. ``at::isTensorSubclassLike``
(aten/src/ATen/TensorSubclassLikeUtils.h) counts every tensor as a subclass while a
Python dispatch mode is on, and a FakeTensor always: under the storage tracker the sum
is always out of place, one extra gradient-sized block the GPU never allocates (the
vocab × hidden block of a tied embedding at the end of every backward).

``EngineSums`` finds those sums and tells the tracker to account the sum's output as the
storage of ``old_var`` (what ``add_`` would have written into). A sum is the engine's
when it runs after a node's ``apply`` has returned and before the next node starts:
Python post-hooks on the nodes (``Node.register_hook``, called by the engine's
``call_function`` after ``apply``, before ``evaluate_function`` adds the outputs to the
next input buffers) and pre-hooks (``Node.register_prehook``) mark the boundaries.
Hooks are put on a node's successors while the node runs, so every node that runs after
the first one the tracker sees has them before it starts. The buffer holding the last
reference is read from use counts, compared with those of a sum whose first operand
the buffer alone holds by construction (``calibrated_use_counts``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"  # no outputs: nothing to sum after it


def _use_counts(t: torch.Tensor) -> tuple[int, int]:
    """The TensorImpl's and the storage's reference counts, as the engine reads them."""
    return t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)


@functools.cache
def calibrated_use_counts() -> tuple[int, int]:
    """Use counts of a sum's first operand, seen from a dispatch mode, when the input
    buffer holds its only reference: ``exp(x)`` feeds two products, the first product's
    gradient (a fresh tensor) waits in the buffer of ExpBackward0 for the second."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    seen: list[tuple[int, int]] = []

    class Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.add.Tensor and torch._C._current_autograd_node() is not None:
                seen.append(_use_counts(args[0]))
            return func(*args, **(kwargs or {}))

    with _disable_current_modes(), torch.enable_grad():
        x = torch.ones(4, requires_grad=True)
        y = x.exp()
        loss = (y * 2).sum() + (y * 3).sum()
        with Probe():
            loss.backward()
    if len(seen) != 1:
        raise RuntimeError(f"the engine's gradient sum was not seen once but {len(seen)} times")
    return seen[0]


def _dense(t: torch.Tensor) -> bool:
    """A strided tensor, neither nested nor a ZeroTensor, whose dimensions some order
    makes contiguous (c10 TensorImpl ``compute_non_overlapping_and_dense``: size-1
    dimensions skipped)."""
    if t.layout != torch.strided or t.is_nested or t._is_zerotensor():
        return False
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True)
                                      if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class EngineSums:
    """Which ``aten.add.Tensor`` calls are the engine's input-buffer sums that the engine
    without a dispatch mode runs in place (``in_place_operand``)."""

    def __init__(self) -> None:
        self._running: Any = None  # the node whose apply runs now
        self._finished: Any = None  # the node whose apply returned; its outputs are summed
        self._baseline = calibrated_use_counts()

    def reset(self) -> None:
        self._running = self._finished = None

    def observe(self) -> None:
        """Called at every op: a node seen running without our hooks gets them (its
        successors too), so the nodes after it are marked."""
        node = torch._C._current_autograd_node()
        if node is None or node is self._running or node is self._finished:
            return
        self._running, self._finished = node, None
        # added while apply runs: the engine calls it after apply without having kept
        # the inputs for it (call_function reads post_hooks() before and after apply)
        node.register_hook(lambda _ins, _outs: self._post())
        self._hook_successors(node)

    def in_place_operand(self, func: Any, args: tuple) -> torch.Tensor | None:
        """``old_var`` when this op is the engine's sum that ``add_`` would have run."""
        if func is not torch.ops.aten.add.Tensor or self._finished is None:
            return None
        if torch._C._current_autograd_node() is not self._finished or len(args) != 2:
            return None
        old, var = args
        if not (isinstance(old, torch.Tensor) and isinstance(var, torch.Tensor)):
            return None
        if torch.is_grad_enabled() or old.shape != var.shape or old.dtype != var.dtype:
            return None  # grad mode on (create_graph): the engine sums out of place
        tensor_refs, storage_refs = _use_counts(old)
        if not _dense(old) or tensor_refs > self._baseline[0] or storage_refs > self._baseline[1]:
            return None  # another holder sees old_var: the engine adds out of place
        return old

    # ---- hooks (they find their node as the engine's current one: a hook holding its
    # node would keep the graph alive through the node's own hook list) ----------------
    def _pre(self) -> None:
        self._running, self._finished = torch._C._current_autograd_node(), None

    def _post(self) -> None:
        node = torch._C._current_autograd_node()
        if node is None or self._finished is node:  # a second copy of the hook
            return
        self._running, self._finished = None, node
        self._hook_successors(node)

    def _hook_successors(self, node: Any) -> None:
        for successor, _ in node.next_functions:
            if successor is None or successor.name() == _ACCUMULATE_GRAD:
                continue
            try:
                successor.register_prehook(lambda _grads: self._pre())
                successor.register_hook(lambda _ins, _outs: self._post())
            except (RuntimeError, TypeError):  # a node without hooks: its sums stay
                continue  # out of place, as the trace saw them before
