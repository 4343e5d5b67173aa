"""The page as one flow, at the adapter: Plan from the Estimate's run, "open in
Estimate", the Inference tab, the knob table's order and the copied commands —
each against the library and the command line."""

from __future__ import annotations

import json
import shlex

import pytest

from oomless.cli import main
from oomless.ui import planning, service

# The case at a length where LoRA fits a 4090: an OOM in Estimate (sequence
# 4096, micro batch 8, no checkpointing), then Plan.
OOM_RUN = {**service.page_defaults(), "method": "lora", "seq_len": 4096, "batch_size": 8,
           "grad_accum": 1}
OOM_RUN.pop("quant")


def cli_json(capsys, *argv: str) -> dict:
    capsys.readouterr()
    code = main([*argv, "--json"])
    assert code in (0, 1)
    return json.loads(capsys.readouterr().out)


def test_plan_keeps_the_estimates_run_and_open_in_estimate_restores_each_plan(workspace):
    estimate = service.estimate_view(workspace, OOM_RUN)
    assert estimate["verdict"]["state"] == "out-of-memory"
    view = planning.plan_view(workspace, {"knobs": OOM_RUN, "method": "keep"})
    assert view["kept"] == {"seq_len": 4096, "effective_batch": 8, "method": "lora",
                            "stage": "sft", "stack": "hf-trainer"}
    assert view["method_note"] is None and view["plans"]
    for plan in view["plans"]:
        knobs = plan["knobs"]
        assert (knobs["method"], knobs["seq_len"]) == ("lora", 4096)
        assert knobs["batch_size"] * knobs["grad_accum"] * knobs["gpus"] == 8
        reopened = service.estimate_view(workspace, {"model": OOM_RUN["model"], **knobs})
        assert reopened["device_peak_bytes"] == plan["device_peak_bytes"]
        assert reopened["verdict"]["state"] in ("fits", "tight")
        assert plan["changes"], "the plan says what it changed from the Estimate's run"


def test_the_plan_command_on_the_estimates_yaml_is_the_same_search(workspace, tmp_path, capsys):
    view = planning.plan_view(workspace, {"knobs": {**OOM_RUN, "stage": "dpo"},
                                         "method": "keep", "top": 3})
    assert view["kept"]["stage"] == "dpo" and view["plans"]
    (tmp_path / "oomless.yaml").write_text(view["base_yaml"])
    words = shlex.split(view["command"])
    assert words[:2] == ["oomless", "plan"]
    words[words.index("oomless.yaml")] = str(tmp_path / "oomless.yaml")
    printed = cli_json(capsys, *words[1:])
    assert [p["device_peak_bytes"] for p in printed["plans"]] == \
        [p["device_peak_bytes"] for p in view["plans"]]
    assert all(p["config"]["stage"] == "dpo" for p in printed["plans"])


def test_when_the_method_fits_nowhere_the_next_lighter_one_is_planned_and_said(workspace):
    run = {**OOM_RUN, "method": "full", "seq_len": 1024}
    view = planning.plan_view(workspace, {"knobs": run, "method": "keep"})
    full_only = planning.plan_view(workspace, {"knobs": run, "method": "full"})
    assert not full_only["plans"]  # full fine-tuning of 7B does not fit a 4090
    assert view["plans"] and view["kept"]["method"] in ("lora", "qlora")
    assert "nothing fits with full" in view["method_note"]


def test_the_knob_table_lists_what_gets_the_run_to_fit_first(workspace):
    rows = service.knob_effects(workspace, OOM_RUN)["rows"]
    rank = {"fits": 0, "tight": 1, "out-of-memory": 3}
    keys = [(rank.get(r["state"], 2), r["device_peak_bytes"]) for r in rows]
    assert keys == sorted(keys)
    assert rows[0]["state"] in ("fits", "tight") or all(r["state"] == "out-of-memory"
                                                        for r in rows)


@pytest.mark.parametrize("engine, extra", [
    ("vllm", []), ("vllm", ["--max-num-seqs", "64", "--kv-cache-dtype", "fp8"]),
    ("hf", ["--batch-size", "4"]),
])
def test_the_inference_tab_says_what_estimate_inference_says(workspace, capsys, engine, extra):
    request = {"model": "qwen2.5-7b-instruct", "gpu": "rtx-a6000", "engine": engine,
               "seq_len": 2048, "max_new_tokens": 512}
    for flag, value in zip(extra[::2], extra[1::2], strict=True):
        request[flag[2:].replace("-", "_")] = int(value) if value.isdigit() else value
    view = planning.inference_view(workspace, request)
    printed = cli_json(capsys, *shlex.split(view["command"])[1:])
    if engine == "vllm":
        assert view["engine_args"] == printed["engine_args"]
        for key in ("num_blocks", "max_concurrency", "required_utilization",
                    "gpu_memory_utilization", "kv_cache_bytes"):
            assert view["budget"][key] == printed[key], key
    else:
        assert view["estimate"]["device_peak_bytes"] == printed["device_peak_bytes"]
    cli = cli_json(capsys, "estimate", "qwen2.5-7b-instruct", "--inference", "--engine", engine,
                   "--gpu", "rtx-a6000", "--seq-len", "2048", "--max-new-tokens", "512", *extra)
    key = "num_blocks" if engine == "vllm" else "device_peak_bytes"
    assert (view["budget"] if engine == "vllm" else view["estimate"])[key] == cli[key]


def test_every_result_carries_the_command_that_gives_it(workspace, capsys):
    estimate = service.estimate_view(workspace, {**OOM_RUN, "seq_len": 512, "batch_size": 1})
    printed = cli_json(capsys, *shlex.split(estimate["command"])[1:])
    assert printed["device_peak_bytes"] == estimate["device_peak_bytes"]
    view = planning.plan_view(workspace, {"knobs": OOM_RUN, "method": "keep"})
    for plan in view["plans"]:
        printed = cli_json(capsys, *shlex.split(plan["command"])[1:])
        assert printed["device_peak_bytes"] == plan["device_peak_bytes"]


def test_a_path_on_the_server_is_not_a_model_the_page_reads(workspace, tmp_path):
    from oomless.errors import ConfigError

    (tmp_path / "run.yaml").write_text("model: qwen2.5-7b-instruct\n")
    with pytest.raises(ConfigError, match="is a path on the server"):
        service.estimate_view(workspace, {**OOM_RUN, "model": str(tmp_path / "run.yaml")})


@pytest.mark.parametrize("name", ["llava/finetune_lora.sh", "moe-llava/phi2_finetune_moe.sh"])
def test_check_reads_a_pasted_launch_script_as_the_cli_reads_the_file(workspace, tmp_path,
                                                                     capsys, name):
    from ui_helpers import FIXTURES

    from oomless.errors import OomlessError

    script = FIXTURES / "real_configs" / name
    (tmp_path / "pasted.sh").write_text(script.read_text())
    argv = ["check", str(tmp_path / "pasted.sh"), "--gpu", "a100-80gb x8"]
    capsys.readouterr()
    code = main([*argv, "--json"])
    out, err = capsys.readouterr()
    request = {"files": [{"name": "", "text": script.read_text()}], "gpu": "a100-80gb",
               "gpus": 8}
    if code == 2:  # the CLI can't tell something: the page says the same
        with pytest.raises(OomlessError) as caught:
            service.check_view(workspace, request)
        assert str(caught.value) in err.replace(f"{tmp_path}/", "")
        return
    printed = json.loads(out)
    view = service.check_view(workspace, request)
    assert view["state"] == printed["verdict"].replace("_", "-")
    assert [p["device_bytes"] for p in view["phases"]] == \
        list(printed["phase_device_bytes"].values())


def test_diagnose_shows_what_the_log_states_and_its_fix_starts_there(workspace):
    from ui_helpers import OOM_LOG

    view = service.diagnose_view(workspace, {"log": OOM_LOG.read_text()})
    assert view["hints"]["micro_batch_size"] == 8 and view["hints"]["grad_accum"] == 2
    assert all(isinstance(v, (int, float, str)) for v in view["hints"].values())
    fixes = [f["text"] for f in view["events"][0]["fixes"]]
    assert any("micro batch 4, accumulation 4" in f for f in fixes), fixes
