"""LoRA target_modules as a regular expression, resolved on the model built on the meta device.

PEFT (peft/tuners/tuners_utils.py check_target_module_exists) matches a string with
re.fullmatch against every full module name; oomless.check.lora_names does the same on
the module tree of the real transformers class (oomless.runtime.meta.linear_names).
"""

from __future__ import annotations

import pytest

import oomless.runtime.meta  # noqa: F401  (registers the meta-device module lister)
from oomless.check.checker import CheckOptions, check
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
