"""One row of family facts per catalog family (oomless/data/families.json), complete,
and every place that needs a family fact reads it from there.

LLAMAFACTORY_TEMPLATES: the names ``register_template(name=...)`` registers in
hiyouga/LLaMA-Factory src/llamafactory/data/template.py at commit
ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30 (2026-08-18), read with the project's code
search; a template the table names must be one of them.
"""

from __future__ import annotations

import pytest

from oomless.config import RunConfig
from oomless.models.catalog import family_of_model_type, list_models
from oomless.models.families import (
    OPTIONAL_KEYS,
    ROW_KEYS,
    family_facts,
    family_rows,
    own_attention_rows,
    tower_kinds,
)
from oomless.planner.writers import lf_template, llamafactory_config, readme

LLAMAFACTORY_TEMPLATES = frozenset("""
custom alpaca bailing bailing_v2 breeze chatglm3 chatml chatml_de cohere cpm4 dbrx deepseek
deepseek3 deepseekr1 hy3 deepseekcoder default dots_ocr empty ernie ernie_nothink ernie_vl
exaone falcon falcon_h1 fewshot gemma gemma2 gemma3 gemma3n gemma4 gemma4n glm4 glm4_moe
glm4v glm4_5v glm_ocr glm4_7 glmz1 gpt_oss granite3 granite3_vision granite4 index hunyuan
hunyuan_small hy_dense_1_8b hy_dense_7b intern2 intern_vl intern_s1 keye_vl kimi_vl lfm2
lfm2_vl llama2 llama2_zh llama3 llama4 mllama moonlight moss_vl llava llava_next
llava_next_llama3 llava_next_mistral llava_next_qwen llava_next_yi llava_next_video
llava_next_video_mistral llava_next_video_yi mimo mimo_v2 mimo_vl minicpm_v minicpm_v_4_6
minicpm_o minimax1 minimax2 ministral mistral mistral_small ministral3 olmo openchat
openchat-3.6 opencoder paligemma paligemma_chat phi phi_small phi4 phi4_mini pixtral qwen
qwen3 qwen3_nothink qwen2_audio qwen2_omni qwen3_omni qwen3_omni_nothink qwen2_vl qwen3_vl
qwen3_vl_nothink qwen3_5 qwen3_5_nothink qwen3_6 sailor seed_coder seed_oss smollm smollm2
solar starchat telechat2 vicuna video_llava xuanyuan yi yi_vl youtu youtu_vl yuan zephyr aeva
""".split())

CATALOG_FAMILIES = sorted({e.family for e in list_models()})


@pytest.mark.parametrize("family", CATALOG_FAMILIES)
def test_every_catalog_family_has_a_complete_row(family):
    facts = family_facts(family)
    assert facts is not None, f"families.json has no row for catalog family '{family}'"
    assert facts.source
    assert facts.loss
    if facts.llamafactory_template is None:
        assert len(facts.template_note) > 20  # the reason no template is written
    else:
        assert facts.llamafactory_template in LLAMAFACTORY_TEMPLATES
    if facts.vision_tower is not None:
        assert facts.vision_tower in tower_kinds()


def test_rows_hold_every_key_and_no_row_is_orphaned():
    import json
    from importlib import resources

    raw = json.loads(resources.files("oomless.data").joinpath("families.json").read_text())
    for name, row in raw["families"].items():
        assert set(ROW_KEYS) <= set(row) <= set(ROW_KEYS) | set(OPTIONAL_KEYS), name
    assert set(family_rows()) == set(CATALOG_FAMILIES)


@pytest.mark.parametrize("name", [e.name for e in list_models()])
def test_catalog_vision_models_carry_their_familys_tower(name):
    entry = next(e for e in list_models() if e.name == name)
    facts = family_facts(entry.family)
    kind = entry.spec.vision.kind if entry.spec.vision else None
    if kind is not None:
        assert facts.vision_tower == kind
        assert entry.spec.vision.checkpointed == tower_kinds()[kind]["checkpointed"]


@pytest.mark.parametrize("family", CATALOG_FAMILIES)
def test_the_llamafactory_yaml_names_the_familys_template_or_none_with_a_note(family):
    entry = next(e for e in list_models() if e.family == family)
    cfg = RunConfig(model=entry.name, method="lora")
    lf = llamafactory_config(cfg, entry.spec, entry.hf_id, family, None)
    template, note = lf_template(family)
    assert lf.get("template") == template
    text = readme(cfg, ["llamafactory.yaml"], False, None, family)
    if template is None:
        assert "template" not in lf and note and note in text
    else:
        assert lf["template"] != "default" and "names no `template`" not in text


def test_a_model_outside_the_catalog_gets_no_template_and_says_why():
    entry = list_models()[0]
    lf = llamafactory_config(RunConfig(model=entry.name), entry.spec, "/models/x", "", None)
    assert "template" not in lf
    assert "not in oomless's catalog" in lf_template("")[1]


def test_glm4v_tower_is_not_checkpointed_and_hf_towers_are():
    kinds = tower_kinds()
    assert kinds["eva2clip"]["checkpointed"] is False
    assert all(kinds[k]["checkpointed"] for k in ("clip", "qwen2_vl", "qwen2_5_vl"))


TRAINER_BUILDS = [(f, t) for f, row in family_rows().items() for t in (row.trainer_builds or {})]


@pytest.mark.parametrize(("family", "trainer"), TRAINER_BUILDS)
def test_every_trainer_builds_row_names_a_trainer_and_keys_the_models_code_reads(family, trainer):
    """Each trainer_builds row: a script tool of the flag table or a stack, a source, and
    config keys that change what every catalog model of the family builds (none adds
    parameters; the row is applied by oomless.check.assemble.as_the_trainer_builds)."""
    from typing import get_args

    from oomless.check.scripts.flags import TOOLS
    from oomless.config.sections import Stack
    from oomless.models.hf_config import spec_from_hf_config

    row = family_rows()[family].trainer_builds[trainer]
    assert trainer in TOOLS or trainer in get_args(Stack)
    assert row["who"] and row["source"].startswith("https://github.com/") and row["config"]
    members = [e for e in list_models() if e.family == family]
    assert members
    for entry in members:
        built = spec_from_hf_config(entry.config | row["config"], entry.name)
        assert 0 < built.param_count < entry.spec.param_count


PARTS = [f for f, row in family_rows().items() if row.module_parts]


@pytest.mark.parametrize("family", PARTS)
def test_every_module_parts_row_builds_its_language_model_from_transformers(family):
    """module_parts: the language model's prefix and the transformers model type its code
    builds (the catalog members' text-model parameters match that class's count); the
    other parts are prefixes of modules, each naming its part."""
    from oomless.models.hf_config import spec_from_hf_config

    parts = family_rows()[family].module_parts
    assert parts["language"]["prefix"].endswith(".") and parts["source"]
    assert all(p.endswith(".") and part for p, part in parts["others"].items())
    assert family_rows()[family].remote_code
    for entry in (e for e in list_models() if e.family == family):
        config = {k: v for k, v in entry.config.items() if k not in ("auto_map", "architectures")}
        text = spec_from_hf_config(config | {"model_type": parts["language"]["model_type"]},
                                   entry.name)
        vision = entry.spec.vision.param_count if entry.spec.vision else 0
        assert text.param_count + vision + entry.spec.other_params == entry.spec.param_count


def test_a_model_type_names_its_family_only_when_one_family_has_it():
    assert family_of_model_type("minicpmo") == "minicpm-o"
    assert family_of_model_type("minicpmv") is None  # MiniCPM-V-2.6 and MiniCPM-Llama3-V-2.5
    assert family_of_model_type("no-such-type") is None


@pytest.mark.parametrize("model_type", sorted(own_attention_rows()))
def test_every_own_attention_row_names_a_kernel_of_a_catalog_model_type(model_type):
    from oomless.allocator.attention_blocks import KERNELS, eager_kernel

    row = own_attention_rows()[model_type]
    assert row["eager"] in KERNELS and row["eager"] != "hf_eager" and row["source"]
    specs = [e.spec for e in list_models() if e.spec.model_type == model_type]
    assert specs and all(eager_kernel(spec) == row["eager"] for spec in specs)
