"""The staging buffer of CUDA's reduction kernel, which a CPU trace does not see.

PyTorch's reductions (``sum``, ``mean``, ...) run ``gpu_reduce_kernel``
(aten/src/ATen/native/cuda/Reduce.cuh). ``setReduceConfig`` lays the reduction out over
thread blocks; when the work per output is large and the outputs few, it splits each
output's inputs over ``ctas_per_output`` blocks, which then combine through global
memory: the kernel takes ``global_memory_size()`` bytes and a ``semaphore_size()``
buffer from the caching allocator, after the op's output exists, and gives them back
when it returns. The gradient of a norm's or a bias's weight is such a reduction (a sum
over every token for each of its ``h`` entries): for ``h`` = 2,304 and 2,048 tokens the
staging buffer is 36 MiB (Gemma-2-2B's four norms per layer on an H200).

``staging_bytes`` follows setReduceConfig for a TensorIterator over one contiguous
input, with these constants of Reduce.cuh: ``MAX_NUM_THREADS`` 512, ``vt0`` and
``input_vec_size`` 4, 16 and 256 values per thread at least and at most, an fp32
accumulator (fp64 for double). One device property enters: the split is the smaller of
(the GPU's resident blocks / the grid) and (values per thread / 16); oomless takes the
second, which binds on data-centre GPUs (2,112 resident blocks of 128 threads on an
H100 or H200, 1,728 on an A100) unless a reduction has hundreds of thousands of
outputs.
"""

from __future__ import annotations

import math
from typing import Any

MAX_NUM_THREADS = 512  # mnt_wrapper<scalar_t>::MAX_NUM_THREADS (not complex double)
VT0 = 4  # gpu_reduce_kernel's default vt0, and ReduceConfig::input_vec_size
WARP_SIZE = 32
MIN_VALUES_PER_THREAD = 16
MAX_VALUES_PER_THREAD = 256
REDUCTIONS = ("aten::sum", "aten::mean")  # ops whose CUDA kernel is gpu_reduce_kernel


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _last_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _iter_dims(shape: tuple[int, ...], strides: tuple[int, ...],
               reduced: set[int]) -> list[tuple[int, int, bool]]:
    """TensorIterator's dimensions, innermost first: (size, input stride in elements,
    reduced?); reduced dimensions first (reorder_dimensions moves them to the front),
    each group by input stride, adjacent ones coalesced where the strides allow."""
    dims = [(size, stride, i in reduced) for i, (size, stride) in enumerate(zip(shape, strides,
                                                                              strict=True))
            if size != 1]
    dims.sort(key=lambda d: (not d[2], d[1]))
    out: list[tuple[int, int, bool]] = []
    for size, stride, red in dims:
        if out and out[-1][2] == red and out[-1][1] * out[-1][0] == stride:
            prev = out.pop()
            out.append((prev[0] * size, prev[1], red))
        else:
            out.append((size, stride, red))
    return out


def _output_vec(it: list[tuple[int, int, bool]], n_reduce: int) -> int:
    """get_output_vec_size: 4, halved until the first kept dimension and every other
    stride divide by it (the data pointer taken as aligned)."""
    vec = 4
    while vec > 1 and (it[n_reduce][0] % vec
                       or any(s % vec for k, (_, s, _) in enumerate(it) if k != n_reduce)):
        vec //= 2
    return vec


def _block(dim0: int, dim1: int, out_vec: int) -> tuple[int, int]:
    """ReduceConfig::set_block_dimension: (block width, block height)."""
    max_threads = MAX_NUM_THREADS // out_vec
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    width = min(dim0_pow2, WARP_SIZE)
    height = min(dim1_pow2, max_threads // width)
    return min(dim0_pow2, max_threads // height), height


def staging_bytes(shape: tuple[int, ...], strides: tuple[int, ...], dims: list[int],
                  accumulator_bytes: int = 4) -> tuple[int, int]:
    """(global staging buffer, semaphores) bytes gpu_reduce_kernel allocates to reduce a
    tensor of ``shape``/``strides`` (elements) over ``dims``; (0, 0) without a global
    reduction."""
    it = _iter_dims(tuple(shape), tuple(strides), {d % len(shape) for d in dims} if shape
                    else set())
    numel = math.prod(shape)
    num_outputs = math.prod(size for size, _, red in it if not red)
    if numel == 0 or not it:
        return 0, 0
    inputs = numel // num_outputs
    n_reduce = sum(1 for d in it if d[2])
    on_fastest = n_reduce == len(it) or it[0][1] < it[n_reduce][1]
    dim0, dim1 = (inputs, num_outputs) if on_fastest else (num_outputs, inputs)
    out_vec = 1
    if (it[0][1] if on_fastest else it[n_reduce][1]) == 1:  # the fastest stride: unit
        if on_fastest and dim0 > 128 and n_reduce == 1:
            dim0 //= VT0  # vectorize along the input
        elif not on_fastest:
            out_vec = _output_vec(it, n_reduce)
            dim0 //= out_vec
    width, height = _block(dim0, dim1, out_vec)
    # input_mult[0] (block_x_reduce) or output_mult[0]
    step_input, step_output = (width, 1) if on_fastest else (1, width)
    across_warps = _div_up(inputs, step_input) >= min(height * 16, MAX_VALUES_PER_THREAD)
    if across_warps:
        step_input *= height
    else:
        step_output *= height
    values = _div_up(inputs, step_input)
    if not (across_warps and values >= MAX_VALUES_PER_THREAD):
        return 0, 0
    # min(resident blocks / grid, values / 16), the first taken as unbounded (see above)
    ctas = _div_up(values, MIN_VALUES_PER_THREAD)
    size = accumulator_bytes * num_outputs * ctas
    if not on_fastest:  # no block_x_reduce: a slot per thread of the block's width
        size *= width * out_vec
    return size, 4 * _div_up(num_outputs // out_vec, step_output)


def reduction_buffers(func: Any, args: tuple, kwargs: dict) -> tuple[int, int]:
    """The staging buffers of a ``sum``/``mean`` op call on a tensor ((0, 0) otherwise)."""
    import torch

    if not func.name().startswith(REDUCTIONS):
        return 0, 0
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return 0, 0
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    dims = list(range(x.dim())) if dim in (None, []) else (
        [dim] if isinstance(dim, int) else list(dim))
    acc = 8 if x.dtype == torch.float64 else 4
    return staging_bytes(tuple(x.shape), tuple(x.stride()), dims, acc)
