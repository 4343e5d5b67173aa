"""Memory that CUDA kernels allocate where the CPU/fake kernels of a trace do not.

A trace runs on CPU fake tensors, so it sees the tensors each op *returns*
but not the buffers a CUDA kernel allocates through the caching allocator for
itself. ``CudaEmulation.before`` is called by the tracker before each op (and
``after`` once its outputs exist) and allocates those buffers as phantom storages
(freed right after the op, or kept, for workspaces), with the sizes the CUDA code
uses:

- cuBLAS/cuBLASLt workspaces (aten/src/ATen/cuda/CublasHandlePool.cpp):
  one per (handle, stream), allocated by the caching allocator when the first
  matmul takes its handle (after the op's output exists) and kept:
  ``CUBLAS_WORKSPACE_CONFIG`` default :4096:8 = 32 MiB on
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
- softmax backward (aten/src/ATen/native/cuda/SoftMax.cu, ``softmax_backward_cuda_out``):
  ``Tensor tmp = grad * output;`` before the kernel, a gradient-sized temporary made
  after the op's output (a structured kernel's output is allocated first) and dropped
  when it returns; ``after`` makes it. The log-softmax backward has none.
- ``_foreach_norm`` (aten/src/ATen/native/cuda/ForeachReduceOp.cu,
  ``foreach_tensor_norm_cuda``): ``output_per_tensor``, an opmath-typed buffer of
  (tensors × the most 65,536-element chunks of any one tensor) elements made before the
  per-tensor results and dropped on return; ``cuda_foreach`` lets fake tensors take
  the foreach path real CUDA tensors take (gradient clipping's norms).
- reductions (``sum``, ``mean``; aten/src/ATen/native/cuda/Reduce.cuh): the staging
  buffer and semaphores of a reduction split over several blocks per output, after the
  output (oomless.runtime.trace.cuda_reduce).

``cuda_autocast_policies`` runs the ops CUDA autocast puts in fp32 (pow, exp, LayerNorm,
softmax and sum without a dtype, ...) as CUDA does where CPU autocast does not; ``cuda_dropout`` makes training
dropout the fused ``native_dropout`` kernel CUDA runs (a boolean mask kept for
backward; the CPU path multiplies by a mask of the input's dtype);
``cuda_autocast_state`` answers the question "is autocast on?" asked of the CUDA device
(``torch.is_autocast_enabled()`` without a device means CUDA) with the state of the CPU
autocast that stands for it, as the run on the GPU answers it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from ...units import MiB
from .cuda_reduce import reduction_buffers

CUBLAS_WORKSPACE_SM90_BYTES = 4096 * 8 * 1024  # :4096:8 default on Hopper
CUBLAS_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8  # :4096:2:16:8 default elsewhere
CUBLASLT_WORKSPACE_BYTES = 1 * MiB  # CUBLASLT_WORKSPACE_SIZE default 1024 KiB
BNB_CUSTOM_KERNEL_MAX_ROWS = 4  # _GEMM_4BIT_CUSTOM_FLOOR_M: always the custom kernel
FOREACH_CHUNK_ELEMENTS = 65536  # MultiTensorApply.cuh kChunkSize


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
        name = func.name()
        if name == "aten::_scaled_dot_product_flash_attention_for_cpu_backward":
            return self._flash_backward(tracker, args)
        if name == "bitsandbytes::gemm_4bit":
            return self._bnb_gemm_4bit(tracker, args, kwargs)
        if name.startswith("aten::_foreach_norm") and args[0]:
            return self._foreach_norm(tracker, args[0])
        return []

    def after(self, tracker: Any, func: Any, args: tuple, kwargs: dict) -> list[int]:
        """Buffers the CUDA op allocates after its outputs; the keys to free after it."""
        if func in self._matmuls:  # the handle's workspace, once its output exists
            self._workspace(tracker)
            return []
        if func.name() == "aten::_softmax_backward_data":
            grad, output = args[0], args[1]
            size = grad.numel() * torch.finfo(torch.result_type(grad, output)).bits // 8
            return [tracker.phantom_alloc(size, "softmax_bwd.grad_times_output")]
        staging, semaphores = reduction_buffers(func, args, kwargs)
        if staging:
            return [tracker.phantom_alloc(staging, "reduce.staging"),
                    tracker.phantom_alloc(semaphores, "reduce.semaphores")]
        return []

    def _workspace(self, tracker: Any) -> None:
        thread = "autograd" if tracker.phase == "backward" else "main"
        if thread in self._threads_with_workspace:
            return
        self._threads_with_workspace.add(thread)
        from .storage_tracker import WORKSPACE

        tracker.phantom_alloc(self.cublas_bytes, f"cublas_workspace[{thread}]", WORKSPACE)
        tracker.phantom_alloc(self.cublaslt_bytes, f"cublaslt_workspace[{thread}]", WORKSPACE)

    def _foreach_norm(self, tracker: Any, tensors: list) -> list[int]:
        chunks = max(-(-t.numel() // FOREACH_CHUNK_ELEMENTS) for t in tensors)
        opmath = 8 if tensors[0].dtype == torch.float64 else 4
        key = tracker.phantom_alloc(opmath * len(tensors) * chunks,
                                    "foreach_norm.output_per_tensor")
        # a slot per tensor: a deeper model's layers add theirs (trace/expansion.py)
        tracker.records[key].grows = [(tracker.owner_of(t), 1) for t in tensors]
        return [key]

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


# CUDA autocast's cast policies (PyTorch aten/src/ATen/autocast_mode.h: AT_FORALL_FP32,
# AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE; registered for
# CUDA by TORCH_LIBRARY_IMPL(aten, Autocast, m) in autocast_mode.cpp), less the ops CPU
# autocast already runs in fp32 (CPU_AUTOCAST_FP32_OPS): the ops a trace, which runs under
# CPU autocast, must run as CUDA does. "fp32": floating 16-bit tensor arguments are cast
# to fp32 and the op runs with autocast off; "fp32_set_opt_dtype": when the first argument
# is an eligible floating tensor and no dtype is passed, the op runs with dtype=float32;
# "fp32_append_dtype": norm runs as its dtype overload with dtype=float32.
CUDA_AUTOCAST_OPS: dict[str, str] = {
    **{op: "fp32" for op in (
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
        "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
        "pow.Scalar", "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm",
        "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
        "dist", "pdist", "renorm", "logsumexp",
        "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
        "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
        "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
        "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa")},
    **{op: "fp32_set_opt_dtype" for op in (
        "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
        "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList")},
    "norm.Scalar": "fp32_append_dtype",
    "norm.ScalarOpt_dim": "fp32_append_dtype",
}
# In CUDA's lists and already fp32 under CPU autocast (TORCH_LIBRARY_IMPL(aten,
# AutocastCPU, m) in autocast_mode.cpp): the trace runs them as CUDA does without help.
CPU_AUTOCAST_FP32_OPS = frozenset({
    "prod", "prod.dim_int", "cdist", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
    "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss",
    "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits"})
_APPEND_DTYPE_TARGET = {"norm.Scalar": "ScalarOpt_dtype", "norm.ScalarOpt_dim": "ScalarOpt_dim_dtype"}


def aten_overload(name: str) -> Any:
    """``torch.ops.aten`` overload of a table row ("pow.Tensor_Scalar", "exp"); None where
    this torch has no such op (an older release: its CUDA list lacks it too)."""
    op, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, op, None), overload or "default", None)


def _eligible(t: Any) -> bool:
    """autocast_mode.h is_eligible: a floating tensor on the device, not double."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 \
        and t.device.type == "cpu"


def _to_fp32(arg: Any) -> Any:
    if isinstance(arg, (list, tuple)):
        return type(arg)(_to_fp32(a) for a in arg)
    return arg.to(torch.float32) if _eligible(arg) and arg.dtype != torch.float32 else arg


def _named(op: Any, args: tuple, kwargs: dict) -> dict:
    """All of ``op``'s arguments by name: the dispatcher leaves out trailing defaults."""
    named = {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(args):
            named[a.name] = args[i]
        elif a.name in kwargs or a.has_default_value():
            named[a.name] = kwargs.get(a.name, a.default_value)
    return named


def _autocast_kernel(name: str, policy: str) -> Any:
    op = aten_overload(name)
    target = getattr(torch.ops.aten.norm, _APPEND_DTYPE_TARGET[name]) \
        if policy == "fp32_append_dtype" else None
    dtype_at = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)
    no_autocast = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(no_autocast):
            if policy == "fp32":  # cached_cast(at::kFloat, args)...
                return op(*_to_fp32(args), **{k: _to_fp32(v) for k, v in kwargs.items()})
            if policy == "fp32_append_dtype":  # type_from_firstarg(at::kFloat, args)
                dtype = torch.float32 if _eligible(args[0]) else args[0].dtype
                return target(**_named(op, args, kwargs), dtype=dtype)
            if _eligible(args[0]):  # firstarg_is_eligible: set_opt_dtype(at::kFloat, ...)
                if dtype_at is not None and dtype_at < len(args):
                    if args[dtype_at] is None:
                        args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1:])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)

    return kernel


@contextlib.contextmanager
def cuda_autocast_policies() -> Any:
    """Run CUDA_AUTOCAST_OPS under CPU autocast as CUDA autocast runs them: kernels for the
    AutocastCPU dispatch key, the key CUDA's policies sit on (above autograd, so the casts
    are recorded and saved for backward as on CUDA), for every entry point (torch.X,
    Tensor.X, ``**``, torch.nn.functional) and the calls inside composite ops. Only while
    the context is open, and only where CPU autocast is on (the key is skipped otherwise)."""
    if _POLICIES_OPEN:  # nested (a trace inside a trace): the outer kernels stand
        yield
        return
    lib = torch.library.Library("aten", "IMPL")
    _POLICIES_OPEN.append(lib)
    try:
        for name, policy in CUDA_AUTOCAST_OPS.items():
            if aten_overload(name) is not None:
                lib.impl(name, _autocast_kernel(name, policy), "AutocastCPU")
        yield
    finally:
        _POLICIES_OPEN.pop()
        lib._destroy()


_POLICIES_OPEN: list[Any] = []


@contextlib.contextmanager
def cuda_foreach() -> Any:
    """torch.utils._foreach_utils ``_has_foreach_support`` as for CUDA tensors: fake
    tensors are not of a type in ``_foreach_supported_types``, so code that picks the
    foreach path for tensors on CUDA (``clip_grad_norm_``'s ``_foreach_norm`` and
    ``_foreach_mul_``) would take the per-tensor loop in a trace."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils import _foreach_utils

    types = _foreach_utils._foreach_supported_types
    added = FakeTensor not in types
    if added:
        types.append(FakeTensor)
    try:
        yield
    finally:
        if added:
            types.remove(FakeTensor)


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


@contextlib.contextmanager
def cuda_autocast_state() -> Any:
    """``torch.is_autocast_enabled()`` as on the GPU, where the forward runs under CUDA
    autocast: the call without a device (or with "cuda") asks about CUDA autocast
    (torch/csrc/autograd/init.cpp ``is_autocast_enabled``: no device_type means
    at::kCUDA), which a trace's CPU autocast stands for, so it answers the CPU state.

    Code branches on it: PEFT's LoRA layers over quantized modules (peft/tuners/lora/
    bnb.py ``Linear4bit.forward``, ``Linear8bitLt.forward``; awq.py, aqlm.py, eetq.py,
    hqq.py alike: ``requires_conversion = not torch.is_autocast_enabled()``) cast the
    input to the adapters' dtype only without autocast. Asked on CPU the answer is False: each
    adapter casts the 16-bit input to fp32 and lora_A's autocast casts it back, a new
    16-bit copy that lora_A's matmul keeps for backward, one per adapted linear. On the
    GPU autocast is on, the input passes uncast and lora_A keeps the input itself."""
    original = torch.is_autocast_enabled

    def is_autocast_enabled(device_type: str | None = None) -> bool:
        return original("cpu" if device_type in (None, "cuda") else device_type)

    torch.is_autocast_enabled = is_autocast_enabled  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.is_autocast_enabled = original  # type: ignore[assignment]
