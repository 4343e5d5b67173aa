"""The torchtune stack (--stack torchtune): each behaviour from torchtune's code
(pytorch/torchtune@bd2a0fc7: training/memory.py register_optim_in_bwd_hooks,
modules/loss/ce_chunked_output_loss.py, cross_entropy_loss.py), checked by its arithmetic,
and torchtune's own memory table (benchmarks/published_rows.yaml, torchtune-* rows)."""

from __future__ import annotations

import pytest

from oomless.api import estimate
from oomless.cli import main
from oomless.config import RunConfig
from oomless.memory.loss_paths import TORCHTUNE_CHUNKS, logits_bytes
from oomless.memory.precision import dtypes_for
from oomless.memory.stacks import stack_effects
from oomless.models.catalog import resolve_model

SPEC = resolve_model("llama-3.2-3b-instruct").spec


def _cfg(**kw) -> RunConfig:
    opts = kw.pop("stack_options", {})
    base = dict(model="llama-3.2-3b-instruct", method="full", stack="torchtune", seq_len=4096,
                micro_batch_size=2, grad_ckpt=True, hardware={"gpu": "a100-80gb"},
                stack_options={"stack_version": "0.6", **opts})
    return RunConfig(**{**base, **kw})


def test_torchtune_runs_the_model_in_bf16_without_master_weights():
    dt = dtypes_for(_cfg())
    assert (dt.base_weight_bytes, dt.optim_elem_bytes, dt.master_bytes, dt.autocast) == (2, 2, 0, False)
    lora = dtypes_for(_cfg(method="lora"))
    assert lora.trainable_bytes == 2  # LoRALinear adapters in the default dtype


def test_optimizer_in_backward_keeps_one_gradient_at_a_time():
    plain = estimate(_cfg()).breakdown["optimizer"]["gradients"]
    fused = estimate(_cfg(stack_options={"optimizer_in_bwd": True})).breakdown["optimizer"][
        "gradients"]
    assert plain == 2 * SPEC.param_count
    assert fused == 2 * SPEC.vocab_size * SPEC.hidden_size  # the embedding, the largest


def test_chunked_losses_by_release():
    t, v = 2 * 4096, SPEC.vocab_size
    cfg = _cfg()
    dt = dtypes_for(cfg)
    chunk = -(-t // TORCHTUNE_CHUNKS) * v
    assert stack_effects(cfg).fused_loss == "torchtune-chunked"  # CEWithChunkedOutputLoss ≤ 0.6
    assert logits_bytes(SPEC, cfg, dt, t)["forward"] == 2 * t * v + 4 * t * v + 6 * chunk
    linear = _cfg(stack_options={"stack_version": "0.7"})
    assert stack_effects(linear).fused_loss == "torchtune-linear"  # LinearCrossEntropyLoss
    assert logits_bytes(SPEC, linear, dt, t)["forward"] == 4 * t * v + 6 * chunk
    plain = _cfg(stack_options={"chunked_loss": False})
    hf = logits_bytes(SPEC, plain, dt, t)
    assert stack_effects(plain).fused_loss == "" and hf["backward"] == 12 * t * v
    assert logits_bytes(SPEC, cfg, dt, t)["backward"] < hf["backward"]


def test_activation_offloading_keeps_checkpoints_in_host_ram():
    off = _cfg(stack_options={"offload_checkpoints": True})
    assert stack_effects(off).offload_checkpoints
    assert estimate(off).peak_allocated_bytes < estimate(_cfg()).peak_allocated_bytes


@pytest.mark.parametrize("argv", [["--stack", "torchtune", "--method", "full"]])
def test_cli_takes_the_stack(argv, capsys):
    assert main(["estimate", "llama-3.2-3b-instruct", *argv, "--gpu", "a100-80gb",
                 "--json"]) == 0
    assert '"stack": "torchtune"' in capsys.readouterr().out


# ---- torch.compile (compile: True): the min-cut partitioner's saved tensors ----------------
def test_compiled_chunked_loss_keeps_the_16bit_logits_not_fp32_log_probabilities():
    """compile_loss: each chunk's saved tensors are its 16-bit logits (the model's own),
    its labels and two fp32 statistics per row (oomless/data/compiled_saved.json)."""
    t, v, h = 2 * 4096, SPEC.vocab_size, SPEC.hidden_size
    cfg = _cfg(stack_options={"compile": True})
    dt = dtypes_for(cfg)
    rows = -(-t // TORCHTUNE_CHUNKS)
    compiled = logits_bytes(SPEC, cfg, dt, t)
    assert compiled["forward"] == 2 * t * v + 8 * t + 2 * 4 * t
    # backward: the output projection's, every chunk's gradient waiting for it, and two
    # vocab × hidden weight gradients summed in autograd's input buffer (full fine-tuning)
    assert compiled["backward"] == 2 * (t - rows) * v + 2 * 2 * v * h + 2 * t * h
    eager = logits_bytes(SPEC, _cfg(), dt, t)
    assert eager["forward"] - compiled["forward"] > 4 * t * v  # the fp32 log-probabilities
    lora = _cfg(method="lora", stack_options={"compile": True})
    assert logits_bytes(SPEC, lora, dtypes_for(lora), t)["backward"] == \
        2 * t * v + 2 * rows * v + 2 * 4 * t  # a frozen projection: no weight gradients


def test_compiled_layers_save_less_than_the_eager_walk():
    from oomless.memory.activations import compiled_layer_bytes, layer_activation_bytes
    from oomless.memory.training import layer_plan

    for method in ("full", "lora"):
        cfg = _cfg(method=method, grad_ckpt=False, stack_options={"compile": True})
        dt = dtypes_for(cfg)
        eager = layer_activation_bytes(SPEC, 2, 4096, dt, layer_plan(SPEC, cfg))
        assert compiled_layer_bytes(SPEC, cfg, dt.act_bytes, 2 * 4096) < eager
    assert estimate(_cfg(grad_ckpt=False, stack_options={"compile": True})).peak_allocated_bytes \
        < estimate(_cfg(grad_ckpt=False)).peak_allocated_bytes


def test_compile_lowers_the_estimate_and_says_where_its_numbers_come_from():
    compiled = estimate(_cfg(stack_options={"compile": True, "optimizer_in_bwd": True}))
    eager = estimate(_cfg(stack_options={"optimizer_in_bwd": True}))
    assert compiled.peak_allocated_bytes < eager.peak_allocated_bytes
    assert any("min_cut_rematerialization_partition" in a for a in compiled.assumptions)
    other = RunConfig(model="phi-3-mini-4k-instruct", method="full", stack="torchtune",
                      stack_options={"compile": True})
    assert any("no partitioner trace" in a for a in estimate(other).assumptions)
    eager_attention = _cfg(attn="eager", stack_options={"compile": True})  # traced with SDPA
    assert any("no partitioner trace" in a for a in estimate(eager_attention).assumptions)
