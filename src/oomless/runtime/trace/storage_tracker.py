"""Dispatch-level tracker of tensor storages: every allocation and release.

``StorageTracker`` is a ``TorchDispatchMode``: every ATen op passes through it,
and every storage an op returns that it has not seen is an allocation; a
``weakref`` callback on the storage object is its release (PyTorch keeps one
Python object per live storage, so the callback fires when the storage itself
dies). The same idea as torch/distributed/_tools/mem_tracker.py, written for
our needs: it never hooks parameters (MemTracker's parameter hooks fail on
frozen LoRA/QLoRA weights), it classifies storages with hindsight (see
``categorize``), and it adds the temporaries that CUDA kernels allocate
internally where the CPU/fake kernels that run here allocate none
(``cuda_emulation``).

It works the same on fake tensors (``oomless trace``) and on real tensors
(``oomless measure`` on CPU), which is what lets a test compare the two.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ...allocator import ALLOC, FREE, MIN_BLOCK_BYTES

# Storage categories (hindsight: see categorize()).
WEIGHTS = "weights"
ADAPTERS = "lora_adapters"
GRADIENTS = "gradients"
OPTIMIZER = "optimizer"
PAGED = "paged_optimizer"  # bitsandbytes paged states: CUDA unified memory, outside PyTorch
ACTIVATIONS = "activations"
LOGITS = "logits"
TEMPORARIES = "temporaries"
WORKSPACE = "cublas_workspace"
INPUTS = "inputs"

_SKIP_OPS = {torch.ops.prim.device.default}


class StorageRecord:
    """One storage's life: size, when and where it was born, when it died."""

    __slots__ = ("key", "nbytes", "phase_idx", "module", "region", "category", "op",
                 "free_phase_idx", "ref", "owner", "grows")

    def __init__(self, key: int, nbytes: int, phase_idx: int, module: str, region: str | None,
                 op: str, category: str | None = None):
        self.key = key
        self.nbytes = nbytes
        self.phase_idx = phase_idx
        self.module = module
        self.region = region
        self.op = op
        self.category = category
        self.free_phase_idx: int | None = None
        self.ref: Any = None
        self.owner = -1  # decoder layer the storage belongs to, -1: none
        # an op over a list of per-layer tensors (torch.stack of gradient norms): the
        # (owner, bytes) of its inputs, so that a deeper model's copy can be sized
        self.grows: list[tuple[int, int]] | None = None


class ModuleStack:
    """Which modules run now, forward and backward, by their name in ``root``.

    Forward: global module pre/post hooks. Backward: a module is entered when
    the first gradient of its outputs is computed and left when the first
    gradient of its inputs is (``register_multi_grad_hook(mode="any")``, which
    holds no gradient, so memory is not changed by the tracking).
    """

    def __init__(self, root: torch.nn.Module, on_enter: Callable[[str, bool], None] | None = None,
                 on_exit: Callable[[str, bool], None] | None = None):
        self.names = {id(m): name for name, m in root.named_modules() if name}
        self.layer_of: dict[str, int] = {}  # module name → decoder layer index
        self.layers_name = ""  # the ModuleList of decoder layers
        self.segment_layer = -1  # the decoder layer whose stretch of the step this is
        self.live: Callable[[], int] | None = None  # live bytes now (set by the tracker)
        self.entry_bytes: dict[str, int] = {}  # live bytes when each module was entered
        self.active: list[str] = []
        self.failed_in: str | None = None  # innermost module running when an error left
        self._on_enter, self._on_exit = on_enter, on_exit
        self._handles: list[Any] = []
        self._grad_handles: list[Any] = []

    def set_layers(self, layers_name: str, count: int) -> None:
        """Name the decoder layers: ``layers_name`` is their ModuleList."""
        self.layers_name = layers_name
        for name in self.names.values():
            rest = name.removeprefix(layers_name + ".")
            if rest != name:
                index = rest.split(".", 1)[0]
                if index.isdigit() and int(index) < count:
                    self.layer_of[name] = int(index)

    def _enter(self, name: str, backward: bool) -> None:
        # a layer's stretch runs from its entry (forward, backward or recomputation)
        # until another module outside it is entered: it includes what happens between
        # layers, such as freeing the previous layer's output
        self.segment_layer = self.layer_of.get(name, -1)
        self.active.append(name)
        if self.live is not None:
            self.entry_bytes[name] = self.live()
        if self._on_enter:
            self._on_enter(name, backward)

    def _exit(self, name: str, backward: bool) -> None:
        if name in self.active:
            # remove the innermost occurrence (recomputation can nest a name)
            idx = len(self.active) - 1 - self.active[::-1].index(name)
            del self.active[idx]
        if self._on_exit:
            self._on_exit(name, backward)

    def _grad_tensors(self, obj: Any) -> list[torch.Tensor]:
        return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor) and t.requires_grad]

    def _pre(self, mod: torch.nn.Module, args: Any) -> None:
        name = self.names.get(id(mod))
        if name is None:
            return
        self._enter(name, False)
        tensors = self._grad_tensors(args)
        if tensors and torch.is_grad_enabled():
            self._grad_handles.append(register_multi_grad_hook(
                tensors, lambda _g, n=name: self._exit(n, True), mode="any"))

    def _post(self, mod: torch.nn.Module, args: Any, out: Any) -> None:
        name = self.names.get(id(mod))
        if name is None:
            return
        self._exit(name, False)
        tensors = self._grad_tensors(out)
        if tensors and torch.is_grad_enabled():
            self._grad_handles.append(register_multi_grad_hook(
                tensors, lambda _g, n=name: self._enter(n, True), mode="any"))

    def reset(self) -> None:
        """Forget modules left open (a backward ends with its last module's inputs)."""
        self.active.clear()
        self.segment_layer = -1

    def __enter__(self) -> ModuleStack:
        self._handles = [register_module_forward_pre_hook(self._pre),
                         register_module_forward_hook(self._post)]
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None and self.active:
            self.failed_in = self.active[-1]
        for h in self._handles + self._grad_handles:
            h.remove()
        self._grad_handles.clear()
        self.reset()


def _rounded(nbytes: int) -> int:
    """Bytes the CUDA allocator hands out for a request (512-byte granularity)."""
    return 0 if nbytes == 0 else -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


class StorageTracker(TorchDispatchMode):
    """Record every storage allocation/release as an event stream.

    ``events``: (ALLOC, key, nbytes) / (FREE, key, 0), in order, the stream the
    allocator simulation replays; ``event_phase``: the phase index of each.
    ``records``: key → StorageRecord. ``phases``: (name, iteration) per index.
    """

    def __init__(self, emulation: Any | None = None):
        super().__init__()
        self.events: list[tuple[str, int, int]] = []
        self.event_phase: list[int] = []
        self.event_owner: list[int] = []  # decoder layer running at each event, -1: none
        self.records: dict[int, StorageRecord] = {}
        self.phases: list[tuple[str, int]] = [("setup", 0)]
        self.region: str | None = None
        self.modules: ModuleStack | None = None
        self.emulation = emulation
        self.live_bytes = 0  # 512-rounded bytes of live storages
        # name → [forward, backward]: the most bytes a module's run added on top of
        # what was live when it started (independent of the model's depth)
        self.module_peaks: dict[str, list[int]] = {}
        self._by_storage: dict[int, int] = {}  # id(storage object) → key
        self.losses: list[Any] = []  # the step's losses (set by the caller)
        self.layers_name = ""  # the decoder layers' ModuleList (set by the caller)
        self._next_key = 1
        # the engine's gradient sums, in place as without this dispatch mode (input_buffer)
        from .input_buffer import EngineSums

        self.engine_sums = EngineSums()

    # ---- phases and regions ------------------------------------------------
    @property
    def phase_idx(self) -> int:
        return len(self.phases) - 1

    @property
    def phase(self) -> str:
        return self.phases[-1][0]

    def start_phase(self, name: str, iteration: int) -> None:
        self.phases.append((name, iteration))
        self.engine_sums.reset()
        if self.modules is not None:
            self.modules.reset()

    # ---- recording ---------------------------------------------------------------
    def _new_record(self, nbytes: int, op: str, category: str | None) -> StorageRecord:
        key = self._next_key
        self._next_key += 1
        module = self.modules.active[-1] if self.modules and self.modules.active else ""
        rec = StorageRecord(key, nbytes, self.phase_idx, module, self.region, op, category)
        self.records[key] = rec
        rec.owner = self._owner()
        self.events.append((ALLOC, key, nbytes))
        self.event_phase.append(self.phase_idx)
        self.event_owner.append(rec.owner)
        self.live_bytes += _rounded(nbytes)
        if self.modules is not None and self.modules.active:
            slot = 1 if self.phase == "backward" else 0
            entry = self.modules.entry_bytes
            for name in self.modules.active:
                peaks = self.module_peaks.setdefault(name, [0, 0])
                added = self.live_bytes - entry.get(name, self.live_bytes)
                if added > peaks[slot]:
                    peaks[slot] = added
        return rec

    def _release(self, key: int) -> None:
        rec = self.records[key]
        rec.free_phase_idx = self.phase_idx
        rec.ref = None
        self.events.append((FREE, key, 0))
        self.event_phase.append(self.phase_idx)
        self.event_owner.append(self._owner())
        self.live_bytes -= _rounded(rec.nbytes)

    def _owner(self) -> int:
        return self.modules.segment_layer if self.modules is not None else -1

    def _on_storage_death(self, sid: int) -> None:
        key = self._by_storage.pop(sid, None)
        if key is not None:
            self._release(key)

    def track(self, tensor: torch.Tensor, op: str = "", category: str | None = None) -> int:
        """Track ``tensor``'s storage (no-op when known; size changes re-allocate)."""
        st = tensor.untyped_storage()
        sid = id(st)
        key = self._by_storage.get(sid)
        nbytes = st.nbytes()
        if key is not None:
            rec = self.records[key]
            if rec.nbytes == nbytes:
                if category and rec.category is None:
                    rec.category = category
                return key
            # resized in place: the allocator hands out a new block, frees the old
            ref = rec.ref
            self._release(key)
            new = self._new_record(nbytes, op, category or rec.category)
            new.ref = ref
            self._by_storage[sid] = new.key
            return new.key
        rec = self._new_record(nbytes, op, category)
        rec.ref = weakref.ref(st, lambda _r, s=sid: self._on_storage_death(s))
        self._by_storage[sid] = rec.key
        return rec.key

    def categorize(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """Mark storages as ``category`` (gradients, optimizer state) with hindsight."""
        for t in tensors:
            key = self._by_storage.get(id(t.untyped_storage()))
            if key is not None:
                self.records[key].category = category

    def set_owner(self, tensors: Iterable[torch.Tensor], layer: int) -> None:
        """Attribute storages to a decoder layer (its weights, gradients, states)."""
        for t in tensors:
            key = self._by_storage.get(id(t.untyped_storage()))
            if key is not None:
                self.records[key].owner = layer

    def reuse(self, tensor: torch.Tensor, old: torch.Tensor) -> int | None:
        """``tensor``'s storage stands for ``old``'s (an in-place op the trace ran out of
        place): no allocation, and the record ends when ``tensor``'s storage dies."""
        key = self._by_storage.get(id(old.untyped_storage()))
        st = tensor.untyped_storage()
        if key is None or id(st) in self._by_storage or self.records[key].nbytes != st.nbytes():
            return None
        del self._by_storage[id(old.untyped_storage())]
        sid = id(st)
        self.records[key].ref = weakref.ref(st, lambda _r, s=sid: self._on_storage_death(s))
        self._by_storage[sid] = key
        return key

    def phantom_alloc(self, nbytes: int, op: str, category: str | None = None) -> int:
        """An allocation no tensor here stands for (a CUDA kernel's internal buffer)."""
        return self._new_record(nbytes, op, category).key

    def phantom_free(self, key: int) -> None:
        self._release(key)

    # ---- dispatch --------------------------------------------------------------------
    def __enter__(self) -> StorageTracker:
        if self.modules is not None and self.modules.live is None:
            self.modules.live = lambda: self.live_bytes
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SKIP_OPS:
            return func(*args, **kwargs)
        self.engine_sums.observe()
        summed_into = self.engine_sums.in_place_operand(func, args)
        temps = self.emulation.before(self, func, args, kwargs) if self.emulation else ()
        out = func(*args, **kwargs)
        name = func.__name__
        reused = self.reuse(out, summed_into) if summed_into is not None else None
        keys = [reused] if reused is not None else \
            [self.track(t, name) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if keys and self.phase == "optimizer":
            self._inherit_owner(args, keys)
        if self.emulation:
            temps = [*temps, *self.emulation.after(self, func, args, kwargs)]
        for key in temps:
            self.phantom_free(key)
        return out

    def _inherit_owner(self, args: tuple, out_keys: list[int]) -> None:
        """Per-parameter temporaries of the optimizer phase (gradient norms) belong to
        their parameter's layer: outputs of an op on one layer's tensors, or the i-th
        output of a foreach op on the i-th input."""
        inputs = next((a for a in args if isinstance(a, (list, tuple))
                       and len(a) == len(out_keys)), None) if len(out_keys) > 1 else None
        if inputs is None:
            owners = {self.owner_of(t) for t in tree_leaves(args) if isinstance(t, torch.Tensor)}
            if len(owners) == 1 and -1 not in owners:
                layer = owners.pop()
                for key in out_keys:
                    self.records[key].owner = layer
            elif len(out_keys) == 1:
                self._record_growth(args, out_keys[0])
            return
        for t, key in zip(inputs, out_keys, strict=True):
            if isinstance(t, torch.Tensor):
                self.records[key].owner = self.owner_of(t)

    def _record_growth(self, args: tuple, out_key: int) -> None:
        lists = [a for a in args if isinstance(a, (list, tuple))
                 and a and all(isinstance(t, torch.Tensor) for t in a)]
        if lists:
            self.records[out_key].grows = [(self.owner_of(t), t.nbytes) for t in lists[0]]

    def owner_of(self, t: torch.Tensor) -> int:
        key = self._by_storage.get(id(t.untyped_storage()))
        return self.records[key].owner if key is not None else -1

    # ---- results ---------------------------------------------------------------------
    def final_category(self, rec: StorageRecord) -> str:
        """A storage's category, decided with hindsight.

        Preset (weights, adapters, inputs, gradients, optimizer, workspace) wins;
        then anything born in the logits region (lm_head output, loss, their
        gradients); then forward storages that outlive their forward are
        activations (saved for backward); everything else is a temporary.
        """
        if rec.category:
            return rec.category
        if rec.region == LOGITS:
            return LOGITS
        if self.phases[rec.phase_idx][0] == "forward" and rec.free_phase_idx != rec.phase_idx:
            return ACTIVATIONS
        return TEMPORARIES
