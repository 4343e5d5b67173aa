"""vLLM engine arguments from the memory model (torch-free; runs without vLLM or a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from oomless.cli import main
from oomless.errors import ConfigError
from oomless.models.catalog import resolve_model
from oomless.models.hardware import get_gpu
from oomless.runtime.infer.core import InferOptions
from oomless.runtime.infer.vllm import ENGINE_CONTEXT_BYTES, engine_args, gpu_spec_for
from oomless.units import GiB

SPEC = resolve_model("qwen2.5-7b-instruct").spec
A6000 = get_gpu("a6000")


def _opts(**kw) -> InferOptions:
    return InferOptions(**{"model": "qwen2.5-7b-instruct", "cutoff_len": 1024,
                           "max_new_tokens": 512, **kw})


def test_seed_004_scoring_on_an_a6000_asks_for_what_it_needs() -> None:
    args, budget = engine_args(_opts(), SPEC, A6000)
    assert args["max_model_len"] == 1024 + 512
    assert args["enable_prefix_caching"] is True and args["enable_lora"] is False
    assert args["gpu_memory_utilization"] < 0.95, "not the fixed 0.95 that filled the card"
    assert budget.num_blocks * 16 >= budget.max_num_seqs * args["max_model_len"]


def test_memory_used_by_others_lowers_the_utilization_below_what_is_free() -> None:
    alone, _ = engine_args(_opts(), SPEC, A6000)
    used = 20 * GiB
    shared, budget = engine_args(_opts(), SPEC, A6000, used_by_others_bytes=used)
    assert shared["gpu_memory_utilization"] < alone["gpu_memory_utilization"]
    # vLLM refuses to start when the budget exceeds what is free after its own context
    assert budget.budget_bytes <= A6000.memory_bytes - used - ENGINE_CONTEXT_BYTES


def test_a_given_utilization_that_cannot_start_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization 0.95 .* fail at start-up"):
        engine_args(_opts(gpu_memory_utilization=0.95), SPEC, A6000,
                    used_by_others_bytes=20 * GiB)


def test_a_model_that_cannot_fit_is_refused_with_numbers() -> None:
    with pytest.raises(ConfigError, match=r"needs .* GiB before any KV cache.*--cutoff-len"):
        engine_args(_opts(), SPEC, get_gpu("4090"), used_by_others_bytes=12 * GiB)


def test_lora_adapter_rank_is_rounded_up_to_a_vllm_rank(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 12, "peft_type": "LORA"}))
    args, budget = engine_args(_opts(adapter=str(adapter)), SPEC, A6000)
    plain, plain_budget = engine_args(_opts(), SPEC, A6000)
    assert args["enable_lora"] is True and args["max_lora_rank"] == 16
    assert budget.weights_bytes > plain_budget.weights_bytes, "LoRA slots cost memory"
    with pytest.raises(ConfigError, match="cannot read adapter_config.json"):
        engine_args(_opts(adapter=str(tmp_path)), SPEC, A6000)


def test_nvml_names_map_to_the_catalog_with_the_real_total() -> None:
    gpu = gpu_spec_for("NVIDIA RTX A6000", 51_527_024_640)
    assert gpu.name == A6000.name and gpu.memory_bytes == 51_527_024_640
    unknown = gpu_spec_for("Some Future GPU", 10 * GiB)
    assert unknown.memory_bytes == 10 * GiB


def test_cli_engine_args_for_a_catalog_gpu(capsys) -> None:
    argv = ["score", "--model", "qwen2.5-7b-instruct", "--engine-args", "--gpu", "a6000",
            "--gpu-used-gb", "10"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    printed = json.loads(text[: text.rindex("}") + 1])
    assert printed["max_model_len"] == 1024 + 16 and 0 < printed["gpu_memory_utilization"] < 1
    assert "KV cache" in text
    assert main(["score", "--model", "qwen2.5-7b-instruct"]) == 2
    assert "needs a dataset and --out" in capsys.readouterr().err


def test_engine_args_leave_torch_out() -> None:
    code = ("import sys; from oomless.cli import main; main(['infer', 'x', '--model', "
            "'qwen2.5-7b-instruct', '--out', 'o', '--engine-args', '--gpu', 'a100-80gb']); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def _vllm_and_cuda() -> bool:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _vllm_and_cuda(), reason="needs vLLM and a CUDA GPU")
def test_vllm_backend_runs_the_tiny_model(tiny_model: Path, tmp_path: Path) -> None:
    from infer_fixtures import RECORDS, read_rows, write_jsonl

    from oomless.runtime.infer.jobs import infer_file

    data = write_jsonl(tmp_path / "d.jsonl", RECORDS)
    out = tmp_path / "out.jsonl"
    opts = InferOptions(model=str(tiny_model), backend="vllm", cutoff_len=64,
                        max_new_tokens=8, chunk_size=4)
    summary = infer_file(data, out, opts)
    assert summary.engine["backend"] == "vllm" and len(read_rows(out)) == len(RECORDS)
    assert 0 < summary.engine["gpu_memory_utilization"] < 0.9
