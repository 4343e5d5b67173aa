"""Helpers shared by the training tests (imported by name: tests/train is on sys.path)."""

from __future__ import annotations


def tiny_run_config(model_dir, out_dir, **overrides):
    """A fast LoRA run of the tiny model on the shipped demo data (fp32, CPU)."""
    from oomless.config import RunConfig
    from oomless.runtime.tiny import demo_data_path

    data = {
        "model": str(model_dir), "method": "lora", "precision": "fp32",
        "micro_batch_size": 4, "grad_accum": 2, "seq_len": 64,
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"train_file": str(demo_data_path())},
        "training": {"max_steps": 6, "learning_rate": 5e-3, "warmup_ratio": 0.0,
                     "output_dir": str(out_dir), "seed": 7},
    }
    for key, value in overrides.items():
        target = data
        *parents, leaf = key.split(".")
        for p in parents:
            target = target.setdefault(p, {})
        target[leaf] = value
    return RunConfig.model_validate(data)


def trained_state(run_dir):
    """The final adapter weights of a run folder, as a dict of tensors."""
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "adapter_model.safetensors"))


def assert_same_run(reference, run_dir, atol=1e-6):
    """``run_dir`` trained what the uninterrupted ``reference`` run did: each step once,
    the same samples and losses, the same final adapter, the same first loss."""
    import json

    import pytest
    import torch

    from oomless.runtime.train.memlog import read_steps

    steps = read_steps(run_dir)
    assert [s["step"] for s in steps] == list(range(1, len(reference.losses) + 1))
    assert [s["samples"] for s in steps] == [s["samples"] for s in read_steps(reference.run_dir)]
    assert [s["loss"] for s in steps] == pytest.approx(reference.losses, abs=atol)
    want, got = trained_state(reference.run_dir), trained_state(run_dir)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=atol, rtol=max(atol * 10, 1e-5))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["first_loss"] == pytest.approx(reference.losses[0], abs=atol)
