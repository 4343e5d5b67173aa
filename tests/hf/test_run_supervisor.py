"""`oomless run`: commands recognised, configurations read as check reads them, fixes
written into copies (the user's files byte-identical), and a script that dies of OOM
relaunched from its checkpoint to the same result as a run that never died."""

from __future__ import annotations

import json
import sys
from pathlib import Path

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

FIXTURES = Path(__file__).parents[1] / "fixtures" / "run"  # real files; README.md there


def lf_yaml() -> str:
    """LLaMA-Factory's examples/train_lora/llama3_lora_sft.yaml as a user edits it: micro
    batch 4 x accumulation 2 (its warmup_ratio is read as the transformers versions
    LLaMA-Factory runs on accept it)."""
    text = (FIXTURES / "llama3_lora_sft.yaml").read_text()
    return text.replace("per_device_train_batch_size: 1\ngradient_accumulation_steps: 8",
                        "per_device_train_batch_size: 4\ngradient_accumulation_steps: 2")


def _moe_llava_command(ds_path):
    """MoE-LLaVA's scripts/v1_5/qwen/finetune_moe.sh, its variables written out."""
    return ["deepspeed", "moellava/train/train_mem.py", "--moe_enable", "True",
            "--num_experts", "4", "--top_k_experts", "2", "--moe_mode", "sparse",
            "--use_residual", "False", "--router_aux_loss_coef", "0.01",
            "--train_modules", "fc1", "fc2", "wg", "--deepspeed", str(ds_path),
            "--model_name_or_path", "qwen1.5-1.8b", "--version", "phi",
            "--data_path", "ft_json/llava_image_tune_.json", "ft_json/nlp_tune.json",
            "--image_folder", "train_image_video",
            "--image_tower", "openai/clip-vit-large-patch14-336",
            "--image_projector_type", "mlp2x_gelu", "--mm_vision_select_layer", "-2",
            "--mm_use_im_start_end", "False", "--mm_use_im_patch_token", "False",
            "--image_aspect_ratio", "pad", "--group_by_modality_length", "True",
            "--bf16", "True", "--output_dir", "./checkpoints/llavaqwen-1.8b-finetune-moe",
            "--num_train_epochs", "1", "--per_device_train_batch_size", "8",
            "--per_device_eval_batch_size", "4", "--gradient_accumulation_steps", "2",
            "--evaluation_strategy", "no", "--save_strategy", "steps", "--save_steps", "24000",
            "--save_total_limit", "1", "--learning_rate", "2e-5", "--weight_decay", "0.",
            "--warmup_ratio", "0.03", "--lr_scheduler_type", "cosine", "--logging_steps", "1",
            "--tf32", "True", "--model_max_length", "2048", "--gradient_checkpointing", "True",
            "--dataloader_num_workers", "4", "--lazy_preprocess", "True",
            "--report_to", "tensorboard", "--cache_dir", "./cache_dir"]


def test_commands_are_recognised(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "lora.yaml"
    cfg.write_text((FIXTURES / "glm4_lora.yaml").read_text())
    (tmp_path / "ft_json").mkdir()
    (tmp_path / "ft_json" / "nlp_tune.json").write_text("[]")  # data, not a configuration
    lf = parse_command(["llamafactory-cli", "train", str(cfg), "learning_rate=1e-5"])
    assert (lf.launcher, lf.config_file) == ("llamafactory-cli", str(cfg))
    glm = parse_command(["torchrun", "--standalone", "--nnodes=1", "--nproc_per_node=8",
                         "finetune.py", "data/AdvertiseGen", "THUDM/glm-4-9b-chat", str(cfg)])
    assert (glm.launcher, glm.nproc, glm.script) == ("torchrun", 8, "finetune.py")
    assert is_glm_finetune(glm)
    ds = parse_command(_moe_llava_command("zero2.json"))
    assert (ds.launcher, ds.script, ds.config_file) == ("deepspeed", "moellava/train/train_mem.py",
                                                        None)
    assert ds.flag("gradient_accumulation_steps") == "2" and ds.flag("deepspeed") == "zero2.json"
    eq = parse_command(["torchrun", "--nproc-per-node", "4", "train.py",
                        "--per_device_train_batch_size=8"])
    assert eq.nproc == 4
    assert eq.argv[eq.flags["per_device_train_batch_size"]] == "--per_device_train_batch_size=8"
    acc = parse_command(["python", "-m", "accelerate.commands.launch", "--num_processes", "2",
                         "train.py", "--output_dir=out"])
    assert (acc.launcher, acc.nproc, acc.flag("output_dir")) == ("accelerate", 2, "--output_dir=out")
    assert parse_command(["bash", "train.sh"]).launcher == "other"


def _training_oom_log():
    return ("Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n"
           "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
           "total capacity of 23.65 GiB of which 1.06 GiB is free.\n")


@pytest.mark.parametrize("kind", ["llamafactory", "hf-args"])
def test_the_fix_goes_into_a_copy(kind, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if kind == "llamafactory":
        (tmp_path / "lf.yaml").write_text(lf_yaml())
        argv = ["llamafactory-cli", "train", "lf.yaml"]
        micro, accum, originals = 4, 2, {"lf.yaml": lf_yaml()}
    else:
        ds_text = (FIXTURES / "zero2_offload.json").read_text()
        (tmp_path / "zero2.json").write_text(ds_text)
        argv = _moe_llava_command("zero2.json")
        micro, accum, originals = 8, 2, {"zero2.json": ds_text}
    view = read_view(parse_command(argv), model="qwen2.5-1.5b-instruct")
    assert view.kind == kind and view.cfg.micro_batch_size == micro
    change = choose_change(view, diagnose_log(_training_oom_log(), view), [])
    assert change.changes == {"micro_batch_size": micro // 2, "grad_accum": accum * 2}
    command, diffs = write_change(view, change, tmp_path / "run" / "attempt-2")
    assert diffs
    for name, text in originals.items():  # the user's files, byte for byte
        assert (tmp_path / name).read_text() == text
    after = read_view(command, model="qwen2.5-1.5b-instruct")  # reads back with the change
    assert (after.cfg.micro_batch_size, after.cfg.grad_accum) == (micro // 2, accum * 2)
    if kind == "llamafactory":
        copy = tmp_path / "run" / "attempt-2" / "lf.yaml"
        assert command.config_file == str(copy) and "### train" in copy.read_text()
    else:  # the flags changed; the DeepSpeed file says "auto" and is left alone
        assert command.flag("per_device_train_batch_size") == "4"
        assert command.flag("deepspeed") == "zero2.json"
        changed = [(a, b) for a, b in zip(argv, command.argv, strict=True) if a != b]
        assert changed == [("8", "4"), ("2", "4")]  # only the two values, in place


def test_glm4_config_with_one_row_per_micro_batch(tmp_path, monkeypatch):
    """GLM-4's own lora.yaml trains one row per micro batch with checkpointing always on:
    a training OOM has no fix that keeps the effective batch; an evaluation OOM halves the
    evaluation batch, in a copy that keeps the file's comments."""
    monkeypatch.chdir(tmp_path)
    original = (FIXTURES / "glm4_lora.yaml").read_text()
    (tmp_path / "lora.yaml").write_text(original)
    view = read_view(parse_command(["python", "finetune.py", "data/AdvertiseGen",
                                    "glm-4-9b-chat", "lora.yaml"]))
    assert view.kind == "glm4" and view.cfg.micro_batch_size == 1 and view.cfg.grad_ckpt
    assert choose_change(view, diagnose_log(_training_oom_log(), view), []) is None
    events = [{"event": "oom_exit", "phase": "eval", "eval_batch_after": 2}]
    change = choose_change(view, diagnose_log("", view), events)
    assert change == Change({"eval.batch_size": 2}, "eval batch 4 -> 2", "eval")
    command, _ = write_change(view, change, tmp_path / "copy")
    assert read_view(command).cfg.eval.batch_size == 2
    assert "# settings for evaluation" in (tmp_path / "copy" / "lora.yaml").read_text()
    assert (tmp_path / "lora.yaml").read_text() == original


def test_auto_fit_starts_with_the_checks_fix(tmp_path, monkeypatch):
    from oomless.runtime.supervise.supervisor import RunOptions, Supervisor

    monkeypatch.chdir(tmp_path)
    (tmp_path / "lf.yaml").write_text(lf_yaml())
    sup = Supervisor(RunOptions(["llamafactory-cli", "train", "lf.yaml"], auto_fit=True,
                                gpu="rtx-4090", model="llama-3.1-8b-instruct",
                                run_dir=str(tmp_path / "run")))
    sup.start()
    (check,) = read_events(tmp_path / "run", "check")
    assert check["checked"] and not check["fits"]
    (fit,) = read_events(tmp_path / "run", "auto_fit")
    cfg = sup.view.cfg
    assert cfg.micro_batch_size * cfg.grad_accum == 8 and cfg.micro_batch_size < 4
    assert fit["changes"]["micro_batch_size"] == cfg.micro_batch_size
    assert sup.command.config_file.endswith("attempt-1/lf.yaml")
    assert (tmp_path / "lf.yaml").read_text() == lf_yaml()


@pytest.fixture(scope="module")
def never_died(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("never")
    args_file = root / "args.json"
    args_file.write_text(json.dumps(script_args(tiny_model_dir, root / "out", max_steps=5)))
    proc = run_script(args_file, child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "out"


@pytest.mark.slow  # several processes or kill/resume: in CI's slow run
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


@pytest.mark.multirank
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


@pytest.mark.slow
def test_a_deepspeed_run_exits_for_a_restart_and_is_relaunched(tiny_model_dir, tmp_path,
                                                              monkeypatch):
    """HF Trainer under DeepSpeed ZeRO-2 (CPU): the OOM ends the process with 75, the
    supervisor relaunches with micro batch 1 from checkpoint-1 ("auto" DeepSpeed values
    follow the TrainingArguments), and the result equals a DeepSpeed run that never died."""
    pytest.importorskip("deepspeed")
    from oomless.cli import main

    deepspeed = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
                 "gradient_accumulation_steps": "auto", "train_batch_size": "auto"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=1", str(SCRIPT)]
    results = {}
    for name, inject in (("never", ""), ("died", "train:2")):
        args = script_args(tiny_model_dir, tmp_path / name, max_steps=3, save_strategy="steps",
                           save_steps=1, per_device_train_batch_size=2, deepspeed=deepspeed)
        args_file = tmp_path / f"{name}.json"
        args_file.write_text(json.dumps(args))
        for key, value in child_env(OOMLESS_INJECT_OOM=inject).items():
            monkeypatch.setenv(key, value)
        assert main(["run", "--", *launcher, str(args_file)]) == 0
        results[name] = tmp_path / name
    run = results["died"] / "oomless"
    (exit_event,) = read_events(run, "oom_exit")
    assert (exit_event["engine"], exit_event["step"]) == ("deepspeed", 2)
    (restart,) = read_events(run, "restart")
    assert restart["changes"] == {"micro_batch_size": 1, "grad_accum": 4}
    assert read_events(run, "relaunch")[0]["checkpoint"].endswith("checkpoint-1")
    assert_same_weights(final_weights(results["never"]), final_weights(results["died"]))
