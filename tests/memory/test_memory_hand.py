"""Hand-computed expectations for the analytic model.

Each number below was worked out on paper from the formulas cited in
oomless/memory/*.py (and the comments here), not by running the code.
"""

import pytest

from oomless.config import RunConfig
from oomless.memory import estimate_training
from oomless.models.catalog import resolve_model
from oomless.models.spec import ModelSpec
from oomless.units import MiB

# V=1000, h=64, L=2, 4 heads / 2 kv heads of 16, I=128, gated, untied, no biases.
# params: embed 64000 + lm_head 64000 + 2 × (q 4096 + k 2048 + v 2048 + o 4096
#         + 3 × 8192 + norms 128 = 36992) + final norm 64 = 202048
TINY = ModelSpec(name="tiny", model_type="llama", vocab_size=1000, hidden_size=64,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)
CUBLAS = 2 * (32 + 1) * MiB  # cuBLAS 32 MiB + cuBLASLt 1 MiB, forward and autograd threads (Hopper)


def test_tiny_param_count():
    assert TINY.param_count == 202048


def test_lora_by_hand():
    cfg = RunConfig(model="tiny", method="lora", micro_batch_size=2, seq_len=32,
                    lora={"r": 8, "targets": ["q_proj", "v_proj"], "dropout": 0.0})
    est = estimate_training(TINY, cfg)
    assert est.trainable_params == 2 * (8 * (64 + 64) + 8 * (64 + 32))  # 3584
    parts = est.breakdown["backward"]
    assert parts["weights"] == 202048 * 2
    assert parts["lora_adapters"] == 3584 * 4
    assert parts["optimizer"] == 3584 * 8
    # per layer (t = 64 tokens): norm1 fp32 16384 + stats 512; q and v LoRA each
    # keep their own bf16 copy of x_norm1 (PEFT casts it to the fp32 adapter
    # dtype, autocast back) 2 × 8192; two lora_A outputs 2 × 1024; autocast's
    # bf16 copies of the adapters (1024 + 768 params) 3584; sdpa q 8192, k 4096,
    # v 4096, out 8192, lse 1024; norm2 16896; gate_out/act_out/up_out
    # 3 × 16384 → 130560. Shared: cos+sin 4096, final norm fp32 16384, minus the
    # first layer's norm1 (16896: nothing before the first adapter needs a grad).
    assert parts["activations"] == 2 * 130560 + 4096 + 16384 - 16896
    # backward start: saved log_softmax + its grad + logits grad, fp32: 12·t·V
    assert parts["logits"] == 12 * 64 * 1000
    assert est.breakdown["forward"]["logits"] == 10 * 64 * 1000  # bf16 + fp32 + log_softmax
    assert est.peak_phase == "backward"
    persistent = 404096 + 14336 + 28672 + CUBLAS
    assert est.peak_allocated_bytes == persistent + 264704 + 768000
    # the reserve from the synthesized stream (oomless.allocator.synthetic): every block
    # but the cuBLAS workspaces (whole 2 MiB multiples) is at most 1 MiB, so all of them
    # share the small pool's 2 MiB segments, and what is cached but free stays under one
    reserve = est.peak_reserved_bytes - est.peak_allocated_bytes
    assert 0 < reserve < 2 * MiB
    assert est.extra["allocator_reserve_bytes"] == reserve
    # CUDA context and the kernel images the step loads
    assert est.device_peak_bytes == est.peak_reserved_bytes + 500 * MiB + 234 * MiB


def test_qlora_by_hand():
    cfg = RunConfig(model="tiny", method="qlora", micro_batch_size=1, seq_len=16,
                    grad_ckpt=True, lora={"r": 4, "targets": "all-linear", "dropout": 0.1})
    est = estimate_training(TINY, cfg)
    # NF4 + double quant: 0.5 + 1/64 + 4/(64·256) = 0.515869140625 B/param on the
    # 73728 decoder linear weights; the other 128320 params stay bf16.
    parts = est.breakdown["backward"]
    assert parts["weights"] == 38034 + 128320 * 2
    assert est.trainable_params == 2 * (512 + 384 + 384 + 512 + 768 * 3)  # 8192
    # checkpointing: 2 layer inputs (2·t·h = 2048 each) + cos/sin 1024 + final norm 4096
    assert parts["activations"] == 2 * 2048 + 1024 + 4096
    assert parts["logits"] == 12 * 16 * 1000
    # recomputed layer (dropout 0.1: each LoRA input keeps a 1-byte mask and a
    # bf16 dropped copy): 4224 + 3×3200 + 6400 + 3200 + 4224 + 2×3200 + 3×4096 + 6272
    fwd = est.breakdown["forward"]
    assert fwd["activations"] == parts["activations"]
    assert est.extra["allocator_reserve_bytes"] == 64 * MiB
    in_layers = 9216 + 52608 + (12288 + 4096 + 2 * 8192)  # + transient (dequantised W)
    assert in_layers < parts["activations"] + parts["logits"]  # so the peak is at the start


def test_full_zero3_8gpu_qwen7b_by_hand():
    spec = resolve_model("qwen2.5-7b").spec
    P = 7_615_616_512
    assert spec.param_count == P
    cfg = RunConfig(model="qwen2.5-7b", method="full", precision="bf16", zero=3,
                    grad_ckpt=True, seq_len=2048, hardware={"gpu": "a100-80gb", "gpus_per_node": 8})
    est = estimate_training(spec, cfg)
    parts = est.breakdown["optimizer"]
    assert parts["weights"] == 2 * P // 8  # bf16 parameters, partitioned
    assert parts["master_weights"] == 4 * P // 8
    assert parts["optimizer"] == 8 * P // 8  # Adam m and v in fp32
    assert parts["grad_partition_fp32"] == 4 * P // 8
    assert parts["gradients"] == 2 * P // 8 + 3584**2 * 2  # + reduce bucket hidden²
    # largest gathered module: the embedding, 152064 × 3584 params, at 4 B/param,
    # plus a prefetch bucket of int(0.9·hidden²) bf16 elements (transformers' "auto")
    assert parts["zero3_gathered"] == 4 * 152064 * 3584 + int(0.9 * 3584**2) * 2
    # 20 bytes/param over 8 GPUs: 19.04 GB of model states per GPU
    states = sum(parts[k] for k in ("weights", "master_weights", "optimizer",
                                    "grad_partition_fp32", "gradients"))
    assert states == pytest.approx(20 * P / 8 + 3584**2 * 2, abs=4)


def test_only_a_casting_lora_layer_copies_the_down_proj_input_to_fp32():
    # Under autocast PEFT's fp32 down_proj adapter gets an fp32 copy of its (t × I) input
    # from lora.Linear (_cast_input_dtype); bitsandbytes' Linear4bit passes it uncast
    # (requires_conversion = not torch.is_autocast_enabled()). t = 2 × 32, I = 128.
    from oomless.memory.precision import dtypes_for
    from oomless.memory.training import forward_transient_bytes

    def transient(method: str) -> float:
        cfg = RunConfig(model="tiny", method=method, micro_batch_size=2, seq_len=32,
                        lora={"r": 8, "targets": ["down_proj"], "dropout": 0.0})
        return forward_transient_bytes(TINY, cfg, dtypes_for(cfg), 64)

    assert transient("lora") - transient("qlora") == 4 * 64 * 128
