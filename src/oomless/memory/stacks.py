"""Training stacks: the memory-relevant behaviours of the software that runs the step.

The same model, method and batch need different memory under HF Trainer, TRL,
LLaMA-Factory, axolotl, ms-swift, Unsloth or a hand-written loop, because each stack
casts parameters, computes the loss and keeps tensors its own way. docs/stacks.md lists
those behaviours with the source each was read from; :func:`stack_effects` is the one
place that turns a run configuration into the switches the analytic model reads
(precision.py, states.py, training.py and loss_paths.py call in here through small
hooks), and :func:`stack_assumptions` says them with their sources in the estimate.
``oomless trace`` runs the stacks' real code where it installs
(oomless.runtime.trace.stacks) and the tests compare both.

Versions matter: which transformers release computes the loss (:func:`loss_path`) and
which TRL generation runs the step. A stated version (``stack_options``) wins, then the
installed one (read from the package metadata, nothing is imported), then the newest
behaviour read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache, lru_cache

from ..config import RunConfig, StackOptions


@dataclass(frozen=True)
class LossPath:
    """How a transformers release turns logits into the causal-LM loss."""

    name: str
    model_upcasts: bool  # the model's forward casts the logits to fp32 (its outputs hold fp32)
    shift_copy: bool  # the loss makes a contiguous fp32 copy of the shifted logits
    source: str
    # the model's forward casts its fp32 logits back to the hidden states' dtype after the
    # loss, while the fp32 logits and the loss's tensors are still alive (ChatGLM)
    recast_after_loss: bool = False


LOSS_PATHS = (
    LossPath("model-upcast+shift", True, True,
             "transformers ≤ 4.45 models/llama/modeling_llama.py LlamaForCausalLM.forward: "
             "logits.float(), then a contiguous copy of logits[..., :-1, :]"),
    LossPath("loss-upcast+shift", False, True,
             "transformers 4.46–4.48 loss/loss_utils.py ForCausalLMLoss: logits.float() and "
             "a contiguous copy of the shifted logits; the model keeps its 16-bit logits"),
    LossPath("loss-upcast", False, False,
             "transformers ≥ 4.49 loss/loss_utils.py ForCausalLMLoss: logits.float(), labels "
             "padded and shifted instead of the logits"),
    # not a transformers release's path: remote code whose forward computes its own loss
    # (families.json own_loss)
    LossPath("model-upcast+shift+recast", True, True,
             "THUDM/glm-4-9b-chat and glm-4v-9b modeling_chatglm.py "
             "ChatGLMForConditionalGeneration.forward: lm_logits.to(torch.float32), "
             "shift_logits = lm_logits[..., :-1, :].contiguous() into CrossEntropyLoss, then "
             "lm_logits = lm_logits.to(hidden_states.dtype) while shift_logits is alive",
             recast_after_loss=True),
)
# first release of each path (checked by benchmarks/loss_versions.py on 4.36–5.23)
_LOSS_PATH_SINCE = ((0, 0), (4, 46), (4, 49))
NEWEST_TRANSFORMERS = "5.23"
NEWEST_TRL = "1.16"


def version_tuple(text: str) -> tuple[int, ...]:
    """(4, 46, 3) from "4.46.3" (pre-release and local suffixes ignored)."""
    out = []
    for part in text.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


@cache
def installed_version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def transformers_version(cfg: RunConfig | _Inputs) -> str:
    return (cfg.stack_options.transformers_version or installed_version("transformers")
            or NEWEST_TRANSFORMERS)


@lru_cache(maxsize=64)
def loss_path(version: str) -> LossPath:
    v = version_tuple(version)[:2]
    index = max(i for i, since in enumerate(_LOSS_PATH_SINCE) if v >= since)
    return LOSS_PATHS[index]


# ms-swift trainers/seq2seq_trainer.py Seq2SeqTrainer.compute_loss ends with
# trainers/mixin.py SwiftMixin._compute_acc: preds = outputs.logits.argmax(dim=-1), an
# int64 tensor per token, handed to metrics/acc.py compute_acc, which copies it to the
# host. It is allocated after the loss has freed its fp32 transients (at least 4 bytes
# per token × vocabulary entry), so it never adds to a peak: swift's bytes are HF
# Trainer's (the trace runs the argmax: runtime/trace/stacks.py).
SWIFT_ACCURACY = ("ms-swift's token accuracy: logits.argmax (int64, 8 bytes per token) "
                  "after the loss has freed its fp32 copies of the logits; below every peak "
                  "(ms-swift 4.6 trainers/mixin.py SwiftMixin._compute_acc)")


# ---- what a configuration gets ------------------------------------------------------
FP32_GROUPS_ALL = frozenset({"embeddings", "lm_head", "norms", "other"})


@dataclass(frozen=True)
class StackEffects:
    """The switches of one configuration's stack that the memory model reads."""

    stack: str
    loss: LossPath
    autocast: bool = True
    keep_outputs: bool = False
    fp32_groups: frozenset[str] = frozenset()  # non-quantized parameters cast to fp32
    adapters_16bit: bool = False
    lmhead_fp32_output: bool = False
    fused_loss: str = ""  # "", "liger", "trl", "unsloth", "cce"
    offload_checkpoints: bool = False
    optimizer_in_bwd: bool = False  # gradients stepped and freed one parameter at a time
    compiled: bool = False  # torch.compile: saved tensors from the partitioner's trace
    # prepare_model_for_kbit_training ran: every 16-bit non-quantized parameter was fp32
    # before the stack's recasts; setup_cache: the freed 16-bit originals stay in the
    # caching allocator (PEFT before PR #3293 added torch.cuda.empty_cache)
    setup_upcast: bool = False
    setup_cache: bool = False
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Inputs:
    """The fields of a RunConfig that decide its stack's effects."""

    stack: str
    method: str
    zero: int
    grad_ckpt: bool
    precision: str
    stage: str
    stack_options: StackOptions


def _trl_is_v1(cfg: _Inputs) -> bool:
    version = cfg.stack_options.stack_version or installed_version("trl") or NEWEST_TRL
    return version_tuple(version) >= (1,)


def stack_effects(cfg: RunConfig) -> StackEffects:
    """The memory-relevant switches of ``cfg.stack`` with its ``stack_options``."""
    return _effects(cfg.stack, cfg.method, cfg.zero, cfg.grad_ckpt, cfg.precision, cfg.stage,
                    cfg.stack_options)


@lru_cache(maxsize=1024)
def _effects(stack: str, method: str, zero: int, grad_ckpt: bool, precision: str, stage: str,
             opts: StackOptions) -> StackEffects:
    """stack_effects, memoised on what it reads (the planner asks for many candidates)."""
    cfg = _Inputs(stack, method, zero, grad_ckpt, precision, stage, opts)
    notes: list[str] = []
    fx = _stated_options(_stack_defaults(cfg, notes), cfg, notes)
    if cfg.stack == "llamafactory" and cfg.stage in ("dpo", "kto", "orpo", "simpo", "ppo"):
        notes.append("LLaMA-Factory keeps the full logits in preference stages (Liger's fused "
                     "loss is switched off there)")
        if fx.fused_loss == "liger":
            fx = replace(fx, fused_loss="")
    return replace(fx, notes=tuple(notes))


def _qlora_single(cfg: _Inputs) -> bool:
    """QLoRA without DeepSpeed (DeepSpeed recasts the module itself)."""
    return cfg.method == "qlora" and cfg.zero == 0


def _stack_defaults(cfg: _Inputs, notes: list[str]) -> StackEffects:
    """What the stack does by default, before any stated ``stack_options``."""
    qlora_single = _qlora_single(cfg)
    fx = StackEffects(cfg.stack, loss_path(transformers_version(cfg)))
    if cfg.stack == "trl":
        if _trl_is_v1(cfg):
            fx = replace(fx, fused_loss="trl", adapters_16bit=cfg.method == "qlora")
        elif qlora_single:
            fx = replace(fx, fp32_groups=frozenset({"norms", "other"}), setup_upcast=True,
                         setup_cache=True)
    elif cfg.stack == "axolotl" and qlora_single:
        fx = replace(fx, fp32_groups=frozenset({"other"}), setup_upcast=True)
    elif cfg.stack == "unsloth":
        fx = replace(fx, fused_loss=unsloth_loss(cfg.stack_options),
                     offload_checkpoints=cfg.grad_ckpt)
        notes.append("Unsloth modelled from its source (it does not install beside oomless' "
                     "pins): offloaded checkpointing and the fused chunked cross-entropy; its "
                     "own Triton kernels for RoPE, RMSNorm and SwiGLU are counted as HF's")
    elif cfg.stack == "torchtune":
        fx = _torchtune(fx, cfg, notes)
    elif cfg.stack == "swift":
        notes.append(SWIFT_ACCURACY)
    elif cfg.stack == "custom-loop":
        pure = cfg.precision in ("bf16", "fp16")
        fx = replace(fx, autocast=not pure, keep_outputs=True,
                     fp32_groups=FP32_GROUPS_ALL if qlora_single else frozenset(),
                     setup_upcast=qlora_single)
    return fx


def _stated_options(fx: StackEffects, cfg: _Inputs, notes: list[str]) -> StackEffects:
    """The stack's defaults with the switches ``stack_options`` states."""
    opts = cfg.stack_options
    if opts.autocast is not None:
        fx = replace(fx, autocast=opts.autocast)
    if opts.kbit_upcast is not None and _qlora_single(cfg):
        fx = replace(fx, fp32_groups=FP32_GROUPS_ALL if opts.kbit_upcast else frozenset(),
                     setup_upcast=opts.kbit_upcast)
    if opts.upcast_layernorm and cfg.zero == 0:
        fx = replace(fx, fp32_groups=fx.fp32_groups | {"norms"})
    if opts.upcast_lmhead_output:
        fx = replace(fx, lmhead_fp32_output=True)
    if opts.liger_kernel:
        fx = replace(fx, fused_loss="liger")
    if opts.cut_cross_entropy:
        fx = replace(fx, fused_loss="cce")
    if opts.offload_checkpoints and cfg.grad_ckpt:
        fx = replace(fx, offload_checkpoints=True)
    if opts.compile:
        fx = replace(fx, compiled=True)
        if not fx.fused_loss.startswith("torchtune-chunked"):
            notes.append("torch.compile of the loss: only torchtune's chunked-output "
                         "cross-entropy was traced compiled; this loss is counted eager (an "
                         "upper bound; torchtune's LinearCrossEntropyLoss.apply_compile_strategy "
                         "skipped compiling it in its first releases)")
    return fx


# Unsloth's loss by release (unslothai/unsloth unsloth/models/llama.py
# CausalLM_fast_forward): to 2024.11.7 the model's bf16 logits and the Triton
# fast_cross_entropy_loss (its backward writes the gradient into the logits in place);
# from the next release (commit fa8e59eb "Cut Cross Entropy") cut_cross_entropy's
# linear_cross_entropy, no logits, for batches over 1024 tokens; from 2025.8.5
# (commit 806bee24) unsloth_zoo's unsloth_fused_ce_loss in chunks.
UNSLOTH_LOSSES = (((0,), "unsloth-triton"), ((2024, 11, 8), "unsloth-cce"),
                  ((2025, 8, 5), "unsloth"))
NEWEST_UNSLOTH = "2026.10.9"


def unsloth_loss(opts: StackOptions) -> str:
    version = version_tuple(opts.stack_version or installed_version("unsloth")
                            or NEWEST_UNSLOTH)
    return [name for since, name in UNSLOTH_LOSSES if version >= since][-1]


# torchtune's loss moved into the output projection after 0.6 (LinearCrossEntropyLoss in
# the recipes' configs since pytorch/torchtune#2531, after the v0.6.1 release)
TORCHTUNE_LINEAR_CE_SINCE = (0, 7)
NEWEST_TORCHTUNE = "0.7"


def _torchtune(fx: StackEffects, cfg: _Inputs, notes: list[str]) -> StackEffects:
    opts = cfg.stack_options
    version = opts.stack_version or installed_version("torchtune") or NEWEST_TORCHTUNE
    loss = ""
    if opts.chunked_loss is not False:
        linear = version_tuple(version) >= TORCHTUNE_LINEAR_CE_SINCE
        loss = "torchtune-linear" if linear else "torchtune-chunked"
    if not opts.compile:
        notes.append("torchtune: eager (compile: False): the loss keeps fp32 "
                     "log-probabilities, every layer its eager saved tensors")
    return replace(fx, autocast=False, adapters_16bit=True, fused_loss=loss,
                   optimizer_in_bwd=opts.optimizer_in_bwd and cfg.zero == 0)


def stack_assumptions(cfg: RunConfig) -> list[str]:
    """The profile's behaviours that this configuration uses, in words, with their sources."""
    fx = stack_effects(cfg)
    out = [f"stack {cfg.stack}: loss path of transformers {transformers_version(cfg)} "
           f"({fx.loss.source})"]
    if not fx.autocast:
        out.append("no autocast: the model computes in its 16-bit dtype, fp32 LoRA adapters "
                   "take an fp32 copy of their input (peft lora/layer.py _cast_input_dtype)")
    if fx.keep_outputs:
        out.append("the step's outputs (logits) stay alive through backward and the next "
                   "forward (a loop that keeps `outputs`, as PEFT's method comparison does)")
    if fx.fp32_groups:
        out.append("fp32 after the stack's casts: " + ", ".join(sorted(fx.fp32_groups)) +
                   " (peft prepare_model_for_kbit_training and the stack's recasts)")
    if fx.setup_upcast:
        out.append("setup phase: prepare_model_for_kbit_training holds every 16-bit "
                   "non-quantized parameter in fp32 before the stack's recasts" +
                   (", and the caching allocator keeps their freed 16-bit originals (PEFT "
                    "before the empty_cache of peft PR #3293; reserved, counted in the phase)"
                    if fx.setup_cache else ""))
    if fx.adapters_16bit:
        out.append("QLoRA adapters, their gradients and AdamW states in bf16 (TRL ≥ 1.0)")
    if fx.lmhead_fp32_output:
        out.append("lm_head output cast to fp32 by a forward hook (upcast_lmhead_output)")
    if fx.fused_loss:
        out.append(f"fused loss ({fx.fused_loss}): the full logits are never materialised")
    if fx.offload_checkpoints:
        out.append("checkpointed layer inputs live in host RAM; one layer's input on the GPU")
    if fx.optimizer_in_bwd:
        out.append("optimizer in backward: one parameter's gradient at a time (the largest)")
    out.extend(fx.notes)
    return out
