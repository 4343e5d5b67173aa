"""vLLM past one GPU: per-rank weights, KV cache and buffers against vLLM's own logs and
its sharding rules (vllm/model_executor/layers/linear.py, vocab_parallel_embedding.py,
vllm/distributed/utils.py get_pp_indices)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomless.cli import main
from oomless.errors import ConfigError
from oomless.memory.inference import EngineRequest, smallest_fitting_parallel, vllm_engine_args
from oomless.memory.vllm_parallel import (
    CUSTOM_AR_BYTES,
    VllmParallel,
    check_parallel,
    comm_buffer_bytes,
    kv_heads_per_rank,
    stage_layers,
    stage_params,
    weight_bytes_per_gpu,
)
from oomless.models.catalog import resolve_model
from oomless.models.hardware import get_gpu
from oomless.units import GiB

QWEN32 = resolve_model("qwen2.5-32b").spec
ARGV = ["estimate", "qwen2.5-32b", "--inference", "--engine", "vllm", "--gpu", "l40sx2",
        "--tensor-parallel-size", "2", "--max-model-len", "10000",
        "--gpu-memory-utilization", "0.9"]


def test_qwen25_32b_tp2_on_two_l40s_matches_vllms_log(capsys):
    """vllm-project/vllm#15815: 'model weights take 30.71GiB ... the rest of the memory
    reserved for KV Cache is 7.71GiB' on each of two L40S."""
    assert main([*ARGV, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["weights_bytes"] / GiB == pytest.approx(30.71, rel=0.03)
    assert out["kv_cache_bytes"] / GiB == pytest.approx(7.71, rel=0.15)
    assert out["fits"] and out["engine_args"]["tensor_parallel_size"] == 2
    assert main(ARGV) == 0
    assert "FITS" in capsys.readouterr().out


def test_one_gpu_is_out_of_memory_and_the_parallel_size_that_fits_is_said(capsys):
    argv = [a for a in ARGV if a not in ("--tensor-parallel-size", "2")]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert not out["fits"] and out["suggested_parallel"] == {"tensor_parallel_size": 2}
    assert main(argv) == 0
    assert "--tensor-parallel-size 2" in capsys.readouterr().out


def test_without_parallelism_the_weights_are_the_parameters():
    assert weight_bytes_per_gpu(QWEN32, VllmParallel()) == QWEN32.param_count * 2


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_shards_sum_to_the_model_plus_what_every_rank_repeats(tp):
    """Norms and row-parallel biases are whole on every rank, KV heads repeat below TP,
    the vocabulary is padded to 64: the shards add up to the model plus exactly that."""
    spec = QWEN32
    per_rank = stage_params(spec, VllmParallel(tp))[0]
    norms = (spec.num_layers * spec.norms_per_layer + 1) * spec.norm_params
    repeated_kv = 0
    if spec.num_kv_heads < tp:  # each rank keeps one KV head: k, v weights and biases
        repeated_kv = spec.num_layers * 2 * (tp - spec.num_kv_heads) * spec.head_dim * (
            spec.hidden_size + 1)
    pad = 2 * (-(-spec.vocab_size // 64) * 64 - spec.vocab_size) * spec.hidden_size
    assert tp * per_rank == spec.param_count + (tp - 1) * norms + repeated_kv + pad


def test_kv_heads_are_replicated_when_fewer_than_ranks():
    assert kv_heads_per_rank(QWEN32, 2) == 4
    assert kv_heads_per_rank(QWEN32, 16) == 1  # 8 KV heads over 16 ranks: one copy each


@given(layers=st.integers(1, 200), pp=st.integers(1, 16))
@settings(max_examples=60, deadline=None)
def test_pipeline_stages_hold_every_layer_once(layers, pp):
    parts = stage_layers(layers, pp)
    assert sum(parts) == layers and max(parts) - min(parts) <= 1 and parts[-1] == min(parts)


def test_pipeline_puts_embedding_first_and_lm_head_last():
    first, *_, last = stage_params(QWEN32, VllmParallel(1, 4))
    assert first > 0 and last > 0
    assert weight_bytes_per_gpu(QWEN32, VllmParallel(1, 4)) < QWEN32.param_count * 2 / 3


def test_communication_buffers_only_with_several_gpus():
    assert comm_buffer_bytes(VllmParallel()) == 0
    assert comm_buffer_bytes(VllmParallel(2)) > CUSTOM_AR_BYTES > 0
    assert comm_buffer_bytes(VllmParallel(1, 3)) < comm_buffer_bytes(VllmParallel(2))


def test_kv_cache_per_gpu_halves_its_block_under_tp2():
    gpu = get_gpu("l40s")
    req = EngineRequest(model="qwen2.5-32b", max_model_len=10000, gpu_memory_utilization=0.9)
    _, one = vllm_engine_args(QWEN32, gpu, req)
    _, two = vllm_engine_args(QWEN32, gpu, replace(req, tensor_parallel_size=2))
    assert two.block_bytes * 2 == one.block_bytes
    assert two.weights_bytes < one.weights_bytes / 2 + 0.01 * GiB


def test_engine_over_nodes_uses_ray_and_names_only_non_defaults():
    gpu = get_gpu("h100")
    req = EngineRequest(model="qwen2.5-32b", max_model_len=4096, tensor_parallel_size=8,
                        pipeline_parallel_size=2, nodes=2)
    args, _ = vllm_engine_args(QWEN32, gpu, req)
    assert args["tensor_parallel_size"] == 8 and args["pipeline_parallel_size"] == 2
    assert args["distributed_executor_backend"] == "ray" and "data_parallel_size" not in args


def test_smallest_engine_that_fits_then_replicas():
    req = EngineRequest(model="qwen2.5-32b", max_model_len=4096)
    found = smallest_fitting_parallel(QWEN32, get_gpu("l40s"), req, gpus_per_node=8)
    assert (found.tensor_parallel_size, found.data_parallel_size) == (2, 4)


def test_vllms_start_up_checks_are_user_errors():
    with pytest.raises(ConfigError, match="divisible by the tensor-parallel size"):
        check_parallel(QWEN32, VllmParallel(3), 4)  # 40 heads
    with pytest.raises(ConfigError, match="--gpu names 2"):
        check_parallel(QWEN32, VllmParallel(2, 1, 2), 2)
    with pytest.raises(ConfigError, match="more than the 64 layers"):
        check_parallel(QWEN32, VllmParallel(1, 65), None)


def test_cli_rejects_more_gpus_than_named(capsys):
    assert main(["estimate", "qwen2.5-32b", "--inference", "--gpu", "l40s",
                 "--tensor-parallel-size", "2"]) == 2
    assert "--gpu names 1" in capsys.readouterr().err


def test_infer_engine_args_carry_the_parallel_sizes(capsys):
    assert main(["infer", "--engine-args", "-m", "qwen2.5-32b", "--gpu", "l40s",
                 "--cutoff-len", "8000", "--max-new-tokens", "2000",
                 "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.9"]) == 0
    out = capsys.readouterr().out
    args = json.loads(out[out.index("{\n"): out.index("\n}") + 2])
    assert args["tensor_parallel_size"] == 2 and args["max_model_len"] == 10000


def test_one_offline_engine_refuses_data_parallel():
    from oomless.runtime.infer.core import InferOptions
    from oomless.runtime.infer.vllm import VllmBackend

    with pytest.raises(ConfigError, match="one `oomless infer` per replica"):
        VllmBackend(InferOptions(model="qwen2.5-0.5b-instruct", data_parallel_size=2))


def test_a_budget_that_leaves_no_room_for_cuda_graphs_is_said(capsys):
    assert main(["estimate", "qwen2.5-7b-instruct", "--inference", "--gpu", "rtx-4090",
                 "--max-model-len", "4096", "--gpu-memory-utilization", "0.99", "--json"]) == 0
    import json as _json

    assert _json.loads(capsys.readouterr().out)["cudagraphs_fit"] is False
    assert main(["estimate", "qwen2.5-7b-instruct", "--inference", "--gpu", "rtx-4090",
                 "--max-model-len", "4096"]) == 0  # the chosen utilization leaves room
    assert "CUDA graphs may not fit" not in capsys.readouterr().out
