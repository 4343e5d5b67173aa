"""Memory that CUDA kernels allocate where the CPU/fake kernels of a trace do not.

A trace runs on CPU fake tensors, so it sees the tensors each op *returns*
but not the buffers a CUDA kernel allocates through the caching allocator for
itself. ``CudaEmulation.before`` is called by the tracker before each op and
allocates those buffers as phantom storages (freed right after the op, or
kept, for workspaces), with the sizes the CUDA code uses:

- cuBLAS/cuBLASLt workspaces (aten/src/ATen/cuda/CublasHandlePool.cpp):
  one per (handle, stream), allocated by the caching allocator at the first
  matmul and kept: ``CUBLAS_WORKSPACE_CONFIG`` default :4096:8 = 32 MiB on
  sm90, :4096:2:16:8 = 8 MiB + 128 KiB elsewhere; cuBLASLt 1 MiB
  (``CUBLASLT_WORKSPACE_SIZE`` default 1024 KiB). The autograd engine runs
  CUDA backward ops on its own device thread, which reserves its own handle,
  so backward adds a second pair.
- FlashAttention-2 backward (aten/src/ATen/native/transformers/cuda/flash_attn/
  flash_api.cpp, mha_bwd): ``softmax_d`` fp32 [b, h, round128(s_q)],
  ``dq_accum`` fp32 [b, round128(s_q), h, round32(d)], and for GQA/MQA
  ``dk_expanded``/``dv_expanded`` [b, s_k, h, d] before the sum over groups.
  The forward's kept tensors (output + fp32 log-sum-exp) equal what PyTorch's
  CPU flash kernel returns, so the forward needs nothing added.
- bitsandbytes 4-bit matmul (bitsandbytes/backends/cuda/ops.py,
  ``_dequant_linear_fallback``): for more than 4 rows the weight is
  dequantized to a [N, K] 16-bit temporary (the custom kernel's shape
  heuristics vary by GPU; we take the fallback, which needs more), plus fp32
  absmax buffers for double quantization.

``cuda_autocast_layer_norm`` makes LayerNorm compute in fp32 under autocast, as
CUDA autocast does and CPU autocast does not; ``cuda_dropout`` makes training
dropout the fused ``native_dropout`` kernel CUDA runs (a boolean mask kept for
backward; the CPU path multiplies by a mask of the input's dtype).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from ...units import MiB

CUBLAS_WORKSPACE_SM90_BYTES = 4096 * 8 * 1024  # :4096:8 default on Hopper
CUBLAS_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8  # :4096:2:16:8 default elsewhere
CUBLASLT_WORKSPACE_BYTES = 1 * MiB  # CUBLASLT_WORKSPACE_SIZE default 1024 KiB
BNB_CUSTOM_KERNEL_MAX_ROWS = 4  # _GEMM_4BIT_CUSTOM_FLOOR_M: always the custom kernel


def cublas_workspace_bytes(compute_capability: str | None) -> int:
    return CUBLAS_WORKSPACE_SM90_BYTES if compute_capability == "9.0" else CUBLAS_WORKSPACE_BYTES


def _round(x: int, m: int) -> int:
    return -(-x // m) * m


def _matmul_ops() -> set[Any]:
    aten = torch.ops.aten
    return {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
            aten.addmv.default, aten.mv.default, aten.dot.default}


@dataclass
class CudaEmulation:
    cublas_bytes: int = CUBLAS_WORKSPACE_BYTES
    cublaslt_bytes: int = CUBLASLT_WORKSPACE_BYTES
    notes: list[str] = field(default_factory=list)
    _threads_with_workspace: set[str] = field(default_factory=set)
    _matmuls: set[Any] = field(default_factory=_matmul_ops)

    def before(self, tracker: Any, func: Any, args: tuple, kwargs: dict) -> list[int]:
        """Allocate the op's CUDA-only buffers; return the keys to free after it."""
        if func in self._matmuls:
            self._workspace(tracker)
            return []
        name = func.name()
        if name == "aten::_scaled_dot_product_flash_attention_for_cpu_backward":
            return self._flash_backward(tracker, args)
        if name == "bitsandbytes::gemm_4bit":
            return self._bnb_gemm_4bit(tracker, args, kwargs)
        return []

    def _workspace(self, tracker: Any) -> None:
        thread = "autograd" if tracker.phase == "backward" else "main"
        if thread in self._threads_with_workspace:
            return
        self._threads_with_workspace.add(thread)
        from .storage_tracker import WORKSPACE

        tracker.phantom_alloc(self.cublas_bytes, f"cublas_workspace[{thread}]", WORKSPACE)
        tracker.phantom_alloc(self.cublaslt_bytes, f"cublaslt_workspace[{thread}]", WORKSPACE)

    def _flash_backward(self, tracker: Any, args: tuple) -> list[int]:
        q, k = args[1], args[2]  # (grad_out, query, key, value, out, logsumexp, ...)
        b, h, s_q, d = q.shape
        h_k, s_k = k.shape[1], k.shape[2]
        keys = [
            tracker.phantom_alloc(4 * b * h * _round(s_q, 128), "flash_bwd.softmax_d"),
            tracker.phantom_alloc(4 * b * _round(s_q, 128) * h * _round(d, 32), "flash_bwd.dq_accum"),
        ]
        if h_k != h:
            size = b * s_k * h * d * q.element_size()
            keys.append(tracker.phantom_alloc(size, "flash_bwd.dk_expanded"))
            keys.append(tracker.phantom_alloc(size, "flash_bwd.dv_expanded"))
        return keys

    def _bnb_gemm_4bit(self, tracker: Any, args: tuple, kwargs: dict) -> list[int]:
        a, shape_b, absmax = args[0], args[2], args[3]
        rows = a.numel() // a.shape[-1]
        if rows <= BNB_CUSTOM_KERNEL_MAX_ROWS:
            return []
        keys = []
        nested = kwargs.get("absmax_8bit", args[7] if len(args) > 7 else None)
        if nested is not None:
            n_blocks = nested.numel()
            keys.append(tracker.phantom_alloc(4 * n_blocks, "bnb.absmax_dq"))
            keys.append(tracker.phantom_alloc(4 * n_blocks, "bnb.absmax"))
        del absmax
        n, k = int(shape_b[0]), int(shape_b[1])
        keys.append(tracker.phantom_alloc(n * k * a.element_size(), "bnb.dequantized_weight"))
        return keys


@contextlib.contextmanager
def cuda_autocast_layer_norm() -> Any:
    """CUDA autocast runs ``layer_norm`` in fp32 (its fp32 op list): 16-bit inputs and
    weights are cast up and the output is fp32. CPU autocast, which a trace runs
    under, leaves it in 16 bits; inside the trace ``F.layer_norm`` does what CUDA does."""
    import torch.nn.functional as F

    original = F.layer_norm

    def layer_norm(input: torch.Tensor, normalized_shape: Any, weight: Any = None,
                   bias: Any = None, eps: float = 1e-5) -> torch.Tensor:
        device = input.device.type
        if input.dtype in (torch.bfloat16, torch.float16) and torch.is_autocast_enabled(device):
            def up(t: Any) -> Any:
                return t.float() if t is not None else None

            with torch.autocast(device, enabled=False):
                return original(input.float(), normalized_shape, up(weight), up(bias), eps)
        return original(input, normalized_shape, weight, bias, eps)

    F.layer_norm = layer_norm
    try:
        yield
    finally:
        F.layer_norm = original


@contextlib.contextmanager
def cuda_dropout() -> Any:
    """``F.dropout`` in training as on CUDA (aten ``dropout``: the fused ``native_dropout``
    whenever the input is on CUDA and 0 < p < 1), which keeps a 1-byte mask."""
    import torch.nn.functional as F

    original = F.dropout

    def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True,
                inplace: bool = False) -> torch.Tensor:
        if training and 0 < p < 1 and not inplace and input.numel():
            return torch.native_dropout(input, p, True)[0]
        return original(input, p, training, inplace)

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = original
