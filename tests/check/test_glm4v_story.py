"""The founding story: GLM-4V-9B with GLM-4's 2024 finetune_demo LoRA YAML.

tests/fixtures/real_configs/glm-4/finetune_demo_lora.yaml (THUDM/GLM-4 4daff94,
finetune_demo/configs/lora.yaml): r 8 on ``query_key_value``, 512 + 512 tokens, no
``freezeV`` key. It ran out of memory at per_device_train_batch_size 2 on 8× A100-80GB
and fits at batch 1 on one A100-80GB; GLM-4's README gives 75 GB for GLM-4V LoRA.

Modelled through named mechanisms only:
- finetune_demo/finetune_vision.py freezes the tower only ``if ft_config.freezeV``
  (after get_peft_model): without the key nothing is frozen;
- PEFT matches ``query_key_value`` in every module, and every EVA2-CLIP attention
  projection has that name: LoRA in all 63 tower layers (oomless.check.lora_names.lora_reach);
- the tower's code (visual.py) has no gradient checkpointing, while
  ``gradient_checkpointing_enable()`` reaches GLM's language layers (families.json
  vision_towers): the tower keeps every layer's activations;
- ChatGLM's own forward upcasts the logits and copies the shifted ones (families.json
  own_loss);
- the YAML sets neither bf16 nor fp16 and finetune_vision.py loads the model in bf16:
  HF Trainer runs without autocast, PEFT's fp32 adapters (autocast_adapter_dtype,
  PEFT ≥ 0.11) take an fp32 copy of each input, and LayerNorm keeps its bf16 input
  (stack_options.autocast false; tests/runtime/test_trace_glm4v.py traces it);
- the language model runs GLM-4V's own eager CoreAttention whatever attn_implementation
  says (modeling_chatglm.py SelfAttention builds CoreAttention; THUDM/GLM-4#420): fp32
  softmax over 32 heads × 2,627² positions in the recomputed layer (ModelSpec
  sdpa_supported false), with CoreAttention's own working set: the 16-bit baddbmm
  buffer and result and masked_fill's fp32 output stay referenced until it returns, five
  score-sized tensors alive at once (families.json own_attention;
  oomless.allocator.attention_blocks);
- ChatGLM's loss casts the fp32 logits back to bf16 after the loss, next to the fp32
  logits, the shifted copy and log_softmax's output (LossPath recast_after_loss); the
  shifted logits of one sequence are a contiguous prefix, copied only from batch 2 on.

With a vision tower the YAML runs finetune_vision.py (4daff94), which cuts samples at
max_input_length + max_output_length = 1,024 tokens (finetune.py keeps one more) and
whose training_step calls torch.cuda.empty_cache() after every backward
(oomless.check.readers_glm): each step starts with only the live tensors' segments.

What stays unexplained (the strict xfail below): a trace of the stand-in with all these
mechanisms at full size (63 tower layers of 6,401 patches, 40 language layers of about
2,600 positions; tests/runtime/glm4v_shell.py) allocates 54.7 GiB at batch 1, as the estimate
does. The same stand-in run on a GPU (NVIDIA H200, 2026-11-26;
benchmarks/results/gpu_runs.md) allocated 54.70 GiB and reserved 58.74 GiB in its first
step (60.26 in a second step that the script's emptying of the cache would not let
grow): about 59.4 GiB on the card, 63.7 GB, 15% under the README's 75 GB. The analytic
estimate (its synthesized stream, oomless.allocator.synthetic, reserves 58.07 GiB) gives
58.7 GiB on the card (63.0 GB), 16% under. The README's row was added with the first
finetune_vision.py (THUDM/GLM-4 b9d6d38, 2024-07-01) "with the configs folder's
settings" on A100-SXM4-80GB; what else that run held is in GLM-4V's own code or in how
the figure was taken, neither at hand. At batch 2 the stand-in allocated 84.68 GiB
and reserved 92.86 GiB in its first step on the GPU, above the 79.25 GiB an
A100-80GB leaves PyTorch; the estimate says 90.9 GiB and even the band's lower bound
(84.0 GiB) is above the card: OUT OF MEMORY, as the run was.

Checked and excluded: evaluation and generation (eval batch 4: prefill of 4 × ~2,100 positions with eager attention, about 34 GiB; the
Seq2SeqTrainer empties the cache after every step and prediction), the attention mask
(a bool (b, 1, s, s) per layer, or get_masks' fp32 (b, s, s) only with padding), the
tower's attention (SDPA: visual.py attention_fn_default, torch ≥ 2), dropout p 0 in the
tower and the language attention (no copy), the allocator across steps (the script
empties the cache after every backward). Seen but not verified: a derivative copy of GLM-4V's
ChatGLMModel.forward re-embeds input_ids in training when the batch has padding
(THUDM/GLM-4#264), which would drop the image features from the language model from
batch 2 on; the genuine file of mid-2024 was not found, so it is not modelled.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from oomless.check.checker import CheckOptions, check, phase_device_bytes
from oomless.config import RunConfig
from oomless.models.catalog import resolve_model
from oomless.models.hardware import parse_gpu_arg
from oomless.units import GiB

YAML = Path(__file__).parents[1] / "fixtures/real_configs/glm-4/finetune_demo_lora.yaml"
README_LORA_BYTES = 75e9  # GLM-4 README: "75GB" for GLM-4V-9B LoRA on one A100-80GB


@pytest.fixture
def batch2(tmp_path):
    path = tmp_path / "lora.yaml"
    path.write_text(YAML.read_text().replace("per_device_train_batch_size: 1",
                                             "per_device_train_batch_size: 2"))
    return path


def test_lora_reaches_the_63_tower_layers_and_the_tower_is_not_checkpointed():
    r = check(CheckOptions(files=(str(YAML),), gpu="a100-80gb", model="glm-4v-9b"))
    assert r.lora_reach == ("LoRA on 40 language + 63 vision-tower layers "
                            "(query_key_value, tower not checkpointed)")
    assert any("does not reach the eva2clip tower" in a for a in r.assumptions) or \
        r.config["vision"]["freeze_tower"] is False


def test_batch_2_on_8_a100_is_predicted_above_the_gpu(batch2):
    r = check(CheckOptions(files=(str(batch2),), gpu="a100-80gbx8", model="glm-4v-9b"))
    assert r.exit_code == 1
    assert r.oom_phase in ("forward", "backward")
    assert r.device_peak_bytes > r.gpu_memory_bytes


def test_batch_2_on_8_a100_is_out_of_memory(batch2):
    r = check(CheckOptions(files=(str(batch2),), gpu="a100-80gbx8", model="glm-4v-9b"))
    assert r.verdict == "out_of_memory"
    assert r.low_bytes > r.gpu_memory_bytes  # even the band's lower bound is above the card


def test_the_language_model_runs_glm4v_own_eager_attention():
    r = check(CheckOptions(files=(str(YAML),), gpu="a100-80gb", model="glm-4v-9b"))
    assert r.config["attn"] == "eager"
    assert any("CoreAttention" in a for a in resolve_model("glm-4v-9b").spec.assumptions)
    text = check(CheckOptions(files=(str(YAML),), gpu="a100-80gb", model="glm-4-9b-chat"))
    assert text.config["attn"] == "sdpa"  # glm-4-9b-chat: as attn_implementation selects


def test_freezev_true_keeps_the_tower_out_of_the_graph(tmp_path):
    path = tmp_path / "lora.yaml"
    path.write_text(YAML.read_text() + "\nfreezeV: true\n")
    frozen = check(CheckOptions(files=(str(path),), gpu="a100-80gb", model="glm-4v-9b"))
    assert "vision tower frozen" in frozen.lora_reach
    reached = check(CheckOptions(files=(str(YAML),), gpu="a100-80gb", model="glm-4v-9b"))
    cfg = RunConfig.model_validate(reached.config)
    spec = resolve_model("glm-4v-9b").spec
    cluster = parse_gpu_arg("a100-80gb")
    on = phase_device_bytes(spec, cfg, cluster)["backward"]
    off = phase_device_bytes(spec, cfg.replace(**{"vision.freeze_tower": True}), cluster)
    # the 63 layers' activations: at least 63 × (GELU input + q, k, v) of 6401 patches
    assert on - off["backward"] > 63 * 2 * 6401 * (15360 + 3 * 1792)


def test_no_bf16_flag_runs_the_bf16_model_without_autocast(tmp_path):
    r = check(CheckOptions(files=(str(YAML),), gpu="a100-80gb", model="glm-4v-9b"))
    assert r.config["stack_options"]["autocast"] is False
    assert any("neither bf16 nor fp16" in n for n in r.notes)
    path = tmp_path / "lora.yaml"
    path.write_text(YAML.read_text().replace("  per_device_train_batch_size: 1",
                                             "  per_device_train_batch_size: 1\n  bf16: true"))
    mixed = check(CheckOptions(files=(str(path),), gpu="a100-80gb", model="glm-4v-9b"))
    assert mixed.config["stack_options"]["autocast"] is None


@pytest.mark.xfail(strict=True, reason="documented miss: batch 1 is predicted at 58.7 GiB "
                   "(63.0 GB), 16% under the README's 75 GB (the stand-in's first step on a "
                   "GPU: 58.74 GiB reserved, about 15% under on the card); what else the real "
                   "run held is not identified (see the module docstring)")
def test_batch_1_is_within_15_percent_of_the_readme():
    r = check(CheckOptions(files=(str(YAML),), gpu="a100-80gb", model="glm-4v-9b"))
    train_peak = max(r.phase_device_bytes[p] for p in ("forward", "backward"))
    assert abs(train_peak - README_LORA_BYTES) <= 0.15 * README_LORA_BYTES
    assert train_peak < 80 * GiB


def test_a_regex_target_is_refused_with_what_settles_it(tmp_path, capsys):
    from oomless.cli import main

    path = tmp_path / "lora.yaml"
    path.write_text(YAML.read_text().replace('target_modules: ["query_key_value"]',
                                             'target_modules: ".*query_key_value"'))
    assert main(["check", str(path), "--model", "glm-4v-9b", "--gpu", "a100-80gb"]) == 2
    err = capsys.readouterr().err
    assert "regular expression" in err and "re.fullmatch" in err and "as a list" in err
