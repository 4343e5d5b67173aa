"""Files that do not train (tests/fixtures/nontraining, sources in its README) are
recognised for what they run, get that memory, and never a fix: no training key is
ever added to them (oomless.check.tasks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomless.check import foreign_keys as K
from oomless.check.checker import CheckOptions, check
from oomless.check.sources import load_source
from oomless.check.tasks import (
    LF_EVAL_KEYS,
    LF_EXPORT_KEYS,
    LF_INFER_KEYS,
    LF_TRAIN_SIGNS,
    file_task,
)
from oomless.cli import main
from oomless.units import GiB

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TASKS = FIXTURES / "nontraining"
LLAMA3 = "llama-3.1-8b-instruct"  # Meta-Llama-3-8B-Instruct's shapes
KINDS = {
    "lf_merge_llama3_lora_sft.yaml": "export",
    "lf_export_llama3_gptq.yaml": "export",
    "lf_inference_llama3_lora_sft.yaml": "inference",
    "lf_inference_llama3_vllm.yaml": "inference",
    "lf_eval_llama3_lora.yaml": "evaluation",
    "lf_predict_llama3_lora.yaml": "prediction",
    "vllm_serve_qwen25_7b_tp2_bnb.yaml": "vllm-serve",
}


def test_every_file_is_listed_with_its_source():
    readme = (TASKS / "README.md").read_text()
    names = {p.name for p in TASKS.glob("*.yaml")}
    assert names == set(KINDS) and all(n in readme for n in names)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_the_file_is_read_for_what_it_runs(name):
    assert file_task(load_source(TASKS / name, "main")) == KINDS[name]


def test_every_training_yaml_of_the_corpus_still_trains():
    for path in (FIXTURES / "real_configs").glob("*/*.yaml"):
        assert file_task(load_source(path, "main")) == "train", path.name


def test_the_keys_are_llamafactorys_own():
    known = K.keys_of("llamafactory", *K.TRAINING_ARGUMENTS)
    for key in LF_EXPORT_KEYS | LF_INFER_KEYS | LF_EVAL_KEYS | LF_TRAIN_SIGNS:
        assert key in known, key


@pytest.mark.parametrize("name,gpu", [
    ("lf_merge_llama3_lora_sft.yaml", "rtx-4090"), ("lf_export_llama3_gptq.yaml", "rtx-4090"),
    ("lf_inference_llama3_lora_sft.yaml", "rtx-4090"),
    ("lf_inference_llama3_vllm.yaml", "rtx-4090"), ("lf_inference_llama3_vllm.yaml", "a100-80gb"),
    ("lf_eval_llama3_lora.yaml", "rtx-4090"), ("lf_predict_llama3_lora.yaml", "rtx-3060"),
])
def test_no_fix_and_no_training_key_is_ever_added(name, gpu, capsys):
    rc = main(["check", str(TASKS / name), "--gpu", gpu, "--model", LLAMA3])
    out = capsys.readouterr().out
    assert rc in (0, 1)
    assert "--- a/" not in out and "+++ b/" not in out  # no diff printed
    result = check(CheckOptions(files=(str(TASKS / name),), gpu=gpu, model=LLAMA3))
    assert result.task == KINDS[name] and result.fix is None and not result.diffs
    assert rc == result.exit_code


def _check(name: str, gpu: str):
    return check(CheckOptions(files=(str(TASKS / name),), gpu=gpu, model=LLAMA3))


def test_a_merge_on_the_cpu_needs_no_gpu_and_says_the_host_ram():
    r = _check("lf_merge_llama3_lora_sft.yaml", "rtx-4090")
    assert r.device_peak_bytes == 0 and r.verdict == "fits"
    # Llama-3-8B: 8.03 B parameters × 2 bytes
    assert any("15.0 GiB of 16-bit weights" in n for n in r.notes)


def test_hf_inference_is_the_weights_and_a_kv_cache_not_training():
    r = _check("lf_inference_llama3_lora_sft.yaml", "rtx-4090")
    weights = 8.03e9 * 2
    # weights + one 3072-token KV cache (32 layers × 8 KV heads × 128 × 2 × 2 bytes) and
    # prefill activations: far below what LoRA training of the same model takes
    assert weights < r.device_peak_bytes < weights + 4 * GiB
    assert r.peak_phase == "generation" and r.verdict == "fits"


def test_vllm_inference_is_held_to_its_utilization():
    small = _check("lf_inference_llama3_vllm.yaml", "rtx-4090")  # 0.7 × 24 GiB < 16 GB weights
    big = _check("lf_inference_llama3_vllm.yaml", "a100-80gb")
    assert small.exit_code == 1 and small.gpu_memory_bytes < 0.71 * 24 * GiB
    assert big.verdict == "fits" and big.peak_phase == "vllm start-up"
    assert any("vllm_maxlen" in n for n in small.notes)


def test_a_vllm_config_over_two_gpus_with_bitsandbytes_is_not_guessed():
    with pytest.raises(Exception, match="not supported yet: vLLM quantization 'bitsandbytes'"):
        _check("vllm_serve_qwen25_7b_tp2_bnb.yaml", "a100-80gb")
