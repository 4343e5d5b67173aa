"""PPO's memory, as TRL's last PPOTrainer runs it (trl/experimental/ppo/ppo_trainer.py).

A PPO update holds four models: the policy (trained: LoRA adapters or all
weights), the reference (the policy with its adapters switched off, or a frozen
copy), a reward model and a value model (sequence-classification models of the
policy's architecture; the value model is trained with all its weights and has
AdamW states, as TRL's ppo.py loads and optimises it).

rollout (phase ``generation``; no gradients, outside autocast): HF generate on
``rollout_chunk`` queries at a time keeps its KV cache and every step's fp32
scores (queries × vocabulary); the chunks' scores are padded into one
(queries × response × vocabulary) fp32 tensor that stays alive until the next
rollout; then per chunk the reference's full logits on query+response and the
value and reward models' forwards (each one layer at a time, no gradient).

update (phases forward/backward/optimizer, under accelerate's autocast with fp32
outputs): per micro batch the value model's backbone (trained, all weights) and
the policy both run on query+response with ``output_hidden_states``; accelerate
returns every output in fp32 — the logits and both models' hidden states — and
the step keeps them through backward; TRL's fused log-prob kernel keeps the
logits and writes their fp32 gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import RunConfig
from ..models.spec import ModelSpec
from .precision import Dtypes, dtypes_for

TRL_PPO_RESPONSE_LENGTH = 53  # PPOConfig.response_length
TRL_ROLLOUT_CHUNK = 64  # PPOConfig.local_rollout_forward_batch_size


@dataclass(frozen=True)
class PpoShapes:
    response_length: int  # tokens generated per query
    query_length: int  # prompt tokens (seq_len = query + response)
    rollout_queries: int  # queries of one update on one GPU (micro batch × accumulation)
    rollout_chunk: int  # queries generated and scored together


def ppo_shapes(cfg: RunConfig, seq: int) -> PpoShapes:
    response = cfg.rlhf.response_length or cfg.data.max_output_length or TRL_PPO_RESPONSE_LENGTH
    response = max(1, min(response, seq - 1))
    queries = cfg.micro_batch_size * cfg.grad_accum
    chunk = min(cfg.rlhf.rollout_batch_size or TRL_ROLLOUT_CHUNK, queries)
    return PpoShapes(response, seq - response, queries, chunk)


def value_model_params(spec: ModelSpec) -> int:
    """A sequence-classification copy of the model: no lm_head, a hidden → 1 score head."""
    return spec.param_count - spec.lm_head_params + spec.hidden_size


def ppo_persistent_bytes(spec: ModelSpec, cfg: RunConfig, dt: Dtypes) -> dict[str, float]:
    """The models besides the policy, and the value model's training state."""
    out: dict[str, float] = {}
    frozen_bytes = dt.base_weight_bytes if cfg.method != "qlora" else 2
    if cfg.rlhf.reward_model == "separate":
        out["reward_model"] = value_model_params(spec) * frozen_bytes
    if cfg.rlhf.value_model == "separate":
        full = dtypes_for(cfg.replace(method="full"))
        n = value_model_params(spec)
        out["value_model"] = n * (full.base_weight_bytes + full.master_bytes
                                  + 2 * full.optim_elem_bytes)
        out["value_gradients"] = n * full.grad_bytes
    return out


@dataclass(frozen=True)
class PpoKit:
    """The per-model pieces memory/training.py computes (passed in, so that this module
    does not import it): saved activations and a no-grad forward's transient."""

    saved_activations: object  # (spec, cfg, dt, b, s) -> {"layers", "one_layer"}
    eval_forward: object  # (spec, dt, b, s, attn) -> bytes


def ppo_phases(spec: ModelSpec, cfg: RunConfig, dt: Dtypes, persistent: dict, grads: dict,
               step_only: dict, kit: PpoKit, seq: int) -> dict[str, dict[str, int]]:
    """Per-phase bytes of a PPO update (see the module docstring)."""
    sh = ppo_shapes(cfg, seq)
    b, v, h = cfg.micro_batch_size, spec.vocab_size, spec.hidden_size
    t = b * seq
    value_cfg = cfg.replace(method="full", stage="rm")
    value_dt = dtypes_for(value_cfg)
    persistent = {**persistent, **ppo_persistent_bytes(spec, cfg, dt)}
    value_grads = persistent.pop("value_gradients", 0)
    grads = {**grads, "value_gradients": value_grads} if value_grads else dict(grads)
    fwd_grads = grads if cfg.grad_accum > 1 else {}
    rollout = {"rollout_scores": 4 * sh.rollout_queries * sh.response_length * v}
    acts = kit.saved_activations(spec, cfg, dt, b, seq)["layers"]
    if cfg.rlhf.value_model == "separate":
        acts += kit.saved_activations(spec, value_cfg, value_dt, b, seq)["layers"]
    # accelerate returns the wrapper's outputs in fp32: the logits and the policy's
    # hidden states, kept by the loop through backward (and, with accumulation, through
    # the next micro batch's forward)
    outputs = 4 * t * v + 4 * (spec.num_layers + 1) * t * h
    previous = outputs if cfg.grad_accum > 1 else 0
    base = {**persistent, **rollout, **fwd_grads, "activations": acts}
    phases = {
        "forward": {**base, "logits": previous + outputs + dt.act_bytes * t * v},
        "backward": {**base, "logits": previous + outputs + 4 * b * sh.response_length * v
                     + 4 * t * v},
        "optimizer": {**persistent, **rollout, **grads, **step_only, "logits": outputs},
    }
    # rollout: the padded scores of every query, then per chunk the reference's full
    # logits and hidden states (output_hidden_states) outside autocast
    ref_bytes = dt.base_weight_bytes if cfg.method != "qlora" else 2
    chunk_t = sh.rollout_chunk * seq
    ref = ref_bytes * chunk_t * (v + (spec.num_layers + 1) * h) + kit.eval_forward(
        spec, dt, sh.rollout_chunk, seq, cfg.attn)
    generation = max(ref, 4 * sh.rollout_queries * sh.response_length * v)
    phases["generation"] = {**persistent, **rollout, "reference_forward": generation}
    return {p: {k: round(x) for k, x in d.items() if x} for p, d in phases.items()}
