"""Scoring one candidate: does it fit (memory), and how fast is it (speed).

Memory comes from the analytic estimator (oomless.memory) — the planner has
no memory formulas of its own. A candidate fits when its predicted device peak
(what nvidia-smi would show, the maximum over every phase: training step,
evaluation, generation) is at most (1 − headroom) × the GPU's memory, the upper
bound of that peak (memory/band.py) fits the GPU's memory, and the host RAM covers
what offload puts there.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import RunConfig
from ..memory.band import band_bytes
from ..memory.overheads import late_dense_block_bytes, peak_bytes
from ..memory.precision import dtypes_for
from ..memory.states import States, decoder_linear_weight_params, model_states, weight_bytes
from ..memory.training import largest_block_bytes, llm_seq_len, training_phases
from ..models.spec import ModelSpec
from .candidates import Family, PlanRequest
from .speed import FamilyCost, ShardBytes, StepTime, TokenLoad, family_cost, step_time


@dataclass(frozen=True)
class Fit:
    device_peak_bytes: int
    peak_phase: str
    host_bytes: int
    paged_bytes: int
    fits: bool
    over_bytes: int  # bytes above the budget or, for the upper bound, the GPU (≤ 0: fits)
    host_short_bytes: int  # host bytes missing for offload (0 when enough)


@dataclass
class FamilyContext:
    """What stays the same across one family's micro-batch splits."""

    family: Family
    cost: FamilyCost
    trainable_params: int
    grad_elem_bytes: int
    weight_bytes_16: float


def over_budget_bytes(device: int, req: PlanRequest) -> int:
    """How far a device peak is over the request's budget: a plan keeps the headroom and
    its upper bound (memory/band.py) fits the GPU."""
    over = device - req.budget_bytes
    if req.within_band:
        over = max(over, band_bytes(device)[1] - req.cluster.gpu.memory_bytes)
    return over


class CandidateScorer:
    """Memory and speed of candidates for one request (per-family caching)."""

    def __init__(self, spec: ModelSpec, req: PlanRequest) -> None:
        self.spec = spec
        self.req = req
        self.cluster = req.cluster
        self.budget_bytes = req.budget_bytes
        self.evaluated = 0

    def memory(self, cfg: RunConfig, states: States | None = None) -> Fit:
        """The analytic estimate's device peak and host RAM, through the same
        functions as estimate_training (without building a MemoryEstimate);
        ``states``: model_states of the candidate's family, reused."""
        self.evaluated += 1
        phases, persistent, st = training_phases(self.spec, cfg, self.cluster, states)
        phase, alloc, reserve, non_pt = peak_bytes(phases, persistent, self.cluster,
                                                   cfg.world_size, False,
                                                   largest_block_bytes(self.spec, cfg),
                                                   late_dense_block_bytes(self.spec, cfg))
        device = alloc + reserve + sum(non_pt.values())
        host_short = 0
        if st.host_bytes and self.req.host_ram_bytes:
            host_short = max(0, st.host_bytes - self.req.host_ram_bytes)
        over = over_budget_bytes(device, self.req)
        return Fit(device, phase, st.host_bytes, st.paged_bytes,
                   over <= 0 and host_short == 0, over, host_short)

    def states(self, cfg: RunConfig) -> States:
        return model_states(self.spec, cfg, dtypes_for(cfg))

    def family_context(self, fam: Family, st: States) -> FamilyContext:
        cfg = fam.cfg
        dt = dtypes_for(cfg)
        adapters = st.trainable_params if cfg.method != "full" else 0
        quantized = decoder_linear_weight_params(self.spec) if cfg.method == "qlora" else 0
        cost = family_cost(self.spec, cfg, self.cluster.gpu, adapters, quantized)
        return FamilyContext(fam, cost, st.trainable_params, dt.grad_bytes,
                             weight_bytes(self.spec, cfg, dt))

    def token_load(self, cfg: RunConfig) -> TokenLoad:
        b = cfg.micro_batch_size
        data = self.req.data
        if data is not None:
            images = cfg.data.images_per_sample if self.spec.vision else 0
            per_image = cfg.data.image_tokens or (
                self.spec.vision.tokens_per_image if self.spec.vision else 0)
            length = cfg.seq_len + images * per_image
            return data.token_load(b, length, cfg.data.packing, cfg.attn == "flash")
        s = llm_seq_len(self.spec, cfg)
        images = cfg.data.images_per_sample if self.spec.vision else 0
        return TokenLoad(b * s, b * s, b * s * s, b, b * images)

    def speed(self, ctx: FamilyContext, cfg: RunConfig, fit: Fit) -> StepTime:
        overflow = max(0, fit.device_peak_bytes + fit.paged_bytes - self.cluster.gpu.memory_bytes)
        sb = ShardBytes(ctx.trainable_params, ctx.grad_elem_bytes, ctx.weight_bytes_16,
                        overflow)
        return step_time(self.spec, cfg, self.cluster, ctx.cost, sb, self.token_load(cfg))
