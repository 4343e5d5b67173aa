"""Vision towers: patches per image, what a trained tower keeps, a frozen tower's peak.

Patches come from the real preprocessing: fixed-size towers resize every image
to their own size (CLIP 336 px, EVA2-CLIP 1120 px: (side / patch)² patches plus a
class token); the Qwen2-VL family resizes with ``smart_resize``
(transformers models/qwen2_vl/image_processing_qwen2_vl.py): each side rounded
to a multiple of patch × merge (28 px), the area brought inside
[min_pixels, max_pixels]; the language model sees patches / merge² tokens.

A tower layer is a pre-norm (EVA2-CLIP: post-norm) ViT block, walked op by op
with the decoder's activation model (memory/activations.py) on a tower-shaped
spec: images × patches rows, bidirectional attention (SDPA/flash keep q, k, v,
output and log-sum-exp; eager keeps the heads × patches² probabilities in fp32
and 16 bits), a plain MLP with quick_gelu (CLIP, Qwen2-VL), gelu (EVA2-CLIP) or
a gated SiLU MLP (Qwen2.5-VL). The tower keeps tensors for backward only when
something in it is trained: its weights (full fine-tuning with the tower
unfrozen) or LoRA adapters (the run's targets reach its linears when it is not
frozen; GLM-4's ``freezeV: false`` with ``query_key_value``, "Include
EVA2CLIPModel"). A frozen tower runs without a graph: one layer's
intermediates at a time (LLaVA also holds every layer's output: it asks for
``output_hidden_states`` to pick layer −2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import RunConfig
from ..models.saved_modules import projector_inside_tower, saved_parts
from ..models.spec import ModelSpec, VisionSpec
from .activations import LayerPlan, layer_activation_bytes
from .precision import Dtypes, saved_copy_dtypes
from .stages import stage_plan

# Qwen2VLImageProcessor defaults (Qwen/Qwen2-VL-7B-Instruct preprocessor_config.json)
QWEN2_VL_MIN_PIXELS = 3136  # 56 × 56
QWEN2_VL_MAX_PIXELS = 12845056  # 28 × 28 × 16384
# module names towers use, as the canonical names of the activation model
_TOWER_ALIASES = {"query_key_value": "qkv_proj", "qkv": "qkv_proj", "dense": "o_proj",
                  "out_proj": "o_proj", "proj": "o_proj", "fc1": "up_proj", "fc2": "down_proj"}


@dataclass(frozen=True)
class ImageGeometry:
    patches: int  # rows the tower runs per image (class token included)
    tokens: int  # positions the language model gives one image
    grid: tuple[int, int]  # patch grid (rows, columns)


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """The Qwen2-VL image processor's resize: sides multiples of ``factor``, area kept
    within [min_pixels, max_pixels], aspect ratio about the same."""
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_geometry(vision: VisionSpec, cfg: RunConfig) -> ImageGeometry:
    if vision.dynamic_resolution:
        side = cfg.vision.image_size or vision.image_size
        factor = vision.patch_size * vision.merge_size
        h, w = smart_resize(side, side, factor, cfg.vision.min_pixels or QWEN2_VL_MIN_PIXELS,
                            cfg.vision.max_pixels or QWEN2_VL_MAX_PIXELS)
        grid = (h // vision.patch_size, w // vision.patch_size)
        return ImageGeometry(grid[0] * grid[1], grid[0] * grid[1] // vision.merge_size**2, grid)
    side = vision.image_size // vision.patch_size
    return ImageGeometry(side * side + int(vision.class_token), vision.tokens_per_image,
                         (side, side))


def image_tokens(spec: ModelSpec, cfg: RunConfig) -> int:
    """Language-model positions per image (``data.image_tokens`` overrides)."""
    if not spec.vision:
        return 0
    return cfg.data.image_tokens or image_geometry(spec.vision, cfg).tokens


def tower_spec(vision: VisionSpec) -> ModelSpec:
    """The tower's layer as a spec the activation model walks."""
    return ModelSpec(
        name=f"{vision.kind} vision tower", model_type=f"{vision.kind}_vision", vocab_size=0,
        hidden_size=vision.hidden_size, num_layers=vision.num_layers,
        num_heads=vision.num_heads, num_kv_heads=vision.num_heads,
        head_dim=vision.hidden_size // vision.num_heads,
        intermediate_size=vision.intermediate_size, mlp_gated=vision.mlp_gated,
        hidden_act=vision.hidden_act, fused_qkv=vision.fused_qkv, qkv_bias=True, o_bias=True,
        mlp_bias=True, norm_type="rms" if vision.norm_type == "rms" else "layer")


def tower_attn(spec: ModelSpec, cfg: RunConfig) -> str:
    """The tower's attention kernel: GLM-4V's visual.py calls SDPA itself (torch ≥ 2);
    transformers towers run the model's attn_implementation; flash keeps what SDPA does."""
    if cfg.vision.attn != "auto":
        return cfg.vision.attn
    if spec.vision and spec.vision.kind == "eva2clip":
        return "sdpa"
    return "eager" if cfg.attn == "eager" else "sdpa"


def copied_parts(spec: ModelSpec, cfg: RunConfig) -> frozenset[str]:
    """The parts PEFT trains as copies next to LoRA (``lora.modules_to_save``,
    models/saved_modules.py): "vision tower", "projector", "embedding", "lm_head"."""
    if cfg.method == "full" or not cfg.lora.modules_to_save:
        return frozenset()
    return frozenset(p.part for p in saved_parts(spec, cfg.lora.modules_to_save))


def tower_plan(spec: ModelSpec, cfg: RunConfig) -> LayerPlan | None:
    """What of a tower layer is trained (None: nothing, the tower keeps no graph). A
    tower in ``lora.modules_to_save`` trains in full (its copy), frozen original or not."""
    if not spec.vision or not cfg.data.images_per_sample:
        return None
    copied = "vision tower" in copied_parts(spec, cfg)
    if cfg.vision.freeze_tower and not copied:
        return None
    tower = tower_spec(spec.vision)
    names = frozenset(lin.name for lin in tower.layer_linears())
    attn = tower_attn(spec, cfg)
    if cfg.method == "full" or copied:
        return LayerPlan(names, frozenset(), cfg.lora.r, False, True, attn)
    targets = cfg.lora.targets
    if targets == "all-linear":
        wrapped = names
    else:
        wanted = {_TOWER_ALIASES.get(t, t) for t in targets}
        wrapped = frozenset(n for n in names if n in wanted or (
            n == "qkv_proj" and wanted & {"q_proj", "k_proj", "v_proj"}))
    if not wrapped:
        return None
    return LayerPlan(frozenset(), frozenset(wrapped), cfg.lora.r, cfg.lora.dropout > 0, False, attn)


def tower_rows(spec: ModelSpec, cfg: RunConfig) -> tuple[int, int]:
    """(images in a micro batch, patches per image)."""
    images = cfg.micro_batch_size * cfg.data.images_per_sample
    return images, image_geometry(spec.vision, cfg).patches


def tower_saved_bytes(spec: ModelSpec, cfg: RunConfig, dt: Dtypes) -> dict[str, float]:
    """What a trained tower keeps for backward: all its layers (or, with gradient
    checkpointing of a tower whose code checkpoints — ``VisionSpec.checkpointed`` —
    each layer's input) and one layer's worth for recomputation."""
    plan = tower_plan(spec, cfg)
    if plan is None:
        return {"layers": 0, "one_layer": 0}
    images, patches = tower_rows(spec, cfg)
    tower = tower_spec(spec.vision)
    layer = layer_activation_bytes(tower, images, patches, dt, plan)
    rows = images * patches
    embeddings = dt.resid_bytes * rows * tower.hidden_size  # patch embedding + positions
    if plan.trainable:  # the trained patch convolution keeps its 16-bit pixels
        embeddings += dt.act_bytes * rows * 3 * 2 * spec.vision.patch_size**2 \
            if spec.vision.dynamic_resolution else dt.act_bytes * images * 3 * (
                spec.vision.image_size**2)
    if cfg.grad_ckpt and spec.vision.checkpointed:
        layers = tower.num_layers * dt.resid_bytes * rows * tower.hidden_size
    else:
        layers = tower.num_layers * layer
    return {"layers": layers + embeddings + projector_saved_bytes(spec, cfg, dt),
            "one_layer": layer}


def projector_saved_bytes(spec: ModelSpec, cfg: RunConfig, dt: Dtypes) -> float:
    """The projector's activations when the gradient passes through it (a trained
    tower): the inputs of its activation functions and norms (frozen linears keep
    nothing; a trained projector also keeps its linears' inputs)."""
    vision = spec.vision
    images = cfg.micro_batch_size * cfg.data.images_per_sample
    tokens = images * image_geometry(vision, cfg).tokens
    h, a = spec.hidden_size, dt.act_bytes
    copied = copied_parts(spec, cfg)
    trained = not cfg.vision.freeze_projector or "projector" in copied or (
        "vision tower" in copied and vision.kind in projector_inside_tower())
    # fp32 weights under autocast (full fine-tuning): the 16-bit copies of the projector's
    # weights stay for the gradient of its input (autocast's weight cache)
    casts = a * vision.projector_params if (dt.autocast and dt.base_weight_bytes == 4) else 0
    if vision.kind == "eva2clip":  # conv 2×2, GLU: linear, LayerNorm, GELU, SiLU(gate)·up, down
        ffn = spec.intermediate_size
        kept = tokens * (4 * h + 3 * a * ffn + a * h)
        return casts + kept + (a * tokens * (4 * vision.hidden_size + 2 * h + ffn) if trained else 0)
    width = vision.hidden_size * vision.merge_size**2
    kept = a * tokens * (width if vision.merge_size > 1 else h)  # GELU input
    if vision.merge_size > 1:  # Qwen2-VL's merger normalises first (LayerNorm: fp32 input)
        kept += 4 * tokens * width
    return casts + kept + (a * tokens * (width + h) if trained else 0)


def copies_saved_bytes(spec: ModelSpec, cfg: RunConfig, dt: Dtypes, t: int) -> float:
    """What PEFT's modules_to_save copies at the language model's ends keep for backward
    over ``t`` tokens (the tower's and projector's: tower_saved_bytes). A trained LM-head
    copy keeps its input and, under autocast, the 16-bit cast of a wider weight (as full
    fine-tuning's head does, memory/training.py). A copy before the first layer
    (embedding, projector, tower) puts the whole decoder on the gradient's path: the
    first layer's input norm keeps its fp32 input, which a run without checkpointing and
    with nothing trained before the first adapter does not keep (memory/training.py
    subtracts it there)."""
    copied = copied_parts(spec, cfg)
    if not copied:
        return 0
    out = 0.0
    if "lm_head" in copied and stage_plan(cfg).head in ("lm_loss", "full_logprobs",
                                                         "kernel_logprobs"):
        out += dt.act_bytes * t * spec.hidden_size
        copy_bytes = saved_copy_dtypes(cfg, dt).trainable_bytes
        if dt.autocast and copy_bytes != dt.act_bytes:
            out += dt.act_bytes * spec.vocab_size * spec.hidden_size
    if copied - {"lm_head"} and not cfg.grad_ckpt and tower_plan(spec, cfg) is None:
        out += 4 * t * spec.hidden_size + 4 * t * 2
    return out


def tower_forward_bytes(spec: ModelSpec, cfg: RunConfig, dt: Dtypes) -> float:
    """A frozen tower's forward peak: one layer's intermediates (the MLP's two widest
    tensors, or eager attention's fp32 and 16-bit scores) next to the hidden state,
    plus every layer's output where the model asks for them (LLaVA)."""
    if not spec.vision or not cfg.data.images_per_sample:
        return 0
    images, patches = tower_rows(spec, cfg)
    tower = tower_spec(spec.vision)
    a, rows = dt.act_bytes, images * patches
    mlp = (3 if tower.hidden_act in ("quick_gelu", "gelu_new") else 2) * a * rows * \
        tower.intermediate_size
    attn = 4 * a * rows * tower.hidden_size
    if tower_attn(spec, cfg) == "eager":
        attn += (4 + 2 * a) * images * tower.num_heads * patches * patches
    states = 2 * a * rows * tower.hidden_size
    if spec.vision.kind == "clip":
        states += tower.num_layers * a * rows * tower.hidden_size
    return max(mlp, attn) + states


def vision_trainable_params(spec: ModelSpec, cfg: RunConfig) -> int:
    """Trainable parameters the vision side adds (LoRA in the tower) or removes (full
    fine-tuning with a frozen tower or projector) against the language model's count."""
    if not spec.vision:
        return 0
    vision = spec.vision
    if cfg.method == "full":
        tower = vision.param_count - vision.projector_params
        return -(tower * cfg.vision.freeze_tower
                 + vision.projector_params * cfg.vision.freeze_projector)
    plan = tower_plan(spec, cfg)
    if plan is None:
        return 0
    tower = tower_spec(vision)
    return tower.num_layers * sum(
        cfg.lora.r * (lin.in_features + lin.out_features)
        for lin in tower.layer_linears() if lin.name in plan.lora)


def vision_assumptions(spec: ModelSpec, cfg: RunConfig) -> list[str]:
    if not spec.vision:
        return []
    if not cfg.data.images_per_sample:
        return ["vision-language model without images (data.images_per_sample 0): the "
                "tower does not run"]
    geo = image_geometry(spec.vision, cfg)
    out = [f"{cfg.data.images_per_sample} image(s) per sample: {geo.patches} patches through "
           f"the tower, {image_tokens(spec, cfg)} tokens each in the language model"]
    if spec.vision.dynamic_resolution:
        out.append(f"images resized as the Qwen2-VL processor does (smart_resize) to a "
                   f"{geo.grid[0]}×{geo.grid[1]} patch grid")
    plan = tower_plan(spec, cfg)
    if plan is None:
        out.append("vision tower frozen: run without a graph, its forward one layer at a time")
    elif plan.trainable:
        copy = " (its modules_to_save copy)" if cfg.method != "full" else ""
        out.append(f"vision tower trained{copy}: every tower layer keeps its activations")
    else:
        out.append(f"LoRA reaches the vision tower ({', '.join(sorted(plan.lora))}): every "
                   "tower layer keeps its activations")
    if plan is not None and cfg.grad_ckpt and not spec.vision.checkpointed:
        out.append(f"gradient checkpointing does not reach the {spec.vision.kind} tower (its "
                   "code has no checkpointing): the tower keeps every layer's activations")
    out.append(f"tower attention: {tower_attn(spec, cfg)}")
    return out


def pixel_bytes(spec: ModelSpec, cfg: RunConfig) -> float:
    """The processor's fp32 pixel tensors of one micro batch, on the GPU for the step:
    (images, 3, side, side) for fixed-size towers; (patches, 3·2·patch²) for Qwen2-VL."""
    if not spec.vision or not cfg.data.images_per_sample:
        return 0
    images = cfg.micro_batch_size * cfg.data.images_per_sample
    vision = spec.vision
    if vision.dynamic_resolution:
        return 4 * images * image_geometry(vision, cfg).patches * 3 * 2 * vision.patch_size**2
    return 4 * images * 3 * vision.image_size**2


def merged_input_bytes(spec: ModelSpec, cfg: RunConfig, dt: Dtypes, t: int) -> float:
    """What the model's forward holds in its own variables until it returns: the input
    embeddings with the image features scattered in, and the image features."""
    if not spec.vision or not cfg.data.images_per_sample:
        return 0
    images = cfg.micro_batch_size * cfg.data.images_per_sample
    return dt.act_bytes * spec.hidden_size * (t + images * image_tokens(spec, cfg))


def check_images_fit_model(spec: ModelSpec, cfg: RunConfig) -> None:
    """Images per sample on a model without a vision tower are refused: they would be
    ignored without a word (the memory of a text run answering a vision question)."""
    if cfg.data.images_per_sample and spec.vision is None:
        from ..errors import ConfigError

        raise ConfigError(
            f"data.images_per_sample {cfg.data.images_per_sample} (--images): {spec.name} is "
            "a text model (no vision tower) and cannot take images; drop --images / "
            "images_per_sample, or choose a vision-language model")
