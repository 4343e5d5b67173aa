"""`oomless estimate`, `models`, `gpus` through the real CLI entry point."""

import json
import subprocess
import sys

import pytest

from oomless.cli import main


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_estimate_json_schema(capsys):
    rc, out, _ = run_cli(capsys, "estimate", "qwen2.5-7b", "--method", "lora", "--gpu",
                         "a100-80gb", "--batch-size", "2", "--seq-len", "1024", "--json")
    assert rc == 0
    data = json.loads(out)
    for key in ("schema_version", "method", "model", "param_count", "trainable_params",
                "peak_phase", "peak_allocated_bytes", "peak_reserved_bytes",
                "device_peak_bytes", "breakdown", "components", "non_pytorch_bytes",
                "assumptions", "config", "gpu", "gpu_memory_bytes", "fits",
                "headroom_bytes", "host_ram_bytes"):
        assert key in data, key
    assert data["fits"] is True
    assert data["config"]["micro_batch_size"] == 2
    assert sum(data["components"].values()) == data["peak_allocated_bytes"]


def test_estimate_table_says_out_of_memory(capsys):
    rc, out, _ = run_cli(capsys, "estimate", "qwen2.5-7b", "--method", "full", "--gpu", "4090")
    assert rc == 0
    assert "OUT OF MEMORY" in out and "optimizer states" in out


def test_estimate_reads_run_config_yaml_and_flags_override(tmp_path, capsys):
    f = tmp_path / "oomless.yaml"
    f.write_text("model: glm-4-9b\nmethod: qlora\nseq_len: 1024\ngrad_ckpt: true\n"
                 "hardware:\n  gpu: rtx-4090\n")
    rc, out, _ = run_cli(capsys, "estimate", str(f), "--seq-len", "512", "--json")
    data = json.loads(out)
    assert rc == 0 and data["config"]["seq_len"] == 512 and data["config"]["method"] == "qlora"
    assert data["gpu"] == "rtx-4090"


@pytest.mark.parametrize("argv, message", [
    (["estimate", "qwen2.5-7bb"], "Closest catalog names: qwen2.5-7b"),
    (["estimate", "qwen2.5-7b", "--gpu", "a100-90gb"], "unknown GPU"),
    (["estimate", "qwen2.5-7b", "--gpu", "2080 super"], "Closest: rtx-2080-ti"),
    (["estimate", "qwen2.5-7b", "--gpu", "4090", "--gpu-memory-gb", "12"], "both name the GPU"),
    (["estimate", "qwen2.5-7b", "--method", "qlora", "--zero", "3", "--quant-storage", "uint8"],
     "QLoRA with ZeRO-3"),
    (["estimate", "qwen2.5-7b", "--offload", "optimizer"], "needs DeepSpeed ZeRO"),
    (["estimate", "qwen2.5-7b", "--lora-targets", "query,value"], "matches no linear layer"),
    (["estimate", "llama-2-70b", "--method", "full", "--zero", "3", "--offload", "all",
      "--gpu", "a100-80gbx8", "--host-ram-gb", "64"], "host RAM"),
])
def test_user_errors_exit_2_without_traceback(capsys, argv, message):
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2
    assert message in err
    assert "Traceback" not in err


def test_bad_yaml_key_names_key_and_line(tmp_path, capsys):
    f = tmp_path / "run.yaml"
    f.write_text("model: qwen2.5-7b\nmethod: lora\nbatchsize: 4\n")
    rc, _, err = run_cli(capsys, "estimate", str(f))
    assert rc == 2 and "run.yaml:3" in err and "'batchsize'" in err


def test_inference_vllm_and_hf(capsys):
    rc, out, _ = run_cli(capsys, "estimate", "qwen2.5-7b", "--inference", "--gpu", "rtx-a6000",
                         "--max-new-tokens", "512", "--seq-len", "2048", "--max-num-seqs", "64",
                         "--json")
    data = json.loads(out)
    assert rc == 0 and data["engine"] == "vllm"
    assert data["max_model_len"] == 2560 and 0 < data["gpu_memory_utilization"] < 0.95
    rc, out, _ = run_cli(capsys, "estimate", "qwen2.5-7b", "--inference", "--engine", "hf",
                         "--json")
    assert rc == 0 and json.loads(out)["kv_cache_bytes"] > 0


def test_models_and_gpus_json(capsys):
    rc, out, _ = run_cli(capsys, "models", "--json")
    models = json.loads(out)
    assert rc == 0 and len(models) >= 30
    assert any(m["name"] == "glm-4-9b" for m in models)
    rc, out, _ = run_cli(capsys, "gpus", "--json")
    gpus = json.loads(out)
    assert rc == 0 and len(gpus) >= 20


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "oomless", "gpus"], capture_output=True,
                         text=True)
    assert out.returncode == 0 and "a100-80gb" in out.stdout


def test_pure_bf16_with_zero_is_refused(capsys):
    rc, _, err = run_cli(capsys, "estimate", "qwen2.5-7b", "--precision", "pure-bf16",
                         "--zero", "2")
    assert rc == 2 and "pure-bf16 with DeepSpeed ZeRO" in err


@pytest.mark.parametrize(("argv", "total_bytes"), [
    (["--gpu", "12gb"], 12 * 10**9),
    (["--gpu", "24GiB"], 24 * 2**30),
    (["--gpu-memory-gb", "12"], 12 * 10**9),
])
def test_gpu_given_by_its_size(capsys, argv, total_bytes):
    rc, out, _ = run_cli(capsys, "estimate", "qwen2.5-0.5b", *argv, "--json")
    data = json.loads(out)
    assert rc == 0 and data["gpu_memory_bytes"] == total_bytes
    assert any("generic" in a and "compute capability 8.0" in a for a in data["assumptions"])
