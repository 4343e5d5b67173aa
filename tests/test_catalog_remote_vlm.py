"""InternVL 2.5 and MiniCPM-V in the catalog: remote-code vision-language models read as
data (oomless.models.hf_vision_remote), each count equal to a model built on the meta device.

- InternVL2_5-1B / -8B: transformers' InternVLForConditionalGeneration from the mapping of
  transformers' own convert_internvl_weights_to_hf.py (the general catalog tests build it);
  here tiny variants check the formulas against it on shapes the releases do not use.
- MiniCPM-Llama3-V-2_5 / MiniCPM-V-2_6: their modeling_minicpmv.py builds
  ``LlamaForCausalLM(config)`` / ``Qwen2ForCausalLM(config)``, a SigLIP tower
  (transformers' Idefics2VisionTransformer in 2.5; modeling_navit_siglip's copy of it in
  2.6) and resampler.py's Resampler; composed here from those classes and the resampler's
  torch modules, and equal to the total the checkpoints' model.safetensors.index.json state.
- MiniCPM-o-2_6: its modeling_minicpmo.py builds the same llm, vpm and resampler plus
  transformers' WhisperEncoder (apm), a two-Linear audio projection and ConditionalChatTTS
  (a LlamaModel, embeddings, weight-normed heads and ChatTTS's DVAE); composed here from
  those classes and torch modules, and equal to two counts measured on the release.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from oomless.models.catalog import find_entry, get_entry, resolve_model
from oomless.models.hf_config import buildable_hf_config, spec_from_hf_config

ROOT = Path(__file__).resolve().parents[1]
HUB_IDS = {  # hub id -> catalog name, LLaMA-Factory template (None: a note instead)
    "openbmb/MiniCPM-V-2_6": ("minicpm-v-2.6", "minicpm_v"),
    "openbmb/MiniCPM-o-2_6": ("minicpm-o-2.6", "minicpm_o"),
    "openbmb/MiniCPM-Llama3-V-2_5": ("minicpm-llama3-v-2.5", None),
    "OpenGVLab/InternVL2_5-8B": ("internvl2.5-8b", None),
    "OpenGVLab/InternVL2_5-1B": ("internvl2.5-1b", None),
}
MINICPMV = ["minicpm-llama3-v-2.5", "minicpm-v-2.6"]


def _blocking_prelude() -> str:
    """tests/safety/test_offline.py's BLOCK: sockets refuse and record every attempt."""
    spec = importlib.util.spec_from_file_location(
        "_offline_test", ROOT / "tests" / "safety" / "test_offline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BLOCK


SCRIPT = '''
from pathlib import Path
from oomless.cli import main
from oomless.models.catalog import resolve_model
results = {{}}
for hub_id in {ids!r}:
    spec = resolve_model(hub_id).spec
    out = Path({tmp!r}) / hub_id.replace("/", "--")
    results[hub_id] = [spec.name, spec.param_count,
                       main(["estimate", hub_id, "--gpu", "a100-80gb", "--images", "1"]),
                       main(["plan", hub_id, "--gpu", "a100-80gb", "--out", str(out)])]
print("RESULT " + json.dumps({{"results": results, "attempts": attempts}}))
'''


def test_the_hub_ids_resolve_plan_and_estimate_with_the_network_blocked(tmp_path):
    script = _blocking_prelude() + textwrap.dedent(SCRIPT).format(
        ids=list(HUB_IDS), tmp=str(tmp_path))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "TRANSFORMERS_OFFLINE"))}
    env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(line[-1].removeprefix("RESULT "))
    assert out["attempts"] == []
    for hub_id, (name, template) in HUB_IDS.items():
        got_name, count, estimate_rc, plan_rc = out["results"][hub_id]
        assert got_name == name and count == get_entry(name).spec.param_count
        assert estimate_rc in (0, 1) and plan_rc in (0, 1)
        folder = tmp_path / hub_id.replace("/", "--")
        lf = (folder / "llamafactory.yaml").read_text()
        readme = (folder / "README.md").read_text()
        if template is None:
            assert "template:" not in lf and "names no `template`" in readme
        else:
            assert f"template: {template}\n" in lf


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _minicpmv_parts(config: dict):
    """What MiniCPMV.__init__ builds (modeling_minicpmv.py of each release), on the meta
    device: llm, vpm (last layer dropped when drop_vision_last_layer) and the resampler's
    modules (resampler.py: query, kv_proj, MultiheadAttention, ln_q/ln_kv/ln_post, proj)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.idefics2.modeling_idefics2 import Idefics2VisionTransformer

    nn = torch.nn
    text = {k: v for k, v in config.items()
            if k not in ("vision_config", "slice_config", "auto_map", "architectures", "model_type")}
    lm_class = {"2.5": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
                "2.6": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config)}[str(config["version"])]
    vision = {k: v for k, v in config["vision_config"].items() if k != "model_type"}
    with torch.device("meta"):
        llm = lm_class[0](lm_class[1](**text))
        vpm = Idefics2VisionTransformer(transformers.Idefics2VisionConfig(**vision))
        if config.get("drop_vision_last_layer", True):
            vpm.encoder.layers = vpm.encoder.layers[:-1]
        dim, kv = llm.config.hidden_size, vpm.config.hidden_size
        resampler = nn.ModuleDict({
            "kv_proj": nn.Linear(kv, dim, bias=False) if kv != dim else nn.Identity(),
            "attn": nn.MultiheadAttention(dim, dim // 128),
            "ln_q": nn.LayerNorm(dim), "ln_kv": nn.LayerNorm(dim), "ln_post": nn.LayerNorm(dim)})
        resampler.register_parameter("query", nn.Parameter(torch.zeros(config["query_num"], dim)))
        resampler.register_parameter("proj", nn.Parameter(torch.zeros(dim, dim)))
    return llm, vpm, resampler


REMOTE = ROOT / "tests" / "fixtures" / "remote_code"  # provenance in its README.md
# the checkpoints' index (fp32 in 2.5, bf16 in 2.6) and the prefix of the language model's
# keys (the 2.6 copy's rename_tensors.py stripped "llm.")
INDEX = {"minicpm-llama3-v-2.5": ("minicpm-llama3-v-2_5", 4, "llm."),
         "minicpm-v-2.6": ("minicpm-v-2_6", 2, "")}


@pytest.mark.parametrize("name", MINICPMV)
def test_minicpmv_count_is_the_composed_model_and_the_checkpoints_total(name):
    entry = get_entry(name)
    llm, vpm, resampler = _minicpmv_parts(entry.config)
    folder, dtype_bytes, llm_prefix = INDEX[name]
    index = json.loads((REMOTE / folder / "model.safetensors.index.json").read_text())
    keys = set(index["weight_map"])
    composed = ({f"vpm.{n}" for n, _ in vpm.named_parameters()}
                | {f"resampler.{n}" for n, _ in resampler.named_parameters()}
                | {llm_prefix + n for n, _ in llm.named_parameters()})
    assert composed == keys  # every tensor of the checkpoint, by name, and no other
    spec = entry.spec
    assert spec.vision.projector_params == _count(resampler)
    assert spec.vision.param_count == _count(vpm) + _count(resampler)
    assert spec.param_count == _count(llm) + _count(vpm) + _count(resampler)
    assert spec.param_count * dtype_bytes == index["metadata"]["total_size"]
    assert spec.param_count == entry.published_params


def test_minicpmv_2_6_tower_built_from_its_own_code_is_the_one_counted():
    """The release's modeling_navit_siglip.py SiglipVisionTransformer on the meta device
    (the composition above builds transformers' Idefics2VisionTransformer in its place)."""
    torch = pytest.importorskip("torch")
    spec_file = importlib.util.spec_from_file_location(
        "minicpmv26_navit_siglip", REMOTE / "minicpm-v-2_6" / "modeling_navit_siglip.py")
    navit = importlib.util.module_from_spec(spec_file)
    spec_file.loader.exec_module(navit)
    entry = get_entry("minicpm-v-2.6")
    vision = {k: v for k, v in entry.config["vision_config"].items() if k != "model_type"}
    with torch.device("meta"):
        tower = navit.SiglipVisionTransformer(navit.SiglipVisionConfig(**vision))
    assert _count(tower) == entry.spec.vision.param_count - entry.spec.vision.projector_params
    _, vpm, _ = _minicpmv_parts(entry.config)
    assert [n for n, _ in tower.named_parameters()] == [n for n, _ in vpm.named_parameters()]


@pytest.mark.parametrize("drop, queries, lm_hidden", [(True, 4, 256), (False, 3, 128)])
def test_minicpmv_formulas_follow_the_code_on_tiny_shapes(drop, queries, lm_hidden):
    """Dropped last tower layer, and a resampler whose width equals the tower's (no kv_proj;
    the resampler has width // 128 heads)."""
    config = copy.deepcopy(get_entry("minicpm-v-2.6").config)
    config.update(hidden_size=lm_hidden, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2, vocab_size=300, query_num=queries,
                  drop_vision_last_layer=drop, bos_token_id=1, eos_token_id=2)
    config["vision_config"].update(hidden_size=48 if drop else lm_hidden, intermediate_size=80,
                                   num_attention_heads=4, num_hidden_layers=3, image_size=56)
    spec = spec_from_hf_config(config, "tiny-minicpmv")
    llm, vpm, resampler = _minicpmv_parts(config)
    assert spec.param_count == _count(llm) + _count(vpm) + _count(resampler)
    assert spec.vision.num_layers == 3 - int(drop)


# Parameter counts of openbmb/MiniCPM-o-2_6 measured on the released checkpoint (bf16):
# weedge/doraemon-nb achat_miniCPMo.ipynb at a9c911670c0e9f201248a46eb8d3213ec57a2895, runs
# of 2025-02-18 with achatbot's print_model_params (sum of numel over model.parameters()):
# built with llm + tts (init_vision, init_audio off) and with llm + apm + tts (init_vision off)
MINICPMO_MEASURED = {"llm+tts": 7_864_846_900, "llm+apm+tts": 8_188_585_524}
# checkpoint tensors of the modules those runs did not build, as transformers' "Some weights
# of the model checkpoint ... were not used" lists them in the same notebook
MINICPMO_UNUSED_TENSORS = {"vpm": 437, "resampler": 13, "apm": 367, "audio_projection_layer": 4}


def _chattts_dvae(torch):
    """ConditionalChatTTS's DVAE() of modeling_minicpmo.py (ChatTTS's dvae.py), its modules
    at their fixed shapes; vq_layer's GroupedResidualFSQ(dim 1024, groups 2) holds, per group,
    vector_quantize_pytorch ResidualFSQ's project_in Linear(512, 4) and project_out Linear(4, 512)."""
    nn = torch.nn

    def block():  # ConvNeXtBlock(256, 1024, kernel 7, dilation 2) and its layer scale coef
        out = nn.ModuleDict({"dwconv": nn.Conv1d(256, 256, 7, padding=6, dilation=2, groups=256),
                             "norm": nn.LayerNorm(256), "pwconv1": nn.Linear(256, 1024),
                             "pwconv2": nn.Linear(1024, 256)})
        out.register_parameter("coef", nn.Parameter(torch.empty(256)))
        return out

    def coder(odim):
        blocks = nn.ModuleList(block() for _ in range(12))
        return nn.ModuleDict({"conv_in": nn.Sequential(nn.Conv1d(512, 128, 3, 1, 1), nn.GELU(),
                                                       nn.Conv1d(128, 256, 3, 1, 1)),
                              "decoder_block": blocks,
                              "conv_out": nn.Conv1d(256, odim, 1, bias=False)})
    dvae = nn.ModuleDict({
        "downsample_conv": nn.Sequential(nn.Conv1d(100, 512, 3, 1, 1), nn.GELU(),
                                         nn.Conv1d(512, 512, 4, 2, 1), nn.GELU()),
        "encoder": coder(1024), "decoder": coder(512),
        "out_conv": nn.Conv1d(512, 100, 3, 1, 1, bias=False),
        "vq_layer": nn.ModuleList(nn.ModuleDict({"project_in": nn.Linear(512, 4),
                                                 "project_out": nn.Linear(4, 512)})
                                  for _ in range(2))})
    dvae.register_parameter("coef", nn.Parameter(torch.empty(1, 100, 1)))
    return dvae


# configuration_minicpm.py ConditionalChatTTSConfig's defaults (MiniCPM-o-2_6; the
# release's tts_config sets llm_dim only)
CHATTTS_DEFAULTS = {"llm_dim": 2560, "hidden_size": 768, "intermediate_size": 3072,
                    "num_attention_heads": 12, "num_hidden_layers": 20,
                    "max_position_embeddings": 4096, "num_audio_tokens": 626,
                    "num_text_tokens": 21178, "num_vq": 4, "use_mlp": True}


def _minicpmo_audio_and_tts(config: dict):
    """apm (transformers' WhisperEncoder: MiniCPMWhisperEncoder adds no parameter),
    audio_projection_layer (MultiModalProjector: Linear, ReLU, Linear with biases) and tts
    (ConditionalChatTTS: projector, emb_code, emb_text, weight-normed head_code, DVAE and a
    LlamaModel), on the meta device."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from torch.nn.utils.parametrizations import weight_norm
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    nn = torch.nn
    hidden, t = config["hidden_size"], CHATTTS_DEFAULTS | config["tts_config"]
    h, audio_tokens, vq = t["hidden_size"], t["num_audio_tokens"], t["num_vq"]
    llama = {k: t[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                "num_hidden_layers", "max_position_embeddings")}
    with torch.device("meta"):
        apm = WhisperEncoder(transformers.WhisperConfig(**config["audio_config"]))
        width = apm.config.encoder_ffn_dim // 4
        projection = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
        projector = nn.Sequential(nn.Linear(t["llm_dim"], h), nn.ReLU(), nn.Linear(h, h)) \
            if t["use_mlp"] else nn.Linear(t["llm_dim"], h, bias=False)
        tts = nn.ModuleDict({
            "projector": projector,
            "emb_code": nn.ModuleList(nn.Embedding(audio_tokens, h) for _ in range(vq)),
            "emb_text": nn.Embedding(t["num_text_tokens"], h),
            "head_code": nn.ModuleList(
                weight_norm(nn.Linear(h, audio_tokens, bias=False), name="weight")
                for _ in range(vq)),
            "dvae": _chattts_dvae(torch),
            "model": transformers.LlamaModel(transformers.LlamaConfig(**llama))})
    return apm, projection, tts


def test_minicpm_o_2_6_resolves_from_the_catalog_with_the_count_of_its_parts():
    """The release's config.json built as MiniCPMO builds it (init_vision, init_audio and
    init_tts default to true), and the two counts measured on the released checkpoint."""
    entry = find_entry("openbmb/MiniCPM-o-2_6")
    assert entry is not None and entry.name == "minicpm-o-2.6"
    config = entry.config
    assert config["model_type"] == "minicpmo" and config["query_num"] == 64
    text = {k: v for k, v in config.items() if k not in ("audio_config", "tts_config")}
    llm, vpm, resampler = _minicpmv_parts(text)
    apm, projection, tts = _minicpmo_audio_and_tts(config)
    built = {"vpm": vpm, "resampler": resampler, "apm": apm, "audio_projection_layer": projection}
    assert {k: len(list(m.parameters())) for k, m in built.items()} == MINICPMO_UNUSED_TENSORS
    llm_n, tts_n, audio_n = _count(llm), _count(tts), _count(apm) + _count(projection)
    assert llm_n + tts_n == MINICPMO_MEASURED["llm+tts"]
    assert llm_n + audio_n + tts_n == MINICPMO_MEASURED["llm+apm+tts"]
    spec = entry.spec
    assert spec.param_count == llm_n + _count(vpm) + _count(resampler) + audio_n + tts_n
    assert spec.vision.param_count == _count(vpm) + _count(resampler)
    assert spec.vision.projector_params == _count(resampler)
    assert spec.other_params == audio_n + tts_n
    assert spec.vision == get_entry("minicpm-v-2.6").spec.vision  # same tower, 64 queries


def test_minicpm_o_without_audio_and_tts_counts_what_finetune_py_builds():
    """OpenBMB finetune.py loads MiniCPM-o with init_vision=True, init_audio=False,
    init_tts=False: llm, vpm and resampler only; the assumptions say how to get there."""
    entry = get_entry("minicpm-o-2.6")
    assert any("init_audio" in note and "finetune.py" in note
               for note in entry.spec.assumptions)
    config = entry.config | {"init_audio": False, "init_tts": False}
    spec = spec_from_hf_config(config, "minicpm-o-vision-only")
    llm, vpm, resampler = _minicpmv_parts(
        {k: v for k, v in config.items() if k not in ("audio_config", "tts_config")})
    assert spec.param_count == _count(llm) + _count(vpm) + _count(resampler)
    assert spec.other_params == 0
    assert not any("init_audio" in note for note in spec.assumptions)


def test_minicpm_o_formulas_follow_the_code_on_tiny_audio_and_tts_shapes():
    """Audio and TTS widths the release does not use (a bias-free TTS projector without
    use_mlp, Whisper keys left to WhisperConfig's defaults) against the modules built."""
    config = copy.deepcopy(get_entry("minicpm-o-2.6").config)
    config.update(hidden_size=128, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2, vocab_size=300, init_vision=False)
    config["audio_config"] = {"d_model": 64, "encoder_layers": 2, "encoder_attention_heads": 4,
                              "encoder_ffn_dim": 96, "max_source_positions": 40}
    config["tts_config"] = {"llm_dim": 128, "hidden_size": 64, "intermediate_size": 80,
                            "num_attention_heads": 4, "num_hidden_layers": 2,
                            "num_audio_tokens": 10, "num_text_tokens": 30, "num_vq": 2,
                            "use_mlp": False}
    spec = spec_from_hf_config(config, "tiny-minicpmo")
    llm, _, _ = _minicpmv_parts({k: v for k, v in config.items()
                                 if k not in ("audio_config", "tts_config")})
    apm, projection, tts = _minicpmo_audio_and_tts(config)
    assert spec.vision is None
    assert spec.other_params == _count(apm) + _count(projection) + _count(tts)
    assert spec.param_count == _count(llm) + spec.other_params


INTERNVL_TINY = [  # InternViT-6B-like towers too: RMSNorm, q/k norms, no qkv bias
    {"norm_type": "layer_norm", "qk_normalization": False, "qkv_bias": True},
    {"norm_type": "rms_norm", "qk_normalization": True, "qkv_bias": False},
]


@pytest.mark.parametrize("base", ["internvl2.5-1b", "internvl2.5-8b"])
@pytest.mark.parametrize("tower", INTERNVL_TINY)
def test_internvl_formulas_equal_transformers_internvl_on_tiny_shapes(base, tower):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = copy.deepcopy(get_entry(base).config)
    config["llm_config"].update(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                num_key_value_heads=2, num_hidden_layers=2, vocab_size=300,
                                bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    config["llm_config"].pop("pad_token_id", None)
    config["vision_config"].update(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                   num_hidden_layers=2, image_size=56, torch_dtype="float32",
                                   **tower)
    config.update(force_image_size=56, torch_dtype="float32")
    spec = spec_from_hf_config(config, "tiny-internvl")
    hf = buildable_hf_config(config)
    cfg = transformers.AutoConfig.for_model(
        "internvl", **{k: v for k, v in hf.items() if k != "model_type"})
    model = transformers.InternVLForConditionalGeneration(cfg)  # real weights: tiny
    assert spec.param_count == _count(model)
    assert spec.vision.param_count == _count(model.model.vision_tower) + _count(
        model.model.multi_modal_projector)
    assert spec.vision.tokens_per_image == (56 // 14) ** 2 // 4
    pixels = torch.zeros(1, 3, 56, 56)
    features = model.model.get_image_features(pixel_values=pixels)
    features = getattr(features, "pooler_output", features)
    assert features.shape[-2:] == (spec.vision.tokens_per_image, 64)


def test_internvl_language_models_map_as_transformers_converter_maps_them():
    eight, one = (buildable_hf_config(get_entry(n).config)
                  for n in ("internvl2.5-8b", "internvl2.5-1b"))
    assert eight["text_config"]["model_type"] == "llama" and eight["image_token_id"] == 92546
    assert one["text_config"]["model_type"] == "qwen2" and one["image_token_id"] == 151667
    assert eight["tie_word_embeddings"] is False and one["tie_word_embeddings"] is False
    assert get_entry("internvl2.5-8b").spec.fused_qkv  # InternLM2's wqkv
    assert not get_entry("internvl2.5-1b").spec.fused_qkv


@pytest.mark.parametrize("name", ["minicpm-v-2.6", "minicpm-o-2.6", "internvl2.5-8b"])
def test_a_local_folder_of_these_configs_reads_as_the_catalog_does(tmp_path, name):
    """Read as data: no --trust-remote-code needed, nothing run."""
    entry = get_entry(name)
    (tmp_path / "config.json").write_text(json.dumps(entry.config))
    spec = resolve_model(str(tmp_path)).spec
    assert spec.param_count == entry.spec.param_count and spec.vision == entry.spec.vision


def test_a_minicpmv_config_without_its_release_is_read_from_its_code(tmp_path):
    config = get_entry("minicpm-v-2.6").config
    del config["version"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    pytest.importorskip("transformers")
    import oomless.runtime.meta  # noqa: F401 - registers the structure reader
    from oomless.api import resolve_model as api_resolve
    from oomless.errors import ModelConfigError

    with pytest.raises(ModelConfigError, match="Pass --trust-remote-code"):
        api_resolve(str(tmp_path), trust_remote_code=False)


def test_remote_code_that_imports_a_missing_package_is_a_clear_refusal(tmp_path, capsys):
    """MiniCPM-V's modeling_minicpmv.py imports torchvision; where a package the code
    imports is not installed, transformers raises ImportError: exit 2 naming it."""
    pytest.importorskip("transformers")
    import oomless.runtime.meta  # noqa: F401 - registers the structure reader
    from oomless.cli import main

    config = get_entry("minicpm-v-2.6").config
    del config["version"]  # not read as data: the code is built
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "configuration_minicpm.py").write_text(
        "from transformers import PretrainedConfig\n\n\n"
        "class MiniCPMVConfig(PretrainedConfig):\n    model_type = 'minicpmv'\n")
    (tmp_path / "modeling_minicpmv.py").write_text(
        "import oomless_test_package_not_installed\n"
        "from transformers import PreTrainedModel\n\n\n"
        "class MiniCPMV(PreTrainedModel):\n    pass\n")
    rc = main(["estimate", str(tmp_path), "--trust-remote-code", "--gpu", "a100-80gb"])
    err = capsys.readouterr().err
    assert rc == 2 and "oomless_test_package_not_installed" in err
    assert "internal error" not in err and "Traceback" not in err


BUILD_INTERNVL = """
import json, sys, types
from torch import nn
from accelerate import init_empty_weights

class DropPath(nn.Module):  # timm is not installed; drop_path_rate 0.0 never builds one
    def __init__(self, *args, **kwargs):
        raise AssertionError("DropPath built")

timm, models, layers = (types.ModuleType(n) for n in ("timm", "timm.models", "timm.models.layers"))
layers.DropPath, timm.models, models.layers = DropPath, models, layers
sys.modules.update({"timm": timm, "timm.models": models, "timm.models.layers": layers})
sys.path.insert(0, sys.argv[1])
from internvl.model.internvl_chat import InternVLChatConfig, InternVLChatModel

out = {}
for name, config in json.loads(sys.argv[2]).items():
    kwargs = {k: v for k, v in config.items() if k not in ("architectures", "auto_map", "model_type")}
    with init_empty_weights():  # accelerate's way: parameters on meta, other tensors real
        model = InternVLChatModel(InternVLChatConfig(**kwargs))
    count = lambda m: sum(p.numel() for p in m.parameters())
    out[name] = [count(model), count(model.vision_model) + count(model.mlp1),
                 count(model.mlp1), type(model.language_model).__name__]
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_internvl_built_from_its_own_code_counts_what_the_catalog_counts():
    """OpenGVLab/InternVL's InternVLChatModel (fixtures/remote_code/internvl) built from each
    catalog config, in a process of its own (its package and the timm name stay out of this one)."""
    pytest.importorskip("accelerate")
    names = ("internvl2.5-8b", "internvl2.5-1b")
    configs = json.dumps({n: get_entry(n).config for n in names})
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", BUILD_INTERNVL, str(REMOTE / "internvl"),
                           configs], env=env, capture_output=True, text=True, timeout=300)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stdout[-2000:] + proc.stderr[-3000:]
    built = json.loads(line[-1].removeprefix("RESULT "))
    for name in names:
        spec = get_entry(name).spec
        total, vision, projector, lm_class = built[name]
        assert (total, vision, projector) == (
            spec.param_count, spec.vision.param_count, spec.vision.projector_params)
        assert lm_class == {"internvl2.5-8b": "InternLM2ForCausalLM",
                            "internvl2.5-1b": "Qwen2ForCausalLM"}[name]
