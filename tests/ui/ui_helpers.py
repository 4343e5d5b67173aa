"""Helpers of the `oomless ui` tests (a module of its own: two conftest.py files
cannot both be imported as `conftest`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
LF_YAML = FIXTURES / "llama-factory" / "llama3_lora_sft.yaml"
OOM_LOG = FIXTURES / "oom_logs" / "seed002_torch2.log"


def ui_extra_installed() -> bool:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            raise RuntimeError("CI must install the ui extra (starlette, uvicorn)") from None
        return False
    return True


def start_server(*args: str, timeout_s: float = 60.0) -> tuple[subprocess.Popen, str, float]:
    """`oomless ui --port 0` as a user runs it: the process, its address, and the seconds
    from process start to the address printed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "oomless", "ui", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()  # "oomless ui: http://127.0.0.1:PORT/ (Ctrl+C stops it)"
    if "http://" not in line:
        proc.kill()
        raise RuntimeError(f"oomless ui did not start: {line}{proc.stderr.read()}")
    url = line.split()[2]
    return proc, url, time.perf_counter() - started


def stop_server(proc: subprocess.Popen) -> str:
    proc.terminate()
    try:
        _out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        _out, err = proc.communicate()
    return err
