"""The attention implementation a run is built with, and the two kernels tracing registers.

On fake tensors SDPA runs under its own registered name (``TRACE_SDPA``) so that the
mask function can answer as a real batch would (oomless.runtime.trace.data_emulation);
a class without an SDPA path that asks for flash gets SDPA under a name transformers
does not check (``TRACE_FLASH_STANDIN``).
"""

from __future__ import annotations

from typing import Any

from ..config import RunConfig
from .model_config import supports_sdpa

TRACE_SDPA = "oomless_sdpa"
# FlashAttention-2 stand-in for classes without an SDPA path (Gemma-2): the same kernel under a
# name transformers does not check against ``_supports_sdpa`` (FA2 soft-caps inside the kernel
# and keeps the same output + log-sum-exp, so the extra tanh of eager attention is not there)
TRACE_FLASH_STANDIN = "oomless_fa2_standin"


def attn_implementation(cfg: RunConfig) -> tuple[str, str | None]:
    """transformers attn_implementation, and a note when it stands in for another."""
    if cfg.attn == "flash":
        return "sdpa", (
            "attn 'flash' traced as SDPA's flash kernel: FlashAttention-2 keeps the same "
            "tensors (output + fp32 log-sum-exp), the flash-attn package is not needed"
        )
    return cfg.attn, None


def build_attention(cfg: RunConfig, config: Any, mode: str) -> tuple[str, list[str]]:
    """The attn_implementation to build ``config`` with in ``mode`` ("fake" registers
    the trace kernels), and the notes that say what stands in for what."""
    attn, note = attn_implementation(cfg)
    notes = [note] if note else []
    if cfg.attn == "sdpa" and not supports_sdpa(config):
        # what transformers itself does when no kernel is asked for (Gemma-2: SDPA cannot
        # soft-cap the scores, so the class declares no SDPA path)
        attn = "eager"
        notes.append(f"{config.model_type} has no SDPA path in transformers: traced with eager "
                     "attention, which is what it runs")
    if mode == "fake" and attn == "sdpa":
        _register_trace_attention()
        attn = TRACE_SDPA if supports_sdpa(config) else TRACE_FLASH_STANDIN
    return attn, notes


def _unpadded_sdpa_mask(*args: Any, **kwargs: Any) -> Any:
    """transformers' SDPA mask for batches without padding, one sequence per row.

    On real tensors transformers reads the batch (``_ignore_causal_mask_sdpa``,
    ``find_packed_sequence_indices``) and, finding no padding, passes no mask so
    that SDPA runs its causal flash kernel. Fake tensors have no values, so
    transformers treats them as a graph being traced and builds the full
    [b, 1, s, s] mask. This mask function answers as the real batch would: no
    mask unless a sliding window or a custom pattern needs one. An attention mask
    of all ones (a trainer's batch, traced with full-batch values) is no padding.
    """
    from transformers.masking_utils import sdpa_mask

    from .trace.data_emulation import full_batch_active

    local = kwargs.get("local_size")
    no_padding = kwargs.get("attention_mask") is None or full_batch_active()
    if (no_padding and not kwargs.get("use_vmap")
            and (local is None or kwargs["kv_length"] < local)):
        return None
    return sdpa_mask(*args, **kwargs)


def _register_trace_attention() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(TRACE_SDPA, sdpa_attention_forward)
    AttentionInterface.register(TRACE_FLASH_STANDIN, _flash_standin)
    for name in (TRACE_SDPA, TRACE_FLASH_STANDIN):
        AttentionMaskInterface.register(name, _unpadded_sdpa_mask)


def _flash_standin(*args: Any, softcap: Any = None, **kwargs: Any) -> Any:
    """SDPA in place of FlashAttention-2, which applies ``softcap`` inside the kernel."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)
