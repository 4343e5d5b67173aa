"""End-to-end training of the tiny model: loss falls, the run folder is complete."""

from __future__ import annotations

import json

import pytest

from oomless.errors import ConfigError
from oomless.runtime.train.loop import train
from oomless.runtime.train.memlog import read_steps

STEP_KEYS = {"step", "loss", "lr", "tokens", "step_time_s", "tokens_per_s", "host_rss_bytes",
             "predicted_peak_bytes", "micro_batch_size", "grad_accum", "samples"}


def test_lora_training_lowers_the_loss_and_writes_the_run_folder(run_config):
    cfg = run_config(**{"training.max_steps": 12, "training.learning_rate": 1e-2})
    result = train(cfg)
    run = result.run_dir
    assert result.steps == 12
    assert sum(result.losses[-3:]) / 3 < sum(result.losses[:3]) / 3 - 0.2
    steps = read_steps(run)
    assert [s["step"] for s in steps] == list(range(1, 13))
    assert STEP_KEYS <= set(steps[0])
    assert all(s["tokens"] > 0 and s["host_rss_bytes"] > 0 for s in steps)
    assert len({i for s in steps for i in s["samples"]}) == 12 * 8  # no sample twice per epoch
    for name in ("oomless.yaml", "token_stats.json", "summary.json",
                 "final/adapter_model.safetensors", "final/tokenizer.json",
                 "checkpoints/step-000012/trainer_state.json"):
        assert (run / name).is_file(), name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_loss"] == pytest.approx(result.losses[-1])


def test_full_fine_tuning_updates_every_weight(run_config, tiny_model_dir):
    from safetensors.torch import load_file

    result = train(run_config(method="full", **{"training.max_steps": 2}))
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    after = load_file(str(result.final_dir / "model.safetensors"))
    assert set(before) == set(after)
    assert all(not before[k].equal(after[k]) for k in after if "norm" not in k)


def test_eval_and_predict_with_generate(run_config):
    from oomless.runtime.tiny import demo_data_path

    cfg = run_config(**{"data.eval_file": str(demo_data_path()), "eval.batch_size": 50,
                        "eval.predict_with_generate": True, "eval.max_new_tokens": 4,
                        "eval.steps": 3, "training.max_steps": 3})
    result = train(cfg)
    assert len(result.eval_losses) == 1
    rows = (result.run_dir / "predictions-step000003-rank0.jsonl").read_text().splitlines()
    assert len(rows) == 200
    assert {"prediction", "reference", "exact_match"} <= set(json.loads(rows[0]))
    metrics = json.loads((result.run_dir / "eval.jsonl").read_text())
    assert 0 <= metrics["exact_match"] <= 1


def test_packing_trains(run_config):
    result = train(run_config(**{"data.packing": True, "seq_len": 128, "micro_batch_size": 2,
                                 "grad_accum": 1, "training.max_steps": 2}))
    assert result.steps == 2


def test_qlora_on_cpu_is_a_clear_error(run_config):
    with pytest.raises(ConfigError, match="qlora needs an NVIDIA GPU"):
        train(run_config(method="qlora", precision="bf16"))


def test_missing_train_file_and_unknown_model(run_config, tmp_path):
    from oomless.errors import UnknownModelError

    with pytest.raises(ConfigError, match="data.train_file is not set"):
        train(run_config(**{"data.train_file": None}))
    with pytest.raises(UnknownModelError, match="not a local folder|neither a local folder"):
        train(run_config(model="no-such-org/no-such-model"))


def test_remote_code_needs_the_config_switch(run_config, tiny_model_dir, tmp_path):
    import shutil

    remote = tmp_path / "remote"
    shutil.copytree(tiny_model_dir, remote)
    config = json.loads((remote / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (remote / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="trust_remote_code: true"):
        train(run_config(model=str(remote)))


def test_too_little_data_for_one_step(run_config):
    with pytest.raises(ConfigError, match="fewer than one optimizer step"):
        train(run_config(micro_batch_size=64, grad_accum=4))


def _big_batch_config(run_config, tmp_path):
    from oomless.runtime.tiny import demo_data_path

    data = tmp_path / "x3.jsonl"
    data.write_text(demo_data_path().read_text() * 3)
    # 512 x 4096 tokens does not fit a 16 GB T4 by the analytic estimate
    return run_config(micro_batch_size=512, grad_accum=1, seq_len=4096,
                      **{"hardware.gpu": "t4", "data.train_file": str(data),
                         "training.max_steps": 1})


def test_preflight_stops_before_loading_weights_with_the_best_plan(run_config, tmp_path,
                                                                   monkeypatch):
    from oomless.runtime.train import loop as train_module
    from oomless.runtime.train.preflight import PreflightError

    def never(*args, **kwargs):
        raise AssertionError("weights loaded before the preflight")

    monkeypatch.setattr(train_module, "load_model", never)
    with pytest.raises(PreflightError, match=r"(?s)OUT OF MEMORY on .*T4.*micro_batch_size: "
                                             r"512 -> \d+, grad_accum: 1 -> \d+.*--auto-fit"):
        train(_big_batch_config(run_config, tmp_path))


def test_auto_fit_applies_the_plan_and_keeps_the_effective_batch(run_config, tmp_path):
    from oomless.config import load_run_config
    from oomless.runtime.train.memlog import read_events

    result = train(_big_batch_config(run_config, tmp_path), auto_fit=True)
    (event,) = [e for e in read_events(result.run_dir) if e["event"] == "auto_fit"]
    micro_old, micro_new = event["changes"]["micro_batch_size"]
    accum_old, accum_new = event["changes"]["grad_accum"]
    assert micro_old * accum_old == micro_new * accum_new == 512 and micro_new < 512
    written = load_run_config(result.run_dir / "oomless.yaml")
    assert (written.micro_batch_size, written.effective_batch) == (micro_new, 512)
    assert read_steps(result.run_dir)[0]["samples"].__len__() == 512


def test_preflight_without_a_gpu_says_it_did_not_check(tiny_model_dir, run_config):
    from oomless.runtime.train.preflight import run_preflight

    pre = run_preflight(run_config(), tiny_model_dir)
    assert pre.fits is None and "not checked" in pre.note
    fits = run_preflight(run_config(**{"hardware.gpu": "t4"}), tiny_model_dir)
    assert fits.fits is True and "fits on" in fits.note


def test_cli_train_and_resume(run_config, tmp_path, capsys):
    from oomless.cli import main
    from oomless.config import dump_run_config

    cfg = run_config(**{"training.max_steps": 2})
    path = tmp_path / "oomless.yaml"
    path.write_text(dump_run_config(cfg))
    assert main(["train", str(path), "--no-progress"]) == 0
    assert "next: oomless report" in capsys.readouterr().out
    longer = cfg.replace(**{"training.max_steps": 3})
    path.write_text(dump_run_config(longer))
    assert main(["train", str(path), "--resume", "--no-progress"]) == 0
    assert [s["step"] for s in read_steps(cfg.training.output_dir)] == [1, 2, 3]


def test_cli_user_errors_exit_2_without_traceback(tmp_path, capsys):
    from oomless.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("model: x\nmicro_batch_size: 0\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "micro_batch_size" in err and "Traceback" not in err


def test_docs_config_md_documents_every_key():
    from pathlib import Path

    from oomless.config import RunConfig

    text = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()

    def keys(model, prefix=""):
        for name, field in model.model_fields.items():
            yield prefix + name
            if hasattr(field.annotation, "model_fields"):
                yield from keys(field.annotation, prefix + name + ".")

    missing = [k for k in keys(RunConfig) if f"`{k}`" not in text
               and k not in ("quantization", "lora", "hardware", "eval", "data", "training")]
    assert not missing


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_qlora_on_cuda_logs_gpu_memory_and_predicted_peak(run_config):
    pytest.importorskip("bitsandbytes")
    result = train(run_config(method="qlora", precision="bf16",
                              **{"training.max_steps": 3, "training.memory_budget_gb": None}))
    steps = read_steps(result.run_dir)
    assert all(len(s["peak_bytes"]) == 1 and s["peak_bytes"][0] > 0 for s in steps)
    assert all(s["allocated_bytes"][0] <= s["reserved_bytes"][0] for s in steps)
    assert result.measured_peak_bytes > 0 and result.predicted_peak_bytes > 0
    assert result.losses[-1] == result.losses[-1]


def test_model_id_from_the_local_hf_cache_offline(run_config, tiny_model_dir, tmp_path,
                                                  monkeypatch):
    import shutil

    import huggingface_hub.constants as hub

    cache = tmp_path / "hub"
    snapshot = cache / "models--tiny-org--tiny-qwen2" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_model_dir, snapshot)
    (cache / "models--tiny-org--tiny-qwen2" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-qwen2" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(cache))
    result = train(run_config(model="tiny-org/tiny-qwen2", **{"training.max_steps": 1}))
    from oomless.runtime.train.memlog import read_events

    events = [e["event"] for e in read_events(result.run_dir)]
    assert events[0] == "start" and events[-1] == "finish" and result.steps == 1
