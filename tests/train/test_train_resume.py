"""Kill and resume: SIGTERM writes a checkpoint; --resume continues exactly."""

from __future__ import annotations

import os
import signal

import pytest
from train_helpers import assert_same_run

from oomless.errors import ConfigError
from oomless.runtime.train.checkpoint import latest_checkpoint, read_state
from oomless.runtime.train.loop import TrainingInterrupted, train

# LoRA dropout > 0 so that the restored RNG state matters
SETTINGS = {"training.max_steps": 7, "lora.dropout": 0.1, "training.lr_scheduler": "cosine",
            "training.warmup_ratio": 0.2}


def _sigterm_at(step):
    def hook(trainer, record):
        if record["step"] == step:
            os.kill(os.getpid(), signal.SIGTERM)

    return hook


def test_sigterm_checkpoint_then_resume_equals_an_uninterrupted_run(run_config):
    straight = train(run_config("straight", **SETTINGS))

    cfg = run_config("killed", **SETTINGS)
    with pytest.raises(TrainingInterrupted, match="stopped at step 3/7.*--resume"):
        train(cfg, on_step_end=_sigterm_at(3))
    folder = latest_checkpoint(cfg_dir := straight.run_dir.parent / "killed")
    state = read_state(folder)
    assert (folder.name, state["step"], state["data_position"]["samples_consumed"]) == (
        "step-000003", 3, 24)
    assert {"optimizer.pt", "scheduler.pt", "rng-rank0.pt", "adapter_model.safetensors"} <= {
        p.name for p in folder.iterdir()}
    assert not list((cfg_dir / "checkpoints").glob(".*"))  # no temporary folder left

    resumed = train(cfg, resume=True)
    assert resumed.steps == 7
    assert_same_run(straight, cfg_dir)


def test_periodic_checkpoints_and_pruning(run_config):
    result = train(run_config(**{"training.max_steps": 4, "training.save_steps": 1,
                                 "training.save_total_limit": 2}))
    names = sorted(p.name for p in (result.run_dir / "checkpoints").iterdir())
    assert names == ["step-000003", "step-000004"]


def test_resume_without_checkpoint_or_with_other_batch_is_refused(run_config):
    cfg = run_config("fresh", **{"training.max_steps": 2})
    with pytest.raises(ConfigError, match="no checkpoint"):
        train(cfg, resume=True)
    train(cfg)
    other = run_config("fresh", grad_accum=3, **{"training.max_steps": 3})
    with pytest.raises(ConfigError, match="different data size or effective batch"):
        train(other, resume=True)
