"""`oomless run` and the processes it starts: signals reach the whole command, a command
that ignores them is stopped anyway, killing `oomless run` does not orphan it, the attempt
log is capped, an early death prints no report error, and a relaunch never repeats a
setting that already ran out of memory (the probe's cases of issue 18)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hf_helpers import read_events
from test_protect_distributed import SCRIPT, child_env, script_args

from oomless.runtime.supervise import RunOptions, supervise
from oomless.runtime.supervise.child import CappedLog, log_tail

# A command that starts a grandchild (both in the command's process group), writes both
# pids, says "ready" and sleeps; IGNORE names the signals it ignores.
COMMAND = '''
import os, signal, subprocess, sys, time
for name in os.environ.get("IGNORE", "").split():
    signal.signal(getattr(signal, name), signal.SIG_IGN)
def noted(signum, frame):
    open(os.environ["NOTE"], "a").write(signal.Signals(signum).name + "\\n")
    sys.exit(0)
for name in os.environ.get("NOTE_SIGNALS", "").split():
    signal.signal(getattr(signal, name), noted)
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(os.environ["PIDS"], "w").write(f"{os.getpid()} {grandchild.pid}")
print("ready", flush=True)
time.sleep(120)
'''


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _start(tmp_path: Path, grace_s: float, **env: str) -> tuple[subprocess.Popen, Path]:
    script = tmp_path / "command.py"
    script.write_text(COMMAND)
    pids = tmp_path / "pids"
    environ = child_env(PIDS=str(pids), NOTE=str(tmp_path / "note"), **env)
    proc = subprocess.Popen([sys.executable, "-m", "oomless", "run", "--no-check", "--no-report",
                             "--stop-grace", str(grace_s), "--run-dir", str(tmp_path / "run"),
                             "--", sys.executable, str(script)],
                            env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path)
    assert _wait_for(lambda: pids.is_file() and pids.read_text(), 60), "the command never started"
    return proc, pids


def _pids(path: Path) -> list[int]:
    return [int(p) for p in path.read_text().split()]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_to_oomless_run_reaches_every_process_of_the_command(sig, tmp_path):
    proc, pids = _start(tmp_path, 30, NOTE_SIGNALS=sig)
    proc.send_signal(getattr(signal, sig))
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + getattr(signal, sig)
    assert (tmp_path / "note").read_text() == f"{sig}\n"  # the command got it
    command, grandchild = _pids(pids)
    assert _wait_for(lambda: not _alive(command) and not _alive(grandchild), 5)
    assert f"{sig} received: passed to the command's processes" in err
    (stopped,) = read_events(tmp_path / "run", "stopped")
    assert "not restarting" in stopped["message"]


def test_a_command_that_ignores_sigint_gets_sigterm_then_sigkill(tmp_path):
    """The grace period is 0.5 s: SIGINT (ignored), SIGTERM (ignored), SIGKILL."""
    proc, pids = _start(tmp_path, 0.5, IGNORE="SIGINT SIGTERM")
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert time.monotonic() - started < 15  # two stages of 0.5 s, not forever
    assert "SIGTERM after 0.5 s then SIGKILL after 0.5 s" in err
    assert not any(_alive(pid) for pid in _pids(pids))


def test_sigkill_to_oomless_run_does_not_orphan_the_command(tmp_path):
    """The watchdog ends the command's group (SIGTERM, ignored here, then SIGKILL)."""
    proc, pids = _start(tmp_path, 0.5, IGNORE="SIGTERM")
    proc.kill()
    proc.communicate(timeout=30)
    assert _wait_for(lambda: not any(_alive(pid) for pid in _pids(pids)), 10)


def test_the_attempt_log_is_capped_and_rotated(tmp_path, monkeypatch):
    """A command that prints 300 KB: attempt-1.log holds at most the cap (64 KiB), the
    part before it is attempt-1.log.1, and together they are the output's last bytes."""
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "loud.py"
    script.write_text("import sys\nfor i in range(30000):\n    print(f'line {i:06d}')\n"
                      "sys.exit(4)\n")
    cap = 64 * 1024
    result = supervise(RunOptions([sys.executable, str(script)], report=False, echo=False,
                                  log_cap_bytes=cap))
    assert result.returncode == 4
    run = tmp_path / "oomless-run"
    current, older = run / "attempt-1.log", run / "attempt-1.log.1"
    assert current.stat().st_size <= cap and older.stat().st_size == cap
    output = "".join(f"line {i:06d}\n" for i in range(30000)).encode()
    kept = older.read_bytes() + current.read_bytes()
    assert output.endswith(kept) and len(kept) > cap
    assert log_tail(current, 100).encode() == output[-100:]


def test_capped_log_splits_a_chunk_at_the_cap(tmp_path):
    log = CappedLog(tmp_path / "a.log", cap_bytes=10)
    log.write(b"0123456789abcdefghijklmnopqrstuvwxyz")  # one chunk of 36 bytes
    log.close()
    assert (tmp_path / "a.log").read_bytes() == b"uvwxyz"
    assert (tmp_path / "a.log.1").read_bytes() == b"klmnopqrst"


def test_a_command_that_dies_early_prints_no_report_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "die.py"
    script.write_text("import sys\nsys.exit(3)\n")
    result = supervise(RunOptions([sys.executable, str(script)], echo=False))
    assert (result.returncode, result.report) == (3, None)
    err = capsys.readouterr().err
    assert "oomless train" not in err and "estimate --json" not in err
    assert "no training step was logged" in err


@pytest.mark.slow
def test_a_setting_that_already_failed_is_not_relaunched(tiny_model_dir, tmp_path, monkeypatch):
    """The probe's case: the protected Trainer runs out of memory at micro batch 4, 2, 1 and
    1 with gradient checkpointing (injected 4 times at step 1) and the process dies; the
    supervisor must not relaunch micro batch 1 without checkpointing."""
    from oomless.cli import main

    args = script_args(tiny_model_dir, tmp_path / "out", max_steps=2)
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps(args))
    for key, value in child_env(OOMLESS_INJECT_OOM="train:1:0:4").items():
        monkeypatch.setenv(key, value)
    rc = main(["run", "--no-report", "--", sys.executable, str(SCRIPT), str(args_file)])
    assert rc == 1
    run = tmp_path / "out" / "oomless"
    assert not read_events(run, "restart") and not read_events(run, "relaunch")
    (no_fix,) = read_events(run, "no_fix")
    assert "micro batch 1 with gradient checkpointing" in no_fix["message"]
    assert {"micro_batch_size": 1, "grad_ckpt": True} in no_fix["failed"]
    assert not (run / "configs" / "attempt-2").exists()


def test_a_fix_given_as_flags_names_no_copy_that_was_never_written(tmp_path, monkeypatch):
    """MoE-LLaVA's deepspeed command (TrainingArguments flags, DeepSpeed "auto" values):
    the fix changes two flags and writes no file, so its message names no configs folder;
    the message says why (the setting that ran out of memory)."""
    from test_run_supervisor import FIXTURES, _moe_llava_command, _training_oom_log

    from oomless.runtime.supervise.configs import choose_change, diagnose_log, failed_settings
    from oomless.runtime.supervise.supervisor import Supervisor

    monkeypatch.chdir(tmp_path)
    (tmp_path / "zero2.json").write_text((FIXTURES / "zero2_offload.json").read_text())
    sup = Supervisor(RunOptions(_moe_llava_command("zero2.json"), model="qwen2.5-1.5b-instruct",
                                run_dir=str(tmp_path / "run")))
    diagnosis = diagnose_log(_training_oom_log(), sup.view)
    failed = failed_settings(sup.view, [], "train")
    change = choose_change(sup.view, diagnosis, [], failed)
    assert change.text.endswith("; tried and out of memory: micro batch 8 with gradient "
                                "checkpointing")
    assert sup._apply(change, 2, "restart")
    (restart,) = read_events(tmp_path / "run", "restart")
    assert restart["copies"] == [] and "attempt-2" not in restart["message"]
    assert "given on the command line" in restart["message"]
    assert not (tmp_path / "run" / "configs" / "attempt-2").exists()


def test_the_relaunch_skips_every_setting_that_failed():
    """Micro batch 8 x 1 (a TrainingArguments view): the protected Trainer already
    failed at 8 and 4 in-process; the relaunch goes to 2, not to 4 again; once 1 with
    checkpointing failed, nothing is left."""
    from oomless.config import build_run_config
    from oomless.diagnose import diagnose_text
    from oomless.runtime.supervise.command import parse_command
    from oomless.runtime.supervise.configs import ConfigView, Setting, choose_change

    cfg = build_run_config({"model": "qwen2.5-1.5b-instruct", "micro_batch_size": 8,
                            "grad_accum": 1, "seq_len": 512}, "test")
    view = ConfigView("hf-json", parse_command(["python", "train.py"]), cfg=cfg)
    diagnosis = diagnose_text("")
    oom = [{"event": "oom", "phase": "train", "micro_batch_after": 4,
            "failed": {"micro_batch_size": 8, "grad_ckpt": False}}]
    change = choose_change(view, diagnosis, oom, [Setting(8, False), Setting(4, False)])
    assert change.changes == {"micro_batch_size": 2, "grad_accum": 4}
    change = choose_change(view, diagnosis, oom, [Setting(1, False)])
    assert change.changes == {"micro_batch_size": 1, "grad_accum": 8, "grad_ckpt": True}
    assert choose_change(view, diagnosis, oom, [Setting(1, True)]) is None


def test_a_copy_left_by_an_earlier_run_is_not_named(tmp_path, monkeypatch):
    """The same run folder used again: a file already in configs/attempt-2 that this fix
    did not write is not named as the copy."""
    from test_run_supervisor import FIXTURES, _moe_llava_command, _training_oom_log

    from oomless.runtime.supervise.configs import choose_change, diagnose_log
    from oomless.runtime.supervise.supervisor import Supervisor

    monkeypatch.chdir(tmp_path)
    (tmp_path / "zero2.json").write_text((FIXTURES / "zero2_offload.json").read_text())
    stale = tmp_path / "run" / "configs" / "attempt-2" / "old.yaml"
    stale.parent.mkdir(parents=True)
    stale.write_text("from an earlier run\n")
    sup = Supervisor(RunOptions(_moe_llava_command("zero2.json"), model="qwen2.5-1.5b-instruct",
                                run_dir=str(tmp_path / "run")))
    change = choose_change(sup.view, diagnose_log(_training_oom_log(), sup.view), [])
    assert sup._apply(change, 2, "restart")
    (restart,) = read_events(tmp_path / "run", "restart")
    assert restart["copies"] == [] and "old.yaml" not in restart["message"]
