"""The protected Trainer's preflight reads a DeepSpeed run's ZeRO stage and offload from
the TrainingArguments' DeepSpeed config, as transformers holds it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from oomless.errors import ConfigError
from oomless.runtime.protect.preflight import _zero


def _args(ds_config: dict | None) -> SimpleNamespace:
    if ds_config is None:
        return SimpleNamespace(hf_deepspeed_config=None)
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    return SimpleNamespace(hf_deepspeed_config=HfTrainerDeepSpeedConfig(ds_config))


@pytest.mark.parametrize(("ds", "expected"), [
    (None, (0, "none")),
    ({"zero_optimization": {"stage": 2}}, (2, "none")),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
     (2, "optimizer")),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                            "offload_param": {"device": "cpu"}}}, (3, "all")),
])
def test_zero_stage_and_offload_from_the_trainers_deepspeed_config(ds, expected):
    assert _zero(_args(ds)) == expected


def test_an_auto_stage_is_named_in_the_error():
    with pytest.raises(ConfigError, match="zero_optimization.stage 'auto'"):
        _zero(_args({"zero_optimization": {"stage": "auto"}}))


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({}, (3, "none", {"version": 1, "limit_all_gathers": True, "backward_prefetch": "NO_PREFETCH",
                      "forward_prefetch": False, "use_orig_params": False})),
    ({"cpu_offload": True, "backward_prefetch": "BACKWARD_PRE", "use_orig_params": False},
     (3, "all", {"version": 1, "limit_all_gathers": True, "backward_prefetch": "BACKWARD_PRE",
                 "forward_prefetch": False, "use_orig_params": False})),
    ({"sharding_strategy": "SHARD_GRAD_OP"}, (2, "none", {
        "version": 1, "limit_all_gathers": True, "backward_prefetch": "NO_PREFETCH",
        "forward_prefetch": False, "use_orig_params": False})),
    ({"fsdp_version": 2}, (3, "none", {"version": 2})),
    ({"fsdp_version": 2, "cpu_offload": True}, (3, "all", {"version": 2})),
])
def test_fsdp_sharding_from_accelerates_own_plugin(kwargs, expected):
    """The preflight reads accelerate's FullyShardedDataParallelPlugin, built for real."""
    import warnings

    from oomless.config import RunConfig
    from oomless.runtime.protect.preflight import fsdp_from_plugin

    plugin_cls = pytest.importorskip("accelerate.utils").FullyShardedDataParallelPlugin
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plugin = plugin_cls(**kwargs)
    assert fsdp_from_plugin(plugin) == expected
    RunConfig(model="llama-2-7b", zero=expected[0], offload=expected[1], fsdp=expected[2])
