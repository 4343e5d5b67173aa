"""Stack profiles: the analytic model against a trace of each stack's real code.

Each case builds a tiny Llama from its config, runs the stack's own code where it
installs (PEFT's prepare_model_for_kbit_training, TRL's fused LM head and its QLoRA
casts, TRL 0.x's peft_module_casting_to_bf16) or the patch written from its source
(LLaMA-Factory, axolotl), two training steps on fake tensors, and compares the peak
with the analytic estimate of the same configuration.
"""

from __future__ import annotations

import pytest

from oomless.config import RunConfig
from oomless.memory import estimate_training
from oomless.memory.stacks import LOSS_PATHS, loss_path, stack_effects, version_tuple
from oomless.models.catalog import ResolvedModel
from oomless.models.hf_config import buildable_hf_config, spec_from_hf_config

TINY_LLAMA = dict(model_type="llama", hidden_size=256, intermediate_size=704,
                  num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                  vocab_size=16384, max_position_embeddings=1024, tie_word_embeddings=False)

CASES = [
    ("hf-trainer", "qlora", False, {}),
    ("custom-loop", "lora", False, {}),
    ("custom-loop", "qlora", True, {}),
    ("custom-loop", "full", False, {}),
    ("trl", "lora", False, {}),
    ("trl", "qlora", True, {}),
    ("trl", "qlora", False, {"stack_version": "0.12"}),
    ("trl", "qlora", True, {"stack_version": "0.12"}),
    ("axolotl", "qlora", True, {}),
    ("llamafactory", "lora", False, {"upcast_layernorm": True, "upcast_lmhead_output": True}),
    ("llamafactory", "qlora", False, {"upcast_layernorm": True}),
    ("llamafactory", "lora", True, {"offload_checkpoints": True}),
    ("hf-trainer", "qlora", True, {"kbit_upcast": True}),
    ("swift", "lora", False, {}),
    ("hf-trainer", "lora", False, {"autocast": False}),
    ("hf-trainer", "lora", True, {"autocast": False}),
]


def _resolved() -> ResolvedModel:
    return ResolvedModel(spec=spec_from_hf_config(TINY_LLAMA, "tiny-llama"),
                         hf_config=buildable_hf_config(TINY_LLAMA), source="test")


def _cfg(stack: str, method: str, ckpt: bool, options: dict) -> RunConfig:
    return RunConfig(model="tiny-llama", stack=stack, method=method, grad_ckpt=ckpt,
                     micro_batch_size=2, seq_len=256, stack_options=options)


@pytest.mark.parametrize("stack, method, ckpt, options", CASES,
                         ids=[f"{s}-{m}{'-ckpt' if c else ''}-{'-'.join(o) or 'default'}"
                              for s, m, c, o in CASES])
def test_analytic_equals_a_trace_of_the_stacks_code(stack, method, ckpt, options):
    from oomless.runtime.trace.fake import trace_training

    cfg = _cfg(stack, method, ckpt, options)
    resolved = _resolved()
    traced = trace_training(cfg, resolved=resolved)
    assert "trace_fallback" not in traced.extra
    analytic = estimate_training(resolved.spec, cfg)
    assert analytic.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.015)
    assert analytic.peak_phase == traced.peak_phase


def test_the_stacks_change_memory_the_way_their_code_does():
    """Each behaviour moves the estimate in the direction its mechanism says."""
    spec = _resolved().spec

    def peak(stack, method, ckpt=False, **options):
        return estimate_training(spec, _cfg(stack, method, ckpt, options)).peak_allocated_bytes

    assert peak("custom-loop", "lora") > peak("hf-trainer", "lora")  # kept outputs, fp32 copies
    assert peak("trl", "lora") < peak("hf-trainer", "lora")  # no full logits
    # no bf16/fp16 flag on a 16-bit model: fp32 adapters keep fp32 copies of their inputs
    assert peak("hf-trainer", "lora", autocast=False) > peak("hf-trainer", "lora")
    assert peak("hf-trainer", "qlora", True, kbit_upcast=True) > peak("hf-trainer", "qlora", True)
    assert peak("llamafactory", "lora", True, offload_checkpoints=True) < \
        peak("llamafactory", "lora", True)


def test_trace_falls_back_where_the_stack_cannot_run_on_cpu():
    from oomless.runtime.trace.fake import trace_training

    for cfg in (_cfg("unsloth", "lora", True, {}),
                _cfg("llamafactory", "lora", False, {"liger_kernel": True}),
                _cfg("hf-trainer", "lora", False, {"transformers_version": "4.46.3"})):
        est = trace_training(cfg, resolved=_resolved())
        assert est.method == "analytic" and est.extra["trace_fallback"]


@pytest.mark.parametrize("version, name", [
    ("4.36.2", "model-upcast+shift"), ("4.45.2", "model-upcast+shift"),
    ("4.46.0", "loss-upcast+shift"), ("4.48.3", "loss-upcast+shift"),
    ("4.49.0", "loss-upcast"), ("5.23.0", "loss-upcast"), ("5.0.0rc1", "loss-upcast")])
def test_loss_path_by_transformers_release(version, name):
    assert loss_path(version).name == name
    assert loss_path(version) in LOSS_PATHS


def test_version_tuple_ignores_suffixes():
    assert version_tuple("4.46.3") == (4, 46, 3)
    assert version_tuple("5.0.0.dev0") == (5, 0, 0)
    assert version_tuple("2.13.0+cpu") == (2, 13, 0)


def test_trl_generation_and_unsloth_switches():
    qlora = dict(method="qlora", model="tiny-llama")
    assert stack_effects(RunConfig(stack="trl", **qlora)).fused_loss == "trl"
    old = stack_effects(RunConfig(stack="trl", stack_options={"stack_version": "0.12"}, **qlora))
    assert old.fused_loss == "" and old.fp32_groups == {"norms", "other"} and old.setup_cache
    unsloth = stack_effects(RunConfig(stack="unsloth", grad_ckpt=True, **qlora))
    assert unsloth.offload_checkpoints and unsloth.fused_loss == "unsloth"
    # DeepSpeed casts the whole module to 16-bit: no fp32 groups under ZeRO
    sharded = stack_effects(RunConfig(stack="custom-loop", zero=2, **qlora))
    assert not sharded.fp32_groups


def test_swift_token_accuracy_runs_in_the_trace_and_stays_below_the_peak():
    """ms-swift's _compute_acc takes logits.argmax (int64 per token) after the loss: the
    trace runs it, and its peak is HF Trainer's, as the analytic model says (docs/stacks.md)."""
    from oomless.runtime.trace.fake import trace_training
    from oomless.runtime.trace.stacks import _swift_loss_and_accuracy, stack_loss

    swift, hf = _cfg("swift", "lora", False, {}), _cfg("hf-trainer", "lora", False, {})
    assert stack_loss(swift) is _swift_loss_and_accuracy
    traced = {c.stack: trace_training(c, resolved=_resolved()).peak_allocated_bytes
              for c in (swift, hf)}
    assert traced["swift"] == traced["hf-trainer"]
    spec = _resolved().spec
    assert estimate_training(spec, swift).peak_allocated_bytes == \
        estimate_training(spec, hf).peak_allocated_bytes
    assert any("token accuracy" in a for a in estimate_training(spec, swift).assumptions)
