"""Models the formulas do not know are read from their own code on the meta device.

Configs are transformers' own defaults for each model type (``AutoConfig.for_model``,
the released model's shapes for most of them), written to a folder as a user's
config.json would be; nothing is downloaded. Each is read through the same entry
`oomless estimate/check/plan` use (oomless.models.catalog.resolve_model) and compared
with the real model class built independently here: the parameter count exactly, and
the structure fields read from the module tree against the config.
"""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import oomless.runtime.meta  # noqa: E402,F401 - registers the structure reader
from oomless.cli import main  # noqa: E402
from oomless.errors import ModelConfigError  # noqa: E402
from oomless.models.catalog import resolve_model  # noqa: E402
from oomless.models.structure import allow_remote_code  # noqa: E402

# model types transformers implements and the formulas do not know (the list)
UNKNOWN_TYPES = ["ernie4_5_moe", "olmoe", "cohere2", "exaone4", "granitemoe", "minimax",
                 "smollm3", "arcee", "qwen3_next"]
# their layers hold operations the formulas lack: said in the assumptions
PARTLY_MODELLED = {"minimax": "output_gate", "qwen3_next": "no q/k/v attention"}


def _real_count(config: dict) -> int:
    d = dict(config)
    cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def _folder(tmp_path, config: dict, name: str = "model"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _default(model_type: str) -> dict:
    return transformers.AutoConfig.for_model(model_type).to_dict()


@pytest.mark.parametrize("model_type", UNKNOWN_TYPES)
def test_unknown_family_is_counted_exactly_from_its_code(tmp_path, model_type):
    config = _default(model_type)
    spec = resolve_model(str(_folder(tmp_path, config))).spec
    assert spec.param_count == _real_count(config)
    text = transformers.AutoConfig.for_model(model_type)
    assert spec.num_layers == text.num_hidden_layers
    assert spec.vocab_size == text.vocab_size
    assert spec.num_heads == text.num_attention_heads
    assert "meta device" in spec.assumptions[0]
    # every one of these classes checkpoints its layers (GradientCheckpointingLayer)
    assert not any("checkpoint" in a for a in spec.assumptions)
    if model_type in PARTLY_MODELLED:
        assert any(PARTLY_MODELLED[model_type] in a for a in spec.assumptions)
    else:  # the structure is fully read: what the formulas model is the whole model
        assert abs(spec.other_params) <= 0.01 * spec.param_count


@pytest.mark.parametrize("model_type,experts,top_k", [("olmoe", 64, 8), ("granitemoe", 8, 2),
                                                      ("ernie4_5_moe", 64, 6)])
def test_experts_and_top_k_come_from_the_modules(tmp_path, model_type, experts, top_k):
    spec = resolve_model(str(_folder(tmp_path, _default(model_type)))).spec
    assert (spec.num_experts, spec.experts_per_token) == (experts, top_k)
    assert spec.active_param_count < spec.param_count


def test_widths_come_from_the_projections_not_the_config(tmp_path):
    # arcee: a plain (ungated) MLP; granitemoe: experts 11008 wide inside fused gate_up
    arcee = resolve_model(str(_folder(tmp_path, _default("arcee"), "a"))).spec
    assert arcee.mlp_gated is False and arcee.intermediate_size == 18432
    granite = resolve_model(str(_folder(tmp_path, _default("granitemoe"), "g"))).spec
    assert granite.moe_intermediate_size == 11008 and granite.mlp_gated


def test_tiny_random_model_matches_the_read_structure(tmp_path):
    """A tiny model of an unknown family, built for real (random weights, CPU), runs a
    forward and has exactly the parameters the meta-device reading counted."""
    config = {k: v for k, v in _default("smollm3").items()
              if k not in ("layer_types", "no_rope_layers")}
    config |= {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
               "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    spec = resolve_model(str(_folder(tmp_path, config))).spec
    d = dict(config)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(d.pop("model_type"), **d))
    out = model(torch.randint(0, 128, (1, 8)))
    assert out.logits.shape == (1, 8, 128)
    assert spec.param_count == sum(p.numel() for p in model.parameters())
    assert (spec.num_layers, spec.num_kv_heads, spec.intermediate_size) == (2, 2, 96)


def _remote_config() -> dict:
    """A MiniCPM-V-2.6-shaped config: model_type minicpmv, code in modeling_minicpmv.py."""
    return {"architectures": ["MiniCPMV"], "model_type": "minicpmv",
            "auto_map": {"AutoConfig": "configuration_minicpm.MiniCPMVConfig",
                         "AutoModel": "modeling_minicpmv.MiniCPMV",
                         "AutoModelForCausalLM": "modeling_minicpmv.MiniCPMV"},
            "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
            "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 151666}


def test_qwen1_from_a_local_folder_is_counted_from_its_fields(tmp_path):
    """Qwen-7B's config.json (remote code) is read as data: no code runs, no consent
    needed; w1/w2 are intermediate_size // 2 wide (modeling_qwen.py QWenMLP)."""
    from oomless.models.catalog import get_entry

    spec = resolve_model(str(_folder(tmp_path, get_entry("qwen-7b").config))).spec
    assert spec.param_count == 7_721_324_544 and spec.intermediate_size == 11008


def test_remote_code_is_refused_without_consent(tmp_path, capsys):
    folder = _folder(tmp_path, _remote_config())
    rc = main(["estimate", str(folder), "--gpu", "a100-80gb"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "--trust-remote-code" in err and "modeling_minicpmv.py" in err
    assert "Traceback" not in err


def test_consent_without_the_code_names_the_missing_file(tmp_path, capsys):
    folder = _folder(tmp_path, _remote_config())
    rc = main(["estimate", str(folder), "--gpu", "a100-80gb", "--trust-remote-code"])
    err = capsys.readouterr().err
    assert rc == 2 and "modeling_minicpmv.py" in err and "never downloads" in err


def test_no_guess_when_neither_formulas_nor_code_know_the_model(tmp_path):
    config = _remote_config()
    del config["auto_map"]
    allow_remote_code(False)
    with pytest.raises(ModelConfigError, match="cannot size it"):
        resolve_model(str(_folder(tmp_path, config)))


def test_a_known_family_the_formulas_misread_is_taken_from_the_code(tmp_path):
    """Qwen3-0.6B's config without head_dim: Qwen3Config defaults it to 128, not
    hidden / heads = 64; the formulas' count is 15% short, so the code's structure wins."""
    from oomless.models.catalog import get_entry

    config = get_entry("qwen3-0.6b").config
    del config["head_dim"]
    spec = resolve_model(str(_folder(tmp_path, config))).spec
    assert spec.param_count == _real_count(config) == get_entry("qwen3-0.6b").spec.param_count
    assert spec.head_dim == 128
    assert any("the structure read from the code is used" in a for a in spec.assumptions)


def test_a_known_family_read_right_keeps_the_formulas(tmp_path):
    from oomless.models.catalog import get_entry

    config = get_entry("qwen3-0.6b").config
    spec = resolve_model(str(_folder(tmp_path, config, "qwen3-0.6b"))).spec
    assert spec == get_entry("qwen3-0.6b").spec
    assert not any("meta device" in a for a in spec.assumptions)


def test_the_api_entry_carries_the_consent(tmp_path):
    from oomless.api import resolve_model as api_resolve

    folder = _folder(tmp_path, _remote_config())
    with pytest.raises(ModelConfigError, match="modeling_minicpmv.py is not in"):
        api_resolve(str(folder), trust_remote_code=True)
    with pytest.raises(ModelConfigError, match="Pass --trust-remote-code"):
        api_resolve(str(folder), trust_remote_code=False)


def test_a_config_value_the_class_refuses_is_a_clear_refusal(tmp_path):
    """Llama-4-Scout's released attn_temperature_tuning is 4; transformers 5's strict
    Llama4TextConfig wants a bool (huggingface_hub StrictDataclassError, not a ValueError):
    refused with the class's reason, not a traceback. The catalog stores it as true."""
    from oomless.models.catalog import get_entry

    config = json.loads(json.dumps(get_entry("llama-4-scout-17b-16e-instruct").config))
    config["text_config"]["attn_temperature_tuning"] = 4
    with pytest.raises(ModelConfigError, match="attn_temperature_tuning"):
        resolve_model(str(_folder(tmp_path, config)))
