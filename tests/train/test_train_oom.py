"""OOM recovery: same samples, same losses, same weights as a run without the OOM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from train_helpers import trained_state

from oomless.runtime.train.loop import train
from oomless.runtime.train.memlog import read_events, read_steps
from oomless.runtime.train.oom import TrainingOOMError

STEPS = {"training.max_steps": 5}


def _assert_same_training(run_a, run_b, atol=1e-5):
    steps_a, steps_b = read_steps(run_a), read_steps(run_b)
    assert [s["samples"] for s in steps_a] == [s["samples"] for s in steps_b]
    assert [s["label_tokens"] for s in steps_a] == [s["label_tokens"] for s in steps_b]
    assert [s["loss"] for s in steps_b] == pytest.approx([s["loss"] for s in steps_a], abs=atol)
    a, b = trained_state(run_a), trained_state(run_b)
    assert set(a) == set(b)
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=atol, rtol=1e-4)


@pytest.fixture(scope="module")
def baseline(tiny_model_dir, tmp_path_factory):
    """Uninterrupted run: micro batch 4 x accumulation 2 (effective batch 8)."""
    from train_helpers import tiny_run_config

    out = tmp_path_factory.mktemp("baseline")
    return train(tiny_run_config(tiny_model_dir, out / "run", **STEPS,
                                 **{"training.memory_budget_gb": 64})).run_dir


def test_injected_oom_redoes_the_step_with_half_the_micro_batch(baseline, run_config):
    cfg = run_config(**STEPS, **{"training.inject_oom": [{"step": 2, "rank": 0}]})
    result = train(cfg)
    (event,) = [e for e in read_events(result.run_dir) if e["event"] == "oom"]
    assert (event["step"], event["micro_batch_before"], event["micro_batch_after"],
            event["grad_accum_after"], event["effective_batch"]) == (2, 4, 2, 4, 8)
    assert "fault injection" in event["error"]
    steps = read_steps(result.run_dir)
    assert [s["micro_batch_size"] for s in steps] == [4, 2, 2, 2, 2]
    assert [s["grad_accum"] for s in steps] == [2, 4, 4, 4, 4]
    _assert_same_training(baseline, result.run_dir)


def test_equal_to_a_run_started_with_the_smaller_micro_batch(baseline, run_config):
    smaller = train(run_config(micro_batch_size=2, grad_accum=4, **STEPS))
    _assert_same_training(baseline, smaller.run_dir)


def test_oom_in_the_first_micro_batch_and_repeated_ooms(baseline, run_config):
    inject = [{"step": 1, "micro_index": 0, "times": 2}, {"step": 4, "micro_index": 1}]
    result = train(run_config(**STEPS, **{"training.inject_oom": inject}))
    ooms = [(e["step"], e["micro_batch_before"], e["micro_batch_after"])
            for e in read_events(result.run_dir) if e["event"] == "oom"]
    assert ooms == [(1, 4, 2), (1, 2, 1), (4, 1, 1)]
    assert result.grad_ckpt  # micro batch 1 could not shrink: checkpointing switched on
    _assert_same_training(baseline, result.run_dir)


def test_oom_at_micro_batch_one_with_checkpointing_stops_with_a_diagnosis(run_config):
    cfg = run_config(micro_batch_size=1, grad_accum=8, grad_ckpt=True,
                     **{"training.inject_oom": [{"step": 2}]})
    with pytest.raises(TrainingOOMError, match=r"(?s)step 2 even with micro batch 1.*fixes:"):
        train(cfg)
    last = read_events(Path(cfg.training.output_dir))[-1]
    assert last["event"] == "oom_unrecoverable"


def test_simulated_budget_triggers_a_real_recovery(baseline, run_config):
    peak_4 = max(s["simulated_peak_bytes"] for s in read_steps(baseline))
    small = train(run_config("small", micro_batch_size=2, grad_accum=4, **STEPS,
                             **{"training.memory_budget_gb": 64}))
    peak_2 = max(s["simulated_peak_bytes"] for s in read_steps(small.run_dir))
    assert peak_2 < peak_4
    budget_gb = (peak_2 + peak_4) / 2 / 2**30
    result = train(run_config("budget", **STEPS, **{"training.memory_budget_gb": budget_gb}))
    (event,) = [e for e in read_events(result.run_dir) if e["event"] == "oom"]
    assert "simulated GPU budget exceeded" in event["error"]
    assert event["micro_batch_after"] == 2
    assert max(s["simulated_peak_bytes"] for s in read_steps(result.run_dir)) <= budget_gb * 2**30
    _assert_same_training(baseline, result.run_dir)


def test_eval_oom_halves_only_the_eval_batch(run_config):
    from oomless.runtime.tiny import demo_data_path

    common = {"data.eval_file": str(demo_data_path()), "eval.batch_size": 40,
              "training.max_steps": 2}
    clean = train(run_config("clean", **common))
    hit = train(run_config("hit", **common,
                           **{"training.inject_oom": [{"step": 1, "phase": "eval",
                                                       "micro_index": 2}]}))
    (event,) = [e for e in read_events(hit.run_dir) if e["event"] == "eval_oom"]
    assert (event["eval_batch_before"], event["eval_batch_after"]) == (40, 20)
    assert [s["micro_batch_size"] for s in read_steps(hit.run_dir)] == [4, 4]
    assert hit.eval_losses == pytest.approx(clean.eval_losses, abs=1e-5)


def test_injection_for_another_rank_does_not_fire(run_config):
    result = train(run_config(**{"training.max_steps": 2,
                                 "training.inject_oom": [{"step": 1, "rank": 1}]}))
    assert not [e for e in read_events(result.run_dir) if e["event"] == "oom"]


def test_oom_after_gradients_were_written_drops_them_and_redoes_the_step(baseline, run_config):
    inject = [{"step": 3, "micro_index": 1, "during": "backward"}]
    result = train(run_config(**STEPS, **{"training.inject_oom": inject}))
    (event,) = [e for e in read_events(result.run_dir) if e["event"] == "oom"]
    assert event["step"] == 3 and "after backward" in event["error"]
    _assert_same_training(baseline, result.run_dir)  # no gradient counted twice
