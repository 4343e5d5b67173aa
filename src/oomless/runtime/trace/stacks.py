"""Running a training stack's own code in the trace (oomless.memory.stacks lists them).

Where a stack's code installs beside oomless, the trace calls it: PEFT's
``prepare_model_for_kbit_training``, TRL's ``add_fused_lm_head`` and its compute-loss
lines, TRL 0.x's ``peft_module_casting_to_bf16`` (kept in trl.experimental), Liger's
``LigerForCausalLMLoss`` when liger-kernel is importable. Where it does not
(LLaMA-Factory, axolotl, Unsloth pin other versions), the patch is written here from
their source, each function naming the one it follows, and the estimate says so.

GPU kernels that only write into buffers the Python code allocated (TRL's and Liger's
Triton kernels) allocate nothing themselves; on CPU fake tensors they are replaced by
no-ops, so the trace sees exactly the allocations of the Python code around them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ...config import RunConfig
from ...memory.stacks import FP32_GROUPS_ALL, stack_effects

NORM_NAMES = ("norm", "ln_f", "ln_1", "ln_2")  # LLaMA-Factory extras/constants.py LAYERNORM_NAMES


def prepare_base_model(model: Any, cfg: RunConfig) -> list[str]:
    """The stack's casts and hooks on the transformers model, before LoRA; notes."""
    fx = stack_effects(cfg)
    notes: list[str] = []
    if cfg.method == "qlora" and fx.fp32_groups:
        from peft import prepare_model_for_kbit_training

        prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.grad_ckpt)
        notes.append("ran peft.prepare_model_for_kbit_training")
        if fx.fp32_groups != FP32_GROUPS_ALL:
            _recast_after_kbit(model, fx.fp32_groups, cfg)
            notes.append("then the stack's recasts to 16-bit (" + ", ".join(
                sorted(FP32_GROUPS_ALL - fx.fp32_groups)) + ")")
    elif "norms" in fx.fp32_groups:
        _upcast_layernorm(model)
        notes.append("norm weights cast to fp32 (LLaMA-Factory upcast_layernorm)")
    if fx.lmhead_fp32_output:
        # LLaMA-Factory model_utils/checkpointing.py _fp32_forward_post_hook
        model.get_output_embeddings().register_forward_hook(
            lambda _m, _args, out: out.to(torch.float32))
        notes.append("lm_head output cast to fp32 by a forward hook (upcast_lmhead_output)")
    if fx.offload_checkpoints and cfg.grad_ckpt:
        model._set_gradient_checkpointing(enable=True,
                                          gradient_checkpointing_func=offloaded_checkpoint)
        notes.append("offloaded checkpointing written from LLaMA-Factory's "
                     "UnslothGradientCheckpointing (layer inputs leave the GPU)")
    return notes


def _recast_after_kbit(model: Any, keep_fp32: frozenset[str], cfg: RunConfig) -> None:
    """TRL 0.x: trl peft_module_casting_to_bf16 (norms fp32, embeddings/lm_head back to
    bf16); axolotl: loaders/model.py _convert_embedding_modules_dtype (norms and
    embeddings back to the training dtype)."""
    if "norms" in keep_fp32:
        from trl.experimental.utils import peft_module_casting_to_bf16

        peft_module_casting_to_bf16(model)
        return
    half = torch.float16 if cfg.precision == "fp16" else torch.bfloat16
    for name, module in model.named_modules():
        if "norm" in name or any(e in name for e in ("embed_tokens", "lm_head")):
            if hasattr(module, "weight"):
                module.to(half)


def _upcast_layernorm(model: Any) -> None:
    """LLaMA-Factory model_utils/checkpointing.py prepare_model_for_training: 1-D
    parameters whose name holds a layer-norm name become fp32."""
    for name, param in model.named_parameters():
        if param.ndim == 1 and any(n in name for n in NORM_NAMES):
            param.data = param.data.to(torch.float32)


class _OffloadedCheckpoint(torch.autograd.Function):
    """LLaMA-Factory's UnslothGradientCheckpointing with the host copy on the meta
    device: the saved input leaves the tracked memory, and backward allocates its copy
    back, as the host-to-device copy does."""

    @staticmethod
    def forward(ctx: Any, forward_function: Any, hidden_states: torch.Tensor, *args: Any) -> Any:
        ctx.shape, ctx.dtype = hidden_states.shape, hidden_states.dtype
        with torch.no_grad():
            outputs = forward_function(hidden_states, *args)
        ctx.forward_function, ctx.args = forward_function, args
        return outputs

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        hidden_states = torch.empty(ctx.shape, dtype=ctx.dtype, device=grad_output.device)
        hidden_states.requires_grad_(True)
        with torch.enable_grad():
            outputs = ctx.forward_function(hidden_states, *ctx.args)
            output = outputs[0] if isinstance(outputs, tuple) else outputs
        torch.autograd.backward(output, grad_output)
        return (None, hidden_states.grad) + (None,) * len(ctx.args)


def offloaded_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    return _OffloadedCheckpoint.apply(function, *args)


def after_lora(model: Any, cfg: RunConfig) -> list[str]:
    """The stack's changes after get_peft_model; notes."""
    fx = stack_effects(cfg)
    notes = []
    if fx.adapters_16bit:
        # trl trainer/sft_trainer.py SFTTrainer.__init__: trainable parameters of a
        # quantized model (not DoRA magnitudes) cast to bf16 after get_peft_model
        for name, param in model.named_parameters():
            if param.requires_grad and "lora_magnitude_vector" not in name:
                param.data = param.data.to(torch.bfloat16)
        notes.append("QLoRA adapters cast to bf16 as TRL's SFTTrainer does")
    if cfg.stack == "llamafactory" and cfg.lora.modules_to_save and not (
            cfg.zero == 3 or cfg.fsdp.version or cfg.precision == "pure-bf16"):
        # LLaMA-Factory model/adapter.py init_adapter: cast_trainable_params_to_fp32 (the
        # adapters are fp32 already; PEFT's modules_to_save copies are not)
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.to(torch.float32)
        notes.append("LLaMA-Factory casts the trainable parameters (modules_to_save copies "
                     "included) to fp32")
    if fx.fused_loss == "trl":
        from trl.trainer.utils import add_fused_lm_head

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        add_fused_lm_head(base, outputs=("log_probs", "entropy", "is_top1"))
        notes.append("TRL's add_fused_lm_head (log_probs, entropy, is_top1); its Triton "
                     "kernels replaced by no-ops (they allocate nothing)")
    elif fx.fused_loss == "liger" or fx.fused_loss.startswith("unsloth"):
        notes.append(f"{fx.fused_loss} fused loss not run in the trace (its Triton kernels "
                     "do not run on CPU): the logits region comes from the analytic model")
    return notes


def trace_unsupported(cfg: RunConfig) -> str | None:
    """Why this stack cannot be traced here, or None."""
    from ...memory.stacks import installed_version, loss_path

    fx = stack_effects(cfg)
    if cfg.stack == "torchtune":
        return ("torchtune runs its own model classes and recipes, which are not installed "
                "beside oomless's pins; its memory is modelled from its source (docs/stacks.md)")
    if fx.fused_loss == "liger" or fx.fused_loss.startswith("unsloth"):
        return (f"the {fx.fused_loss} fused cross-entropy runs Triton kernels, which do not run "
                "on CPU; its memory is modelled from its source")
    if fx.compiled:
        return ("torch.compile (stack_options.compile): the step's tracker sees eager "
                "autograd; the compiled layers' saved tensors come from the partitioner's "
                "trace (oomless.runtime.trace.compiled) in the analytic estimate")
    installed = installed_version("transformers")
    if installed and loss_path(installed) != fx.loss:
        return (f"the run uses transformers {cfg.stack_options.transformers_version}, whose loss "
                f"path differs from the installed {installed}'s; the trace can only run the "
                "installed release (benchmarks/loss_versions.py traces the others)")
    return None


# ---- the step --------------------------------------------------------------------------
def stack_loss(cfg: RunConfig) -> Callable[[Any, dict[str, torch.Tensor]], tuple[Any, Any]]:
    """(model, batch) → (loss, outputs) as the stack's compute_loss does it."""
    if stack_effects(cfg).fused_loss == "trl":
        return _trl_fused_loss
    if cfg.stack == "swift":
        return _swift_loss_and_accuracy
    return model_loss


def model_loss(forward: Any, batch: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    outputs = forward(**batch)
    return outputs.loss, outputs


def _swift_loss_and_accuracy(forward: Any, batch: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    """ms-swift trainers/seq2seq_trainer.py Seq2SeqTrainer.compute_loss: the model's loss,
    then trainers/mixin.py SwiftMixin._compute_acc takes the logits' argmax (int64 per
    token) and metrics/acc.py compute_acc copies it to the host."""
    outputs = forward(**batch)
    preds = outputs.logits.argmax(dim=-1)
    del preds  # compute_acc: preds.cpu().numpy(); the device tensor dies with the call
    return outputs.loss, outputs


def _trl_fused_loss(forward: Any, batch: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    """trl trainer/sft_trainer.py SFTTrainer.compute_loss (loss_type nll): the fused LM
    head's per-token log-probabilities summed over the label tokens."""
    outputs = forward(**batch, fused_lm_head=True)
    num_tokens = outputs.label_mask.sum()
    loss = (-outputs.log_probs).sum() / torch.as_tensor(num_tokens).clamp(min=1)
    return loss, outputs


@contextlib.contextmanager
def _trl_kernels_as_noops() -> Iterator[None]:
    """TRL's torch fallbacks for its Triton kernels, and its CPU fp32 accumulation
    (``_addmm_fp32`` upcasts both operands off CUDA), allocate tile-sized fp32
    temporaries the GPU path does not: the kernels and cuBLAS' ``addmm(out_dtype=fp32,
    out=acc)`` write in place, so a no-op stands for them."""
    from trl.kernels import chunked_logprob as ck

    saved = ck._forward_tile, ck._backward_tile, ck._addmm_fp32
    ck._forward_tile = ck._backward_tile = ck._addmm_fp32 = _noop_kernel
    try:
        yield
    finally:
        ck._forward_tile, ck._backward_tile, ck._addmm_fp32 = saved


def _noop_kernel(*args: Any, **kwargs: Any) -> None:
    return None


def step_context(cfg: RunConfig) -> Any:
    """Around the whole step: TRL's tile kernels as no-ops (forward and backward)."""
    if stack_effects(cfg).fused_loss == "trl":
        return _trl_kernels_as_noops()
    return contextlib.nullcontext()


def keeps_outputs(cfg: RunConfig) -> bool:
    return stack_effects(cfg).keep_outputs
