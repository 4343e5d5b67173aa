"""The supervised command as one process group: teed into a capped log, stopped, never orphaned.

- The command runs in its own session (its own process group, away from the
  terminal's signals), so one ``killpg`` reaches every process it starts
  (torchrun's and deepspeed's workers included).
- SIGINT, SIGTERM and SIGHUP sent to ``oomless run`` are passed to that group.
  A command that does not end escalates: SIGTERM :data:`STOP_GRACE_S` seconds
  after the signal (when the first was SIGINT or SIGHUP), SIGKILL the same time
  after that. The same signal again skips the wait to the next stage.
- A watchdog process (:data:`WATCHDOG`, in a session of its own) holds the read
  end of a pipe only ``oomless run`` writes to. When ``oomless run`` dies
  without saying "done" (SIGKILL, a crash) the pipe reaches end-of-file and
  the watchdog stops the command's group the same way (SIGTERM, then SIGKILL
  after the grace period): the command never outlives its supervisor holding
  the GPU. (``PR_SET_PDEATHSIG`` would reach only the direct child, not the
  workers a launcher starts, and needs a ``preexec_fn``, unsafe beside the
  NVML sampling thread.)
- ``attempt-N.log`` holds at most :data:`LOG_CAP_BYTES`: when full it becomes
  ``attempt-N.log.1`` (replacing an older one) and a new ``attempt-N.log``
  starts, so an attempt keeps at most twice the cap of its latest output.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

STOP_GRACE_S = 10.0
LOG_CAP_BYTES = 50 * 2**20
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

# Runs with -I -S (no site, no sitecustomize): reads the group id, then waits for
# end-of-file on stdin; "done" before it means oomless ended normally.
WATCHDOG = r'''
import os, signal, sys, time
for s in (signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
grace = float(sys.argv[1])
data = b""
while chunk := os.read(0, 4096):
    data += chunk
lines = data.split(b"\n")
if not lines[0].isdigit() or data.endswith(b"done"):
    sys.exit(0)
group = int(lines[0])
def alive():
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
for sig in (signal.SIGTERM, signal.SIGKILL):
    if not alive():
        break
    os.killpg(group, sig)
    deadline = time.monotonic() + grace
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
'''


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class CappedLog:
    """A binary log file of at most ``cap_bytes``, rotated once into ``NAME.1``."""

    def __init__(self, path: Path, cap_bytes: int = LOG_CAP_BYTES) -> None:
        self.path, self.cap_bytes = path, max(1, cap_bytes)
        self.rotated = path.with_name(path.name + ".1")
        self.rotated.unlink(missing_ok=True)
        self._fh: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.size = 0

    def write(self, chunk: bytes) -> None:
        while chunk:
            room = self.cap_bytes - self.size
            if room <= 0:
                self._fh.close()
                os.replace(self.path, self.rotated)
                self._fh = open(self.path, "wb")  # noqa: SIM115
                self.size, room = 0, self.cap_bytes
            part, chunk = chunk[:room], chunk[room:]
            self._fh.write(part)
            self.size += len(part)
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def log_tail(path: Path, limit_bytes: int) -> str:
    """The last ``limit_bytes`` of an attempt's output (``NAME.1`` then ``NAME``)."""
    parts: list[bytes] = []
    need = limit_bytes
    for part in (path, path.with_name(path.name + ".1")):
        if need <= 0 or not part.is_file():
            continue
        with open(part, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(0, size - need))
            data = fh.read()
        parts.insert(0, data)
        need -= len(data)
    return b"".join(parts).decode("utf-8", errors="replace")


class Watchdog:
    """Stops the command's process group when this process dies without saying done."""

    def __init__(self, grace_s: float) -> None:
        read_end, self._write_end = os.pipe()  # not inherited by the command (PEP 446)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", WATCHDOG, str(grace_s)], stdin=read_end,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(read_end)

    def watch(self, group: int) -> None:
        os.write(self._write_end, f"{group}\n".encode())

    def done(self) -> None:
        """The command has ended (or was never started): the watchdog leaves quietly."""
        try:
            os.write(self._write_end, b"done")
        finally:
            os.close(self._write_end)
        self.proc.wait()


class GroupStopper:
    """While installed: the signals of FORWARDED go to the command's group, escalating."""

    def __init__(self, group: int, grace_s: float, say: Callable[[str], None]) -> None:
        self.group, self.grace_s, self.say = group, grace_s, say
        self.caught: int | None = None
        self._stages: list[int] = []
        self._wake = threading.Event()
        self._ended = False
        self._old: dict[int, Any] = {}
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GroupStopper:
        if threading.current_thread() is threading.main_thread():
            for sig in FORWARDED:
                self._old[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._ended = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=1)

    def kill(self, sig: int) -> None:
        try:
            os.killpg(self.group, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.caught is not None:  # again: the next stage now
            self._wake.set()
            return
        self.caught = signum
        self._stages = [s for s in (signal.SIGTERM, signal.SIGKILL) if s != signum]
        self.kill(signum)
        then = " then ".join(f"{signal_name(s)} after {self.grace_s:g} s" for s in self._stages)
        self.say(f"{signal_name(signum)} received: passed to the command's processes; {then} "
                 "if they are still running (send it again to skip the wait)")
        self._thread = threading.Thread(target=self._escalate, name="oomless-stop", daemon=True)
        self._thread.start()

    def _escalate(self) -> None:
        for sig in self._stages:
            self._wake.wait(self.grace_s)
            self._wake.clear()
            if self._ended:
                return
            self.kill(sig)
