"""Every optimizer row of knobs.OPTIMIZERS drives the memory model, the planner and the
files ``plan --out`` writes (issue 18, item 9: no place tests a name for "8bit")."""

from __future__ import annotations

import pytest

from oomless.config import RunConfig
from oomless.knobs import OPTIMIZERS, offloaded_optimizer, optimizer_from_hf
from oomless.memory.constants import ADAM8BIT_BYTES
from oomless.memory.precision import dtypes_for
from oomless.memory.states import model_states
from oomless.models.catalog import resolve_model
from oomless.models.hardware import parse_gpu_arg
from oomless.planner.candidates import _tradeoffs, families
from oomless.planner.request import build_request
from oomless.planner.writers import deepspeed_config, llamafactory_config, training_arguments

MODEL = "qwen2.5-0.5b"
ROWS = sorted(OPTIMIZERS)


def _states(name: str, **changes):
    cfg = RunConfig(model=MODEL, method="full", optimizer=name, **changes)
    return model_states(resolve_model(MODEL).spec, cfg, dtypes_for(cfg)), cfg


@pytest.mark.parametrize("name", ROWS)
def test_the_row_decides_the_state_bytes(name):
    kind = OPTIMIZERS[name]
    st, cfg = _states(name)
    states = st.gpu.get("optimizer", 0) + st.paged_bytes
    per_param = states / st.trainable_params
    if kind.factored:
        assert 0 < per_param < 0.1  # row and column factors: a sliver of AdamW's 8 bytes
    elif kind.eight_bit:  # uint8 states, fp32 for tensors under 4,096 elements (norms)
        assert ADAM8BIT_BYTES < per_param < ADAM8BIT_BYTES * 1.01
    elif kind.paged:  # bitsandbytes' 32-bit states are fp32
        assert states == kind.full_states * 4 * st.trainable_params
    else:
        assert states == kind.full_states * dtypes_for(cfg).optim_elem_bytes * \
            st.trainable_params
    assert (st.paged_bytes > 0) == kind.paged


@pytest.mark.parametrize("name", ROWS)
def test_offloaded_states_are_those_deepspeed_steps(name):
    kind = OPTIMIZERS[name]
    st, _ = _states(name, zero=2, offload="optimizer")
    adamw, _ = _states("adamw", zero=2, offload="optimizer")
    stepped = offloaded_optimizer(name)
    assert stepped.zero_offload and (stepped is kind) == kind.zero_offload
    if not kind.zero_offload:
        assert st.host_bytes == adamw.host_bytes
        assert any("DeepSpeed steps CPU-Adam" in a for a in st.assumptions)


@pytest.mark.parametrize("name", ROWS)
def test_the_planner_reads_the_row(name):
    kind = OPTIMIZERS[name]
    base = RunConfig(model=MODEL, method="full")
    trade = _tradeoffs(base, "bf16", name, False)
    assert bool(trade) == kind.eight_bit  # 8-bit states are a trade-off, paging is not
    spec = resolve_model(MODEL).spec
    req = build_request(spec, base.model_copy(update={"optimizer": name}),
                        parse_gpu_arg("rtx-4090 x2"), effective_batch=4)
    for fam in families(req, spec):
        if fam.cfg.offload != "none":
            assert OPTIMIZERS[fam.cfg.optimizer].zero_offload


@pytest.mark.parametrize("name", ROWS)
def test_the_written_files_name_the_row(name):
    kind = OPTIMIZERS[name]
    spec = resolve_model(MODEL).spec
    cfg = RunConfig(model=MODEL, method="full", optimizer=name, zero=2, offload="optimizer",
                    hardware={"gpus_per_node": 2})
    assert training_arguments(cfg, None)["optim"] == kind.hf_optim
    assert llamafactory_config(cfg, spec, "Qwen/Qwen2.5-0.5B-Instruct", "qwen", None)["optim"] == \
        kind.hf_optim
    # read back, the name is a row with the same state layout (sgd-momentum writes 'sgd')
    back = OPTIMIZERS[optimizer_from_hf(kind.hf_optim)]
    assert (back.eight_bit, back.paged, back.factored) == \
        (kind.eight_bit, kind.paged, kind.factored)
    assert deepspeed_config(cfg, spec)["optimizer"]["type"] == "AdamW"  # CPU-Adam's block
