"""Every real configuration in tests/fixtures/real_configs is read by `oomless check`
(exit 0 or 1, never 2, except the files CANNOT_TELL lists: exit 2 with the reason), and
every fix it prints applies with `patch -p1` from the redirected output and re-checks as
fitting within the headroom.

Where the catalog has no entry for the file's model, the run passes ``--model``
with a catalog model of the same architecture, as a user would (the reading of
the file's own model name is checked separately).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from oomless.check.checker import CheckOptions, check, read_files
from oomless.cli import main

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "real_configs"
LLAMA3 = "llama-3.1-8b-instruct"  # Meta-Llama-3-8B(-Instruct): the same shapes, RoPE aside
JSON_ALONE = {"model": "qwen2.5-7b-instruct", "seq_len": 2048}
QWEN1_7B = "qwen-7b"  # the shapes of Qwen-7B-Chat-Int4 before GPTQ
INTERNVL = "internvl/internvl_chat/shell/internvl2.5/2nd_finetune"

# file -> (--gpu, other options)
FILES: dict[str, tuple[str, dict]] = {
    "alignment-handbook/deepspeed_zero3.yaml": ("a100-80gb", JSON_ALONE),
    "alignment-handbook/dpo_config_full.yaml": ("a100-80gb x8", {"model": "mistral-7b-v0.1"}),
    "alignment-handbook/dpo_config_qlora.yaml": ("a100-80gb", {"model": "mistral-7b-v0.1"}),
    "alignment-handbook/fsdp.yaml": ("a100-80gb", JSON_ALONE),
    "alignment-handbook/sft_config_full.yaml": ("a100-80gb x8", {}),
    "alignment-handbook/sft_config_qlora.yaml": ("rtx-4090", {}),
    "axolotl/bigstral-ds-zero3.yaml": ("a100-80gb x8", {"model": "mixtral-8x7b-v0.1"}),
    "axolotl/dpo.yaml": ("rtx-4090", {}),
    "axolotl/instruct-dpo-lora-8b.yml": ("a100-80gb", {}),
    "axolotl/lora-8b.yml": ("a100-80gb", {}),
    "axolotl/mistral_qlora.yml": ("rtx-4090", {}),
    "axolotl/adamw-pretrain-fsdp2.yaml": ("rtx-4090 x8", {}),  # a fix is printed
    "axolotl/phi3-ft-fsdp.yml": ("a100-40gb x8", {}),
    "axolotl/qwen3-8b-fsdp-tp-cp.yaml": ("h100-80gb x8", {}),
    "axolotl/qlora-fsdp-70b.yaml": ("rtx-4090 x2", {"model": "llama-3.1-70b-instruct"}),
    "axolotl/qlora.yml": ("rtx-4090", {}),
    "axolotl/zero3_bf16_cpuoffload_all.json": ("a100-80gb x8", JSON_ALONE),
    "glm-4/ds_zero_2.json": ("a100-80gb x8", JSON_ALONE),
    "glm-4/ds_zero_3.json": ("a100-80gb x8", JSON_ALONE),
    "glm-4/finetune_demo_lora.yaml": ("rtx-4090", {"model": "glm-4-9b-chat"}),
    "glm-4/finetune_demo_sft.yaml": ("a100-80gb x8", {"model": "glm-4-9b-chat"}),
    "glm-4/finetune_lora.yaml": ("a100-80gb x8", {"model": "glm-4-9b-chat"}),
    "glm-4/finetune_sft.yaml": ("a100-80gb x8", {"model": "glm-4-9b-chat"}),
    "glm-4/ptuning_v2.yaml": ("rtx-4090", {"model": "glm-4-9b-chat"}),
    # the file names meta-llama/Meta-Llama-3-8B-Instruct, a catalog model
    **{f"llama-factory/{name}": ("rtx-4090", {}) for name in (
        "llama3_lora_sft.yaml", "llama3_lora_dpo.yaml", "llama3_lora_kto.yaml",
        "llama3_lora_ppo.yaml", "llama3_lora_reward.yaml", "llama3_lora_pretrain.yaml",
        "llama3_lora_sft_otfq.yaml", "loraplus_llama3_lora_sft.yaml",
        "pissa_llama3_lora_sft.yaml")},
    # pre-quantized checkpoints (their own config.json carries the quantization) and a
    # local block-expanded model: --model with the catalog's Llama-3-8B shapes
    **{f"llama-factory/{name}": ("rtx-4090", {"model": LLAMA3}) for name in (
        "llama3_lora_sft_aqlm.yaml", "llama3_lora_sft_awq.yaml", "llama3_lora_sft_gptq.yaml",
        "llama3_freeze_sft.yaml")},
    **{f"llama-factory/{name}": ("a100-80gb x8", {}) for name in (
        "train_full_llama3_full_sft.yaml", "llama3_lora_sft_ds3.yaml",
        "mod_llama3_full_sft.yaml", "fsdp_qlora_llama3_lora_sft.yaml")},
    **{f"llama-factory/{name}": ("a100-80gb", {}) for name in (
        "apollo_llama3_full_sft.yaml", "badam_llama3_full_sft.yaml",  # layer-wise: one GPU
        "galore_llama3_full_sft.yaml")},
    "llama-factory/qwen2vl_lora_sft.yaml": ("a100-80gb", {}),
    "llama-factory/qwen2vl_full_sft.yaml": ("a100-80gb x8", {}),
    "llama-factory/qwen3_lora_sft.yaml": ("rtx-4090", {}),
    "llama-factory/qwen3_full_sft.yaml": ("a100-80gb x8", {}),
    "llama-factory/qwen3_lora_dpo.yaml": ("rtx-4090", {}),
    "llama-factory/ds_z2_config.json": ("a100-80gb x8", JSON_ALONE),
    "llama-factory/ds_z3_config.json": ("a100-80gb x8", JSON_ALONE),
    "llama-factory/ds_z3_offload_config.json": ("a100-80gb x8", JSON_ALONE),
    "llama-factory/fsdp_config.yaml": ("a100-80gb", JSON_ALONE),
    "llava/finetune.sh": ("a100-80gb x8", {"model": "llama-2-13b"}),  # Vicuna-13B v1.5
    "llava/finetune_lora.sh": ("a100-80gb x8", {"model": "llama-2-13b"}),
    "llava/zero2.json": ("a100-80gb x8", JSON_ALONE),
    "llava/zero3.json": ("a100-80gb x8", JSON_ALONE),
    "llava/zero3_offload.json": ("a100-80gb x8", JSON_ALONE),
    "moe-llava/phi2_finetune_moe.sh": ("a100-40gb x8", {}),
    "moe-llava/pretrain.sh": ("a100-40gb x8", {}),
    "moe-llava/qwen_finetune_moe.sh": ("a100-40gb x8", {"model": "moe-llava-phi2-2.7b-4e"}),
    "moe-llava/stablelm_finetune_moe.sh": ("a100-40gb x8", {"model": "moe-llava-phi2-2.7b-4e"}),
    "moe-llava/zero2_offload.json": ("a100-40gb x8", JSON_ALONE),
    "moe-llava/zero3.json": ("a100-40gb x8", JSON_ALONE),
    "moe-llava/zero3_offload.json": ("a100-40gb x8", JSON_ALONE),
    "trl/deepspeed_zero2.yaml": ("a100-80gb", JSON_ALONE),
    "trl/deepspeed_zero3.yaml": ("a100-80gb", JSON_ALONE),
    "trl/example_config.yaml": ("rtx-4090", {}),
    "trl/fsdp_qlora.yaml": ("a100-80gb", {**JSON_ALONE, "method": "qlora"}),
    "weclone/ds_config.json": ("rtx-4090 x2", JSON_ALONE),
    "weclone/mllm.template.jsonc": ("a100-80gb", {}),
    "weclone/settings.json": ("rtx-4090", {}),
    "weclone/settings.template.jsonc": ("rtx-4090", {}),
    # launch scripts and arguments files of other projects (read by oomless.check.scripts);
    # a GPU count the script computes when it runs is given with --gpu NAMExN
    # Qwen/Qwen-7B is a catalog model; the Int4 GPTQ checkpoint is not (its config.json
    # carries the quantization): --model names the same shapes
    **{f"qwen/finetune/{name}": (gpu, {}) for name, gpu in (
        ("finetune_lora_ds.sh", "a100-80gb x8"), ("finetune_ds.sh", "a100-80gb x8"),
        ("finetune_lora_single_gpu.sh", "a100-80gb"))},
    **{f"qwen/finetune/{name}": (gpu, {"model": QWEN1_7B}) for name, gpu in (
        ("finetune_qlora_ds.sh", "a100-80gb x2"), ("finetune_qlora_single_gpu.sh", "rtx-4090"))},
    "qwen/finetune/ds_config_zero2.json": ("a100-80gb x8", JSON_ALONE),
    "qwen/finetune/ds_config_zero3.json": ("a100-80gb x8", JSON_ALONE),
    "minicpm-v/finetune/finetune_lora.sh": ("a100-80gb", {}),  # its own MiniCPM-o-2_6
    "minicpm-v/finetune/finetune_ds.sh": ("a100-80gb", {"model": "qwen2.5-vl-7b-instruct"}),
    "minicpm-v/finetune/ds_config_zero2.json": ("a100-80gb x8", JSON_ALONE),
    "minicpm-v/finetune/ds_config_zero3.json": ("a100-80gb x8", JSON_ALONE),
    "deepspeed-chat/run_llama2_7b_lora.sh": ("a100-80gb x8", {}),
    "deepspeed-chat/run_llama2_7b.sh": ("a100-80gb x8", {}),
    "deepspeed-chat/opt_single_gpu_run_1.3b.sh": ("a100-80gb", {"model": "qwen2.5-1.5b-instruct"}),
    "deepspeed-chat/opt_single_node_run_30b_lora.sh": ("a100-80gb x8",
                                                       {"model": "qwen2.5-32b-instruct"}),
    "openrlhf/train_sft.sh": ("a100-80gb x8", {}),
    "openrlhf/train_sft_llama.sh": ("a100-80gb x8", {}),
    "openrlhf/train_sft_mixtral_lora.sh": ("a100-80gb x8", {}),
    "openrlhf/train_dpo_llama.sh": ("a100-80gb x8", {"model": "meta-llama-3-8b-instruct"}),
    "openrlhf/train_rm_llama.sh": ("a100-80gb x8", {"model": "meta-llama-3-8b-instruct"}),
    "openrlhf/train_kto_llama.sh": ("a100-80gb x8", {"model": "meta-llama-3-8b-instruct"}),
    "axolotl/gpt-oss-20b-sft-lora-singlegpu.yaml": ("h100-80gb", {}),
    "llama-factory-sh/qwen3_lora_sft.sh": ("rtx-4090 x1", {}),
    "ms-swift/lora_sft.sh": ("rtx-4090", {}),
    "ms-swift/agent_loss_scale_train.sh": ("rtx-4090", {}),
    "ms-swift/qlora_bnb_train.sh": ("rtx-4090", {}),
    "ms-swift/qlora_gptq.sh": ("a100-80gb", {"model": "qwen2.5-72b-instruct"}),
    "ms-swift/full_train.sh": ("a100-80gb", {}),
    "ms-swift/multimodal_ocr.sh": ("a100-80gb", {}),
    "ms-swift/packing_llm.sh": ("rtx-4090", {}),
    f"{INTERNVL}/internvl2_5_1b_dynamic_res_2nd_finetune_lora.sh": (
        "a100-80gb", {"model": "qwen2.5-0.5b-instruct"}),
    f"{INTERNVL}/internvl2_5_8b_dynamic_res_2nd_finetune_full.sh": (
        "a100-80gb", {"model": "qwen2.5-7b-instruct"}),
    "internvl/internvl_chat/zero_stage1_config.json": ("a100-80gb x8", JSON_ALONE),
    "internvl/internvl_chat/zero_stage3_config.json": ("a100-80gb x8", JSON_ALONE),
    "firefly/qwen2.5-7b-sft-qlora.json": ("rtx-4090", {}),
    "firefly/qwen1.5-7b-sft-lora.json": ("a100-80gb", {"model": "qwen2.5-7b-instruct"}),
    "firefly/minicpm-2b-sft-full.json": ("a100-80gb x8", {"model": "qwen2.5-1.5b-instruct"}),
    "firefly/ds_z3_config.json": ("a100-80gb x8", JSON_ALONE),
    "unsloth/Qwen2.5_(7B)-Alpaca.py": ("t4", {}),
    "unsloth/Llama3.1_(8B)-Alpaca.py": ("t4", {}),
    "unsloth/Mistral_v0.3_(7B)-Conversational.py": ("t4", {"model": "mistral-7b-instruct-v0.3"}),
    "unsloth/Gemma2_(9B)-Alpaca.py": ("t4", {}),
    "llama-factory-0.6/examples/lora_single_gpu/sft.sh": ("rtx-4090", {}),
    "llama-factory-0.6/examples/qlora_single_gpu/bitsandbytes.sh": ("rtx-4090", {}),
    "llama-factory-0.6/examples/full_multi_gpu/single_node.sh": ("rtx-4090", {}),
    "llama-factory-0.6/examples/full_multi_gpu/llama3_full_sft.yaml": ("a100-80gb x4", {}),
    **{f"torchtune/{name}": ("rtx-4090", {"seq_len": 2048}) for name in (  # max_seq_len null
        "llama3_1_8B_qlora_single_device.yaml", "llama3_1_8B_lora_single_device.yaml",
        "llama3_1_8B_full_single_device.yaml", "qwen2_5_7B_lora_single_device.yaml")},
}
# A configuration with the launch configuration it is run with
PAIRS: dict[tuple[str, str], tuple[str, dict]] = {
    ("alignment-handbook/sft_config_full.yaml", "alignment-handbook/deepspeed_zero3.yaml"):
        ("a100-80gb", {}),
    ("alignment-handbook/dpo_config_full.yaml", "alignment-handbook/fsdp.yaml"):
        ("a100-80gb", {"model": "mistral-7b-v0.1"}),
    ("trl/example_config.yaml", "trl/deepspeed_zero3.yaml"): ("rtx-4090", {}),
    ("trl/example_config.yaml", "trl/deepspeed_zero2.yaml"): ("rtx-4090", {}),
    ("llama-factory/fsdp_qlora_llama3_lora_sft.yaml", "llama-factory/fsdp_config.yaml"):
        ("rtx-4090", {}),
}
CASES = {**{(k,): v for k, v in FILES.items()}, **PAIRS}
# Files whose memory check cannot tell, and what it says instead (exit 2). MiniCPM-V's
# finetune_lora.sh (the whole vision tower trained next to LoRA: --tune_vision true puts vpm
# in PEFT's modules_to_save) is estimated since lora.modules_to_save counts the copies
CANNOT_TELL: dict[tuple[str, ...], str] = {}


def _auto_batch_alone(names: tuple[str, ...]) -> bool:
    """A DeepSpeed JSON alone whose micro batch is "auto": the TrainingArguments that fill
    it are not given, so check can't tell (exit 2, check/readers_hf.py _refuse_auto)."""
    import json

    from oomless.check.jsonc import blank

    if len(names) != 1 or not names[0].endswith(".json"):
        return False
    data = json.loads(blank((CORPUS / names[0]).read_text()))
    return "zero_optimization" in data and data.get("train_micro_batch_size_per_gpu") == "auto"


def test_every_corpus_file_is_listed():
    files = {str(p.relative_to(CORPUS)) for p in CORPUS.rglob("*")
             if p.is_file() and p.name != "README.md"}
    assert files == set(FILES)
    assert len(files) >= 40


def _copy(tmp_path: Path, names: tuple[str, ...]) -> list[Path]:
    """The files' folders (companions: DeepSpeed JSONs) copied, the files' new paths."""
    for folder in {n.split("/")[0] for n in names}:
        shutil.copytree(CORPUS / folder, tmp_path / folder, dirs_exist_ok=True)
    return [tmp_path / n for n in names]


@pytest.mark.parametrize("names", sorted(CASES), ids=lambda n: "+".join(n))
def test_corpus_file_is_read_and_its_fix_applies(names, tmp_path, monkeypatch, capsys):
    gpu, extra = CASES[names]
    _check_and_patch(names, gpu, extra, tmp_path, monkeypatch, capsys)


def _check_and_patch(names, gpu, extra, tmp_path, monkeypatch, capsys) -> str:
    """`oomless check` of the files, its printed fix applied with patch -p1 and checked
    again (it must fit); the printed diff ('' when there is none)."""
    paths = _copy(tmp_path, names)
    monkeypatch.chdir(tmp_path)
    argv = ["check", *map(str, paths), "--gpu", gpu]
    for key, value in extra.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    rc = main(argv)
    out = capsys.readouterr()
    if _auto_batch_alone(names):
        assert rc == 2 and "can't tell" in out.err and '"auto"' in out.err
        return ""
    if names in CANNOT_TELL:
        assert rc == 2 and CANNOT_TELL[names] in out.err, out.err
        return ""
    assert rc in (0, 1), out.err
    opts = CheckOptions(files=tuple(map(str, paths)), gpu=gpu, **extra)
    result = check(opts)
    assert rc == result.exit_code
    if not result.diffs:
        assert rc == 0 or result.fix is None
        return ""
    patch = tmp_path / "fix.patch"
    patch.write_text(out.out)  # what `oomless check X > fix.patch` writes
    applied = subprocess.run(["patch", "-p1", "--batch", "-i", str(patch)], cwd=tmp_path,
                             capture_output=True, text=True)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    after = check(opts)
    if result.fix["high_bytes"] > result.gpu_memory_bytes:  # a tight fix: it keeps the budget
        assert after.device_peak_bytes <= after.budget_bytes and after.verdict == "tight", (
            result.fix["changes"], after.notes)
        return out.out
    assert after.within_budget and after.exit_code == 0, (result.fix["changes"], after.notes)
    return out.out


# Fixes of launch scripts in the script's own terms, on a card where the file as published
# does not fit: the ${VAR:-N} default a computed batch is made from (the $((...)) itself
# is never written over), the ZeRO stage where the script sets it, DeepSpeed-Chat's bare
# --offload flag; the lines the fix must add
SCRIPT_FIXES: dict[str, tuple[str, dict, tuple[str, ...]]] = {
    f"{INTERNVL}/internvl2_5_1b_dynamic_res_2nd_finetune_lora.sh": (
        "a100-40gb", {"model": "qwen2.5-0.5b-instruct"},
        ("+PER_DEVICE_BATCH_SIZE=${PER_DEVICE_BATCH_SIZE:-1}",)),
    "deepspeed-chat/run_llama2_7b.sh": ("a100-40gb x2", {}, ("+    --offload \\",)),
    "deepspeed-chat/opt_single_gpu_run_1.3b.sh": (
        "rtx-3060", {"model": "qwen2.5-1.5b-instruct"},
        ("+    ZERO_STAGE=3", "+    --offload &> $OUTPUT/training.log")),
    # OpenRLHF: flags in a literal heredoc, edited where the body writes them
    "openrlhf/train_sft.sh": ("rtx-4090 x8", {}, ("+   --ds.zero_stage 3 \\",
                                                  "+    --ds.adam_offload")),
    "openrlhf/train_sft_llama.sh": ("a100-40gb x8", {}, ("+   --micro_train_batch_size 1 \\",)),
}


@pytest.mark.parametrize("name", sorted(SCRIPT_FIXES))
def test_script_fixes_edit_defaults_zero_and_offload_flags(name, tmp_path, monkeypatch, capsys):
    gpu, extra, lines = SCRIPT_FIXES[name]
    diff = _check_and_patch((name,), gpu, extra, tmp_path, monkeypatch, capsys)
    added = [x for x in diff.splitlines() if x.startswith("+") and not x.startswith("+++")]
    assert set(lines) <= set(added), added
    assert not any("$((" in x for x in diff.splitlines() if x[:1] in "+-"), diff


@pytest.mark.parametrize("name,model", [
    ("llama-factory/llama3_lora_sft.yaml", "meta-llama/Meta-Llama-3-8B-Instruct"),
    ("llama-factory/llama3_lora_sft_gptq.yaml", "TechxGenus/Meta-Llama-3-8B-Instruct-GPTQ"),
    ("axolotl/bigstral-ds-zero3.yaml", "mistral-community/Mixtral-8x22B-v0.1"),
    ("alignment-handbook/dpo_config_full.yaml", "alignment-handbook/zephyr-7b-sft-full"),
    ("llava/finetune.sh", "lmsys/vicuna-13b-v1.5"),
    ("weclone/settings.json", "./Qwen2.5-7B-Instruct"),
])
def test_the_files_own_model_is_read(name, model):
    assert read_files(CheckOptions(files=(str(CORPUS / name),))).run["model"] == model


needs_patch = pytest.mark.skipif(shutil.which("patch") is None, reason="patch(1) not installed")
pytestmark = needs_patch
