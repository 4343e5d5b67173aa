"""Image+text records for vision-language models that transformers implements.

Records name their images in ``images`` (paths relative to the data file's
folder) and mark where each goes with ``<image>`` in the user text (the
LLaMA-Factory convention; without any marker the images go before the first
user turn). The model's processor decides how many tokens an image becomes
(LLaVA: a fixed grid; Qwen2-VL: by resolution): oomless runs the processor
on the record once to count them, expands each marker to that many image
tokens (labels -100), and feeds the processor's pixel tensors at collate time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .formats import RecordError

PLACEHOLDER = "<image>"


def is_vision_model(model_dir: Path) -> bool:
    from ..errors import ModelConfigError
    from ..fileio import read_json

    config = read_json(Path(model_dir) / "config.json", "a model config (JSON object)",
                       ModelConfigError)
    return isinstance(config, dict) and "vision_config" in config


@dataclass(frozen=True)
class VisionProcessor:
    processor: Any
    image_token: str
    image_token_id: int
    wrap: tuple[str, str] = ("", "")  # Qwen2-VL: <|vision_start|> ... <|vision_end|>

    def marker(self) -> str:
        return f"{self.wrap[0]}{self.image_token}{self.wrap[1]}"


def load_processor(model_dir: Path, trust_remote_code: bool = False) -> VisionProcessor:
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code,
                                         local_files_only=True)
    vocab = proc.tokenizer.get_vocab()
    wrap = (("<|vision_start|>", "<|vision_end|>")
            if "<|vision_start|>" in vocab and "<|vision_end|>" in vocab else ("", ""))
    return VisionProcessor(proc, proc.image_token, proc.image_token_id, wrap)


def record_images(record: dict[str, Any], data_dir: Path) -> list[str]:
    """Absolute paths of a record's images; RecordError if any is missing."""
    raw = record.get("images") or record.get("image") or []
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not all(isinstance(p, str) and p for p in raw):
        raise RecordError("'images' must be a list of image file paths")
    paths = [(data_dir / p) if not Path(p).is_absolute() else Path(p) for p in raw]
    for p in paths:
        if not p.is_file():
            raise RecordError(f"image file '{p}' not found (paths are relative to the data file)")
    return [str(p) for p in paths]


def place_markers(msgs: list[dict[str, str]], n_images: int,
                  vp: VisionProcessor) -> list[dict[str, str]]:
    """Replace ``<image>`` markers by the model's image marker (or insert them)."""
    found = sum(m["content"].count(PLACEHOLDER) for m in msgs if m["role"] == "user")
    if found == 0:
        first = next(i for i, m in enumerate(msgs) if m["role"] == "user")
        msgs = [dict(m) for m in msgs]
        msgs[first]["content"] = PLACEHOLDER * n_images + msgs[first]["content"]
        found = n_images
    if found != n_images:
        raise RecordError(f"{found} '<image>' marker(s) in the user turns but {n_images} "
                          "image(s) in 'images'; give one marker per image")
    if any(PLACEHOLDER in m["content"] for m in msgs if m["role"] != "user"):
        raise RecordError("'<image>' markers belong in user turns only")
    return [{**m, "content": m["content"].replace(PLACEHOLDER, vp.marker())} for m in msgs]


def open_images(paths: list[str] | tuple[str, ...]) -> list[Any]:
    from PIL import Image, UnidentifiedImageError

    out = []
    for p in paths:
        try:
            with Image.open(p) as img:
                out.append(img.convert("RGB"))
        except (UnidentifiedImageError, OSError) as err:
            raise RecordError(f"cannot read image '{p}': {err}") from None
    return out


def image_token_counts(vp: VisionProcessor, text: str, paths: list[str]) -> list[int]:
    """Tokens each image becomes, in order, as the processor expands them."""
    out = vp.processor(text=[text], images=open_images(paths))
    ids = list(out["input_ids"][0])
    counts, run = [], 0
    for t in ids + [None]:
        if t == vp.image_token_id:
            run += 1
        elif run:
            counts.append(run)
            run = 0
    if len(counts) != len(paths):
        raise RecordError(f"the processor made {len(counts)} image token run(s) for "
                          f"{len(paths)} image(s)")
    return counts


def expand_image_tokens(ids: list[int], vp: VisionProcessor, counts: list[int]) -> list[int]:
    """Each single image token in ``ids`` becomes its image's run of tokens."""
    out: list[int] = []
    for t in ids:
        if t == vp.image_token_id:
            if not counts:
                raise RecordError("more image tokens in the text than images")
            out += [t] * counts.pop(0)
        else:
            out.append(t)
    return out


def pixel_inputs(vp: VisionProcessor, paths: list[str], device: Any) -> dict[str, Any]:
    """The image processor's tensors (pixel_values, image_grid_thw, ...) for a batch."""
    out = vp.processor.image_processor(images=open_images(paths), return_tensors="pt")
    return {k: v.to(device) for k, v in out.items() if hasattr(v, "to")}
