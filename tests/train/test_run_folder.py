"""A run folder belongs to one run: lock, run id, --start-over, and resume rules
(another configuration refused, a damaged or planted checkpoint skipped, logs cut
back to the checkpoint, torn lines repaired)."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from train_helpers import assert_same_run

from oomless.errors import ConfigError
from oomless.runtime.train import checkpoint as ckpt
from oomless.runtime.train.loop import TrainingInterrupted, train
from oomless.runtime.train.memlog import read_events, read_steps
from oomless.runtime.train.run_folder import RunFolder

# dropout > 0 so that the restored RNG state matters; a checkpoint every 2 steps
SETTINGS = {"training.max_steps": 6, "training.save_steps": 2, "lora.dropout": 0.1,
            "training.warmup_ratio": 0.2}


class Killed(BaseException):
    """Stands for kill -9 in-process: the loop stops with no checkpoint and no cleanup."""


def _kill_after(step):
    def hook(trainer, record):
        if record["step"] == step:
            raise Killed

    return hook


def _sigterm_at(step):
    def hook(trainer, record):
        if record["step"] == step:
            os.kill(os.getpid(), signal.SIGTERM)

    return hook


@pytest.fixture(scope="module")
def straight(tiny_model_dir, tmp_path_factory):
    """The uninterrupted run every interrupted one must equal."""
    from train_helpers import tiny_run_config

    out = tmp_path_factory.mktemp("straight") / "run"
    return train(tiny_run_config(tiny_model_dir, out, **SETTINGS))


def _assert_equal_runs(reference, run_dir):
    assert_same_run(reference, run_dir)


def test_a_new_run_refuses_a_folder_with_another_run_and_start_over_clears_it(
        straight, run_config):
    cfg = run_config("reused", **SETTINGS)
    with pytest.raises(Killed):
        train(cfg, on_step_end=_kill_after(5))  # an old run: checkpoints 2 and 4
    run_dir = cfg.training.output_dir
    with pytest.raises(ConfigError, match=r"holds another run \(checkpoints up to step-000004\)"
                                          r".*--resume.*--start-over"):
        train(cfg)
    with pytest.raises(Killed):
        train(cfg, start_over=True, on_step_end=_kill_after(3))  # new run: checkpoint 2 only
    names = sorted(p.name for p in RunFolder(run_dir).checkpoints.iterdir())
    assert names == ["step-000002"]  # the old run's step-000004 is gone
    resumed = train(cfg, resume=True)
    assert resumed.steps == 6
    _assert_equal_runs(straight, resumed.run_dir)
    run_ids = {e["run_id"] for e in read_events(resumed.run_dir)}
    assert len(run_ids) == 1  # every line of the folder is the new run's


def test_foreign_files_in_output_dir_are_refused(run_config, tmp_path):
    cfg = run_config("mine", **SETTINGS)
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("my notes")
    with pytest.raises(ConfigError, match=r"holds files that are not a training run's \(notes"):
        train(cfg, start_over=True)
    assert (folder / "notes.txt").read_text() == "my notes"


def test_a_second_run_in_a_locked_folder_exits_naming_the_first(run_config):
    cfg = run_config("locked", **SETTINGS)
    first = RunFolder(cfg.training.output_dir)
    first.claim(resume=False, start_over=False)
    try:
        with pytest.raises(ConfigError, match=rf"in use by another training run \(pid "
                                              rf"{os.getpid()} on "):
            train(cfg, start_over=True)
    finally:
        first.release()
    assert train(cfg, start_over=True).steps == 6  # released: the folder is free again


def test_resume_refuses_another_configuration_naming_the_difference(run_config):
    cfg = run_config("other", **SETTINGS)
    with pytest.raises(Killed):
        train(cfg, on_step_end=_kill_after(3))
    changed = cfg.replace(**{"lora.r": 8, "training.learning_rate": 1e-3})
    with pytest.raises(ConfigError, match=r"another configuration: lora\.r: 4 → 8; "
                                          r"training\.learning_rate: 0\.005 → 0\.001"):
        train(changed, resume=True)
    # where files go and how often they are written may change
    assert train(cfg.replace(**{"training.save_steps": 1}), resume=True).steps == 6


def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before(straight, run_config):
    cfg = run_config("damaged", **SETTINGS)
    with pytest.raises(Killed):
        train(cfg, on_step_end=_kill_after(5))
    root = RunFolder(cfg.training.output_dir).checkpoints
    weights = root / "step-000004" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = b"\xff" * 8  # a flipped tail: the file still loads, the manifest says no
    weights.write_bytes(bytes(data))
    (root / "step-000002" / ckpt.STATE).write_text('{"step": 2, "run_')  # torn
    with pytest.raises(ConfigError, match=r"(?s)no usable checkpoint.*step-000004: "
                                          r"'adapter_model.safetensors' differs.*step-000002: "
                                          r"'.*trainer_state.json' is unreadable"):
        train(cfg, resume=True)
    (root / "step-000002" / ckpt.STATE).unlink()  # a checkpoint without state is not listed
    with pytest.raises(ConfigError, match="step-000004"):
        train(cfg, resume=True)


def test_fallback_resume_is_exact(straight, run_config):
    cfg = run_config("fallback", **SETTINGS)
    with pytest.raises(Killed):
        train(cfg, on_step_end=_kill_after(5))
    state = RunFolder(cfg.training.output_dir).checkpoints / "step-000004" / "rng-rank0.pt"
    state.write_bytes(state.read_bytes()[:100])  # torn by a crash of the file system
    resumed = train(cfg, resume=True)
    (event,) = [e for e in read_events(resumed.run_dir) if e["event"] == "resume"]
    assert event["message"] == "resumed from step-000002"
    assert "step-000004: 'rng-rank0.pt' differs" in event["skipped_checkpoints"][0]
    _assert_equal_runs(straight, resumed.run_dir)


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('the payload ran')",))


def test_a_pickled_payload_in_a_checkpoint_never_runs(straight, run_config, tmp_path):
    marker = tmp_path / "pwned"
    probe = tmp_path / "probe.pt"
    torch.save(_Payload(marker), probe)
    torch.load(probe, weights_only=False)  # the payload is real: unsafe loading runs it
    assert marker.read_text() == "the payload ran"
    marker.unlink()

    cfg = run_config("planted", **SETTINGS)
    with pytest.raises(Killed):
        train(cfg, on_step_end=_kill_after(5))
    folder = RunFolder(cfg.training.output_dir).checkpoints / "step-000004"
    for name in ("scheduler.pt", "rng-rank0.pt", "optimizer.pt"):
        torch.save(_Payload(marker), folder / name)
    # the attacker rewrites the manifest too: only loading without code stops the payload
    manifest = {str(p.relative_to(folder)): [p.stat().st_size, ckpt.sha256_file(p)]
                for p in folder.rglob("*") if p.is_file() and p.name != ckpt.MANIFEST}
    (folder / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ckpt.CheckpointError, match="not plain saved state.*nothing in it was run"):
        ckpt.safe_load(folder / "optimizer.pt")
    resumed = train(cfg, resume=True)
    assert not marker.exists()
    (event,) = [e for e in read_events(resumed.run_dir) if e["event"] == "resume"]
    assert "not plain saved state" in event["skipped_checkpoints"][0]
    _assert_equal_runs(straight, resumed.run_dir)


def test_logs_are_cut_back_to_the_checkpoint_and_torn_lines_repaired(straight, run_config):
    inject = {"training.inject_oom": [{"step": 3, "rank": 0}]}
    cfg = run_config("torn", **SETTINGS, **inject)
    with pytest.raises(Killed):  # step 3 has its OOM and its memlog line, no checkpoint
        train(cfg, on_step_end=_kill_after(3))
    run_dir = cfg.training.output_dir
    for name in ("memlog.jsonl", "events.jsonl"):
        with open(os.path.join(run_dir, name), "a") as fh:
            fh.write('{"step": 3, "torn')  # a write cut by kill -9
    resumed = train(cfg, resume=True)
    events = read_events(resumed.run_dir)
    assert [e["event"] for e in events].count("oom") == 1  # step 3 redone: its OOM once
    assert [s["step"] for s in read_steps(resumed.run_dir)] == list(range(1, 7))
    for name in ("memlog.jsonl", "events.jsonl"):
        text = (resumed.run_dir / name).read_text()
        assert all(json.loads(line) for line in text.splitlines())  # nothing glued
    (resume,) = [e for e in events if e["event"] == "resume"]
    assert resume["dropped_log_lines"] == {"memlog.jsonl": 2, "events.jsonl": 2}


def test_sigterm_then_resume_keeps_the_first_loss(straight, run_config):
    cfg = run_config("term", **SETTINGS)
    with pytest.raises(TrainingInterrupted):
        train(cfg, on_step_end=_sigterm_at(3))
    resumed = train(cfg, resume=True)
    assert resumed.first_loss == pytest.approx(straight.losses[0], abs=1e-6)
    _assert_equal_runs(straight, resumed.run_dir)


def test_rich_markup_in_the_run_folder_is_printed_as_is(run_config, tmp_path, capsys):
    from oomless.cli import main
    from oomless.config import dump_run_config

    cfg = run_config("run[link=file:x]x[/link]", **{"training.max_steps": 1})
    path = tmp_path / "markup.yaml"
    path.write_text(dump_run_config(cfg))
    assert main(["train", str(path), "--no-progress"]) == 0
    out = capsys.readouterr().out.replace("\n", "")
    assert f"next: oomless report {cfg.training.output_dir}" in out


def test_cutting_logs_back_keeps_the_exits_that_ended_an_attempt(tmp_path):
    """A rank that ran out of memory at step 3 exited for a restart (oom_exit); the relaunch
    resumes from checkpoint-2 with another micro batch and does not redo that exit, so the
    event stays in the history the supervisor and the report read; a recovered in-process
    OOM at step 3 is redone and is dropped."""
    from oomless.runtime.train.memlog import EVENTS, truncate_after

    lines = [{"step": 2, "event": "checkpoint"}, {"step": 3, "event": "oom"},
             {"step": 3, "event": "oom_exit", "rank": 1}]
    (tmp_path / EVENTS).write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert truncate_after(tmp_path, 2) == {EVENTS: 1}
    assert [e["event"] for e in read_events(tmp_path)] == ["checkpoint", "oom_exit"]
