"""Issue 18, bounded work and item 2: one table of caps (oomless.limits.CAPS) is read by
the CLI's flags, RunConfig (files and the web page) and the planner's request; the
planner's search has a time budget and says when it ended the search."""

from __future__ import annotations

import argparse
import time

import pytest

from oomless.cli import main
from oomless.cli._options import _FLAG_KEYS, run_config_from_args
from oomless.config import RunConfig, build_run_config, set_dotted
from oomless.errors import ConfigError
from oomless.limits import CAPS
from oomless.planner import PlanOptions, plan, request_from_options
from oomless.planner.candidates import batch_splits

# Caps of RunConfig's own keys (the others are the planner's inputs, tested below)
RUN_KEYS = sorted(k for k in CAPS if k not in ("effective_batch", "world_size", "top",
                                               "gpu_memory_gb"))


@pytest.mark.parametrize("key", RUN_KEYS)
def test_every_run_key_accepts_its_cap_and_refuses_one_more(key):
    high = CAPS[key].high
    at_cap: dict = {"model": "qwen2.5-0.5b"}
    set_dotted(at_cap, key, high)  # alone: the effective batch and GPU count stay in theirs
    assert isinstance(build_run_config(at_cap), RunConfig)
    data: dict = {"model": "qwen2.5-0.5b"}
    set_dotted(data, key, high + 1)
    with pytest.raises(ConfigError, match=rf"'{key}': at most {high:,}, got {high + 1:,}"):
        build_run_config(data)


def test_the_effective_batch_and_gpu_count_are_capped_in_runconfig():
    cap = CAPS["effective_batch"].high
    assert build_run_config({"model": "x", "micro_batch_size": cap}).effective_batch == cap
    with pytest.raises(ConfigError, match=rf"effective batch at most {cap:,}, got {2 * cap:,}"):
        build_run_config({"model": "x", "micro_batch_size": cap, "grad_accum": 2})
    with pytest.raises(ConfigError, match="world size at most"):
        build_run_config({"model": "x", "hardware": {"gpus_per_node": 1024, "nodes": 2**16}})


@pytest.mark.parametrize(("flag", "key"), [(f, k) for f, k in _FLAG_KEYS.items() if k in CAPS])
def test_every_capped_flag_refuses_what_runconfig_refuses(capsys, flag, key):
    high = CAPS[key].high
    argv = ["estimate", "qwen2.5-0.5b", "--" + flag.replace("_", "-"), str(high + 1)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (f"{high:,}" in err or f"{high}" in err) and CAPS[key].why in err


def test_the_web_pages_path_refuses_batch_10_to_the_35():
    """The UI builds an argparse Namespace without argparse's types: RunConfig refuses."""
    args = argparse.Namespace(model="qwen2.5-0.5b", lora_targets=None, quant=None, gpu=None,
                              **{f: None for f in _FLAG_KEYS})
    args.batch_size = 10**35
    with pytest.raises(ConfigError, match=r"'micro_batch_size': at most 1,048,576, got 1e\+35"):
        run_config_from_args(args)


def test_plan_refuses_a_trillion_samples_per_step_at_once(capsys):
    """The probe's `plan --effective-batch 1000000000000` never answered."""
    t0 = time.perf_counter()
    assert main(["plan", "qwen2.5-0.5b", "--gpu", "rtx-4090",
                 "--effective-batch", "1000000000000"]) == 2
    assert time.perf_counter() - t0 < 30  # a usage error, not a search (generous bound)
    assert "expected a whole number 1 to 1,048,576" in capsys.readouterr().err


@pytest.mark.parametrize(("changes", "match"), [
    ({"effective_batch": 10**12}, "--effective-batch: at most 1,048,576"),
    ({"top": 10**6}, "--top: at most 1,000"),
    ({"gpu": "rtx-4090 x100000"}, r"--gpu \(GPUs per node\): at most 1,024"),
    ({"host_ram_gb": 1e300}, "--host-ram-gb: at most"),
    ({"seq_len": 2**30}, "'seq_len': at most 16,777,216"),
])
def test_the_planners_options_are_capped_as_the_page_sends_them(changes, match):
    opts = PlanOptions(**{"model": "qwen2.5-0.5b", "gpu": "rtx-4090", **changes})
    with pytest.raises(ConfigError, match=match):
        request_from_options(opts)


def test_batch_splits_are_every_divisor_pair_in_order():
    for n in (1, 2, 12, 36, 97, 1024, 2**20):
        expected = [(b, n // b) for b in range(1, n + 1) if n % b == 0]
        assert batch_splits(n) == expected


def test_the_time_budget_ends_the_search_and_says_so():
    opts = PlanOptions(model="qwen2.5-0.5b", gpu="rtx-4090", effective_batch=2**20,
                       time_budget_s=1e-9)
    result = plan(*request_from_options(opts)[:2])
    assert not result.complete
    assert any("the search stopped at its time budget of 1e-09 s" in n for n in result.notes)
    whole = plan(*request_from_options(PlanOptions(model="qwen2.5-0.5b", gpu="rtx-4090"))[:2])
    assert whole.complete and not any("time budget" in n for n in whole.notes)


def test_plan_prints_the_budget_note(capsys):
    assert main(["plan", "qwen2.5-0.5b", "--gpu", "rtx-4090", "--time-budget", "1e-9"]) in (0, 1)
    assert "the search stopped at its time budget" in capsys.readouterr().out.replace("\n", " ")
