"""Causes with numbers and quantified fixes, the seed 002 case among them."""

from __future__ import annotations

import json

import pytest
from diagnose_fixtures import FIXTURES, GiB, MiB, all_fixture_logs, as_bytes, read_fixture

from oomless.config import RunConfig, load_run_config
from oomless.diagnose import diagnose_text
from oomless.diagnose.predict import choose_cluster
from oomless.memory import estimate_training
from oomless.models.catalog import resolve_model


def finding(name: str, cfg: RunConfig | None = None, index: int = 0):
    return diagnose_text(read_fixture(name), cfg).findings[index]


def codes(items) -> list[str]:
    return [i.code for i in items]


def seed002_config() -> RunConfig:
    return load_run_config(FIXTURES / "seed002_oomless.yaml")


@pytest.mark.parametrize("name", ["seed002_torch2.log", "seed002_torch1.log"])
def test_seed002_with_its_config_gives_batch_4_accumulation_4_and_the_estimators_peak(name):
    cfg = seed002_config()
    f = finding(name, cfg)
    fix = f.fixes[0]
    assert fix.code == "micro_batch"
    assert fix.changes == {"micro_batch_size": 4, "grad_accum": 4}
    assert fix.text.startswith("micro batch 4, accumulation 4, effective batch 16")
    assert fix.keeps_training and fix.prediction == "estimator"
    # the GPU is the one the message printed: 39.39 GiB (an A100-40GB)
    assert abs(fix.gpu_memory_bytes - as_bytes("39.39", "GiB")) <= 0.01 * fix.gpu_memory_bytes
    cluster = choose_cluster(cfg, None, as_bytes("39.39", "GiB"))
    spec = resolve_model(cfg.model).spec
    after = estimate_training(spec, cfg.replace(micro_batch_size=4, grad_accum=4), cluster)
    before = estimate_training(spec, cfg, cluster)
    assert fix.predicted_peak_bytes == after.device_peak_bytes
    assert fix.fits is True and fix.predicted_peak_bytes <= fix.gpu_memory_bytes
    # it saves at least what the log says was missing (6.56 GiB asked, 3.18 GiB free)
    missing = as_bytes("6.56", "GiB") - as_bytes("3.18", "GiB")
    assert before.device_peak_bytes - after.device_peak_bytes >= missing
    assert f"predicted {after.device_peak_bytes / GiB:.2f} GiB of" in fix.summary


def test_seed002_without_a_config_reads_batch_and_accumulation_from_the_launch_line():
    f = finding("seed002_torch2.log")
    assert codes(f.causes)[0] == "activations"
    fix = f.fixes[0]
    assert fix.changes == {"micro_batch_size": 4, "grad_accum": 4}
    # "num_local_procs=8" in DeepSpeed's launcher line gives the GPU count
    assert "effective batch 16 × 8 GPUs = 128 unchanged" in fix.text
    assert fix.predicted_peak_bytes is None and fix.prediction == "none"


def test_seed002_notes_when_the_estimator_is_below_what_the_log_shows():
    cfg = seed002_config()
    d = diagnose_text(read_fixture("seed002_torch2.log"), cfg)
    cluster = choose_cluster(cfg, None, as_bytes("39.39", "GiB"))
    predicted = estimate_training(resolve_model(cfg.model).spec, cfg, cluster).device_peak_bytes
    seen = as_bytes("39.39", "GiB") - as_bytes("3.18", "GiB") + as_bytes("6.56", "GiB")
    notes = [n for n in d.notes if "estimator predicts" in n]
    assert bool(notes) == (predicted < seen)


def test_fragmentation_when_the_request_fits_in_reserved_but_unallocated_memory():
    f = finding("torch21_capacty_eval_fragmentation.log")
    assert codes(f.causes)[:2] == ["fragmentation", "evaluation"]
    fix = f.fixes[0]
    assert fix.code == "expandable_segments" and fix.prediction == "arithmetic"
    used = as_bytes("23.69", "GiB") - as_bytes("20.19", "MiB")
    expected = used - as_bytes("1.52", "GiB") + as_bytes("72.00", "MiB")
    assert fix.predicted_peak_bytes == expected and fix.fits


def test_evaluation_batch_from_the_trainer_banner_is_halved():
    f = finding("torch21_capacty_eval_fragmentation.log")
    assert next(c for c in f.causes if c.code == "evaluation").numbers["eval_batch_size"] == 16
    assert next(x for x in f.fixes if x.code == "eval_batch").changes == {"eval.batch_size": 8}


def test_launcher_and_deepspeed_context_become_notes():
    d = diagnose_text(read_fixture("host_torchrun_sigkill_loading.log"))
    assert "torchrun: rank 0 failed first (exit code -9)" in d.notes
    d = diagnose_text(read_fixture("deepspeed_stage3_step_oom.log"))
    assert any("allocator cache flushes (up to 3 per step)" in n for n in d.notes)


def test_host_event_with_an_offloading_config_sizes_host_ram():
    cfg = RunConfig(model="qwen2.5-7b", method="full", zero=3, offload="optimizer",
                    hardware={"gpu": "a100-80gb", "gpus_per_node": 8, "host_ram_gb": 64})
    f = diagnose_text(read_fixture("host_kernel_oom.log"), cfg).findings[0]
    fix = next(x for x in f.fixes if x.code == "host_ram_needed")
    spec = resolve_model("qwen2.5-7b").spec
    from oomless.api import cluster_for

    expected = estimate_training(spec, cfg, cluster_for(cfg)).host_ram_bytes
    assert fix.predicted_peak_bytes == expected and fix.gpu_memory_bytes == 64 * 10**9
    assert fix.fits == (expected <= 64 * 10**9)


def test_no_fragmentation_when_the_reserved_slack_could_not_hold_the_request():
    assert "fragmentation" not in codes(finding("seed002_torch2.log").causes)


def test_other_processes_are_named_largest_first_and_tiny_ones_left_out():
    f = finding("torch2_other_processes.log")
    assert f.causes[0].code == "other_process"
    fix = f.fixes[0]
    assert fix.code == "free_gpu"
    assert fix.text.index("3053273") < fix.text.index("3120922")
    assert "644963" not in fix.text
    others = as_bytes("5.59", "MiB") * 2 + as_bytes("312.00", "MiB") + as_bytes("29.04", "GiB") + \
        as_bytes("14.74", "GiB")
    assert f.causes[0].numbers["others_bytes"] == others
    assert fix.fits and fix.predicted_peak_bytes < 4 * GiB


def test_memory_fraction_cap():
    f = finding("torch1_allowed.log")
    assert f.causes[0].code == "memory_fraction"
    assert "fragmentation" not in codes(f.causes)  # the free memory is above the cap, not usable


def test_multi_rank_replicas_logits_and_long_sample():
    d = diagnose_text(read_fixture("torch2_multirank_ddp_logits.log"))
    assert len(d.findings) == 4
    for f in d.findings:
        assert codes(f.causes)[0] == "replicas"
        assert {"logits", "long_sample", "activations"} <= set(codes(f.causes))
        zero3 = next(x for x in f.fixes if x.code == "zero3")
        assert "over 4 GPUs" in zero3.text
        assert next(x for x in f.fixes if x.code == "micro_batch").changes == {
            "micro_batch_size": 2, "grad_accum": 8}


def test_logits_recognised_by_size_with_a_config():
    spec = resolve_model("qwen2.5-0.5b").spec
    cfg = RunConfig(model="qwen2.5-0.5b", micro_batch_size=4, seq_len=2048)
    request = 4 * 2048 * spec.vocab_size * 4
    text = (f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {request / GiB:.2f} GiB. GPU 0 "
            "has a total capacity of 23.55 GiB of which 2.31 GiB is free. Including non-PyTorch memory, "
            "this process has 21.23 GiB memory in use. Of the allocated memory 20.70 GiB is allocated by "
            "PyTorch, and 110.00 MiB is reserved by PyTorch but unallocated.")
    f = diagnose_text(text, cfg).findings[0]
    logits = next(c for c in f.causes if c.code == "logits")
    assert logits.numbers["tokens"] == 4 * 2048
    chunked = next(x for x in f.fixes if x.code == "chunked_loss")
    assert chunked.predicted_peak_bytes is not None and chunked.prediction == "arithmetic"


def test_zero3_already_in_use_suggests_offload_instead():
    f = finding("deepspeed_stage3_step_oom.log")
    assert "zero3" not in codes(f.fixes) and "offload" in codes(f.fixes)
    assert codes(f.causes)[:2] == ["fragmentation", "optimizer_states"]


def test_seed004_vllm_utilization_too_high_for_what_else_is_on_the_gpu():
    f = finding("seed004_vllm_scoring.log")
    assert codes(f.causes)[0] == "vllm_utilization"
    assert "generation" in codes(f.causes)
    fix = f.fixes[0]
    new_u = fix.changes["gpu_memory_utilization"]
    total = as_bytes("47.43", "GiB")
    request = as_bytes("1.16", "GiB")
    missing = request - as_bytes("601.06", "MiB")
    assert new_u < 0.95
    # what is left outside vLLM's budget grows by at least the missing bytes plus the request
    assert (0.95 - new_u) * total >= missing + request
    assert fix.fits and fix.predicted_peak_bytes <= total


def test_vllm_free_memory_fix_fits_next_to_the_other_processes():
    f = finding("vllm_free_memory.log")
    fix = f.fixes[0]
    total, free = 23.43 * GiB, 3.25 * GiB
    assert fix.code == "gpu_memory_utilization"
    assert fix.changes["gpu_memory_utilization"] * total <= free - 512 * MiB
    assert fix.fits


def test_vllm_max_len_fixes():
    v1 = finding("vllm_max_len_v1.log")
    assert v1.causes[0].code == "vllm_max_len"
    assert next(x for x in v1.fixes if x.code == "max_model_len").changes == {"max_model_len": 114432}
    v0 = finding("vllm_max_len_v0.log")
    util = next(x for x in v0.fixes if x.code == "gpu_memory_utilization")
    assert util.changes["gpu_memory_utilization"] > 0.90
    assert next(x for x in v0.fixes if x.code == "max_model_len").changes == {"max_model_len": 4752}


def test_vllm_no_kv_cache_when_the_weights_alone_fill_the_gpu():
    f = finding("vllm_no_kv_cache.log")
    assert f.causes[0].code == "vllm_no_kv_cache"
    # 5.43 GiB of weights + 1.42 GiB of activations do not fit 6 GiB at any utilization
    assert "gpu_memory_utilization" not in codes(f.fixes)
    assert "quantize" in codes(f.fixes)
    tp = next(x for x in f.fixes if x.code == "tensor_parallel_size")
    assert tp.changes == {"tensor_parallel_size": 2}  # what `estimate --inference` takes


def test_the_tensor_parallel_fix_is_expressible_by_estimate(capsys):
    """The serving fix names vLLM's own setting; estimate --inference sizes it."""
    from oomless.cli import main

    f = finding("vllm_no_kv_cache.log")
    tp = next(x for x in f.fixes if x.code == "tensor_parallel_size")
    flag = "--" + next(iter(tp.changes)).replace("_", "-")
    assert main(["estimate", "qwen2.5-7b-instruct", "--inference", "--gpu", "l4x2",
                 flag, str(tp.changes["tensor_parallel_size"]), "--max-model-len", "2048",
                 "--json"]) == 0
    assert '"tensor_parallel_size": 2' in capsys.readouterr().out


@pytest.mark.parametrize("name, fix_code", [
    ("host_kernel_oom.log", "host_ram"),
    ("host_dataloader_killed.log", "dataloader_workers"),
    ("host_torchrun_sigkill_loading.log", "load_to_gpu"),
    ("host_cpu_allocator.log", "load_to_gpu"),
])
def test_host_memory_causes_and_fixes(name, fix_code):
    f = finding(name)
    assert f.causes[0].code == "host_ram"
    assert f.fixes[0].code == fix_code


def test_nccl_cause():
    f = finding("nccl_oom.log")
    assert f.causes[0].code == "nccl_buffers"


def test_config_with_a_named_gpu_predicts_for_that_gpu():
    cfg = seed002_config()
    cluster = choose_cluster(cfg, "a100-80gb", None)
    d = diagnose_text(read_fixture("seed002_torch2.log"), cfg, cluster)
    fix = d.findings[0].fixes[0]
    assert fix.gpu_memory_bytes == cluster.gpu.memory_bytes
    assert d.gpu == cluster.gpu.display_name and cluster.world_size == 8


@pytest.mark.parametrize("name", all_fixture_logs())
def test_training_preserving_fixes_come_first_and_json_round_trips(name):
    d = diagnose_text(read_fixture(name))
    for f in d.findings:
        keeps = [x.keeps_training for x in f.fixes]
        assert keeps == sorted(keeps, reverse=True)
    data = json.loads(json.dumps(d.to_dict()))
    assert data["found"] == bool(d.findings)
    for event in data["events"]:
        for key, value in event["event"]["numbers"].items():
            if key.endswith("_bytes"):
                assert isinstance(value, int)


def test_config_with_several_gpus_and_no_zero3_shows_the_replicated_states():
    # seed 001: GLM-4-9B LoRA with plain data parallelism on four RTX 4090s
    cfg = RunConfig(model="glm-4-9b-chat", method="lora", micro_batch_size=1, seq_len=2048,
                    hardware={"gpu": "4090", "gpus_per_node": 4})
    text = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.16 GiB. GPU 0 has a total "
            "capacity of 23.65 GiB of which 601.06 MiB is free. Including non-PyTorch memory, this process "
            "has 23.03 GiB memory in use. Of the allocated memory 22.43 GiB is allocated by PyTorch, and "
            "102.00 MiB is reserved by PyTorch but unallocated.")
    f = diagnose_text(text, cfg).findings[0]
    cause = next(c for c in f.causes if c.code == "replicas")
    assert cause.numbers["world_size"] == 4
    assert cause.numbers["sharded_states_bytes"] < cause.numbers["states_bytes"]
    zero3 = next(x for x in f.fixes if x.code == "zero3")
    spec = resolve_model("glm-4-9b-chat").spec
    from oomless.api import cluster_for

    expected = estimate_training(spec, cfg.replace(zero=3), cluster_for(cfg)).device_peak_bytes
    assert zero3.predicted_peak_bytes == expected


def test_every_fix_carries_a_prediction_with_a_config_for_training_events():
    cfg = seed002_config()
    for name in ("seed002_torch2.log", "torch21_capacty_eval_fragmentation.log",
                 "torch2_other_processes.log", "deepspeed_stage3_step_oom.log"):
        for f in diagnose_text(read_fixture(name), cfg).findings:
            for fix in f.fixes:
                assert fix.predicted_peak_bytes is not None, (name, fix.code)
