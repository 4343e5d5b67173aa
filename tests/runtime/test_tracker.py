"""The dispatch-level storage tracker and the CUDA emulation, on real CPU tensors."""

from __future__ import annotations

import torch

from oomless.allocator import ALLOC, FREE
from oomless.runtime.trace.cuda_emulation import (
    CUBLAS_WORKSPACE_BYTES,
    CUBLAS_WORKSPACE_SM90_BYTES,
    CUBLASLT_WORKSPACE_BYTES,
    CudaEmulation,
    cublas_workspace_bytes,
)
from oomless.runtime.trace.storage_tracker import (
    ACTIVATIONS,
    GRADIENTS,
    TEMPORARIES,
    WEIGHTS,
    WORKSPACE,
    ModuleStack,
    StorageTracker,
)


def _allocs(tr: StorageTracker) -> list[int]:
    return [tr.records[k].nbytes for kind, k, _ in tr.events if kind == ALLOC]


def test_allocations_and_releases_are_recorded_once_per_storage():
    tr = StorageTracker()
    with tr:
        x = torch.empty(1000)  # 4000 bytes
        v = x.view(10, 100)  # a view: same storage, no allocation
        x.add_(1)  # in place: no allocation
        y = x * 2
        del x, v  # storage dies only when the last view goes
        z = torch.zeros(3, dtype=torch.float16)
        del y
    assert _allocs(tr) == [4000, 4000, 6]
    kinds = [(kind, tr.records[k].nbytes) for kind, k, _ in tr.events]
    assert kinds == [(ALLOC, 4000), (ALLOC, 4000), (FREE, 4000), (ALLOC, 6), (FREE, 4000)]
    assert tr.live_bytes == 512  # z, rounded to the allocator's 512-byte granularity
    del z


def test_resized_storage_counts_as_a_new_allocation():
    tr = StorageTracker()
    with tr:
        out = torch.empty(0)
        torch.add(torch.ones(10), 1, out=out)  # resizes `out` to 10 floats
    sizes = [tr.records[k].nbytes for kind, k, _ in tr.events]
    assert 40 in sizes
    assert tr.live_bytes == 512  # the resized `out` (the ones() input died)


def test_categories_are_decided_with_hindsight():
    tr = StorageTracker()
    tr.start_phase("forward", 0)
    with tr:
        saved = torch.ones(100)
        temp = torch.ones(100) + 1
        del temp
        tr.start_phase("backward", 0)
        grad = torch.ones(100)
        tr.categorize([grad], GRADIENTS)
        scratch = torch.ones(7)
    cats = [tr.final_category(r) for r in tr.records.values()]
    assert cats.count(ACTIVATIONS) == 1  # born in forward, alive after it
    assert GRADIENTS in cats
    assert cats.count(TEMPORARIES) >= 3  # temp, its ones() input, scratch
    del saved, grad, scratch


def test_module_stack_follows_forward_and_backward():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    seen: list[tuple[str, bool]] = []
    stack = ModuleStack(model, on_enter=lambda n, b: seen.append((n, b)))
    with stack:
        model(torch.ones(3, 4, requires_grad=True)).sum().backward()
    assert seen[:3] == [("0", False), ("1", False), ("2", False)]
    assert [n for n, b in seen if b] == ["2", "1", "0"]  # backward runs in reverse


def test_module_peaks_are_what_each_module_adds():
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    tr = StorageTracker()
    for p in model.parameters():  # existing storages are known before the step
        tr.track(p, "parameter", WEIGHTS)
    tr.modules = ModuleStack(model)
    tr.start_phase("forward", 0)
    with tr, tr.modules:
        out = model(torch.ones(32, 64))
    assert tr.module_peaks["0"] == [32 * 256 * 4, 0]  # its output; the weight view is free
    assert tr.module_peaks["1"] == [32 * 64 * 4, 0]
    del out


def test_cublas_workspaces_per_thread():
    assert cublas_workspace_bytes("9.0") == CUBLAS_WORKSPACE_SM90_BYTES == 32 * 2**20
    assert cublas_workspace_bytes("8.0") == CUBLAS_WORKSPACE_BYTES == 8 * 2**20 + 128 * 1024
    tr = StorageTracker(emulation=CudaEmulation())
    a = torch.ones(8, 8, requires_grad=True)
    tr.start_phase("forward", 0)
    with tr:
        y = (a @ a) @ a  # two matmuls, one forward workspace pair
        tr.start_phase("backward", 0)
        y.sum().backward()  # the autograd thread gets its own pair
    ws = [r.nbytes for r in tr.records.values() if r.category == WORKSPACE]
    pair = [CUBLAS_WORKSPACE_BYTES, CUBLASLT_WORKSPACE_BYTES]
    assert ws == pair + pair


def test_flash_attention_backward_buffers_gqa():
    # b=1, h=8, s=100, d=64, 2 kv heads: hand-computed from flash_api.cpp mha_bwd
    q = torch.randn(1, 8, 100, 64, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, 100, 64, dtype=torch.bfloat16, requires_grad=True)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True,
                                                           enable_gqa=True)
    tr = StorageTracker(emulation=CudaEmulation())
    tr.start_phase("backward", 0)
    with tr:
        out.sum().backward()
    phantom = {r.op: r.nbytes for r in tr.records.values() if r.op.startswith("flash_bwd")}
    assert phantom == {
        "flash_bwd.softmax_d": 4 * 1 * 8 * 128,  # fp32 [b, h, round128(s)]
        "flash_bwd.dq_accum": 4 * 1 * 128 * 8 * 64,  # fp32 [b, round128(s), h, round32(d)]
        "flash_bwd.dk_expanded": 2 * 1 * 100 * 8 * 64,  # [b, s_k, h, d] before the group sum
        "flash_bwd.dv_expanded": 2 * 1 * 100 * 8 * 64,
    }
    keys = {k for k, r in tr.records.items() if r.op.startswith("flash_bwd")}
    assert all(any(kind == FREE and key == k for kind, key, _ in tr.events) for k in keys)


def test_softmax_backward_makes_grad_times_output_after_its_output():
    # SoftMax.cu softmax_backward_cuda_out: tmp = grad * output once grad_input exists;
    # log_softmax's backward has no such temporary
    x = torch.randn(2, 4, 8, 8, dtype=torch.bfloat16, requires_grad=True)
    p = torch.softmax(x, -1, dtype=torch.float32)
    lp = torch.log_softmax(x.float(), -1)
    tr = StorageTracker(emulation=CudaEmulation())
    tr.start_phase("backward", 0)
    with tr:
        (p.sum() + lp.sum()).backward()
    ops = [tr.records[k].op for kind, k, _ in tr.events if kind == ALLOC]
    tmp = ops.index("softmax_bwd.grad_times_output")
    assert ops[tmp - 1] == "_softmax_backward_data.default"
    assert tr.records[next(k for k, r in tr.records.items()
                           if r.op == "softmax_bwd.grad_times_output")].nbytes == 4 * 2 * 4 * 8 * 8
    assert ops.count("softmax_bwd.grad_times_output") == 1


def test_foreach_norm_takes_its_chunk_buffer_sized_for_every_tensor():
    # ForeachReduceOp.cu: zeros(ntensors x the most 65,536-element chunks), fp32 opmath;
    # here 3 tensors, the largest 200,000 elements: 4 chunks
    from oomless.runtime.trace.cuda_emulation import cuda_foreach

    grads = [torch.ones(200_000), torch.ones(10), torch.ones(70_000)]
    tr = StorageTracker(emulation=CudaEmulation())
    with tr:
        norms = torch._foreach_norm(grads, 2.0)
    assert len(norms) == 3
    buf = [r for r in tr.records.values() if r.op == "foreach_norm.output_per_tensor"]
    assert [r.nbytes for r in buf] == [4 * 3 * 4]
    assert [n for _, n in buf[0].grows] == [1, 1, 1]  # a deeper model's tensors add slots
    with cuda_foreach():  # fake tensors take the foreach path, as CUDA tensors do
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.utils._foreach_utils import _has_foreach_support

        with FakeTensorMode():
            fake = [torch.ones(4)]
            assert _has_foreach_support(fake, fake[0].device)


def test_the_cublas_workspace_follows_the_first_matmul_s_output():
    # CublasHandlePool.cpp: the handle (and its workspace) is taken inside the matmul,
    # after the structured op has allocated its output
    tr = StorageTracker(emulation=CudaEmulation())
    a = torch.ones(64, 64)
    with tr:
        a @ a
    ops = [tr.records[k].op for kind, k, _ in tr.events if kind == ALLOC]
    assert ops[0] == "mm.default" and ops[1].startswith("cublas_workspace")
