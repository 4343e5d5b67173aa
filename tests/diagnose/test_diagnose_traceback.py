"""diagnose reads the phase from the frames around the error (loading, forward,
backward, optimizer step, evaluation, vLLM sampler warm-up and CUDA graphs), flags a
request larger than the GPU as bug-shaped, names other processes' memory and gives a
serving log serving fixes only — on real logs (tests/fixtures/oom_logs/real, sources in
its README, "Added for the phase …")."""

from __future__ import annotations

import pytest
from diagnose_fixtures import FIXTURES, GiB, as_bytes

from oomless.diagnose import diagnose_text
from oomless.diagnose.events import CUDA_ERROR_OOM, CUDA_OOM, VLLM_SAMPLER

REAL = FIXTURES / "real"


def findings(name: str):
    return diagnose_text((REAL / name).read_bytes().decode("utf-8", errors="replace")).findings


def only(name: str):
    (f,) = findings(name)
    return f


def codes(items) -> list[str]:
    return [x.code for x in items]


@pytest.mark.parametrize("name,kind,phase", [
    ("trl_2776_grpo_adamw_step_h20.log", CUDA_OOM, "optimizer_step"),
    ("llm2vec_52_from_pretrained_cuda_error.log", CUDA_ERROR_OOM, "model_load"),
    ("visfly_9_backward_8gb.log", CUDA_OOM, "backward"),
    ("cylinder3d_109_backward_t4_progress.log", CUDA_OOM, "backward"),
    ("pytorch_18313_backward_cuda_error_1080ti.log", CUDA_ERROR_OOM, "backward"),
    ("czsl_7_evaluate_predictions_pt1x.log", CUDA_OOM, "evaluation"),
    ("vllm_19186_cuda_graph_capture_cuda_error.log", CUDA_ERROR_OOM, "vllm_cuda_graphs"),
    ("llmd_787_qwen3_32b_tp2_sampler_warmup.log", VLLM_SAMPLER, "vllm_sampler_warmup"),
])
def test_the_phase_comes_from_the_frames(name, kind, phase):
    f = only(name)
    assert (f.event.kind, f.event.phase) == (kind, phase)


def test_an_optimizer_step_oom_is_not_called_activations():
    f = only("trl_2776_grpo_adamw_step_h20.log")
    assert codes(f.causes)[0] == "optimizer_states" and "activations" not in codes(f.causes)
    assert "micro_batch" not in codes(f.fixes)


def test_a_loading_oom_is_the_model_size_not_the_batch():
    f = only("llm2vec_52_from_pretrained_cuda_error.log")
    assert codes(f.causes)[0] == "model_too_large" and "micro_batch" not in codes(f.fixes)


def test_a_request_larger_than_the_gpu_is_bug_shaped_not_a_batch_to_halve():
    f = only("framepack_369_30gib_on_11gib.log")
    req, total = f.event.numbers["requested_bytes"], f.event.numbers["total_bytes"]
    assert abs(req - as_bytes("30.29", "GiB")) < 0.01 * GiB and req > total
    assert codes(f.causes) == ["oversized_request"]
    assert "micro_batch" not in codes(f.fixes) and codes(f.fixes)[0] == "check_lengths"
    assert "2.8×" in f.causes[0].evidence  # 30.29 / 10.74


def test_a_request_just_under_the_gpu_is_not_flagged():
    f = only("d3dp_9_eval_23gib_request_3090.log")  # 23.11 GiB of 23.70 GiB
    assert "oversized_request" not in codes(f.causes)


def test_other_processes_are_named_with_their_memory():
    f = only("fireredtts2_17_two_other_processes_12gb.log")
    assert codes(f.causes)[0] == "other_process"
    assert "process 3893521" in f.causes[0].evidence and "process 1493972" in f.causes[0].evidence
    assert codes(f.fixes)[0] == "free_gpu"


@pytest.mark.parametrize("name", ["vllm_14452_rtx5090_tp8_sampler_warmup_1024.log",
                                  "vllm_26278_elastic_ep_sampler_warmup_95gib.log",
                                  "llmd_787_qwen3_32b_tp2_sampler_warmup.log"])
def test_the_sampler_warm_up_gets_vllms_own_advice(name):
    sampler = [f for f in findings(name) if f.event.kind == VLLM_SAMPLER]
    assert len(sampler) == 1
    f = sampler[0]
    assert f.event.numbers["dummy_requests"] == 1024 and codes(f.causes) == ["vllm_sampler"]
    assert codes(f.fixes) == ["max_num_seqs", "gpu_memory_utilization"]
    assert f.fixes[0].changes == {"max_num_seqs": 512}


@pytest.mark.parametrize("name", ["vllm_15105_v080_tp2_3090_own_worker_process.log",
                                  "vllm_26278_elastic_ep_sampler_warmup_95gib.log",
                                  "vllm_19186_cuda_graph_capture_cuda_error.log",
                                  "vllm_14452_rtx5090_tp8_sampler_warmup_1024.log"])
def test_a_serving_log_gets_serving_fixes_only(name):
    found = findings(name)
    assert found
    for f in found:
        assert all(x.domain != "training" for x in f.fixes), (f.event.message, f.fixes)
        assert "micro_batch" not in codes(f.fixes)


def test_cuda_graph_capture_gets_eager_mode_and_a_lower_utilization():
    f = only("vllm_19186_cuda_graph_capture_cuda_error.log")
    assert codes(f.causes)[0] == "vllm_cuda_graphs"
    assert {"enforce_eager", "gpu_memory_utilization"} <= set(codes(f.fixes))


def test_the_oldest_wording_is_read():
    f = only("pytorch_examples_12_thc_runtime_error_2.log")  # PyTorch 0.1 THC
    assert f.event.kind == CUDA_ERROR_OOM


def test_a_message_inside_json_is_read():
    f = only("gladia_802_json_detail_20_samples.log")
    assert f.event.numbers["requested_bytes"] == 20 * GiB


def test_the_one_process_listed_in_a_container_is_this_process_not_another():
    # NVML lists host pids inside a container: "Process 2271801 has 23.44 GiB" is the
    # failing rank itself (22.87 GiB allocated by its PyTorch + its CUDA context)
    f = only("llamafactory_7781_eval_predict_rank6_4090.log")
    assert f.event.rank == 6 and f.event.device == 6
    assert abs(f.event.numbers["requested_bytes"] - as_bytes("270.00", "MiB")) < 1024
    assert "other_process" not in codes(f.causes)
