"""A tiny random-weight causal LM and a locally trained tokenizer, fully offline.

Used by ``oomless demo`` and by tests: ``build_tiny_model(path)`` writes a
normal Hugging Face folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a ChatML chat template, generation_config.json)
that ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer`` load like
any downloaded model. The tokenizer is a byte-level BPE trained with the
``tokenizers`` library on the shipped demo dataset (oomless/data/demo_sft.jsonl),
so no download is ever needed. Everything is seeded: the same arguments give
the same files.
"""

from __future__ import annotations

import json
import os
import shutil
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from ..dataset.formats import CHAT_TEMPLATE
from ..fileio import new_temp_dir, publish_dir

Arch = Literal["qwen2", "llama"]

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)

DEMO_DATA = "demo_sft.jsonl"


def demo_data_path() -> Path:
    """The shipped demo instruction dataset (alpaca format, ~200 records)."""
    return Path(str(resources.files("oomless.data").joinpath(DEMO_DATA)))


def _corpus() -> list[str]:
    """Text the tokenizer is trained on: the demo records plus the template words."""
    lines = ["system user assistant", "You are a helpful assistant."]
    with open(demo_data_path(), encoding="utf-8") as fh:
        for line in fh:
            rec = json.loads(line)
            lines.extend(str(v) for v in rec.values() if v)
    return lines


def build_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` with a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(
    arch: Arch = "qwen2",
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    tie_embeddings: bool = False,
    special_ids: dict[str, int] | None = None,
    initializer_range: float = 0.1,
) -> Any:
    """A small Qwen2 or Llama ``PretrainedConfig`` (float32, eager-safe sizes).

    ``initializer_range`` is 0.1, not the usual 0.02: with 0.02 the frozen random
    lm_head can only produce logits within about ±1.3, so LoRA cannot lower the
    loss much below ln(vocab); at 0.1 the demo's loss visibly falls in 30 steps.
    """
    from transformers import LlamaConfig, Qwen2Config

    ids = special_ids or {}
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_embeddings,
        initializer_range=initializer_range,
        pad_token_id=ids.get("pad"),
        eos_token_id=ids.get("eos"),
        bos_token_id=ids.get("bos"),
    )
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "llama":
        return LlamaConfig(**common)
    raise ValueError(f"unknown tiny architecture '{arch}': expected qwen2 or llama")


def _complete(path: Path) -> bool:
    need = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return all((path / name).is_file() for name in need)


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    arch: Arch = "qwen2",
    seed: int = 0,
    overwrite: bool = False,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random-weight model + tokenizer folder; returns its path.

    An existing complete folder is reused unless ``overwrite``. The folder is
    built in a temporary sibling and renamed into place (atomic). Keyword
    arguments override :func:`tiny_config` (hidden_size, num_layers, ...).
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    if _complete(out) and not overwrite:
        return out
    tokenizer = build_tokenizer(config_overrides.pop("vocab_size", 512))
    ids = {"pad": tokenizer.pad_token_id, "eos": tokenizer.eos_token_id, "bos": None}
    config = tiny_config(arch, vocab_size=len(tokenizer), special_ids=ids, **config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=ids["eos"], pad_token_id=ids["pad"], do_sample=False
    )
    return _save_folder(out, model, tokenizer)


IMAGE_TOKEN = "<image>"


def build_tiny_vlm(out_dir: str | os.PathLike[str], seed: int = 0, image_size: int = 32,
                   patch_size: int = 8, overwrite: bool = False) -> Path:
    """A tiny LLaVA (CLIP vision tower + projector + Qwen2 language model) with its processor.

    Each image becomes (image_size / patch_size)² tokens (16 by default). Saved
    as a normal folder that AutoModelForImageTextToText / AutoProcessor load.
    """
    import torch
    from transformers import (
        AutoModelForImageTextToText,
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaProcessor,
    )

    out = Path(out_dir)
    if _complete(out) and (out / "processor_config.json").is_file() and not overwrite:
        return out
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    ids = {"pad": tokenizer.pad_token_id, "eos": tokenizer.eos_token_id, "bos": None}
    text = tiny_config("qwen2", vocab_size=len(tokenizer), special_ids=ids)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, image_size=image_size,
                              patch_size=patch_size, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_select_strategy="default", vision_feature_layer=-1,
                         pad_token_id=ids["pad"], eos_token_id=ids["eos"])
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                               patch_size=patch_size, vision_feature_select_strategy="default",
                               chat_template=CHAT_TEMPLATE, num_additional_image_tokens=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    return _save_folder(out, model, processor)


def _save_folder(out: Path, model: Any, processor: Any) -> Path:
    """Write model and tokenizer/processor as one HF folder, atomically
    (a temporary folder beside it, then a rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_temp_dir(out.parent, out.name)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        processor.save_pretrained(tmp)
        publish_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out
