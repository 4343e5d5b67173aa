"""Fixes that work in the tool that runs them: DeepSpeed "auto" values are never
replaced (the HF Trainer fills them from TrainingArguments and refuses a mismatch),
"auto" is read from the TrainingArguments beside it, and a fix that needs a
DeepSpeed file points to one that exists, or writes it (oomless.check.dsfiles)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from oomless.check.checker import CheckOptions, check, read_files
from oomless.check.dsfiles import candidates, deepspeed_text
from oomless.cli import main
from oomless.errors import ConfigError

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "real_configs"
LF_DS3 = CORPUS / "llama-factory" / "ds_z3_config.json"  # every batch/precision key "auto"


def _autos(data, path=()) -> set[tuple]:
    if isinstance(data, dict):
        return set().union(*(_autos(v, path + (k,)) for k, v in data.items())) if data else set()
    return {path} if data == "auto" else set()


def _ta(tmp_path: Path, **keys) -> Path:
    ta = tmp_path / "args.json"
    ta.write_text(json.dumps({"output_dir": "out", "deepspeed": "ds.json", **keys}, indent=2))
    return ta


def test_a_deepspeed_file_alone_with_auto_batch_is_cant_tell(tmp_path):
    with pytest.raises(ConfigError, match=r"can't tell .*train_micro_batch_size_per_gpu"):
        read_files(CheckOptions(files=(str(LF_DS3),), model="qwen2.5-7b-instruct"))


@pytest.mark.parametrize("bf16,expected", [(True, "bf16"), (None, "fp32")])
def test_auto_precision_is_read_from_the_training_arguments(tmp_path, bf16, expected):
    shutil.copy(LF_DS3, tmp_path / "ds.json")
    ta = _ta(tmp_path, **({"bf16": bf16} if bf16 is not None else {}))
    reading = read_files(CheckOptions(files=(str(ta), str(tmp_path / "ds.json")),
                                      model="qwen2.5-7b-instruct"))
    assert reading.run["precision"] == expected  # TrainingArguments.bf16 defaults to False


def test_no_auto_value_is_replaced_by_a_fix(tmp_path):
    shutil.copy(LF_DS3, tmp_path / "ds.json")
    ta = _ta(tmp_path, per_device_train_batch_size=16, gradient_accumulation_steps=1, bf16=True)
    opts = CheckOptions(files=(str(ta), str(tmp_path / "ds.json")), gpu="a100-40gb x8",
                        model="qwen2.5-7b-instruct", seq_len=4096, method="full")
    result = check(opts)
    assert result.fix is not None
    before = _autos(json.loads(LF_DS3.read_text()))
    for path, text in result.new_texts.items():
        if path.endswith("ds.json"):
            assert _autos(json.loads(text)) >= before
    assert str(ta) in result.diffs


def _project(tmp_path: Path, script: str) -> Path:
    """A checkout (with .git) holding only the script, under scripts/v1_5."""
    root = tmp_path / "proj"
    (root / ".git").mkdir(parents=True)
    (root / "scripts" / "v1_5").mkdir(parents=True)
    shutil.copy(CORPUS / "llava" / script, root / "scripts" / "v1_5" / script)
    return root


def test_a_fix_that_needs_a_deepspeed_file_writes_it_and_points_to_it(tmp_path, monkeypatch,
                                                                      capsys):
    root = _project(tmp_path, "finetune.sh")
    monkeypatch.chdir(root)
    script = Path("scripts/v1_5/finetune.sh")
    argv = ["check", str(script), "--gpu", "a100-80gb x2", "--model", "llama-2-13b"]
    result = check(CheckOptions(files=(str(script),), gpu="a100-80gb x2", model="llama-2-13b"))
    assert result.fix["config"]["offload"] == "all"  # ZeRO-3 → ZeRO-3 with offload
    assert main([*argv, "--write"]) == 1
    capsys.readouterr()
    ref = next(line.split()[1] for line in script.read_text().splitlines()
               if "--deepspeed" in line)
    assert Path(ref).is_file() and ref == "scripts/v1_5/zero3_offload.json"
    written = json.loads(Path(ref).read_text())
    assert written["zero_optimization"]["stage"] == 3
    assert written["zero_optimization"]["offload_param"]["device"] == "cpu"
    # the batch and precision stay the Trainer's: "auto"
    assert {("train_micro_batch_size_per_gpu",), ("bf16", "enabled")} <= _autos(written)
    after = check(CheckOptions(files=(str(script),), gpu="a100-80gb x2", model="llama-2-13b"))
    assert after.config["offload"] == "all" and after.within_budget


def test_a_fix_points_to_the_tools_own_file_where_the_checkout_has_it(tmp_path, monkeypatch):
    root = _project(tmp_path, "finetune.sh")
    for name in ("zero3.json", "zero3_offload.json"):
        shutil.copy(CORPUS / "llava" / name, root / "scripts" / name)
    monkeypatch.chdir(root)
    result = check(CheckOptions(files=("scripts/v1_5/finetune.sh",), gpu="a100-80gb x2",
                                model="llama-2-13b"))
    (diff,) = result.diffs.values()
    assert "+    --deepspeed ./scripts/zero3_offload.json \\" in diff
    assert set(result.new_texts) == {"scripts/v1_5/finetune.sh"}  # nothing new to write


def test_referenced_files_are_looked_up_cwd_then_beside_then_up_to_the_repo_root(
        tmp_path, monkeypatch):
    root = tmp_path / "repo"
    (root / ".git").mkdir(parents=True)
    script = root / "a" / "b" / "run.sh"
    script.parent.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    found = candidates("cfg/ds.json", script)
    assert found[0] == Path("cfg/ds.json")  # the working directory first
    assert found[1] == script.parent.resolve() / "cfg/ds.json"  # then beside the script
    ups = [p.parent.parent for p in found[3:]]
    assert ups == [root.resolve() / "a", root.resolve()]  # parents, up to the repo root


@pytest.mark.slow  # imports transformers and DeepSpeed (~15 s)
@pytest.mark.parametrize("zero,offload", [(2, "none"), (2, "optimizer"), (3, "none"),
                                          (3, "all")])
def test_the_written_deepspeed_file_is_accepted_by_transformers_and_deepspeed(zero, offload):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    ds = json.loads(deepspeed_text(zero, offload))
    args = TrainingArguments(output_dir="out", per_device_train_batch_size=2,
                             gradient_accumulation_steps=4, bf16=True, use_cpu=True)
    hf = HfTrainerDeepSpeedConfig(ds)
    hf.trainer_config_process(args)  # raises on a value that disagrees with the arguments

    class Model:
        class config:  # noqa: N801
            hidden_size = 4096

    hf.trainer_config_finalize(args, Model(), 1000)
    parsed = DeepSpeedConfig(hf.config)
    assert parsed.zero_optimization_stage == zero
    assert parsed.train_micro_batch_size_per_gpu == 2 and parsed.bfloat16_config.enabled


@pytest.mark.slow  # imports transformers (~10 s)
def test_the_edited_training_arguments_are_accepted_by_hf_argument_parser(tmp_path):
    from transformers import HfArgumentParser, TrainingArguments

    shutil.copy(LF_DS3, tmp_path / "ds.json")
    ta = _ta(tmp_path, per_device_train_batch_size=16, gradient_accumulation_steps=1, bf16=True)
    result = check(CheckOptions(files=(str(ta), str(tmp_path / "ds.json")), gpu="a100-40gb x8",
                                model="qwen2.5-7b-instruct", seq_len=4096, method="full"))
    edited = json.loads(result.new_texts[str(ta)])
    edited.pop("deepspeed")  # the DeepSpeed engine is not started here
    (args,) = HfArgumentParser(TrainingArguments).parse_dict({**edited, "use_cpu": True})
    fix = result.fix["config"]
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (
        fix["micro_batch_size"], fix["grad_accum"])


def _hf_fields() -> set[str]:
    import dataclasses

    from transformers import TrainingArguments

    return {f.name for f in dataclasses.fields(TrainingArguments)}


@pytest.mark.slow  # checks every corpus case (~75) and imports transformers and DeepSpeed
def test_every_corpus_fix_is_valid_for_the_tool_that_reads_it(tmp_path, monkeypatch):
    """Each printed fix: DeepSpeed JSON parses, keeps every "auto" and is accepted by
    transformers' HfTrainerDeepSpeedConfig and DeepSpeed's DeepSpeedConfig; a
    TrainingArguments JSON or launch script's TrainingArguments keys parse with
    HfArgumentParser; a referenced DeepSpeed file exists after --write."""
    from test_corpus import CASES, _auto_batch_alone, _copy
    from transformers import HfArgumentParser, TrainingArguments

    from oomless.check.shellargs import parse_launch, typed

    fields = _hf_fields()
    checked = 0
    for names, (gpu, extra) in sorted(CASES.items()):
        if _auto_batch_alone(names):
            continue
        case = tmp_path / "+".join(n.replace("/", "_") for n in names)
        case.mkdir()
        paths = _copy(case, names)
        monkeypatch.chdir(case)
        result = check(CheckOptions(files=tuple(map(str, paths)), gpu=gpu, **extra))
        for path, text in result.new_texts.items():
            old = Path(path).read_text() if Path(path).exists() else ""
            if path.endswith(".json") and "zero_optimization" in text:
                new = json.loads(text)
                assert _autos(new) >= (_autos(json.loads(old)) if old else set()), path
            elif path.endswith((".yaml", ".yml")):
                import yaml

                ref = (yaml.safe_load(text) or {}).get("deepspeed")
                was = (yaml.safe_load(old) or {}).get("deepspeed") if old else None
                assert not isinstance(ref, str) or ref == was or Path(ref).is_file() \
                    or str(Path(ref).resolve()) in {str(Path(p).resolve())
                                                    for p in result.new_texts}, ref
            elif path.endswith(".sh"):
                args = {k: v for k, v in parse_launch(text, path).args.items() if k in fields}
                values = {k: typed(a.values) for k, a in args.items()}
                # the DeepSpeed engine is not started here; tf32 asks for an Ampere GPU
                values = {k: v for k, v in values.items() if k not in ("deepspeed", "tf32")}
                HfArgumentParser(TrainingArguments).parse_dict(
                    {**values, "output_dir": "out", "use_cpu": True}, allow_extra_keys=True)
                ref, was = (typed(a["deepspeed"].values) if "deepspeed" in a else None
                            for a in (parse_launch(text, path).args,
                                      parse_launch(old, path).args))
                assert ref == was or Path(ref).is_file() \
                    or str(Path(ref).resolve()) in {str(Path(p).resolve())
                                                    for p in result.new_texts}, ref
            checked += 1
    assert checked >= 10
