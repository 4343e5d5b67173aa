"""PPO in a trace: the step of TRL's last PPOTrainer, re-created from its source.

TRL 1.16 has no PPOTrainer; the last one is trl/experimental/ppo/ppo_trainer.py
(huggingface/trl @ 0062ee10a9bc59dbb7ba244f3bbaf2e81f25196f), whose ``train()``
runs, per update:

1. rollout, without gradients and outside autocast (on the unwrapped models):
   ``batch_generation`` — HF ``generate`` with ``output_scores=True`` on chunks of
   ``local_rollout_forward_batch_size`` queries, the stacked fp32 scores of every
   chunk padded into one (queries × response × vocabulary) tensor, which the loop
   keeps alive until the next rollout replaces it; per chunk the log-probs of the
   sampled tokens, the reference's full logits (the policy with its adapters
   switched off, or a frozen copy), and ``get_reward`` of the value model and of
   the reward model;
2. per micro batch, under accelerate's autocast with fp32 outputs:
   ``PolicyAndValueWrapper`` (the value model's backbone and score head, then the
   policy, both with ``output_hidden_states``), ``selective_log_softmax`` of the
   response's logits, the clipped policy and value losses, backward, the
   optimizer step over the policy's trainable weights and the whole value model;
   the outputs stay referenced through backward and the step, and the entropy of
   the logits is computed after it.

The TRL helpers that still exist in 1.16 are called (``selective_log_softmax``,
``trl.experimental.utils.get_reward`` and ``first_true_indices``); the removed ones
(``batch_generation``, ``generate``, ``forward``, ``PolicyAndValueWrapper``) are
written here from that source. Generation runs to the full response length (fake
tokens carry no end-of-sequence).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import torch

from ...config import RunConfig

PPO_TEMPERATURE = 0.7  # PPOConfig.temperature
PPO_VF_COEF = 0.1  # PPOConfig.vf_coef
PPO_CLIP = 0.2  # PPOConfig.cliprange, cliprange_value
PAD_ID = 0


class PolicyAndValueWrapper(torch.nn.Module):
    """The value model's backbone and score head, then the policy (TRL's wrapper)."""

    def __init__(self, policy: torch.nn.Module, value_model: torch.nn.Module) -> None:
        super().__init__()
        self.policy = policy
        self.value_model = value_model
        self.critic_backbone = getattr(value_model, value_model.base_model_prefix)

    def get_output_embeddings(self) -> Any:
        return self.policy.get_output_embeddings()

    def get_input_embeddings(self) -> Any:
        return self.policy.get_input_embeddings()

    def forward(self, **kwargs: Any) -> Any:
        output = self.critic_backbone(**kwargs)
        logits = self.value_model.score(output.hidden_states[-1])
        return self.policy(**kwargs), logits


def _forward(model: Any, query_responses: torch.Tensor) -> Any:
    """TRL's ``forward``: the model on query+response, pad positions masked."""
    attention_mask = query_responses != PAD_ID
    position_ids = attention_mask.cumsum(1) - attention_mask.long()
    input_ids = torch.masked_fill(query_responses, ~attention_mask, 0)
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 return_dict=True, output_hidden_states=True)


def _generate(lm: Any, queries: torch.Tensor, config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's ``generate``: HF generate with the processed scores, stacked."""
    context = queries.shape[1]
    attention_mask = queries != PAD_ID
    input_ids = torch.masked_fill(queries, ~attention_mask, 0)
    out = lm.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    logits = torch.stack(out.scores, 1)
    return torch.cat((queries, out.sequences[:, context:]), dim=1), logits


def _batch_generation(lm: Any, queries: torch.Tensor, chunk: int,
                      config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's ``batch_generation``: chunks generated one after another, then padded into
    one tensor each (``trl.trainer.utils.pad``: a new tensor filled chunk by chunk)."""
    responses, scores = [], []
    for i in range(0, queries.shape[0], chunk):
        qr, logits = _generate(lm, queries[i:i + chunk], config)
        responses.append(qr)
        scores.append(logits)
    return _padded(responses, PAD_ID), _padded(scores, 0)


def _padded(tensors: list[torch.Tensor], value: int) -> torch.Tensor:
    out = torch.full((len(tensors), *tensors[0].shape), value, dtype=tensors[0].dtype)
    for i, t in enumerate(tensors):
        out[i] = t
    return out.view(-1, *tensors[0].shape[1:])


@contextlib.contextmanager
def full_length_generation(max_length: int) -> Any:
    """HF generate stops when every sequence has ended; fake tokens have no value, so the
    stop check answers as for samples that run to ``max_new_tokens`` (``max_length``
    tokens with the prompt)."""
    from transformers.generation import utils

    original = utils.StopCheck.__call__
    utils.StopCheck.__call__ = lambda self, unfinished, tokens, length: length >= max_length
    try:
        yield
    finally:
        utils.StopCheck.__call__ = original


class PpoStep:
    """One PPO update's rollout, micro-batch loss and statistics, as TRL runs them."""

    def __init__(self, cfg: RunConfig, wrapper: PolicyAndValueWrapper, reward: Any, ref: Any,
                 queries: torch.Tensor, response_length: int, chunk: int, fake: Any):
        from transformers import GenerationConfig

        self.cfg, self.wrapper, self.reward, self.ref = cfg, wrapper, reward, ref
        self.queries, self.chunk, self.fake = queries, chunk, fake
        self.context = queries.shape[1]
        self.generation = GenerationConfig(
            max_new_tokens=response_length, temperature=PPO_TEMPERATURE + 1e-7, top_k=0,
            top_p=1.0, do_sample=True, return_dict_in_generate=True, output_scores=True,
            pad_token_id=PAD_ID, eos_token_id=None)
        self.rollout_state: dict[str, Any] = {}
        self.kept: tuple = ()

    def rollout(self, iteration: int, on_phase: Any) -> None:
        """Generation and scoring (TRL ``train()``, the ``torch.no_grad()`` block)."""
        from trl.experimental.utils import get_reward
        from trl.trainer.utils import selective_log_softmax

        on_phase("generation", iteration)
        policy, ctx = self.wrapper.policy, self.context
        total = ctx + self.generation.max_new_tokens
        with torch.no_grad(), full_length_generation(total):
            query_responses, logitss = _batch_generation(policy, self.queries, self.chunk,
                                                         self.generation)
            self.rollout_state = {"query_responses": query_responses, "logitss": logitss}
            logprobs, ref_logprobs, values = [], [], []
            for i in range(0, self.queries.shape[0], self.chunk):
                query_response = query_responses[i:i + self.chunk]
                response = query_response[:, ctx:]
                logits = logitss[i:i + self.chunk]
                logprobs.append(selective_log_softmax(logits, response))
                del logits
                with self._reference() as ref:
                    ref_output = _forward(ref, query_response)
                ref_logits = ref_output.logits[:, ctx - 1:-1]
                ref_logits /= PPO_TEMPERATURE + 1e-7
                ref_logprobs.append(selective_log_softmax(ref_logits, response))
                del ref_output, ref_logits
                full_value = get_reward(self.wrapper.value_model, query_response, PAD_ID, ctx)[0]
                values.append(full_value[:, ctx - 1:-1].squeeze(-1))
                get_reward(self.reward, query_response, PAD_ID, ctx)
            self.rollout_state.update(logprobs=torch.cat(logprobs), values=torch.cat(values),
                                      ref_logprobs=torch.cat(ref_logprobs))

    @contextlib.contextmanager
    def _reference(self) -> Any:
        if self.ref is not None:
            yield self.ref
            return
        with self.wrapper.policy.disable_adapter():  # TRL null_ref_context
            yield self.wrapper.policy

    def loss(self, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One micro batch's PPO loss; its outputs stay referenced through the step."""
        from trl.trainer.utils import selective_log_softmax

        ctx, rows = self.context, self.cfg.micro_batch_size
        state = self.rollout_state
        mb_query_responses = state["query_responses"][:rows]
        mb_responses = mb_query_responses[:, ctx:]
        output, vpred_temp = _forward(model, mb_query_responses)
        logits = output.logits[:, ctx - 1:-1]
        logits /= PPO_TEMPERATURE + 1e-7
        new_logprobs = selective_log_softmax(logits, mb_responses)
        vpred = vpred_temp[:, ctx - 1:-1].squeeze(-1)
        mb_values, mb_logprobs = state["values"][:rows], state["logprobs"][:rows]
        mb_return = mb_values  # advantages and returns are per-token vectors: small
        clipped = torch.clamp(vpred, mb_values - PPO_CLIP, mb_values + PPO_CLIP)
        vf_loss = 0.5 * torch.max(torch.square(vpred - mb_return),
                                  torch.square(clipped - mb_return)).mean()
        ratio = torch.exp(new_logprobs - mb_logprobs)
        advantage = mb_values
        pg_loss = torch.max(-advantage * ratio,
                            -advantage * torch.clamp(ratio, 1 - PPO_CLIP, 1 + PPO_CLIP)).mean()
        self.kept = (output, vpred_temp, logits, new_logprobs)
        return pg_loss + PPO_VF_COEF * vf_loss

    def statistics(self, iteration: int, on_phase: Any) -> None:
        """After the step: the entropy of the logits, then the outputs are released."""
        if self.kept:
            logits = self.kept[2]
            with torch.no_grad():
                prob_dist = torch.nn.functional.softmax(logits, dim=-1)
                torch.logsumexp(logits, dim=-1) - torch.sum(prob_dist * logits, dim=-1)
            del prob_dist, logits
        self.kept = ()


def ppo_setup(cfg: RunConfig, hf_config: dict[str, Any], policy: Any, num_layers: int,
              seq: int, fake: Any) -> SimpleNamespace:
    """The PPO wrapper, the frozen models and the step's hooks for a trace."""
    from ...memory.ppo import ppo_shapes
    from ...memory.stages import stage_plan
    from ..build import TraceUnsupported, build_model

    if cfg.rlhf.value_model != "separate" or cfg.rlhf.reward_model != "separate":
        raise TraceUnsupported("PPO is traced with a separate value and reward model (TRL); "
                               "a value head or reward adapter is estimated analytically")
    frozen_cfg = cfg.replace(method="lora") if cfg.method == "qlora" else cfg
    value = build_model(hf_config, cfg.replace(method="full"), mode="fake", num_layers=num_layers,
                        sequence_classification=True).model
    reward = build_model(hf_config, frozen_cfg, mode="fake", num_layers=num_layers,
                         sequence_classification=True, frozen=True).model
    ref = None
    if stage_plan(cfg).reference == "separate":
        ref = build_model(hf_config, frozen_cfg, mode="fake", num_layers=num_layers,
                          frozen=True).model
    wrapper = PolicyAndValueWrapper(policy, value)
    shapes = ppo_shapes(cfg, seq)
    vocab = policy.get_input_embeddings().num_embeddings
    with fake:
        queries = torch.randint(1, vocab, (shapes.rollout_queries, shapes.query_length))
    step = PpoStep(cfg, wrapper, reward, ref, queries, shapes.response_length,
                   shapes.rollout_chunk, fake)
    frozen = tuple(m for m in (reward, ref) if m is not None)
    notes = ("ppo traced as TRL's last PPOTrainer step (trl/experimental/ppo/ppo_trainer.py), "
             "re-created from its source: TRL 1.16 has no PPO",)
    return SimpleNamespace(model=wrapper, loss_fn=step.loss, frozen_models=frozen,
                           step_hooks=(step.rollout, step.statistics), notes=notes,
                           batch={"query_responses": queries})
