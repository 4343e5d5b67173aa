"""Pre-quantized checkpoints and on-the-fly HQQ/EETQ: storage bytes against the
published checkpoint files and against transformers' own layers, the training
kernels' 16-bit copies, and what is refused."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from oomless.config import RunConfig
from oomless.errors import ConfigError, ModelConfigError
from oomless.memory import estimate_training
from oomless.memory.precision import dtypes_for
from oomless.memory.quantized import saved_dequant_bytes, transient_dequant_bytes
from oomless.memory.states import model_states
from oomless.models.catalog import get_entry
from oomless.models.hf_config import spec_from_hf_config
from oomless.models.quantization import QuantSpec, quant_spec_from_config
from oomless.models.spec import ModelSpec

DATA = json.loads((Path(__file__).parents[1] / "fixtures" / "quantized" /
                   "checkpoints.json").read_text())["checkpoints"]
GPTQ_4BIT = DATA[0]["quantization_config"]


def _checkpoint_spec(base: str, qcfg: dict, dtype: str = "float16") -> ModelSpec:
    config = copy.deepcopy(get_entry(base).config)
    config["quantization_config"] = copy.deepcopy(qcfg)
    config["torch_dtype"] = dtype
    return spec_from_hf_config(config, f"{base}-quantized")


def _weights(spec: ModelSpec, **cfg) -> int:
    run = RunConfig(model="x", **{"method": "lora", **cfg})
    return model_states(spec, run, dtypes_for(run)).gpu["weights"]


@pytest.mark.parametrize("ckpt", DATA, ids=[c["repo"] for c in DATA])
def test_weight_bytes_equal_the_published_checkpoint_files(ckpt):
    spec = _checkpoint_spec(ckpt["base"], ckpt["quantization_config"], ckpt["torch_dtype"])
    published = sum(ckpt["files_gb"]) * 1e9
    # the pages print 3 significant figures per file: ±0.005 GB each, plus the header
    tolerance = 0.005e9 * len(ckpt["files_gb"]) + 0.001e9
    assert abs(_weights(spec) - published) <= tolerance, (_weights(spec) / 1e9, published / 1e9)


def test_gptq_lora_uses_4bit_weights_not_bf16():
    """Issue 12: 'Llama-3-8B GPTQ LoRA: 19.9 GiB predicted' read the checkpoint as bf16."""
    gptq = _checkpoint_spec("meta-llama-3-8b-instruct", GPTQ_4BIT)
    plain = get_entry("meta-llama-3-8b-instruct").spec
    assert gptq.quantization.method == "gptq" and gptq.quantization.bits == 4
    assert _weights(gptq) < 0.36 * _weights(plain)
    cfg = RunConfig(model="x", method="lora", seq_len=1024, grad_ckpt=True)
    est, ref = estimate_training(gptq, cfg), estimate_training(plain, cfg)
    assert est.peak_allocated_bytes < 0.5 * ref.peak_allocated_bytes
    assert any("GPTQ 4-bit g128" in a and "TorchLinear" in a for a in est.assumptions)


def test_gptq_torch_kernel_keeps_16bit_weights_for_backward():
    """gptqmodel's TorchLinear multiplies by a dequantized 16-bit weight that autograd
    keeps for the input gradient: without checkpointing every quantized linear but
    layer 0's q/k/v holds one; with checkpointing only the recomputed layer."""
    spec = _checkpoint_spec("meta-llama-3-8b-instruct", GPTQ_4BIT)
    layer = sum(lin.weight_params for lin in spec.layer_linears())
    qkv = sum(lin.weight_params for lin in spec.attention_linears() if lin.name != "o_proj")
    for ckpt, layers, one in ((False, 2 * (32 * layer - qkv), 2 * layer), (True, 0, 2 * layer)):
        cfg = RunConfig(model="x", method="lora", grad_ckpt=ckpt)
        assert saved_dequant_bytes(spec, cfg, dtypes_for(cfg)) == {"layers": layers,
                                                                    "one_layer": one}
        assert transient_dequant_bytes(spec, cfg, dtypes_for(cfg)) == 0


def test_autograd_keeps_the_weight_of_a_matmul_whose_input_needs_a_gradient():
    """The mechanism behind the GPTQ rows: torch.matmul(x, w) with a weight that needs no
    gradient saves w (for grad_x = grad @ w.T), not x."""
    torch = pytest.importorskip("torch")
    saved = []
    x = torch.randn(4, 64, requires_grad=True)
    w = torch.randn(64, 32)  # the dequantized weight: a plain tensor, no grad
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torch.matmul(x, w).sum().backward()
    assert [t.data_ptr() for t in saved] == [w.data_ptr()]


@pytest.mark.parametrize(("method", "transient"), [("awq", True), ("aqlm", True),
                                                   ("fp8", True), ("eetq", False)])
def test_other_kernels_hold_one_transient_weight(method, transient):
    qcfg = {"quant_method": method, "bits": 4, "group_size": 128, "version": "gemm",
            "weight_block_size": [128, 128]}
    spec = _checkpoint_spec("qwen2.5-0.5b-instruct", qcfg)
    cfg = RunConfig(model="x", method="lora")
    dt = dtypes_for(cfg)
    biggest = max(lin.weight_params for lin in spec.layer_linears())
    assert transient_dequant_bytes(spec, cfg, dt) == (2 * biggest if transient else 0)
    assert saved_dequant_bytes(spec, cfg, dt)["layers"] == 0


def test_fp8_storage_equals_transformers_fp8_linear():
    torch = pytest.importorskip("torch")
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    for scheme, block in (("dynamic", [128, 128]), ("static", None)):
        config = FineGrainedFP8Config(activation_scheme=scheme, weight_block_size=block)
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(896, 4864, bias=False))
        replace_with_fp8_linear(model, quantization_config=config, pre_quantized=True)
        real = sum(p.numel() * p.element_size() for p in model.parameters())
        quant, _ = quant_spec_from_config({"quant_method": "fp8", "activation_scheme": scheme,
                                           "weight_block_size": block}, "test")
        assert quant.linear_bytes(896, 4864) == real


def test_bitsandbytes_checkpoint_equals_on_the_fly_qlora():
    base = get_entry("qwen2.5-7b-instruct")
    bnb = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
           "bnb_4bit_use_double_quant": True}
    spec = _checkpoint_spec(base.name, bnb, "bfloat16")
    qlora = RunConfig(model="x", method="qlora")
    assert _weights(spec) == model_states(base.spec, qlora, dtypes_for(qlora)).gpu["weights"]


def test_stacks_that_train_dense_weights():
    fp8 = _checkpoint_spec("qwen2.5-0.5b-instruct", {"quant_method": "fp8"}, "bfloat16")
    dense = fp8.param_count * 2
    assert _weights(fp8, stack="llamafactory") == dense  # FineGrainedFP8Config(dequantize=True)
    assert _weights(fp8) < 0.7 * dense  # 1 B/param linears; the 136M-param embedding stays bf16
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                "strategy": "group", "group_size": 128}, "targets": ["Linear"]}}}
    assert _weights(_checkpoint_spec("qwen2.5-0.5b-instruct", ct, "bfloat16")) == dense


@pytest.mark.parametrize(("cfg", "message"), [
    ({"method": "full"}, "cannot be trained"),
    ({"zero": 3, "hardware": {"gpus_per_node": 2}}, "ZeRO-3"),
])
def test_what_transformers_refuses_is_refused(cfg, message):
    spec = _checkpoint_spec("meta-llama-3-8b-instruct", GPTQ_4BIT)
    with pytest.raises(ConfigError, match=rf"pre-quantized GPTQ 4-bit g128.*{message}"):
        estimate_training(spec, RunConfig(model="x", **cfg))


def test_qlora_on_a_quantized_checkpoint_keeps_the_checkpoint():
    spec = _checkpoint_spec("meta-llama-3-8b-instruct", GPTQ_4BIT)
    assert _weights(spec) == _weights(spec, method="qlora", quantization={"bits": 8})
    est = estimate_training(spec, RunConfig(model="x", method="qlora"))
    assert any("bitsandbytes settings are ignored" in a for a in est.assumptions)


def test_modules_to_not_convert_stay_16bit():
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}
    skipped = dict(awq, modules_to_not_convert=["down_proj", "model.layers.0.mlp.up_proj"])
    full, partial = (_checkpoint_spec("qwen2.5-0.5b-instruct", q) for q in (awq, skipped))
    down = [lin for lin in full.layer_linears() if lin.name == "down_proj"][0]
    per_layer = 2 * down.weight_params - down_bytes(full.quantization, down)
    assert _weights(partial) - _weights(full) == pytest.approx(full.num_layers * per_layer, abs=1)


def down_bytes(q: QuantSpec, lin) -> float:
    return q.linear_bytes(lin.in_features, lin.out_features, lin.bias)


def test_unknown_method_is_counted_16bit_and_said():
    spec = _checkpoint_spec("qwen2.5-0.5b-instruct", {"quant_method": "mxfp4"}, "bfloat16")
    assert spec.quantization is None
    assert any("'mxfp4' is not modelled" in a for a in spec.assumptions)
    with pytest.raises(ModelConfigError, match="quantization_config must be a JSON object"):
        quant_spec_from_config(["gptq"], "config.json")


def test_quantization_survives_to_dict_from_dict():
    spec = _checkpoint_spec("meta-llama-3-8b-instruct", GPTQ_4BIT)
    again = ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again.quantization == spec.quantization and again == spec


@pytest.mark.parametrize(("quant", "per_param"), [
    ({"method": "hqq", "bits": 4}, 0.5 + 2 * 2 / 64),  # 2 codes per byte + fp16 scale, zero / 64
    ({"method": "hqq", "bits": 3}, 0.4 + 2 * 2 / 64),  # ten 3-bit codes per int32
    ({"method": "eetq", "bits": 8}, 1.0),  # int8 (+ a per-channel fp16 scale)
])
def test_on_the_fly_hqq_and_eetq(quant, per_param):
    spec = get_entry("qwen2.5-7b-instruct").spec
    lin = spec.num_layers * sum(x.weight_params for x in spec.layer_linears())
    rest = 2 * (spec.param_count - lin)
    weights = _weights(spec, method="qlora", quantization=quant) - rest
    assert weights == pytest.approx(lin * per_param, rel=2e-3)


def test_eetq_takes_only_8_bits():
    with pytest.raises(ValueError, match="eetq takes 8 bits"):
        RunConfig(model="x", method="qlora", quantization={"method": "eetq", "bits": 4})
