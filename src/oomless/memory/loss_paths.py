"""Logits and loss memory: what the step holds between lm_head and the loss's backward.

For a plain transformers loss (units of tokens t × vocabulary V bytes; L is the
logits' element size as the model returns them):

- forward peak: L (the model's logits) + 4 (the loss's fp32 copy, when L is 16-bit)
  + 4 (the shifted fp32 copy, transformers < 4.49, when the batch has several rows:
  the shifted logits of one row are a contiguous prefix) + 4 (log_softmax's output,
  kept for backward) + 2 (ChatGLM's own forward: the logits cast back to bf16 after
  the loss);
- backward start: 12 — the saved log_softmax, its incoming gradient (nll_loss's
  backward) and the logits' fp32 gradient (log_softmax's backward), plus L when the
  stack keeps its outputs alive;
- held: L in every other phase when the stack keeps its outputs (until the next
  forward has returned).

``benchmarks/loss_versions.py`` measures the slope of the step's peak with the real
code of transformers 4.36 to 5.23 in both conventions; the analytic slope equals it.

Fused losses never build the t × V logits: Liger's fused linear cross-entropy
(one chunk of rows × V in the activation dtype, plus the t × hidden input gradient it
computes in the forward), TRL's fused LM head (4096-token × 32768-entry tiles, an fp32
t × hidden gradient in the backward), Unsloth's fused cross-entropy (chunks sized to
16 B per logit within 4 GiB) and torchtune's chunked cross-entropy (8 chunks upcast one
at a time; their fp32 log-probabilities saved, or under ``compile_loss`` their 16-bit
logits and per-row statistics, as the min-cut partitioner chooses).
"""

from __future__ import annotations

import math

from ..config import RunConfig
from ..models.spec import ModelSpec
from ..units import GiB
from . import constants as C
from .gemma import softcap_logits_bytes
from .precision import Dtypes
from .stacks import LOSS_PATHS, LossPath, StackEffects, stack_effects

# trl kernels/chunked_logprob.py TOKEN_CHUNK_SIZE; trl trainer/utils.py
# _CHUNKED_LOGPROB_CHUNK_SIZE (vocabulary entries per tile)
TRL_TOKEN_TILE = 4096
TRL_VOCAB_TILE = 32768
UNSLOTH_CCE_MIN_TOKENS = C.UNSLOTH_CCE_MIN_TOKENS
TORCHTUNE_CHUNKS = C.TORCHTUNE_LOSS_CHUNKS
# unsloth_zoo fused_losses/cross_entropy_loss.py: _CE_BYTES_PER_LOGIT, _CE_TARGET_GB_CAP
UNSLOTH_BYTES_PER_LOGIT = 16
UNSLOTH_TARGET_BYTES = 4 * GiB


def loss_path_of(spec: ModelSpec, fx: StackEffects) -> LossPath:
    """The loss path the step runs: the model's own (remote code that computes its loss
    itself, families.json own_loss), else the installed transformers release's."""
    from ..models.families import own_loss_path

    own = own_loss_path(spec.model_type)
    return next(p for p in LOSS_PATHS if p.name == own) if own else fx.loss


def model_logits_bytes(cfg: RunConfig, dt: Dtypes, fx: StackEffects,
                       spec: ModelSpec | None = None) -> int:
    """Element size of the logits the model returns."""
    path = loss_path_of(spec, fx) if spec is not None else fx.loss
    if path.model_upcasts or fx.lmhead_fp32_output:
        return 4
    if not dt.autocast and ("lm_head" in fx.fp32_groups or "embeddings" in fx.fp32_groups
                            or dt.act_bytes == 4):
        return 4  # an fp32 lm_head (or model) outside autocast computes fp32 logits
    return 2 if (dt.autocast or dt.act_bytes == 2) else 4


def lm_head_cast_bytes(spec: ModelSpec, dt: Dtypes, fx: StackEffects) -> int:
    """An fp32 frozen lm_head under autocast: the matmul keeps its 16-bit cast of the
    weight for the input gradient until lm_head's backward (autocast caches only leaves
    that require grad, so the cast is made per call and saved)."""
    head = "embeddings" if spec.tie_embeddings else "lm_head"
    if dt.autocast and head in fx.fp32_groups:
        return dt.act_bytes * spec.vocab_size * spec.hidden_size
    return 0


def logits_bytes(spec: ModelSpec, cfg: RunConfig, dt: Dtypes, t: int,
                 rows: int = 2) -> dict[str, float]:
    """{"forward", "backward", "held"}: the logits region's bytes at the forward's peak,
    at the backward's start, and what stays alive in every other phase. ``rows``: the
    sequences in the forward (the shifted logits of one sequence need no copy)."""
    fx = stack_effects(cfg)
    if fx.fused_loss:
        return _fused(spec, cfg, dt, t, fx.fused_loss)
    v = spec.vocab_size
    path = loss_path_of(spec, fx)
    lb = model_logits_bytes(cfg, dt, fx, spec)
    copy = C.LOSS_FP32_BYTES if lb == 2 else 0
    # logits[..., :-1, :] of a (1, s, V) tensor is a prefix of contiguous rows, so
    # .contiguous() returns it as it is: the shifted copy exists only for several rows
    shift = C.LOSS_FP32_BYTES if path.shift_copy and rows > 1 else 0
    # ChatGLM casts its fp32 logits back to the hidden states' dtype after the loss, next
    # to the fp32 logits, the shifted copy and log_softmax's output; that cast is what
    # its outputs (and a stack keeping them) hold
    recast = dt.resid_bytes if path.recast_after_loss and lb == 4 and dt.resid_bytes != 4 else 0
    kept = (recast or lb) if fx.keep_outputs else 0
    cast = lm_head_cast_bytes(spec, dt, fx)
    capped = softcap_logits_bytes(spec, lb, t)  # Gemma-2: the tanh output is kept
    forward = (kept + lb + copy + shift + C.LOSS_FP32_BYTES + recast) * t * v + cast + capped
    backward = (kept + 3 * C.LOSS_FP32_BYTES) * t * v + cast + capped
    return {"forward": forward, "backward": backward, "held": kept * t * v}


def _head_copied(spec: ModelSpec, cfg: RunConfig) -> bool:
    from ..models.saved_modules import saved_parts

    return cfg.method != "full" and any(
        p.part == "lm_head" for p in saved_parts(spec, cfg.lora.modules_to_save))


def _fused(spec: ModelSpec, cfg: RunConfig, dt: Dtypes, t: int, kind: str) -> dict[str, float]:
    h, v, a = spec.hidden_size, spec.vocab_size, dt.act_bytes
    # the fused kernels' fp32 gradient of the head's weight, when it requires grad: full
    # fine-tuning, or a trained copy of the head (PEFT modules_to_save)
    lm_head_grad = 4 * v * h if cfg.method == "full" or _head_copied(spec, cfg) else 0
    if kind == "liger":
        # liger ops/fused_linear_cross_entropy.py: chunk = next_pow2(ceil(t / ceil(V / h)))
        chunk = min(t, 1 << max(0, math.ceil(math.log2(max(1, math.ceil(t / math.ceil(v / h)))))))
        saved = a * t * h + 4 * t + lm_head_grad  # grad_input (+ grad_weight), loss_1d
        return {"forward": saved + a * chunk * v, "backward": saved, "held": 0}
    if kind.startswith("torchtune"):
        compiled = kind == "torchtune-chunked" and stack_effects(cfg).compiled
        out = _torchtune_compiled(t, v, a) if compiled else _torchtune(t, v, a, kind)
        if kind == "torchtune-chunked":
            out["backward"] = max(out["backward"], _chunked_output_backward(
                t, v, h, a, dt.grad_bytes if cfg.method == "full" else 0))
        return out
    if kind == "unsloth-triton":
        # the bf16 logits, saved; per-row loss and logsumexp in fp32; the backward's
        # gradient overwrites the logits (kernels/cross_entropy_loss.py)
        return {"forward": a * t * v + 8 * t, "backward": a * t * v + a * t * h, "held": 0}
    if kind == "cce" or (kind == "unsloth-cce" and t > UNSLOTH_CCE_MIN_TOKENS):
        # cut_cross_entropy: per-row logsumexp and loss; the t × hidden input gradient
        return {"forward": 8 * t, "backward": 8 * t + a * t * h + lm_head_grad, "held": 0}
    if kind == "unsloth-cce":  # RETURN_LOGITS for short batches: the Triton path
        return {"forward": a * t * v + 8 * t, "backward": a * t * v + a * t * h, "held": 0}
    if kind == "trl":
        # the tile buffer is min(tokens, 4096) × 32768 whatever the vocabulary
        tile = a * min(t, TRL_TOKEN_TILE) * TRL_VOCAB_TILE
        vectors = 7 * 4 * t
        forward = a * t * h + vectors + tile  # kept hidden copy, per-token sums, the tile
        backward = a * t * h + 4 * t * h + 3 * 4 * t + tile + lm_head_grad
        return {"forward": forward, "backward": backward, "held": 0}
    # unsloth: chunks within the byte target, plus the t × hidden input gradient
    chunked = min(UNSLOTH_BYTES_PER_LOGIT * t * v, UNSLOTH_TARGET_BYTES)
    return {"forward": chunked + a * t * h, "backward": chunked + a * t * h, "held": 0}


def _torchtune(t: int, v: int, a: int, kind: str) -> dict[str, float]:
    """torchtune's chunked cross-entropy, eager: every chunk's fp32 log-probabilities are
    saved for backward (log_softmax keeps its output); one chunk is upcast (and, for
    LinearCrossEntropyLoss, projected) at a time; the chunked-output loss also holds the
    model's 16-bit logits until the loss returns (the recipe then deletes them)."""
    chunk = math.ceil(t / TORCHTUNE_CHUNKS) * v
    saved = C.LOSS_FP32_BYTES * t * v
    model_logits = a * t * v if kind == "torchtune-chunked" else 0
    forward = model_logits + saved + (a + C.LOSS_FP32_BYTES) * chunk
    # one chunk's backward: nll's gradient, log_softmax's fp32 gradient, the 16-bit cast's
    backward = saved + (2 * C.LOSS_FP32_BYTES + a) * chunk
    return {"forward": forward, "backward": backward, "held": 0}


def _torchtune_compiled(t: int, v: int, a: int) -> dict[str, float]:
    """torchtune's chunked cross-entropy with ``compile_loss``: each chunk's
    ``compute_cross_entropy`` is one compiled region. The partitioner saves the chunk's
    16-bit logits (the model's own, which the save keeps alive after the recipe deletes
    them), its labels and two fp32 statistics per row
    (oomless.memory.activations.compiled_chunk_loss_bytes); the fp32 upcast and the
    log-probabilities are fused away. In the backward every chunk's loss
    node runs before the output projection's (autograd runs the higher sequence numbers
    first), so the 16-bit gradients of all chunks meet the last chunk's saved logits."""
    from .activations import compiled_chunk_loss_bytes

    chunk = math.ceil(t / TORCHTUNE_CHUNKS) * v
    saved = compiled_chunk_loss_bytes(t, a)
    small = saved["labels"] + saved["rows"]
    return {"forward": saved["logits"] * v + small,
            "backward": a * t * v + a * chunk + saved["rows"], "held": 0}


def _chunked_output_backward(t: int, v: int, h: int, a: int, grad_bytes: int) -> float:
    """torchtune's chunked output (modules/transformer.py TransformerDecoder.chunked_output:
    the output projection once per chunk): every chunk's loss backward runs before the
    projection's (autograd runs the higher sequence numbers first), so the chunks' 16-bit
    logit gradients wait for it. A trained projection's weight gradient of each chunk
    (vocab × hidden) is summed into the previous ones in autograd's input buffer before
    AccumulateGrad runs: two of them alive from the second chunk on; the hidden states'
    gradient (t × hidden) fills as the chunks return."""
    rows = math.ceil(t / TORCHTUNE_CHUNKS)
    weight = grad_bytes * v * h
    first = a * t * v + weight + a * t * h
    second = a * (t - rows) * v + 2 * weight + a * t * h if weight else 0
    return max(first, second)


def largest_logits_block_bytes(spec: ModelSpec, cfg: RunConfig, t: int) -> float:
    """The largest single block the loss allocates: one fp32 t × V tensor, or a fused
    loss's tile."""
    fx = stack_effects(cfg)
    if not fx.fused_loss:
        return C.LOSS_FP32_BYTES * t * spec.vocab_size
    if fx.fused_loss == "unsloth":
        return min(UNSLOTH_BYTES_PER_LOGIT * t * spec.vocab_size, UNSLOTH_TARGET_BYTES) / 4
    if fx.fused_loss == "torchtune-chunked" and fx.compiled:
        return 2 * math.ceil(t / TORCHTUNE_CHUNKS) * spec.vocab_size  # one 16-bit chunk
    if fx.fused_loss.startswith("torchtune"):
        return C.LOSS_FP32_BYTES * math.ceil(t / TORCHTUNE_CHUNKS) * spec.vocab_size
    if fx.fused_loss == "unsloth-triton" or (fx.fused_loss == "unsloth-cce"
                                             and t <= UNSLOTH_CCE_MIN_TOKENS):
        return 2 * t * spec.vocab_size  # the model's bf16 logits
    return 4 * t * spec.hidden_size


def head_saved_blocks(spec: ModelSpec, cfg: RunConfig, dt: Dtypes, t: int) -> tuple[int, ...]:
    """What a trained lm_head's matmul saves for its backward, in the order it is made:
    its input (the final norm's output) and, under autocast with fp32 master weights, the
    16-bit copy of its weight that ``at::autocast::cached_cast`` makes. Autocast's cache
    is cleared when the forward's autocast exits, but the saved reference keeps the copy
    until the head's backward has run, which releases both. () when lm_head is frozen,
    or a reward model's score head or TRL's tiled projection replaces it."""
    from .stages import stage_plan

    lm_head = stage_plan(cfg).head in ("lm_loss", "full_logprobs", "kernel_logprobs")
    if cfg.method != "full" or not lm_head:
        return ()
    blocks = [dt.act_bytes * t * spec.hidden_size]
    if dt.autocast and dt.trainable_bytes != dt.act_bytes:
        blocks.append(dt.act_bytes * spec.vocab_size * spec.hidden_size)
    return tuple(blocks)
