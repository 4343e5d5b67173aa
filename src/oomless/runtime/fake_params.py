"""Parameters as fake tensors (one FakeTensorMode per process) and parameter counts that
read a packed 4-bit weight by the size it stands for."""

from __future__ import annotations

from typing import Any

import torch

_FAKE_MODE: Any = None


def fake_mode() -> Any:
    """One FakeTensorMode per process: fake tensors of different modes cannot mix."""
    global _FAKE_MODE
    if _FAKE_MODE is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        # non-fake inputs: bitsandbytes' cached code tables are real CPU tensors
        _FAKE_MODE = FakeTensorMode(allow_non_fake_inputs=True)
    return _FAKE_MODE


def fakeify(model: torch.nn.Module, fake: Any) -> None:
    """Replace every non-fake parameter and buffer by a CPU fake tensor of its
    shape and dtype; tied parameters stay tied."""
    from torch._subclasses.fake_tensor import FakeTensor

    memo: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or isinstance(p, FakeTensor):
                continue
            if id(p) not in memo:
                with fake:
                    t = torch.empty(p.shape, dtype=p.dtype)
                memo[id(p)] = torch.nn.Parameter(t, requires_grad=p.requires_grad)
            module._parameters[name] = memo[id(p)]
        for name, b in list(module._buffers.items()):
            if b is None or isinstance(b, FakeTensor):
                continue
            if id(b) not in memo:
                with fake:
                    memo[id(b)] = torch.empty(b.shape, dtype=b.dtype)
            module._buffers[name] = memo[id(b)]


def param_numel(p: torch.Tensor) -> int:
    """Elements ``p`` stands for: a packed 4-bit weight counts its unpacked shape."""
    state = getattr(p, "quant_state", None)
    if state is not None and getattr(state, "shape", None) is not None:
        return int(torch.Size(state.shape).numel())
    return p.numel()


def count_params(model: torch.nn.Module) -> int:
    return sum(param_numel(p) for p in model.parameters())


def count_trainable(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
