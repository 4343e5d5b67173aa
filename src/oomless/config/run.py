"""RunConfig, the whole run, and its way in and out of ``oomless.yaml``: built from a
mapping with errors that name the key and its line, loaded from a file, dumped as YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from ..errors import ConfigError
from ..limits import CAPS, cap_message
from ..yamlfile import load_yaml_with_lines
from .sections import (
    Attention,
    DataConfig,
    DeepSpeedConfig,
    EvalConfig,
    FsdpConfig,
    HardwareConfig,
    LoraConfig,
    Method,
    Offload,
    Optimizer,
    Precision,
    QuantConfig,
    RlhfConfig,
    Stack,
    StackOptions,
    Stage,
    TrainingConfig,
    VisionConfig,
    _Section,
)


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
    fsdp: FsdpConfig = FsdpConfig()
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
