"""Every setting that changes memory is read from the real files into the run
configuration (stage, stack, quantization, vision tower, evaluation by generation,
evaluation batch, sharding); --data, --write and --diff-out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from oomless.check.checker import CheckOptions, check, read_files
from oomless.cli import main
from oomless.config import RunConfig

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "real_configs"
LLAMA3 = "llama-3.1-8b-instruct"


def run_of(name: str, *extra: str, **opts) -> dict:
    files = (str(CORPUS / name), *(str(CORPUS / e) for e in extra))
    return read_files(CheckOptions(files=files, **opts)).run


@pytest.mark.parametrize("name,stage,stack", [
    ("llama-factory/llama3_lora_sft.yaml", "sft", "llamafactory"),
    ("llama-factory/llama3_lora_dpo.yaml", "dpo", "llamafactory"),
    ("llama-factory/llama3_lora_kto.yaml", "kto", "llamafactory"),
    ("llama-factory/llama3_lora_ppo.yaml", "ppo", "llamafactory"),
    ("llama-factory/llama3_lora_reward.yaml", "rm", "llamafactory"),
    ("llama-factory/llama3_lora_pretrain.yaml", "pt", "llamafactory"),
    ("alignment-handbook/dpo_config_qlora.yaml", "dpo", "trl"),
    ("alignment-handbook/sft_config_qlora.yaml", "sft", "trl"),
    ("trl/example_config.yaml", "sft", "trl"),
    ("axolotl/dpo.yaml", "dpo", "axolotl"),
    ("axolotl/qlora.yml", "sft", "axolotl"),
    ("weclone/settings.json", "sft", "llamafactory"),
    ("moe-llava/phi2_finetune_moe.sh", "sft", "hf-trainer"),
])
def test_stage_and_stack(name, stage, stack):
    run = run_of(name)
    assert (run["stage"], run["stack"]) == (stage, stack)


def test_llamafactory_pref_loss_orpo_is_its_own_stage(tmp_path):
    text = (CORPUS / "llama-factory/llama3_lora_dpo.yaml").read_text()
    path = tmp_path / "orpo.yaml"
    path.write_text(text.replace("pref_loss: sigmoid", "pref_loss: orpo"))
    assert read_files(CheckOptions(files=(str(path),))).run["stage"] == "orpo"


@pytest.mark.parametrize("name,method,bits", [
    ("llama-factory/llama3_lora_sft_otfq.yaml", "qlora", 4),
    ("llama-factory/llama3_lora_sft_gptq.yaml", "lora", None),
    ("alignment-handbook/sft_config_qlora.yaml", "qlora", 4),
    ("axolotl/lora-8b.yml", "qlora", 8),
    ("axolotl/qlora.yml", "qlora", 4),
    ("axolotl/dpo.yaml", "full", None),
    ("llava/finetune_lora.sh", "lora", None),
])
def test_method_and_quantization(name, method, bits):
    run = run_of(name)
    assert run["method"] == method
    if bits:
        assert run["quantization"]["bits"] == bits


@pytest.mark.parametrize("name", ["llama-factory/llama3_lora_sft_gptq.yaml",
                                  "llama-factory/llama3_lora_sft_awq.yaml",
                                  "llama-factory/llama3_lora_sft_aqlm.yaml"])
def test_pre_quantized_checkpoints_are_said(name):
    reading = read_files(CheckOptions(files=(str(CORPUS / name),)))
    assert any("pre-quantized" in a for a in reading.assumptions)


def test_vision_tower_settings(tmp_path):
    assert run_of("glm-4/finetune_lora.yaml", model="glm-4v-9b")["vision"]["freeze_tower"] is True
    text = (CORPUS / "glm-4/finetune_lora.yaml").read_text().replace("freezeV: True",
                                                                     "freezeV: False")
    path = tmp_path / "lora.yaml"
    path.write_text(text)
    run = read_files(CheckOptions(files=(str(path),), model="glm-4v-9b")).run
    assert run["vision"]["freeze_tower"] is False
    assert run_of("llama-factory/qwen2vl_full_sft.yaml")["vision"]["freeze_tower"] is True
    lf = (CORPUS / "llama-factory/qwen2vl_full_sft.yaml").read_text()
    path = tmp_path / "vl.yaml"
    path.write_text(lf.replace("freeze_vision_tower: true", "freeze_vision_tower: false"))
    assert read_files(CheckOptions(files=(str(path),))).run["vision"]["freeze_tower"] is False
    # LLaMA-Factory hparams/finetuning_args.py: freeze_multi_modal_projector defaults to true
    assert run_of("llama-factory/qwen2vl_full_sft.yaml")["vision"]["freeze_projector"] is True
    path.write_text(lf + "\nfreeze_multi_modal_projector: false\n")
    assert read_files(CheckOptions(files=(str(path),))).run["vision"]["freeze_projector"] is False


def test_image_max_pixels_caps_the_tokens_per_image():
    result = check(CheckOptions(files=(str(CORPUS / "llama-factory/qwen2vl_lora_sft.yaml"),),
                                gpu="a100-80gb", model="qwen2.5-vl-7b-instruct"))
    # 262144 pixels / (14 × 2)^2 pixels per token
    assert result.config["data"]["image_tokens"] == 335


def test_glm4_evaluation_generates_from_the_prompt_alone():
    run = run_of("glm-4/finetune_demo_lora.yaml", model="glm-4-9b-chat")
    # process_batch_eval gives no labels: Seq2SeqTrainer generates and computes no loss
    assert run["eval"] == {"batch_size": 4, "predict_with_generate": True, "max_new_tokens": 512,
                           "loss": False}
    assert run["data"] == {"max_input_length": 513, "max_output_length": 512}
    assert run["seq_len"] == 1025 and run["grad_ckpt"] is True  # finetune_demo always on


def test_glm4v_runs_finetune_vision_with_its_own_cut(tmp_path):
    # finetune_vision.py (4daff94): max_length = max_input_length + max_output_length, the
    # eval prompt input_segment[:max_input_length]; finetune.py keeps one token more
    run = run_of("glm-4/finetune_demo_lora.yaml", model="glm-4v-9b")
    assert run["seq_len"] == 1024
    assert run["data"] == {"max_input_length": 512, "max_output_length": 512}
    # a local GLM-4V config.json (its vision_config) is read the same way
    config = tmp_path / "glm-4v" / "config.json"
    config.parent.mkdir()
    config.write_text('{"model_type": "chatglm", "vision_config": {"image_size": 1120}}')
    reading = read_files(CheckOptions(files=(str(CORPUS / "glm-4/finetune_demo_lora.yaml"),),
                                      model=str(config.parent)))
    assert reading.run["seq_len"] == 1024
    assert any("finetune_vision.py" in n and "empties the CUDA cache" in n
               for n in reading.notes)


def test_glm4_0414_checkpointing_follows_the_yaml(tmp_path):
    assert run_of("glm-4/finetune_lora.yaml", model="glm-4-9b-chat")["grad_ckpt"] is False
    result = check(CheckOptions(files=(str(CORPUS / "glm-4/finetune_sft.yaml"),),
                                gpu="rtx-4090 x2", model="glm-4-9b-chat"))
    if result.fix and result.fix["config"]["grad_ckpt"]:
        assert "gradient_checkpointing: true" in "".join(result.diffs.values())


def test_ptuning_v2_is_read_with_its_prefix():
    reading = read_files(CheckOptions(files=(str(CORPUS / "glm-4/ptuning_v2.yaml"),),
                                      model="glm-4-9b-chat"))
    assert reading.facts["prefix_tokens"] == 512 and "lora" in reading.fixed
    assert any("P-tuning v2 (512 prefix tokens)" in a for a in reading.assumptions)
    assert not reading.warnings


def test_llamafactory_evaluation_and_generation(tmp_path):
    text = (CORPUS / "llama-factory/llama3_lora_sft.yaml").read_text()
    path = tmp_path / "predict.yaml"
    path.write_text(text + "predict_with_generate: true\nmax_new_tokens: 256\n")
    run = read_files(CheckOptions(files=(str(path),))).run
    assert run["eval"] == {"batch_size": 1, "predict_with_generate": True, "max_new_tokens": 256}
    assert run_of("llama-factory/llama3_lora_kto.yaml")["eval"] == {}  # no val_size: no eval


def test_axolotl_eval_table_generates():
    run = run_of("axolotl/mistral_qlora.yml")
    assert run["eval"] == {"batch_size": 2, "predict_with_generate": True, "max_new_tokens": 128}
    assert run["data"]["packing"] is True and run["seq_len"] == 8192


def test_launch_scripts_resolve_variables_and_the_launcher():
    run = run_of("moe-llava/phi2_finetune_moe.sh")
    assert run["model"] == "moe-llava-phi2-2.7b-4e" and run["zero"] == 2
    assert (run["micro_batch_size"], run["grad_accum"], run["seq_len"]) == (8, 2, 2048)
    reading = read_files(CheckOptions(files=(str(CORPUS / "moe-llava/phi2_finetune_moe.sh"),)))
    assert reading.facts["deepspeed_moe"] is True
    lora = run_of("llava/finetune_lora.sh")
    assert lora["lora"]["r"] == 128 and lora["attn"] == "flash" and lora["zero"] == 3


def test_accelerate_config_gives_processes_and_sharding():
    run = run_of("alignment-handbook/sft_config_full.yaml", "alignment-handbook/deepspeed_zero3.yaml")
    assert (run["zero"], run["offload"]) == (3, "all")
    assert run["hardware"] == {"gpus_per_node": 1, "nodes": 1}
    run = run_of("trl/example_config.yaml", "trl/deepspeed_zero2.yaml")
    assert (run["zero"], run["offload"], run["hardware"]["gpus_per_node"]) == (2, "none", 8)


def test_every_reading_validates_as_a_run_configuration():
    for path in sorted(p for p in CORPUS.rglob("*") if p.is_file()):
        arguments_file = path.parent.name == "firefly" and "sft" in path.name
        if path.suffix in (".json",) and not arguments_file or path.name in ("README.md",) \
                or "deepspeed" in path.name or "fsdp" in path.name and path.parent.name != "axolotl":
            continue
        run = read_files(CheckOptions(files=(str(path),), model="qwen2.5-7b-instruct")).run
        if run["method"] == "qlora" and run["zero"] == 3:
            continue  # FSDP-QLoRA: check estimates it unsharded (an assumption it states)
        lora = run.get("lora") or {}
        if isinstance(lora.get("targets"), str) and lora["targets"] != "all-linear":
            # a regex (MiniCPM-V's lora_target_modules) is resolved on the model's module
            # tree (oomless.check.lora_names) before the RunConfig is built
            run["lora"] = {**lora, "targets": "all-linear"}
        RunConfig.model_validate({k: v for k, v in run.items() if k != "hardware"})


# ---- --data, --write, --diff-out -----------------------------------------------------------
def test_data_file_sets_the_length_to_its_longest_sample(tmp_path):
    data = tmp_path / "train.jsonl"
    rows = [{"instruction": "word " * n, "input": "", "output": "ok"} for n in (10, 40, 120)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    name = str(CORPUS / "llama-factory/llama3_lora_sft.yaml")
    without = check(CheckOptions(files=(name,), gpu="rtx-4090", model=LLAMA3))
    with_data = check(CheckOptions(files=(name,), gpu="rtx-4090", model=LLAMA3, data=str(data)))
    assert without.config["seq_len"] == 1024
    assert 120 < with_data.config["seq_len"] < 300
    assert with_data.device_peak_bytes < without.device_peak_bytes
    assert any("pad to the longest sample" in n for n in with_data.notes)


def test_write_keeps_the_original_and_refuses_to_replace_it(tmp_path, capsys):
    path = tmp_path / "settings.json"
    shutil.copy(CORPUS / "weclone/settings.json", path)
    original = path.read_bytes()
    assert main(["check", str(path), "--gpu", "rtx-4090", "--write"]) == 1
    assert (tmp_path / "settings.json.orig").read_bytes() == original
    assert path.read_bytes() != original
    assert main(["check", str(path), "--gpu", "rtx-4090"]) == 0  # the written fix fits
    path.write_bytes(original)
    assert main(["check", str(path), "--gpu", "rtx-4090", "--write"]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert main(["check", str(path), "--gpu", "rtx-4090", "--write", "--force"]) == 1


def test_diff_out_writes_the_patch(tmp_path):
    path = tmp_path / "settings.json"
    shutil.copy(CORPUS / "weclone/settings.json", path)
    out = tmp_path / "fix.patch"
    assert main(["check", str(path), "--gpu", "rtx-4090", "--diff-out", str(out)]) == 1
    assert out.read_text().startswith("--- a/") and '"per_device_train_batch_size": 4' in \
        out.read_text()
    assert main(["check", str(path), "--gpu", "rtx-4090", "--diff-out", str(out)]) == 2


# ---- PEFT modules_to_save under each tool's name (lora.modules_to_save) ---------------------
def test_axolotl_lora_modules_to_save_of_a_real_file_is_counted():
    """axolotl examples/llama-3/lora-8b.yml (commit 9f824ef7...) lists embed_tokens and
    lm_head in lora_modules_to_save: both copies are counted, vocabulary × hidden each."""
    from oomless.api import estimate

    result = check(CheckOptions(files=(str(CORPUS / "axolotl/lora-8b.yml"),), gpu="a100-80gb"))
    assert result.config["lora"]["modules_to_save"] == ["embed_tokens", "lm_head"]
    assert "copies of embed_tokens, lm_head" in result.lora_reach
    cfg = RunConfig.model_validate(result.config)
    without = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"modules_to_save": []})})
    vocab_by_hidden = 128256 * 4096  # Meta-Llama-3-8B: untied embedding and head
    assert estimate(cfg).trainable_params - estimate(without).trainable_params == \
        2 * vocab_by_hidden


def test_llamafactory_additional_target_is_a_comma_separated_list(tmp_path):
    """LLaMA-Factory splits additional_target at commas (hparams/finetuning_args.py
    split_arg); the real llama3_lora_sft.yaml with the key added (the fixture has none)."""
    text = (CORPUS / "llama-factory/llama3_lora_sft.yaml").read_text()
    assert "additional_target" not in text and "lora_target: all\n" in text
    path = tmp_path / "saved.yaml"
    path.write_text(text.replace("lora_target: all\n",
                                 "lora_target: all\nadditional_target: embed_tokens, lm_head\n"))
    run = read_files(CheckOptions(files=(str(path),))).run
    assert run["lora"]["modules_to_save"] == ["embed_tokens", "lm_head"]
    assert run_of("llama-factory/llama3_lora_sft.yaml")["lora"]["modules_to_save"] == []


def test_trl_and_peft_configs_name_modules_to_save(tmp_path):
    """TRL's ModelConfig.lora_modules_to_save and a PEFT LoraConfig's modules_to_save
    (GLM-4 finetune's peft_config) reach the knob."""
    text = (CORPUS / "trl/example_config.yaml").read_text()
    path = tmp_path / "trl.yaml"
    path.write_text(text + "\nuse_peft: true\nlora_modules_to_save: [lm_head]\n")
    assert run_of(str(path))["lora"]["modules_to_save"] == ["lm_head"]
    glm = (CORPUS / "glm-4/finetune_lora.yaml").read_text()
    line = '  target_modules: ["q_proj", "k_proj", "v_proj"]\n'
    assert line in glm
    path = tmp_path / "glm.yaml"
    path.write_text(glm.replace(line, line + "  modules_to_save: [embed_tokens]\n"))
    assert run_of(str(path), model="glm-4-9b-chat")["lora"]["modules_to_save"] == ["embed_tokens"]


def test_an_unknown_saved_module_is_a_user_error(tmp_path, capsys):
    text = (CORPUS / "axolotl/lora-8b.yml").read_text()
    path = tmp_path / "lora.yml"
    path.write_text(text.replace("  - lm_head\n", "  - score_proj\n"))
    assert main(["check", str(path), "--gpu", "a100-80gb"]) == 2
    err = capsys.readouterr().err
    assert "'score_proj' names no part of" in err and "lm_head" in err
    assert "Traceback" not in err


def test_a_python_scripts_get_peft_model_modules_to_save_is_read(tmp_path, capsys):
    """The Unsloth notebook script (tests/fixtures/real_configs/unsloth) with
    modules_to_save added to its get_peft_model call: read from the call, and refused for
    the unsloth stack (its own handling of the copies is not modelled yet)."""
    text = (CORPUS / "unsloth/Qwen2.5_(7B)-Alpaca.py").read_text()
    line = "    lora_alpha = 16,\n"
    assert text.count(line) == 1
    path = tmp_path / "alpaca.py"
    path.write_text(text.replace(line, line + '    modules_to_save = ["lm_head"],\n'))
    run = read_files(CheckOptions(files=(str(path),))).run
    assert run["stack"] == "unsloth"
    assert main(["check", str(path), "--gpu", "a100-80gb"]) == 2
    err = capsys.readouterr().err
    assert "unsloth stack: not supported yet" in err and "Traceback" not in err
