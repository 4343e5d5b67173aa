"""GLM-4V: the analytic vision tower against a trace of a shape-faithful stand-in.

GLM-4V's EVA2-CLIP tower is remote code; tests/runtime/glm4v_shell.py re-creates
its shapes in plain torch (test-only, not part of oomless) in front of transformers'
GLM-4 language model. A 1120 px image runs 6,401 patches through the tower.
"""

from __future__ import annotations

import dataclasses

import pytest
from glm4v_shell import build_fake_shell, shell_batch

from oomless.config import RunConfig
from oomless.memory import estimate_training
from oomless.memory.vision import image_tokens
from oomless.models.catalog import get_entry, resolve_model
from oomless.models.hf_config import spec_from_hf_config
from oomless.models.hf_decoder import chatglm_to_glm
from oomless.runtime.build import fake_mode
from oomless.runtime.trace.module_trace import trace_module

LM_LAYERS, TOWER_LAYERS = 2, 3


def _non_weights(breakdown: dict[str, int]) -> int:
    return sum(v for k, v in breakdown.items() if k != "weights")


@pytest.mark.parametrize("freeze_tower, autocast", [(True, None), (False, None),
                                                    (False, False)])
def test_eva2clip_tower_at_1120px_analytic_equals_the_trace(freeze_tower, autocast):
    """autocast False: HF Trainer without bf16/fp16 on finetune_vision.py's bf16 model
    (GLM-4's finetune_demo LoRA YAML): PEFT's fp32 adapters copy each input to fp32."""
    config = get_entry("glm-4v-9b").config
    cfg = RunConfig(model="glm-4v-9b", seq_len=256, data={"images_per_sample": 1},
                    lora={"r": 8, "dropout": 0.1, "targets": ["q_proj", "k_proj", "v_proj"]},
                    vision={"freeze_tower": freeze_tower},
                    stack_options={"autocast": autocast})
    glm = chatglm_to_glm(config)
    glm["num_hidden_layers"] = LM_LAYERS
    vision = dataclasses.replace(resolve_model("glm-4v-9b").spec.vision, num_layers=TOWER_LAYERS)
    spec = dataclasses.replace(spec_from_hf_config(glm, "glm-4v shell"), vision=vision)
    model, layers = build_fake_shell(config, cfg, LM_LAYERS, TOWER_LAYERS)
    with fake_mode():
        batch = shell_batch(model, config["vision_config"], cfg.seq_len, image_tokens(spec, cfg))
    stats = trace_module(model, cfg, batch, num_layers=layers,
                         loss_fn=lambda m, b: m(**b).loss)
    est = estimate_training(spec, cfg)
    assert stats.trainable_params == est.trainable_params
    for phase in ("forward", "backward"):
        ratio = _non_weights(est.breakdown[phase]) / _non_weights(stats.breakdown[phase])
        assert abs(ratio - 1) < 0.02, phase


def test_glm4v_readme_configuration_needs_the_tower_trained():
    """GLM-4's README: LoRA of GLM-4V-9B, "Include EVA2CLIPModel", 75 GB on one GPU
    (batch 1, 512 + 512 tokens, one 1120 px image, r 8 on query_key_value)."""
    spec = resolve_model("glm-4v-9b").spec
    common = dict(model="glm-4v-9b", seq_len=1024, precision="pure-bf16",
                  data={"images_per_sample": 1},
                  lora={"r": 8, "dropout": 0.1, "targets": ["query_key_value"]})
    with_tower = estimate_training(spec, RunConfig(**common, vision={"freeze_tower": False}))
    frozen = estimate_training(spec, RunConfig(**common))
    assert abs(with_tower.device_peak_bytes / 75e9 - 1) < 0.15
    assert frozen.device_peak_bytes < 0.75 * with_tower.device_peak_bytes
