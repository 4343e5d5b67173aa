"""DeepSpeed ZeRO's own GPU buffers, from the user's ``zero_optimization`` (torch-free).

Values come from the run configuration's ``deepspeed`` section (what a DeepSpeed JSON
says); ``null`` there means the value transformers' "auto" fills in
(transformers/integrations/deepspeed.py HfTrainerDeepSpeedConfig.trainer_config_finalize:
``reduce_bucket_size`` = hidden², ``stage3_prefetch_bucket_size`` = 0.9·hidden²), which
is what oomless's own deepspeed.json writes; keys a JSON leaves out take DeepSpeed's
defaults (DEEPSPEED_DEFAULTS, deepspeed/runtime/zero/config.py DeepSpeedZeroConfig).

The buffers (DeepSpeed 0.19, deepspeed/runtime/zero/):

- ZeRO-1/2 with ``contiguous_gradients``: ``setup_buckets`` allocates one gradient
  staging buffer of ``reduce_bucket_size`` elements in the gradient dtype, and a second
  when ``overlap_comm`` is on ("double buffers to avoid data access conflict").
- ZeRO-3 with ``contiguous_gradients``: one buffer of ``reduce_bucket_size`` elements
  (stage3.py, the IPG bucket after the optimizer states).
- ZeRO-3 gathering: the module being computed is gathered whole, and the parameter
  coordinator prefetches the next ones up to ``stage3_prefetch_bucket_size`` elements,
  never holding more than ``stage3_max_live_parameters`` gathered elements.
- ``allgather_bucket_size`` (ZeRO-1/2): the updated 16-bit partitions are all-gathered
  with ``all_gather_into_tensor`` straight into the flat 16-bit buffer
  (runtime/utils.py all_gather_dp_groups), so it adds no buffer; it is read, not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# deepspeed/runtime/zero/config.py DeepSpeedZeroConfig field defaults (DeepSpeed 0.19)
DEEPSPEED_DEFAULTS: dict[str, Any] = {
    "reduce_bucket_size": 500_000_000,  # pp_int(5e8)
    "allgather_bucket_size": 500_000_000,  # pp_int(5e8)
    "stage3_prefetch_bucket_size": 50_000_000,  # pp_int(5e7)
    "stage3_max_live_parameters": 1_000_000_000,  # pp_int(1e9)
    "contiguous_gradients": True,
    "overlap_comm": None,  # None: True for stage 3, False otherwise (overlap_comm_valid)
}
# transformers' "auto" for the bucket sizes (trainer_config_finalize)
HF_AUTO_PREFETCH_FRACTION = 0.9
ZERO_KEYS = tuple(DEEPSPEED_DEFAULTS)


@dataclass(frozen=True)
class ZeroBuffers:
    """Per-GPU bytes of DeepSpeed's buffers and the settings they came from."""

    gradient_staging_bytes: int  # contiguous_gradients IPG buffer(s)
    gathered_bytes: int  # ZeRO-3: module being computed + prefetch, capped by max live
    settings: dict[str, Any]
    notes: tuple[str, ...]


def resolve_settings(options: dict[str, Any] | None, hidden_size: int, stage: int) -> dict:
    """The values DeepSpeed runs with: the user's, "auto" (None) as transformers fills it,
    DeepSpeed's defaults for keys not given."""
    given = dict(options or {})
    out = {}
    for key, default in DEEPSPEED_DEFAULTS.items():
        value = given[key] if key in given else default
        if value is None and key == "reduce_bucket_size":
            value = hidden_size * hidden_size
        elif value is None and key == "stage3_prefetch_bucket_size":
            value = int(HF_AUTO_PREFETCH_FRACTION * hidden_size * hidden_size)
        out[key] = value
    if out["overlap_comm"] is None:
        out["overlap_comm"] = stage == 3
    return out


def from_deepspeed_json(zero_optimization: dict[str, Any]) -> dict[str, Any]:
    """The run configuration's ``deepspeed`` values of a DeepSpeed JSON's
    ``zero_optimization``: "auto" → None (transformers fills it), keys not given →
    DeepSpeed's defaults (what DeepSpeed runs with)."""
    out: dict[str, Any] = {}
    for key in ZERO_KEYS:
        value = zero_optimization.get(key, DEEPSPEED_DEFAULTS[key])
        if value == "auto":
            value = None
        elif isinstance(value, float):
            value = int(value)
        out[key] = value
    return out


def zero_buffers(stage: int, options: dict[str, Any] | None, hidden_size: int,
                 largest_module_params: int, grad_bytes: int, weight_bytes: float,
                 trainable_grads: bool = True) -> ZeroBuffers:
    """DeepSpeed's buffers on one GPU for ZeRO ``stage`` (1-3)."""
    s = resolve_settings(options, hidden_size, stage)
    notes = []
    staging = 0
    if s["contiguous_gradients"] and trainable_grads:
        copies = 2 if (stage in (1, 2) and s["overlap_comm"]) else 1
        staging = copies * int(s["reduce_bucket_size"]) * grad_bytes
        notes.append(f"ZeRO-{stage} contiguous_gradients: {copies} staging buffer(s) of "
                     f"reduce_bucket_size {int(s['reduce_bucket_size']):,} elements"
                     + (" (overlap_comm doubles it)" if copies == 2 else ""))
    gathered = 0
    if stage == 3:
        live = min(largest_module_params + int(s["stage3_prefetch_bucket_size"]),
                   max(largest_module_params, int(s["stage3_max_live_parameters"])))
        gathered = round(live * weight_bytes
                         + (largest_module_params * grad_bytes if trainable_grads else 0))
        notes.append(f"ZeRO-3 gathers the largest module ({largest_module_params:,} parameters) "
                     f"plus a prefetch of stage3_prefetch_bucket_size "
                     f"{int(s['stage3_prefetch_bucket_size']):,} elements (at most "
                     f"stage3_max_live_parameters {int(s['stage3_max_live_parameters']):,})")
    return ZeroBuffers(staging, gathered, s, tuple(notes))


def fsdp2_gathered_bytes(root_params: int, layer_params: int, weight_bytes: float,
                         grad_bytes: int, trained: bool) -> int:
    """What FSDP2 holds unsharded on one GPU under full sharding, as oomless's FSDP engine
    wraps the model (runtime/train/engines.py FSDPEngine: ``fully_shard`` per decoder layer,
    then the whole model, ``reshard_after_forward=True``). From torch
    distributed/fsdp/_fully_shard: the root group (embedding, final norm, LM head) is
    gathered when the root's forward starts and stays gathered through it (the whole
    model's forward), and again from the root's pre-backward to its post-backward (the
    whole backward), where its gradients are reduce-scattered last; each layer's
    all-gather overlaps with the one before (implicit forward prefetch;
    FSDPParamGroup._backward_prefetch one layer ahead in backward), so two layers are
    unsharded at once; a layer's unsharded gradients wait for its reduce-scatter."""
    weights = root_params * weight_bytes + 2 * layer_params * weight_bytes
    grads = (root_params + layer_params) * grad_bytes if trained else 0
    return round(weights + grads)
