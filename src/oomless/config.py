"""RunConfig: one fine-tuning run, as written in ``oomless.yaml``.

The same file is read by ``oomless estimate FILE``, ``oomless check``,
``oomless train`` and written by ``oomless plan``. Memory-relevant knobs are
top-level keys (they map 1:1 to ``estimate``'s flags); the data and training
loop live in their own sections. Every key is documented in docs/config.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .errors import ConfigError
from .knobs import ATTENTIONS, METHODS, OPTIMIZERS
from .limits import CAPS, cap_message
from .yamlfile import (  # noqa: F401 (the YAML reader, imported from here by callers)
    MAX_YAML_DEPTH,
    MAX_YAML_NODES,
    load_yaml_with_lines,
    parse_yaml_with_lines,
)

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


class RunConfig(_Section):
    """Everything that decides a fine-tune's memory, plus data and loop settings."""

    model: str = Field(..., description="catalog name, HF id in the local cache, or a local path")
    method: Method = "lora"
    stage: Stage = Field("sft", description="training stage: pt, sft, rm, dpo, kto, orpo, "
                         "simpo, ppo")
    stack: Stack = Field("hf-trainer", description="the software that runs the step "
                         "(docs/stacks.md)")
    precision: Precision = "bf16"
    quantization: QuantConfig = QuantConfig()
    stack_options: StackOptions = StackOptions()
    optimizer: Optimizer = "adamw"
    lora: LoraConfig = LoraConfig()
    micro_batch_size: int = Field(1, ge=1, description="per-GPU batch of one forward pass")
    grad_accum: int = Field(1, ge=1, description="micro batches per optimizer step")
    seq_len: int = Field(2048, ge=1, description="tokens per sample (padded or packed length)")
    grad_ckpt: bool = False
    attn: Attention = "sdpa"
    zero: Literal[0, 1, 2, 3] = 0
    offload: Offload = "none"
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()
    hardware: HardwareConfig = HardwareConfig()
    vision: VisionConfig = VisionConfig()
    rlhf: RlhfConfig = RlhfConfig()
    eval: EvalConfig = EvalConfig()
    data: DataConfig = DataConfig()
    training: TrainingConfig = TrainingConfig()

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        for key, value in (("world_size", self.world_size),
                           ("effective_batch", self.effective_batch)):
            if value > CAPS[key].high:
                raise ValueError(f"{key.replace('_', ' ')} {cap_message(key, value)}")
        if self.offload != "none" and self.zero == 0:
            raise ValueError(
                f"offload '{self.offload}' needs DeepSpeed ZeRO (zero: 1-3); "
                "set zero: 3 (or 2 for optimizer offload)"
            )
        if self.offload == "all" and self.zero != 3:
            raise ValueError("offload 'all' (parameters too) needs zero: 3; set zero: 3")
        if self.method == "qlora" and self.zero == 3 and self.quant_storage == "uint8":
            raise ValueError(
                "QLoRA with ZeRO-3 / FSDP shards the 4-bit weights only when they are stored "
                "in a float dtype: set quantization.storage: bfloat16 (bnb_4bit_quant_storage, "
                "the PEFT docs' recipe), or use zero: 2"
            )
        if self.method == "qlora" and self.zero == 3 and self.quantization.bits != 4:
            raise ValueError("QLoRA with ZeRO-3 / FSDP needs 4-bit quantization (bits: 4)")
        if self.precision == "pure-bf16" and self.zero > 0:
            raise ValueError(
                "pure-bf16 with DeepSpeed ZeRO: DeepSpeed keeps fp32 master weights and "
                "optimizer states anyway; use precision: bf16 with zero, or zero: 0"
            )
        if self.precision == "fp32" and self.method == "qlora":
            raise ValueError("QLoRA computes in 16-bit; use precision bf16 or fp16")
        return self

    # ---- derived ---------------------------------------------------------
    @property
    def quant_storage(self) -> str:
        """bnb_4bit_quant_storage: stated, else bfloat16 under ZeRO-3 / FSDP, else uint8."""
        return self.quantization.storage or ("bfloat16" if self.zero == 3 else "uint8")

    @property
    def world_size(self) -> int:
        return self.hardware.gpus_per_node * self.hardware.nodes

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer step across all GPUs."""
        return self.micro_batch_size * self.grad_accum * self.world_size

    @property
    def eval_batch_size(self) -> int:
        return self.eval.batch_size or self.micro_batch_size

    def replace(self, **changes: Any) -> RunConfig:
        """A validated copy with top-level or dotted ("hardware.nodes") keys changed."""
        data = self.model_dump()
        for key, value in changes.items():
            set_dotted(data, key, value)
        return RunConfig.model_validate(data)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """data["a"]["b"] = value for the key "a.b", creating sections as needed."""
    *parents, leaf = dotted.split(".")
    for p in parents:
        if data.get(p) is None:  # absent, or an empty section in YAML ("hardware:")
            data[p] = {}
        if not isinstance(data[p], dict):
            raise ConfigError(f"'{p}' is {data[p]!r}, not a section of keys; cannot set "
                              f"'{dotted}' (write '{p}:' with its keys indented below)")
        data = data[p]
    data[leaf] = value


def format_validation_error(err: ValidationError, source: str, lines: dict[str, int]) -> str:
    """One line per problem: the key, the file line, what is wrong."""
    parts = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        line = lines.get(key)
        where = f"{source}:{line}" if line else source
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key; see docs/config.md for the keys oomless reads"
        parts.append(f"{where}: '{key}': {msg}")
    return "invalid run configuration:\n  " + "\n  ".join(parts)


def build_run_config(data: dict[str, Any], source: str = "<options>",
                     lines: dict[str, int] | None = None) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source, lines or {})) from None


def load_run_config(path: str | Path) -> RunConfig:
    """Read an ``oomless.yaml``; errors name the key and its line."""
    data, lines = load_yaml_with_lines(path)
    return build_run_config(data, str(path), lines)


def dump_run_config(cfg: RunConfig) -> str:
    """YAML text of a config, without keys left at their defaults' sections empty."""
    import yaml

    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
