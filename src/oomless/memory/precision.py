"""Which dtype each kind of tensor has, for a method × precision × ZeRO choice.

The conventions follow what HF Trainer, PEFT and DeepSpeed do by default:

- LoRA/QLoRA: the base model is loaded in 16-bit (bf16/fp16), PEFT upcasts the
  adapter weights to fp32 (``autocast_adapter_dtype=True``, peft/tuners/tuners_utils.py),
  and the step runs under ``torch.autocast`` (Trainer ``bf16=True``).
- Full fine-tuning with mixed precision and no ZeRO: fp32 parameters and
  gradients, AdamW states in fp32, autocast to 16-bit (PyTorch AMP).
- Full fine-tuning under DeepSpeed ZeRO with bf16/fp16: the module is 16-bit,
  DeepSpeed keeps fp32 master weights, fp32 gradient partitions and Adam
  states in the optimizer (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py).
- pure-bf16: everything in bf16, optimizer states too (LLaMA-Factory ``pure_bf16``).
- fp32: everything fp32, no autocast.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import RunConfig
from .stacks import stack_effects


@dataclass(frozen=True)
class Dtypes:
    base_weight_bytes: int  # frozen or trained module weights, per parameter
    trainable_bytes: int  # dtype of trainable parameters in the module
    grad_bytes: int  # .grad of trainable parameters in the module
    master_bytes: int  # separate fp32 master copy (DeepSpeed), per trainable param
    optim_elem_bytes: int  # AdamW exp_avg / exp_avg_sq element size
    act_bytes: int  # activations fed to matmuls
    resid_bytes: int  # residual stream (embedding output) dtype
    autocast: bool  # ops run under torch.autocast (weights cast per matmul)
    norm_fp32: bool = False  # fp32 norm weights: norm outputs are fp32 (stack casts)
    # bitsandbytes 4-bit linears return their input's dtype (nn/modules.py Linear4bit.forward):
    # fed fp32 norm outputs, the MLP and the attention projections run in fp32
    mlp_bytes: int = 0  # MLP intermediates (0: act_bytes)
    attn_bytes: int = 0  # q, k, v and the attention output kept for backward (0: act_bytes)

    @property
    def mlp(self) -> int:
        return self.mlp_bytes or self.act_bytes

    @property
    def attn(self) -> int:
        return self.attn_bytes or self.act_bytes


def dtypes_for(cfg: RunConfig) -> Dtypes:
    """The dtypes of ``cfg``'s method × precision × ZeRO, after its stack's casts."""
    return _stack_casts(cfg, _convention_dtypes(cfg))


def _convention_dtypes(cfg: RunConfig) -> Dtypes:
    half = cfg.precision in ("bf16", "fp16")
    if cfg.precision == "fp32":
        return Dtypes(4, 4, 4, 0, 4, 4, 4, False)
    if cfg.precision == "pure-bf16":
        return Dtypes(2, 2, 2, 0, 2, 2, 2, False)
    assert half
    if cfg.zero > 0:
        # DeepSpeed casts the whole module (adapters too) to 16-bit and keeps
        # fp32 master weights, fp32 gradient partitions and Adam states.
        return Dtypes(2, 2, 2, 4, 4, 2, 2, False)
    if cfg.method in ("lora", "qlora"):
        # 16-bit base, fp32 adapters (their grads and Adam states fp32).
        return Dtypes(2, 4, 4, 0, 4, 2, 2, True)
    # Plain AMP: fp32 module, autocast to 16-bit.
    return Dtypes(4, 4, 4, 0, 4, 2, 4, True)


def _stack_casts(cfg: RunConfig, dt: Dtypes) -> Dtypes:
    """``dt`` after the stack's casts (memory/stacks.py): no autocast, fp32 embeddings or
    norms, 16-bit adapters."""
    fx = stack_effects(cfg)
    if not fx.autocast and dt.autocast:
        if cfg.method == "full":  # the model in its 16-bit dtype: pure 16-bit training
            dt = Dtypes(2, 2, 2, 0, 2, 2, 2, False)
        else:
            dt = replace(dt, autocast=False)
    if fx.adapters_16bit and cfg.method != "full":
        dt = replace(dt, trainable_bytes=2, grad_bytes=2, optim_elem_bytes=2)
    if "embeddings" in fx.fp32_groups:
        dt = replace(dt, resid_bytes=4)
    if "norms" in fx.fp32_groups:
        dt = replace(dt, norm_fp32=True)
    if cfg.method == "qlora" and (dt.norm_fp32 or dt.resid_bytes == 4):
        # 4-bit linears fed fp32 return fp32: the MLP runs in fp32 and its fp32 output
        # turns the residual stream fp32; SDPA under autocast casts q, k, v back to 16-bit
        dt = replace(dt, mlp_bytes=4, resid_bytes=4, attn_bytes=0 if dt.autocast else 4)
    return dt


def saved_copy_dtypes(cfg: RunConfig, dt: Dtypes) -> Dtypes:
    """The dtypes of PEFT ``modules_to_save`` copies (models/saved_modules.py): PEFT makes
    each a ``copy.deepcopy`` of the module (peft/utils/other.py ModulesToSaveWrapper.update)
    and upcasts only its tuner layers' adapters (tuners_utils.py cast_adapter_dtype skips
    the wrapper), so the copy keeps the module's dtype, its gradient too, and torch's
    AdamW makes its states like their parameter (zeros_like). Where the run's trainable
    parameters share one dtype anyway, the copies take it: DeepSpeed ZeRO (16-bit module,
    fp32 master and states), fp32 and pure-bf16 runs, LLaMA-Factory (model/adapter.py
    init_adapter: cast_trainable_params_to_fp32 upcasts every trainable parameter outside
    ZeRO-3/FSDP/pure_bf16) and PEFT's prepare_model_for_kbit_training before the copy
    (every 16-bit parameter made fp32)."""
    fx = stack_effects(cfg)
    if cfg.stack == "unsloth":
        from ..errors import ConfigError

        # unsloth models/llama.py get_peft_model: a trained embed_tokens / lm_head copy is
        # recast ("mixed precision") and the frozen original moved to the CPU
        raise ConfigError(
            f"lora.modules_to_save {list(cfg.lora.modules_to_save)} with the unsloth stack: "
            "not supported yet (Unsloth moves the frozen original to the CPU and recasts the "
            "trained copy); estimate with another stack as an upper bound, or drop the list")
    if cfg.zero or cfg.precision in ("fp32", "pure-bf16") or cfg.stack == "llamafactory":
        return dt
    if fx.setup_upcast:
        return replace(dt, trainable_bytes=4, grad_bytes=4, optim_elem_bytes=4, master_bytes=0)
    model = dt.base_weight_bytes
    return replace(dt, trainable_bytes=model, grad_bytes=model, optim_elem_bytes=model,
                   master_bytes=0)
