"""torch FSDP1 as accelerate's FSDP plugin runs it (memory/zero_buffers.py fsdp1_unsharded,
memory/states.py fsdp1_units): the arithmetic, accelerate's own defaults, the accelerate
config reader, and the flat parameters of a real FSDP1 model on CPU (gloo, three ranks)
against oomless's units."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oomless.api import estimate
from oomless.check.readers_trl import accelerate_fsdp
from oomless.config import FsdpConfig, RunConfig
from oomless.memory.precision import dtypes_for
from oomless.memory.quantized import quant_constant_bytes
from oomless.memory.states import fsdp1_units
from oomless.memory.zero_buffers import (
    FSDP1_MAX_INFLIGHT_ALL_GATHERS,
    Fsdp1Units,
    fsdp1_padded_numel,
    fsdp1_unsharded,
)
from oomless.models.catalog import resolve_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "real_configs"
# the PEFT docs' FSDP QLoRA row (benchmarks/published_rows.yaml peft-docs-70b-qlora-fsdp)
ROW = dict(model="llama-2-70b", method="qlora", micro_batch_size=2, grad_accum=2,
           seq_len=2048, grad_ckpt=True, attn="flash", zero=3,
           quantization={"bits": 4, "type": "nf4", "double_quant": True, "storage": "bfloat16"},
           lora={"r": 8, "alpha": 16, "targets": "all-linear"},
           hardware={"gpu": "a100-80gb", "gpus_per_node": 2})
FSDP1 = {"version": 1, "backward_prefetch": "BACKWARD_PRE", "use_orig_params": False}


@given(st.integers(0, 10**12), st.integers(1, 4096))
def test_padding_is_the_smallest_multiple_of_the_world(numel, world):
    padded = fsdp1_padded_numel(numel, world)
    assert padded % world == 0 and numel <= padded < numel + world


def test_unsharded_bytes_are_the_root_two_layers_and_the_trained_gradients():
    units = Fsdp1Units(root_numel=1001, layer_numel=3001, elem_bytes=2, root_trained_numel=0,
                       layer_trained_numel=11, grad_bytes=2)
    total, notes = fsdp1_unsharded(units, 2, FsdpConfig().model_dump(), offload=False)
    weights = (1002 + FSDP1_MAX_INFLIGHT_ALL_GATHERS * 3002) * 2
    grads = (12 + 12 / 2) * 2  # padded unsharded gradient + its reduce-scatter output
    assert total == round(weights + grads)
    assert "stays unsharded" in notes[0] and "CPU runs ahead" in notes[0]
    offloaded, notes = fsdp1_unsharded(units, 2, FsdpConfig().model_dump(), offload=True)
    assert offloaded - total == round(weights / 2)  # the shards copied to the GPU
    assert any("offload_params" in n for n in notes)
    _, notes = fsdp1_unsharded(units, 2, {"limit_all_gathers": False}, offload=False)
    assert any("can't tell" in n for n in notes)


def test_qlora_layer_is_packed_into_the_quant_storage_dtype():
    spec = resolve_model("llama-2-70b").spec
    cfg = RunConfig(**ROW, fsdp=FSDP1)
    units = fsdp1_units(spec, cfg, dtypes_for(cfg))
    h, kv, ff = 8192, 1024, 28672  # Llama-2-70B: hidden, 8 KV heads × 128, MLP
    linears = 2 * h * h + 2 * h * kv + 3 * h * ff
    assert units.elem_bytes == 2
    assert units.layer_numel == linears // 4 + 2 * h  # 4 codes per bf16 element + 2 norms
    assert units.root_numel == 2 * 32000 * h + h  # embedding, lm_head, final norm
    assert units.root_trained_numel == 0 and units.layer_trained_numel > 0


def test_estimate_counts_fsdp1_instead_of_the_deepspeed_buffers():
    spec = resolve_model("llama-2-70b").spec
    fsdp1 = RunConfig(**ROW, fsdp=FSDP1)
    parts = estimate(fsdp1).components
    expected, _ = fsdp1_unsharded(fsdp1_units(spec, fsdp1, dtypes_for(fsdp1)), 2,
                                  fsdp1.fsdp.model_dump(), offload=False)
    assert parts["zero3_gathered"] == expected
    offload = RunConfig(**{**ROW, "offload": "all"}, fsdp=FSDP1)
    off = estimate(offload)
    assert off.components.get("gradients", 0) == 0  # sharded gradients in _cpu_grad
    assert off.components["zero3_gathered"] > expected
    assert any("FSDP1" in a for a in off.assumptions)
    # the QuantState is not a parameter: FSDP1 offloads only flat parameters
    assert off.components["weights"] == round(quant_constant_bytes(spec, offload)) > 0


def test_accelerate_defaults_are_accelerates_own():
    plugin = pytest.importorskip("accelerate.utils").FullyShardedDataParallelPlugin()
    ours = FsdpConfig()
    assert plugin.fsdp_version == 1 and plugin.backward_prefetch is None
    assert ours.backward_prefetch == "NO_PREFETCH"
    assert (plugin.limit_all_gathers, plugin.use_orig_params, plugin.forward_prefetch) == \
        (ours.limit_all_gathers, ours.use_orig_params, ours.forward_prefetch)


def test_accelerate_config_fsdp_keys_are_read():
    import yaml

    d = yaml.safe_load((FIXTURES / "trl" / "fsdp_qlora.yaml").read_text())
    assert accelerate_fsdp(d["fsdp_config"]) == {
        "version": 1, "backward_prefetch": "BACKWARD_PRE", "forward_prefetch": False,
        "use_orig_params": False}
    assert accelerate_fsdp({"fsdp_version": 2, "fsdp_backward_prefetch": None}) == {
        "version": 2, "backward_prefetch": "NO_PREFETCH"}


def test_accelerate_fsdp2_is_estimated_as_fsdp2():
    base = dict(model="llama-2-7b", method="full", zero=3, seq_len=512,
                hardware={"gpu": "a100-80gb", "gpus_per_node": 8})
    by_accelerate = estimate(RunConfig(**base, fsdp={"version": 2})).components
    by_engine = estimate(RunConfig(**base, training={"engine": "fsdp"})).components
    assert by_accelerate["zero3_gathered"] == by_engine["zero3_gathered"]
    fsdp1 = estimate(RunConfig(**base, fsdp={"version": 1})).components
    assert fsdp1["zero3_gathered"] != by_engine["zero3_gathered"]


# ---- a real FSDP1 on CPU ------------------------------------------------------------------
WORLD = 3
TINY = dict(hidden_size=40, intermediate_size=97, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=131, tie_word_embeddings=False,
            model_type="llama", architectures=["LlamaForCausalLM"])


def _rank(rank: int, out: str, port: int) -> None:  # pragma: no cover - child processes
    import functools

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import BackwardPrefetch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"})
    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(LlamaForCausalLM(cfg), auto_wrap_policy=policy, device_id=torch.device("cpu"),
                 use_orig_params=False, limit_all_gathers=True,
                 backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
    units = FSDP.fsdp_modules(model)
    trace: list[tuple[str, list[str]]] = []

    def unsharded() -> list[str]:  # the units whose padded unsharded flat parameter is allocated
        return [u.module.__class__.__name__ for u in units
                if u._handle.flat_param._full_param_padded.untyped_storage().size() > 0]

    def record(module, args, output):  # each layer's last linear: forward, then its backward
        trace.append(("forward", unsharded()))
        output.register_hook(lambda grad: trace.append(("backward", unsharded())))

    for layer in units[1:]:
        layer.module.mlp.down_proj.register_forward_hook(record)
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    for _ in range(2):  # the first step runs FSDP's lazy init (padded sizes); trace the second
        trace.clear()
        model(input_ids=ids, labels=ids).loss.backward()
    rows = [{"unit": m.module.__class__.__name__,
             "unpadded": m._handle.flat_param._unpadded_unsharded_size.numel(),
             "padded": m._handle.flat_param._padded_unsharded_size.numel(),
             "shard": m._handle.flat_param.numel()} for m in units]
    if rank == 0:
        Path(out).write_text(json.dumps({"flat": rows, "trace": trace}))
    # FSDP1 keeps its process group referenced (DTensor caches), so gloo's worker threads
    # would outlive the interpreter's shutdown and may abort the rank after a correct run
    # (oomless.runtime.train.dist.release_process_groups explains it): release what can
    # be released, then end the rank without interpreter shutdown, as `oomless train` does
    from oomless.runtime.train.dist import release_process_groups

    del model
    release_process_groups()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.multirank
@pytest.mark.slow
def test_flat_parameters_equal_fsdp1s_own(tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    out = tmp_path / "flat.json"
    port = 29400 + os.getpid() % 500
    subprocess.run([sys.executable, __file__, str(out), str(port)], check=True, timeout=300)
    rows = json.loads(out.read_text())["flat"]
    from oomless.models.hf_config import spec_from_hf_config

    spec = spec_from_hf_config(TINY, "tiny-llama")
    cfg = RunConfig(model="llama-2-7b", method="full", zero=3, fsdp={"version": 1})
    units = fsdp1_units(spec, cfg, dtypes_for(cfg))
    root = [r for r in rows if r["unit"] == "LlamaForCausalLM"]
    layers = [r for r in rows if r["unit"] == "LlamaDecoderLayer"]
    assert len(root) == 1 and len(layers) == TINY["num_hidden_layers"]
    for row, numel in [(root[0], units.root_numel)] + [(r, units.layer_numel) for r in layers]:
        assert row["unpadded"] == numel
        assert row["padded"] == fsdp1_padded_numel(numel, WORLD) == row["shard"] * WORLD
    assert any(r["padded"] > r["unpadded"] for r in rows)  # the sizes make padding show


@pytest.mark.multirank
@pytest.mark.slow
def test_root_stays_unsharded_and_backward_prefetch_gathers_a_second_layer(tmp_path):
    """What fsdp1_unsharded counts, seen in a real FSDP1 step (gloo, BACKWARD_PRE): the root
    unit is unsharded at every point of the forward and the backward; the backward holds the
    layer being computed and the one prefetched (FSDP1_MAX_INFLIGHT_ALL_GATHERS), the forward
    one layer (on a CPU the thread never runs ahead of the device, so the limiter's second
    forward gather does not show)."""
    out = tmp_path / "trace.json"
    port = 29900 + os.getpid() % 90
    subprocess.run([sys.executable, __file__, str(out), str(port)], check=True, timeout=300)
    trace = json.loads(out.read_text())["trace"]
    assert [phase for phase, _ in trace] == ["forward"] * 2 + ["backward"] * 2
    assert all("LlamaForCausalLM" in units for _, units in trace)
    layers = {phase: max(units.count("LlamaDecoderLayer") for p, units in trace if p == phase)
              for phase in ("forward", "backward")}
    assert layers == {"forward": 1, "backward": FSDP1_MAX_INFLIGHT_ALL_GATHERS}


if __name__ == "__main__":  # the ranks of test_flat_parameters_equal_fsdp1s_own
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(sys.argv[1], int(sys.argv[2])), nprocs=WORLD)
