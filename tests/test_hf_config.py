"""Reading Hugging Face config.json files into a ModelSpec (no transformers import)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomless.errors import ModelConfigError, UnknownFamilyError, UnknownModelError
from oomless.models.catalog import get_entry
from oomless.models.hf_cache import find_cached_config, load_hf_config, locate_hf_config
from oomless.models.hf_config import (
    buildable_hf_config,
    chatglm_to_glm,
    spec_from_hf_config,
)
from oomless.models.spec import ModelSpec

FIXTURES = Path(__file__).parent / "fixtures" / "configs"


def _cfg(name: str) -> dict:
    return get_entry(name).config


# ---- dense decoders ---------------------------------------------------------
def test_llama_gqa_untied():
    spec = spec_from_hf_config(_cfg("llama-3.1-8b-instruct"), "x")
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (32, 8, 128)
    assert spec.kv_dim == 1024 and not spec.tie_embeddings and spec.mlp_gated
    assert [lin.name for lin in spec.layer_linears()] == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    ]


def test_missing_kv_heads_means_multi_head_attention():
    config = _cfg("llama-2-7b")
    config.pop("num_key_value_heads")
    assert spec_from_hf_config(config, "x").num_kv_heads == 32


def test_multi_query_attention():
    config = _cfg("llama-2-7b") | {"num_key_value_heads": 1}
    spec = spec_from_hf_config(config, "x")
    assert spec.num_kv_heads == 1 and spec.kv_dim == spec.head_dim


def test_qwen2_biases_and_tied_small_models():
    small = spec_from_hf_config(_cfg("qwen2.5-0.5b-instruct"), "x")
    assert small.qkv_bias and not small.o_bias and small.tie_embeddings
    assert small.lm_head_params == 0
    # Qwen2 carries sliding_window but does not use it unless use_sliding_window
    assert small.sliding_window is None
    assert not spec_from_hf_config(_cfg("qwen2.5-7b-instruct"), "x").tie_embeddings


def test_qwen3_qk_norm_and_explicit_head_dim():
    spec = spec_from_hf_config(_cfg("qwen3-4b"), "x")
    assert spec.qk_norm and spec.head_dim == 128 and spec.q_dim == 4096 != spec.hidden_size


def test_mistral_sliding_window_every_layer_and_gemma2_every_second():
    mistral = spec_from_hf_config(_cfg("mistral-7b-v0.1"), "x")
    assert (mistral.sliding_window, mistral.sliding_window_every) == (4096, 1)
    assert spec_from_hf_config(_cfg("mistral-7b-instruct-v0.3"), "x").sliding_window is None
    gemma = spec_from_hf_config(_cfg("gemma-2-9b-it"), "x")
    assert (gemma.sliding_window, gemma.sliding_window_every) == (4096, 2)
    assert gemma.norms_per_layer == 4 and gemma.tie_embeddings and gemma.dtype == "float32"


def test_phi2_plain_mlp_layernorm_biases():
    spec = spec_from_hf_config(_cfg("phi-2"), "x")
    assert not spec.mlp_gated and spec.norm_type == "layer" and spec.norms_per_layer == 1
    assert spec.qkv_bias and spec.o_bias and spec.mlp_bias and spec.lm_head_bias
    assert [lin.name for lin in spec.mlp_linears()] == ["up_proj", "down_proj"]


def test_phi3_fused_projections():
    spec = spec_from_hf_config(_cfg("phi-3-mini-4k-instruct"), "x")
    names = [lin.name for lin in spec.layer_linears()]
    assert names == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert spec.sliding_window == 2047


# ---- mixture of experts -------------------------------------------------------
def test_mixtral_experts():
    spec = spec_from_hf_config(_cfg("mixtral-8x7b-v0.1"), "x")
    assert (spec.num_experts, spec.experts_per_token, spec.num_moe_layers) == (8, 2, 32)
    experts = [lin for lin in spec.mlp_linears() if lin.role == "expert"]
    assert {lin.count for lin in experts} == {8}
    assert spec.active_param_count < spec.param_count


def test_qwen2_moe_shared_expert_with_gate():
    spec = spec_from_hf_config(_cfg("qwen1.5-moe-a2.7b"), "x")
    roles = [(lin.name, lin.role) for lin in spec.mlp_linears()]
    assert ("shared_expert_gate", "router") in roles
    assert spec.shared_expert_intermediate_size == 5632 and spec.num_shared_experts == 1


def test_qwen3_moe_has_no_shared_expert():
    spec = spec_from_hf_config(_cfg("qwen3-30b-a3b"), "x")
    assert (spec.num_experts, spec.experts_per_token, spec.moe_intermediate_size) == (128, 8, 768)
    assert spec.shared_expert_intermediate_size == 0
    # model card: 30.5B total, 3.3B activated
    assert spec.param_count == pytest.approx(30.5e9, rel=0.01)
    assert spec.active_param_count == pytest.approx(3.3e9, rel=0.02)


def test_sparse_step_and_dense_only_layers():
    config = json.loads((FIXTURES / "tiny_qwen2_moe_sparse_step.json").read_text())
    spec = spec_from_hf_config(config, "tiny")
    # Qwen2MoeDecoderLayer: sparse iff i not in mlp_only_layers and (i + 1) % step == 0
    assert spec.moe_layer_indices == (1, 5)
    assert spec.num_moe_layers == 2
    assert [spec.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    roundtrip = ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert roundtrip == spec


def test_sparse_step_count_matches_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = json.loads((FIXTURES / "tiny_qwen2_moe_sparse_step.json").read_text())
    spec = spec_from_hf_config(config, "tiny")
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**kwargs))
    assert spec.param_count == sum(p.numel() for p in model.parameters())


# ---- ChatGLM / GLM-4 ----------------------------------------------------------
def test_chatglm_fields():
    spec = spec_from_hf_config(_cfg("glm-4-9b-chat"), "glm")
    assert spec.model_type == "chatglm"
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (32, 2, 128)
    assert spec.vocab_size == 151552 and spec.intermediate_size == 13696
    assert spec.fused_qkv and spec.fused_gate_up and spec.qkv_bias and not spec.o_bias
    assert [lin.name for lin in spec.layer_linears()] == [
        "qkv_proj", "o_proj", "gate_up_proj", "down_proj",
    ]
    assert spec.max_position_embeddings == 131072


def test_chatglm_converts_to_transformers_glm():
    glm = chatglm_to_glm(_cfg("glm-4-9b-chat"))
    assert glm["model_type"] == "glm" and glm["num_key_value_heads"] == 2
    assert glm["partial_rotary_factor"] == 0.5 and glm["attention_bias"] is True
    # the converted config describes the same model
    assert spec_from_hf_config(glm, "x").param_count == spec_from_hf_config(_cfg("glm-4-9b-chat"), "x").param_count
    assert buildable_hf_config(_cfg("glm-4-9b-chat"))["model_type"] == "glm"
    assert buildable_hf_config(_cfg("glm-4v-9b")) is None


def test_chatglm_without_multi_query_uses_all_heads():
    config = _cfg("glm-4-9b-chat") | {"multi_query_attention": False}
    config.pop("multi_query_group_num")
    assert spec_from_hf_config(config, "x").num_kv_heads == 32


# ---- vision-language ------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "tokens", "kind"),
    [
        ("llava-1.5-7b", 576, "clip"),  # (336/14)^2, CLS dropped
        ("qwen2.5-vl-7b-instruct", 729, "qwen2_5_vl"),  # 756x756 / 28^2
        ("glm-4v-9b", 1602, "eva2clip"),  # (1120/14/2)^2 + boi + eoi
        ("moe-llava-phi2-2.7b-4e", 576, "clip"),
    ],
)
def test_vision_tokens(name, tokens, kind):
    spec = spec_from_hf_config(_cfg(name), name)
    assert spec.vision.tokens_per_image == tokens
    assert spec.vision.kind == kind
    assert 0 < spec.vision.projector_params < spec.vision.param_count


def test_llava_text_config_uses_llama_defaults():
    spec = spec_from_hf_config(_cfg("llava-1.5-7b"), "llava")
    # llava-1.5's text_config states only vocab/max positions: the rest is LlamaConfig's default
    assert (spec.hidden_size, spec.num_layers, spec.intermediate_size) == (4096, 32, 11008)
    assert spec.vocab_size == 32064


def test_moe_llava_alternating_moe_layers():
    spec = spec_from_hf_config(_cfg("moe-llava-phi2-2.7b-4e"), "m")
    assert spec.moe_layer_indices == tuple(range(0, 32, 2))
    assert (spec.num_experts, spec.experts_per_token) == (4, 2)
    assert not spec.lm_head_bias and not spec.mlp_gated and spec.mlp_bias
    assert spec.vision.param_count == 303_507_456 + 9_180_160  # CLIP-L/14-336 + mlp2x_gelu


def test_unknown_vision_tower_is_named():
    config = _cfg("moe-llava-phi2-2.7b-4e") | {"mm_image_tower": "google/siglip-so400m"}
    with pytest.raises(ModelConfigError, match="siglip-so400m"):
        spec_from_hf_config(config, "m")


# ---- errors -------------------------------------------------------------------------
def test_missing_field_names_field_and_file():
    path = FIXTURES / "llama_missing_hidden_size.json"
    config = load_hf_config(str(path))
    with pytest.raises(ModelConfigError, match=r"llama_missing_hidden_size\.json.*'hidden_size'"):
        spec_from_hf_config(config, "x", where=str(path))


def test_missing_chatglm_field():
    config = _cfg("glm-4-9b-chat")
    config.pop("padded_vocab_size")
    with pytest.raises(ModelConfigError, match=r"my/config\.json.*'padded_vocab_size'"):
        spec_from_hf_config(config, "x", where="my/config.json")


def test_missing_model_type():
    with pytest.raises(ModelConfigError, match="'model_type'"):
        spec_from_hf_config({"hidden_size": 8}, "x")


def test_not_an_object():
    with pytest.raises(ModelConfigError, match="JSON object"):
        spec_from_hf_config([1, 2], "x")  # type: ignore[arg-type]


# ---- loading from disk and from the HF cache -------------------------------------------
def test_load_from_file_and_folder():
    folder = FIXTURES / "glm-4-9b-chat"
    by_folder = load_hf_config(str(folder))
    by_file = load_hf_config(str(folder / "config.json"))
    assert by_folder == by_file
    assert locate_hf_config(str(folder)) == folder / "config.json"
    assert spec_from_hf_config(by_file, "x").param_count == 9_399_951_360


def test_folder_without_config(tmp_path):
    with pytest.raises(UnknownModelError, match="no config.json"):
        load_hf_config(str(tmp_path))


def test_bad_json():
    with pytest.raises(ModelConfigError, match=r"truncated\.json:\d+: not valid JSON"):
        load_hf_config(str(FIXTURES / "truncated.json"))


def test_unknown_path_or_id():
    with pytest.raises(UnknownModelError, match="offline"):
        load_hf_config("nobody/no-such-model-xyz")


def _fake_cache(root: Path, model_id: str, source: Path, ref: bool = True) -> Path:
    repo = root / "hub" / ("models--" + model_id.replace("/", "--"))
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    shutil.copy(source, snap / "config.json")
    if ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0123abcd\n")
    return snap / "config.json"


@pytest.mark.parametrize("ref", [True, False])
def test_hf_cache_lookup(tmp_path, monkeypatch, ref):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    expected = _fake_cache(tmp_path, "THUDM/glm-4-9b-chat", FIXTURES / "glm-4-9b-chat" / "config.json", ref)
    assert find_cached_config("THUDM/glm-4-9b-chat") == expected
    assert locate_hf_config("THUDM/glm-4-9b-chat") == expected
    assert load_hf_config("THUDM/glm-4-9b-chat")["model_type"] == "chatglm"
    assert find_cached_config("THUDM/other") is None


def test_reading_configs_imports_no_torch():
    code = (
        "import sys, oomless.models.hf_config, oomless.models.catalog\n"
        "from oomless.models.catalog import list_models\n"
        "[e.spec for e in list_models()]\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- properties ---------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 96),
    heads=st.sampled_from([8, 16, 32, 64]),
    kv_div=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([64, 128]),
    inter=st.integers(64, 30000),
    vocab=st.integers(1000, 260000),
    tie=st.booleans(),
)
def test_llama_count_matches_closed_form(layers, heads, kv_div, head_dim, inter, vocab, tie):
    hidden = heads * head_dim
    kv = heads // kv_div
    config = {
        "model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": inter,
        "vocab_size": vocab, "tie_word_embeddings": tie,
    }
    spec = spec_from_hf_config(config, "p")
    attn = 2 * hidden * hidden + 2 * hidden * kv * head_dim
    per_layer = attn + 3 * hidden * inter + 2 * hidden
    expected = layers * per_layer + vocab * hidden * (1 if tie else 2) + hidden
    assert spec.param_count == expected


# ---- assumptions and other formats -------------------------------------------------------
def test_assumptions_are_recorded():
    assert spec_from_hf_config(_cfg("qwen2.5-7b-instruct"), "x").assumptions == ()
    vl = spec_from_hf_config(_cfg("qwen2.5-vl-7b-instruct"), "x")
    assert any("756x756" in note for note in vl.assumptions)
    llava = spec_from_hf_config(_cfg("llava-1.5-7b"), "x")
    assert any("hidden_size" in note and "defaults" in note for note in llava.assumptions)
    glm4v = spec_from_hf_config(_cfg("glm-4v-9b"), "x")
    assert any("1602 tokens" in note for note in glm4v.assumptions)
    # no llama-shaped guess for a family the formulas do not know: they refuse it (a
    # user's file is then read from the model's own code, tests/runtime/test_meta.py)
    odd = _cfg("llama-2-7b") | {"model_type": "my_llama_fork"}
    with pytest.raises(UnknownFamilyError, match="my_llama_fork.*not a family"):
        spec_from_hf_config(odd, "x")


def test_original_llava_repo_format():
    # liuhaotian/llava-v1.5-7b style: a llama config plus mm_* fields, no vision_config
    config = _cfg("llama-2-7b") | {
        "model_type": "llava_llama", "architectures": ["LlavaLlamaForCausalLM"],
        "mm_vision_tower": "openai/clip-vit-large-patch14-336", "mm_projector_type": "mlp2x_gelu",
        "mm_hidden_size": 1024, "mm_vision_select_layer": -2, "vocab_size": 32000,
    }
    spec = spec_from_hf_config(config, "llava-orig")
    llava_hf = get_entry("llava-1.5-7b").spec
    assert spec.vision.tokens_per_image == 576 and not spec.is_moe
    # same tower and projector as llava-hf/llava-1.5-7b-hf; the hf port has 64 more vocab rows
    assert spec.vision.param_count == llava_hf.vision.param_count
    assert llava_hf.param_count - spec.param_count == 2 * 64 * 4096


def test_vlm_top_level_tie_applies_to_text():
    config = _cfg("qwen2.5-vl-7b-instruct")
    text_keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "vocab_size", "model_type")
    config["text_config"] = {k: config[k] for k in text_keys} | {"model_type": "qwen2_5_vl_text"}
    config["tie_word_embeddings"] = True
    spec = spec_from_hf_config(config, "x")
    assert spec.tie_embeddings and spec.num_layers == 28


# ---- configs as transformers 5 writes them ---------------------------------------------
_SAVED_FORMATS = [
    ("LlamaConfig", "LlamaForCausalLM", {"num_hidden_layers": 2}),
    ("MistralConfig", "MistralForCausalLM", {"num_hidden_layers": 2}),
    ("Qwen2Config", "Qwen2ForCausalLM", {"num_hidden_layers": 2}),
    ("Qwen3Config", "Qwen3ForCausalLM", {"num_hidden_layers": 2}),
    ("GemmaConfig", "GemmaForCausalLM", {"num_hidden_layers": 2}),
    ("Gemma2Config", "Gemma2ForCausalLM", {"num_hidden_layers": 2}),
    ("PhiConfig", "PhiForCausalLM", {"num_hidden_layers": 2}),
    ("Phi3Config", "Phi3ForCausalLM", {"num_hidden_layers": 2}),
    ("GlmConfig", "GlmForCausalLM", {"num_hidden_layers": 2}),
    ("Glm4Config", "Glm4ForCausalLM", {"num_hidden_layers": 2}),
    ("MixtralConfig", "MixtralForCausalLM", {"num_hidden_layers": 2}),
    ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"num_hidden_layers": 2}),
    ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_hidden_layers": 2}),
    ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration",
     {"text_config": {"num_hidden_layers": 2}, "vision_config": {"depth": 2}}),
    ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
     {"text_config": {"num_hidden_layers": 2}, "vision_config": {"depth": 2}}),
    ("LlavaConfig", "LlavaForConditionalGeneration",
     {"text_config": {"num_hidden_layers": 2}, "vision_config": {"num_hidden_layers": 2}}),
]


@pytest.mark.parametrize(("config_cls", "model_cls", "kwargs"), _SAVED_FORMATS)
def test_transformers_saved_configs_count_exactly(config_cls, model_cls, kwargs):
    """A config dict as transformers' own to_dict() writes it (defaults, nested sub-configs)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, config_cls)(**kwargs)
    saved = json.loads(json.dumps(config.to_dict()))
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(config)
    spec = spec_from_hf_config(saved, config_cls)
    assert spec.param_count == sum(p.numel() for p in model.parameters())
