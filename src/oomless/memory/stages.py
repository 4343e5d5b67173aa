"""Training stages: what rm, dpo, kto, orpo and simpo change in a step's memory.

pt and sft run one sequence per sample and the causal-LM loss
(memory/training.py). The other stages, as TRL 1.16 (the ``hf-trainer`` and
``trl`` stacks) and LLaMA-Factory (``llamafactory``) run them:

- rm (TRL RewardTrainer): chosen and rejected run through an
  ``AutoModelForSequenceClassification`` together (2 rows per sample); its
  score head maps the hidden states to one value, so there is no lm_head and
  no vocabulary-sized logits. LoRA trains the head too (PEFT ``SEQ_CLS``
  ``modules_to_save``).
- dpo (DPOTrainer): chosen and rejected together (2 rows); the log-probs come
  from TRL's fused head (``add_fused_lm_head``, trl/kernels/chunked_logprob.py),
  which never materialises the logits: it projects 4096 tokens × 32768 vocabulary
  entries at a time and keeps only a copy of the hidden states and per-token
  statistics; its backward accumulates an fp32 gradient of the hidden states.
  Then a no-grad forward of the reference on the same rows: the policy with its
  LoRA adapters switched off, or a separate frozen copy (full fine-tuning), or
  nothing when reference log-probs are precomputed.
- kto (KTOTrainer): one row per sample through the fused head; no-grad forwards
  of the KL completions (policy, then reference) and of the reference.
- orpo, simpo (TRL's experimental ORPOTrainer, CPOTrainer ``loss_type="simpo"``):
  chosen and rejected together, no reference, the full logits (converted to
  fp32 by accelerate) through TRL's fused log-prob kernel; ORPO adds the
  cross-entropy of the chosen half.
- LLaMA-Factory's preference trainers compute every log-prob from the full fp32
  logits (``get_batch_logps``), as transformers' loss does for SFT.

ppo is modelled in memory/ppo.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import RunConfig
from ..models.spec import ModelSpec
from . import constants as C
from .precision import Dtypes

TRL_TOKEN_CHUNK = 4096  # trl/kernels/chunked_logprob.py TOKEN_CHUNK_SIZE
TRL_VOCAB_CHUNK = 32768  # trl/trainer/utils.py _CHUNKED_LOGPROB_CHUNK_SIZE
# the fused head's fp32 per-token vectors: 7 running statistics in the forward
# (running max, sum of exp, x·exp, exp², sum of z, max before target, target logit)
TRL_FUSED_STATS = 7
PAIR_STAGES = ("rm", "dpo", "orpo", "simpo")
# stacks whose dpo/kto run TRL 1.16's fused log-prob head
FUSED_HEAD_STACKS = ("hf-trainer", "trl")


@dataclass(frozen=True)
class StagePlan:
    """How a stage's step differs from SFT's."""

    stage: str
    rows: int  # sequences per sample in the policy's forward (pairs: chosen + rejected)
    head: str  # lm_loss | chunked_logprobs | kernel_logprobs | full_logprobs | score
    reference: str  # none | adapter-off | separate | precomputed
    nll_rows: int = 0  # ORPO: rows (per sample) of the extra chosen cross-entropy


def reference_kind(cfg: RunConfig) -> str:
    """The reference model of dpo/kto/ppo: adapter-off, separate, precomputed or none."""
    if cfg.stage not in ("dpo", "kto", "ppo"):
        return "none"
    ref = cfg.rlhf.reference
    if ref == "auto":
        return "separate" if cfg.method == "full" else "adapter-off"
    if ref == "adapter-off" and cfg.method == "full":
        return "separate"  # full fine-tuning has no adapter to switch off
    return ref


def stage_plan(cfg: RunConfig) -> StagePlan:
    stage = cfg.stage
    rows = 2 if stage in PAIR_STAGES else 1
    if stage in ("pt", "sft", "ppo"):
        head = "lm_loss"
    elif stage == "rm":
        head = "score"
    elif cfg.stack not in FUSED_HEAD_STACKS:
        head = "full_logprobs"
    elif stage in ("dpo", "kto"):
        head = "chunked_logprobs"
    else:
        head = "kernel_logprobs"
    nll = 1 if stage == "orpo" else 0
    return StagePlan(stage, rows, head, reference_kind(cfg), nll)


def scored_tokens(rows: int, s: int) -> int:
    """Positions the log-prob head scores: every next-token label of every row
    (batches are full length; every position after the first is a completion token)."""
    return rows * max(s - 1, 1)


def chunked_head_bytes(spec: ModelSpec, cfg: RunConfig, dt: Dtypes, rows: int,
                       s: int) -> dict[str, float]:
    """TRL's fused log-prob head (ChunkedLogProbFunction) on ``rows`` sequences.

    saved: the hidden-state copy it keeps (``hidden_states[:, :-1]`` reshaped or
    masked) plus per-token outputs; forward_peak: the projection tile (4096 tokens
    × 32768 vocabulary, compute dtype), the fp32 statistics and, with an fp32
    lm_head under autocast, the tile's 16-bit weight slice; backward: the fp32
    gradient of the hidden states, the tile again and — when lm_head is trained
    — its fp32 weight gradient, before they are cast back.
    """
    n = scored_tokens(rows, s)
    h, v = spec.hidden_size, spec.vocab_size
    hidden = dt.resid_bytes  # the final norm returns the residual stream's dtype
    tile = min(n, TRL_TOKEN_CHUNK) * min(v, TRL_VOCAB_CHUNK) * dt.act_bytes
    weight_cast = 0
    if dt.autocast and dt.base_weight_bytes != dt.act_bytes:
        weight_cast = min(v, TRL_VOCAB_CHUNK) * h * dt.act_bytes
    if hidden != dt.act_bytes:
        weight_cast += min(n, TRL_TOKEN_CHUNK) * h * dt.act_bytes
    outputs = n * (3 * 4 + 1) + 2 * n * 4  # log-probs, entropy, mean logit, top-1; log_z
    saved = n * h * hidden + outputs
    forward_peak = saved + tile + TRL_FUSED_STATS * 4 * n + weight_cast
    grad_hidden = n * h * 4 + n * h * hidden  # fp32 accumulation, then its cast
    lm_head_grad = 4 * v * h if cfg.method == "full" else 0
    backward = saved + grad_hidden + max(tile + weight_cast, 0) + lm_head_grad
    return {"saved": saved, "forward_peak": forward_peak, "backward": backward}


def full_logprob_bytes(spec: ModelSpec, cfg: RunConfig, dt: Dtypes, rows: int, s: int,
                       nll_rows: int, b: int) -> dict[str, float]:
    """LLaMA-Factory's log-probs (``get_batch_logps``): 16-bit logits, their fp32 copy and
    the fp32 log-softmax kept for backward (12 bytes per logit at the backward's start),
    plus ORPO's cross-entropy on the chosen rows (a contiguous fp32 copy and its
    log-softmax)."""
    v = spec.vocab_size
    t = rows * s
    half = 2 if (dt.autocast or dt.act_bytes == 2) else 4
    upcast = C.LOSS_FP32_BYTES if half == 2 else 0
    nll = 2 * C.LOSS_FP32_BYTES * nll_rows * b * s * v
    forward = (half + upcast + C.LOSS_FP32_BYTES) * t * v + nll
    return {"saved": forward, "forward_peak": forward,
            "backward": 3 * C.LOSS_FP32_BYTES * t * v + nll}


def kernel_logprob_bytes(spec: ModelSpec, dt: Dtypes, rows: int, s: int, nll_rows: int,
                         b: int) -> dict[str, float]:
    """TRL's experimental ORPO/CPO trainers: the full logits, converted to fp32 by
    accelerate (both copies exist for a moment), and ``selective_log_softmax`` through
    TRL's fused Triton kernel, which keeps the fp32 logits and writes a contiguous fp32
    gradient of them in backward (its slice's gradient is then padded back to the full
    logits: a second one). ORPO's cross-entropy on the chosen half adds a contiguous
    fp32 copy and its log-softmax, and their gradients in backward: the chosen half's
    gradient (nll), padded back to the full logits, meets the kernel's padded gradient
    in autograd's input buffer, which adds it in place (torch/csrc/autograd/
    input_buffer.cpp ``accumulate``): both padded gradients and the half one, no third
    full-size sum; before that, the cross-entropy's own backward holds three halves
    next to the kernel's gradient."""
    v, t = spec.vocab_size, rows * s
    half = 2 if (dt.autocast or dt.act_bytes == 2) else 0
    fp32 = C.LOSS_FP32_BYTES * t * v
    nll = C.LOSS_FP32_BYTES * nll_rows * b * s * v
    forward_peak = max(half * t * v + fp32, fp32 + 2 * nll)
    backward = max(2 * fp32 + nll, fp32 + 3 * nll)
    return {"saved": fp32 + nll, "forward_peak": forward_peak, "backward": backward}


def score_head_bytes(spec: ModelSpec, dt: Dtypes, rows: int, s: int) -> dict[str, float]:
    """A sequence-classification head (hidden → 1): its trained weight keeps its
    16-bit input; the scores are one number per token."""
    t = rows * s
    saved = dt.act_bytes * t * spec.hidden_size + 4 * t
    return {"saved": saved, "forward_peak": saved, "backward": saved + 4 * t * spec.hidden_size}


def head_bytes(spec: ModelSpec, cfg: RunConfig, dt: Dtypes, plan: StagePlan, b: int,
               s: int) -> dict[str, float] | None:
    """The loss head of a stage (None: transformers' causal-LM loss, memory/training.py)."""
    rows = plan.rows * b
    if plan.head == "chunked_logprobs":
        return chunked_head_bytes(spec, cfg, dt, rows, s)
    if plan.head == "full_logprobs":
        return full_logprob_bytes(spec, cfg, dt, rows, s, plan.nll_rows, b)
    if plan.head == "kernel_logprobs":
        return kernel_logprob_bytes(spec, dt, rows, s, plan.nll_rows, b)
    if plan.head == "score":
        return score_head_bytes(spec, dt, rows, s)
    return None


def reference_head_bytes(spec: ModelSpec, cfg: RunConfig, dt: Dtypes, plan: StagePlan,
                         rows: int, s: int) -> float:
    """The head of a no-grad reference forward: nothing is kept, its peak is transient."""
    if plan.head == "chunked_logprobs":
        return chunked_head_bytes(spec, cfg, dt, rows, s)["forward_peak"]
    if plan.head == "kernel_logprobs":
        return kernel_logprob_bytes(spec, dt, rows, s, 0, 0)["forward_peak"]
    return full_logprob_bytes(spec, cfg, dt, rows, s, 0, 0)["forward_peak"]


def reference_rows(cfg: RunConfig, plan: StagePlan) -> int:
    """Rows of the largest no-grad forward after the policy's (0: none)."""
    if plan.reference in ("none", "precomputed"):
        return 0
    return plan.rows * cfg.micro_batch_size


def separate_reference_params(spec: ModelSpec, cfg: RunConfig) -> int:
    """Parameters of a separate frozen reference model (TRL loads it in the policy's dtype)."""
    return spec.param_count if stage_plan(cfg).reference == "separate" else 0


def score_head_param_delta(spec: ModelSpec, cfg: RunConfig) -> tuple[int, int]:
    """rm: (weights, trainable) parameters a sequence-classification model has more than
    the causal LM: no lm_head (tied: the embedding stays), a hidden → 1 score head, which
    LoRA trains as well (PEFT keeps the original and a trained copy)."""
    if cfg.stage != "rm":
        return 0, 0
    h = spec.hidden_size
    if cfg.method == "full":
        return h - spec.lm_head_params, h - spec.lm_head_params
    return 2 * h - spec.lm_head_params, h


_HEAD_NOTES = {
    "chunked_logprobs": "log-probs from TRL's fused head (4096 × 32768 projection tiles, no "
                        "vocabulary-sized logits; its Triton kernels fold tiles in place)",
    "full_logprobs": "log-probs from the full logits in fp32 and their log-softmax",
    "kernel_logprobs": "log-probs from the full fp32 logits through TRL's fused Triton kernel",
    "score": "reward model: AutoModelForSequenceClassification, no lm_head, a trained "
             "hidden → 1 score head",
}
_REFERENCE_NOTES = {
    "adapter-off": "reference: the policy with its LoRA adapters switched off, a no-grad "
                   "forward after the policy's",
    "separate": "reference: a separate frozen copy of the model in the policy's dtype",
    "precomputed": "reference log-probs precomputed before training: no reference in the step",
}


def stage_assumptions(spec: ModelSpec, cfg: RunConfig) -> list[str]:
    plan = stage_plan(cfg)
    if plan.stage in ("pt", "sft"):
        return []
    out = [f"stage {plan.stage}: {plan.rows} sequence(s) of seq_len per sample in one "
           "forward, every position after the first a completion token"]
    if plan.stage == "ppo":
        out.append("ppo as TRL's last PPOTrainer runs it: reward and value models of the "
                   "policy's architecture (the value model trained with AdamW), generation "
                   "scores of the step's queries kept in fp32 until the next rollout, the "
                   "update under accelerate's autocast with fp32 outputs kept through backward")
    return out + [note for note in (_HEAD_NOTES.get(plan.head),
                                     _REFERENCE_NOTES.get(plan.reference)) if note]
