"""`oomless diagnose` through the real CLI entry point: output and exit codes."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys

from diagnose_fixtures import FIXTURES, as_bytes

from oomless.cli import main

SEED002 = str(FIXTURES / "seed002_torch2.log")
CONFIG = str(FIXTURES / "seed002_oomless.yaml")


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_human_output_one_block_per_event(capsys):
    rc, out, err = run_cli(capsys, "diagnose", str(FIXTURES / "torch2_multirank_ddp_logits.log"))
    assert rc == 0 and not err
    assert out.count("Out of memory ") == 4
    for rank in range(4):
        assert f"rank {rank}" in out
    assert "Full replicas" in out and "ZeRO-3 over 4 GPUs" in out


def test_seed002_with_config_prints_the_fix_with_its_prediction(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # one fix per line, no wrapping inside the panel
    rc, out, _ = run_cli(capsys, "diagnose", SEED002, "--config", CONFIG)
    assert rc == 0
    line = next(x for x in out.splitlines() if "Fix 1:" in x)
    assert re.search(r"Fix 1: micro batch 4, accumulation 4, effective batch 16 .*unchanged: "
                     r"predicted \d+\.\d\d GiB of 39\.\d\d GiB", line), line


def test_json_output_has_events_numbers_causes_fixes(capsys):
    rc, out, _ = run_cli(capsys, "diagnose", SEED002, "--config", CONFIG, "--json")
    assert rc == 0
    data = json.loads(out)
    assert data["found"] is True and len(data["events"]) == 1
    event = data["events"][0]
    assert event["event"]["numbers"]["requested_bytes"] == as_bytes("6.56", "GiB")
    assert event["event"]["phase"] == "backward" and event["event"]["rank"] == 0
    assert event["causes"][0]["code"] == "activations"
    fix = event["fixes"][0]
    assert fix["changes"] == {"micro_batch_size": 4, "grad_accum": 4}
    assert isinstance(fix["predicted_peak_bytes"], int) and fix["prediction"] == "estimator"
    assert fix["summary"].startswith("micro batch 4, accumulation 4")


def test_gpu_flag_changes_the_gpu_predicted_for(capsys):
    rc, out, _ = run_cli(capsys, "diagnose", SEED002, "--config", CONFIG, "--gpu", "a100-80gb", "--json")
    assert rc == 0
    data = json.loads(out)
    assert "80GB" in data["gpu"]
    assert data["events"][0]["fixes"][0]["gpu_memory_bytes"] == data["gpu_memory_bytes"]


def test_unknown_text_from_stdin(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"epoch 1 loss 0.3\n\xff\xfe ok\n")))
    rc, out, _ = run_cli(capsys, "diagnose", "-")
    assert rc == 0
    assert out.strip() == "no out-of-memory event found"


def test_unknown_text_json(capsys, tmp_path):
    log = tmp_path / "train.log"
    log.write_text("all good\n")
    rc, out, _ = run_cli(capsys, "diagnose", str(log), "--json")
    assert rc == 0
    data = json.loads(out)
    assert data == {**data, "found": False, "summary": "no out-of-memory event found", "events": []}


def test_missing_file_is_a_user_error(capsys, tmp_path):
    rc, out, err = run_cli(capsys, "diagnose", str(tmp_path / "nope.log"))
    assert rc == 2 and not out
    assert "cannot read log" in err and "Traceback" not in err


def test_bad_config_is_a_user_error(capsys, tmp_path):
    bad = tmp_path / "oomless.yaml"
    bad.write_text("model: qwen2.5-7b\nmicro_batch_size: -1\n")
    rc, _, err = run_cli(capsys, "diagnose", SEED002, "--config", str(bad))
    assert rc == 2 and "micro_batch_size" in err


def test_unknown_gpu_is_a_user_error(capsys):
    rc, _, err = run_cli(capsys, "diagnose", SEED002, "--gpu", "not-a-gpu")
    assert rc == 2 and "unknown GPU" in err


CODE = """
import sys, json, contextlib, io
from oomless.cli import main
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    rc = main(["diagnose", sys.argv[1], "--config", sys.argv[2], "--json"])
heavy = sorted(m for m in ("torch", "transformers", "peft", "accelerate", "deepspeed") if m in sys.modules)
print(json.dumps({"rc": rc, "heavy": heavy}))
"""


def test_diagnose_leaves_torch_out():
    out = subprocess.run([sys.executable, "-c", CODE, SEED002, CONFIG], capture_output=True,
                         text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"rc": 0, "heavy": []}
