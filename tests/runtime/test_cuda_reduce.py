"""oomless.runtime.trace.cuda_reduce: the staging buffer of CUDA's reduction kernel.

The expected sizes are the (staging, semaphores) pairs the caching allocator logged on an
NVIDIA H200 (torch 2.11; benchmarks/results/gpu_streams/*.json.gz) for the weight
gradients of norms and biases: a sum over every token of each of the weight's entries.
"""

from __future__ import annotations

import pytest
import torch

from oomless.runtime.trace.cuda_emulation import CudaEmulation
from oomless.runtime.trace.cuda_reduce import staging_bytes
from oomless.runtime.trace.storage_tracker import StorageTracker

MiB = 2**20


@pytest.mark.parametrize(("width", "tokens", "staging", "semaphores", "stream"), [
    (2304, 2048, 36 * MiB, 72, "gemma-2-2b-full-2x1024"),  # Gemma-2-2B's norms
    (2048, 2048, 32 * MiB, 64, "llama-3.2-1b-full-1x2048"),
    (896, 2048, 14 * MiB, 28, "qwen2.5-0.5b-full-1x2048-ckpt"),  # norms and q bias
    (128, 2048, 2 * MiB, 4, "qwen2.5-0.5b-full-1x2048-ckpt"),  # k/v biases
    (3584, 1024, 28 * MiB, 112, "qwen2.5-7b-full-1x1024-ckpt"),
    (512, 1024, 4 * MiB, 16, "qwen2.5-7b-full-1x1024-ckpt"),
])
def test_a_weight_gradient_sum_stages_what_the_gpu_logged(width, tokens, staging,
                                                          semaphores, stream):
    shape = (1, tokens, width)
    assert staging_bytes(shape, (tokens * width, width, 1), [0, 1]) == (staging, semaphores)


def test_small_reductions_need_no_global_staging():
    assert staging_bytes((64, 32), (32, 1), [0]) == (0, 0)
    assert staging_bytes((4, 128), (128, 1), [1]) == (0, 0)


def test_the_tracker_gets_the_buffers_after_the_sum_s_output():
    w = torch.ones(2304, requires_grad=True)
    x = torch.randn(1, 2048, 2304)
    y = x * (1.0 + w)
    tr = StorageTracker(emulation=CudaEmulation())
    with tr:
        y.sum().backward()
    ops = [tr.records[k].op for kind, k, _ in tr.events if kind == "alloc"]
    at = ops.index("reduce.staging", ops.index("sum.dim_IntList"))
    assert ops[at - 1] == "sum.dim_IntList" and ops[at + 1] == "reduce.semaphores"
    sizes = {tr.records[k].nbytes for kind, k, _ in tr.events
             if kind == "alloc" and tr.records[k].op == "reduce.staging"}
    assert 36 * MiB in sizes
