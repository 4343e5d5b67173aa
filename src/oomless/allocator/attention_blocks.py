"""Eager attention's (heads × s × s) temporaries, as blocks of the synthesized stream.

The layer's saved tensors (memory/activations.py) hold what autograd keeps of the
attention; what they leave out is the working set its code makes and drops within one
call, which only the allocator sees. Which tensors are alive together is a property of
the attention's code, so it is read per kernel:

- ``hf_eager``: transformers ``eager_attention_forward``; in the forward the 16-bit
  scores, their sum with the causal mask, and the fp32 copy ``softmax(...,
  dtype=torch.float32)`` makes of its input before it runs (aten SoftMax.cpp
  ``softmax``: ``input.toType(dtype)``), each consumed by the next; in the backward the
  probabilities' 16-bit gradient (matmul backward), its fp32 copy (``ToCopyBackward`` of
  ``softmax(..., dtype=torch.float32).to(dtype)``), the fp32 gradient of the scores
  (``_softmax_backward_data``) with the ``grad * output`` temporary CUDA's kernel makes
  next to it (SoftMax.cu ``softmax_backward_cuda_out``), its 16-bit cast and the
  scaling's gradient, each gradient freed once the next node has made its own.
- ``chatglm_core``: modeling_chatglm.py ``CoreAttention.forward`` (families.json
  ``own_attention``). The forward fills a new 16-bit tensor from ``baddbmm`` of a
  ``torch.empty`` 16-bit buffer (``beta=0``): both stay referenced by the locals
  ``matmul_input_buffer`` and ``matmul_result`` until the function returns. Meanwhile
  ``.float()`` makes an fp32 copy, ``* self.coeff`` a second (the copy is dropped once
  the product exists: a scalar multiply saves nothing), ``masked_fill`` a third (the mask
  is saved, not the scores; the product is dropped), which the local
  ``attention_scores`` keeps until the function returns, and ``softmax`` its fp32
  output, which autograd saves (in the layer's saved tensors), as it does the
  ``.type_as`` 16-bit probabilities for ``bmm``; ``attention_dropout`` with p = 0
  returns its input (aten Dropout.cpp). Before the return five score-sized tensors are
  alive: two 16-bit and one fp32 temporaries, two saved.
  The backward runs the chain in reverse, each gradient consumed by the next node:
  ``bmm``'s 16-bit gradient of the probabilities, its fp32 copy (``ToCopyBackward``),
  ``_softmax_backward_data``'s fp32 gradient, ``masked_fill``'s, the ``coeff``
  multiply's, and the 16-bit cast (``ToCopyBackward`` of ``.float()``) into
  ``baddbmm``'s backward (and the softmax backward's ``grad * output`` temporary, as
  above). Under gradient checkpointing the recomputation runs the same forward again.

SDPA and flash kernels have none of these.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.families import own_eager_attention
from ..models.spec import ModelSpec

KERNELS = ("hf_eager", "chatglm_core")


@dataclass(frozen=True)
class AttentionWork:
    """One layer's attention temporaries (bytes) in the synthesized stream's terms."""

    forward_chain: tuple[int, ...] = ()  # the front of the layer's chained forward work
    # region ops (oomless.allocator.synthetic Ops) run before the chain, in the forward
    # and in a checkpointed layer's recomputation
    forward_ops: tuple[int, ...] = ()
    backward_work: tuple[int, ...] = ()  # alive with the layer's backward work
    backward_ops: tuple[int, ...] = ()  # region ops run in the layer's backward


def eager_kernel(spec: ModelSpec) -> str:
    """The eager attention the model's code runs (a KERNELS name)."""
    return own_eager_attention(spec.model_type) or "hf_eager"


def attention_work(spec: ModelSpec, act_bytes: int, rows: int, seq_len: int,
                   attn: str) -> AttentionWork:
    """The layer's eager-attention temporaries; empty for SDPA and flash kernels."""
    if attn != "eager":
        return AttentionWork()
    n = rows * spec.num_heads * seq_len * seq_len
    half, full = act_bytes * n, 4 * n
    if eager_kernel(spec) == "chatglm_core":
        # buffer, result, .float(), * coeff (drop .float()), masked_fill (drop the
        # product); softmax's output and the probabilities are saved; return drops the
        # buffer, the result and masked_fill's output
        fwd = (half, half, full, full, -3, full, -4, -1, -2, -5)
        # each gradient is freed once the next node has made its own; CUDA's softmax
        # backward makes grad * output (key 4) after its output and drops it on return
        bwd = (half, full, -1, full, full, -4, -2, full, -3, full, -5, half, -6, -7)
        return AttentionWork(forward_ops=fwd, backward_ops=bwd)
    # the probabilities' 16-bit gradient, its fp32 copy, the softmax backward's output and
    # its grad * output temporary, the cast back to 16 bits, the scaling's gradient
    bwd = (half, full, -1, full, full, -4, -2, half, -3, half, -5, -6)
    return AttentionWork(forward_chain=(half, half, full), backward_ops=bwd)
