"""A TRL recipe that leaves ``bf16`` or ``gradient_checkpointing`` unset is read with the
trainer config's own default of the TRL release that runs it, not TrainingArguments'.

The releases come from TRL's history (huggingface/trl): v0.18.2's SFTConfig has no bf16
field (TrainingArguments' False); PR #3515 (commit 32ffa1170, "New defaults: bf16=True")
and PR #3598 (commit 4c92de000, bf16 None -> ``not fp16`` in ``__post_init__``) are first
in v0.19.0, for SFT, DPO, KTO, reward, ORPO, CPO and GRPO configs alike; PR #3510 (commit
a222aeb46, "New defaults: gradient_checkpointing=True") is first in v0.22.0. The installed
TRL is the judge of its own release: the slow test builds its configs.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest

from oomless.check.checker import CheckOptions, read_files
from oomless.check.readers_trl import trl_defaults, trl_version

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "real_configs"


@pytest.mark.parametrize(("version", "precision", "grad_ckpt"), [
    ("0.18.2", None, False), ("0.19.0", "bf16", False), ("0.21.0", "bf16", False),
    ("0.22.0", "bf16", True), ("1.16.0", "bf16", True), ("1.16.0.dev0", "bf16", True),
])
def test_an_unset_recipe_follows_the_release(version, precision, grad_ckpt):
    run, notes = trl_defaults({"model_name_or_path": "x"}, version)
    assert run.get("precision") == precision
    assert run["grad_ckpt"] is grad_ckpt
    assert len(notes) == 2 and all(f"TRL {version}" in n for n in notes)


@pytest.mark.parametrize("recipe", [
    {"bf16": False}, {"bf16": True}, {"fp16": True}, {"pure_bf16": True},
    {"gradient_checkpointing": False}, {"activation_checkpointing": False},
])
def test_what_the_recipe_sets_is_kept(recipe):
    run, _notes = trl_defaults(recipe, "1.16.0")
    assert ("precision" in run) == (not any(k in recipe for k in ("bf16", "fp16", "pure_bf16")))
    assert ("grad_ckpt" in run) == (not any("checkpointing" in k for k in recipe))


def test_the_trl_example_config_reads_as_the_installed_trl_runs_it():
    # examples/cli_configs/example_config.yaml sets neither key
    reading = read_files(CheckOptions(files=(str(CORPUS / "trl/example_config.yaml"),)))
    expected, _ = trl_defaults({}, trl_version())
    assert {k: reading.run[k] for k in expected} == expected
    assert sum(f"TRL {trl_version()}" in n for n in reading.notes) == 2


# stage -> (the recipe keys that select it, the TRL config class that reads it)
STAGES = {
    "sft": ({}, "trl.SFTConfig"),
    "dpo": ({"beta": 0.1}, "trl.DPOConfig"),
    "kto": ({"desirable_weight": 1.0}, "trl.KTOConfig"),
    "rm": ({"center_rewards_coefficient": 0.01}, "trl.RewardConfig"),
    "orpo": ({}, "trl.experimental.orpo.ORPOConfig"),  # read from the file name
    "simpo": ({"loss_type": "simpo"}, "trl.experimental.cpo.CPOConfig"),
}


def _config_class(dotted: str):
    import importlib

    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.slow
@pytest.mark.parametrize("stage", sorted(STAGES))
@pytest.mark.parametrize("extra", [{}, {"fp16": True}, {"gradient_checkpointing": False}])
def test_the_reading_equals_the_installed_trl_config(stage, extra, tmp_path):
    """The installed TRL's own config, built from the recipe's keys, holds the bf16 and
    gradient_checkpointing the reader reads."""
    import yaml

    keys, dotted = STAGES[stage]
    recipe = {"model_name_or_path": "Qwen/Qwen2.5-0.5B", "use_peft": True, **keys, **extra}
    path = tmp_path / f"{stage}.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    reading = read_files(CheckOptions(files=(str(path),), model="qwen2.5-0.5b-instruct"))
    assert reading.run["stage"] == stage
    cls = _config_class(dotted)
    fields = {f.name for f in dataclasses.fields(cls)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers 5: gradient_checkpointing renamed
        # use_cpu: a bf16 config is refused on a machine without a GPU otherwise
        args = cls(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True,
                   **{k: v for k, v in recipe.items() if k in fields})
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    assert (reading.run["precision"], reading.run["grad_ckpt"]) == \
        (precision, bool(args.gradient_checkpointing))
