"""The worked example of docs/memory-model.md, computed by hand, equals the estimator.

Each expected figure is plain arithmetic on the model's published shapes (the
formulas in the document's table), not a value read back from the code. The
test also checks that the document prints the same byte counts, so the
document and the estimator cannot drift apart.
"""

from pathlib import Path

from oomless.api import estimate
from oomless.config import RunConfig
from oomless.units import MiB

DOC = Path(__file__).resolve().parents[2] / "docs" / "memory-model.md"

# Qwen2.5-7B: P parameters, L layers, hidden H, MLP width MLP, KV width kv, vocab V
P, L, H, MLP, KV, V, HEAD_DIM = 7_615_616_512, 28, 3584, 18944, 512, 152_064, 128
R, T = 16, 2048  # LoRA rank on all linear layers; tokens per micro batch (1 × 2048)

ADAPTER_PARAMS = L * R * ((H + H) + 2 * (H + KV) + (H + H) + 3 * (H + MLP))
WEIGHTS = 2 * P
ADAPTERS = 4 * ADAPTER_PARAMS
ADAMW = 8 * ADAPTER_PARAMS
CUBLAS_A100 = 2 * (4096 * 1024 * 2 + 16 * 1024 * 8 + 1 * MiB)
ACTIVATIONS = L * 2 * T * H + 2 * 2 * T * HEAD_DIM + 4 * T * H
LOGITS = 12 * T * V
ALLOCATED = WEIGHTS + ADAPTERS + ADAMW + CUBLAS_A100 + ACTIVATIONS + LOGITS
# The reserve is the synthesized two-step stream replayed through the caching-allocator
# model (docs section 7): not arithmetic on paper, so the test replays it and bounds it
# by hand: less than one fp32 logits block, which the second step's loss reuses.
RESERVE = 735_990_784
CONTEXT = 500 * MiB
KERNELS = 234 * MiB  # kernel images the first step loads


def _estimate():
    cfg = RunConfig(model="qwen2.5-7b", method="lora", seq_len=T, grad_ckpt=True,
                    lora={"r": R, "targets": "all-linear"}, hardware={"gpu": "a100-80gb"})
    return estimate(cfg)


def test_worked_example_equals_the_estimator_to_the_byte():
    est = _estimate()
    assert est.trainable_params == ADAPTER_PARAMS == 40_370_176
    assert est.peak_phase == "backward"
    assert est.components == {"weights": WEIGHTS, "lora_adapters": ADAPTERS, "optimizer": ADAMW,
                              "cublas_workspace": CUBLAS_A100, "activations": ACTIVATIONS,
                              "logits": LOGITS}
    assert est.peak_allocated_bytes == ALLOCATED
    assert est.peak_reserved_bytes == ALLOCATED + RESERVE
    assert 0 < RESERVE < 4 * T * V
    assert est.extra["allocator_reserve_bytes"] == RESERVE
    assert est.device_peak_bytes == ALLOCATED + RESERVE + CONTEXT + KERNELS


def test_the_document_prints_the_same_numbers():
    text = DOC.read_text()
    for value in (ADAPTER_PARAMS, WEIGHTS, ADAPTERS, ADAMW, CUBLAS_A100, ACTIVATIONS, LOGITS,
                  ALLOCATED, RESERVE, ALLOCATED + RESERVE, KERNELS,
                  ALLOCATED + RESERVE + CONTEXT + KERNELS):
        assert f"{value:,}" in text, f"{value:,} missing from {DOC.name}"
