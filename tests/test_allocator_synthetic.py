"""oomless.allocator.synthetic: a training run's stream laid out from block sizes."""

from __future__ import annotations

import pytest

from oomless.allocator.replay import ALLOC, FREE
from oomless.allocator.synthetic import TrainingBlocks, replayed_peaks, training_events

MiB = 2**20


def _run(**kw) -> TrainingBlocks:
    base = dict(weights=(100 * MiB, 100 * MiB), persistent=(), grads=(100 * MiB, 100 * MiB),
                grad_casts=(0, 0), layer_grads=((0, 2),), head_grads=(2, 2),
                embed_grads=(2, 2), states=(100 * MiB, 100 * MiB), state_count=2, layers=1,
                layer_saved=(50 * MiB,), layer_input=0, forward_work=(), backward_work=(),
                loss_forward=(300 * MiB,), loss_backward=(-1,))
    return TrainingBlocks(**{**base, **kw})


def test_the_second_steps_loss_takes_a_fresh_segment_by_hand():
    # Step 1: the 300 MiB loss block has no cached block that fits: a segment of its own.
    # Freed, it takes both 100 MiB gradients and the first optimizer state; the other
    # three states get segments of their own. zero_grad frees the gradients (200 MiB
    # cached), so step 2's loss block needs a second 300 MiB segment:
    # reserved 200 + 50 + 300 + 3·100 + 300 = 1150 MiB; allocated peaks in step 2's
    # loss: weights 200 + states 400 + saved 50 + loss 300 = 950 MiB.
    assert replayed_peaks(_run()) == (950 * MiB, 1150 * MiB)
    # one step only: the first step's states are the peak (200 + 200 + 400), 850 reserved
    assert replayed_peaks(_run(), steps=1) == (800 * MiB, 850 * MiB)


def test_every_block_is_freed_but_the_persistent_ones():
    events = training_events(_run(layer_input=10 * MiB, forward_work=(20 * MiB,),
                                  backward_work=(30 * MiB,), grad_casts=(50 * MiB, 0),
                                  layer_saved=(5 * MiB, 50 * MiB), forward_cached=(5 * MiB,),
                                  late_work=(7 * MiB,)))
    live = set()
    for kind, key, _ in events:
        if kind == ALLOC:
            live.add(key)
        else:
            assert kind == FREE
            live.discard(key)
    assert len(live) == 2 + 4  # the weights and the optimizer states


def test_gradient_accumulation_makes_each_grad_once_per_step():
    events = training_events(_run(micro_batches=3), steps=1)
    grads = [s for kind, _, s in events if kind == ALLOC and s == 100 * MiB]
    # 2 weights + 2 grads (once, not per micro batch) + 4 states
    assert len(grads) == 2 + 2 + 4


def test_the_heads_saved_copy_goes_between_its_16_bit_and_fp32_gradients():
    # lm_head's MmBackward makes the 16-bit weight gradient (40 MiB) and then releases
    # what it saved (the 40 MiB autocast weight copy); ToCopyBackward then makes the
    # fp32 .grad (80 MiB) and drops the 16-bit one.
    blocks = _run(grads=(100 * MiB, 100 * MiB, 80 * MiB), grad_casts=(0, 0, 40 * MiB),
                  head_grads=(2, 3), embed_grads=(3, 3), head_saved=(40 * MiB,),
                  states=(100 * MiB, 100 * MiB, 80 * MiB))
    events = training_events(blocks, steps=1)
    copy_key = next(k for kind, k, s in events if kind == ALLOC and s == 40 * MiB)
    cast_at = next(i for i, (kind, k, s) in enumerate(events)
                   if kind == ALLOC and s == 40 * MiB and k != copy_key)
    freed_at = events.index((FREE, copy_key, 0))
    grad_at = next(i for i, (kind, _, s) in enumerate(events) if kind == ALLOC and s == 80 * MiB)
    assert cast_at < freed_at < grad_at
    assert freed_at == cast_at + 1  # released as soon as the 16-bit gradient exists


def test_a_checkpointed_forward_makes_autocasts_weight_copies_once():
    # the copies go into autocast's cache; the chain of temporaries does not make them again
    copy, act = 30 * MiB, 12 * MiB
    blocks = _run(layer_saved=(copy, act), forward_cached=(copy,), layer_input=4 * MiB)
    loss_at = next(i for i, (kind, _, s) in enumerate(training_events(blocks, 1))
                          if kind == ALLOC and s == 300 * MiB)
    made = [s for kind, _, s in training_events(blocks, 1)[:loss_at] if kind == ALLOC]
    assert made.count(copy) == 1 and made.count(act) == 1


def test_forward_cached_must_lead_layer_saved():
    with pytest.raises(ValueError, match="first blocks of layer_saved"):
        _run(layer_saved=(1 * MiB, 2 * MiB), forward_cached=(2 * MiB,))
