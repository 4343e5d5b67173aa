"""The supervisor loop: check, launch with protection, tee, diagnose, fix a copy, resume.

1. Recognise the command (command.py) and read its configuration the way
   ``oomless check`` reads it (configs.py); with a GPU named or found,
   check it; ``--auto-fit`` starts with check's smallest fix when it
   predicts an OOM.
2. Launch it with the protection shim on ``PYTHONPATH`` (protect/bootstrap.py),
   its output shown and copied to ``attempt-N.log``, GPUs sampled through NVML;
   signals are passed to its process group and a watchdog stops it if oomless
   dies (child.py).
3. When it ends with an error: diagnose the log and the events the protected
   Trainer wrote. An OOM gets the smallest change that keeps the effective
   batch and that no setting which already ran out of memory rules out
   (configs.choose_change), written into a copy of the configuration (the
   original is never written); the command is relaunched with the copy,
   resuming from the last complete ``checkpoint-N`` of ``output_dir``.
   A signal, anything else, or ``--max-restarts`` used up, ends the run.
4. Write the report (``oomless report`` of the run folder).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import OomlessError
from ...units import fmt_bytes
from ..protect.bootstrap import write_shim
from ..protect.env import (
    ATTEMPT_ENV,
    EXIT_OOM_RESTART,
    GPU_ENV,
    PROTECT_ENV,
    RESUME_ENV,
    RUN_DIR_ENV,
    RUN_SUBDIR,
)
from ..train.memlog import EVENTS, MEMLOG, RunLog
from .child import LOG_CAP_BYTES, STOP_GRACE_S, CappedLog, GroupStopper, Watchdog, log_tail
from .child import signal_name as _signal_name
from .command import Command, parse_command
from .configs import (
    Change,
    ConfigView,
    Setting,
    change_from_check,
    check_view,
    choose_change,
    diagnose_log,
    failed_settings,
    oom_phase,
    read_view,
    write_change,
)
from .sampler import GpuSampler

DEFAULT_RUN_DIR = "oomless-run"
# what diagnose reads of a log: its end, where the error that ended the command is
DIAGNOSE_TAIL_BYTES = 8 * 2**20


@dataclass(frozen=True)
class RunOptions:
    command: list[str]
    auto_fit: bool = False
    max_restarts: int = 2
    gpu: str | None = None
    model: str | None = None
    run_dir: str | None = None
    protect: bool = True
    check: bool = True
    report: bool = True
    echo: bool = True  # show the command's output live
    stop_grace_s: float = STOP_GRACE_S  # per stage of SIGINT -> SIGTERM -> SIGKILL
    log_cap_bytes: int = LOG_CAP_BYTES  # per attempt-N.log (one older part kept)


@dataclass
class RunResult:
    run_dir: Path
    returncode: int
    attempts: int = 0
    changes: list[str] = field(default_factory=list)
    report: Path | None = None
    verdict: str = ""


def latest_checkpoint(output_dir: str | None) -> Path | None:
    """The highest complete ``checkpoint-N`` (its trainer_state.json written) in output_dir."""
    if not output_dir or not Path(output_dir).is_dir():
        return None
    found = []
    for child in Path(output_dir).iterdir():
        number = child.name.removeprefix("checkpoint-")
        if child.name.startswith("checkpoint-") and number.isdigit() \
                and (child / "trainer_state.json").is_file():
            found.append((int(number), child))
    return max(found)[1] if found else None


def read_run_events(run_dir: Path) -> list[dict[str, Any]]:
    """events.jsonl, a torn last line (a killed writer) skipped."""
    from ...report.data import read_jsonl

    path = run_dir / EVENTS
    return [obj for _n, obj in read_jsonl(path)] if path.is_file() else []


def _files(folder: Path) -> dict[Path, int]:
    """The files in ``folder`` and their modification times (what a fix wrote there)."""
    if not folder.is_dir():
        return {}
    return {p: p.stat().st_mtime_ns for p in folder.iterdir() if p.is_file()}


def _run_dir(opts: RunOptions, view: ConfigView) -> Path:
    if opts.run_dir:
        return Path(opts.run_dir)
    if view.output_dir:
        return Path(view.output_dir) / RUN_SUBDIR
    return Path(DEFAULT_RUN_DIR)


class Supervisor:
    def __init__(self, opts: RunOptions) -> None:
        self.opts = opts
        self.command: Command = parse_command(opts.command)
        self.view = read_view(self.command, opts.model)
        self.run_dir = _run_dir(opts, self.view).resolve()
        self.log = RunLog(self.run_dir)
        self.shim = write_shim(self.run_dir / "shim")
        self.gpu = opts.gpu
        self.result = RunResult(self.run_dir, 1)
        self.echo = opts.echo
        self.stopped_by: int | None = None  # the signal that stopped the last launch
        self.failed: list[Setting] = []  # settings that ran out of memory, every attempt

    def say(self, text: str) -> None:
        try:
            print(f"oomless run: {text}", file=sys.stderr, flush=True)
        except OSError:  # the terminal is gone (SIGHUP): events.jsonl has every message
            pass

    def event(self, kind: str, message: str, **data: Any) -> None:
        self.log.event(kind, message, None, **data)
        self.say(message)

    # ---- before the start ---------------------------------------------------------------
    def start(self) -> None:
        c, v = self.command, self.view
        self.event("run_start", f"supervising `{shlex.join(c.argv)}` ({c.launcher}, "
                   f"{v.kind} configuration, {c.nproc} process(es) per node); run folder "
                   f"{self.run_dir}", command=c.argv, launcher=c.launcher, config_kind=v.kind,
                   nproc=c.nproc, notes=v.notes)
        if self.opts.check:
            self._check()

    def _check(self) -> None:
        try:
            result = check_view(self.view, self.gpu, self.run_dir / "configs")
        except OomlessError as err:
            self.event("check", f"configuration not checked: {err}", checked=False)
            return
        if result is None:
            why = "no model" if not self.view.model else "no GPU named (--gpu)"
            if self.view.kind == "none":
                why = "; ".join(self.view.notes) or "no configuration"
            self.event("check", f"configuration not checked: {why}", checked=False)
            return
        verdict = {"fits": "fits", "tight": "TIGHT (it may run out of memory)",
                   "out_of_memory": "predicted OUT OF MEMORY"}[result.verdict]
        self.event("check", f"check: {verdict} on {result.hardware} (peak "
                   f"{fmt_bytes(result.device_peak_bytes)} in {result.peak_phase})",
                   checked=True, fits=result.fits, device_peak_bytes=result.device_peak_bytes,
                   gpu_memory_bytes=result.gpu_memory_bytes, diffs=result.diffs)
        change = change_from_check(result)
        if change is None:
            return
        if self.opts.auto_fit:
            self._apply(change, 1, "auto_fit")
        else:
            self.say("rerun with --auto-fit to start with: " + change.text)

    def _apply(self, change: Change, attempt: int, kind: str) -> bool:
        folder = self.run_dir / "configs" / f"attempt-{attempt}"
        before = _files(folder)
        try:
            command, diffs = write_change(self.view, change, folder)
        except OomlessError as err:
            self.event("no_fix", f"could not write the fix ({change.text}): {err}")
            return False
        self.command = command
        self.view = read_view(command, self.opts.model)
        self.result.changes.append(change.text)
        copies = sorted(str(p) for p, stamp in _files(folder).items() if before.get(p) != stamp)
        where = (f"written to a copy: {', '.join(copies)}" if copies
                 else "given on the command line")
        self.event(kind, f"{change.text}; {where} (your files are unchanged)",
                   changes=change.changes, diffs=diffs, command=command.argv,
                   phase=change.phase, copies=copies)
        return True

    # ---- one launch -----------------------------------------------------------------------
    def _env(self, attempt: int, resume: Path | None) -> dict[str, str]:
        env = dict(os.environ)
        path = env.get("PYTHONPATH")
        env["PYTHONPATH"] = os.pathsep.join([str(self.shim)] + ([path] if path else []))
        env.update({RUN_DIR_ENV: str(self.run_dir), ATTEMPT_ENV: str(attempt),
                    "PYTHONUNBUFFERED": "1"})
        env.pop(RESUME_ENV, None)
        if resume is not None:
            env[RESUME_ENV] = str(resume)
        if not self.opts.protect:
            env[PROTECT_ENV] = "0"
        if self.gpu:
            env[GPU_ENV] = self.gpu
        return env

    def launch(self, attempt: int, resume: Path | None) -> tuple[int, Path]:
        """Run the command once (see child.py): its return code and its log."""
        log_path = self.run_dir / f"attempt-{attempt}.log"
        argv = self.command.argv
        log = CappedLog(log_path, self.opts.log_cap_bytes)
        watchdog = Watchdog(self.opts.stop_grace_s)
        proc: subprocess.Popen | None = None
        try:
            try:
                proc = subprocess.Popen(argv, env=self._env(attempt, resume),
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            except OSError as err:
                raise OomlessError(f"cannot start `{argv[0]}`: {err.strerror or err}") from None
            watchdog.watch(proc.pid)
            with GroupStopper(proc.pid, self.opts.stop_grace_s, self.say) as stopper:
                self._tee(proc, log)
                rc = proc.wait()
            self.stopped_by = stopper.caught
            return rc, log_path
        finally:
            if proc is not None and proc.poll() is None:  # oomless itself failed mid-way
                GroupStopper(proc.pid, 0, self.say).kill(signal.SIGKILL)
                proc.wait()
            log.close()
            watchdog.done()

    def _tee(self, proc: subprocess.Popen, log: CappedLog) -> None:
        fd = proc.stdout.fileno()
        while chunk := os.read(fd, 65536):
            log.write(chunk)
            if self.echo:
                try:
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.flush()
                except OSError:  # the terminal is gone (SIGHUP): the log still gets it
                    self.echo = False

    # ---- after a launch -------------------------------------------------------------------
    def _output_dir(self, events: list[dict]) -> str | None:
        starts = [e for e in events if e.get("event") == "train_begin" and e.get("output_dir")]
        return self.view.output_dir or (starts[-1]["output_dir"] if starts else None)

    def after_failure(self, attempt: int, rc: int, log_path: Path, events: list[dict]) -> bool:
        """True when the command should run again (the fix written, the checkpoint found)."""
        text = log_tail(log_path, DIAGNOSE_TAIL_BYTES)
        diagnosis = diagnose_log(text, self.view)
        child_oom = any(e.get("event") in ("oom_exit", "oom_unrecoverable") for e in events)
        if not (diagnosis.found or child_oom or rc == EXIT_OOM_RESTART):
            self.event("failed", f"attempt {attempt} ended with exit code {rc} and no "
                       f"out-of-memory error in its log ({log_path}); not restarting",
                       attempt=attempt, returncode=rc)
            return False
        if attempt > self.opts.max_restarts:
            self.event("gave_up", f"attempt {attempt} ran out of memory; --max-restarts "
                       f"{self.opts.max_restarts} used up", attempt=attempt, returncode=rc)
            return False
        self.event("oom_died", f"attempt {attempt} died of an out-of-memory error (exit code "
                   f"{rc})", attempt=attempt, returncode=rc,
                   causes=[c.code for f in diagnosis.findings[:3] for c in f.causes[:1]])
        self.failed += failed_settings(self.view, events, oom_phase(diagnosis, events))
        change = choose_change(self.view, diagnosis, events, self.failed)
        if change is None:
            tried = ", ".join(dict.fromkeys(f.text for f in self.failed)) or "its settings"
            self.event("no_fix", "no change that keeps the effective batch is left (tried and "
                       f"out of memory: {tried}; or the configuration is not readable): "
                       "lower the sequence length, quantize or shard the model; see "
                       f"`oomless diagnose {log_path}`",
                       failed=[vars(f) for f in self.failed])
            return False
        return self._apply(change, attempt + 1, "restart")

    def run(self) -> RunResult:
        self.start()
        sampler = GpuSampler(self.run_dir / "gpu.csv")
        sampler.start()
        resume: Path | None = None
        try:
            for attempt in range(1, self.opts.max_restarts + 2):
                seen = len(read_run_events(self.run_dir))
                self.result.attempts = attempt
                rc, log_path = self.launch(attempt, resume)
                events = read_run_events(self.run_dir)[seen:]
                self.result.returncode = rc
                if self.stopped_by is not None:
                    self.result.returncode = 128 + self.stopped_by
                    self.event("stopped", f"attempt {attempt} stopped by "
                               f"{_signal_name(self.stopped_by)} (exit code {rc}); not "
                               "restarting", attempt=attempt, returncode=rc)
                    break
                if rc == 0:
                    self.event("finished", f"attempt {attempt} finished", attempt=attempt)
                    break
                if not self.after_failure(attempt, rc, log_path, events):
                    break
                resume = latest_checkpoint(self._output_dir(events))
                self.event("relaunch", f"attempt {attempt + 1}: `{shlex.join(self.command.argv)}`"
                           + (f", resuming from {resume}" if resume else
                              ", from the start (no checkpoint written yet)"),
                           attempt=attempt + 1, checkpoint=str(resume) if resume else None)
        finally:
            sampler.stop()
            if sampler.note:
                self.log.event("monitor", sampler.note, None)
            elif sampler.peak_used_bytes:
                self.log.event("monitor", "GPU memory sampled through NVML (gpu.csv)", None,
                               peak_used_bytes=sampler.peak_used_bytes)
        if self.opts.report:
            self.result.report = self._report()
        self.result.verdict = "finished" if self.result.returncode == 0 else (
            "stopped" if self.stopped_by is not None else "failed")
        return self.result

    def _report(self) -> Path | None:
        if not (self.run_dir / MEMLOG).is_file():  # no step was logged: nothing to show
            self.say(f"no report: no training step was logged (the command ended before its "
                     f"first step); its output is in {self.run_dir}/attempt-*.log")
            return None
        try:
            from ...report import load_report_data, write_report

            return Path(write_report(load_report_data(self.run_dir), self.run_dir / "report.html"))
        except (OomlessError, ImportError) as err:
            self.say(f"no report: {err}")
            return None


def supervise(opts: RunOptions) -> RunResult:
    """Run ``opts.command`` under supervision; the result names the run folder."""
    return Supervisor(opts).run()
