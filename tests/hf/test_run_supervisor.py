"""`oomless run`: commands recognised, configurations read as check reads them, fixes
written into copies (the user's files byte-identical), and a script that dies of OOM
relaunched from its checkpoint to the same result as a run that never died."""

from __future__ import annotations

import json
import sys

import pytest
from hf_helpers import assert_same_weights, read_events
from test_protect_distributed import SCRIPT, child_env, final_weights, run_script, script_args

from oomless.runtime.supervise.command import is_glm_finetune, parse_command
from oomless.runtime.supervise.configs import (
    Change,
    choose_change,
    diagnose_log,
    read_view,
    write_change,
)
from oomless.runtime.train.memlog import read_steps

# A LLaMA-Factory example configuration (examples/train_lora/llama3_lora_sft.yaml shape)
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

### output
output_dir: saves/qwen-7b/lora/sft

### train
per_device_train_batch_size: 8
gradient_accumulation_steps: 2
learning_rate: 1.0e-4
bf16: true
"""

# GLM-4 finetune_demo/configs/lora.yaml (the seed's values)
GLM_YAML = """\
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

# MoE-LLaVA's scripts/zero2.json
ZERO2 = {"zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                               "reduce_bucket_size": "auto"},
         "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto",
         "gradient_accumulation_steps": "auto", "train_batch_size": "auto"}


def _moe_llava_command(ds_path):
    return ["deepspeed", "--num_gpus", "8", "moellava/train/train_mem.py",
            "--deepspeed", str(ds_path), "--model_name_or_path", "qwen2.5-7b-instruct",
            "--version", "qwen", "--data_path", "llava_image_tune_.json",
            "--output_dir", "./checkpoints/moe-llava", "--bf16", "True",
            "--per_device_train_batch_size=8", "--gradient_accumulation_steps", "2",
            "--gradient_checkpointing", "True", "--learning_rate", "2e-5"]


def test_commands_are_recognised(tmp_path):
    cfg = tmp_path / "lora.yaml"
    cfg.write_text(GLM_YAML)
    lf = parse_command(["llamafactory-cli", "train", str(cfg), "learning_rate=1e-5"])
    assert (lf.launcher, lf.config_file) == ("llamafactory-cli", str(cfg))
    glm = parse_command(["torchrun", "--standalone", "--nnodes=1", "--nproc_per_node=8",
                         "finetune.py", "data/AdvertiseGen", "THUDM/glm-4-9b-chat", str(cfg)])
    assert (glm.launcher, glm.nproc, glm.script) == ("torchrun", 8, "finetune.py")
    assert is_glm_finetune(glm)
    ds = parse_command(_moe_llava_command(tmp_path / "zero2.json"))
    assert (ds.launcher, ds.nproc, ds.script) == ("deepspeed", 8, "moellava/train/train_mem.py")
    assert ds.flag("gradient_accumulation_steps") == "2"
    assert ds.argv[ds.flags["per_device_train_batch_size"]] == "--per_device_train_batch_size=8"
    acc = parse_command(["python", "-m", "accelerate.commands.launch", "--num_processes", "2",
                         "train.py", "--output_dir=out"])
    assert (acc.launcher, acc.nproc, acc.flag("output_dir")) == ("accelerate", 2, "--output_dir=out")
    assert parse_command(["bash", "train.sh"]).launcher == "other"


def _training_oom_log():
    return ("Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n"
           "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
           "total capacity of 23.65 GiB of which 1.06 GiB is free.\n")


@pytest.mark.parametrize("kind", ["llamafactory", "glm4", "hf-args"])
def test_the_fix_goes_into_a_copy(kind, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if kind == "llamafactory":
        (tmp_path / "lf.yaml").write_text(LF_YAML)
        argv = ["llamafactory-cli", "train", "lf.yaml"]
        micro, accum, original = 8, 2, {"lf.yaml": LF_YAML}
    elif kind == "glm4":
        (tmp_path / "lora.yaml").write_text(GLM_YAML)
        argv = ["python", "finetune.py", "data", "glm-4-9b-chat", "lora.yaml"]
        micro, accum, original = 4, 1, {"lora.yaml": GLM_YAML}
    else:
        (tmp_path / "zero2.json").write_text(json.dumps(ZERO2, indent=2))
        argv = _moe_llava_command("zero2.json")
        micro, accum, original = 8, 2, {"zero2.json": json.dumps(ZERO2, indent=2)}
    view = read_view(parse_command(argv))
    assert view.kind == kind and view.cfg.micro_batch_size == micro
    change = choose_change(view, diagnose_log(_training_oom_log(), view), [])
    assert change.changes["micro_batch_size"] * change.changes["grad_accum"] == micro * accum
    assert change.changes["micro_batch_size"] < micro
    command, diffs = write_change(view, change, tmp_path / "run" / "attempt-2")
    assert diffs
    for name, text in original.items():  # the user's files, byte for byte
        assert (tmp_path / name).read_text() == text
    after = read_view(command)  # the new command reads back with the change
    assert after.cfg.micro_batch_size == change.changes["micro_batch_size"]
    assert after.cfg.grad_accum == change.changes["grad_accum"]
    if kind != "hf-args":
        copy = tmp_path / "run" / "attempt-2" / list(original)[0]
        assert command.config_file == str(copy)
        assert "### train" in copy.read_text() or "# see `transformers" in copy.read_text()


def test_eval_oom_changes_only_the_eval_batch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lora.yaml").write_text(GLM_YAML)
    view = read_view(parse_command(["python", "finetune.py", "data", "glm-4-9b-chat",
                                    "lora.yaml"]))
    events = [{"event": "eval_oom", "phase": "eval", "eval_batch_after": 4}]
    change = choose_change(view, diagnose_log("", view), events)
    assert change == Change({"eval.batch_size": 4}, "eval batch 16 -> 4", "eval")
    command, _ = write_change(view, change, tmp_path / "copy")
    after = read_view(command)
    assert (after.cfg.eval.batch_size, after.cfg.micro_batch_size) == (4, 4)


def test_auto_fit_starts_with_the_checks_fix(tmp_path, monkeypatch):
    from oomless.runtime.supervise.supervisor import RunOptions, Supervisor

    monkeypatch.chdir(tmp_path)
    (tmp_path / "lf.yaml").write_text(LF_YAML)
    sup = Supervisor(RunOptions(["llamafactory-cli", "train", "lf.yaml"], auto_fit=True,
                                gpu="rtx-4090", run_dir=str(tmp_path / "run")))
    sup.start()
    (check,) = read_events(tmp_path / "run", "check")
    assert check["checked"] and not check["fits"]
    (fit,) = read_events(tmp_path / "run", "auto_fit")
    cfg = sup.view.cfg
    assert cfg.micro_batch_size * cfg.grad_accum == 16 and cfg.micro_batch_size < 8
    assert sup.command.config_file.endswith("attempt-1/lf.yaml")
    assert (tmp_path / "lf.yaml").read_text() == LF_YAML


@pytest.fixture(scope="module")
def never_died(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("never")
    args_file = root / "args.json"
    args_file.write_text(json.dumps(script_args(tiny_model_dir, root / "out", max_steps=5)))
    proc = run_script(args_file, child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "out"


def test_a_script_that_dies_of_oom_is_relaunched_from_its_checkpoint(
        never_died, tiny_model_dir, tmp_path, monkeypatch):
    from oomless.cli import main

    # the simulated GPU holds 2 rows per micro batch from step 3 on; checkpoint every step
    args = script_args(tiny_model_dir, tmp_path / "out", max_steps=5, save_strategy="steps",
                       save_steps=1, simulate_gpu_rows=2, simulate_from_step=3)
    args_file = tmp_path / "args.json"
    text = json.dumps(args, indent=2)
    args_file.write_text(text)
    for key, value in child_env().items():
        monkeypatch.setenv(key, value)
    rc = main(["run", "--max-restarts", "2", "--", sys.executable, str(SCRIPT), str(args_file)])
    assert rc == 0
    assert args_file.read_text() == text  # the user's configuration, byte for byte
    run = tmp_path / "out" / "oomless"
    kinds = [e["event"] for e in read_events(run)]
    assert kinds.count("oom_died") == 1 and kinds.count("finished") == 1
    (restart,) = read_events(run, "restart")
    assert restart["changes"] == {"micro_batch_size": 2, "grad_accum": 4}
    (relaunch,) = read_events(run, "relaunch")
    assert relaunch["checkpoint"].endswith("checkpoint-2")
    copy = json.loads((run / "configs" / "attempt-2" / "args.json").read_text())
    assert (copy["per_device_train_batch_size"], copy["gradient_accumulation_steps"]) == (2, 4)
    assert "CUDA out of memory" in (run / "attempt-1.log").read_text()
    begins = read_events(run, "train_begin")
    assert [b["resumed"] for b in begins] == [False, True]
    assert [s["step"] for s in read_steps(run)] == [1, 2, 3, 4, 5]
    assert (run / "report.html").is_file()
    assert_same_weights(final_weights(never_died), final_weights(tmp_path / "out"))


def test_a_failure_that_is_not_an_oom_is_not_restarted(tmp_path, monkeypatch):
    from oomless.runtime.supervise import RunOptions, supervise

    monkeypatch.chdir(tmp_path)
    script = tmp_path / "broken.py"
    script.write_text("raise ValueError('the dataset has no column text')\n")
    result = supervise(RunOptions([sys.executable, str(script)], report=False, echo=False))
    assert result.returncode == 1 and result.attempts == 1
    (failed,) = read_events(tmp_path / "oomless-run", "failed")
    assert "no out-of-memory error" in failed["message"]


@pytest.mark.slow
def test_a_torchrun_job_that_exits_for_a_restart_is_relaunched(never_died, tiny_model_dir,
                                                               tmp_path, monkeypatch):
    """Two ranks; rank 1 runs out of memory after its backward at step 3 (not recoverable
    in-process with two ranks): it exits 75, torchrun stops the job, the supervisor relaunches
    with micro batch 1 from checkpoint-2, and the result equals one process that never died."""
    from oomless.cli import main

    args = script_args(tiny_model_dir, tmp_path / "out", max_steps=5, save_strategy="steps",
                       save_steps=1, per_device_train_batch_size=2)
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps(args))
    for key, value in child_env(OOMLESS_INJECT_OOM="train:3:1:1:backward").items():
        monkeypatch.setenv(key, value)
    rc = main(["run", "--", sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", str(SCRIPT), str(args_file)])
    assert rc == 0
    run = tmp_path / "out" / "oomless"
    (exit_event,) = read_events(run, "oom_exit")
    assert (exit_event["rank"], exit_event["step"]) == (1, 3)
    (restart,) = read_events(run, "restart")
    assert restart["changes"] == {"micro_batch_size": 1, "grad_accum": 4}
    assert read_events(run, "relaunch")[0]["checkpoint"].endswith("checkpoint-2")
    assert_same_weights(final_weights(never_died), final_weights(tmp_path / "out"))


def test_the_entry_points_leave_torch_out():
    import subprocess

    code = ("import sys, oomless.hf, oomless.runtime.supervise, oomless.runtime.protect.bootstrap;"
            "from oomless.cli import build_parser; build_parser();"
            "print(sorted(m for m in ('torch', 'transformers', 'trl') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=child_env())
    assert out.stdout.strip() == "[]"
