"""allocator/attention_blocks.py's ``chatglm_core`` working set is what ChatGLM's
CoreAttention allocates: the stand-in's op-by-op copy of modeling_chatglm.py
``CoreAttention.forward`` (tests/runtime/glm4v_shell.py), run forward and backward on
small real CPU tensors under the storage tracker (with the buffers CUDA kernels add,
runtime/trace/cuda_emulation.py), allocates and frees its (heads × s × s) tensors in the
order the synthesized stream's ops say, apart from the two autograd saves for the
backward (the layer's saved tensors hold those); transformers' eager attention does the
same in its backward."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import torch
from glm4v_shell import chatglm_core_attention

from oomless.allocator import ALLOC
from oomless.allocator.attention_blocks import attention_work, eager_kernel
from oomless.models.catalog import resolve_model
from oomless.runtime.trace.cuda_emulation import CudaEmulation
from oomless.runtime.trace.storage_tracker import StorageTracker

HEADS, SEQ, HEAD_DIM = 3, 8, 5  # q/k/v/context (120 elements) differ from scores (192)


def _score_events(tr: StorageTracker, start: int, stop: int, saved: set[int]) -> list:
    """(alloc bytes) or ('free', k-th score block) of the tracker's score-sized storages,
    as synthesized-stream ops: n > 0 allocates, -k frees the k-th block."""
    sizes = {2 * HEADS * SEQ * SEQ, 4 * HEADS * SEQ * SEQ}
    order: list[int] = []
    ops: list[int] = []
    for kind, key, _ in tr.events[start:stop]:
        if key in saved or tr.records[key].nbytes not in sizes:
            continue
        if kind == ALLOC:
            order.append(key)
            ops.append(tr.records[key].nbytes)
        elif key in order:
            ops.append(-(order.index(key) + 1))
    return ops


def test_chatglm_core_blocks_are_what_core_attention_allocates():
    spec = resolve_model("glm-4v-9b").spec
    assert eager_kernel(spec) == "chatglm_core"
    work = attention_work(replace(spec, num_heads=HEADS), 2, 1, SEQ, "eager")
    q, k, v = (torch.randn(1, HEADS if i == 0 else 1, SEQ, HEAD_DIM, dtype=torch.bfloat16,
                           requires_grad=True) for i in range(3))
    tr = StorageTracker(emulation=CudaEmulation())
    with tr:
        out, _ = chatglm_core_attention(SimpleNamespace(layer_idx=1), q, k, v, None)
        forward_end = len(tr.events)
        born = {key for kind, key, _ in tr.events if kind == ALLOC}
        out.sum().backward()
    dead = {key for kind, key, _ in tr.events if kind != ALLOC}
    alive_after_forward = {key for key in born if key not in
                           {k2 for kind, k2, _ in tr.events[:forward_end] if kind != ALLOC}}
    saved = {key for key in alive_after_forward
             if tr.records[key].nbytes in (2 * HEADS * SEQ * SEQ, 4 * HEADS * SEQ * SEQ)}
    assert len(saved) == 2 and saved <= dead  # softmax's output, the 16-bit probabilities
    assert tuple(_score_events(tr, 0, forward_end, saved)) == work.forward_ops
    assert tuple(_score_events(tr, forward_end, len(tr.events), born)) == work.backward_ops
    assert work.forward_chain == () and work.backward_work == ()


def test_other_families_keep_transformers_eager_chain():
    from transformers.models.llama.modeling_llama import eager_attention_forward

    spec = resolve_model("meta-llama/Llama-3.2-1B").spec
    assert eager_kernel(spec) == "hf_eager"
    n = spec.num_heads * 4 * 4
    work = attention_work(spec, 2, 1, 4, "eager")
    assert work.forward_chain == (2 * n, 2 * n, 4 * n) and work.forward_ops == ()
    assert work.backward_work == ()
    assert attention_work(spec, 2, 1, 4, "sdpa") == attention_work(spec, 2, 1, 4, "flash")
    # the backward's ops are what eager_attention_forward's backward allocates on CUDA
    work = attention_work(replace(spec, num_heads=HEADS), 2, 1, SEQ, "eager")
    q, k, v = (torch.randn(1, HEADS, SEQ, HEAD_DIM, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    mask = torch.zeros(1, 1, SEQ, SEQ, dtype=torch.bfloat16)
    module = SimpleNamespace(num_key_value_groups=1, training=True)
    tr = StorageTracker(emulation=CudaEmulation())
    with tr:
        out, _ = eager_attention_forward(module, q, k, v, mask, scaling=HEAD_DIM ** -0.5)
        forward_end = len(tr.events)
        out.sum().backward()
    freed = {key for kind, key, _ in tr.events[:forward_end] if kind != ALLOC}
    saved = {key for kind, key, _ in tr.events[:forward_end] if kind == ALLOC and key not in freed}
    assert tuple(_score_events(tr, forward_end, len(tr.events), saved)) == work.backward_ops
