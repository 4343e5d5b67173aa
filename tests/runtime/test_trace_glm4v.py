"""GLM-4V: the analytic vision tower against a trace of a shape-faithful stand-in.

GLM-4V's EVA2-CLIP tower is remote code; tests/runtime/glm4v_shell.py re-creates
its shapes in plain torch (test-only, not part of oomless) in front of transformers'
GLM-4 language model. A 1120 px image runs 6,401 patches through the tower.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
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


def _shell_spec(config: dict) -> object:
    """The spec of exactly the shell: transformers' GLM-4 port (LM_LAYERS layers) with
    GLM-4V's tower (TOWER_LAYERS layers), its eager CoreAttention and its own loss."""
    glm = chatglm_to_glm(config)
    glm["num_hidden_layers"] = LM_LAYERS
    glm4v = resolve_model("glm-4v-9b").spec
    vision = dataclasses.replace(glm4v.vision, num_layers=TOWER_LAYERS)
    return dataclasses.replace(spec_from_hf_config(glm, "glm-4v shell"), vision=vision,
                               model_type=glm4v.model_type, sdpa_supported=glm4v.sdpa_supported)


def _non_weights(breakdown: dict[str, int]) -> int:
    return sum(v for k, v in breakdown.items() if k != "weights")


@pytest.mark.parametrize("freeze_tower, autocast, rows, grad_ckpt",
                         [(True, None, 1, False), (False, None, 1, False),
                          (False, False, 1, False), (False, False, 2, True)])
def test_eva2clip_tower_at_1120px_analytic_equals_the_trace(freeze_tower, autocast, rows,
                                                            grad_ckpt):
    """autocast False: HF Trainer without bf16/fp16 on finetune_vision.py's bf16 model
    (GLM-4's finetune_demo LoRA YAML): PEFT's fp32 adapters copy each input to fp32.
    Two rows with checkpointing: the shifted logits are copied (one row's are not),
    ChatGLM's bf16 cast of the logits sits on top at the forward's peak, and one
    language layer's eager CoreAttention is recomputed in the backward."""
    config = get_entry("glm-4v-9b").config
    cfg = RunConfig(model="glm-4v-9b", seq_len=256, data={"images_per_sample": 1},
                    micro_batch_size=rows, grad_ckpt=grad_ckpt,
                    lora={"r": 8, "dropout": 0.1, "targets": ["q_proj", "k_proj", "v_proj"]},
                    vision={"freeze_tower": freeze_tower},
                    stack_options={"autocast": autocast})
    spec = _shell_spec(config)
    model, layers = build_fake_shell(config, cfg, LM_LAYERS, TOWER_LAYERS)
    with fake_mode():
        one = shell_batch(model, config["vision_config"], cfg.seq_len, image_tokens(spec, cfg))
        batch = {k: torch.cat([v] * rows) for k, v in one.items()}
    stats = trace_module(model, cfg, batch, num_layers=layers,
                         loss_fn=lambda m, b: m(**b).loss)
    est = estimate_training(spec, cfg)
    assert stats.trainable_params == est.trainable_params
    for phase in ("forward", "backward"):
        ratio = _non_weights(est.breakdown[phase]) / _non_weights(stats.breakdown[phase])
        assert abs(ratio - 1) < 0.02, phase


def test_glm4v_readme_configuration_needs_the_tower_trained():
    """GLM-4's README: LoRA of GLM-4V-9B, "Include EVA2CLIPModel" (batch 1, 512 + 512
    tokens, one 1120 px image, r 8 on query_key_value, finetune_demo's gradient
    checkpointing of the language layers): the trained, uncheckpointed tower is the
    largest part of the step. The README's 75 GB itself is held by
    tests/check/test_glm4v_story.py."""
    spec = resolve_model("glm-4v-9b").spec
    common = dict(model="glm-4v-9b", seq_len=1024, precision="pure-bf16", grad_ckpt=True,
                  data={"images_per_sample": 1},
                  lora={"r": 8, "dropout": 0.1, "targets": ["query_key_value"]})
    with_tower = estimate_training(spec, RunConfig(**common, vision={"freeze_tower": False}))
    frozen = estimate_training(spec, RunConfig(**common))
    assert frozen.device_peak_bytes < 0.75 * with_tower.device_peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 2])
def test_the_readme_step_at_full_size_analytic_equals_the_trace(rows):
    """GLM-4's finetune_demo LoRA YAML as `oomless check` reads it, at full size (40
    language layers of 2,627 positions, 63 tower layers of 6,401 patches): the estimate's
    allocated peak (the catalog spec: ChatGLM's fused query_key_value) against a trace of
    the stand-in with GLM-4V's eager attention and ChatGLM's loss. The trace's allocator
    replay reserves more (tests/check/test_glm4v_story.py states both)."""
    from pathlib import Path

    from oomless.check.checker import CheckOptions, check

    yaml = Path(__file__).parents[1] / "fixtures/real_configs/glm-4/finetune_demo_lora.yaml"
    read = check(CheckOptions(files=(str(yaml),), gpu="a100-80gb", model="glm-4v-9b"))
    cfg = RunConfig.model_validate(read.config).replace(micro_batch_size=rows)
    config = get_entry("glm-4v-9b").config
    spec = resolve_model("glm-4v-9b").spec
    model, layers = build_fake_shell(config, cfg)
    with fake_mode():
        one = shell_batch(model, config["vision_config"], cfg.seq_len, image_tokens(spec, cfg))
        batch = {k: torch.cat([v] * rows) for k, v in one.items()}
    stats = trace_module(model, cfg, batch, num_layers=layers, loss_fn=lambda m, b: m(**b).loss)
    est = estimate_training(spec, cfg)
    assert abs(est.peak_allocated_bytes / max(stats.phase_peaks.values()) - 1) < 0.01
