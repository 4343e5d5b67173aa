"""Peers' memory estimators, run on the same configurations as ours.

- accelerate: `accelerate estimate-memory`'s real code (calculate_maximum_sizes on
  the meta-device model, estimate_training_usage); its training figure is the
  largest of its components, batch 1, no activations.
- DeepSpeed: the real estimate_zero2/3_model_states_mem_needs functions (model
  states only; ZeRO-2 formula for stages 0–2).
- gpu_poor: its published formulas (RahulSChand/gpu_poor, src/App.js), re-implemented
  (params V·h·2 + L·4h² + L·3·I·h; activation terms per layer; ×0.15 with
  checkpointing; 650 MB overhead; no GQA, no flash attention).
- PyTorch MemTracker: run on the real model under FakeTensorMode where it works
  (it cannot hook frozen parameters, so LoRA/QLoRA rows report the failure).
"""

from __future__ import annotations

from oomless.config import RunConfig
from oomless.models.spec import ModelSpec

MB = 1e6


def accelerate_estimate(model, cfg: RunConfig) -> int:
    """accelerate's "training with Adam" figure for the model's fp32 size."""
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    total_size, _ = calculate_maximum_sizes(model)
    precision = {"bf16": "bfloat16", "fp16": "float16", "pure-bf16": "bfloat16"}.get(
        cfg.precision, "float32")
    usage = estimate_training_usage(total_size, precision)
    return int(max(usage.values()))


def deepspeed_estimate(spec: ModelSpec, cfg: RunConfig, largest_layer_params: int) -> int:
    """DeepSpeed's model-states estimate per GPU (no activations)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    gpus, nodes = cfg.hardware.gpus_per_node, cfg.hardware.nodes
    offload = cfg.offload != "none"
    if cfg.zero == 3:
        _, gpu, _ = estimate_zero3_model_states_mem_needs(
            spec.param_count, largest_layer_params, gpus, nodes, cpu_offload=offload,
            cpu_offload_params=cfg.offload == "all")
        return int(gpu)
    _, gpu = estimate_zero2_model_states_mem_needs(spec.param_count, gpus, nodes,
                                                   cpu_offload=offload)
    return int(gpu)


def gpu_poor_estimate(spec: ModelSpec, cfg: RunConfig) -> int:
    """gpu_poor's training formula (bytes), as published (see module docstring)."""
    # h hidden, L layers, ffn intermediate, a heads, V vocabulary
    h, L, ffn, a, V = (spec.hidden_size, spec.num_layers, spec.intermediate_size,
                       spec.num_heads, spec.vocab_size)
    s, b = cfg.seq_len, cfg.micro_batch_size
    fb = 4 if cfg.precision == "fp32" else 2
    params = V * h * 2 + L * 4 * h * h + L * 3 * ffn * h
    weights = params * (0.5 if cfg.method == "qlora" else fb)
    attn = s * h * 5 * fb + s * s * a * (2 * fb + 4) + 3 * s * h * fb
    mlp = 2 * h * s * fb + 6 * s * ffn * fb
    norm = s * 8 + s * h * fb * 6
    acts = (attn + mlp + norm) * L * b * (0.15 if cfg.grad_ckpt else 1.0)
    if cfg.method == "full":
        grad_opt = params * 3 * fb
    else:  # its LoRA/QLoRA states: layers × 8 × h × 2 × 4 × 3 (Adam)
        grad_opt = L * 8 * h * 2 * 4 * 3 * (2 if cfg.method == "lora" else 0.25)
    return int(weights + acts + grad_opt + 650 * MB)


def memtracker_estimate(run_step, model) -> tuple[int | None, str]:
    """Peak bytes MemTracker reports for ``run_step(tracker)`` under fake tensors, or
    why it failed (its module stats are reset between the two iterations, as it asks)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    try:
        tracker.track_external(model)
        with tracker:
            run_step(tracker)
    except (RuntimeError, NotImplementedError, AssertionError) as err:
        # the peer's failure is a result to report, not something to hide
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:100]}"
    peak = tracker.get_tracker_snapshot("peak")
    total = sum(v.get("Total", 0) for v in peak.values())
    return int(total), ""
