"""LoRA target_modules as a regular expression, resolved on the model built on the meta device.

PEFT (peft/tuners/tuners_utils.py check_target_module_exists) matches a string with
re.fullmatch against every full module name; oomless.check.lora_names does the same on
the module tree of the real transformers class (oomless.runtime.meta.linear_names).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import oomless.runtime.meta  # noqa: F401  (registers the meta-device module lister)
from oomless.api import estimate
from oomless.check.checker import CheckOptions, check
from oomless.cli import main
from oomless.config import RunConfig
from oomless.errors import CannotTellError, ConfigError

RECIPE = """\
model_name_or_path: {model}
torch_dtype: bfloat16
use_peft: true
lora_r: 16
lora_alpha: 16
lora_target_modules: {targets}
bf16: true
per_device_train_batch_size: 2
max_length: 1024
gradient_checkpointing: true
"""


def _check(tmp_path, targets: str, model: str = "Qwen/Qwen2.5-0.5B-Instruct"):
    path = tmp_path / "sft.yaml"
    path.write_text(RECIPE.format(model=model, targets=targets))
    return check(CheckOptions(files=(str(path),), gpu="a100-80gb"))


def test_a_regex_is_the_names_it_matches(tmp_path):
    regex = _check(tmp_path, r"'.*self_attn\.(q_proj|v_proj)'")
    listed = _check(tmp_path, "[q_proj, v_proj]")
    assert regex.config["lora"]["targets"] == ["q_proj", "v_proj"]
    assert regex.phase_device_bytes == listed.phase_device_bytes
    assert any("48 language linears (q_proj, v_proj)" in n for n in regex.notes)


def test_a_regex_reaching_some_layers_only_cannot_be_told(tmp_path):
    with pytest.raises(CannotTellError, match=r"reaches 2 of the 24 'q_proj' modules"):
        _check(tmp_path, r"'.*layers\.(0|1)\..*q_proj'")


def test_a_regex_matching_nothing_or_not_compiling_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="matches no linear module"):
        _check(tmp_path, "'.*nothing_here'")
    with pytest.raises(ConfigError, match="not a valid regular expression"):
        _check(tmp_path, "'(q_proj'")


def test_the_vision_tower_is_reached_only_where_the_regex_names_its_modules(tmp_path):
    vl = "Qwen/Qwen2-VL-2B-Instruct"
    language = _check(tmp_path, "'model.language_model.*(q_proj|v_proj)'", vl)
    assert language.lora_reach == "LoRA on 28 language layers (q_proj, v_proj) (vision tower frozen)"
    everything = _check(tmp_path, "'.*'", vl)
    assert everything.lora_reach.startswith("LoRA on 28 language + 32 vision-tower layers")
    assert everything.config["vision"]["freeze_tower"] is False
    assert any("lm_head" in a and "not counted" in a for a in everything.assumptions)
    with pytest.raises(CannotTellError, match="reaches only the vision side"):
        _check(tmp_path, "'.*visual.*'", vl)


def test_peft_all_linear_reaches_the_vision_tower_when_nothing_freezes_it(tmp_path):
    """PEFT's all-linear takes every Linear but the output layer (tuners_utils
    _maybe_include_all_linear_layers); TRL freezes no tower."""
    vl = "Qwen/Qwen2-VL-2B-Instruct"
    r = _check(tmp_path, "all-linear", vl)
    assert r.lora_reach.startswith("LoRA on 28 language + 32 vision-tower layers")
    text = _check(tmp_path, "all-linear")
    assert text.lora_reach == "LoRA on 24 language layers (all linear layers)"


# ---- the same regex read from a launch script's flag (MiniCPM-V finetune.py) ---------------
# OpenBMB/MiniCPM-V finetune/finetune_lora.sh (tests/fixtures/real_configs/minicpm-v, commit
# 53c0174797d9b6505a91122ee5f59fb20a4cabc9): --lora_target_modules
# "llm\..*layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)", --tune_vision true; its
# finetune.py passes the string to LoraConfig(target_modules=...) and, with tune_vision,
# modules_to_save ['embed_tokens', 'resampler', 'vpm'].
MINICPM = Path(__file__).resolve().parents[1] / "fixtures" / "real_configs" / "minicpm-v"


def _minicpm(tmp_path, edit=lambda text: text) -> str:
    shutil.copytree(MINICPM, tmp_path / "minicpm-v")
    path = tmp_path / "minicpm-v" / "finetune" / "finetune_lora.sh"
    path.write_text(edit(path.read_text()))
    return str(path)


def _frozen_tower(text: str) -> str:
    assert text.count("--tune_vision true") == 1
    return text.replace("--tune_vision true", "--tune_vision false")


def test_minicpm_script_regex_reaches_the_language_model_only(tmp_path, monkeypatch):
    """llm\\. restricts LoRA to the language model: MiniCPM-o's llm is transformers'
    Qwen2ForCausalLM (families.json module_parts), listed on the meta device; the
    expression cannot match a name under vpm., resampler. (partial matching)."""
    path = _minicpm(tmp_path, _frozen_tower)
    monkeypatch.chdir(Path(path).parent)
    r = check(CheckOptions(files=(path,), gpu="a100-80gb"))
    assert r.model == "minicpm-o-2.6"
    assert r.lora_reach == ("LoRA on 28 language layers (k_proj, o_proj, q_proj, v_proj) "
                            "(vision tower frozen), copies of embed_tokens, resampler")
    assert r.config["lora"]["targets"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert r.config["vision"]["freeze_tower"] is True
    note = next(n for n in r.notes if "re.fullmatch" in n)
    assert "112 language linears" in note and "vision tower" not in note
    assert "can match no name under vpm., resampler." in note
    assert r.config["lora"]["modules_to_save"] == ["embed_tokens", "resampler"]
    assert any("trains embed_tokens, resampler next to LoRA" in n and "counted" in n
               for n in r.notes)
    est = estimate(RunConfig.model_validate(r.config))
    copies = next(a for a in est.assumptions if a.startswith("PEFT modules_to_save"))
    assert "embed_tokens (input embedding, 543,692,800 parameters)" in copies
    assert "resampler (projector, 68,619,264 parameters)" in copies


def test_minicpm_script_as_published_trains_the_tower_fully_and_is_estimated(tmp_path,
                                                                           monkeypatch, capsys):
    """--tune_vision true with LoRA: finetune.py puts vpm in modules_to_save (a trainable
    copy of the whole tower) next to embed_tokens and resampler: estimated with the copies,
    their gradients and optimizer states and the tower's activations."""
    path = _minicpm(tmp_path)
    monkeypatch.chdir(Path(path).parent)
    assert main(["check", path, "--gpu", "a100-80gb"]) == 0
    out = capsys.readouterr().out
    assert ("LoRA on 28 language layers (k_proj, o_proj, q_proj, v_proj) + vision tower trained "
            "fully (modules_to_save vpm), copies of embed_tokens, resampler") in out
    r = check(CheckOptions(files=(path,), gpu="a100-80gb"))
    assert r.config["lora"]["modules_to_save"] == ["embed_tokens", "resampler", "vpm"]
    frozen = check(CheckOptions(files=(_minicpm(tmp_path / "f", _frozen_tower),),
                                gpu="a100-80gb"))
    trained, without = (estimate(RunConfig.model_validate(c.config)) for c in (r, frozen))
    # ZeRO-2 over 8 GPUs, fp16: the tower's copy (the SigLIP tower without the resampler)
    # adds its 16-bit weights whole, its 16-bit gradient, fp32 master weights and AdamW
    # states as eighths; the tower keeps activations it did not keep frozen
    tower = 486_411_504 - 68_619_264
    assert trained.trainable_params - without.trainable_params == tower
    opt, opt_frozen = trained.breakdown["optimizer"], without.breakdown["optimizer"]
    assert opt["saved_modules"] - opt_frozen["saved_modules"] == 2 * tower
    for key, per_param in (("optimizer", 8), ("master_weights", 4), ("gradients", 2)):
        assert opt[key] - opt_frozen[key] == pytest.approx(per_param * tower / 8, abs=2), key
    assert trained.breakdown["backward"]["activations"] > without.breakdown["backward"][
        "activations"]
    assert "vision tower trained (its modules_to_save copy)" in " ".join(trained.assumptions)


def test_minicpm_default_targets_are_the_regex_of_finetune_py(tmp_path, monkeypatch):
    """No --lora_target_modules: LoraArguments' default regex (q, k, v of llm's layers)."""
    def drop(text: str) -> str:
        line = next(x for x in text.splitlines() if "--lora_target_modules" in x)
        return _frozen_tower(text.replace(line + "\n", ""))

    path = _minicpm(tmp_path, drop)
    monkeypatch.chdir(Path(path).parent)
    r = check(CheckOptions(files=(path,), gpu="a100-80gb"))
    assert r.config["lora"]["targets"] == ["k_proj", "q_proj", "v_proj"]
    assert r.lora_reach.startswith("LoRA on 28 language layers (k_proj, q_proj, v_proj)")


def test_a_minicpm_regex_that_can_reach_the_tower_cannot_be_told(tmp_path, monkeypatch):
    """'.*self_attn\\.(q_proj|v_proj)' can match names under vpm. (SigLIP's self_attn):
    without the checkpoint's code oomless cannot list them, so it says so."""
    def widen(text: str) -> str:
        line = next(x for x in text.splitlines() if "--lora_target_modules" in x)
        return _frozen_tower(text.replace(
            line, '    --lora_target_modules ".*self_attn\\.(q_proj|v_proj)" \\'))

    path = _minicpm(tmp_path, widen)
    monkeypatch.chdir(Path(path).parent)
    with pytest.raises(CannotTellError, match=r"under vpm\. \(vision tower\), resampler\. "
                       r"\(projector\).*--trust-remote-code"):
        check(CheckOptions(files=(path,), gpu="a100-80gb"))


def test_a_part_is_ruled_out_only_when_no_name_under_it_can_match():
    from oomless.check.lora_names import _parts_reached

    parts = {"vpm.": "vision tower", "resampler.": "projector"}
    assert _parts_reached(r"llm\..*layers\.\d+\.self_attn\.(q_proj|k_proj)", parts) == []
    assert _parts_reached(r".*q_proj", parts) == ["vpm. (vision tower)",
                                                  "resampler. (projector)"]
    assert _parts_reached(r"(vpm|llm)\.encoder\..*", parts) == ["vpm. (vision tower)"]
    assert _parts_reached(r"vp", parts) == []  # a string shorter than the prefix


def test_a_python_script_hands_peft_its_string_as_a_regex(tmp_path):
    """LoraConfig(target_modules="...") is a regular expression (PEFT fullmatches a str);
    a list is names: both read through the same resolver."""
    script = tmp_path / "train.py"
    body = ("from transformers import AutoModelForCausalLM, TrainingArguments\n"
            "from peft import LoraConfig\n"
            "model = AutoModelForCausalLM.from_pretrained('Qwen/Qwen2.5-0.5B-Instruct')\n"
            "config = LoraConfig(r=8, target_modules={targets})\n"
            "args = TrainingArguments(output_dir='o', per_device_train_batch_size=2, bf16=True)\n")
    script.write_text(body.format(targets=r"r'model\.layers\.\d+\.mlp\.(up_proj|down_proj)'"))
    regex = check(CheckOptions(files=(str(script),), gpu="a100-80gb", seq_len=512))
    assert regex.config["lora"]["targets"] == ["down_proj", "up_proj"]
    assert any("re.fullmatch" in n for n in regex.notes)
    script.write_text(body.format(targets="['up_proj', 'down_proj']"))
    listed = check(CheckOptions(files=(str(script),), gpu="a100-80gb", seq_len=512))
    assert sorted(listed.config["lora"]["targets"]) == ["down_proj", "up_proj"]
    assert regex.phase_device_bytes == listed.phase_device_bytes


def test_parts_are_told_by_the_familys_prefixes_where_no_vision_word_marks_them():
    """MiniCPM-V's tower is ``vpm.``: no vision word in its names; the family row's
    module_parts says which part each prefix is (a tree built from a local folder with
    --trust-remote-code has these names)."""
    from oomless.check.lora_names import _prefixes, split_by_part

    names = ("llm.model.layers.0.self_attn.q_proj", "vpm.encoder.layers.0.self_attn.q_proj",
             "resampler.kv_proj", "apm.layers.0.self_attn.q_proj", "llm.lm_head")
    by_words = split_by_part(names)
    assert "vpm.encoder.layers.0.self_attn.q_proj" in by_words["language"]
    parts = split_by_part(names, _prefixes("minicpm-o"))
    assert parts["language"] == ["llm.model.layers.0.self_attn.q_proj", "llm.lm_head"]
    assert parts["vision tower"] == ["vpm.encoder.layers.0.self_attn.q_proj"]
    assert parts["projector"] == ["resampler.kv_proj"]
    assert parts["audio encoder"] == ["apm.layers.0.self_attn.q_proj"]
    assert _prefixes("qwen2") == {}  # a family without module_parts: the words decide
