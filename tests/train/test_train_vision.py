"""Vision-language records (image + text) on a tiny LLaVA built locally."""

from __future__ import annotations

import json

import pytest

from oomless.config import DataConfig
from oomless.dataset.records import IGNORE_INDEX, load_examples
from oomless.errors import DataError
from oomless.runtime.train.loop import train

COLORS = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220)}


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from oomless.runtime.tiny import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "llava-tiny")


@pytest.fixture
def image_data(tmp_path):
    from PIL import Image

    for name, rgb in COLORS.items():
        Image.new("RGB", (40, 36), rgb).save(tmp_path / f"{name}.png")
    records = [{"messages": [{"role": "user", "content": "<image>What colour is this?"},
                             {"role": "assistant", "content": name}], "images": [f"{name}.png"]}
               for name in COLORS for _ in range(4)]
    records.append({"instruction": "Say hi.", "output": "hi"})  # text-only records mix in
    path = tmp_path / "vl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _vision(tiny_vlm):
    from oomless.dataset.vision import load_processor

    return load_processor(tiny_vlm)


def test_image_markers_expand_to_the_processor_tokens_and_carry_no_labels(tiny_vlm, image_data):
    vp = _vision(tiny_vlm)
    loaded = load_examples(image_data, vp.processor.tokenizer, DataConfig(), 128, vision=vp)
    ex = loaded.examples[0]
    positions = [i for i, t in enumerate(ex.input_ids) if t == vp.image_token_id]
    assert len(positions) == 16 and positions == list(range(positions[0], positions[0] + 16))
    assert all(ex.labels[i] == IGNORE_INDEX for i in positions)
    assert ex.images[0].endswith("red.png") and loaded.examples[-1].images == ()


@pytest.mark.parametrize(("record", "reason"), [
    ({"messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}],
      "images": ["missing.png"]}, "image file .*missing.png' not found"),
    ({"messages": [{"role": "user", "content": "<image><image>x"},
                   {"role": "assistant", "content": "y"}], "images": ["red.png"]},
     "2 '<image>' marker.* but 1 image"),
    ({"messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}],
      "images": "red.png"}, None),
])
def test_bad_image_records(tiny_vlm, image_data, record, reason):
    path = image_data.parent / "bad.jsonl"
    path.write_text(json.dumps(record) + "\n")
    vp = _vision(tiny_vlm)
    if reason is None:  # a single path string is accepted
        assert load_examples(path, vp.processor.tokenizer, DataConfig(), 128, vision=vp).examples
        return
    with pytest.raises(DataError, match=rf"bad\.jsonl:1: .*{reason}"):
        load_examples(path, vp.processor.tokenizer, DataConfig(), 128, vision=vp)


def test_image_cut_by_truncation_is_a_bad_record(tiny_vlm, image_data):
    vp = _vision(tiny_vlm)
    with pytest.raises(DataError, match="truncation would cut an image"):
        load_examples(image_data, vp.processor.tokenizer, DataConfig(max_input_length=10), 128,
                      vision=vp)


def test_lora_training_on_image_text_records(tiny_vlm, image_data, tmp_path):
    from safetensors.torch import load_file

    from oomless.config import RunConfig

    cfg = RunConfig.model_validate({
        "model": str(tiny_vlm), "method": "lora", "precision": "fp32", "seq_len": 128,
        "micro_batch_size": 2, "grad_accum": 2, "lora": {"r": 4, "dropout": 0.0},
        "data": {"train_file": str(image_data)},
        "training": {"max_steps": 3, "learning_rate": 1e-2, "output_dir": str(tmp_path / "run"),
                     "inject_oom": [{"step": 2}]},
    })
    result = train(cfg)
    assert result.steps == 3 and all(loss == loss for loss in result.losses)
    adapter = load_file(str(result.final_dir / "adapter_model.safetensors"))
    vision_b = [v for k, v in adapter.items() if "vision_tower" in k and "lora_B" in k]
    assert vision_b and any(v.abs().sum() > 0 for v in vision_b)  # the pixels reached the model
