"""A coarse training run's alloc/free stream, built from block sizes, not traced.

The analytic estimate knows each tensor a step holds (weights per parameter,
per-layer saved activations, the loss's blocks, gradients, optimizer states) but
not the order in which the caching allocator sees them, and the allocator's
reserve depends on that order. ``training_events`` lays the blocks out in the
order the libraries request them, for ``steps`` optimizer steps:

- loading: the weights, one block per checkpoint tensor in the loader's order
  (transformers ``modeling_utils`` walks the checkpoint keys sorted by
  ``dot_natural_key``), then the other persistent blocks;
- each micro batch's forward: per layer the tensors autograd saves (kept) and
  its working set (each temporary freed once the next one is made; attention code
  whose temporaries are not a chain as the ops its code makes,
  oomless.allocator.attention_blocks); under gradient checkpointing only the
  layer's input is kept and the layer's tensors are freed as soon as made
  (``torch.utils.checkpoint``, non-reentrant), except the 16-bit weight copies
  autocast caches for leaves that require grad (``at::autocast::cached_cast``),
  which stay until the outermost autocast exits (``torch.autocast.__exit__``
  clears the cache) after the loss; then the loss region's ops;
- the backward: the loss region's backward ops with the head's gradients, after which
  the head's backward has dropped what it saved (its input and the 16-bit weight copy
  autocast made for it, which outlives autocast's cache through that reference), then
  the layers in reverse, each with its recomputed tensors (checkpointing), its
  gradient working set and its parameters' ``.grad`` (created by
  ``AccumulateGrad`` the first time a parameter gets one after ``zero_grad``;
  under autocast an fp32 weight's gradient is first made in 16-bit by the
  matmul's backward and cast by ``ToCopyBackward``),
  then the embedding's gradient;
- the optimizer: in the first step only, each parameter's states in parameter
  order (``torch/optim/adam.py`` ``_init_group``: ``exp_avg`` then
  ``exp_avg_sq`` per parameter); then ``zero_grad(set_to_none=True)`` frees
  every ``.grad``.

The replay (``oomless.allocator.replay``) gives the peaks; reserved − allocated
is the reserve the estimate reports.
"""

from __future__ import annotations

from dataclasses import dataclass

from .replay import ALLOC, FREE, replay

Ops = tuple[int, ...]  # region ops: n > 0 allocates n bytes, -k frees the region's k-th block


@dataclass(frozen=True)
class TrainingBlocks:
    """Sizes in bytes of a training run's blocks (all layers alike)."""

    weights: tuple[int, ...]  # loaded weights, loader order
    persistent: tuple[int, ...]  # other blocks the run holds throughout (adapters, workspaces)
    grads: tuple[int, ...]  # each trained parameter's .grad, parameter order
    # per .grad: a lower-precision gradient made first and cast into it (0: none)
    grad_casts: tuple[int, ...]
    layer_grads: tuple[tuple[int, int], ...]  # per layer: [first, end) into grads
    head_grads: tuple[int, int]  # [first, end) of the grads made at the backward's start
    embed_grads: tuple[int, int]  # [first, end) of the grads made at its end
    states: tuple[int, ...]  # per trained parameter: one optimizer state's bytes
    state_count: int  # states per parameter (AdamW: 2)
    layers: int
    layer_saved: tuple[int, ...]  # tensors one layer keeps for backward
    layer_input: int  # a checkpointed layer's kept input (0: no checkpointing)
    forward_work: tuple[int, ...]  # a layer's forward temporaries
    backward_work: tuple[int, ...]  # a layer's backward temporaries
    before_layers: Ops = ()  # ops before the first layer (inputs, vision tower)
    shared: tuple[int, ...] = ()  # kept from the last layer's forward to the backward's end
    # made after ``shared``, released once the head's gradients exist (the head's saved
    # input and autocast weight copy, which its backward drops)
    head_saved: tuple[int, ...] = ()
    loss_forward: Ops = ()  # the loss region's forward ops
    loss_backward: Ops = ()  # its backward ops up to the head's gradients; keys continue
    loss_release: Ops = ()  # its ops after the head's gradients
    # blocks a checkpointed layer's forward leaves in a cache until the forward returns:
    # the first blocks of layer_saved (autocast's weight copies), which the checkpointed
    # forward makes once, into the cache, and not again as temporaries
    forward_cached: tuple[int, ...] = ()
    late_work: tuple[int, ...] = ()  # temporaries at the backward's very end
    # a layer's attention ops before its chained forward work (also in a checkpointed
    # layer's recomputation) and in its backward, for attention code whose temporaries
    # are not a chain (allocator/attention_blocks.py); each region frees its own blocks
    attention_forward: Ops = ()
    attention_backward: Ops = ()
    micro_batches: int = 1

    def __post_init__(self) -> None:
        if self.layer_saved[:len(self.forward_cached)] != self.forward_cached:
            raise ValueError("forward_cached must be the first blocks of layer_saved")


class _Stream:
    def __init__(self) -> None:
        self.events: list[tuple[str, int, int]] = []
        self.next_key = 0

    def alloc(self, size: int) -> int:
        self.next_key += 1
        self.events.append((ALLOC, self.next_key, int(size)))
        return self.next_key

    def free(self, *keys: int) -> None:
        self.events.extend((FREE, k, 0) for k in keys)

    def region(self, ops: Ops, keys: list[int]) -> None:
        """Region ops; ``keys`` collects the region's blocks (freed ones stay listed)."""
        for op in ops:
            if op > 0:
                keys.append(self.alloc(op))
            elif op < 0:
                self.free(keys[-op - 1])


def _layers_forward(s: _Stream, b: TrainingBlocks, cached: list[int]) -> list[list[int]]:
    kept: list[list[int]] = [[s.alloc(b.layer_input)]] if b.layer_input else []
    for layer in range(b.layers):
        if b.layer_input:  # nothing is saved: each tensor goes once the next is made
            cached += [s.alloc(n) for n in b.forward_cached]
            s.region(b.attention_forward, [])
            last = _chain(s, b.layer_saved[len(b.forward_cached):] + b.forward_work)
            if layer + 1 < b.layers:  # the layer's output, the next one's input
                kept.append([s.alloc(b.layer_input)])
            s.free(last)
        else:
            kept.append([s.alloc(n) for n in b.layer_saved])
            s.region(b.attention_forward, [])
            s.free(_chain(s, b.forward_work))
    return kept


def _chain(s: _Stream, sizes: tuple[int, ...]) -> int:
    """Temporaries each consumed by the next: one is freed once the next is made; the
    last one's key (0: none) is left for the caller to free."""
    last = 0
    for n in sizes:
        key = s.alloc(n)
        s.free(last)
        last = key
    return last


def _grads(s: _Stream, b: TrainingBlocks, span: tuple[int, int], live: dict[int, int],
           released: tuple[int, ...] = ()) -> None:
    """The span's .grad blocks; ``released`` (what the node that made the first gradient
    saved) is freed once that node has run: after its 16-bit gradient, before
    ``ToCopyBackward`` makes the fp32 one."""
    for i in reversed(range(*span)):
        cast = s.alloc(b.grad_casts[i]) if b.grad_casts[i] else 0
        s.free(*released)
        released = ()
        if i not in live:
            live[i] = s.alloc(b.grads[i])
        s.free(cast)
    s.free(*released)


def _micro_batch(s: _Stream, b: TrainingBlocks, live_grads: dict[int, int]) -> None:
    before: list[int] = []
    s.region(b.before_layers, before)
    cached: list[int] = []
    kept = _layers_forward(s, b, cached)
    shared = [s.alloc(n) for n in b.shared]
    head = [s.alloc(n) for n in b.head_saved]
    loss: list[int] = []
    s.region(b.loss_forward, loss)
    s.free(*cached)
    s.region(b.loss_backward, loss)
    _grads(s, b, b.head_grads, live_grads, tuple(head))
    s.region(b.loss_release, loss)
    for layer in reversed(range(b.layers)):
        recomputed = [s.alloc(n) for n in b.layer_saved] if b.layer_input else []
        if b.layer_input:
            s.region(b.attention_forward, [])
        work = [s.alloc(n) for n in b.backward_work]
        s.region(b.attention_backward, [])
        _grads(s, b, b.layer_grads[layer], live_grads)
        s.free(*work, *recomputed, *kept[layer])
    s.free(*shared)
    _grads(s, b, b.embed_grads, live_grads)
    s.free(*[s.alloc(n) for n in b.late_work])
    s.free(*before)


def training_events(b: TrainingBlocks, steps: int = 2) -> list[tuple[str, int, int]]:
    """The run's events: loading, then ``steps`` optimizer steps."""
    s = _Stream()
    for n in b.weights + b.persistent:
        s.alloc(n)
    for step in range(steps):
        live: dict[int, int] = {}
        for _ in range(b.micro_batches):
            _micro_batch(s, b, live)
        if step == 0:
            for i in range(len(b.states)):
                for _ in range(b.state_count):
                    s.alloc(b.states[i])
        s.free(*live.values())
    return s.events


def replayed_peaks(b: TrainingBlocks, steps: int = 2) -> tuple[int, int]:
    """(peak allocated, peak reserved) of the run's events through the allocator."""
    report = replay(training_events(b, steps))
    return report.peak_allocated_bytes, report.peak_reserved_bytes


__all__ = ["TrainingBlocks", "replayed_peaks", "training_events"]
