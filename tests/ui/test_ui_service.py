"""The page's adapter (oomless.ui.service) against the library and the command line.

The page must say what the library says: the same bytes as ``api.estimate``, the
same files as ``plan --out``, a diff that applies to the user's real file, and
the same message as the CLI for every mistake.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ui_helpers import FIXTURES, LF_YAML, OOM_LOG

from oomless.api import estimate
from oomless.cli import main
from oomless.config import RunConfig
from oomless.diagnose import NO_EVENT
from oomless.errors import ConfigError, ModelConfigError, OomlessError, UnknownModelError
from oomless.fileio import OutputFolder
from oomless.ui import planning, runs, service


def cli_error(capsys, *argv: str) -> str:
    """The message `oomless ARGV` prints for a user error (exit code 2)."""
    capsys.readouterr()
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("oomless: error: ")
    return err.removeprefix("oomless: error: ")


def page(**knobs) -> dict:
    return {**service.page_defaults(), **knobs}


# ---- estimate ------------------------------------------------------------------
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(batch=st.integers(1, 64), seq=st.sampled_from([256, 1024, 2048, 8192]),
       ckpt=st.booleans(), method=st.sampled_from(["full", "lora", "qlora"]),
       gpus=st.sampled_from([1, 2, 8]), zero=st.sampled_from([0, 2, 3]),
       gpu=st.sampled_from(["rtx-4090", "a100-80gb", "t4"]),
       offload=st.sampled_from(["none", "optimizer", "all"]),
       optim=st.sampled_from(["adamw", "paged-adamw-8bit", "adafactor"]))
def test_the_bars_add_up_to_the_library_estimate(workspace, batch, seq, ckpt, method, gpus,
                                                 zero, gpu, offload, optim):
    if method == "qlora" and zero == 3:
        zero = 2  # not a valid run (RunConfig refuses it): tested below
    offload = {0: "none", 2: "optimizer" if offload != "none" else "none"}.get(zero, offload)
    request = page(batch_size=batch, seq_len=seq, grad_ckpt=ckpt, method=method, gpus=gpus,
                   zero=zero, gpu=gpu, offload=offload, optim=optim)
    view = service.estimate_view(workspace, request)
    cfg = RunConfig(model=request["model"], method=method, micro_batch_size=batch, seq_len=seq,
                    grad_ckpt=ckpt, zero=zero, offload=offload, optimizer=optim,
                    hardware={"gpu": gpu, "gpus_per_node": gpus})
    est = estimate(cfg)
    assert view["device_peak_bytes"] == est.device_peak_bytes
    assert view["peak_phase"] == est.peak_phase
    assert [p["phase"] for p in view["phases"]] == list(est.breakdown)
    for bar in view["phases"]:
        assert sum(bar["groups"].values()) == bar["total_bytes"]
        members = [b for group in bar["members"].values() for _name, b in group]
        assert sum(members) == bar["total_bytes"]
        assert bar["allocated_bytes"] == sum(est.breakdown[bar["phase"]].values())
    peak_bar = next(b for b in view["phases"] if b["phase"] == est.peak_phase)
    assert peak_bar["total_bytes"] == est.device_peak_bytes  # the bar = the verdict's number
    assert view["verdict"]["state"] == est.verdict.replace(" ", "-")


def test_stack_and_stage_reach_the_run_configuration(workspace):
    cfg = service.run_config(workspace, page(stack="llamafactory", stage="dpo"))
    assert (cfg.stack, cfg.stage) == ("llamafactory", "dpo")


@pytest.mark.parametrize(("gpu_gb", "state"), [(8, "out-of-memory"), (12, "tight"), (16, "fits")])
def test_the_page_verdict_is_the_estimates_three_valued_verdict(gpu_gb, state):
    """Tight where the uncertainty band straddles the GPU's memory (memory/band.py)."""
    est = estimate(RunConfig(model="qwen2.5-7b", method="qlora", seq_len=2048, grad_ckpt=True,
                             hardware={"gpu": f"{gpu_gb}gb"}))
    view = service.verdict_of(est)
    assert (view["low_bytes"], view["high_bytes"]) == (est.low_bytes, est.high_bytes)
    assert view["low_bytes"] < est.device_peak_bytes < view["high_bytes"]
    assert view["state"] == state  # 12 GB: 11.2 GiB lies inside the band of ~10.8 GiB


def test_each_knob_effect_is_the_library_estimate_of_that_change(workspace):
    request = page(grad_ckpt=True, batch_size=2, gpus=2, zero=2)
    effects = service.knob_effects(workspace, request)
    knobs = {row["knob"] for row in effects["rows"]}
    assert {"micro batch", "sequence length", "gradient checkpointing", "attention", "method",
            "optimizer", "LoRA rank", "ZeRO stage", "offload", "GPUs"} <= knobs
    for row in effects["rows"]:
        alone = service.estimate_view(workspace, {**request, **row["change"]})
        assert row["device_peak_bytes"] == alone["device_peak_bytes"], row
        assert row["delta_bytes"] == alone["device_peak_bytes"] - effects["base_bytes"]
    halved = next(r for r in effects["rows"] if r["knob"] == "micro batch" and r["to"] == "1")
    assert halved["delta_bytes"] < 0


def test_the_command_line_shown_gives_the_same_estimate(workspace, capsys):
    import json
    import shlex

    view = service.estimate_view(workspace, page(batch_size=3, grad_ckpt=True, method="qlora",
                                                 quant="fp4", gpus=2, zero=2))
    words = shlex.split(view["command"])
    assert words[:2] == ["oomless", "estimate"]
    capsys.readouterr()
    assert main([*words[1:], "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["device_peak_bytes"] == view["device_peak_bytes"]


def test_an_uploaded_config_json_is_estimated_as_the_file_itself(workspace, tmp_path):
    source = FIXTURES / "configs" / "glm-4-9b-chat" / "config.json"
    request = page(model_config={"name": "glm-4-9b-chat", "text": source.read_text()},
                   grad_ckpt=True)
    request.pop("model")
    view = service.estimate_view(workspace, request)
    shutil.copytree(source.parent, tmp_path / "glm-4-9b-chat")
    cfg = RunConfig(model=str(tmp_path / "glm-4-9b-chat" / "config.json"), grad_ckpt=True,
                    hardware={"gpu": "rtx-4090"})
    assert view["device_peak_bytes"] == estimate(cfg).device_peak_bytes
    assert view["model"] == "glm-4-9b-chat"
    assert "./config.json" in view["command"]


@pytest.mark.parametrize("name", ["llama_missing_hidden_size.json", "truncated.json"])
def test_a_broken_config_json_gets_the_cli_message_without_our_folder(workspace, tmp_path,
                                                                      capsys, name):
    text = (FIXTURES / "configs" / name).read_text()
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(text)
    expected = cli_error(capsys, "estimate", str(folder / "config.json"), "--gpu", "4090")
    request = page(model_config={"name": "my-model", "text": text})
    request.pop("model")
    with pytest.raises((ModelConfigError, UnknownModelError, ConfigError)) as caught:
        service.estimate_view(workspace, request)
    assert str(workspace.root) not in str(caught.value)
    assert str(caught.value) == expected.replace(f"{tmp_path}/", "")


def test_an_unknown_model_gets_the_cli_message(workspace, capsys):
    expected = cli_error(capsys, "estimate", "llama-9000", "--gpu", "4090")
    with pytest.raises(UnknownModelError) as caught:
        service.estimate_view(workspace, page(model="llama-9000"))
    assert str(caught.value) == expected


def test_an_invalid_combination_gets_the_cli_message(workspace, capsys):
    expected = cli_error(capsys, "estimate", "qwen2.5-7b-instruct", "--gpu", "4090",
                         "--offload", "optimizer")
    with pytest.raises(ConfigError, match="offload 'optimizer' needs DeepSpeed ZeRO") as caught:
        service.estimate_view(workspace, page(offload="optimizer"))
    assert str(caught.value) == expected


# ---- plan ------------------------------------------------------------------------
def test_plan_files_are_the_files_plan_out_writes(workspace, tmp_path, capsys):
    out = tmp_path / "plan"
    capsys.readouterr()
    assert main(["plan", "qwen2.5-7b-instruct", "--gpu", "rtx-4090 x2", "--seq-len", "1024",
                 "--out", str(out)]) == 0
    view = planning.plan_view(workspace, {"model": "qwen2.5-7b-instruct", "gpu": "rtx-4090",
                                         "gpus": 2, "seq_len": 1024})
    assert view["plans"], "a 7B model fits two RTX 4090s"
    best = view["plans"][0]["files"]
    written = {p.name: p.read_text() for p in out.iterdir()
               if p.name != OutputFolder.MANIFEST}  # plan's own bookkeeping, not a plan file
    assert set(best) == set(written)
    for name, text in written.items():  # downloads name their sibling files by name only
        assert best[name] == text.replace(f"{out.resolve()}/", ""), name
    assert not list(workspace.root.glob("plan-*")), "temporary plan folders are removed"


def test_nothing_fits_is_an_answer_not_an_error(workspace):
    view = planning.plan_view(workspace, {"model": "qwen2.5-72b-instruct", "gpu": "t4",
                                         "seq_len": 32768, "method": "full"})
    assert view["plans"] == [] and view["misses"]


# ---- check -------------------------------------------------------------------------
def test_check_of_a_real_llamafactory_yaml_gives_a_diff_that_applies(workspace, tmp_path):
    text = LF_YAML.read_text()
    view = service.check_view(workspace, {"files": [{"name": LF_YAML.name, "text": text}],
                                          "gpu": "t4", "model": "llama-3.1-8b-instruct"})
    assert view["state"] == "out-of-memory" and view["fix"] and view["diff"]
    assert view["files"] == [LF_YAML.name]
    assert all(str(workspace.root) not in n for n in view["notes"])
    (tmp_path / LF_YAML.name).write_text(text)
    (tmp_path / view["diff_name"]).write_text(view["diff"])
    subprocess.run(["git", "apply", view["diff_name"]], cwd=tmp_path, check=True)
    fixed = (tmp_path / LF_YAML.name).read_text()
    assert fixed != text
    again = service.check_view(workspace, {"files": [{"name": LF_YAML.name, "text": fixed}],
                                           "gpu": "t4", "model": "llama-3.1-8b-instruct"})
    assert again["state"] == "fits" and not again["diff"]


def test_a_broken_yaml_gets_the_cli_message(workspace, tmp_path, capsys, monkeypatch):
    broken = "model_name_or_path: x\nfinetuning_type: [lora\n"
    (tmp_path / "train.yaml").write_text(broken)
    monkeypatch.chdir(tmp_path)
    expected = cli_error(capsys, "check", "train.yaml", "--gpu", "4090")
    with pytest.raises(ConfigError) as caught:
        service.check_view(workspace, {"files": [{"name": "train.yaml", "text": broken}],
                                       "gpu": "rtx-4090"})
    assert str(caught.value) == expected


def test_check_needs_one_or_two_files(workspace):
    with pytest.raises(ConfigError, match="one configuration file"):
        service.check_view(workspace, {"files": []})
    with pytest.raises(ConfigError, match="file 1 is empty"):
        service.check_view(workspace, {"files": [{"name": "a.yaml", "text": "  "}]})


# ---- diagnose ------------------------------------------------------------------------
def test_diagnose_shows_the_numbers_of_the_log(workspace):
    view = service.diagnose_view(workspace, {"log": OOM_LOG.read_text()})
    assert view["found"]
    numbers = view["events"][0]["numbers"]
    for printed in ("6.56 GiB", "3.18 GiB", "39.39 GiB", "33.67 GiB"):  # in the log's message
        assert printed in numbers
    assert view["events"][0]["causes"] and view["events"][0]["fixes"]


def test_a_log_without_oom_says_so(workspace):
    text = (FIXTURES / "oom_logs" / "no_oom_traceback.log").read_text()
    view = service.diagnose_view(workspace, {"log": text})
    assert not view["found"] and view["summary"] == NO_EVENT


def test_diagnose_with_the_run_configuration_prices_the_fixes(workspace):
    config = (FIXTURES / "oom_logs" / "seed002_oomless.yaml").read_text()
    view = service.diagnose_view(workspace, {"log": OOM_LOG.read_text(), "config": config})
    assert any("predicted" in fix["text"] for fix in view["events"][0]["fixes"])


# ---- runs and uploads ------------------------------------------------------------------
def test_a_missing_run_folder_gets_the_cli_message(capsys, tmp_path):
    missing = str(tmp_path / "no-such-run")
    expected = cli_error(capsys, "report", missing)
    with pytest.raises(OomlessError) as caught:
        runs.report_view({"path": missing})
    assert str(caught.value) == expected


@given(st.text(max_size=300))
def test_uploaded_names_stay_inside_the_workspace(name):
    safe = service.safe_name(name)
    assert safe and "/" not in safe and "\\" not in safe and not safe.startswith(".")
    assert len(safe) <= 100


def test_the_workspace_keeps_uploads_inside_and_is_removed_on_close():
    ws = service.Workspace()
    saved = ws.save(ws.folder("check"), "../../etc/passwd", "x")
    assert saved.parent.parent == ws.root and saved.name == "passwd" and saved.read_text() == "x"
    first = ws.model_config("my model", '{"a": 1}')
    assert ws.model_config("my model", '{"a": 1}') == first  # one folder per content
    assert ws.model_config("my model", '{"a": 2}') != first
    assert first.parent.name == "my_model" and first.is_relative_to(ws.root)
    ws.close()
    assert not Path(ws.root).exists()


def test_no_upload_is_left_behind_after_a_check(workspace):
    service.check_view(workspace, {"files": [{"name": LF_YAML.name, "text": LF_YAML.read_text()}],
                                   "gpu": "rtx-4090", "model": "llama-3.1-8b-instruct"})
    with pytest.raises(ConfigError):
        service.check_view(workspace, {"files": [{"name": "x.yaml", "text": "a: [b"}]})
    assert list(workspace.root.iterdir()) == []
