"""Several processes (gloo on CPU): an OOM on one rank changes every rank together."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from train_helpers import trained_state

from oomless.config import dump_run_config
from oomless.runtime.train.loop import train
from oomless.runtime.train.memlog import read_events, read_steps


def _torchrun(cfg_path, nproc=2, extra=()):
    env = {**os.environ, "OOMLESS_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "oomless", "train", str(cfg_path), "--no-progress", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def single_process(tiny_model_dir, tmp_path_factory):
    """One process, micro batch 4 x accumulation 2: effective batch 8."""
    from train_helpers import tiny_run_config

    out = tmp_path_factory.mktemp("single") / "run"
    return train(tiny_run_config(tiny_model_dir, out, **{"training.max_steps": 4})).run_dir


@pytest.mark.multirank
@pytest.mark.slow  # several processes or kill/resume: in CI's slow run
def test_oom_on_rank_1_halves_the_micro_batch_on_both_ranks(single_process, run_config,
                                                             tmp_path):
    # two processes x micro batch 2 x accumulation 2: the same effective batch of 8
    cfg = run_config("two", micro_batch_size=2, grad_accum=2,
                     **{"training.max_steps": 4,
                        "training.inject_oom": [{"step": 2, "rank": 1}]})
    path = tmp_path / "two.yaml"
    path.write_text(dump_run_config(cfg))
    _torchrun(path)
    run = tmp_path / "two"
    (event,) = [e for e in read_events(run) if e["event"] == "oom"]
    assert event["ranks"] == [1] and "rank 1" in event["error"]
    assert (event["micro_batch_before"], event["micro_batch_after"]) == (2, 1)
    steps = read_steps(run)
    assert [s["micro_batch_size_per_rank"] for s in steps] == [[2, 2], [1, 1], [1, 1], [1, 1]]
    # the global samples of each step and the trained weights equal the single process's
    single = read_steps(single_process)
    assert [s["label_tokens"] for s in steps] == [s["label_tokens"] for s in single]
    assert [s["loss"] for s in steps] == pytest.approx([s["loss"] for s in single], abs=1e-5)
    a, b = trained_state(single_process), trained_state(run)
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=1e-4)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("zero", [2, 3])
def test_deepspeed_zero_two_processes_oom_on_rank_1(single_process, run_config, tmp_path, zero):
    """DeepSpeed's ZeRO engine on gloo: the ranks agree before the backward collectives."""
    pytest.importorskip("deepspeed")
    cfg = run_config(f"zero{zero}", micro_batch_size=2, grad_accum=2, zero=zero,
                     **{"training.max_steps": 4,
                        "training.inject_oom": [{"step": 2, "rank": 1}]})
    path = tmp_path / "zero.yaml"
    path.write_text(dump_run_config(cfg))
    _torchrun(path)
    run = tmp_path / f"zero{zero}"
    (event,) = [e for e in read_events(run) if e["event"] == "oom"]
    assert event["ranks"] == [1]
    assert [s["micro_batch_size_per_rank"] for s in read_steps(run)][1:] == [[1, 1]] * 3
    assert (run / "checkpoints" / "step-000004" / "deepspeed").is_dir()
    a, b = trained_state(single_process), trained_state(run)
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=1e-4)


@pytest.mark.multirank
@pytest.mark.slow  # several processes or kill/resume: in CI's slow run
def test_fsdp_oom_on_rank_1_then_kill_and_resume(run_config, tmp_path):
    """FSDP2 on gloo: recovery, a checkpoint of sharded state, and --resume."""
    constant = {"training.lr_scheduler": "constant"}
    base = train(run_config("base", **constant, **{"training.max_steps": 4})).run_dir
    cfg = run_config("fsdp", micro_batch_size=2, grad_accum=2,
                     **constant, **{"training.engine": "fsdp", "training.max_steps": 2,
                                    "training.inject_oom": [{"step": 2, "rank": 1}]})
    path = tmp_path / "fsdp.yaml"
    path.write_text(dump_run_config(cfg))
    _torchrun(path)  # stops after step 2 with a checkpoint
    path.write_text(dump_run_config(cfg.replace(**{"training.max_steps": 4})))
    _torchrun(path, extra=["--resume"])
    run = tmp_path / "fsdp"
    assert [e["event"] for e in read_events(run)].count("oom") == 1
    assert [e["event"] for e in read_events(run)].count("resume") == 1
    steps = read_steps(run)
    assert [s["micro_batch_size_per_rank"] for s in steps] == [[2, 2], [1, 1], [1, 1], [1, 1]]
    assert [s["loss"] for s in steps] == pytest.approx([s["loss"] for s in read_steps(base)],
                                                        abs=1e-5)
    a, b = trained_state(base), trained_state(run)
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=1e-4)


def _multi_gpu_yaml(run_config, tmp_path, **overrides):
    cfg = run_config("multi", **{"hardware.gpu": "a100-80gb", "hardware.gpus_per_node": 4,
                                 **overrides})
    path = tmp_path / "multi.yaml"
    path.write_text(dump_run_config(cfg))
    return cfg, path


@pytest.mark.parametrize(("zero", "nodes", "engine", "dist_type"),
                         [(3, 2, "auto", "DEEPSPEED"), (2, 1, "auto", "DEEPSPEED"),
                          (0, 1, "auto", "MULTI_GPU"), (0, 1, "fsdp", "FSDP")])
def test_several_gpus_launch_accelerate_with_valid_files(run_config, tmp_path, capsys,
                                                         zero, nodes, engine, dist_type):
    from accelerate.commands.config.config_args import load_config_from_file

    from oomless.cli import main

    cfg, path = _multi_gpu_yaml(run_config, tmp_path, zero=zero,
                                **{"hardware.nodes": nodes, "training.engine": engine})
    argv = ["train", str(path), "--dry-run", "--resume", "--machine-rank", "1",
            "--main-process-ip", "10.0.0.1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "accelerate.commands.launch --config_file" in out
    assert out.strip().endswith(f"-m oomless train {path} --resume")
    run = tmp_path / "multi"
    acc = load_config_from_file(str(run / "accelerate.yaml"))  # accelerate's own parser
    assert (acc.distributed_type.value, acc.num_processes, acc.num_machines) == (
        dist_type, 4 * nodes, nodes)
    if dist_type == "DEEPSPEED":
        assert acc.deepspeed_config["deepspeed_config_file"] == str(run / "deepspeed.json")
    else:
        assert not (run / "deepspeed.json").exists()
    if dist_type == "FSDP":
        assert acc.fsdp_config["fsdp_version"] == 2


def test_deepspeed_json_is_accepted_by_deepspeed(run_config):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    from oomless.runtime.train.engines import deepspeed_config

    cfg = run_config(zero=3, offload="optimizer", precision="bf16", micro_batch_size=2)
    parsed = DeepSpeedConfig(deepspeed_config(cfg, world_size=1))  # world 1 outside a group
    assert (parsed.zero_optimization_stage, parsed.train_micro_batch_size_per_gpu,
            parsed.bfloat16_config.enabled) == (3, 2, True)
    assert parsed.zero_config.offload_optimizer.device == "cpu"
    assert deepspeed_config(cfg, world_size=8)["train_batch_size"] == 16


def test_multi_node_needs_the_main_address(run_config, tmp_path):
    from oomless.cli import main

    _, path = _multi_gpu_yaml(run_config, tmp_path, zero=3, **{"hardware.nodes": 2})
    assert main(["train", str(path), "--dry-run"]) == 2
