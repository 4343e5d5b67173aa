"""The decode-throughput model that ranks vLLM engine shapes (oomless.planner.serving):
tensor parallelism's all-reduces (two per layer, vLLM's RowParallelLinear) over the GPU's
interconnect make the smaller engine win whenever both hold the same sequences."""

from __future__ import annotations

from dataclasses import replace

import pytest

from oomless.api import resolve_model
from oomless.config import RunConfig
from oomless.memory.inference import EngineRequest, vllm_engine_args
from oomless.models.hardware import Cluster, get_gpu
from oomless.planner.serving import (
    ALLREDUCE_LATENCY_S,
    TP_ALLREDUCES_PER_LAYER,
    allreduce_seconds,
    choose_engine,
    decode_speed,
)
from oomless.planner.speed import COLLECTIVE_EFFICIENCY

LLAMA8 = resolve_model("llama-3.1-8b-instruct").spec
QWEN32 = resolve_model("qwen2.5-32b").spec


def test_ring_all_reduce_moves_2_t_minus_1_over_t_of_the_message():
    assert allreduce_seconds(1e6, 1, 450) == 0.0
    link = 450 * 1e9 * COLLECTIVE_EFFICIENCY
    assert allreduce_seconds(1e6, 2, 450) == pytest.approx(ALLREDUCE_LATENCY_S + 1e6 / link)
    assert allreduce_seconds(1e6, 8, 450) == pytest.approx(ALLREDUCE_LATENCY_S + 1.75e6 / link)


def _speed(spec, gpu_name, req):
    gpu = get_gpu(gpu_name)
    _, budget = vllm_engine_args(spec, gpu, req)
    return decode_speed(spec, gpu, req, budget), budget


def test_tp_adds_two_all_reduces_per_layer_and_halves_the_read():
    req = EngineRequest(model="llama-3.1-8b-instruct", max_model_len=1024, max_num_seqs=64)
    one, b1 = _speed(LLAMA8, "h100-sxm", req)
    two, b2 = _speed(LLAMA8, "h100-sxm", replace(req, tensor_parallel_size=2))
    assert one.batch == two.batch == 64 and b1.holds_max_num_seqs and b2.holds_max_num_seqs
    assert one.allreduce_s == 0
    per = allreduce_seconds(64 * LLAMA8.hidden_size * 2, 2, get_gpu("h100-sxm").interconnect_gbs)
    assert two.allreduce_s == pytest.approx(TP_ALLREDUCES_PER_LAYER * LLAMA8.num_layers * per)
    # each rank reads half the weights (norms whole: a little more) and half the KV
    assert one.read_s / 2 <= two.read_s <= one.read_s / 2 * 1.01


def test_smallest_engine_wins_when_every_shape_holds_the_sequences():
    # 256 sequences of 1,024 tokens fit one H100 with an 8B model: TP only adds all-reduces
    req = EngineRequest(model="llama-3.1-8b-instruct", max_model_len=1024)
    chosen, why = choose_engine(LLAMA8, get_gpu("h100-sxm"), req, gpus_per_node=8)
    assert (chosen.tensor_parallel_size, chosen.data_parallel_size) == (1, 8)
    assert why.startswith("TP 1 × DP 8 chosen") and "TP 2 × DP 4" in why and "all-reduce" in why


def test_a_larger_tp_wins_only_where_its_kv_cache_holds_more_sequences():
    req = EngineRequest(model="qwen2.5-32b", max_model_len=4096)
    gpu = get_gpu("l40s")
    chosen, why = choose_engine(QWEN32, gpu, req, gpus_per_node=4)
    speeds = {}
    for tp in (2, 4):
        trial = replace(req, tensor_parallel_size=tp, data_parallel_size=4 // tp)
        speeds[tp], _ = _speed(QWEN32, "l40s", trial)
    assert speeds[4].batch > 2 * speeds[2].batch  # the KV cache, not the compute, decides
    best = max(speeds, key=lambda t: speeds[t].tokens_per_s)
    assert chosen.tensor_parallel_size == best and f"TP {best}" in why.split(" chosen")[0]


def test_no_engine_fits_says_so():
    req = EngineRequest(model="qwen2.5-32b", max_model_len=4096)
    chosen, why = choose_engine(QWEN32, get_gpu("t4"), req, gpus_per_node=2)
    assert chosen is None and "holds one sequence" in why


def test_plan_readme_says_why_it_chose_the_engine(tmp_path):
    from oomless.planner.writers import vllm_plan, write_plan_files

    cfg = RunConfig(model="qwen2.5-32b", method="lora", seq_len=2048)
    cluster = Cluster(get_gpu("l40s"), 4)
    args, why = vllm_plan(cfg, QWEN32, cluster, "Qwen/Qwen2.5-32B-Instruct")
    assert f"TP {args['tensor_parallel_size']} " in why.split(" chosen")[0]
    write_plan_files(tmp_path / "p", cfg, QWEN32, cluster, "Qwen/Qwen2.5-32B-Instruct")
    assert why in (tmp_path / "p" / "README.md").read_text()
