"""Vision-language models: the tower runs with the language model in the trace, and
the analytic tower model equals it (LLaVA's CLIP tower, Qwen2-VL's ViT at two
resolutions, frozen and trained)."""

from __future__ import annotations

import pytest

from oomless.config import RunConfig
from oomless.memory import estimate_training
from oomless.memory.vision import image_geometry, smart_resize
from oomless.models.catalog import ResolvedModel
from oomless.models.hf_config import buildable_hf_config, spec_from_hf_config
from oomless.runtime.trace.fake import trace_training

TEXT = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=4, vocab_size=16000,
            max_position_embeddings=8192)
LLAVA = dict(model_type="llava", text_config=dict(model_type="llama", **TEXT),
             vision_config=dict(model_type="clip_vision_model", hidden_size=256,
                                intermediate_size=1024, num_hidden_layers=3,
                                num_attention_heads=4, image_size=224, patch_size=14),
             image_token_index=15999, vision_feature_layer=-2,
             vision_feature_select_strategy="default", tie_word_embeddings=False)
QWEN2_VL = dict(model_type="qwen2_vl", **TEXT, image_token_id=15998, video_token_id=15997,
                vision_start_token_id=15996, vision_end_token_id=15995,
                rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]},
                vision_config=dict(depth=3, embed_dim=256, mlp_ratio=4, num_heads=4,
                                   hidden_size=512, patch_size=14, spatial_merge_size=2,
                                   temporal_patch_size=2, in_chans=3))


def _compare(config: dict, **options) -> float:
    resolved = ResolvedModel(spec=spec_from_hf_config(config, "vlm"),
                             hf_config=buildable_hf_config(config), source="test")
    cfg = RunConfig(model="vlm", seq_len=256, micro_batch_size=1,
                    data={"images_per_sample": 1}, **options)
    traced = trace_training(cfg, resolved=resolved)
    assert not traced.extra.get("trace_fallback"), traced.extra.get("trace_fallback")
    assert traced.breakdown["optimizer"].get("inputs", 0) > 0  # the pixel tensors are there
    ours = estimate_training(resolved.spec, cfg)
    assert ours.trainable_params == traced.trainable_params
    return ours.peak_allocated_bytes / traced.peak_allocated_bytes - 1


@pytest.mark.parametrize("options", [
    {"method": "lora"},
    {"method": "lora", "vision": {"freeze_tower": False}},
    {"method": "full", "attn": "eager", "vision": {"freeze_tower": False}},
])
def test_llava_tower_analytic_equals_the_trace(options):
    assert abs(_compare(LLAVA, **options)) < 0.02


@pytest.mark.parametrize("options,tolerance", [
    ({"method": "lora", "vision": {"image_size": 448}}, 0.02),
    ({"method": "lora", "vision": {"image_size": 896, "freeze_tower": False}}, 0.02),
    # full fine-tuning of a 25M-parameter model: the allocator's rounding of the fp32
    # embedding, its AdamW states and lm_head's gradient (not modelled) weigh 2%
    ({"method": "full", "vision": {"image_size": 448, "freeze_tower": False}}, 0.03),
])
def test_qwen2_vl_tower_analytic_equals_the_trace(options, tolerance):
    assert abs(_compare(QWEN2_VL, **options)) < tolerance


def test_smart_resize_is_the_image_processors():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf

    for h, w, lo, hi in [(756, 756, 3136, 12845056), (1344, 1344, 3136, 768 * 768),
                         (100, 3000, 3136, 12845056), (20, 20, 3136, 12845056)]:
        assert smart_resize(h, w, 28, lo, hi) == hf(h, w, 28, lo, hi)


def test_patches_and_tokens_per_image():
    llava = spec_from_hf_config(LLAVA, "l").vision
    geo = image_geometry(llava, RunConfig(model="l"))
    assert (geo.patches, geo.tokens) == (16 * 16 + 1, 16 * 16)  # class token dropped
    qwen = spec_from_hf_config(QWEN2_VL, "q").vision
    big = image_geometry(qwen, RunConfig(model="q", vision={"image_size": 1344}))
    capped = image_geometry(qwen, RunConfig(model="q", vision={"image_size": 1344,
                                                               "max_pixels": 768 * 768}))
    assert (big.patches, big.tokens) == (96 * 96, 48 * 48)
    assert capped.tokens < big.tokens and capped.patches == 4 * capped.tokens
