"""Training stages in the analytic estimate and the planner (torch-free)."""

from __future__ import annotations

import pytest
import yaml

from oomless.config import RunConfig
from oomless.errors import ConfigError
from oomless.memory import estimate_training
from oomless.memory.stages import reference_kind, stage_plan
from oomless.models.catalog import resolve_model
from oomless.models.hardware import parse_gpu_arg
from oomless.planner import PlanOptions, plan_from_options

SPEC = resolve_model("qwen2.5-7b-instruct").spec


def _peak(**options) -> int:
    return estimate_training(SPEC, RunConfig(model="qwen2.5-7b-instruct", seq_len=1024,
                                             **options)).peak_allocated_bytes


def test_how_each_stage_runs():
    plan = stage_plan(RunConfig(model="m", stage="dpo"))
    assert (plan.rows, plan.head, plan.reference) == (2, "chunked_logprobs", "adapter-off")
    assert stage_plan(RunConfig(model="m", stage="dpo", stack="llamafactory")).head == "full_logprobs"
    assert stage_plan(RunConfig(model="m", stage="rm")).head == "score"
    assert stage_plan(RunConfig(model="m", stage="orpo")).nll_rows == 1
    assert reference_kind(RunConfig(model="m", stage="dpo", method="full")) == "separate"
    assert reference_kind(RunConfig(model="m", stage="simpo")) == "none"
    assert reference_kind(RunConfig(model="m", stage="kto", rlhf={"reference": "precomputed"})) \
        == "precomputed"


def test_stage_changes_the_estimate_where_the_trainer_changes_the_step():
    sft = _peak(stage="sft")
    # chosen and rejected together: twice the activations; the fused head has no logits
    assert _peak(stage="dpo") > sft
    # a separate full-precision reference copy for full fine-tuning
    full_dpo = estimate_training(SPEC, RunConfig(model="m", stage="dpo", method="full",
                                                 seq_len=1024))
    assert full_dpo.breakdown["optimizer"]["reference_model"] == SPEC.param_count * 4
    # precomputed reference log-probs: no reference forward, no reference weights
    assert _peak(stage="dpo", method="full", rlhf={"reference": "precomputed"}) < \
        full_dpo.peak_allocated_bytes
    # the reward model has no lm_head (untied 7B: 545M parameters fewer)
    rm = estimate_training(SPEC, RunConfig(model="m", stage="rm", seq_len=1024))
    assert rm.breakdown["optimizer"]["weights"] < \
        estimate_training(SPEC, RunConfig(model="m", seq_len=1024)).breakdown["optimizer"]["weights"]
    ppo = estimate_training(SPEC, RunConfig(model="m", stage="ppo", seq_len=1024))
    assert {"reward_model", "value_model", "rollout_scores"} <= set(ppo.breakdown["optimizer"])


def test_rlhf_keys_are_checked():
    with pytest.raises(ValueError, match="rlhf"):
        RunConfig.model_validate({"model": "m", "rlhf": {"referenec": "separate"}})
    with pytest.raises(ValueError, match="reference"):
        RunConfig.model_validate({"model": "m", "rlhf": {"reference": "copy"}})


def test_plan_for_a_dpo_run_plans_dpo(tmp_path):
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump({"model": "qwen2.5-7b-instruct", "stage": "dpo",
                                    "seq_len": 2048, "micro_batch_size": 4}))
    result = plan_from_options(PlanOptions(model=str(path), gpu="a100-80gb", top=3))
    assert result.plans
    for plan in result.plans:
        cfg = plan.run_config()
        assert cfg.stage == "dpo"
        est = estimate_training(SPEC, cfg, parse_gpu_arg("a100-80gb"))
        assert est.device_peak_bytes == plan.device_peak_bytes


def test_unknown_stage_is_a_user_error():
    from oomless.config import build_run_config

    with pytest.raises(ConfigError, match="stage"):
        build_run_config({"model": "m", "stage": "grpo"})
