"""CUDA autocast's fp32 policies emulated under CPU autocast, and the saved tensors of the
activations' Python formulas (what oomless.memory.activations.ACT_SAVED counts)."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from oomless.memory.activations import ACT_SAVED, FUSED_ACT_SAVED, act_saved_bytes
from oomless.runtime.trace.cuda_emulation import (
    CPU_AUTOCAST_FP32_OPS,
    CUDA_AUTOCAST_OPS,
    aten_overload,
    cuda_autocast_policies,
)

HEADER = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"


def _has_autocast_cpu_kernel(name: str) -> bool:
    op, _, overload = name.partition(".")
    return torch._C._dispatch_has_kernel_for_dispatch_key(
        f"aten::{op}" + (f".{overload}" if overload else ""), "AutocastCPU")


def _header_ops(macro: str) -> set[str]:
    """The rows of one AT_FORALL_* macro of the installed torch's autocast_mode.h."""
    text = HEADER.read_text(encoding="utf-8")
    body = text.split(f"#define {macro}(_)", 1)[1].split("#define", 1)[0]
    return {".".join(p.strip() for p in m.split(",")) for m in re.findall(r"_\(([\w, ]+)\)", body)}


@pytest.mark.skipif(not HEADER.exists(), reason="this torch ships no ATen headers")
def test_the_table_is_cudas_policy_less_what_cpu_autocast_already_runs_in_fp32():
    cuda = _header_ops("AT_FORALL_FP32") | _header_ops("AT_FORALL_FP32_SET_OPT_DTYPE")
    cuda |= {"norm.Scalar", "norm.ScalarOpt_dim"}  # AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE
    assert '"norm.Scalar"' in HEADER.read_text(encoding="utf-8")
    assert set(CUDA_AUTOCAST_OPS) == cuda - CPU_AUTOCAST_FP32_OPS
    assert CPU_AUTOCAST_FP32_OPS <= cuda


@pytest.mark.parametrize("name", sorted(CUDA_AUTOCAST_OPS))
def test_every_row_is_an_aten_op_intercepted_only_inside_the_context(name):
    assert aten_overload(name) is not None
    assert not _has_autocast_cpu_kernel(name)  # CPU autocast leaves it alone
    with cuda_autocast_policies():
        assert _has_autocast_cpu_kernel(name)
    assert not _has_autocast_cpu_kernel(name)


@pytest.mark.parametrize("name", sorted(CPU_AUTOCAST_FP32_OPS))
def test_rows_left_out_are_those_cpu_autocast_already_casts(name):
    assert _has_autocast_cpu_kernel(name)


X = torch.randn(4, 8, dtype=torch.bfloat16)
ENTRY_POINTS = {  # entry point → dtype under CPU autocast with CUDA's policies
    "torch.pow": (lambda: torch.pow(X, 3.0), torch.float32),
    "Tensor.__pow__": (lambda: X ** 3, torch.float32),
    "Tensor.__rpow__": (lambda: 2 ** X, torch.float32),
    "Tensor.exp": (lambda: X.exp(), torch.float32),
    "torch.rsqrt": (lambda: torch.rsqrt(X.abs() + 1), torch.float32),
    "F.softplus": (lambda: F.softplus(X), torch.float32),
    "F.layer_norm": (lambda: F.layer_norm(X, (8,), torch.ones(8, dtype=torch.bfloat16)),
                     torch.float32),
    "F.rms_norm": (lambda: F.rms_norm(X, (8,)), torch.float32),
    "torch.logsumexp": (lambda: torch.logsumexp(X, -1), torch.float32),
    "F.interpolate": (lambda: F.interpolate(X[None], scale_factor=2.0, mode="linear"),
                      torch.float32),
    "Tensor.sum": (lambda: X.sum(), torch.float32),
    "torch.sum(dim)": (lambda: torch.sum(X, -1), torch.float32),
    "Tensor.sum(dtype)": (lambda: X.sum(dtype=torch.bfloat16), torch.bfloat16),
    "F.softmax": (lambda: F.softmax(X, -1), torch.float32),
    "F.softmax(dtype)": (lambda: F.softmax(X, -1, dtype=torch.bfloat16), torch.bfloat16),
    "F.softmin": (lambda: F.softmin(X, -1), torch.float32),  # composite: softmax inside
    "Tensor.cumsum": (lambda: X.cumsum(0), torch.float32),
    "Tensor.norm": (lambda: X.norm(), torch.float32),
    "torch.norm(dim)": (lambda: torch.norm(X, dim=-1), torch.float32),
    "aten.norm.Scalar": (lambda: torch.ops.aten.norm.Scalar(X, 2), torch.float32),
    "aten.norm.ScalarOpt_dim": (lambda: torch.ops.aten.norm.ScalarOpt_dim(X, 2, [1]),
                                torch.float32),
    "int sum": (lambda: torch.arange(4).sum(), torch.int64),  # not eligible
    "mul": (lambda: X * 2, torch.bfloat16),  # not on the list
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_entry_points_run_as_cuda_autocast_runs_them(entry):
    call, dtype = ENTRY_POINTS[entry]
    with cuda_autocast_policies(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert call().dtype == dtype
    with cuda_autocast_policies():  # no autocast: nothing changes
        assert call().dtype in (torch.bfloat16, torch.int64)


def test_layer_norm_casts_input_and_affine_parameters_and_records_the_cast():
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(8, dtype=torch.bfloat16, requires_grad=True)
    with cuda_autocast_policies(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = F.layer_norm(x, (8,), w, None)
    assert out.dtype == torch.float32
    out.sum().backward()  # the casts are on the autograd graph: grads in the inputs' dtype
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16


def _saved_sizes(act: str, autocast: bool, emulate: bool) -> tuple[list[int], int]:
    saved: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    u = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    h = u * 1.0  # a non-leaf input, as the up projection's output is
    policies = cuda_autocast_policies() if emulate else contextlib.nullcontext()
    with policies, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = ACT2FN[act](h)
    storages = {t.untyped_storage().data_ptr(): t.element_size() for t in saved if t.numel() > 1}
    return sorted(storages.values()), out.element_size()


@pytest.mark.parametrize("act", sorted(ACT_SAVED) + ["silu", "gelu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("autocast", [True, False])
def test_act_saved_is_what_autograd_keeps(act, autocast):
    sizes, out = act_saved_bytes(act, 2, autocast)
    assert _saved_sizes(act, autocast, emulate=True) == (sorted(sizes), out)
    if act not in ACT_SAVED:
        assert len(sizes) == len(FUSED_ACT_SAVED)


def test_cpu_autocast_alone_keeps_gelu_new_in_16_bits():
    """What the trace saw before the emulation: the 120 MiB per phi-2 layer it missed."""
    assert _saved_sizes("gelu_new", True, emulate=False) == ([2, 2, 2, 2], 2)
    assert _saved_sizes("gelu_new", True, emulate=True) == ([2, 4, 4, 4], 4)


def test_nested_contexts_keep_the_kernels_until_the_outer_one_closes():
    with cuda_autocast_policies():
        with cuda_autocast_policies():
            assert _has_autocast_cpu_kernel("pow.Tensor_Scalar")
        assert _has_autocast_cpu_kernel("pow.Tensor_Scalar")
    assert not _has_autocast_cpu_kernel("pow.Tensor_Scalar")
