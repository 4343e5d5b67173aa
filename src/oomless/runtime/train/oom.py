"""Out-of-memory recovery: fault injection, a simulated GPU budget, the policy.

An OOM is recognised by type only (``torch.OutOfMemoryError``, which CUDA's
caching allocator raises, and which the two test helpers below raise too):

- :class:`FaultInjector` raises it at chosen optimizer steps, ranks and
  micro batches (``training.inject_oom``);
- :func:`budget_mode` counts the bytes of every live tensor storage created
  inside a step (a ``TorchDispatchMode``; storages are released through
  weakref finalizers) on top of a baseline (weights, gradients, optimizer
  states) and raises it when the total exceeds ``training.memory_budget_gb``:
  a CPU stand-in for a GPU of that size.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from typing import Any

from ...config import InjectOOM
from ...errors import OomlessError
from ...units import GiB, fmt_bytes


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (never empty)."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


class TrainingOOMError(OomlessError):
    """OOM at micro batch 1 with gradient checkpointing: no recovery left."""

    exit_code = 1


def _oom(message: str) -> BaseException:
    import torch

    return torch.OutOfMemoryError(message)


class FaultInjector:
    """Raises OutOfMemoryError where ``training.inject_oom`` says, ``times`` times each."""

    def __init__(self, specs: list[InjectOOM], rank: int) -> None:
        self.specs = [s for s in specs if s.rank is None or s.rank == rank]
        self.rank = rank
        self.fired: dict[str, int] = {}

    @staticmethod
    def _key(spec: InjectOOM) -> str:
        return f"{spec.phase}:{spec.step}:{spec.micro_index}:{spec.during}"

    def check(self, phase: str, step: int, micro_index: int, num_micro: int,
              during: str = "forward") -> None:
        for spec in self.specs:
            if spec.phase != phase or spec.step != step or spec.during != during:
                continue
            target = num_micro - 1 if spec.micro_index is None else min(spec.micro_index,
                                                                        num_micro - 1)
            key = self._key(spec)
            if micro_index == target and self.fired.get(key, 0) < spec.times:
                self.fired[key] = self.fired.get(key, 0) + 1
                raise _oom(f"oomless fault injection: {phase} step {step}, rank {self.rank}, "
                           f"micro batch {micro_index + 1}/{num_micro}, after {during}")

    def state_dict(self) -> dict[str, int]:
        return dict(self.fired)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.fired = dict(state)


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views counted once)."""
    import torch

    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def state_tensors(model: Any, optimizer: Any) -> list[Any]:
    """Weights, gradients and optimizer states: what lives across steps."""
    import torch

    out = []
    for p in model.parameters():
        out.append(p)
        if p.grad is not None:
            out.append(p.grad)
    for state in optimizer.state.values():
        out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def _budget_mode_class() -> type:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class _BudgetMode(TorchDispatchMode):
        def __init__(self, budget_bytes: int, baseline_bytes: int) -> None:
            super().__init__()
            self.budget_bytes = budget_bytes
            self.baseline_bytes = baseline_bytes
            self.live_bytes = 0
            self.peak_bytes = baseline_bytes
            self._sizes: dict[int, int] = {}

        def _free(self, key: int, n_bytes: int) -> None:
            if self._sizes.pop(key, None) is not None:
                self.live_bytes -= n_bytes

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._track(t)
            return out

        def _track(self, t: Any) -> None:
            st = t.untyped_storage()
            key, n_bytes = st.data_ptr(), st.nbytes()
            if n_bytes == 0 or key in self._sizes:
                return
            self._sizes[key] = n_bytes
            self.live_bytes += n_bytes
            weakref.finalize(st, self._free, key, n_bytes)
            total = self.baseline_bytes + self.live_bytes
            self.peak_bytes = max(self.peak_bytes, total)
            if total > self.budget_bytes:
                raise _oom(f"simulated GPU budget exceeded: tried to hold {fmt_bytes(total)} "
                           f"of {fmt_bytes(self.budget_bytes)} (training.memory_budget_gb)")

    return _BudgetMode


def budget_mode(budget_gb: float, baseline_bytes: int) -> Any:
    """A context manager that raises OutOfMemoryError above ``budget_gb`` GiB."""
    return _budget_mode_class()(int(budget_gb * GiB), baseline_bytes)


def release_memory(discard_gradients: Any, device: Any) -> None:
    """Drop what a failed step held: gradients, garbage, the allocator's cache."""
    import torch

    discard_gradients()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Recovery:
    """What to do after an OOM: the new micro batch and checkpointing switch."""

    micro_batch_size: int
    grad_ckpt: bool
    action: str


def next_setting(micro_batch_size: int, grad_ckpt: bool) -> Recovery | None:
    """Halve the micro batch; at 1, switch on gradient checkpointing; else None."""
    if micro_batch_size > 1:
        new = micro_batch_size // 2
        return Recovery(new, grad_ckpt, f"micro batch {micro_batch_size} -> {new}")
    if not grad_ckpt:
        return Recovery(1, True, "gradient checkpointing on (micro batch already 1)")
    return None


def diagnosis(step: int, longest_tokens: int, predicted_peak_bytes: int | None,
              budget_bytes: int | None, message: str) -> str:
    predicted = fmt_bytes(predicted_peak_bytes) if predicted_peak_bytes else "unknown"
    budget = f", budget {fmt_bytes(budget_bytes)}" if budget_bytes else ""
    return (
        f"out of memory at optimizer step {step} even with micro batch 1 and gradient "
        f"checkpointing (longest sample {longest_tokens} tokens; predicted peak {predicted}"
        f"{budget}).\n  last error: {message}\n  fixes: lower seq_len or data.max_input_length/"
        "max_output_length, use method: qlora or lora instead of full, shard with zero: 3 "
        "(several GPUs) or offload: optimizer; `oomless plan` finds a setting that fits"
    )
