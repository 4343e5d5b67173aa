"""Training stacks: the memory-relevant behaviours of the software that runs the step.

The same model, method and batch need different memory under HF Trainer, TRL,
LLaMA-Factory, axolotl, ms-swift, Unsloth or a hand-written loop, because each stack
casts parameters, computes the loss and keeps tensors its own way. A *profile* is the
list of those behaviours with the source each was read from (docs/stacks.md gives the
same list for users); :func:`stack_effects` turns a run configuration into the
switches the analytic model reads (precision.py, states.py, training.py and
loss_paths.py call in here through small hooks). ``oomless trace`` runs the stacks' real code where
it installs (runtime/trace/stacks.py) and the tests compare both.

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
class Behaviour:
    key: str
    text: str  # what it does to memory, in words
    source: str  # repository · file · function it was read from


@dataclass(frozen=True)
class LossPath:
    """How a transformers release turns logits into the causal-LM loss."""

    name: str
    model_upcasts: bool  # the model's forward casts the logits to fp32 (its outputs hold fp32)
    shift_copy: bool  # the loss makes a contiguous fp32 copy of the shifted logits
    source: str


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


# ---- the profiles ----------------------------------------------------------------------
_B = Behaviour
HF_TRAINER = (
    _B("autocast", "forward under bf16/fp16 autocast, outputs converted to fp32 and dropped "
       "before backward", "transformers trainer.py Trainer.compute_loss; accelerate "
       "utils/operations.py convert_outputs_to_fp32"),
    _B("loss-path", "the loss path of the transformers release (fp32 upcast, shifted copy "
       "before 4.49)", "transformers loss/loss_utils.py ForCausalLMLoss"),
)
PROFILES: dict[str, tuple[Behaviour, ...]] = {
    "hf-trainer": HF_TRAINER,
    "trl": HF_TRAINER + (
        _B("trl-fused-head", "TRL ≥ 1.0: SFTTrainer scores tokens with a fused LM head in "
           "tiles of 4096 tokens × 32768 vocabulary entries; the full logits never exist",
           "trl trainer/utils.py add_fused_lm_head; trl kernels/chunked_logprob.py "
           "ChunkedLogProbFunction; trainer/sft_trainer.py SFTTrainer.compute_loss"),
        _B("trl-qlora-bf16-adapters", "TRL ≥ 1.0: LoRA adapters of a quantized model cast "
           "to bf16 (states and gradients bf16)", "trl trainer/sft_trainer.py SFTTrainer."
           "__init__ (loop after get_peft_model, _is_quantized_model)"),
        _B("trl0-kbit", "TRL 0.x: k-bit models go through prepare_model_for_kbit_training "
           "(16-bit parameters to fp32), then peft_module_casting_to_bf16 casts embeddings "
           "and lm_head back to bf16 and keeps norms fp32", "trl 0.x (0.11–0.12) trainer/sft_trainer.py "
           "SFTTrainer._prepare_peft_model; trainer/utils.py peft_module_casting_to_bf16"),
    ),
    "llamafactory": HF_TRAINER + (
        _B("upcast_layernorm", "norm weights fp32 (norm outputs fp32)",
           "LLaMA-Factory model/model_utils/checkpointing.py prepare_model_for_training"),
        _B("upcast_lmhead_output", "a forward hook casts the lm_head output to fp32",
           "LLaMA-Factory checkpointing.py _fp32_forward_post_hook"),
        _B("enable_liger_kernel", "Liger kernels with fused linear cross-entropy",
           "LLaMA-Factory model/model_utils/liger_kernel.py apply_liger_kernel"),
        _B("use_unsloth_gc", "checkpointed layer inputs copied to host RAM",
           "LLaMA-Factory checkpointing.py get_unsloth_gradient_checkpointing_func"),
    ),
    "axolotl": HF_TRAINER + (
        _B("axolotl-kbit", "QLoRA without FSDP/ZeRO-3: embeddings and norms cast to fp32, "
           "prepare_model_for_kbit_training, then norms and embeddings cast back to the "
           "training dtype (only biases stay fp32)", "axolotl loaders/model.py "
           "_configure_embedding_dtypes, _prepare_model_for_quantization, "
           "_convert_embedding_modules_dtype"),
        _B("liger", "Liger plugin: fused linear cross-entropy",
           "axolotl integrations/liger"),
    ),
    "swift": HF_TRAINER + (
        _B("swift-acc", "token accuracy from the logits' argmax inside compute_loss "
           "(t × 8 bytes)", "ms-swift trainers/seq2seq_trainer.py Seq2SeqTrainer.compute_loss"),
    ),
    "unsloth": HF_TRAINER + (
        _B("unsloth-offload-ckpt", "checkpointed layer inputs offloaded to host RAM",
           "unsloth_zoo gradient_checkpointing.py Unsloth_Offloaded_Gradient_Checkpointer"),
        _B("unsloth-fused-ce", "from 2025.8.5: cross-entropy fused with lm_head in chunks "
           "sized to at most 16 B × tokens × vocabulary per chunk and 4 GiB in all (half the "
           "free memory when less)", "unsloth_zoo fused_losses/cross_entropy_loss.py "
           "get_chunk_size, _CE_BYTES_PER_LOGIT, _CE_TARGET_GB_CAP"),
        _B("unsloth-cce", "2024.11.8 to 2025.8.4: cut_cross_entropy's linear_cross_entropy "
           "(no logits) for batches over 1024 tokens", "unsloth models/llama.py "
           "CausalLM_fast_forward (HAS_CUT_CROSS_ENTROPY, RETURN_LOGITS)"),
        _B("unsloth-triton-ce", "to 2024.11.7: the model's bf16 logits and a Triton "
           "cross-entropy whose backward writes the gradient into the logits in place",
           "unsloth kernels/cross_entropy_loss.py Fast_CrossEntropyLoss"),
    ),
    "torchtune": (
        _B("torchtune-dtype", "the model runs in its dtype (bf16) without autocast: full "
           "fine-tuning is pure bf16 (no fp32 master weights, AdamW states bf16), LoRA "
           "adapters bf16", "torchtune recipes/full_finetune_single_device.py _setup_model "
           "(training.set_default_dtype); modules/peft/lora.py LoRALinear"),
        _B("torchtune-chunked-ce", "transformers' loss is not used: torchtune ≤ 0.6 "
           "CEWithChunkedOutputLoss (the model returns its bf16 logits in 8 chunks, each "
           "upcast to fp32 on its own), later LinearCrossEntropyLoss (the output projection "
           "runs per chunk of 8 inside the loss: the full logits never exist); eager "
           "F.cross_entropy keeps each chunk's fp32 log-probabilities for backward",
           "torchtune modules/loss/ce_chunked_output_loss.py, cross_entropy_loss.py "
           "(num_output_chunks=8)"),
        _B("optimizer_in_bwd", "each parameter's optimizer step runs in a "
           "post-accumulate-grad hook that then frees its gradient: gradients never exist "
           "all at once", "torchtune training/memory.py register_optim_in_bwd_hooks "
           "(optim_step: step, zero_grad)"),
        _B("enable_activation_offloading", "saved activations (the checkpointed layer "
           "inputs under activation checkpointing) copied to host RAM",
           "torchtune training/_activation_offloading.py OffloadActivations"),
    ),
    "custom-loop": (
        _B("no-autocast", "the model runs in its 16-bit dtype without autocast; fp32 LoRA "
           "adapters get an fp32 copy of their input", "peft method_comparison/MetaMathQA/"
           "run.py (use_amp false); peft tuners/lora/layer.py Linear.forward "
           "_cast_input_dtype"),
        _B("keep-outputs", "the outputs (logits) stay alive through backward, the optimizer "
           "step and the next forward", "peft method_comparison/MetaMathQA/run.py train loop"),
        _B("kbit-upcast", "QLoRA: prepare_model_for_kbit_training casts every 16-bit "
           "non-quantized parameter to fp32 (embeddings: fp32 residual stream; lm_head: "
           "fp32 logits without autocast)", "peft utils/other.py "
           "prepare_model_for_kbit_training"),
        _B("loss-path", "the loss path of the transformers release",
           "transformers loss/loss_utils.py ForCausalLMLoss"),
    ),
}


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
    fused_loss: str = ""  # "", "liger", "trl", "unsloth"
    offload_checkpoints: bool = False
    optimizer_in_bwd: bool = False  # gradients stepped and freed one parameter at a time
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
    qlora_single = cfg.method == "qlora" and cfg.zero == 0  # DeepSpeed recasts the module
    fx = StackEffects(cfg.stack, loss_path(transformers_version(cfg)))
    notes: list[str] = []
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
    elif cfg.stack == "custom-loop":
        pure = cfg.precision in ("bf16", "fp16")
        fx = replace(fx, autocast=not pure, keep_outputs=True,
                     fp32_groups=FP32_GROUPS_ALL if qlora_single else frozenset(),
                     setup_upcast=qlora_single)
    if opts.kbit_upcast is not None and qlora_single:
        fx = replace(fx, fp32_groups=FP32_GROUPS_ALL if opts.kbit_upcast else frozenset(),
                     setup_upcast=opts.kbit_upcast)
    if opts.upcast_layernorm and cfg.zero == 0:
        fx = replace(fx, fp32_groups=fx.fp32_groups | {"norms"})
    if opts.upcast_lmhead_output:
        fx = replace(fx, lmhead_fp32_output=True)
    if opts.liger_kernel:
        fx = replace(fx, fused_loss="liger")
    if opts.offload_checkpoints and cfg.grad_ckpt:
        fx = replace(fx, offload_checkpoints=True)
    if cfg.stack == "llamafactory" and cfg.stage in ("dpo", "kto", "orpo", "simpo", "ppo"):
        notes.append("LLaMA-Factory keeps the full logits in preference stages (Liger's fused "
                     "loss is switched off there)")
        if fx.fused_loss == "liger":
            fx = replace(fx, fused_loss="")
    return replace(fx, notes=tuple(notes))


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
    notes.append("torchtune: eager loss (compile: True keeps the 16-bit logits instead of "
                 "fp32 log-probabilities and needs less; not modelled)")
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
