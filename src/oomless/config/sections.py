"""The accepted values of a run's knobs and the sections of ``oomless.yaml`` (lora,
quantization, stack_options, deepspeed, fsdp, hardware, vision, rlhf, eval, data, training):
frozen pydantic models, every number capped by oomless.limits.CAPS."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..knobs import ATTENTIONS, METHODS, OPTIMIZERS
from ..limits import CAPS, cap_message

# The accepted values of the knobs with a registry come from knobs.py (one row each).
Method = Literal[tuple(METHODS)]  # type: ignore[valid-type]
Optimizer = Literal[tuple(OPTIMIZERS)]  # type: ignore[valid-type]
Attention = Literal[tuple(ATTENTIONS)]  # type: ignore[valid-type]
Precision = Literal["bf16", "fp16", "fp32", "pure-bf16"]
Offload = Literal["none", "optimizer", "all"]
QuantStorage = Literal["uint8", "bfloat16", "float16", "float32"]
# Training stages as LLaMA-Factory names them (plus TRL's ORPO and SimPO): pt and sft
# run one sequence per sample; rm, dpo, kto, orpo and simpo run preference pairs;
# ppo holds policy, reference, reward and value models and generates.
Stage = Literal["pt", "sft", "rm", "dpo", "kto", "orpo", "simpo", "ppo"]
# The reference model of dpo/kto/ppo (docs/config.md, rlhf.reference)
Reference = Literal["auto", "adapter-off", "separate", "precomputed"]
# The software that runs the training step: each stack's memory-relevant behaviours
# are listed in docs/stacks.md.
Stack = Literal["hf-trainer", "trl", "llamafactory", "axolotl", "swift", "unsloth",
                "custom-loop", "torchtune"]


class _Section(BaseModel):
    # NaN and infinity are refused in every float field (a NaN passes gt=0 checks)
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    _key_prefix: ClassVar[str] = ""  # where the section sits in RunConfig ("hardware.")

    @field_validator("*")
    @classmethod
    def _capped(cls, value: Any, info: ValidationInfo) -> Any:
        """Numbers above their cap in limits.CAPS (the CLI's flags read the same table)."""
        key = cls._key_prefix + str(info.field_name)
        if key in CAPS and isinstance(value, int | float) and value > CAPS[key].high:
            raise ValueError(cap_message(key, value))
        return value


class LoraConfig(_Section):
    _key_prefix: ClassVar[str] = "lora."
    r: int = Field(16, ge=1, description="LoRA rank")
    alpha: float = Field(32, description="LoRA alpha (scaling = alpha / r)")
    dropout: float = Field(0.0, ge=0, lt=1, description="PEFT and LLaMA-Factory default 0")
    targets: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names (q_proj, v_proj, ...) or 'all-linear'"
    )
    modules_to_save: list[str] = Field(
        default_factory=list, description="modules trained in full next to LoRA (PEFT "
        "modules_to_save, LLaMA-Factory additional_target, axolotl lora_modules_to_save): "
        "each gets a trainable copy, its gradients and optimizer states; names are read as "
        "the part they name: embedding (embed_tokens, wte, ...), LM head (lm_head, ...), "
        "projector (multi_modal_projector, resampler, merger, ...) or vision tower "
        "(vision_tower, vpm, visual, ...), whose activations a copy then keeps; ignored "
        "under full fine-tuning")


class QuantConfig(_Section):
    """``method: qlora``: how the base is quantized when it loads (LLaMA-Factory's
    quantization_method / quantization_bit)."""

    _key_prefix: ClassVar[str] = "quantization."

    method: Literal["bnb", "hqq", "eetq"] = Field(
        "bnb", description="bitsandbytes (4/8-bit), HQQ (1-6, 8-bit) or EETQ (8-bit)")
    bits: Literal[1, 2, 3, 4, 5, 6, 8] = 4
    type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True
    storage: QuantStorage | None = Field(
        None, description="bitsandbytes bnb_4bit_quant_storage: the dtype the packed 4-bit "
        "weights are stored in; a float dtype lets FSDP / ZeRO-3 shard them (null: uint8, "
        "bfloat16 under ZeRO-3 / FSDP as LLaMA-Factory and the PEFT recipes set it)")

    @model_validator(mode="after")
    def _bits_for_method(self) -> QuantConfig:
        allowed = {"bnb": (4, 8), "hqq": (1, 2, 3, 4, 5, 6, 8), "eetq": (8,)}[self.method]
        if self.bits not in allowed:
            raise ValueError(f"quantization.bits {self.bits} with method {self.method}: "
                             f"{self.method} takes {', '.join(map(str, allowed))} bits")
        return self


class StackOptions(_Section):
    """Switches of the training stack that change memory (docs/stacks.md)."""

    _key_prefix: ClassVar[str] = "stack_options."

    transformers_version: str | None = Field(
        None, description="transformers release the run uses (selects the loss path); "
        "default: the installed one")
    stack_version: str | None = Field(
        None, description="release of the stack's own package (trl, ...); default: installed")
    kbit_upcast: bool | None = Field(
        None, description="peft prepare_model_for_kbit_training casts the 16-bit non-quantized "
        "parameters to fp32 (null: the stack's default)")
    autocast: bool | None = Field(
        None, description="the step runs under torch.autocast (false: HF Trainer without "
        "bf16/fp16 on a 16-bit-loaded model computes in the model's dtype, PEFT's fp32 "
        "adapters take an fp32 copy of their input; null: the stack's default)")
    liger_kernel: bool = Field(False, description="Liger kernels with the fused linear "
                               "cross-entropy (LLaMA-Factory enable_liger_kernel, axolotl "
                               "liger_fused_linear_cross_entropy)")
    upcast_layernorm: bool = Field(False, description="LLaMA-Factory upcast_layernorm")
    upcast_lmhead_output: bool = Field(False, description="LLaMA-Factory upcast_lmhead_output")
    offload_checkpoints: bool = Field(False, description="checkpointed layer inputs kept in "
                                      "host RAM (LLaMA-Factory use_unsloth_gc, Unsloth's "
                                      "'unsloth' gradient checkpointing, torchtune's "
                                      "enable_activation_offloading)")
    optimizer_in_bwd: bool = Field(False, description="torchtune optimizer_in_bwd: each "
                                   "parameter is stepped and its gradient freed inside the "
                                   "backward")
    cut_cross_entropy: bool = Field(False, description="Apple's cut-cross-entropy "
                                    "(axolotl's CutCrossEntropyPlugin): the loss from the hidden "
                                    "states and the lm_head weight, no logits")
    chunked_loss: bool | None = Field(None, description="torchtune: a chunked cross-entropy "
                                      "(CEWithChunkedOutputLoss / LinearCrossEntropyLoss) "
                                      "instead of torch's (null: the recipes' default, chunked)")
    compile: bool = Field(False, description="torch.compile of the decoder layers and the loss "
                          "(torchtune compile: True): the saved tensors are what AOTAutograd's "
                          "min-cut partitioner keeps (oomless/data/compiled_saved.json)")


class DeepSpeedConfig(_Section):
    """DeepSpeed ``zero_optimization`` values that size ZeRO's own buffers
    (memory/zero_buffers.py). null: transformers' "auto" (what oomless writes);
    a DeepSpeed JSON's keys that are absent take DeepSpeed's defaults."""

    reduce_bucket_size: int | None = Field(None, gt=0, description="elements per gradient "
                                           "staging bucket (null: hidden², HF auto)")
    allgather_bucket_size: int = Field(500_000_000, gt=0, description="ZeRO-1/2 all-gather "
                                       "chunk (no buffer of its own)")
    stage3_prefetch_bucket_size: int | None = Field(
        None, ge=0, description="ZeRO-3 parameters prefetched ahead (null: 0.9·hidden²)")
    stage3_max_live_parameters: int = Field(1_000_000_000, ge=0,
                                            description="ZeRO-3 gathered parameters at most")
    contiguous_gradients: bool = True
    overlap_comm: bool | None = Field(None, description="null: DeepSpeed's default (on for "
                                      "ZeRO-3 only); on doubles ZeRO-1/2's staging buffer")


class FsdpConfig(_Section):
    """torch FSDP1 (``FullyShardedDataParallel``) as accelerate's FSDP plugin wraps the model
    (memory/zero_buffers.py fsdp1_unsharded). Defaults: accelerate 1.15
    utils/dataclasses.py FullyShardedDataParallelPlugin."""

    version: Literal[1, 2] | None = Field(
        None, description="1: torch FSDP1 through accelerate (fsdp_version 1); 2 or null: "
        "FSDP2 (fully_shard), as oomless's own FSDP engine wraps the model")
    limit_all_gathers: bool = Field(True, description="FSDP1 rate limiter: at most two "
                                    "all-gathers in flight (_limiter_utils._FreeEventQueue)")
    backward_prefetch: Literal["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"] = Field(
        "NO_PREFETCH", description="fsdp_backward_prefetch (accelerate's default: none)")
    forward_prefetch: bool = Field(False, description="fsdp_forward_prefetch")
    use_orig_params: bool = Field(False, description="fsdp_use_orig_params (views of the flat "
                                  "parameter, no memory of their own)")


class HardwareConfig(_Section):
    _key_prefix: ClassVar[str] = "hardware."
    gpu: str | None = Field(None, description="GPU name from `oomless gpus`")
    gpus_per_node: int = Field(1, ge=1)
    nodes: int = Field(1, ge=1)
    host_ram_gb: float | None = Field(None, gt=0, description="host RAM per node, GB (offload)")


class EvalConfig(_Section):
    _key_prefix: ClassVar[str] = "eval."
    batch_size: int | None = Field(None, ge=1, description="default: micro_batch_size")
    max_new_tokens: int = Field(0, ge=0, description="generation length when predicting")
    predict_with_generate: bool = False
    steps: int = Field(0, ge=0, description="evaluate every N optimizer steps (0: at the end)")
    loss: bool = Field(True, description="evaluation runs a forward with labels for the loss; "
                       "false when the evaluation batches carry no labels and the trainer only "
                       "generates (transformers Seq2SeqTrainer.prediction_step with "
                       "predict_with_generate computes the loss only when the batch has "
                       "labels)")


class VisionConfig(_Section):
    """Vision-language models: what of the vision side is trained, and the images."""

    _key_prefix: ClassVar[str] = "vision."

    freeze_tower: bool = Field(True, description="vision tower frozen (LLaMA-Factory "
                               "freeze_vision_tower, GLM-4 freezeV, LLaVA's default)")
    freeze_projector: bool = Field(True, description="multi-modal projector frozen "
                                   "(LLaMA-Factory freeze_multi_modal_projector)")
    image_size: int | None = Field(None, ge=1, description="side of a (square) input image in "
                                   "pixels; default: the model's own (fixed-size towers) or "
                                   "756 (Qwen2-VL family)")
    max_pixels: int | None = Field(None, ge=1, description="Qwen2-VL family: largest image "
                                   "area after resizing (processor max_pixels, LLaMA-Factory "
                                   "image_max_pixels); default: the processor's")
    min_pixels: int | None = Field(None, ge=1, description="Qwen2-VL family: smallest image "
                                   "area after resizing (processor min_pixels)")
    attn: Literal["auto", "eager", "sdpa"] = Field(
        "auto", description="the tower's attention: auto (what the model's code runs: the "
        "run's attn for transformers towers, SDPA for GLM-4V's EVA2-CLIP), eager or sdpa "
        "(eager, and SDPA's math fallback, keep the patches² × heads scores)")


class RlhfConfig(_Section):
    """Training stages other than pt/sft: the reference, reward and value models, PPO's
    generation (docs/config.md, "rlhf"). Keys follow TRL's and LLaMA-Factory's meaning."""

    _key_prefix: ClassVar[str] = "rlhf."

    reference: Reference = Field(
        "auto", description="dpo/kto/ppo reference: auto (LoRA: the policy with its adapters "
        "switched off; full: a separate frozen copy), adapter-off, separate, precomputed "
        "(TRL precompute_ref_log_probs: no reference forward in the step)")
    reward_model: Literal["separate", "adapter"] = Field(
        "separate", description="ppo: a separate reward model of the same size (TRL), or a "
        "reward adapter on the policy's base (LLaMA-Factory reward_model_type: lora)")
    value_model: Literal["separate", "head"] = Field(
        "separate", description="ppo: a separate value model trained with the policy (TRL), or "
        "a value head on the policy (LLaMA-Factory AutoModelForCausalLMWithValueHead)")
    response_length: int | None = Field(
        None, ge=1, description="ppo: generated tokens per query (TRL response_length; default "
        "data.max_output_length, else 53 as TRL)")
    rollout_batch_size: int | None = Field(
        None, ge=1, description="ppo: queries generated and scored together (TRL "
        "local_rollout_forward_batch_size; default 64 as TRL, at most the queries of one "
        "step, micro_batch_size × grad_accum)")
    kto_kl: bool = Field(True, description="kto: estimate the KL term from mismatched "
                         "completions (one more no-grad forward per model)")


class DataConfig(_Section):
    _key_prefix: ClassVar[str] = "data."
    train_file: str | None = None
    eval_file: str | None = None
    format: Literal["auto", "alpaca", "sharegpt", "messages"] = "auto"
    max_input_length: int | None = Field(None, ge=1, description="prompt tokens kept")
    max_output_length: int | None = Field(None, ge=1, description="response tokens kept")
    packing: bool = False
    on_bad_record: Literal["error", "skip"] = "error"
    images_per_sample: int = Field(0, ge=0, description="vision-language: images per record")
    image_tokens: int | None = Field(None, ge=1, description="override tokens per image")


class InjectOOM(_Section):
    """Fault injection (tests, demos): raise torch.OutOfMemoryError on purpose."""

    _key_prefix: ClassVar[str] = "training.inject_oom."

    step: int = Field(..., ge=1, description="optimizer step (1-based) or evaluation round")
    rank: int | None = Field(0, ge=0, description="process rank; null: every rank")
    times: int = Field(1, ge=1, description="how many attempts of that step fail")
    phase: Literal["train", "eval"] = "train"
    micro_index: int | None = Field(
        None, ge=0, description="micro batch inside the step that fails (null: the last)"
    )
    during: Literal["forward", "backward"] = Field(
        "forward", description="fail after the forward (before backward) or after the backward "
        "(its gradients already accumulated: they must be dropped and the step redone)"
    )


class TrainingConfig(_Section):
    _key_prefix: ClassVar[str] = "training."
    output_dir: str = "runs/oomless"
    epochs: float = Field(1.0, gt=0)
    max_steps: int | None = Field(None, ge=1)
    learning_rate: float = Field(2e-4, gt=0)
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_ratio: float = Field(0.03, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, ge=0)
    seed: int = 42
    logging_steps: int = Field(1, ge=1)
    save_steps: int = Field(0, ge=0, description="checkpoint every N steps (0: at the end)")
    trust_remote_code: bool = False
    auto_fit: bool = False
    engine: Literal["auto", "deepspeed", "fsdp"] = "auto"
    inject_oom: list[InjectOOM] = Field(
        default_factory=list, description="fault injection: OOMs at chosen steps and ranks"
    )
    memory_budget_gb: float | None = Field(
        None, gt=0, description="simulated GPU budget (GiB): tracked tensor bytes above it "
        "raise OutOfMemoryError (CPU testing of OOM recovery)"
    )
    save_total_limit: int | None = Field(None, ge=1, description="checkpoints kept (None: all)")
