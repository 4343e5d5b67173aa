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
  (DeepSpeed runtime/utils.py all_gather_dp_groups), so it adds no buffer; it is read, not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import constants as C

DEEPSPEED_DEFAULTS: dict[str, Any] = C.DEEPSPEED_ZERO_DEFAULTS
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


# torch distributed/fsdp/_limiter_utils.py _FreeEventQueue._max_num_inflight_all_gathers
# ("empirically chosen"): with limit_all_gathers the CPU thread waits for the oldest free
# once two unsharded flat parameters are pending
FSDP1_MAX_INFLIGHT_ALL_GATHERS = 2


def fsdp1_padded_numel(numel: int, world_size: int) -> int:
    """A flat parameter's unsharded numel padded to a multiple of the world size
    (torch distributed/fsdp/_flat_param.py FlatParamHandle._get_shard: each rank's chunk is
    ``ceil(numel / world)`` elements, the last one padded with ``F.pad``)."""
    return -(-numel // world_size) * world_size


@dataclass(frozen=True)
class Fsdp1Units:
    """The flat parameters accelerate's FSDP1 plugin builds (TRANSFORMER_BASED_WRAP: one unit
    per decoder layer, the root for the rest), in elements of the flat parameter's dtype."""

    root_numel: int  # embedding, final norm, LM head: the root FSDP unit
    layer_numel: int  # one decoder layer's flat parameter
    elem_bytes: int  # bytes per flat-parameter element (the quant storage dtype for QLoRA)
    root_trained_numel: int  # elements of the root whose gradients are computed
    layer_trained_numel: int  # one layer's trained elements (its own unit or its adapters')
    grad_bytes: int


def fsdp1_unsharded(units: Fsdp1Units, world_size: int, settings: dict[str, Any],
                    offload: bool) -> tuple[int, tuple[str, ...]]:
    """Bytes FSDP1 (FULL_SHARD) holds on one GPU beyond the sharded flat parameters, at the
    backward's peak, and the notes that say how (torch 2.13 distributed/fsdp/):

    - the root unit is not resharded after the forward (_runtime_utils._post_forward_reshard:
      ``not state._is_root``), so it stays unsharded through the backward;
    - each layer unit's padded unsharded flat parameter is allocated at its all-gather
      (_flat_param.FlatParamHandle._alloc_padded_unsharded_flat_param); in backward one
      layer is computed and the next is gathered ahead: by ``backward_prefetch`` /
      ``forward_prefetch`` (_runtime_utils._prefetch_handle), or by the CPU thread running
      ahead of the GPU (a freed unsharded parameter is reused only once the stream that used
      it passes it); ``limit_all_gathers`` caps the pending ones at
      FSDP1_MAX_INFLIGHT_ALL_GATHERS, which is what is counted;
    - a trained unit's gradient is reduce-scattered from its padded unsharded gradient into a
      new shard (_runtime_utils._reduce_grad, _get_reduce_scatter_tensors);
    - ``offload_params``: pre_unshard copies the CPU shard to the GPU (flat_param_to) for the
      all-gather and keeps it until the reshard; sharded gradients go to the CPU
      (_offload_grad into ``_cpu_grad``)."""
    pad = fsdp1_padded_numel
    prefetch = settings.get("backward_prefetch", "NO_PREFETCH")
    layers = FSDP1_MAX_INFLIGHT_ALL_GATHERS
    root = pad(units.root_numel, world_size)
    layer = pad(units.layer_numel, world_size)
    weights = (root + layers * layer) * units.elem_bytes
    grads = (pad(units.root_trained_numel, world_size)
             + pad(units.layer_trained_numel, world_size) * (1 + 1 / world_size))
    total = weights + grads * units.grad_bytes
    notes = [f"FSDP1 FULL_SHARD: the root unit ({units.root_numel:,} elements) stays unsharded "
             f"from the forward through the backward; {layers} decoder-layer unit(s) of "
             f"{units.layer_numel:,} elements unsharded at once (limit_all_gathers' bound; "
             f"backward_prefetch {prefetch}"
             + ("" if prefetch != "NO_PREFETCH" and settings.get("forward_prefetch") else
                ": without prefetch the second is there only while the CPU runs ahead")
             + f"); each flat parameter padded to a multiple of the {world_size} ranks"]
    if units.layer_trained_numel or units.root_trained_numel:
        notes.append("FSDP1: a trained unit's unsharded gradient and its reduce-scatter output")
    if offload:
        total += (root + layers * layer) / world_size * units.elem_bytes
        notes.append("FSDP1 offload_params: each unsharded unit's shard is copied from pinned "
                     "CPU memory to the GPU for its all-gather; sharded gradients live on the CPU")
    if not settings.get("limit_all_gathers", True):
        notes.append("FSDP1 limit_all_gathers false: the CPU thread may issue more all-gathers "
                     "ahead than counted here (how many depends on the CPU's lead over the "
                     "GPU: can't tell); limit_all_gathers true bounds it at two")
    return round(total), tuple(notes)
