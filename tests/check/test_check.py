"""`oomless check`: foreign configurations read, the OOM phase found, the
smallest fix printed as a diff that applies to the same file and then fits."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest

from oomless.check import foreign_keys as K
from oomless.check.checker import CheckOptions, check
from oomless.cli import main
from oomless.config import load_run_config

GLM_SEED = """\
data_config:
  train_file: train.jsonl
  val_file: dev.jsonl
  test_file: dev.jsonl
  num_proc: 1

max_input_length: 512
max_output_length: 512

training_args:
  # see `transformers.Seq2SeqTrainingArguments`
  output_dir: ./output
  max_steps: 3000
  learning_rate: 5e-4
  per_device_train_batch_size: 4
  per_device_eval_batch_size: 16
  dataloader_num_workers: 16
  remove_unused_columns: false
  save_strategy: steps
  save_steps: 500
  evaluation_strategy: steps
  eval_steps: 500
  predict_with_generate: true
  generation_config:
    max_new_tokens: 512

peft_config:
  peft_type: LORA
  task_type: CAUSAL_LM
  r: 8
  lora_alpha: 32
  lora_dropout: 0.1
  target_modules: ["query_key_value"]
"""

LF_YAML = """\
### model
model_name_or_path: Qwen/Qwen2.5-7B-Instruct

### method
stage: sft
do_train: true
finetuning_type: lora
lora_target: all

### dataset
dataset: alpaca_en_demo
template: qwen
cutoff_len: 4096

### train
per_device_train_batch_size: 8
gradient_accumulation_steps: 2
learning_rate: 1.0e-4
bf16: true
"""

# MoE-LLaVA's fine-tuning stage (seed 002): DeepSpeed ZeRO-2 file + HF arguments
DS_ZERO2 = {"zero_optimization": {"stage": 2, "overlap_comm": True,
                                  "contiguous_gradients": True, "reduce_bucket_size": "auto"},
            "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "train_batch_size": "auto"}
TA_MOE_LLAVA = {"output_dir": "./checkpoints/moe-llava", "per_device_train_batch_size": 8,
                "per_device_eval_batch_size": 4, "gradient_accumulation_steps": 2,
                "bf16": True, "gradient_checkpointing": True, "learning_rate": 2e-5,
                "deepspeed": "zero2.json"}


def _patch(tmp_path, diff: str) -> None:
    """Apply the printed unified diff with patch(1), as a user would."""
    proc = subprocess.run(["patch", "-p1", "--batch"], input=diff, text=True, cwd=tmp_path,
                          capture_output=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


needs_patch = pytest.mark.skipif(shutil.which("patch") is None, reason="patch(1) not installed")


@needs_patch
def test_glm4_seed_yaml_ooms_and_the_diff_fixes_it(tmp_path, capsys):
    path = tmp_path / "lora.yaml"
    path.write_text(GLM_SEED)
    rc = main(["check", str(path), "--gpu", "rtx-4090", "--model", "glm-4-9b-chat"])
    out = capsys.readouterr().out
    assert rc == 1 and "OUT OF MEMORY in the forward phase" in out
    result = check(CheckOptions(files=(str(path),), gpu="rtx-4090", model="glm-4-9b-chat"))
    # finetune.py's evaluation feeds no labels: Seq2SeqTrainer only generates (no loss forward)
    assert result.oom_phase == "forward" and "evaluation" not in result.phase_device_bytes
    # micro batch 1 (about 20.7 GiB) keeps the 90% budget; the band's upper bound (about
    # 23.8 GiB, with the 234 MiB of kernel images a first step loads) is just above the
    # card's 23.65 GiB, and no change of this file keeps it on the card: the fix is tight
    fix = result.fix
    assert fix["config"]["micro_batch_size"] * fix["config"]["grad_accum"] == 4
    assert fix["device_peak_bytes"] <= result.budget_bytes < result.gpu_memory_bytes
    assert fix["high_bytes"] > result.gpu_memory_bytes
    diff = result.diffs[str(path)]
    assert "-  per_device_train_batch_size: 4" in diff
    _patch(tmp_path, diff)
    after = check(CheckOptions(files=(str(path),), gpu="rtx-4090", model="glm-4-9b-chat"))
    assert after.device_peak_bytes <= after.budget_bytes and after.verdict == "tight"
    assert after.fix is None
    # a 32 GB card: batch 4 is tight there, and its fix keeps the whole band on the card
    path.write_text(GLM_SEED)
    roomy = check(CheckOptions(files=(str(path),), gpu="rtx-5090", model="glm-4-9b-chat"))
    assert roomy.verdict == "tight" and roomy.fix["high_bytes"] <= roomy.gpu_memory_bytes
    _patch(tmp_path, roomy.diffs[str(path)])
    after = check(CheckOptions(files=(str(path),), gpu="rtx-5090", model="glm-4-9b-chat"))
    assert after.fits and after.within_budget and after.fix is None
    assert "# see `transformers.Seq2SeqTrainingArguments`" in path.read_text()


@needs_patch
def test_llamafactory_yaml_fix_applies_and_fits(tmp_path):
    path = tmp_path / "qwen_lora.yaml"
    path.write_text(LF_YAML)
    result = check(CheckOptions(files=(str(path),), gpu="rtx-4090"))
    assert result.oom_phase == "forward" and result.model == "qwen2.5-7b-instruct"
    cfg = result.fix["config"]
    assert cfg["micro_batch_size"] * cfg["grad_accum"] == 16
    _patch(tmp_path, result.diffs[str(path)])
    import yaml

    edited = yaml.safe_load(path.read_text())
    assert set(edited) <= K.keys_of("llamafactory", *K.TRAINING_ARGUMENTS)
    after = check(CheckOptions(files=(str(path),), gpu="rtx-4090"))
    assert after.within_budget


@needs_patch
def test_moe_llava_deepspeed_and_training_arguments(tmp_path):
    (tmp_path / "zero2.json").write_text(json.dumps(DS_ZERO2, indent=2))
    ta = tmp_path / "args.json"
    ta.write_text(json.dumps(TA_MOE_LLAVA, indent=2))
    opts = CheckOptions(files=(str(ta), str(tmp_path / "zero2.json")), gpu="a100-40gb x8",
                        model="moe-llava-phi2-2.7b-4e", seq_len=2048, method="full")
    result = check(opts)
    assert result.config["zero"] == 2 and result.config["micro_batch_size"] == 8
    assert not result.within_budget
    cfg = result.fix["config"]
    assert cfg["micro_batch_size"] < 8 and cfg["micro_batch_size"] * cfg["grad_accum"] == 16
    assert set(result.diffs) == {str(ta)}  # DeepSpeed's "auto" values follow the arguments
    _patch(tmp_path, result.diffs[str(ta)])
    assert check(opts).within_budget


@needs_patch
def test_oomless_yaml_fix(tmp_path):
    path = tmp_path / "oomless.yaml"
    path.write_text("model: qwen2.5-7b-instruct\nmethod: lora\nmicro_batch_size: 8\n"
                    "seq_len: 4096\nhardware:\n  gpu: rtx-a6000\n")
    rc = main(["check", str(path)])
    assert rc == 1
    result = check(CheckOptions(files=(str(path),)))
    _patch(tmp_path, result.diffs[str(path)])
    cfg = load_run_config(path)
    assert cfg.effective_batch == 8 and check(CheckOptions(files=(str(path),))).within_budget


def test_config_that_fits_exits_0_without_a_diff(tmp_path, capsys):
    path = tmp_path / "small.yaml"
    path.write_text(LF_YAML.replace("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct")
                    .replace("per_device_train_batch_size: 8", "per_device_train_batch_size: 1"))
    rc = main(["check", str(path), "--gpu", "a100-80gb"])
    out = capsys.readouterr().out
    assert rc == 0 and "FITS" in out and "---" not in out


def run_cli(*argv):
    return subprocess.run([sys.executable, "-c", "import sys; from oomless.cli import main; "
                           "sys.exit(main(sys.argv[1:]))", *argv],
                          capture_output=True, text=True, timeout=120)


def test_unknown_keys_are_warnings_that_name_key_line_and_similar_keys(tmp_path):
    path = tmp_path / "lf.yaml"
    path.write_text(LF_YAML.replace("lora_target: all", "lora_target: all\nlogging_stpes: 16"))
    proc = run_cli("check", str(path), "--gpu", "4090")
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr
    assert f"{path}:9: unknown key 'logging_stpes'" in proc.stdout
    assert "similar: 'logging_steps'" in proc.stdout
    proc = run_cli("check", str(path), "--gpu", "4090", "--strict")
    assert proc.returncode == 2 and f"{path}:9: unknown key 'logging_stpes'" in proc.stderr
    # an unknown key that may change the method is not a warning: check cannot tell
    path.write_text(LF_YAML.replace("lora_target: all", "lora_target: all\nlora_rnak: 16"))
    proc = run_cli("check", str(path), "--gpu", "4090")
    assert proc.returncode == 2 and "can't tell the method: unknown key 'lora_rnak'" in proc.stderr
    assert "--method" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    ds = tmp_path / "ds.json"
    ds.write_text('{\n  "zero_optimization": {\n    "stage": 2,\n    "stagee": 3\n  }\n}\n')
    ta = tmp_path / "ta.json"
    ta.write_text('{"per_device_train_batch_size": 2}')
    proc = run_cli("check", str(ta), str(ds), "--gpu", "4090", "--model", "qwen2.5-0.5b-instruct",
                   "--strict")
    assert proc.returncode == 2 and f"{ds}:4: unknown key 'zero_optimization.stagee'" in proc.stderr


@pytest.mark.parametrize("text,argv,needle", [
    (GLM_SEED, ["--gpu", "4090"], "pass --model"),
    ("foo: 1\n", ["--gpu", "4090"], "cannot tell which tool"),
    (LF_YAML.replace("finetuning_type: lora", "finetuning_type: half"), ["--gpu", "4090"],
     "finetuning_type 'half'"),
    (LF_YAML, [], "needs the GPUs"),
    (LF_YAML.replace("bf16: true", "bf16: true\nflash_attn: fa9"), ["--gpu", "4090"],
     "flash_attn 'fa9'"),
])
def test_user_errors_exit_2(tmp_path, text, argv, needle):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    proc = run_cli("check", str(path), *argv)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr


def test_check_cli_is_torch_free_and_json(tmp_path):
    path = tmp_path / "lora.yaml"
    path.write_text(GLM_SEED)
    code = ("import sys, json, io, contextlib; from oomless.cli import main; buf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf):\n"
            f"    rc = main(['check', r'{path}', '--gpu', '4090', '--model', 'glm-4-9b-chat',"
            " '--json'])\n"
            "heavy = [m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules]\n"
            "print(json.dumps({'rc': rc, 'heavy': heavy, 'out': json.loads(buf.getvalue())}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=120)
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["rc"] == 1 and res["heavy"] == []
    assert res["out"]["oom_phase"] == "forward" and res["out"]["diffs"]


def test_stored_argument_names_match_the_installed_libraries():
    """The installed versions' argument names are exactly the keys whose stored version
    ranges end at the newest version read (the generator read the same releases)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from peft import LoraConfig
    from transformers import Seq2SeqTrainingArguments, TrainingArguments

    def newest(tool):
        last = K.latest_version(tool)
        return {k for k, ranges in K.TOOLS[tool]["keys"].items() if ranges.endswith(f"..{last}")}

    import transformers

    assert K.latest_version("transformers:TrainingArguments") == transformers.__version__
    ta = {f.name for f in dataclasses.fields(TrainingArguments) if f.init and f.name[0] != "_"}
    assert newest("transformers:TrainingArguments") == ta
    assert newest("transformers:Seq2SeqTrainingArguments") == {
        f.name for f in dataclasses.fields(Seq2SeqTrainingArguments) if f.init and f.name[0] != "_"}
    assert newest("peft:LoraConfig") == {f.name for f in dataclasses.fields(LoraConfig)
                                         if f.init and f.name[0] != "_"}
    zero = set(DeepSpeedZeroConfig.model_fields) | {
        f.alias for f in DeepSpeedZeroConfig.model_fields.values() if f.alias}
    assert set(K.TOOLS["deepspeed:zero_optimization"]["keys"]) == zero


@needs_patch
@pytest.mark.parametrize("old", ["a: 1\nb: 2", "a: 1\nb: 2\n"], ids=["no-final-newline", "newline"])
def test_a_diff_of_a_file_without_a_final_newline_applies(tmp_path, old):
    """A real recipe (alignment-handbook's sft_config_full.yaml) ends without a newline;
    a fix that appends a key after its last line must still apply with patch(1)."""
    from oomless.check.textedit import unified_diff

    (tmp_path / "f.yaml").write_text(old)
    new = old.rstrip("\n") + "\nc: 3\n"
    _patch(tmp_path, unified_diff(old, new, "f.yaml"))
    assert (tmp_path / "f.yaml").read_text() == new


def test_a_gpu_inside_the_band_is_tight_with_a_fix(capsys):
    """MoE-LLaVA's real stage-3 script (tests/fixtures/real_configs/moe-llava) on
    8 × A100-40GB: the predicted peak is under the GPU's memory, but the GPU lies inside
    the estimate's band, so the verdict is tight (exit 1), as `plan` would refuse it."""
    from pathlib import Path

    script = Path(__file__).parents[1] / "fixtures/real_configs/moe-llava/phi2_finetune_moe.sh"
    result = check(CheckOptions(files=(str(script),), gpu="a100-40gb x8"))
    assert result.low_bytes < result.gpu_memory_bytes < result.high_bytes
    assert result.oom_phase is None and result.verdict == "tight"
    assert result.exit_code == 1 and result.fix is not None
    assert result.to_dict()["high_bytes"] == result.high_bytes
    assert main(["check", str(script), "--gpu", "a100-40gb x8"]) == 1
    assert "TIGHT" in capsys.readouterr().out
