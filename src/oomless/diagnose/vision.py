"""Out-of-memory in a vision tower's attention: one image's patches attending to each other.

A ViT's attention without a fused kernel (eager, or SDPA's math path, which the
vision towers of Qwen2-VL and others fall back to with an attention mask)
materialises a (heads × patches × patches) score tensor per image: at 2 bytes
per score, a request of ``patches² × heads × 2`` bytes. Dynamic-resolution
models (Qwen2-VL/2.5-VL, GLM-4V at high resolution) turn an unresized large
image into tens of thousands of patches, so the request grows with the image
area squared and the micro batch is not the lever (one image does it).
"""

from __future__ import annotations

import math
import re

from ..units import GiB, fmt_bytes
from .events import Cause, Fix, OomEvent
from .view import GpuView

_VISION = re.compile(r"(?i)vision|visual|image_encoder|siglip|clip|eva2clip|\bvit\b|_vit")
_ATTENTION = re.compile(r"(?i)attention|attn|sdpa|softmax")
# Qwen2-VL / Qwen2.5-VL, CLIP ViT-L/14, SigLIP-so400m: 16 heads; the count when the
# model is not known
DEFAULT_HEADS = 16
PATCH_PIXELS = 14 * 14  # 14-pixel patches (Qwen2-VL, CLIP-L/14, EVA2-CLIP)
SCORE_BYTES = 2  # bf16/fp16 attention scores
# The share of the free memory the score tensor may take after the fix (the rest:
# the softmax output and the other layers' activations)
FREE_SHARE = 0.5


def vision_attention(event: OomEvent, view: GpuView, heads: int | None) -> tuple[float, Cause] | None:
    frames = " ".join(event.frames)
    req = view.requested_bytes
    if not req or req < GiB or not _VISION.search(frames) or not _ATTENTION.search(frames):
        return None
    h = heads or DEFAULT_HEADS
    patches = int(math.sqrt(req / (h * SCORE_BYTES)))
    assumed = "" if heads else " (16 heads assumed)"
    return 3.9, Cause(
        "vision_attention", "Vision attention over one very large image",
        f"the {fmt_bytes(req)} request ≈ {patches:,}² patches × {h} heads × {SCORE_BYTES} bytes"
        f"{assumed}: the vision tower's attention holds every patch pair of an image at once, so "
        "the image's size decides, not the micro batch",
        {"requested_bytes": req, "patches": patches, "heads": h})


def image_size_fix(cause: Cause, view: GpuView) -> Fix:
    heads = int(cause.numbers["heads"])
    free = view.available_bytes or 0
    room = max(1, int(math.sqrt(FREE_SHARE * free / (heads * SCORE_BYTES)))) if free else 0
    limit = (f"at most {room:,} patches per image fit in half of the {fmt_bytes(free)} free: "
             f"image_max_pixels {room * PATCH_PIXELS:,} (LLaMA-Factory; max_pixels of the "
             "Qwen2-VL processor), or resize the images" if room else
             "resize the images (LLaMA-Factory image_max_pixels, the processor's max_pixels)")
    return Fix("image_size", f"cap the image size: {limit}; a flash-attention vision tower "
               "keeps no patch × patch matrix", {"image_max_pixels": room * PATCH_PIXELS}
               if room else {}, keeps_training=False)
