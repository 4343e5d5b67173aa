"""Pre-quantized checkpoints: ``quantization_config`` read, and the bytes each
storage format keeps per linear layer (torch-free).

A checkpoint whose ``config.json`` carries ``quantization_config`` is loaded by
transformers with that method's layers in place of ``nn.Linear``; their
buffers, not 16-bit weights, are what sits on the GPU. The byte counts below
follow the buffers each layer class registers (K = in_features, N =
out_features, g = group size):

- GPTQ, gptqmodel ``GPTQQuantLinear._register_gptq_buffers``
  (gptqmodel/nn_modules/qlinear/__init__.py), the layer transformers 5 builds:
  ``qweight`` int32 [K·bits/32, N], ``qzeros`` int32 [⌈K/g⌉, N·bits/32],
  ``scales`` fp16 [⌈K/g⌉, N], ``g_idx`` int32 [K] (always, desc_act or not),
  ``bias`` fp16 [N].
- AWQ, AutoAWQ ``WQLinear_GEMM`` (awq/modules/linear/gemm.py) and gptqmodel's
  AWQ GEMM layer: ``qweight`` int32 [K, N·bits/32], ``qzeros`` int32 [K/g,
  N·bits/32], ``scales`` fp16 [K/g, N], ``bias`` fp16 [N].
- AQLM, aqlm ``QuantizedLinear`` (aqlm/inference.py): ``codes`` [N/og, K/ig,
  C] in the smallest int holding nbits (aqlm.utils.get_int_dtype), ``codebooks``
  fp16 [C, 2^nbits, og, ig], ``scales`` fp16 [N/og], ``bias`` fp16 [N].
- HQQ, hqq ``HQQLinear`` with hqq.core.bitpack: 8/4/2/1-bit codes packed into
  uint8, 3-bit ten to an int32, 6-bit five to an int32 (5-bit taken as six to
  an int32); a scale and a zero per group of ``group_size`` in the compute
  dtype (quant_zero/quant_scale off, as transformers and LLaMA-Factory set).
- bitsandbytes (pre-quantized or on the fly): NF4/FP4 two codes per byte with
  one absmax per 64 (double quantization: uint8 absmax + fp32 per 256 blocks),
  bitsandbytes functional.quantize_4bit; LLM.int8 int8 [N, K] + fp32 row scale.
- FP8, transformers ``FP8Linear`` (integrations/finegrained_fp8.py):
  float8 weight [N, K], fp32 ``weight_scale_inv`` per weight_block_size block
  (one per tensor without blocks).
- EETQ, eetq ``EetqLinear``: int8 weight [K, N] + fp16 per-channel scale.
- compressed-tensors ``pack-quantized`` (int4/int8 packed in int32, a scale per
  group in the checkpoint dtype, packed zero points when asymmetric),
  ``float-quantized``/``int-quantized`` (one byte per weight + scales).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import ModelConfigError

METHODS = ("gptq", "awq", "aqlm", "hqq", "bitsandbytes", "fp8", "compressed-tensors", "eetq")

# bitsandbytes 4-bit block and double-quantization block (functional.quantize_4bit,
# blocksize=64; compress_statistics quantizes the absmax in blocks of 256)
BNB4_BLOCK = 64
BNB4_DQ_BLOCK = 256
HQQ_DEFAULT_GROUP = 64  # transformers HqqConfig(group_size=64)
FP8_DEFAULT_BLOCK = (128, 128)  # transformers FineGrainedFP8Config(weight_block_size=(128, 128))
# HQQ code bits actually stored per weight (hqq.core.bitpack word layouts)
HQQ_STORED_BITS = {8: 8.0, 6: 32 / 5, 5: 32 / 6, 4: 4.0, 3: 3.2, 2: 2.0, 1: 1.0}


@dataclass(frozen=True)
class QuantSpec:
    """How a checkpoint's linear layers are stored (one quantization_config)."""

    method: str  # one of METHODS
    bits: int = 4
    group_size: int = 0  # 0: one group per input row (GPTQ/AWQ group_size -1)
    desc_act: bool = False
    sym: bool = True
    zero_point: bool = True  # asymmetric formats store zero points
    scale_bytes: int = 2  # fp16/bf16 scales; fp32 = 4
    fmt: str = ""  # gemm/gemv (AWQ), nf4/fp4/int8 (bnb), pack-quantized/... (compressed-tensors)
    double_quant: bool = False  # bitsandbytes 4-bit
    block_size: tuple[int, int] = (0, 0)  # FP8 weight_block_size; (0, 0): per tensor
    codebooks: int = 1  # AQLM
    codebook_bits: int = 16
    in_group_size: int = 8
    out_group_size: int = 1
    modules_to_not_convert: tuple[str, ...] = field(default=())
    quantized_modules: tuple[str, ...] = field(default=())  # GPTQ modules_in_block_to_quantize
    notes: tuple[str, ...] = field(default=(), compare=False)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        d = asdict(self)
        d["block_size"] = list(self.block_size)
        d["modules_to_not_convert"] = list(self.modules_to_not_convert)
        d["quantized_modules"] = list(self.quantized_modules)
        d["notes"] = list(self.notes)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QuantSpec:
        data = dict(data)
        data["block_size"] = tuple(data.get("block_size", (0, 0)))
        data["modules_to_not_convert"] = tuple(data.get("modules_to_not_convert", ()))
        data["quantized_modules"] = tuple(data.get("quantized_modules", ()))
        data["notes"] = tuple(data.get("notes", ()))
        return cls(**data)

    @property
    def label(self) -> str:
        """A short human name: "GPTQ 4-bit g128", "AWQ 4-bit g128", "FP8"."""
        if self.method == "fp8":
            return "FP8"
        group = f" g{self.group_size}" if self.group_size else ""
        name = {"bitsandbytes": "bitsandbytes", "compressed-tensors": "compressed-tensors"}
        return f"{name.get(self.method, self.method.upper())} {self.bits}-bit{group}"

    def linear_bytes(self, in_features: int, out_features: int, bias: bool = False) -> float:
        """Bytes one converted linear layer keeps on the GPU (see the module docstring);
        fractional where a format's block counts are averaged (bitsandbytes absmax)."""
        k, n = in_features, out_features
        return _STORAGE[self.method](self, k, n) + (2 * n if bias else 0)

    def skips(self, linear_name: str) -> bool:
        """Whether this canonical linear stays in 16-bit (modules_to_not_convert, or
        not among GPTQ's modules_in_block_to_quantize)."""
        if self.quantized_modules and linear_name not in self.quantized_modules:
            return True
        for pattern in self.modules_to_not_convert:
            if re.search(r"\.\d+\.", pattern):
                continue  # one layer's module ("model.layers.0.mlp.down_proj"): not modelled
            if pattern.rstrip(".*").split(".")[-1] == linear_name:
                return True
        return False


def _groups(q: QuantSpec, k: int) -> int:
    return math.ceil(k / q.group_size) if q.group_size else 1


def _gptq_bytes(q: QuantSpec, k: int, n: int) -> float:
    g = _groups(q, k)
    return k * n * q.bits / 8 + g * n * q.bits / 8 + g * n * q.scale_bytes + 4 * k


def _awq_bytes(q: QuantSpec, k: int, n: int) -> float:
    g = _groups(q, k)
    return k * n * q.bits / 8 + g * n * q.bits / 8 + g * n * q.scale_bytes


def _aqlm_bytes(q: QuantSpec, k: int, n: int) -> float:
    code_bytes = 1 if q.codebook_bits <= 8 else 2 if q.codebook_bits <= 16 else 4
    codes = (n // q.out_group_size) * (k // q.in_group_size) * q.codebooks * code_bytes
    books = q.codebooks * 2**q.codebook_bits * q.out_group_size * q.in_group_size * 2
    return codes + books + 2 * (n // q.out_group_size)


def _hqq_bytes(q: QuantSpec, k: int, n: int) -> float:
    stored = HQQ_STORED_BITS.get(q.bits, float(q.bits))
    groups = k * n / (q.group_size or HQQ_DEFAULT_GROUP)
    return k * n * stored / 8 + 2 * groups * q.scale_bytes


def _bnb_bytes(q: QuantSpec, k: int, n: int) -> float:
    if q.bits == 8:
        return k * n + 4 * n  # Int8Params + SCB row scales
    blocks = k * n / BNB4_BLOCK
    absmax = blocks + 4 * blocks / BNB4_DQ_BLOCK if q.double_quant else 4 * blocks
    return k * n / 2 + absmax


def _fp8_bytes(q: QuantSpec, k: int, n: int) -> float:
    bn, bk = q.block_size
    scales = math.ceil(n / bn) * math.ceil(k / bk) if bn and bk else 1
    static = 4 if q.fmt == "static" else 0  # FP8Linear.activation_scale, fp32 scalar
    return k * n + 4 * scales + static


def _eetq_bytes(q: QuantSpec, k: int, n: int) -> float:
    return k * n + 2 * n


def _compressed_bytes(q: QuantSpec, k: int, n: int) -> float:
    g = _groups(q, k)
    if q.fmt == "pack-quantized":
        zeros = 0 if q.sym else math.ceil(n * q.bits / 32) * 4 * g
        return k * n * q.bits / 8 + n * g * q.scale_bytes + zeros + 16  # + weight_shape int64[2]
    return k * n * max(q.bits, 8) / 8 + n * g * q.scale_bytes


_STORAGE = {"gptq": _gptq_bytes, "awq": _awq_bytes, "aqlm": _aqlm_bytes, "hqq": _hqq_bytes,
            "bitsandbytes": _bnb_bytes, "fp8": _fp8_bytes, "eetq": _eetq_bytes,
            "compressed-tensors": _compressed_bytes}


# ---- reading quantization_config ------------------------------------------------


def _int(value: Any, default: int) -> int:
    return default if value is None else int(value)


def _group(value: Any) -> int:
    group = _int(value, 0)
    return group if group > 0 else 0  # -1: one group per input row


def _names(value: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in value or ())


def _gptq(c: dict[str, Any]) -> QuantSpec:
    notes = []
    if c.get("is_marlin_format") or c.get("checkpoint_format") == "marlin":
        notes.append("GPTQ Marlin-format checkpoint counted with the GPTQ buffer layout "
                     "(Marlin drops qzeros and g_idx: within 1%)")
    if c.get("dynamic"):
        notes.append("GPTQ 'dynamic' per-module overrides not read: every module at the "
                     "top-level bits/group_size")
    quantized = [name.split(".")[-1] for block in c.get("modules_in_block_to_quantize") or ()
                 for name in (block if isinstance(block, list) else [block])]
    skip = _names(c.get("modules_to_not_convert"))
    return QuantSpec("gptq", bits=_int(c.get("bits"), 4), group_size=_group(c.get("group_size", 128)),
                     desc_act=bool(c.get("desc_act", False)), sym=bool(c.get("sym", True)),
                     fmt=str(c.get("checkpoint_format") or "gptq"),
                     modules_to_not_convert=skip, quantized_modules=tuple(quantized),
                     notes=tuple(notes))


def _awq(c: dict[str, Any]) -> QuantSpec:
    return QuantSpec("awq", bits=_int(c.get("bits", c.get("w_bit")), 4),
                     group_size=_group(c.get("group_size", c.get("q_group_size", 128))),
                     zero_point=bool(c.get("zero_point", True)), sym=not c.get("zero_point", True),
                     fmt=str(c.get("version") or c.get("format") or "gemm").lower(),
                     modules_to_not_convert=_names(c.get("modules_to_not_convert")))


def _aqlm(c: dict[str, Any]) -> QuantSpec:
    books, bits = _int(c.get("num_codebooks"), 1), _int(c.get("nbits_per_codebook"), 16)
    in_group = _int(c.get("in_group_size"), 8)
    skip = tuple(n.removesuffix(".weight") for n in _names(c.get("linear_weights_not_to_quantize")))
    return QuantSpec("aqlm", bits=max(1, round(books * bits / in_group)), codebooks=books,
                     codebook_bits=bits, in_group_size=in_group,
                     out_group_size=_int(c.get("out_group_size"), 1), modules_to_not_convert=skip)


def _hqq(c: dict[str, Any]) -> QuantSpec:
    weights = (c.get("quant_config") or {}).get("weight_quant_params") or c
    return QuantSpec("hqq", bits=_int(weights.get("nbits"), 4),
                     group_size=_int(weights.get("group_size"), HQQ_DEFAULT_GROUP),
                     modules_to_not_convert=_names(c.get("skip_modules")))


def _bnb(c: dict[str, Any]) -> QuantSpec:
    eight = bool(c.get("load_in_8bit") or c.get("_load_in_8bit"))
    skip = _names(c.get("llm_int8_skip_modules") or c.get("modules_to_not_convert"))
    return QuantSpec("bitsandbytes", bits=8 if eight else 4,
                     fmt="int8" if eight else str(c.get("bnb_4bit_quant_type") or "fp4"),
                     double_quant=bool(c.get("bnb_4bit_use_double_quant", False)),
                     modules_to_not_convert=skip)


def _fp8(c: dict[str, Any]) -> QuantSpec:
    block = c.get("weight_block_size")
    skip = _names(c.get("modules_to_not_convert") or c.get("ignored_layers"))
    notes = () if block else ("FP8 without weight_block_size: one fp32 scale per weight",)
    return QuantSpec("fp8", bits=8, block_size=tuple(block) if block else (0, 0),
                     fmt=str(c.get("activation_scheme") or "dynamic"),
                     modules_to_not_convert=skip, notes=notes)


def _eetq(c: dict[str, Any]) -> QuantSpec:
    return QuantSpec("eetq", bits=8, modules_to_not_convert=_names(c.get("modules_to_not_convert")))


def _compressed(c: dict[str, Any]) -> QuantSpec:
    groups = [g for g in (c.get("config_groups") or {}).values() if g.get("weights")]
    if not groups:
        raise ValueError("config_groups has no weights scheme")
    w = groups[0]["weights"]
    strategy = str(w.get("strategy") or "tensor")
    group = _int(w.get("group_size"), 0) if strategy == "group" else 0
    notes = ("compressed-tensors: only the first config_group is read",) if len(groups) > 1 else ()
    return QuantSpec("compressed-tensors", bits=_int(w.get("num_bits"), 8), group_size=group,
                     sym=bool(w.get("symmetric", True)), fmt=str(c.get("format") or "pack-quantized"),
                     modules_to_not_convert=_names(c.get("ignore")), notes=notes)


_READERS = {"gptq": _gptq, "awq": _awq, "aqlm": _aqlm, "hqq": _hqq, "bitsandbytes": _bnb,
            "fp8": _fp8, "eetq": _eetq, "compressed-tensors": _compressed}


def quant_spec_from_config(qcfg: Any, where: str) -> tuple[QuantSpec | None, list[str]]:
    """(QuantSpec, notes) from a config.json's ``quantization_config``; (None, notes)
    for methods oomless does not model (their weights are then counted in 16-bit)."""
    if not isinstance(qcfg, dict):
        raise ModelConfigError(f"{where}: quantization_config must be a JSON object, got "
                               f"{type(qcfg).__name__}")
    method = str(qcfg.get("quant_method") or "").lower().replace("_", "-")
    if method == "compressed_tensors":
        method = "compressed-tensors"
    reader = _READERS.get(method)
    if reader is None:
        return None, [f"{where}: quantization_config quant_method '{method or '?'}' is not "
                      f"modelled (known: {', '.join(METHODS)}); its weights are counted in 16-bit"]
    try:
        return reader(qcfg), []
    except (TypeError, ValueError) as err:
        raise ModelConfigError(
            f"{where}: quantization_config ({method}) cannot be read: {err}. Fix the field "
            "from the checkpoint's released config.json") from None
