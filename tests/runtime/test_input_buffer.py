"""The autograd engine sums a tensor's gradients in place; the tracker accounts them so.

torch/csrc/autograd/input_buffer.cpp ``accumulate``: ``old_var.add_(var)`` when the
buffer holds the only reference to a plain dense ``old_var`` — but never while a Python
dispatch mode is on or for a FakeTensor (at::isTensorSubclassLike), so the tracker
(a dispatch mode) sees ``old_var + var`` and must account it as the engine runs it
without one (oomless.runtime.trace.input_buffer). The engine's own choice is read with
torch.profiler (memory per op, no dispatch mode).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from oomless.allocator import ALLOC
from oomless.runtime.trace.storage_tracker import StorageTracker

V, H = 1000, 16  # a vocab × hidden fp32 block: 64,000 bytes


def _tied_autocast(weight: torch.Tensor) -> torch.Tensor:
    """A tied embedding with fp32 master weights under bf16 autocast (HF Trainer's full
    fine-tuning): lm_head's gradient reaches the weight through the cast's backward."""
    ids = torch.arange(8).reshape(2, 4) * 100
    h = torch.nn.functional.embedding(ids, weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = torch.nn.functional.linear(h, weight)
    return logits.float().logsumexp(-1).mean()


def _tied_fp32(weight: torch.Tensor) -> torch.Tensor:
    """The same in fp32: lm_head's gradient is a transposed view whose storage another
    tensor still shares when the embedding's arrives, so the engine adds out of place."""
    ids = torch.arange(8).reshape(2, 4) * 100
    h = torch.nn.functional.embedding(ids, weight)
    return torch.nn.functional.linear(h, weight).logsumexp(-1).mean()


def _same_gradient_twice(weight: torch.Tensor) -> torch.Tensor:
    """y + y: AddBackward0 hands one gradient to both inputs; the buffer is not its only
    holder."""
    y = weight.exp()
    return (y + y).sum()


CASES = {"tied-autocast": _tied_autocast, "tied-fp32": _tied_fp32,
         "same-gradient-twice": _same_gradient_twice}


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _engine_sums_out_of_place(loss_fn: Callable[[torch.Tensor], torch.Tensor],
                              mode: bool = False) -> int:
    """How many vocab-sized sums the engine allocates in backward (torch.profiler)."""
    weight = torch.randn(V, H, requires_grad=True)
    loss = loss_fn(weight)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, \
            _Passthrough() if mode else contextlib.nullcontext():
        loss.backward()
    return sum(1 for e in prof.events()
               if e.name == "aten::add" and e.self_cpu_memory_usage == V * H * 4)


def _tracked_sums(loss_fn: Callable[[torch.Tensor], torch.Tensor], fake: bool) -> int:
    tracker = StorageTracker()
    with FakeTensorMode() if fake else contextlib.nullcontext(), tracker:
        weight = torch.randn(V, H, requires_grad=True)
        loss = loss_fn(weight)
        tracker.start_phase("backward", 0)
        loss.backward()
    return sum(1 for (kind, key, n), phase in zip(tracker.events, tracker.event_phase, strict=True)
               if kind == ALLOC and n == V * H * 4 and tracker.records[key].op == "add.Tensor"
               and tracker.phases[phase][0] == "backward")


def test_a_dispatch_mode_turns_the_engines_in_place_sum_off():
    assert _engine_sums_out_of_place(_tied_autocast) == 0
    assert _engine_sums_out_of_place(_tied_autocast, mode=True) == 1


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("fake", [False, True])
def test_tracker_allocates_the_sums_the_engine_allocates(case, fake):
    assert _tracked_sums(CASES[case], fake) == _engine_sums_out_of_place(CASES[case])


def test_the_engines_own_choice_in_each_case():
    # tied under autocast: lm_head's cast gradient, then the embedding's dense gradient
    # added into it, no third block; the other two cases are summed out of place
    assert _engine_sums_out_of_place(_tied_autocast) == 0
    assert _engine_sums_out_of_place(_tied_fp32) == 1
    assert _engine_sums_out_of_place(_same_gradient_twice) == 1


def test_a_traced_tied_llama_backward_allocates_one_embedding_gradient_block():
    """Full fine-tuning of a tied Llama traced on fake tensors (fp32 weights, bf16
    autocast): per backward, lm_head's fp32 weight gradient and the embedding's dense
    gradient — the engine adds the second into the first, no vocab × hidden sum."""
    from oomless.allocator import AllocatorConfig
    from oomless.config import RunConfig
    from oomless.models.hf_config import buildable_hf_config
    from oomless.runtime.trace.fake import trace_once

    vocab, hidden = 1000, 96  # no other backward tensor has 4 · 1000 · 96 bytes
    config = dict(model_type="llama", hidden_size=hidden, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=vocab, max_position_embeddings=512, tie_word_embeddings=True)
    cfg = RunConfig(model="tiny", method="full", precision="bf16", seq_len=64,
                    micro_batch_size=2)
    stats = trace_once(buildable_hf_config(config), cfg, None, 2, AllocatorConfig())
    stream = stats.stream
    blocks = [stream.phases[phase] for (kind, key, n), phase
              in zip(stream.events, stream.event_phase, strict=True)
              if kind == ALLOC and n == 4 * vocab * hidden
              and stream.phases[phase][0] == "backward"]
    assert blocks == [("backward", 0)] * 2 + [("backward", 1)] * 2
