"""One table per knob: optimizers, attention kinds and training methods.

Adding an optimizer (or an attention kind) means adding one row here: the run
configuration's accepted values (oomless.config.sections), the CLI's choices, the memory
model's state bytes (``memory/states.py``), the names other tools use in their
files (``check`` reads them, ``plan --out`` writes them), the class the
runtime builds and what ``diagnose`` may suggest all read these rows.

Foreign names: transformers ``TrainingArguments.optim`` values are
``transformers.training_args.OptimizerNames``; LLaMA-Factory's ``flash_attn``
values are ``AttentionFunction`` in its ``extras/constants.py``;
``attn_implementation`` values are transformers' attention interface keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class OptimizerKind:
    name: str
    full_states: int  # states of a parameter's size at the optimizer's element dtype (AdamW: m, v)
    eight_bit: bool = False  # bitsandbytes block-wise 8-bit states (memory/constants.ADAM8BIT_BYTES)
    factored: bool = False  # Adafactor: row + column factors per matrix (memory/states.py)
    paged: bool = False  # states in CUDA unified memory, outside PyTorch's allocator
    hf_optim: str = ""  # TrainingArguments.optim that ``plan --out`` and ``check`` write
    hf_aliases: tuple[str, ...] = ()  # further TrainingArguments.optim values read as this one
    torch_class: str = ""  # "module:Class" the runtime builds
    class_kwargs: dict[str, Any] = field(default_factory=dict)
    needs_cuda: bool = False  # bitsandbytes kernels
    saves_memory_over_adamw: bool = False  # diagnose/check may propose it as a memory fix
    # DeepSpeed's ZeRO-Offload steps this optimizer on the CPU (CPU-Adam, built from the
    # AdamW block plan --out writes). Other rows cannot be offloaded: DeepSpeed refuses a
    # client optimizer with ZeRO-Offload (runtime/engine.py, zero_force_ds_cpu_optimizer),
    # so with offload the run steps CPU-Adam instead (memory/states.py counts its states,
    # the planner does not offer the pair).
    zero_offload: bool = False


OPTIMIZERS: dict[str, OptimizerKind] = {o.name: o for o in (
    OptimizerKind("adamw", 2, hf_optim="adamw_torch_fused",
                  hf_aliases=("adamw_torch", "adamw_hf", "adamw_torch_fused", "adamw_apex_fused"),
                  torch_class="torch.optim:AdamW", zero_offload=True),
    OptimizerKind("adamw-8bit", 2, eight_bit=True, hf_optim="adamw_bnb_8bit",
                  hf_aliases=("adamw_8bit", "adamw_bnb_8bit"),
                  torch_class="bitsandbytes.optim:AdamW8bit", needs_cuda=True,
                  saves_memory_over_adamw=True),
    OptimizerKind("paged-adamw", 2, paged=True, hf_optim="paged_adamw_32bit",
                  hf_aliases=("paged_adamw_32bit",),
                  torch_class="bitsandbytes.optim:PagedAdamW", needs_cuda=True),
    OptimizerKind("paged-adamw-8bit", 2, eight_bit=True, paged=True, hf_optim="paged_adamw_8bit",
                  hf_aliases=("paged_adamw_8bit",),
                  torch_class="bitsandbytes.optim:PagedAdamW8bit", needs_cuda=True,
                  saves_memory_over_adamw=True),
    OptimizerKind("sgd", 0, hf_optim="sgd", torch_class="torch.optim:SGD",
                  saves_memory_over_adamw=True),
    OptimizerKind("sgd-momentum", 1, hf_optim="sgd", torch_class="torch.optim:SGD",
                  class_kwargs={"momentum": 0.9}, saves_memory_over_adamw=True),
    OptimizerKind("adafactor", 0, factored=True, hf_optim="adafactor",
                  torch_class="transformers.optimization:Adafactor",
                  class_kwargs={"scale_parameter": False, "relative_step": False,
                                "warmup_init": False},
                  saves_memory_over_adamw=True),
)}


@dataclass(frozen=True)
class AttentionKind:
    name: str
    hf_implementation: str  # transformers attn_implementation
    llamafactory: str  # LLaMA-Factory flash_attn value written
    llamafactory_aliases: tuple[str, ...] = ()  # further flash_attn values read as this one
    materialises_scores: bool = False  # keeps the s x s attention probabilities (eager)


ATTENTIONS: dict[str, AttentionKind] = {a.name: a for a in (
    AttentionKind("eager", "eager", "disabled", ("disabled",), materialises_scores=True),
    AttentionKind("sdpa", "sdpa", "sdpa", ("auto", "sdpa")),
    AttentionKind("flash", "flash_attention_2", "fa2", ("fa2", "fa3")),
)}


@dataclass(frozen=True)
class MethodKind:
    name: str
    trains_all_weights: bool
    adapter: bool
    quantized_base: bool
    llamafactory_finetuning_type: str


METHODS: dict[str, MethodKind] = {m.name: m for m in (
    MethodKind("full", True, False, False, "full"),
    MethodKind("lora", False, True, False, "lora"),
    MethodKind("qlora", False, True, True, "lora"),
)}


def offloaded_optimizer(name: str) -> OptimizerKind:
    """The row whose states ZeRO-Offload keeps in host RAM for a run with ``name``: its
    own if DeepSpeed can step it on the CPU, else the AdamW row (CPU-Adam)."""
    kind = OPTIMIZERS[name]
    return kind if kind.zero_offload else next(k for k in OPTIMIZERS.values() if k.zero_offload)


def optimizer_from_hf(name: str) -> str | None:
    """Our optimizer name for a TrainingArguments ``optim`` value (None: not modelled)."""
    for kind in OPTIMIZERS.values():
        if name == kind.hf_optim and name != "sgd" or name in kind.hf_aliases:
            return kind.name
    return "sgd" if name == "sgd" else None


def attention_from_llamafactory(value: str) -> str | None:
    """Our attention kind for a LLaMA-Factory ``flash_attn`` value (None: unknown)."""
    for kind in ATTENTIONS.values():
        if value in kind.llamafactory_aliases:
            return kind.name
    return None


def load_class(path: str) -> Any:
    """The class a registry row names as "module:Class" (imported on use)."""
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
