"""PEFT modules_to_save (``lora.modules_to_save``): a trainable copy of each listed part.

PEFT (peft/utils/other.py ModulesToSaveWrapper.update) keeps the listed module frozen and
trains ``copy.deepcopy`` of it. Per part, the persistent bytes the copy adds are derived
here from the spec's parameter counts and the dtypes of the mechanism, never from the
estimate's own output: the copy's weights, its gradient and AdamW's two states (torch-free).
"""

from __future__ import annotations

import pytest

from oomless.config import RunConfig
from oomless.errors import ConfigError
from oomless.memory import estimate_training
from oomless.memory.precision import dtypes_for
from oomless.memory.training import saved_activation_bytes
from oomless.memory.vision import copies_saved_bytes, tower_saved_bytes
from oomless.models.catalog import resolve_model
from oomless.models.saved_modules import saved_parts

VLM = "minicpm-v-2.6"  # llm.model.embed_tokens, llm.lm_head, resampler, vpm
SPEC = resolve_model(VLM).spec
TEXT = resolve_model("qwen2.5-0.5b").spec  # tied embeddings


def _cfg(saved: list[str], model: str = VLM, **options) -> RunConfig:
    options.setdefault("data", {"images_per_sample": 1})
    lora = {"targets": ["q_proj", "v_proj"], "modules_to_save": saved} | options.pop("lora", {})
    return RunConfig(model=model, method="lora", seq_len=1024, micro_batch_size=1, lora=lora,
                     **options)


def _step(cfg: RunConfig, spec=SPEC) -> dict[str, int]:
    est = estimate_training(spec, cfg)
    return {**est.breakdown["optimizer"], "trainable": est.trainable_params}


def _delta(saved: list[str], spec=SPEC, **options) -> dict[str, int]:
    model = VLM if spec is SPEC else "qwen2.5-0.5b"
    if spec is not SPEC:
        options.setdefault("data", {})
    with_copy, without = (_step(_cfg(s, model, **options), spec) for s in (saved, []))
    return {k: with_copy.get(k, 0) - without.get(k, 0) for k in with_copy.keys() | without}


# the copy's parameters, from the spec's counts: MiniCPM-V-2.6's Qwen2 vocabulary × hidden,
# the resampler (VisionSpec.projector_params) and the SigLIP tower without it
PARTS = {
    "embed_tokens": SPEC.vocab_size * SPEC.hidden_size,
    "lm_head": SPEC.vocab_size * SPEC.hidden_size,
    "resampler": SPEC.vision.projector_params,
    "vpm": SPEC.vision.param_count - SPEC.vision.projector_params,
}


@pytest.mark.parametrize("name", sorted(PARTS))
def test_a_listed_part_adds_its_copy_gradient_and_adamw_states_in_the_modules_dtype(name):
    """Plain PEFT with HF Trainer in bf16: the copy stays bf16 (PEFT upcasts only its tuner
    layers' adapters), its gradient is bf16 and torch's AdamW keeps two bf16 states."""
    n = PARTS[name]
    d = _delta([name])
    assert d["trainable"] == n
    assert d["saved_modules"] == 2 * n
    assert d["gradients"] == 2 * n
    assert d["optimizer"] == pytest.approx(2 * 2 * n, abs=1)
    assert d.get("master_weights", 0) == 0


def test_llamafactory_upcasts_the_copies_to_fp32():
    """LLaMA-Factory's init_adapter casts every trainable parameter to fp32 outside
    ZeRO-3/FSDP/pure_bf16: the copy, its gradient and its states are fp32."""
    n = PARTS["embed_tokens"]
    d = _delta(["embed_tokens"], stack="llamafactory")
    assert (d["saved_modules"], d["gradients"]) == (4 * n, 4 * n)
    assert d["optimizer"] == pytest.approx(2 * 4 * n, abs=1)


def test_under_zero2_the_copies_are_sharded_as_the_other_trainable_parameters():
    """DeepSpeed ZeRO-2 over 4 GPUs: the 16-bit copy whole on every GPU, its 16-bit
    gradient, fp32 master weights, fp32 gradient partition and AdamW states in quarters."""
    n = PARTS["resampler"]
    d = _delta(["resampler"], zero=2, hardware={"gpu": "a100-80gb", "gpus_per_node": 4})
    assert d["saved_modules"] == 2 * n
    assert d["gradients"] == pytest.approx(2 * n / 4, abs=1)
    assert d["master_weights"] == pytest.approx(4 * n / 4, abs=1)
    assert d["grad_partition_fp32"] == pytest.approx(4 * n / 4, abs=1)
    assert d["optimizer"] == pytest.approx(2 * 4 * n / 4, abs=1)


def test_a_tied_head_is_copied_as_a_matrix_of_its_own():
    """Qwen2.5-0.5B ties lm_head to the embedding: the copy's weight is its own, a full
    vocabulary × hidden matrix (the deep copy does not keep the tie)."""
    assert TEXT.tie_embeddings
    d = _delta(["lm_head"], TEXT)
    assert d["trainable"] == TEXT.vocab_size * TEXT.hidden_size


def test_parts_are_read_by_the_last_name_and_copied_once():
    parts = saved_parts(SPEC, ["llm.model.embed_tokens", "embed_tokens", "vpm"])
    assert [(p.part, p.params) for p in parts] == [
        ("embedding", PARTS["embed_tokens"]), ("vision tower", PARTS["vpm"])]


def test_a_name_of_no_part_is_refused_with_the_names_that_exist():
    with pytest.raises(ConfigError, match=r"'score_proj' names no part of .*embed_tokens.*vpm"):
        estimate_training(SPEC, _cfg(["score_proj"]))
    with pytest.raises(ConfigError, match=r"'vpm' names no part of qwen2.5-0.5b.*"
                                          r"\(the input embedding, the LM head\)"):
        estimate_training(TEXT, _cfg(["vpm"], "qwen2.5-0.5b", data={}))


def test_full_fine_tuning_ignores_the_list():
    full = RunConfig(model=VLM, method="full", seq_len=1024, data={"images_per_sample": 1})
    listed = full.model_copy(update={"lora": full.lora.model_copy(
        update={"modules_to_save": ["vpm"]})})
    assert estimate_training(SPEC, full).breakdown == estimate_training(SPEC, listed).breakdown


def test_a_copied_tower_keeps_what_a_trained_tower_keeps():
    """The tower's copy trains its weights: every linear keeps its input, more than LoRA in
    the tower keeps (frozen weights keep only the adapters' inputs); the whole tower's
    saved bytes join the language model's activations."""
    copied = _cfg(["vpm"], grad_ckpt=False)
    lora_tower = _cfg([], grad_ckpt=False, vision={"freeze_tower": False},
                      lora={"targets": "all-linear"})
    dt = dtypes_for(copied)
    trained = tower_saved_bytes(SPEC, copied, dt)
    adapters = tower_saved_bytes(SPEC, lora_tower, dt)
    assert trained["one_layer"] > adapters["one_layer"] > 0
    s = 1024 + 64  # text plus the resampler's 64 query tokens per image
    with_copy = saved_activation_bytes(SPEC, copied, dt, 1, s)["layers"]
    without = saved_activation_bytes(SPEC, _cfg([], grad_ckpt=False), dt, 1, s)["layers"]
    # and, the gradient now reaching the first layer, its input norm keeps its fp32 input
    first_norm = 4 * s * SPEC.hidden_size + 4 * s * 2
    assert with_copy - without == pytest.approx(trained["layers"] + first_norm, abs=2)


def test_an_lm_head_copy_keeps_its_input_and_under_autocast_its_cast_weight():
    """Its weight gradient needs its input (tokens × hidden, 16-bit); an fp32 copy under
    autocast (LLaMA-Factory) also keeps autocast's 16-bit cast of the weight."""
    t = 1024
    peft = _cfg(["lm_head"], data={})
    lf = _cfg(["lm_head"], data={}, stack="llamafactory")
    assert copies_saved_bytes(SPEC, peft, dtypes_for(peft), t) == 2 * t * SPEC.hidden_size
    assert copies_saved_bytes(SPEC, lf, dtypes_for(lf), t) == 2 * t * SPEC.hidden_size + (
        2 * SPEC.vocab_size * SPEC.hidden_size)


def test_an_embedding_copy_puts_the_first_layer_on_the_gradient_path():
    """Without checkpointing, a LoRA run whose graph starts at the first adapter keeps no
    input of the first layer's norm; a trained embedding copy makes it keep its fp32 input."""
    t = 1024
    plain = _cfg(["embed_tokens"], data={}, grad_ckpt=False)
    assert copies_saved_bytes(SPEC, plain, dtypes_for(plain), t) == (
        4 * t * SPEC.hidden_size + 4 * t * 2)
    ckpt = _cfg(["embed_tokens"], data={}, grad_ckpt=True)
    assert copies_saved_bytes(SPEC, ckpt, dtypes_for(ckpt), t) == 0


@pytest.mark.parametrize("stack, saved", [("hf-trainer", ["embed_tokens"]),
                                          ("hf-trainer", ["lm_head"]),
                                          ("llamafactory", ["embed_tokens", "lm_head"])])
def test_analytic_equals_a_trace_of_peft_with_modules_to_save(stack, saved):
    """The real PEFT code (ModulesToSaveWrapper's deep copy) run on fake tensors on a tiny
    Llama: the trainable count is the same, and the peak within the tolerance the stacks'
    trace comparison uses (tests/memory/test_stacks.py)."""
    from oomless.models.catalog import ResolvedModel
    from oomless.models.hf_config import buildable_hf_config, spec_from_hf_config
    from oomless.runtime.trace.fake import trace_training

    tiny = dict(model_type="llama", hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=4, vocab_size=16384,
                max_position_embeddings=1024, tie_word_embeddings=False)
    resolved = ResolvedModel(spec=spec_from_hf_config(tiny, "tiny-llama"),
                             hf_config=buildable_hf_config(tiny), source="test")
    cfg = RunConfig(model="tiny-llama", stack=stack, method="lora", micro_batch_size=2,
                    seq_len=256, lora={"modules_to_save": saved})
    traced = trace_training(cfg, resolved=resolved)
    assert "trace_fallback" not in traced.extra
    analytic = estimate_training(resolved.spec, cfg)
    assert analytic.trainable_params == traced.trainable_params
    assert analytic.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.015)
    assert analytic.peak_phase == traced.peak_phase


def test_the_unsloth_stack_with_copies_is_not_supported_yet():
    with pytest.raises(ConfigError, match="unsloth stack: not supported yet"):
        estimate_training(SPEC, _cfg(["embed_tokens"], data={}, stack="unsloth"))


def test_a_fused_loss_keeps_an_fp32_gradient_of_a_copied_heads_weight():
    """Liger's fused linear cross-entropy allocates an fp32 grad_weight when the head's
    weight requires grad (as under full fine-tuning): a trained head copy makes it so."""
    from oomless.memory.loss_paths import logits_bytes

    t = 2048
    liger = {"liger_kernel": True}
    head, plain = (_cfg(s, data={}, stack_options=liger) for s in (["lm_head"], []))
    assert logits_bytes(SPEC, head, dtypes_for(head), t)["backward"] - logits_bytes(
        SPEC, plain, dtypes_for(plain), t)["backward"] == 4 * SPEC.vocab_size * SPEC.hidden_size


@pytest.mark.parametrize("name", ["qwen2.5-0.5b-lora-4x512-save-embed-head",
                                  "llama-3.2-1b-lora-2x1024-ckpt-save-embed"])
def test_copies_match_a_gpu_measurement(name):
    """Measured on an NVIDIA H200 (benchmarks/results/gpu_streams, 2026-11-26): LoRA with
    PEFT's trainable copies of embed_tokens (and the tied lm_head) — the analytic
    allocated peak within 0.5%, reserved within 2%."""
    import gzip
    import json
    from pathlib import Path

    from oomless.models.hardware import Cluster, get_gpu

    path = Path(__file__).parents[2] / "benchmarks/results/gpu_streams" / f"{name}.json.gz"
    with gzip.open(path, "rt") as f:
        rec = json.load(f)
    cfg = RunConfig.model_validate({**rec["config"], "hardware": {"gpu": "h200"}})
    est = estimate_training(resolve_model(cfg.model).spec, cfg, Cluster(get_gpu("h200")))
    measured = rec["measured"]
    assert abs(est.peak_allocated_bytes / measured["peak_allocated_bytes"] - 1) < 0.005
    assert abs(est.peak_reserved_bytes / measured["peak_reserved_bytes"] - 1) < 0.02
