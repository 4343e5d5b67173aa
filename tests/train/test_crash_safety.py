"""Kill `oomless train` (kill -9 or SIGTERM) at chosen and at random moments — inside a
checkpoint write, while the final weights are published, anywhere — then continue as
a user would (--resume; --start-over when there is nothing to resume). Every run
must end equal to an uninterrupted one (steps, samples, losses, one OOM event, the
final adapter), or stop with a clear refusal: never a wrong model. Two runs started
into one folder: one trains, the other exits 2 naming it."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_helpers import assert_same_run, tiny_run_config

from oomless.config import dump_run_config
from oomless.runtime.train.loop import train
from oomless.runtime.train.memlog import read_events

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
SETTINGS = {"training.max_steps": STEPS, "training.save_steps": 2, "lora.dropout": 0.1,
            "training.warmup_ratio": 0.2, "training.inject_oom": [{"step": 5, "rank": 0}]}

# Runs `oomless train` and, when KILL_AT="module:function:N" is set, kills the process
# with SIGKILL as the N-th call of that function starts: a crash at an exact point of
# a checkpoint or of the final write.
RUNNER = '''
import importlib, os, signal, sys
point = os.environ.get("KILL_AT")
if point:
    module_name, name, nth = point.split(":")
    module = importlib.import_module(module_name)
    original, calls = getattr(module, name), [0]
    def killer(*args, **kwargs):
        calls[0] += 1
        if calls[0] == int(nth):
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)
    setattr(module, name, killer)
from oomless.cli import main
sys.exit(main(sys.argv[1:]))
'''
CKPT = "oomless.runtime.train.checkpoint"
FOLDER = "oomless.runtime.train.run_folder"


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "run"
    return train(tiny_run_config(tiny_model_dir, out, **SETTINGS))


def _env(kill_at: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("KILL_AT", None)
    if kill_at:
        env["KILL_AT"] = kill_at
    return env


def _start(cfg_file: Path, flags: list[str], kill_at: str | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RUNNER, "train", str(cfg_file),
                             "--no-progress", *flags], env=_env(kill_at), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _next_flags(run_dir: Path, last_err: str) -> list[str]:
    """What a user does next: --resume, or --start-over when nothing can be resumed."""
    if "no checkpoint" in last_err or not (run_dir / "run.json").is_file():
        return ["--start-over"]
    return ["--resume"]


def _train_through(cfg_file: Path, run_dir: Path, interruptions: list) -> list[int]:
    """Run until a run finishes; each planned interruption is a kill point (str) or a
    (signal, seconds after start) pair. A refusal (exit 2) is answered as a user would
    and does not use up an interruption. Returns the exit codes."""
    codes, flags, pending = [], ["--start-over"], list(interruptions)
    for _attempt in range(len(interruptions) + 6):
        plan = pending[0] if pending else None
        proc = _start(cfg_file, flags, plan if isinstance(plan, str) else None)
        if isinstance(plan, tuple):
            sig, delay = plan
            try:
                proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                proc.send_signal(sig)
        _, err = proc.communicate(timeout=600)
        codes.append(proc.returncode)
        assert "Traceback" not in err, err[-3000:]
        if proc.returncode == 0:
            return codes  # finished (also when an interruption came too late to matter)
        # killed (-9), stopped by SIGTERM with a checkpoint (130) or before its handler
        # was installed (-15), or refused (2) with what to do next
        assert proc.returncode in (-signal.SIGKILL, -signal.SIGTERM, 130, 2), err[-3000:]
        if proc.returncode == 2:
            assert "no checkpoint" in err or "--start-over" in err, err[-3000:]
        elif pending:
            pending.pop(0)
        flags = _next_flags(run_dir, err)
    pytest.fail(f"the run never finished: exit codes {codes}")


def _assert_equals_reference(reference, run_dir: Path) -> None:
    assert_same_run(reference, run_dir, atol=1e-5)  # another process: other thread counts
    assert [e["event"] for e in read_events(run_dir)].count("oom") == 1
    assert len({e["run_id"] for e in read_events(run_dir)}) == 1
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == STEPS
    leftovers = [p.name for p in [*run_dir.iterdir(), *(run_dir / "checkpoints").iterdir()]
                 if p.name.endswith((".tmp", ".old"))]
    assert leftovers == []


def _config_file(run_config, tmp_path: Path, name: str) -> tuple[Path, Path]:
    cfg = run_config(name, **SETTINGS)
    path = tmp_path / f"{name}.yaml"
    path.write_text(dump_run_config(cfg))
    return path, Path(cfg.training.output_dir)


@pytest.mark.slow  # several processes or kill/resume: in CI's slow run
def test_killed_inside_checkpoint_and_final_writes_resumes_exactly(reference, run_config,
                                                                   tmp_path):
    cfg_file, run_dir = _config_file(run_config, tmp_path, "points")
    # each checkpoint writes its state and then its manifest (write_json_atomic 2x) and
    # hashes 7 files; a resume first verifies the checkpoint it loads (7 hashes)
    points = [f"{CKPT}:write_json_atomic:3",  # checkpoint 4: scheduler saved, no state yet
              f"{CKPT}:sha256_file:10",  # resumed at 2; checkpoint 4 while it is hashed
              f"{FOLDER}:publish_dir:1"]  # resumed at 2; final weights, not yet published
    codes = _train_through(cfg_file, run_dir, points)
    assert codes == [-signal.SIGKILL] * 3 + [0]
    _assert_equals_reference(reference, run_dir)


@pytest.mark.slow  # several processes or kill/resume: in CI's slow run
def test_two_runs_into_one_folder_one_trains_the_other_names_it(reference, run_config,
                                                                tmp_path):
    cfg_file, run_dir = _config_file(run_config, tmp_path, "race")
    first = _start(cfg_file, [])
    deadline = time.monotonic() + 300
    while not (run_dir / "run.lock").is_file() and first.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    second = _start(cfg_file, ["--start-over"])
    _, err2 = second.communicate(timeout=600)
    _, err1 = first.communicate(timeout=600)
    assert first.returncode == 0, err1[-3000:]
    assert second.returncode == 2 and "in use by another training run (pid " \
        f"{first.pid} on " in err2 and "Traceback" not in err2
    _assert_equals_reference(reference, run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(16))
def test_random_kills_never_give_a_wrong_model(reference, run_config, tmp_path, trial):
    rng = random.Random(trial)
    cfg_file, run_dir = _config_file(run_config, tmp_path, f"random{trial}")
    started = time.monotonic()
    _train_through(cfg_file, run_dir, [])
    duration = time.monotonic() - started  # one whole run, imports included
    shutil.rmtree(run_dir)
    kill_points = [f"{CKPT}:write_rank_rng:{rng.randint(1, 5)}",
                   f"{CKPT}:write_json_atomic:{rng.randint(1, 5)}",
                   f"{CKPT}:publish_dir:{rng.randint(1, 5)}",
                   f"{FOLDER}:publish_dir:1", f"{FOLDER}:write_json_atomic:{rng.randint(1, 3)}"]
    plan = []
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.3:
            plan.append(rng.choice(kill_points))
        else:
            sig = rng.choice([signal.SIGKILL, signal.SIGKILL, signal.SIGTERM])
            plan.append((sig, rng.uniform(0.3, 1.0) * duration))
    _train_through(cfg_file, run_dir, plan)
    _assert_equals_reference(reference, run_dir)


@pytest.mark.slow
def test_a_stale_folder_is_refused_until_started_over(reference, run_config, tmp_path):
    cfg_file, run_dir = _config_file(run_config, tmp_path, "stale")
    _train_through(cfg_file, run_dir, [f"{CKPT}:publish_dir:3"])  # an old, finished run
    proc = _start(cfg_file, [])
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 2 and "holds another run" in err
    _train_through(cfg_file, run_dir, [(signal.SIGKILL, 0.0)])  # starts over, killed at once
    _assert_equals_reference(reference, run_dir)
