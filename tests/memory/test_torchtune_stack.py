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
from oomless.memory.stacks import PROFILES, stack_effects
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


def test_every_behaviour_names_its_source():
    assert all(b.source.startswith("torchtune ") for b in PROFILES["torchtune"])


@pytest.mark.parametrize("argv", [["--stack", "torchtune", "--method", "full"]])
def test_cli_takes_the_stack(argv, capsys):
    assert main(["estimate", "llama-3.2-3b-instruct", *argv, "--gpu", "a100-80gb",
                 "--json"]) == 0
    assert '"stack": "torchtune"' in capsys.readouterr().out
