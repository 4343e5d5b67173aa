"""Quantized base weights in training: pre-quantized checkpoints (GPTQ, AWQ,
AQLM, HQQ, bitsandbytes, FP8, compressed-tensors, EETQ) and on-the-fly
quantization (``method: qlora`` with bitsandbytes, HQQ or EETQ).

Three things differ from a 16-bit base: the weight storage (the layer's
buffers, models/quantization.py), the 16-bit copies of weights the training
kernel makes, and what a stack does to the checkpoint before training. The
kernel rows below say, per method, which layer runs in training and what it
allocates (each from the code that runs):

- GPTQ: transformers 5 builds gptqmodel layers; every trainable GPTQ kernel
  trains through ``TorchLinear._forward_eager`` (gptqmodel/nn_modules/qlinear/
  torch.py; tritonv2.py falls back to it when ``self.training``): the weight is
  dequantized to the input's dtype and multiplied with ``torch.matmul``.
  Autograd keeps that 16-bit weight for the input gradient wherever the input
  needs one, so every quantized linear holds a 16-bit copy from its forward to
  its backward (LLaMA-Factory loads GPTQ with ``use_exllama: False``).
- AWQ: gptqmodel's ``AwqGemmFn`` (gemm_awq.py) saves only the packed tensors;
  it dequantizes the weight in the forward (above 1024 rows) and again in the
  backward: one transient 16-bit weight per matmul.
- AQLM (aqlm ``_QuantizedMatmul``, matmat_dequant kernels), HQQ
  (``HQQMatmulNoCacheMul``, PyTorch backend), bitsandbytes (``MatMul4Bit``),
  FP8 (transformers ``FP8LinearFunction``: FP8 matmul forward, dequantized weight
  in the backward): one transient 16-bit weight per matmul.
- EETQ: a fused int8 GEMM, no 16-bit copy.
- compressed-tensors: decompressed to dense weights on the first forward
  (transformers quantizer_compressed_tensors.py), so training holds 16-bit weights.
- FP8 under LLaMA-Factory: loaded with ``FineGrainedFP8Config(dequantize=True)``
  when training (llamafactory/model/model_utils/quantization.py): 16-bit weights.

Each row also names PEFT's LoRA layer over the method's module (peft 0.21
tuners/lora/<peft_layer>.py) and whether it casts its input to the adapters' dtype
while autocast is on. The default layer (layer.py ``Linear.forward``, nn.Linear and
its subclasses: FP8Linear, dense weights) and gptq.py always do
(``self._cast_input_dtype(x, lora_A.weight.dtype)``): with fp32 adapters lora_A's
autocast casts the copy back, a 16-bit copy per adapter kept for backward. bnb.py,
awq.py, aqlm.py, eetq.py and hqq.py cast only when ``not torch.is_autocast_enabled()``:
under autocast the adapters keep the input itself (memory/activations.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import RunConfig
from ..errors import ConfigError
from ..models.quantization import QuantSpec
from ..models.spec import ModelSpec
from .precision import Dtypes


@dataclass(frozen=True)
class TrainingKernel:
    """What a quantized layer allocates in a training step."""

    name: str  # the kernel modelled
    saves_dequantized: bool = False  # a 16-bit weight copy kept from forward to backward
    transient_dequantized: bool = True  # one 16-bit weight copy while a matmul runs
    dense_in_training: bool = False  # the weights become dense 16-bit before training
    peft_layer: str = "layer"  # peft/tuners/lora/<peft_layer>.py wraps the module
    peft_casts_input: bool = True  # that layer casts its input under autocast too


KERNELS: dict[str, TrainingKernel] = {
    "gptq": TrainingKernel("gptqmodel TorchLinear (dequantize, then torch.matmul)",
                           saves_dequantized=True, transient_dequantized=False,
                           peft_layer="gptq"),
    "awq": TrainingKernel("gptqmodel AwqGemmFn (dequantized weight in forward and backward)",
                          peft_layer="awq", peft_casts_input=False),
    "aqlm": TrainingKernel("aqlm _QuantizedMatmul (matmat_dequant kernels)",
                           peft_layer="aqlm", peft_casts_input=False),
    "hqq": TrainingKernel("hqq HQQMatmulNoCacheMul (PyTorch backend)",
                          peft_layer="hqq", peft_casts_input=False),
    "bitsandbytes": TrainingKernel("bitsandbytes MatMul4Bit / MatMul8bitLt",
                                   peft_layer="bnb", peft_casts_input=False),
    "fp8": TrainingKernel("transformers FP8LinearFunction (dequantized weight in backward)"),
    "eetq": TrainingKernel("EETQ w8_a16_gemm (fused int8 GEMM)", transient_dequantized=False,
                           peft_layer="eetq", peft_casts_input=False),
    "compressed-tensors": TrainingKernel("compressed-tensors (decompressed on first forward)",
                                         transient_dequantized=False, dense_in_training=True),
}
# On-the-fly methods of RunConfig.quantization (LLaMA-Factory quantization_method).
_ON_THE_FLY = {"bnb": "bitsandbytes", "hqq": "hqq", "eetq": "eetq"}
HQQ_ON_THE_FLY_GROUP = 64  # transformers HqqConfig default group_size, which LLaMA-Factory keeps


def base_quantization(spec: ModelSpec, cfg: RunConfig) -> QuantSpec | None:
    """How the frozen base weights are stored in this run, or None (16-bit).

    A pre-quantized checkpoint wins over ``method: qlora`` (transformers keeps
    the checkpoint's own quantization_config)."""
    if spec.quantization is not None:
        return spec.quantization
    if cfg.method != "qlora":
        return None
    q = cfg.quantization
    method = _ON_THE_FLY[q.method]
    return QuantSpec(method=method, bits=q.bits, fmt=q.type if q.bits == 4 else "int8",
                     double_quant=q.double_quant,
                     group_size=HQQ_ON_THE_FLY_GROUP if method == "hqq" else 0)


def kernel(spec: ModelSpec, cfg: RunConfig) -> TrainingKernel | None:
    q = base_quantization(spec, cfg)
    if q is None:
        return None
    if q.method == "fp8" and spec.quantization is not None and cfg.stack == "llamafactory":
        return TrainingKernel("LLaMA-Factory dequantizes FP8 checkpoints for training",
                              transient_dequantized=False, dense_in_training=True)
    return KERNELS[q.method]


def lora_input_kept_uncast(spec: ModelSpec, cfg: RunConfig, linear_name: str) -> bool:
    """Whether PEFT's LoRA layer over the base linear ``linear_name`` passes its input
    to the adapters uncast under autocast (its kernel row's ``peft_casts_input``); a
    16-bit linear (no quantization, a skipped module, dense weights) gets PEFT's default
    layer, which casts."""
    q, k = base_quantization(spec, cfg), kernel(spec, cfg)
    if q is None or k is None or k.dense_in_training or q.skips(linear_name):
        return False
    return not k.peft_casts_input


def check_prequantized(spec: ModelSpec, cfg: RunConfig) -> None:
    """What transformers and LLaMA-Factory refuse for a pre-quantized checkpoint."""
    q = spec.quantization
    if q is None:
        return
    if cfg.method == "full":
        raise ConfigError(
            f"{spec.name} is a pre-quantized {q.label} checkpoint: its quantized weights cannot "
            "be trained (transformers' Trainer refuses purely quantized models); use method: "
            "lora (adapters on the quantized base), or the unquantized model for full fine-tuning")
    if cfg.zero == 3:
        raise ConfigError(
            f"{spec.name} is a pre-quantized {q.label} checkpoint: DeepSpeed ZeRO-3 and FSDP "
            "cannot shard quantized weights (LLaMA-Factory refuses it too); use zero: 2 or 0")


def _quantized_linears(spec: ModelSpec, q: QuantSpec) -> list[tuple[int, object]]:
    """(layers, LinearSpec) of every decoder linear the quantization converts."""
    moe = spec.num_moe_layers
    out = []
    for n_layers, is_moe in ((spec.num_layers - moe, False), (moe, True)):
        if not n_layers:
            continue
        for lin in spec.layer_linears(is_moe):
            if lin.role != "router" and not q.skips(lin.name):
                out.append((n_layers, lin))
    return out


def quantized_weight_bytes(spec: ModelSpec, cfg: RunConfig, dt: Dtypes) -> float:
    """Base weights on one GPU before sharding, with the quantized linears at their
    storage bytes and everything else (embeddings, lm_head, norms, vision tower,
    skipped modules) at the 16-bit base dtype."""
    q = base_quantization(spec, cfg)
    k = kernel(spec, cfg)
    if q is None or k is None or k.dense_in_training:
        return spec.param_count * dt.base_weight_bytes
    stored = params = 0
    for n_layers, lin in _quantized_linears(spec, q):
        stored += n_layers * lin.count * q.linear_bytes(lin.in_features, lin.out_features, lin.bias)
        params += n_layers * lin.params
    return stored + (spec.param_count - params) * dt.base_weight_bytes


def quant_constant_bytes(spec: ModelSpec, cfg: RunConfig) -> float:
    """QLoRA's bitsandbytes 4-bit quantization constants (absmax, double-quantized):
    kept in the QuantState beside the packed weight, not as parameters, so FSDP and
    ZeRO-3 shard only the packed data (bitsandbytes nn/modules.py Params4bit)."""
    q = base_quantization(spec, cfg)
    if q is None or q.method != "bitsandbytes" or q.bits != 4 or spec.quantization is not None:
        return 0.0
    return sum(n * lin.count * (q.linear_bytes(lin.in_features, lin.out_features)
                                - lin.in_features * lin.out_features / 2)  # minus packed codes
               for n, lin in _quantized_linears(spec, q))


def _largest_quantized(spec: ModelSpec, q: QuantSpec) -> int:
    linears = [lin for _, lin in _quantized_linears(spec, q)]
    return max((lin.weight_params // lin.count for lin in linears), default=0)


def transient_dequant_bytes(spec: ModelSpec, cfg: RunConfig, dt: Dtypes) -> int:
    """The 16-bit copy of one weight a dequantizing kernel holds during a matmul."""
    k = kernel(spec, cfg)
    if k is None or not k.transient_dequantized or k.dense_in_training:
        return 0
    return dt.act_bytes * _largest_quantized(spec, base_quantization(spec, cfg))


def saved_dequant_bytes(spec: ModelSpec, cfg: RunConfig, dt: Dtypes) -> dict[str, float]:
    """16-bit weights autograd keeps for backward (GPTQ's TorchLinear):
    ``layers`` for the whole forward, ``one_layer`` for one layer's recompute.

    Without gradient checkpointing nothing in layer 0 before its first LoRA
    output needs a gradient (frozen embeddings), so the attention input
    projections of layer 0 keep no copy; with checkpointing HF makes the
    embedding output require grad and only the recomputed layer keeps copies."""
    k = kernel(spec, cfg)
    if k is None or not k.saves_dequantized:
        return {"layers": 0.0, "one_layer": 0.0}
    q = base_quantization(spec, cfg)

    def layer_bytes(is_moe: bool) -> float:
        return dt.act_bytes * sum(lin.weight_params for lin in spec.layer_linears(is_moe)
                                  if lin.role != "router" and not q.skips(lin.name))

    dense, moe = layer_bytes(False), (layer_bytes(True) if spec.is_moe else 0.0)
    one_layer = max(dense, moe)
    if cfg.grad_ckpt:
        return {"layers": 0.0, "one_layer": one_layer}
    first_inputs = dt.act_bytes * sum(
        lin.weight_params for lin in spec.attention_linears()
        if lin.name in ("q_proj", "k_proj", "v_proj", "qkv_proj") and not q.skips(lin.name))
    n_moe = spec.num_moe_layers
    total = (spec.num_layers - n_moe) * dense + n_moe * moe
    return {"layers": total - first_inputs, "one_layer": one_layer}


def quantization_assumptions(spec: ModelSpec, cfg: RunConfig) -> list[str]:
    q = base_quantization(spec, cfg)
    if q is None:
        return []
    k = kernel(spec, cfg)
    source = "pre-quantized checkpoint" if spec.quantization is not None else "quantized on load"
    out = [f"base weights: {q.label} ({source}); training kernel modelled: {k.name}"]
    if k.dense_in_training:
        out.append("the quantized weights become dense 16-bit weights for training")
    elif spec.quantization is not None:
        out.append("embeddings, lm_head, norms, MoE routers, the vision tower and "
                   "modules_to_not_convert stay in 16-bit; per-linear storage from the "
                   "layer's buffers (not traced: transformers needs the quantization "
                   "library and a GPU to build these layers)")
    if spec.quantization is not None and cfg.method == "qlora":
        out.append("method qlora on a pre-quantized checkpoint: transformers keeps the "
                   "checkpoint's own quantization; the bitsandbytes settings are ignored")
    out += list(q.notes)
    return out
