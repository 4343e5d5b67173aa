"""`oomless diagnose` on logs users pasted into GitHub issues (tests/fixtures/oom_logs/real,
sources in its README): the event, its numbers, and the cause and fix the thread (or the
numbers) point to."""

from __future__ import annotations

import pytest
from diagnose_fixtures import FIXTURES, GiB, MiB, as_bytes

from oomless.diagnose import diagnose_text
from oomless.diagnose.events import CUDA_ERROR_OOM, CUDA_OOM, VLLM_MAX_LEN, VLLM_NO_KV

REAL = FIXTURES / "real"


def diagnose(name: str):
    return diagnose_text((REAL / name).read_bytes().decode("utf-8", errors="replace"))


def only(name: str):
    d = diagnose(name)
    assert len(d.findings) == 1, [f.event for f in d.findings]
    return d.findings[0]


def causes(f) -> list[str]:
    return [c.code for c in f.causes]


def fixes(f) -> list[str]:
    return [x.code for x in f.fixes]


def near(value, number: str, unit: str) -> bool:
    return abs(value - as_bytes(number, unit)) <= as_bytes("0.01", unit)


@pytest.mark.parametrize("name,kind,requested,total", [
    ("glm4_785_glm4v_4x4090_rank3.log", CUDA_OOM, ("986.00", "MiB"), ("23.64", "GiB")),
    ("glm4_408_glm4v_rank5_other_process_sigterm.log", CUDA_OOM, ("66.00", "MiB"), ("79.14", "GiB")),
    ("glm4_729_a5000_other_process.log", CUDA_OOM, ("108.00", "MiB"), ("23.68", "GiB")),
    ("chatglm_finetuning_23_v100_lora.log", CUDA_OOM, None, ("31.75", "GiB")),
    ("chatglm3_finetuning_13_4090.log", CUDA_OOM, ("1016.00", "MiB"), ("23.99", "GiB")),
    ("chatglm3_finetuning_31_a10_progressbar.log", CUDA_OOM, None, ("22.02", "GiB")),
    ("transformers_tasks_48_wrapped_24gb.log", CUDA_OOM, None, ("24.00", "GiB")),
    ("kohya_623_pt1x_runtimeerror.log", CUDA_OOM, None, ("8.00", "GiB")),
    ("xtuner_963_llava_llama3_8b_30gib_alloc.log", CUDA_OOM, ("30.10", "GiB"), ("79.14", "GiB")),
    ("llamafactory_6800_qwen2vl_full_dpo_8xv100_cross_entropy.log", CUDA_OOM, ("4.64", "GiB"),
     ("31.74", "GiB")),
    ("trl_1626_custom_dpo_20gib_no_traceback.log", CUDA_OOM, ("20.39", "GiB"), ("22.19", "GiB")),
    ("trl_1667_mistral7b_qlora_dpo_a100_truncated.log", CUDA_OOM, ("112.00", "MiB"), None),
    ("unsloth_1390_qwen2vl_vision_sdpa_272gib.log", CUDA_OOM, ("272.00", "GiB"), ("79.15", "GiB")),
    ("llamafactory_9331_qwen25vl_5090_acceleratorerror.log", CUDA_ERROR_OOM, None, None),
    ("lmmr1_42_qwen2vl_7b_vllm_cumem_allocator.log", CUDA_ERROR_OOM, None, None),
])
def test_the_event_and_its_numbers_are_read(name, kind, requested, total):
    f = only(name)
    assert f.event.kind == kind
    if requested:
        assert near(f.event.numbers["requested_bytes"], *requested)
    if total:
        assert near(f.event.numbers["total_bytes"], *total)


@pytest.mark.parametrize("name", [
    "tensorflowtts_416_tf_bfc_eval_oom.log",  # TensorFlow's allocator, not PyTorch
    "gemma_54_jax_resource_exhausted_t4.log",  # JAX / XLA
    "deepspeed_2870_moe_zero3_assertion.log",  # a configuration assertion
    "moellava_44_moe_param_group_assertion.log",
    "deepspeed_2899_galactica30b_zero3_multinode.log",  # memory reports, no failure
    "pandallm_25_a100_7b_zero_offload.log",
    "deepspeed_6679_lora_zero3_cpuadam_init.log",
    "transformers_11139_bart_predict_beam6.log",  # the OOM line is not in the excerpt
    "msswift_1122_glm4v_step80_collapsed.log",
])
def test_no_out_of_memory_event_where_the_log_shows_none(name):
    assert not diagnose(name).found


def test_other_process_holding_memory_is_named():
    f = only("glm4_408_glm4v_rank5_other_process_sigterm.log")
    assert f.event.rank == 5 and causes(f)[0] == "other_process"
    assert "process 8674" in f.causes[0].evidence and fixes(f)[0] == "free_gpu"


def test_free_memory_far_above_the_request_is_not_the_batch():
    f = only("chatglm_finetuning_28_wsl_free_but_oom.log")
    assert causes(f)[0] == "free_but_failed"
    assert "micro_batch" not in fixes(f) and fixes(f) == ["environment"]


def test_logits_in_cross_entropy():
    f = only("llamafactory_6800_qwen2vl_full_dpo_8xv100_cross_entropy.log")
    assert "logits" in causes(f) and f.event.phase == "forward"


def test_vision_tower_attention_names_the_image_size_not_the_batch():
    f = only("unsloth_1390_qwen2vl_vision_sdpa_272gib.log")
    assert f.event.phase == "forward"  # read from frames without a "Traceback" header
    assert causes(f) == ["vision_attention"]
    patches = f.causes[0].numbers["patches"]
    assert patches ** 2 * 16 * 2 <= 272 * GiB < (patches + 1) ** 2 * 16 * 2
    assert fixes(f) == ["image_size"] and f.fixes[0].changes["image_max_pixels"] > 0


def test_vllm_negative_kv_cache_without_the_error_line():
    f = only("vllm_13882_qwen25_7b_rtx4060_negative_kv.log")
    assert f.event.kind == VLLM_NO_KV and f.event.line == 4
    util = f.fixes[0]
    assert util.code == "gpu_memory_utilization" and util.domain == "serving"
    assert util.changes["gpu_memory_utilization"] == 0.95  # was 0.70 on an 8 GiB card
    weights, non_torch, act = 5.20 * GiB, 0.03 * GiB, 1.42 * GiB
    assert 0.95 * 8 * GiB - (weights + non_torch + act) > 0


@pytest.mark.parametrize("name", ["vllm_10439_qwen25_05b_docker_no_cache_blocks.log",
                                  "vllm_27508_gptoss120b_h100_v1_kv_check.log",
                                  "vllm_4429_deepseek33b_2xl40_tp2.log"])
def test_no_cache_blocks_raises_the_utilization(name):
    f = only(name)
    assert f.event.kind == VLLM_NO_KV
    assert fixes(f)[0] == "gpu_memory_utilization" and "raise" in f.fixes[0].text


@pytest.mark.parametrize("name,length,tokens", [
    ("vllm_qwen3_295_qwen15_7b_max_seq_len.log", 32768, 7344),
    ("vllm_14452_dual_rtx5090_max_seq_len_60000.log", 60000, 58384),
    ("openrlhf_336_llama3_70b_ppo_ray_kv.log", None, 378 * 16),  # "# GPU blocks: 378"
])
def test_max_model_len_longer_than_the_kv_cache(name, length, tokens):
    f = only(name)
    assert f.event.kind == VLLM_MAX_LEN
    assert f.event.numbers.get("max_model_len") == length
    by_code = {x.code: x for x in f.fixes}
    assert by_code["max_model_len"].changes == {"max_model_len": tokens}
    assert by_code["gpu_memory_utilization"].domain == "serving"


def test_vllm_worker_oom_gets_serving_advice():
    f = only("lmmr1_42_qwen2vl_7b_vllm_cumem_allocator.log")
    assert causes(f)[0] == "vllm_runtime"
    assert set(fixes(f)) == {"max_num_seqs", "max_model_len", "gpu_memory_utilization"}
    assert all(x.domain == "serving" for x in f.fixes)


def test_no_serving_fix_is_labelled_as_changing_the_training():
    import io

    from rich.console import Console

    from oomless.diagnose.render import render

    for path in sorted(REAL.glob("*.log")):
        d = diagnose_text(path.read_bytes().decode("utf-8", errors="replace"))
        out = io.StringIO()
        render(d, Console(file=out, width=200))
        for f in d.findings:
            serving = f.event.kind in (VLLM_NO_KV, VLLM_MAX_LEN) or f.event.library == "vllm"
            if serving:
                assert all(x.domain != "training" for x in f.fixes), path.name
        if any(x.domain == "serving" for f in d.findings for x in f.fixes):
            assert "changes the training" not in out.getvalue(), path.name


def test_at_least_twenty_real_logs():
    assert len(list(REAL.glob("*.log"))) >= 20
    readme = (REAL / "README.md").read_text()
    for path in REAL.glob("*.log"):
        assert path.name in readme


def test_truncated_message_keeps_its_request():
    f = only("trl_1667_mistral7b_qlora_dpo_a100_truncated.log")
    assert f.event.numbers == {"requested_bytes": 112 * MiB}
