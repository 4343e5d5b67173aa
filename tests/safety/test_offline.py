"""Nothing in oomless reaches the network: every command runs in a process whose
sockets refuse to connect (and that records every attempt), without HF_HUB_OFFLINE."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOG = ROOT / "tests" / "fixtures" / "oom_logs" / "deepspeed_stage3_step_oom.log"

BLOCK = '''
import json, socket, sys
attempts = []
def _refuse(kind):
    def refuse(*args, **kwargs):
        attempts.append([kind, repr(args)[:200]])
        raise OSError("network blocked by the test")
    return refuse
_connect = socket.socket.connect
def connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6):
        return _refuse("connect")(address)
    return _connect(self, address)
socket.socket.connect = connect
socket.socket.connect_ex = lambda self, address: connect(self, address)
socket.create_connection = _refuse("create_connection")
socket.getaddrinfo = _refuse("getaddrinfo")
'''

SCRIPT = '''
import os, sys
sys.path.insert(0, {train_helpers!r})
from pathlib import Path
from train_helpers import tiny_run_config
from oomless.config import dump_run_config
from oomless.runtime.tiny import build_tiny_model
tmp = Path({tmp!r})
model = build_tiny_model(tmp / "model")
results = {{}}
# the library first, before the CLI sets HF_HUB_OFFLINE for its process
from oomless.runtime.train.loop import train
cfg = tiny_run_config(model, tmp / "lib-run", **{{"training.max_steps": 2}})
results["train()"] = train(cfg).steps
from oomless.runtime.infer.core import InferOptions
from oomless.runtime.infer.jobs import infer_file
data = tmp / "prompts.jsonl"
data.write_text('{{"prompt": "hi"}}\\n{{"prompt": "there"}}\\n')
opts = InferOptions(model=str(model), backend="hf", cutoff_len=16, max_new_tokens=2)
results["infer_file()"] = infer_file(data, tmp / "lib-answers.jsonl", opts).written
from oomless.cli import main
cfg_file = tmp / "run.yaml"
cfg_file.write_text(dump_run_config(cfg.replace(**{{"training.output_dir": str(tmp / "run")}})))
commands = {{
    "estimate": ["estimate", "llama-3.1-8b-instruct", "--gpu", "4090"],
    "plan": ["plan", "qwen2.5-7b-instruct", "--gpu", "4090", "--out", str(tmp / "plan")],
    "check": ["check", str(tmp / "plan" / "llamafactory.yaml"), "--gpu", "4090"],
    "diagnose": ["diagnose", {log!r}],
    "train": ["train", str(cfg_file), "--no-progress"],
    "report": ["report", str(tmp / "run")],
    "infer": ["infer", str(data), "-m", str(model), "-o", str(tmp / "a.jsonl"),
              "--backend", "hf", "--max-new-tokens", "2"],
    "score": ["score", str(data), "-m", str(model), "-o", str(tmp / "s.jsonl"),
              "--backend", "hf"],
    "infer-catalog-name": ["infer", str(data), "-m", "qwen2.5-0.5b-instruct", "-o",
                           str(tmp / "c.jsonl"), "--backend", "hf"],
    "trace": ["trace", str(model), "--seq-len", "32"],
    "models": ["models"],
    "gpus": ["gpus"],
{extra}}}
for name, argv in commands.items():
    results[name] = main(argv)
print("RESULT " + json.dumps({{"results": results, "attempts": attempts}}))
'''


def _run_blocked(tmp_path: Path, extra: str = "") -> dict:
    script = BLOCK + textwrap.dedent(SCRIPT).format(
        train_helpers=str(ROOT / "tests" / "train"), tmp=str(tmp_path), log=str(LOG),
        extra=extra)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "TRANSFORMERS_OFFLINE"))}
    env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1",
               TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[-1].removeprefix("RESULT "))


def test_every_command_runs_with_the_network_blocked(tmp_path):
    out = _run_blocked(tmp_path)
    assert out["attempts"] == []
    results = out["results"]
    assert results["train()"] == 2 and results["infer_file()"] == 2
    assert results["infer-catalog-name"] == 2  # not in the local cache: refused, not fetched
    assert results["check"] in (0, 1) and results["plan"] in (0, 1)
    others = {k: v for k, v in results.items()
              if k not in ("train()", "infer_file()", "infer-catalog-name", "check", "plan")}
    assert others == dict.fromkeys(others, 0), results


@pytest.mark.slow
def test_demo_monitor_and_measure_with_the_network_blocked(tmp_path):
    extra = ('    "demo": ["demo", "--out", str(tmp / "demo")],\n'
             '    "monitor": ["monitor", "--once"],\n'
             '    "measure": ["measure", str(model), "--device", "cpu", "--seq-len", "32"],\n')
    out = _run_blocked(tmp_path, extra)
    assert out["attempts"] == []
    assert out["results"]["demo"] == 0 and out["results"]["measure"] == 0
    assert out["results"]["monitor"] in (0, 1)  # 1: no GPU here
