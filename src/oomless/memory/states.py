"""Model states per GPU: weights, LoRA adapters, gradients, master weights,
optimizer states, and how ZeRO shards them; the host RAM that offload needs."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import RunConfig
from ..errors import ConfigError
from ..knobs import OPTIMIZERS, offloaded_optimizer
from ..models.saved_modules import copies_note, saved_parts
from ..models.spec import LinearSpec, ModelSpec
from . import constants as C
from .moe_lora import expert_adapter_params, is_fused_expert_target
from .optimizer_states import (
    OptimizerBytes,
    adafactor_bytes,
    optimizer_state_bytes,
    trainable_tensors,
)
from .precision import Dtypes, saved_copy_dtypes
from .quantized import check_prequantized, quant_constant_bytes, quantized_weight_bytes
from .stacks import StackEffects, stack_effects
from .stages import score_head_param_delta
from .vision import vision_trainable_params
from .zero_buffers import Fsdp1Units, fsdp1_unsharded, fsdp2_gathered_bytes, zero_buffers

# Module names people write in LoRA target lists → our canonical names
# (ChatGLM, Phi-2, GPT-2, Mixtral-legacy, InternLM spellings).
TARGET_ALIASES = {
    "query_key_value": "qkv_proj", "c_attn": "qkv_proj", "wqkv": "qkv_proj", "Wqkv": "qkv_proj",
    "dense": "o_proj", "out_proj": "o_proj", "wo": "o_proj", "c_proj": "o_proj",
    "dense_h_to_4h": "gate_up_proj", "dense_4h_to_h": "down_proj",
    "fc1": "up_proj", "fc2": "down_proj", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj",
}
_FUSED_PARTS = {"qkv_proj": {"q_proj", "k_proj", "v_proj"}, "gate_up_proj": {"gate_proj", "up_proj"}}
# nn.Linear modules that PEFT's "all-linear" reaches. Experts and routers are
# 3-D parameters in transformers ≥ 5 (e.g. MixtralExperts.gate_up_proj), not
# nn.Linear, so LoRA does not wrap them.
_LORA_ROLES = {"attn", "mlp", "shared_expert"}


def lora_targets(spec: ModelSpec, targets: list[str] | str) -> set[str]:
    """Canonical names of the linears of ``spec`` that LoRA wraps."""
    names = {lin.name for lin in spec.layer_linears() if lin.role in _LORA_ROLES}
    if targets == "all-linear":
        return names
    chosen: set[str] = set()
    for raw in targets:
        t = TARGET_ALIASES.get(raw, raw)
        if t == "gate_up_proj" and not spec.mlp_gated:
            t = "up_proj"
        hits = {n for n in names if n == t or t in _FUSED_PARTS.get(n, ())}
        if not hits and is_fused_expert_target(spec, raw):
            continue  # PEFT re-targets it on the fused expert parameters (memory/moe_lora.py)
        if not hits:
            raise ConfigError(
                f"LoRA target '{raw}' matches no linear layer of {spec.name}; "
                f"its linear layers are {', '.join(sorted(names))} (or use 'all-linear')"
            )
        chosen |= hits
    return chosen


def lora_params(spec: ModelSpec, r: int, targets: set[str]) -> int:
    """r·(in + out) per wrapped matrix (PEFT lora_A: in→r, lora_B: r→out, no bias)."""
    total = 0
    for moe in _layer_kinds(spec):
        n_layers, is_moe = moe
        per_layer = sum(
            r * (lin.in_features + lin.out_features) * lin.count
            for lin in spec.layer_linears(is_moe)
            if lin.name in targets and lin.role in _LORA_ROLES
        )
        total += n_layers * per_layer
    return total


def _layer_kinds(spec: ModelSpec) -> list[tuple[int, bool]]:
    moe = spec.num_moe_layers
    return [(spec.num_layers - moe, False), (moe, True)]


def decoder_linear_weight_params(spec: ModelSpec) -> int:
    """Weights of the decoder's nn.Linear-like matrices (what 4/8-bit quantizes)."""
    return sum(
        n * sum(lin.weight_params for lin in spec.layer_linears(is_moe) if lin.role != "router")
        for n, is_moe in _layer_kinds(spec)
    )


def largest_module_params(spec: ModelSpec) -> int:
    """Largest module DeepSpeed ZeRO-3 gathers at once: a layer, the embedding or lm_head."""
    layer = max(spec.layer_params(False), spec.layer_params(True) if spec.is_moe else 0)
    return max(layer, spec.embedding_params, spec.lm_head_params)


def largest_linear_params(spec: ModelSpec) -> int:
    lins: list[LinearSpec] = spec.layer_linears()
    return max(lin.weight_params // lin.count for lin in lins)


def largest_trainable_tensor(spec: ModelSpec, cfg: RunConfig, targets: set[str]) -> int:
    """Elements of the largest trained parameter: a full model's embedding, lm_head or
    largest linear; LoRA's largest A or B matrix."""
    if cfg.method == "full":
        return max(spec.embedding_params, spec.lm_head_params, largest_linear_params(spec))
    sizes = [max(lin.in_features, lin.out_features) for lin in spec.layer_linears()
             if lin.name in targets]
    return cfg.lora.r * max(sizes, default=spec.hidden_size)


@dataclass
class States:
    """Per-GPU persistent bytes by category, host bytes, counts."""

    gpu: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0
    trainable_params: int = 0
    paged_bytes: int = 0  # paged optimizer states (CUDA unified memory, evictable)
    assumptions: list[str] = field(default_factory=list)


def fp32_upcast_params(spec: ModelSpec, fx: StackEffects) -> int:
    """Non-quantized parameters the stack casts to fp32 (StackEffects.fp32_groups)."""
    norms = (spec.num_layers * spec.norms_per_layer + 1) * spec.norm_params
    if spec.qk_norm:
        norms += spec.num_layers * 2 * spec.head_dim
    groups = {"embeddings": spec.embedding_params, "lm_head": spec.lm_head_params,
              "norms": norms}
    quantized = decoder_linear_weight_params(spec)
    groups["other"] = max(0, spec.param_count - quantized - sum(groups.values()))
    return sum(n for name, n in groups.items() if name in fx.fp32_groups)


def weight_bytes(spec: ModelSpec, cfg: RunConfig, dt: Dtypes) -> float:
    """Bytes of the base model's weights on one GPU before any ZeRO-3 sharding
    (quantized linears at their storage bytes: memory/quantized.py; the stack's
    fp32 upcasts: memory/stacks.py)."""
    upcast = max(0, 4 - dt.base_weight_bytes) * fp32_upcast_params(spec, stack_effects(cfg))
    return quantized_weight_bytes(spec, cfg, dt) + upcast


def qlora_gathered_bytes(spec: ModelSpec, cfg: RunConfig, dt: Dtypes) -> float:
    """The module ZeRO-3 / FSDP gathers at once under QLoRA: a decoder layer in packed
    4-bit (frozen: no gradient), or the 16-bit embedding or lm_head, plus the prefetch
    bucket of the next one."""
    layer = max(spec.layer_params(False), spec.layer_params(True) if spec.is_moe else 0)
    packed = 0.5 * layer
    largest = max(packed, 2 * spec.embedding_params, 2 * spec.lm_head_params)
    return largest + C.ZERO3_PREFETCH_FRACTION * spec.hidden_size**2 * 2


def optimizer_bytes(spec: ModelSpec, cfg: RunConfig, dt: Dtypes, targets: set[str],
                    trainable: int) -> OptimizerBytes:
    """State bytes of the optimizer's row in knobs.OPTIMIZERS over the trainable tensors
    (bitsandbytes' per-tensor rules: memory/optimizer_states.py)."""
    kind = OPTIMIZERS.get(cfg.optimizer)
    if kind is None:
        raise ConfigError(f"unknown optimizer '{cfg.optimizer}'; one of {', '.join(OPTIMIZERS)}")
    if kind.factored:
        return OptimizerBytes(adafactor_bytes(spec, cfg, targets, _LORA_ROLES), 0.0)
    tensors = trainable_tensors(spec, cfg, targets, _LORA_ROLES, trainable)
    return optimizer_state_bytes(kind, tensors, dt.optim_elem_bytes)


def model_states(spec: ModelSpec, cfg: RunConfig, dt: Dtypes) -> States:
    """Persistent per-GPU bytes of weights, adapters, grads, master and optimizer."""
    check_prequantized(spec, cfg)
    st = States()
    targets = lora_targets(spec, cfg.lora.targets) if cfg.method != "full" else set()
    adapter, trainable, head_weights = _trained_params(spec, cfg, targets)
    st.trainable_params = trainable
    weights = weight_bytes(spec, cfg, dt) + head_weights * dt.base_weight_bytes
    buffers = zero_buffers(cfg.zero, cfg.deepspeed.model_dump(), spec.hidden_size,
                           largest_module_params(spec), dt.grad_bytes, dt.base_weight_bytes)
    fsdp = cfg.training.engine == "fsdp" or cfg.fsdp.version is not None  # no DeepSpeed buckets
    if cfg.zero and not fsdp:
        st.assumptions.extend(buffers.notes)
    shard3 = cfg.world_size if cfg.zero == 3 else 1  # ZeRO-3 partitions the parameters
    _sharded_weights(st, spec, cfg, dt, weights, buffers.gathered_bytes)
    if adapter:
        st.gpu["lora_adapters"] = round(adapter * dt.trainable_bytes / shard3)
    _optimizer_side(st, spec, cfg, dt, targets, trainable)
    if cfg.offload == "all":  # ZeRO-3 parameter offload
        st.host_bytes += round(weights / cfg.world_size * cfg.hardware.gpus_per_node)
    _gradients(st, spec, cfg, dt, targets, trainable, buffers.gradient_staging_bytes
               if cfg.zero and not fsdp else 0)
    _saved_copies(st, spec, cfg, dt)
    return st


def _saved_copies(st: States, spec: ModelSpec, cfg: RunConfig, dt: Dtypes) -> None:
    """PEFT modules_to_save (models/saved_modules.py): each copy's weights, gradients,
    master weights and optimizer states, sharded as the run's other trainable parameters,
    in the copies' dtypes (precision.saved_copy_dtypes)."""
    if cfg.method == "full" or not cfg.lora.modules_to_save:
        return
    parts = saved_parts(spec, cfg.lora.modules_to_save)
    copies, cdt, side = sum(p.params for p in parts), saved_copy_dtypes(cfg, dt), States()
    _optimizer_side(side, spec, cfg, cdt, set(), copies)
    _gradients(side, spec, cfg, cdt, set(), copies, 0)
    st.gpu["saved_modules"] = round(copies * cdt.trainable_bytes
                                    / (cfg.world_size if cfg.zero == 3 else 1))
    for key, value in side.gpu.items():
        st.gpu[key] = st.gpu.get(key, 0) + value
    st.host_bytes, st.paged_bytes = st.host_bytes + side.host_bytes, st.paged_bytes + side.paged_bytes
    st.trainable_params += copies
    st.assumptions += [a for a in side.assumptions if a not in st.assumptions]
    st.assumptions.append(f"{copies_note(parts)}: weights {cdt.trainable_bytes} B, gradients "
                          f"{cdt.grad_bytes} B, optimizer states {cdt.optim_elem_bytes} B an "
                          f"element{', fp32 master weights' if cdt.master_bytes else ''}")


def _trained_params(spec: ModelSpec, cfg: RunConfig, targets: set[str]) -> tuple[int, int, int]:
    """(adapter parameters: LoRA's, PEFT's on fused experts, a reward model's score head and
    the vision tower's; trainable parameters; score-head weights, trained or not)."""
    head_weights, head_trained = score_head_param_delta(spec, cfg)  # rm: score head, no lm_head
    vision = vision_trainable_params(spec, cfg)  # tower adapters, or a frozen tower (full FT)
    if cfg.method == "full":  # no adapters (PEFT wraps no experts either)
        return 0, spec.param_count + head_trained + vision, head_weights
    adapter = lora_params(spec, cfg.lora.r, targets) if targets else 0
    adapter += expert_adapter_params(spec, cfg)  # PEFT's ParamWrapper on fused experts
    adapter += head_trained + vision
    return adapter, adapter, head_weights


def _sharded_weights(st: States, spec: ModelSpec, cfg: RunConfig, dt: Dtypes, weights: float,
                     zero3_gathered_bytes: int) -> None:
    """The weights' share per GPU and, under ZeRO-3 / FSDP, what is gathered at once."""
    shard3 = cfg.world_size if cfg.zero == 3 else 1
    replicated = quant_constant_bytes(spec, cfg) if cfg.zero == 3 else 0
    st.gpu["weights"] = 0 if cfg.offload == "all" else round((weights - replicated) / shard3
                                                             + replicated)
    if cfg.zero == 3 and cfg.fsdp.version == 1 and cfg.offload == "all" and replicated:
        # FSDP1 moves the module to device_id before flattening (fsdp/_init_utils.py
        # _move_states_to_device: param.data = param.to(device)), and Params4bit.to moves its
        # QuantState along (bitsandbytes 0.50 nn/modules.py); offload then moves only the
        # flat parameters to the CPU (_init_param_handle_from_module: flat_param_to(cpu))
        st.gpu["weights"] = round(replicated)
        st.assumptions.append("FSDP1 offload_params: bitsandbytes' quantization constants "
                              "(QuantState, not parameters) stay on every GPU")
    if cfg.zero == 3 and cfg.fsdp.version == 1:
        gathered, notes = fsdp1_unsharded(fsdp1_units(spec, cfg, dt), cfg.world_size,
                                          cfg.fsdp.model_dump(), cfg.offload == "all")
        st.gpu["zero3_gathered"] = gathered
        st.assumptions.extend(notes)
    elif cfg.zero == 3 and cfg.method == "qlora":
        st.gpu["zero3_gathered"] = round(qlora_gathered_bytes(spec, cfg, dt))
        st.assumptions.append(
            "QLoRA sharded (ZeRO-3 / FSDP, bnb_4bit_quant_storage "
            f"{cfg.quant_storage}): the packed 4-bit weights and 16-bit parameters are "
            "sharded, the quantization constants (absmax) stay on every GPU; the largest "
            "module (a layer in packed 4-bit, or the 16-bit embedding / lm_head) is gathered, "
            "plus a prefetch bucket of 0.9·hidden² elements")
    elif cfg.zero == 3 and (cfg.training.engine == "fsdp" or cfg.fsdp.version == 2):
        layer = max(spec.layer_params(False), spec.layer_params(True) if spec.is_moe else 0)
        root = spec.embedding_params + spec.lm_head_params + spec.norm_params
        st.gpu["zero3_gathered"] = fsdp2_gathered_bytes(
            root, layer, dt.base_weight_bytes, dt.grad_bytes, cfg.method == "full")
        st.assumptions.append(
            "FSDP2 (fully_shard per decoder layer, then the model): the root group (embedding, "
            "LM head, final norm) stays gathered through forward and backward, two layers are "
            "gathered at once (prefetch), unsharded gradients wait for the reduce-scatter")
    elif cfg.zero == 3:
        st.gpu["zero3_gathered"] = zero3_gathered_bytes
        st.assumptions.append(
            "ZeRO-3: the largest module (layer, embedding or lm_head) is gathered with its "
            "16-bit gradient (DeepSpeed's estimator counts 4 B/param) plus the prefetch")


# bytes per element of bnb_4bit_quant_storage (bitsandbytes Params4bit quant_storage)
_STORAGE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1}


def fsdp1_units(spec: ModelSpec, cfg: RunConfig, dt: Dtypes) -> Fsdp1Units:
    """FSDP1's flat parameters as accelerate wraps the model (TRANSFORMER_BASED_WRAP by the
    decoder layer class; the root holds the rest). QLoRA: bitsandbytes packs two 4-bit codes
    per byte into ``quant_storage`` elements (Params4bit), so a quantized linear is
    in·out/2 bytes of flat parameter; FSDP1 flattens only same-dtype tensors
    (FlatParamHandle._validate_tensors_to_flatten), which is why the storage is a float.
    LoRA: transformers (distributed/fsdp.py update_fsdp_plugin_peft) wraps each trainable
    adapter layer as its own unit (PEFT fsdp_auto_wrap_policy), so no unit mixes frozen and
    trained parameters (which use_orig_params would otherwise give whole-unit gradients);
    a layer's adapters are counted together as its trained unit."""
    layer = max(spec.layer_params(False), spec.layer_params(True) if spec.is_moe else 0)
    root = spec.embedding_params + spec.lm_head_params + spec.norm_params
    trained_root = root if cfg.method == "full" else 0
    if cfg.method == "full":
        return Fsdp1Units(root, layer, dt.base_weight_bytes, trained_root, layer, dt.grad_bytes)
    targets = lora_targets(spec, cfg.lora.targets)
    adapters = lora_params(spec, cfg.lora.r, targets) // max(1, spec.num_layers)
    if cfg.method != "qlora":
        return Fsdp1Units(root, layer, dt.base_weight_bytes, 0, adapters, dt.grad_bytes)
    elem = _STORAGE_BYTES[cfg.quant_storage]
    linears = max(sum(lin.in_features * lin.out_features * lin.count
                      for lin in spec.layer_linears(moe)) for moe in {False, spec.is_moe})
    packed = -(-linears // (2 * elem))  # two codes per byte
    rest = round((layer - linears) * dt.base_weight_bytes / elem)
    return Fsdp1Units(round(root * dt.base_weight_bytes / elem), packed + rest, elem, 0,
                      adapters, dt.grad_bytes)


def _stepped_config(st: States, cfg: RunConfig) -> RunConfig:
    """The run with the optimizer DeepSpeed actually steps (CPU-Adam under offload)."""
    if cfg.offload not in ("optimizer", "all"):
        return cfg
    stepped = cfg.model_copy(update={"optimizer": offloaded_optimizer(cfg.optimizer).name})
    if stepped.optimizer != cfg.optimizer:
        st.assumptions.append(
            f"optimizer offload: DeepSpeed steps CPU-Adam ({stepped.optimizer}), not "
            f"{cfg.optimizer}: it refuses a client optimizer with ZeRO-Offload "
            "(deepspeed runtime/engine.py, zero_force_ds_cpu_optimizer)")
    return stepped


def _optimizer_side(st: States, spec: ModelSpec, cfg: RunConfig, dt: Dtypes, targets: set[str],
                    trainable: int) -> None:
    """Optimizer states, fp32 master weights and ZeRO's fp32 gradient partition: on the
    GPU (sharded by ZeRO-1+), paged by bitsandbytes, or in host RAM under offload."""
    stepped = _stepped_config(st, cfg)
    states = optimizer_bytes(spec, stepped, dt, targets, trainable)
    opt = states.device + states.paged
    if OPTIMIZERS[stepped.optimizer].eight_bit:
        st.assumptions.append(
            f"8-bit optimizer states: tensors under {C.ADAM8BIT_MIN_SIZE:,} elements (norms, "
            "biases, narrow LoRA matrices) keep fp32 states (bitsandbytes min_8bit_size); "
            "tensors the model's shapes do not name are counted as large")
    shard_opt = cfg.world_size if cfg.zero >= 1 else 1  # ZeRO-1+ partitions optimizer states
    master = trainable * dt.master_bytes
    fp32_grad_partition = trainable * 4 if cfg.zero >= 1 else 0
    if cfg.offload in ("optimizer", "all"):
        optimizer_side = (opt + master + fp32_grad_partition) / shard_opt
        st.host_bytes += round(optimizer_side * cfg.hardware.gpus_per_node)
        st.assumptions.append(
            "optimizer offload: fp32 master weights, fp32 gradient partitions and "
            "optimizer states live in pinned host RAM (DeepSpeed ZeRO-Offload)"
        )
        return
    paged = OPTIMIZERS[cfg.optimizer].paged
    if paged:
        st.paged_bytes = round(states.paged / shard_opt)
    st.gpu["optimizer"] = round((states.device if paged else opt) / shard_opt)
    st.gpu["master_weights"] = round(master / shard_opt)
    st.gpu["grad_partition_fp32"] = round(fp32_grad_partition / shard_opt)
    if paged:
        st.assumptions.append(
            "paged optimizer: bitsandbytes keeps the states of tensors of 100,000 elements "
            "or more in CUDA unified memory, outside PyTorch's allocator; they count on the "
            "device until memory runs short, then page to host, so they are not counted "
            "against the fit (smaller tensors' states are ordinary device memory)"
        )


def _gradients(st: States, spec: ModelSpec, cfg: RunConfig, dt: Dtypes, targets: set[str],
               trainable: int, staging_bytes: int) -> None:
    """The gradients per GPU (ZeRO-2/3: a partition, plus DeepSpeed's ``staging_bytes``)
    and DDP's bucket copy."""
    n = cfg.world_size
    grads = trainable * dt.grad_bytes
    # ZeRO-2/3 keep each rank's gradient partition; ZeRO-1+ adds DeepSpeed's staging
    # buffer(s) of reduce_bucket_size elements (memory/zero_buffers.py)
    shard_grads = n if cfg.zero >= 2 else 1
    st.gpu["gradients"] = round(grads / shard_grads + staging_bytes)
    if cfg.fsdp.version == 1 and cfg.offload == "all" and cfg.zero == 3:
        # FSDP1 CPUOffload(offload_params=True): _offload_grad copies each sharded gradient
        # into the flat parameter's pinned ``_cpu_grad`` (torch fsdp/_runtime_utils.py)
        st.gpu["gradients"] = 0
        st.host_bytes += round(grads / n * cfg.hardware.gpus_per_node)
    if stack_effects(cfg).optimizer_in_bwd:
        # torchtune training/memory.py register_optim_in_bwd_hooks: each gradient is
        # stepped and freed as soon as it is accumulated: the largest one at a time
        st.gpu["gradients"] = round(min(grads, largest_trainable_tensor(spec, cfg, targets)
                                        * dt.grad_bytes))
    if cfg.zero == 0 and n > 1:
        # torch DDP copies gradients into flat buckets (gradient_as_bucket_view=False,
        # the HF/accelerate default): a second copy of all trainable gradients.
        st.gpu["ddp_buckets"] = round(grads)
        st.assumptions.append(
            "DDP: gradient buckets hold a second copy of the gradients "
            "(gradient_as_bucket_view=False, the default)"
        )
