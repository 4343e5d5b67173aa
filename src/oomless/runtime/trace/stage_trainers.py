"""Training stages in a trace: TRL's own trainers compute the loss on the fake model.

For ``rm``, ``dpo``, ``kto``, ``orpo`` and ``simpo`` the trace builds the real TRL
1.16 trainer (RewardTrainer, DPOTrainer, KTOTrainer, and the experimental
ORPOTrainer and CPOTrainer with ``loss_type="simpo"``) on a tiny random model
with a locally trained tokenizer and a few preference records — the trainer's
own ``__init__`` decides what a step does (LoRA: the reference is the model with
its adapters switched off; full fine-tuning: a separate frozen copy; the fused
log-prob head DPO and KTO patch onto the model). Then the trainer is pointed at
the fake model of the real size, and its ``compute_loss`` runs on a fake batch
of full-length chosen/rejected sequences inside the traced steps; backward,
clipping and the optimizer step are HF Trainer's as for SFT
(runtime/trace/hf_step.py).

What CUDA does differently from CPU is emulated as elsewhere: TRL's fused
log-prob head folds each logits tile with a Triton kernel that allocates
nothing (its CPU fallback, ``_forward_tile``/``_backward_tile``, works on
fp32 copies of the tile); the trace replaces the fallback by an in-place
stand-in.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from ...config import RunConfig

# stages traced through a trainer's loss (ppo: runtime/trace/ppo_step.py)
TRAINER_STAGES = ("rm", "dpo", "kto", "orpo", "simpo", "ppo")
_ROWS = 4  # preference records the tiny trainer is built with


@dataclass
class StageSetup:
    """What a traced step of a training stage runs."""

    model: Any  # what the optimizer trains: the policy (PPO: policy and value model)
    loss_fn: Any  # (model, batch) -> loss
    batch: dict[str, torch.Tensor]  # fake, full length
    frozen_models: tuple = ()  # a separate reference model (full FT), a reward model
    notes: tuple[str, ...] = ()
    step_hooks: tuple = (None, None)  # (before, after) each optimizer step


def _records(stage: str) -> list[dict[str, Any]]:
    if stage == "kto":
        return [{"prompt": "a b", "completion": " c d", "label": i % 2 == 0} for i in range(_ROWS)]
    return [{"prompt": "a b", "chosen": " c d", "rejected": " e f"} for _ in range(_ROWS)]


@functools.lru_cache(maxsize=1)
def _tokenizer() -> Any:
    from ..tiny import build_tokenizer

    return build_tokenizer()


def _tiny_model(hf_config: dict[str, Any], sequence_classification: bool) -> Any:
    """A real, tiny model of the same architecture (the trainer's __init__ needs one)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from ..build import transformers_config, with_num_layers

    tok = _tokenizer()
    small = with_num_layers(hf_config, 1)
    holder = small.get("text_config") or small
    holder.update(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=len(tok))
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if key in holder:
            holder[key] = 64
    config = transformers_config(small)
    config.pad_token_id = tok.pad_token_id
    auto = AutoModelForSequenceClassification if sequence_classification else AutoModelForCausalLM
    if sequence_classification:
        config.num_labels = 1
    return auto.from_config(config, dtype=torch.float32)


def _trainer(stage: str, cfg: RunConfig, hf_config: dict[str, Any], recorder: list) -> Any:
    """The TRL trainer of ``stage`` built on a tiny model, as a user's script would."""
    from datasets import Dataset
    from peft import LoraConfig

    tok = _tokenizer()
    tiny = _tiny_model(hf_config, stage == "rm")
    peft = None
    if cfg.method != "full":
        targets = cfg.lora.targets
        peft = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                          target_modules=targets if targets == "all-linear" else list(targets),
                          modules_to_save=list(cfg.lora.modules_to_save) or None,
                          task_type="SEQ_CLS" if stage == "rm" else "CAUSAL_LM")
    common = dict(output_dir=tempfile.mkdtemp(prefix="oomless-trl-"), report_to=[],
                  per_device_train_batch_size=2, save_strategy="no", logging_strategy="no",
                  use_cpu=True, bf16=cfg.precision == "bf16", fp16=False,
                  gradient_checkpointing=cfg.grad_ckpt, max_grad_norm=cfg.training.max_grad_norm)
    ds = Dataset.from_list(_records(stage))
    kwargs: dict[str, Any] = dict(model=tiny, train_dataset=ds, processing_class=tok,
                                  peft_config=peft)
    with _recording_fused_heads(recorder), _quiet():
        if stage == "dpo":
            from trl import DPOConfig, DPOTrainer

            args = DPOConfig(**common, precompute_ref_log_probs=False)
            if cfg.method == "full":
                kwargs["ref_model"] = _tiny_model(hf_config, False)
            return DPOTrainer(args=args, **kwargs)
        if stage == "kto":
            from trl import KTOConfig, KTOTrainer

            if cfg.method == "full":
                kwargs["ref_model"] = _tiny_model(hf_config, False)
            return KTOTrainer(args=KTOConfig(**common), **kwargs)
        if stage == "rm":
            from trl import RewardConfig, RewardTrainer

            return RewardTrainer(args=RewardConfig(**common), **kwargs)
        if stage == "orpo":
            from trl.experimental.orpo import ORPOConfig, ORPOTrainer

            return ORPOTrainer(args=ORPOConfig(**common), **kwargs)
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        return CPOTrainer(args=CPOConfig(**common, loss_type="simpo", cpo_alpha=0.0), **kwargs)


@contextlib.contextmanager
def _recording_fused_heads(recorder: list) -> Any:
    """Record the keyword arguments the trainer patches its fused LM head with."""
    import trl.trainer.utils as tu

    modules = [m for m in _trl_trainer_modules() if hasattr(m, "add_fused_lm_head")]
    original = tu.add_fused_lm_head

    def record(model: Any, **kwargs: Any) -> None:
        recorder.append(kwargs)
        original(model, **kwargs)

    for m in modules:
        m.add_fused_lm_head = record
    try:
        yield
    finally:
        for m in modules:
            m.add_fused_lm_head = original


def _trl_trainer_modules() -> list[Any]:
    import trl.trainer.dpo_trainer as dpo
    import trl.trainer.kto_trainer as kto

    return [dpo, kto]


@contextlib.contextmanager
def _quiet() -> Any:
    """Dataset preparation prints progress bars; a trace prints nothing."""
    import datasets

    was = datasets.utils.logging.is_progress_bar_enabled()
    datasets.utils.logging.disable_progress_bar()
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if was:
            datasets.utils.logging.enable_progress_bar()
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


@contextlib.contextmanager
def triton_kernel_emulation() -> Any:
    """TRL's Triton kernels, as CUDA runs them. The fused log-prob head folds each (tokens × 32768) logits tile into running
    statistics with a Triton kernel that writes only the tile and the per-token vectors
    (trl/kernels/chunked_logprob.py ``_forward_kernel``/``_backward_kernel``), and on
    CUDA accumulates the gradient GEMMs with ``torch.addmm(..., out_dtype=float32,
    out=acc)`` (``_addmm_fp32``); the CPU fallbacks make fp32 copies of the tile and of
    the weight slice. Inside the trace they are replaced by in-place stand-ins, as the
    CUDA kernels allocate nothing. ``selective_log_softmax`` (ORPO, SimPO, PPO) takes its
    fused Triton path on CUDA; here it takes the same path with a stand-in that allocates
    what that kernel allocates."""
    import trl.kernels.chunked_logprob as ck

    def in_place(tile: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        return None

    import trl.trainer.utils as tu

    saved = ck._forward_tile, ck._backward_tile, ck._addmm_fp32
    ck._forward_tile = ck._backward_tile = ck._addmm_fp32 = in_place
    kernel = (tu.is_triton_available, tu._supports_trl_loss_kernel,
              getattr(tu, "_fused_logprob_entropy", None))
    tu.is_triton_available = lambda: True
    tu._supports_trl_loss_kernel = _kernel_supports
    tu._fused_logprob_entropy = _fused_logprob_entropy
    try:
        yield
    finally:
        ck._forward_tile, ck._backward_tile, ck._addmm_fp32 = saved
        tu.is_triton_available, tu._supports_trl_loss_kernel = kernel[:2]
        if kernel[2] is None:
            del tu._fused_logprob_entropy
        else:
            tu._fused_logprob_entropy = kernel[2]


def _kernel_supports(logits: torch.Tensor, index: Any = None, row_mask: Any = None) -> bool:
    """trl.trainer.utils._supports_trl_loss_kernel without its CUDA device check."""
    return logits.dtype in (torch.float16, torch.bfloat16, torch.float32) and \
        1 <= logits.ndim <= 3 and logits.stride(-1) == 1


class _LogProbEntropyAllocations(torch.autograd.Function):
    """What TRL's fused log-prob/entropy Triton kernel (trl/kernels/logprob_entropy.py
    ``_LogProbEntropyFunction``) allocates, for CPU traces where Triton is absent:
    four fp32 per-row vectors in the forward, the logits kept for backward, and a
    contiguous gradient of the logits' shape in the backward."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, index: torch.Tensor) -> Any:
        shape = logits.shape[:-1]
        logprobs, entropy, log_z, expected = (
            torch.empty(shape, dtype=torch.float32) for _ in range(4))
        ctx.save_for_backward(logits, index, log_z, expected)
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprobs: Any, grad_entropy: Any) -> Any:
        logits = ctx.saved_tensors[0]
        return torch.empty_like(logits, memory_format=torch.contiguous_format), None


def _fused_logprob_entropy(logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0,
                           row_mask: Any = None) -> Any:
    return _LogProbEntropyAllocations.apply(logits, index)


def traced_stage(cfg: RunConfig, hf_config: dict[str, Any], model: Any, num_layers: int,
                 seq: int, fake: Any) -> StageSetup:
    """The stage's loss, batch and frozen models for a trace of ``num_layers`` layers."""
    from ...memory.stages import stage_plan
    from ..build import build_model

    if cfg.stage == "ppo":
        from .ppo_step import ppo_setup

        return StageSetup(**vars(ppo_setup(cfg, hf_config, model, num_layers, seq, fake)))
    reference = None
    if stage_plan(cfg).reference == "separate":
        reference = build_model(hf_config, cfg, mode="fake", num_layers=num_layers,
                                frozen=True).model
    return stage_setup(cfg, model, hf_config, cfg.micro_batch_size, seq, fake, reference)


def stage_setup(cfg: RunConfig, model: Any, hf_config: dict[str, Any], batch: int, seq: int,
                fake: Any, reference: Any = None) -> StageSetup:
    """The trainer's loss for ``model`` (the fake policy) and a fake batch of ``batch``
    samples of ``seq`` tokens; ``reference``: the fake frozen reference model (full FT)."""
    from trl.trainer.utils import add_fused_lm_head

    heads: list[dict] = []
    trainer = _trainer(cfg.stage, cfg, hf_config, heads)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if heads:  # the same fused log-prob head the trainer patched onto its model
        add_fused_lm_head(base, **heads[0])
        if reference is not None:
            add_fused_lm_head(reference, **(heads[1] if len(heads) > 1 else {}))
    trainer.model = trainer.model_wrapped = model
    if hasattr(trainer, "ref_model"):
        trainer.ref_model = reference
    with fake:
        inputs = _fake_inputs(cfg.stage, model, batch, seq)
    notes = ["training stage traced through TRL's own trainer: its compute_loss on the fake "
             "model, with a batch of full-length samples (every position a completion token)"]
    return StageSetup(model, lambda m, b: trainer.compute_loss(m, b), inputs,
                      (reference,) if reference is not None else (), tuple(notes))


def _fake_inputs(stage: str, model: Any, b: int, s: int) -> dict[str, torch.Tensor]:
    vocab = model.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(0)

    def ids(rows: int) -> torch.Tensor:
        return torch.randint(0, vocab, (rows, s), generator=gen)

    ones = functools.partial(torch.ones, dtype=torch.long)
    if stage == "kto":
        return {"input_ids": ids(b), "attention_mask": ones(b, s), "completion_mask": ones(b, s),
                "KL_input_ids": ids(b), "KL_attention_mask": ones(b, s),
                "KL_completion_mask": ones(b, s), "label": torch.ones(b, dtype=torch.bool)}
    if stage == "rm":
        return {"input_ids": ids(2 * b), "attention_mask": ones(2 * b, s)}
    if stage in ("orpo", "simpo"):
        return {"chosen_input_ids": ids(b), "chosen_attention_mask": ones(b, s),
                "chosen_labels": ids(b), "rejected_input_ids": ids(b),
                "rejected_attention_mask": ones(b, s), "rejected_labels": ids(b)}
    return {"input_ids": ids(2 * b), "attention_mask": ones(2 * b, s),
            "completion_mask": ones(2 * b, s)}
