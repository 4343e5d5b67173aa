"""Run HF Trainer's steps under the storage tracker (shared by trace and measure).

Before the step the tracker learns the weights, adapters, quantization states
and inputs; during it, which decoder layer runs at every event (for layer
expansion, oomless.runtime.trace.expansion) and where the logits region starts and ends
(lm_head forward to lm_head backward); after backward, which storages are
gradients; after the step, which are optimizer states — each attributed to
the decoder layer of its parameter.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ...config import RunConfig
from ..build import TraceUnsupported
from .storage_tracker import ADAPTERS, INPUTS, LOGITS, OPTIMIZER, PAGED, WEIGHTS, ModuleStack

PEFT_PREFIX = "base_model.model."


class TraceFailed(Exception):
    """The model's own code failed under the trace; ``module`` names where."""

    def __init__(self, module: str, error: BaseException):
        super().__init__(f"{type(error).__name__}: {error}")
        self.module = module


def decoder_layers_name(model: Any, num_layers: int) -> str | None:
    """Name of the ModuleList holding the decoder layers (not a vision tower's blocks)."""
    import torch

    found = [name for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers]
    text = [n for n in found if "vision" not in n and "visual" not in n]
    return (text or found or [None])[0]


def layer_index(name: str, layers_name: str | None) -> int:
    """Decoder layer a parameter or module name belongs to, -1 for none."""
    if not layers_name:
        return -1
    rest = name.removeprefix(layers_name + ".")
    head = rest.split(".", 1)[0]
    return int(head) if rest != name and head.isdigit() else -1


def register_model(tracker: Any, model: Any, cfg: RunConfig, batches: list[Any],
                   layers_name: str | None) -> None:
    """Weights, adapters, quantization states and inputs exist before the step."""
    lora = cfg.method in ("lora", "qlora")
    for name, p in model.named_parameters():
        tracker.track(p, "parameter", ADAPTERS if (lora and p.requires_grad) else WEIGHTS)
        owned = [p]
        state = getattr(p, "quant_state", None)
        if state is not None:
            owned += _quant_state_tensors(state)
            for t in owned[1:]:
                tracker.track(t, "quant_state", WEIGHTS)
        tracker.set_owner(owned, layer_index(name, layers_name))
    for name, b in model.named_buffers():
        tracker.track(b, "buffer", WEIGHTS)
        tracker.set_owner([b], layer_index(name, layers_name))
    for batch in batches:
        for t in (batch or {}).values():
            tracker.track(t, "input", INPUTS)


def _quant_state_tensors(state: Any) -> list[Any]:
    import torch

    out = [v for v in vars(state).values() if isinstance(v, torch.Tensor)]
    inner = getattr(state, "state2", None)
    if inner is not None:
        out += [v for v in vars(inner).values() if isinstance(v, torch.Tensor)]
    return out


def _output_embedding_name(model: Any) -> str | None:
    head = model.get_output_embeddings()
    for name, module in model.named_modules():
        if module is head:
            return name
    return None


class _Callbacks:
    """What the step tells the tracker: phases, the logits region, gradients, states."""

    def __init__(self, tracker: Any, model: Any, cfg: RunConfig, layers_name: str | None):
        self.tracker = tracker
        self.head = _output_embedding_name(model)
        self.owner = {id(p): layer_index(n, layers_name) for n, p in model.named_parameters()}
        self.states = PAGED if cfg.optimizer.startswith("paged") else OPTIMIZER

    def on_enter(self, name: str, backward: bool) -> None:
        if name == self.head and not backward:
            self.tracker.region = LOGITS

    def on_exit(self, name: str, backward: bool) -> None:
        if name == self.head and backward:
            self.tracker.region = None

    def on_phase(self, name: str, iteration: int) -> None:
        self.tracker.start_phase(name, iteration)
        self.tracker.region = LOGITS if (name == "backward" and self.head) else None

    def on_grads(self, params: list[Any]) -> None:
        from .storage_tracker import GRADIENTS

        for p in params:
            if p.grad is not None:
                self.tracker.categorize([p.grad], GRADIENTS)
                self.tracker.set_owner([p.grad], self.owner[id(p)])

    def on_states(self, optimizer: Any) -> None:
        import torch

        for p, state in optimizer.state.items():
            tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
            self.tracker.categorize(tensors, self.states)
            self.tracker.set_owner(tensors, self.owner.get(id(p), -1))


def _with_phases(hook: Any, on_phase: Any) -> Any:
    return None if hook is None else (lambda it: hook(it, on_phase))


def _tracked_model(model: Any, cfg: RunConfig, batches: list[dict | None], num_layers: int,
                   emulation: Any, frozen_models: tuple) -> tuple[Any, _Callbacks, ModuleStack]:
    """A StorageTracker that knows the model's tensors (and the other models' weights),
    the callbacks that categorize the step's tensors, and the module stack reporting to it."""
    from .storage_tracker import StorageTracker

    tracker = StorageTracker(emulation=emulation)
    layers_name = decoder_layers_name(model, num_layers)
    tracker.layers_name = layers_name or ""
    register_model(tracker, model, cfg, batches, layers_name)
    for other in frozen_models:
        for p in other.parameters():
            tracker.track(p, "parameter", WEIGHTS)
        for b in other.buffers():
            tracker.track(b, "buffer", WEIGHTS)
    calls = _Callbacks(tracker, model, cfg, layers_name)
    modules = ModuleStack(model, calls.on_enter, calls.on_exit)
    if layers_name:
        modules.set_layers(layers_name, num_layers)
    tracker.modules = modules
    return tracker, calls, modules


def _cuda_kernels(emulation: Any) -> contextlib.ExitStack:
    """CUDA autocast's fp32 ops, its on/off state as code asks it, CUDA's dropout kernel
    and foreach paths, where CUDA is emulated."""
    from .cuda_emulation import (
        cuda_autocast_policies,
        cuda_autocast_state,
        cuda_dropout,
        cuda_foreach,
    )

    cuda = contextlib.ExitStack()
    if emulation is not None:
        cuda.enter_context(cuda_autocast_policies())
        cuda.enter_context(cuda_autocast_state())
        cuda.enter_context(cuda_dropout())
        cuda.enter_context(cuda_foreach())
    return cuda


def run_tracked(model: Any, cfg: RunConfig, batch: dict, eval_batch: dict | None, *,
                device_type: str, num_layers: int, fake: Any = None, emulation: Any = None,
                iterations: int = 2, loss_fn: Any = None, frozen_models: tuple = (),
                full_batch_values: bool = False, step_hooks: tuple = (None, None)) -> Any:
    """Run the training steps under a StorageTracker and return it.

    ``loss_fn``: a trainer's loss in place of the causal-LM loss; ``frozen_models``: other
    models the step holds (a reference or reward model), tracked as weights;
    ``full_batch_values``: answer value reads of fake tensors as for a full batch
    (runtime/trace/data_emulation.py); ``step_hooks``: (before, after) each optimizer
    step, called with the iteration and the tracker's phase callback."""
    from .data_emulation import FullBatchMode
    from .hf_step import run_steps

    tracker, calls, modules = _tracked_model(model, cfg, [batch, eval_batch], num_layers,
                                             emulation, frozen_models)
    values = FullBatchMode() if full_batch_values else contextlib.nullcontext()
    cuda = _cuda_kernels(emulation)
    try:
        with fake if fake is not None else contextlib.nullcontext(), values, cuda, tracker, \
                modules:
            tracker.losses = run_steps(
                model, cfg, batch, device_type=device_type, iterations=iterations,
                on_phase=calls.on_phase, on_grads=calls.on_grads, on_states=calls.on_states,
                eval_batch=eval_batch, loss_fn=loss_fn,
                before_step=_with_phases(step_hooks[0], calls.on_phase),
                after_step=_with_phases(step_hooks[1], calls.on_phase))
    except NotImplementedError as err:
        raise TraceUnsupported(str(err)) from None
    except Exception as err:  # the model's own code failed: say where, fall back
        where = modules.failed_in or ""
        raise TraceFailed(where.removeprefix(PEFT_PREFIX), err) from err
    finally:
        tracker.start_phase("teardown", 0)
        tracker.modules = None
    return tracker
