"""Launch scripts read with a real shell parser, launchers, flags by meaning, "can't tell".

The shell idioms are tested on small scripts written here; the launchers, the flag
table and the verdicts on the real scripts of tests/fixtures/real_configs (their
provenance is in its README).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomless.check.checker import CheckOptions, check, read_files
from oomless.check.scripts import flags as F
from oomless.check.scripts.launchers import LAUNCHERS, find_launch
from oomless.check.scripts.shell import Unknown, read_shell
from oomless.cli import main
from oomless.errors import CannotTellError, ConfigError

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "real_configs"
SRC = Path(__file__).resolve().parents[2] / "src" / "oomless" / "check" / "scripts"


def _shell(text: str, tmp_path: Path | None = None):
    path = (tmp_path or Path("/nonexistent")) / "run.sh"
    return read_shell(text, path)


def _argv(script, index: int = -1) -> list:
    return [w.value for w in script.commands[index].argv]


# ---- the shell reading -------------------------------------------------------------------
def test_defaults_arithmetic_and_exports():
    s = _shell('GPUS=${GPUS:-2}\nBATCH=${BATCH:-16}\nPER=${PER:-4}\n'
               'ACC=$((BATCH / PER / GPUS))\nexport N=${N:=3}\nrun $ACC $N\n')
    assert _argv(s) == ["run", "2", "3"]
    assert s.value("N") == "3"


def test_an_argument_loop_runs_zero_turns_and_the_default_is_what_runs():
    s = _shell('MODEL="Qwen/Qwen-7B"\nwhile [[ "$1" != "" ]]; do\n  case $1 in\n'
               '    -m | --model ) shift\n      MODEL=$1 ;;\n  esac\n  shift\ndone\n'
               'for a in "$@"; do MODEL=$a; done\npython train.py --model $MODEL\n')
    assert _argv(s) == ["python", "train.py", "--model", "Qwen/Qwen-7B"]


def test_an_if_on_a_missing_argument_takes_its_default():
    s = _shell('ZERO=$2\nif [ "$ZERO" == "" ]; then\n  ZERO=3\nfi\nrun --zero_stage $ZERO\n')
    assert _argv(s)[-1] == "3"
    assert s.commands[-1].argv[-1].span is not None  # the literal 3 a fix would edit


def test_a_default_that_is_used_keeps_the_span_of_its_literal():
    text = 'PER=${PER:-4}\nexport N=${N:=16}\nACC=$((N / PER))\nrun --bs $PER --n ${N} --acc $ACC\n'
    s = _shell(text)
    argv = s.commands[-1].argv
    assert [w.value for w in argv] == ["run", "--bs", "4", "--n", "16", "--acc", "4"]
    (a, b), (c, d) = argv[2].span, argv[4].span
    assert (text[a:b], text[c:d]) == ("4", "16") and text[a - 2:a] == ":-"
    assert argv[6].span is None  # computed: a fix edits its inputs, never the expression
    assert _shell("PER=${PER:-$X}\nrun $PER\n").commands[-1].argv[-1].span is None
    set_first = "export PER=8\nPER=${PER:-4}\nrun $PER\n"  # the value comes from PER=8
    start, end = _shell(set_first).commands[-1].argv[-1].span
    assert set_first[start:end] == "8" and start == set_first.index("8")


def test_a_test_it_cannot_decide_makes_the_variable_unknown():
    s = _shell('if [ -f /etc/x ]; then B=1; else B=2; fi\nrun $B\n')
    assert isinstance(_argv(s)[-1], Unknown)


def test_a_gpu_count_asked_at_run_time_stays_unknown_through_word_splitting():
    s = _shell("G=$(python -c 'import torch; print(torch.cuda.device_count())')\n"
               'ARGS="--nproc_per_node $G \\\n  --nnodes 1"\ntorchrun $ARGS t.py --x 1\n')
    argv = _argv(s)
    assert argv[0] == "torchrun" and argv[1] == "--nproc_per_node" and argv[3:5] == [
        "--nnodes", "1"]
    assert isinstance(argv[2], Unknown) and argv[2].gpu_count and argv[2].line == 1


def test_arrays_case_functions_and_line_continuations():
    s = _shell('A=(x "y z")\nSIZE=7b\ncase $SIZE in\n  7b) LR=1e-5;;\n  *) LR=0;;\nesac\n'
               'f() { OUT=${1:-none}; }\nf given\nrun "${A[1]}" $LR \\\n  $OUT\n')
    assert _argv(s) == ["run", "y z", "1e-5", "given"]


def test_heredocs_write_files_and_fill_variables():
    s = _shell("read -r -d '' CMD <<EOF\nopenrlhf.cli.train_sft \\\n  --max_len $L\nEOF\n"
               'L=9\ncat <<EOF > ds.json\n{"zero_optimization": {"stage": $S}}\nEOF\n'
               "deepspeed --module $CMD\n".replace("$S", "3"))
    assert _argv(s)[:3] == ["deepspeed", "--module", "openrlhf.cli.train_sft"]
    assert "--max_len" in _argv(s)
    assert '"stage": 3' in s.files["ds.json"]


def test_source_reads_a_sibling_file(tmp_path):
    (tmp_path / "common.sh").write_text("MODEL=meta-llama/Llama-2-7b-hf\n")
    s = _shell("source ./common.sh\npython train.py --model_name_or_path $MODEL\n", tmp_path)
    assert _argv(s)[-1] == "meta-llama/Llama-2-7b-hf"


def test_a_script_the_parser_cannot_read_is_a_clear_error():
    with pytest.raises(ConfigError, match="shell parser cannot read"):
        _shell("run (( \n")


# ---- launchers ------------------------------------------------------------------------------
@pytest.mark.parametrize("line,launcher,program,gpus", [
    ("python train.py --a 1", "python", "train.py", 1),
    ("python -m pkg.train --a 1", "python", "pkg.train", 1),
    ("python -m torch.distributed.run --nproc_per_node 4 t.py", "torchrun", "t.py", 4),
    ("torchrun --standalone --nproc_per_node=2 t.py --a 1", "torchrun", "t.py", 2),
    ("torchrun t.py", "torchrun", "t.py", 1),
    ("deepspeed --num_gpus 8 main.py --deepspeed", "deepspeed", "main.py", 8),
    ("deepspeed --include localhost:0,1 main.py", "deepspeed", "main.py", 2),
    ("deepspeed --module openrlhf.cli.train_sft --x 1", "deepspeed", "openrlhf.cli.train_sft",
     None),
    ("accelerate launch --multi_gpu --num_processes 4 t.py", "accelerate launch", "t.py", 4),
    ("accelerate launch -m axolotl.cli.train x.yml", "accelerate launch", "axolotl.cli.train",
     None),
    ("NPROC_PER_NODE=4 swift sft --model m", "swift sft", "swift sft", 4),
    ("tune run --nproc_per_node 2 lora_finetune_distributed --config c.yaml", "tune run",
     "lora_finetune_distributed", 2),
    ("CUDA_VISIBLE_DEVICES=0,1 llamafactory-cli train x.yaml", "llamafactory-cli train",
     "llamafactory-cli train", 2),
    ("axolotl train x.yml", "axolotl train", "axolotl train", None),
])
def test_every_launcher_is_recognised(line, launcher, program, gpus):
    s = _shell(f"mkdir -p out\n{line} 2>&1 | tee log\n")
    found = find_launch(s, "run.sh")
    assert (found.launcher, found.program) == (launcher, program)
    assert found.gpus == gpus or (gpus is None and isinstance(found.gpus, Unknown))


def test_launcher_option_tables_are_sourced():
    for name, row in LAUNCHERS.items():
        assert re.match(r"(torch|deepspeed|accelerate) [0-9.]+ \S+\.py$|Slurm srun\(1\) manual",
                        row["source"]), name
        assert row["processes"], name


# ---- the flag table ------------------------------------------------------------------------
_URL = re.compile(r"https://github\.com/[\w.-]+/[\w.-]+/(blob|tree)/[0-9a-f]{40}/\S+")
_PACKAGE = re.compile(r"(transformers|trl|peft) [0-9.]+ \S+\.py$")  # a pinned package's file


@pytest.mark.parametrize("row", F.ROWS, ids=lambda r: f"{r['flag']}:{r['meaning']}")
def test_every_flag_row_is_sourced_and_read(row):
    assert row["meaning"] in F.MEANINGS
    assert row["tools"] and all(t in F.TOOLS or t == "hf-script" for t in row["tools"])
    assert _URL.match(row["source"]) or _PACKAGE.match(row["source"]) or row[
        "source"].startswith("transformers TrainingArguments")
    for tool in row["tools"]:
        got = F.settings({row["flag"]: 1}, None if tool == "hf-script" else tool)
        assert got[row["meaning"]].key == row["flag"], (tool, got)
    readers = "".join(p.read_text() for p in SRC.glob("*.py"))
    assert f'"{row["meaning"]}"' in readers  # some reader reads this meaning


def test_every_tool_row_is_sourced():
    for tool, row in F.TOOLS.items():
        for part in row["source"].split(" ; "):
            assert _URL.match(part), (tool, part)
        assert set(row["marks"]) <= F.flags_of(tool) | set(row.get("known", ())), tool
        for key in row["defaults"]:
            assert F.meaning_of(key, tool) is not None or key in row.get("known", ()), (tool, key)
        if "bare_flags" in row:  # store_true flags a fix adds alone: flags of the tool
            assert "store_true" in row["bare_flags_from"], tool
            assert set(row["bare_flags"]) <= F.flags_of(tool) | set(row.get("known", ())), tool


# ---- "can't tell" ---------------------------------------------------------------------------
def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "train.sh"
    path.write_text("#!/bin/bash\n" + body)
    return str(path)


def test_an_unknown_method_flag_cannot_be_told_and_method_settles_it(tmp_path, capsys):
    path = _script(tmp_path, "python train.py --model_name_or_path qwen2.5-7b-instruct "
                   "--model_max_length 1024 --my_qlora_switch True --bf16 True\n")
    assert main(["check", path, "--gpu", "a100-80gb"]) == 2
    err = capsys.readouterr().err.strip()
    assert "can't tell the method" in err and "--my_qlora_switch" in err and "--method" in err
    assert len(err.splitlines()) == 1
    settled = check(CheckOptions(files=(path,), gpu="a100-80gb", method="qlora"))
    assert settled.config["method"] == "qlora"


def test_an_unknown_harmless_flag_only_warns(tmp_path):
    path = _script(tmp_path, "python train.py --model_name_or_path qwen2.5-7b-instruct "
                   "--model_max_length 1024 --my_logging_color blue\n")
    result = check(CheckOptions(files=(path,), gpu="a100-80gb"))
    assert any("my_logging_color" in w for w in result.warnings)
    assert result.config["method"] == "full"


def test_no_length_is_never_guessed(tmp_path):
    path = _script(tmp_path, "python train.py --model_name_or_path qwen2.5-7b-instruct\n")
    with pytest.raises(CannotTellError, match="sequence length.*--seq-len"):
        check(CheckOptions(files=(path,), gpu="a100-80gb"))
    assert check(CheckOptions(files=(path,), gpu="a100-80gb", seq_len=512)).config[
        "seq_len"] == 512


def test_a_gpu_count_computed_at_run_time_asks_for_gpu_with_a_count(capsys):
    path = str(CORPUS / "qwen/finetune/finetune_lora_ds.sh")
    assert main(["check", path, "--gpu", "a100-80gb", "--model", "llama-2-7b"]) == 2
    err = capsys.readouterr().err
    assert "can't tell the GPU count" in err and "device_count" in err and "--gpu" in err
    result = check(CheckOptions(files=(path,), gpu="a100-80gb x8", model="llama-2-7b"))
    assert "8 GPU" in result.hardware or result.config["hardware"]["gpus_per_node"] == 8


def test_a_model_not_in_the_catalog_asks_for_model(capsys, tmp_path):
    # Qwen/Qwen-7B is a catalog model: the script checks as qwen-7b
    path = str(CORPUS / "qwen/finetune/finetune_lora_single_gpu.sh")
    assert main(["check", path, "--gpu", "a100-80gb"]) == 0
    assert "qwen-7b on" in capsys.readouterr().out
    other = tmp_path / "finetune_lora_single_gpu.sh"
    other.write_text(Path(path).read_text().replace('MODEL="Qwen/Qwen-7B"',
                                                    'MODEL="someorg/NotInTheCatalog-7B"'))
    assert main(["check", str(other), "--gpu", "a100-80gb"]) == 2
    assert "pass --model" in capsys.readouterr().err


# ---- real scripts read by meaning ------------------------------------------------------------
def _run(name: str, **opts) -> dict:
    return read_files(CheckOptions(files=(str(CORPUS / name),), **opts)).run


def test_qwen_scripts_read_lora_qlora_and_the_default_model():
    lora = _run("qwen/finetune/finetune_lora_ds.sh")
    assert lora["model"] == "Qwen/Qwen-7B" and lora["method"] == "lora"
    assert lora["lora"]["r"] == 64 and lora["lora"]["targets"] == ["c_attn", "c_proj", "w1", "w2"]
    assert (lora["seq_len"], lora["micro_batch_size"], lora["zero"]) == (512, 2, 2)
    q = _run("qwen/finetune/finetune_qlora_single_gpu.sh")
    assert q["method"] == "qlora" and q["precision"] == "fp16"
    assert q["hardware"]["gpus_per_node"] == 1


def test_deepspeed_chat_boolean_deepspeed_lora_dim_and_zero_stage():
    run = _run("deepspeed-chat/run_llama2_7b_lora.sh")
    assert run["zero"] == 3 and run["seq_len"] == 512 and run["precision"] == "fp16"
    assert run["method"] == "full"  # lora_dim without --only_optimize_lora: every weight trains
    assert _run("deepspeed-chat/opt_single_node_run_30b_lora.sh")["method"] == "full"


def test_deepspeed_chat_only_optimize_lora_freezes_the_base(tmp_path):
    path = _script(tmp_path, "deepspeed --num_gpus 2 main.py --model_name_or_path "
                   "qwen2.5-7b-instruct --lora_dim 16 --only_optimize_lora --zero_stage 2 "
                   "--offload --deepspeed\n")
    run = read_files(CheckOptions(files=(path,))).run
    assert run["method"] == "lora" and run["lora"]["r"] == 16
    assert (run["zero"], run["offload"], run["seq_len"]) == (2, "optimizer", 512)
    assert run["hardware"]["gpus_per_node"] == 2


def test_openrlhf_stage_comes_from_its_module_and_an_unmapped_one_cannot_be_told(tmp_path):
    for name, stage in (("train_sft.sh", "sft"), ("train_rm_llama.sh", "rm"),
                        ("train_dpo_llama.sh", "dpo"), ("train_kto_llama.sh", "kto")):
        assert _run(f"openrlhf/{name}", model="meta-llama-3-8b-instruct")["stage"] == stage
    rm = check(CheckOptions(files=(str(CORPUS / "openrlhf/train_rm_llama.sh"),),
                            gpu="a100-80gb x8", model="meta-llama-3-8b-instruct"))
    assert rm.config["stage"] == "rm" and rm.verdict == "fits"  # the 8 GPUs it was written for
    ppo = _script(tmp_path, "deepspeed --module openrlhf.cli.train_ppo --pretrain "
                  "Qwen/Qwen2.5-7B --max_len 2048 --zero_stage 2 --bf16\n")
    with pytest.raises(CannotTellError, match="training stage: the module openrlhf.cli.train_ppo"):
        check(CheckOptions(files=(ppo,), gpu="a100-80gb x8"))


def test_llamafactory_cli_with_its_arguments_as_flags_is_read_by_its_own_reader():
    path = str(CORPUS / "llama-factory-sh/qwen3_lora_sft.sh")
    with pytest.raises(CannotTellError, match="GPU count"):
        check(CheckOptions(files=(path,), gpu="rtx-4090"))
    result = check(CheckOptions(files=(path,), gpu="rtx-4090 x1"))
    cfg = result.config
    assert result.model == "qwen3-4b-instruct-2507" and result.label == "LLaMA-Factory command line"
    assert (cfg["method"], cfg["lora"]["r"], cfg["seq_len"], cfg["precision"]) == (
        "lora", 8, 2048, "bf16")
    assert (cfg["micro_batch_size"], cfg["grad_accum"]) == (1, 8)


def test_openrlhf_fix_sets_the_stage_and_adds_the_bare_offload_flag(tmp_path):
    path = _script(tmp_path, "deepspeed --module openrlhf.cli.train_sft \\\n"
                   "   --pretrain Qwen/Qwen2.5-7B --max_len 2048 \\\n   --zero_stage 2 \\\n"
                   "   --train_batch_size 64 --micro_train_batch_size 2 \\\n"
                   "   --bf16 --flash_attn --gradient_checkpointing\n")
    result = check(CheckOptions(files=(path,), gpu="rtx-4090 x8"))
    assert result.verdict == "out_of_memory"
    new = result.new_texts[path]
    assert "--zero_stage 3 " in new and new.rstrip().endswith("--adam_offload")
    Path(path).write_text(new)
    after = check(CheckOptions(files=(path,), gpu="rtx-4090 x8"))
    assert (after.config["zero"], after.config["offload"]) == (3, "optimizer")
    assert after.within_budget


_ACCELERATE_SFT = ("accelerate launch {opts}--config_file {config} sft.py \\\n"
                   "    --model_name_or_path Qwen/Qwen2.5-7B --max_length 4096 \\\n"
                   "    --per_device_train_batch_size 8 --gradient_accumulation_steps 1 \\\n"
                   "    --bf16 True --gradient_checkpointing True\n")


def test_accelerate_launch_reads_the_config_file_the_script_names(tmp_path, monkeypatch):
    (tmp_path / "zero3.yaml").write_text((CORPUS / "trl/deepspeed_zero3.yaml").read_text())
    (tmp_path / "fsdp.yaml").write_text((CORPUS / "alignment-handbook/fsdp.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    path = _script(tmp_path, _ACCELERATE_SFT.format(opts="", config="zero3.yaml"))
    run = read_files(CheckOptions(files=(path,))).run
    assert (run["zero"], run["offload"], run["hardware"]["gpus_per_node"]) == (3, "none", 8)
    result = check(CheckOptions(files=(path,), gpu="a100-40gb"))
    assert result.verdict == "out_of_memory" and set(result.new_texts) == {
        path, str(tmp_path / "zero3.yaml")}  # the accelerate config's accumulation too
    for file, text in result.new_texts.items():
        Path(file).write_text(text)
    assert check(CheckOptions(files=(path,), gpu="a100-40gb")).within_budget
    two = _script(tmp_path, _ACCELERATE_SFT.format(opts="--num_processes 2 ", config="fsdp.yaml"))
    reading = read_files(CheckOptions(files=(two,)))
    assert reading.run["hardware"]["gpus_per_node"] == 2  # the launcher's flag wins
    assert reading.run["zero"] == 3 and any("FSDP" in a for a in reading.assumptions)
    missing = _script(tmp_path, _ACCELERATE_SFT.format(opts="", config="nowhere.yaml"))
    with pytest.raises(ConfigError, match="accelerate config 'nowhere.yaml'"):
        read_files(CheckOptions(files=(missing,)))


def test_flags_in_a_literal_heredoc_are_edited_where_the_body_writes_them(tmp_path):
    """OpenRLHF's ``read -r -d '' training_commands <<EOF`` then ``deepspeed --module
    $training_commands``: a body without expansions is the script's own text, so the fix
    edits its words in place; the accumulation follows from --train_batch_size and is never
    written as a flag OpenRLHF does not have."""
    path = tmp_path / "train_sft_llama.sh"
    path.write_text((CORPUS / "openrlhf/train_sft_llama.sh").read_text())
    result = check(CheckOptions(files=(str(path),), gpu="a100-40gb x8"))
    assert result.verdict != "fits" and result.diffs
    diff = result.diffs[str(path)]
    assert "+   --micro_train_batch_size 1 \\" in diff and "gradient_accumulation" not in diff
    path.write_text(result.new_texts[str(path)])
    after = check(CheckOptions(files=(str(path),), gpu="a100-40gb x8"))
    assert after.within_budget and after.config["grad_accum"] == 32
    expanded = _script(tmp_path, "M=2\nread -r -d '' CMD <<EOF\nopenrlhf.cli.train_sft "
                       "--pretrain Qwen/Qwen2.5-7B --max_len 2048 --train_batch_size 256 "
                       "--micro_train_batch_size $M --bf16 --gradient_checkpointing\nEOF\n"
                       "deepspeed --module $CMD\n")
    refused = check(CheckOptions(files=(expanded,), gpu="a100-40gb x8"))
    assert refused.verdict != "fits"  # a body with an expansion is not the script's text:
    assert all("--micro_train_batch_size $M " in new  # it is never written over
               for new in refused.new_texts.values())
    assert refused.diffs or any("cannot say it as written" in r for r in refused.refused)


def test_openrlhf_old_and_dotted_flags():
    old = _run("openrlhf/train_sft_llama.sh")
    new = _run("openrlhf/train_sft.sh")
    for run in (old, new):
        assert run["model"] == "meta-llama/Meta-Llama-3-8B" and run["zero"] == 2
        assert run["seq_len"] == 2048 and run["micro_batch_size"] == 2
    assert old["attn"] == "flash" and old["precision"] == "bf16"
    assert new["data"]["packing"] is True
    settled = check(CheckOptions(files=(str(CORPUS / "openrlhf/train_sft.sh"),),
                                 gpu="a100-80gb x8"))
    assert settled.config["grad_accum"] == 256 // (2 * 8)  # --train.batch_size 256
    assert _run("openrlhf/train_sft_mixtral_lora.sh")["lora"]["r"] == 64


def test_minicpm_internvl_and_firefly_read_what_trains():
    m = _run("minicpm-v/finetune/finetune_lora.sh")
    assert m["method"] == "lora" and m["vision"] == {"freeze_tower": False}
    assert m["hardware"]["gpus_per_node"] == 8 and m["seq_len"] == 2048
    i = _run("internvl/internvl_chat/shell/internvl2.5/2nd_finetune/"
             "internvl2_5_1b_dynamic_res_2nd_finetune_lora.sh")
    assert i["method"] == "lora" and i["lora"]["r"] == 16 and i["hardware"]["gpus_per_node"] == 2
    assert i["grad_accum"] == 2 and i["micro_batch_size"] == 4 and i["zero"] == 1
    f = _run("firefly/qwen2.5-7b-sft-qlora.json", model="qwen2.5-7b-instruct")
    assert f["method"] == "qlora" and f["lora"]["r"] == 64 and f["seq_len"] == 1024


def test_minicpm_o_is_counted_as_each_trainer_builds_it(tmp_path):
    """MiniCPM-V's finetune.py loads MiniCPM-o with init_audio=False, init_tts=False and
    LLaMA-Factory's patch_config sets init_tts=False: the modules they leave out of the
    model are left out of the count, and a note says so."""
    from oomless.check.assemble import resolve
    from oomless.models.catalog import get_entry
    from oomless.models.hf_vision_remote import minicpmo_audio_and_tts_params

    whole = get_entry("minicpm-o-2.6").spec
    audio, tts = minicpmo_audio_and_tts_params(get_entry("minicpm-o-2.6").config)
    assert whole.other_params == audio + tts > 0
    opts = CheckOptions(files=(str(CORPUS / "minicpm-v/finetune/finetune_lora.sh"),))
    reading = read_files(opts)
    assert reading.run["model"] == "openbmb/MiniCPM-o-2_6"
    spec = resolve(reading, opts)
    assert spec.param_count == whole.param_count - audio - tts and spec.vision == whole.vision
    assert any("finetune.py" in n and f"{audio + tts:,}" in n for n in reading.notes)
    text = (CORPUS / "llama-factory/qwen2vl_full_sft.yaml").read_text()
    yaml = tmp_path / "minicpmo_full_sft.yaml"
    yaml.write_text(text.replace("Qwen/Qwen2-VL-7B-Instruct", "openbmb/MiniCPM-o-2_6")
                    .replace("template: qwen2_vl", "template: minicpm_o"))
    opts = CheckOptions(files=(str(yaml),))
    reading = read_files(opts)
    assert resolve(reading, opts).param_count == whole.param_count - tts
    assert any("LLaMA-Factory" in n and f"{tts:,}" in n for n in reading.notes)
    qwen = CheckOptions(files=(str(CORPUS / "llama-factory/qwen2vl_full_sft.yaml"),))
    reading = read_files(qwen)
    assert resolve(reading, qwen) == get_entry("qwen2-vl-7b-instruct").spec  # others unchanged


# ---- verdicts against the memory the sources publish ---------------------------------------
# (script, the memory its source states in its first line, a card it must fit, a card it
# must not); ms-swift states the peak of each example in the script's first line
PUBLISHED = [
    ("ms-swift/lora_sft.sh", "# 22GB", "rtx-4090", "t4"),
    # --modules_to_save embed_tokens lm_head: without the copies it would fit the T4
    ("ms-swift/agent_loss_scale_train.sh", "# 20GB", "rtx-4090", "t4"),
    ("ms-swift/qlora_bnb_train.sh", "# 10GB", "rtx-3060", None),
    ("ms-swift/packing_llm.sh", "# 22GB", "rtx-4090", "t4"),
    ("ms-swift/full_train.sh", "# 76GiB", "a100-80gb", "a100-40gb"),
]
# Documented misses: the source's number and why the verdict differs
MISSES = {
    "ms-swift/multimodal_ocr.sh": "# 20GB: checked at max_length 4096 (the cap); the LaTeX-OCR "
    "samples are one image (≤ 1280 tokens at MAX_PIXELS 1003520) and a short formula, so the "
    "run pads to far fewer tokens: --data with the real samples settles it (not shipped)",
}


@pytest.mark.parametrize("name,stated,fits_on,oom_on", PUBLISHED)
def test_verdicts_agree_with_the_published_memory(name, stated, fits_on, oom_on):
    assert (CORPUS / name).read_text().splitlines()[0].strip() == stated
    fits = check(CheckOptions(files=(str(CORPUS / name),), gpu=fits_on))
    assert fits.verdict != "out_of_memory", (fits.device_peak_bytes, fits.low_bytes)
    if oom_on:
        assert check(CheckOptions(files=(str(CORPUS / name),), gpu=oom_on)).verdict != "fits"


def test_documented_misses_are_real_files():
    name, why = "ms-swift/multimodal_ocr.sh", MISSES["ms-swift/multimodal_ocr.sh"]
    assert (CORPUS / name).read_text().splitlines()[0].strip() == why.split(":")[0]
    ocr = check(CheckOptions(files=(str(CORPUS / name),), gpu="rtx-4090"))
    assert ocr.config["seq_len"] == 4096 and ocr.verdict != "fits"  # the miss, as it stands


# Qwen(1)'s README, "Profiling of Memory and Speed" (QwenLM/Qwen README.md at
# 03cd81f5e4da6ab60fc8f97f3b8aa1206fdb08a9): finetune.py on one A100-SXM4-80G, batch 1 ×
# accumulation 8, FlashAttention-2, Qwen-7B; GPU memory in "G" by sequence length. The
# README does not name its counter: "G" is read as 10^9 bytes. Its script, run as the
# table was (batch 1, the length; the LoRA row without trainable embeddings is a chat
# model: finetune.py sets modules_to_save only when the name has no 'chat'; the "LoRA (emb)"
# row is the script as published, on Qwen/Qwen-7B: wte and lm_head trained as copies).
QWEN_LENGTHS = (256, 512, 1024, 2048, 4096, 8192)
QWEN_README = {  # script, the MODEL it runs, --model (the Int4 GPTQ checkpoint), the row
    "LoRA": ("finetune_lora_single_gpu.sh", "Qwen/Qwen-7B-Chat", None,
             (20.1, 20.4, 21.5, 23.8, 29.7, 36.6)),
    "Q-LoRA": ("finetune_qlora_single_gpu.sh", "Qwen/Qwen-7B-Chat-Int4", "qwen-7b",
               (11.5, 11.5, 12.3, 13.9, 16.9, 23.5)),
    "LoRA (emb)": ("finetune_lora_single_gpu.sh", "Qwen/Qwen-7B", None,
                   (33.7, 34.1, 35.2, 35.1, 39.2, 48.5)),
}
# Where the published figure lies outside the estimate's band (memory/band.py), as it
# stands: (row, length) -> which side, and why
QWEN_MISSES = {
    ("Q-LoRA", 256): ("under", "the Int4 GPTQ base is sized as bitsandbytes nf4 weights; "
                      "auto-gptq's own buffers are not modelled"),
    ("Q-LoRA", 4096): ("over", "as at 8192, just outside: +15.8% against the band's +15.7% "
                       "since the kernel images a first step loads (234 MiB) are counted"),
    ("Q-LoRA", 8192): ("over", "the activations grow faster with the length than measured "
                       "(LoRA's row agrees at 8192, Q-LoRA's does not): not explained yet"),
    ("LoRA (emb)", 256): ("under", "13.6 G above the LoRA row where the copies of wte and "
                          "lm_head, their bf16 gradients and AdamW states make 10.0 G; the "
                          "rest is not explained yet (the optimizer step's temporaries of "
                          "the era's foreach AdamW are not counted)"),
    ("LoRA (emb)", 512): ("under", "as at 256 tokens (13.7 G above the LoRA row)"),
    ("LoRA (emb)", 1024): ("under", "as at 256 tokens (13.7 G above the LoRA row), 0.5% "
                           "above the band's top"),
}
MISSES["qwen/finetune (Qwen README)"] = "; ".join(
    f"{row} {n} tokens: estimate {side} the band ({why})"
    for (row, n), (side, why) in QWEN_MISSES.items())


def _qwen_as_profiled(tmp_path: Path, row: str, length: int):
    script, model_id, model, _ = QWEN_README[row]
    shutil.copytree(CORPUS / "qwen", tmp_path / "qwen", dirs_exist_ok=True)
    path = tmp_path / "qwen" / "finetune" / script
    text = path.read_text()
    for old, new in (("--per_device_train_batch_size 2", "--per_device_train_batch_size 1"),
                     ("--model_max_length 512", f"--model_max_length {length}")):
        assert old in text
        text = text.replace(old, new)
    text = re.sub(r'^MODEL="[^"]+"', f'MODEL="{model_id}"', text, count=1, flags=re.M)
    path.write_text(text)
    return check(CheckOptions(files=(str(path),), gpu="a100-80gb", model=model))


@pytest.mark.parametrize("row", sorted(QWEN_README))
def test_qwen_scripts_against_the_memory_table_of_qwens_readme(row, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # finetune/ds_config_zero2.json from the repository root
    published = QWEN_README[row][3]
    for length, gb in zip(QWEN_LENGTHS, published, strict=True):
        result = _qwen_as_profiled(tmp_path / str(length), row, length)
        assert result.config["micro_batch_size"] == 1 and result.config["seq_len"] == length
        assert result.verdict == "fits"  # it ran on the 80 GB card
        measured = gb * 1e9
        side = ("under" if measured > result.high_bytes else
                "over" if measured < result.low_bytes else "in")
        assert side == QWEN_MISSES.get((row, length), ("in",))[0], (
            row, length, result.device_peak_bytes / 1e9, gb)


def test_qwen_lora_on_a_base_model_trains_copies_of_the_embeddings():
    """finetune_lora_single_gpu.sh runs Qwen/Qwen-7B (no 'chat'): finetune.py trains wte and
    lm_head too (PEFT modules_to_save), the README's "LoRA (emb)" row; a chat model does not."""
    result = check(CheckOptions(files=(str(CORPUS / "qwen/finetune/finetune_lora_single_gpu.sh"),),
                                gpu="a100-80gb"))
    assert result.model == "qwen-7b"
    assert result.config["lora"]["modules_to_save"] == ["wte", "lm_head"]
    assert result.lora_reach.endswith("copies of wte, lm_head")
    chat = check(CheckOptions(files=(str(CORPUS / "qwen/finetune/finetune_lora_single_gpu.sh"),),
                              gpu="a100-80gb", model="qwen-7b-chat"))
    assert chat.config["lora"]["modules_to_save"] == []


def test_axolotl_gpt_oss_lora_against_the_memory_of_its_readme(tmp_path):
    """axolotl examples/gpt-oss/README.md (at 30bef60fc403d4b6187515e1ceae75bd67cb7df4):
    "LoRA SFT linear layers (1x48GB @ ~44GiB)", torch's reserved memory from its logs. The
    config offloads the checkpointed activations and computes the loss with Cut
    Cross-Entropy (no logits); both are read, and both lower the estimate."""
    text = (CORPUS / "axolotl/gpt-oss-20b-sft-lora-singlegpu.yaml").read_text()
    path = tmp_path / "gpt-oss.yaml"
    path.write_text(text)
    result = check(CheckOptions(files=(str(path),), gpu="l40s"))
    opts = result.config["stack_options"]
    assert opts["offload_checkpoints"] and opts["cut_cross_entropy"]
    assert result.low_bytes <= 44 * 2**30 <= result.high_bytes  # the README's ~44 GiB
    assert result.verdict != "out_of_memory"  # it ran on a 48 GB card
    for line in ("activation_offloading: true", "  - axolotl.integrations.cut_cross_entropy."
                 "CutCrossEntropyPlugin"):
        assert line in text
        path.write_text(path.read_text().replace(line + "\n", ""))
        bigger = check(CheckOptions(files=(str(path),), gpu="l40s"))
        assert bigger.device_peak_bytes > result.device_peak_bytes
        result = bigger
    assert result.verdict == "out_of_memory"  # what check said before reading them


@pytest.mark.parametrize("name,model", [
    ("unsloth/Qwen2.5_(7B)-Alpaca.py", "qwen2.5-7b-instruct"),
    ("unsloth/Llama3.1_(8B)-Alpaca.py", "llama-3.1-8b-instruct"),
    ("unsloth/Mistral_v0.3_(7B)-Conversational.py", "mistral-7b-instruct-v0.3"),
    ("unsloth/Gemma2_(9B)-Alpaca.py", "gemma-2-9b-it"),
])
def test_unsloth_scripts_are_read_with_ast_and_fit_the_t4_they_are_written_for(name, model):
    path = CORPUS / name
    assert "free** Tesla T4" in path.read_text().splitlines()[3]
    result = check(CheckOptions(files=(str(path),), gpu="t4", model=model))
    cfg = result.config
    assert (cfg["method"], cfg["lora"]["r"], cfg["seq_len"]) == ("qlora", 16, 2048)
    assert (cfg["micro_batch_size"], cfg["grad_accum"], cfg["grad_ckpt"]) == (2, 4, True)
    assert cfg["precision"] == "fp16"  # dtype None: bf16 where the card has it, a T4 has not
    assert result.verdict != "out_of_memory" and not result.diffs


def test_a_python_script_is_never_executed_and_non_literals_cannot_be_told(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("import os\nfrom transformers import AutoModelForCausalLM, TrainingArguments\n"
                    "raise SystemExit('executed')\n"
                    "m = AutoModelForCausalLM.from_pretrained('qwen2.5-0.5b-instruct', "
                    "load_in_4bit=os.environ['Q'])\n"
                    "args = TrainingArguments(per_device_train_batch_size=4, bf16=True)\n")
    with pytest.raises(CannotTellError, match="load_in_4bit.*--method"):
        check(CheckOptions(files=(str(path),), gpu="a100-80gb", seq_len=512))
    result = check(CheckOptions(files=(str(path),), gpu="a100-80gb", seq_len=512, method="full"))
    assert result.config["micro_batch_size"] == 4


# ---- torchtune --------------------------------------------------------------------------------
TUNE = "torchtune/llama3_1_8B_qlora_single_device.yaml"


def test_torchtune_is_read_through_its_components_and_its_length_is_never_guessed():
    path = str(CORPUS / TUNE)
    with pytest.raises(CannotTellError, match="max_seq_len None.*--seq-len"):
        check(CheckOptions(files=(path,), gpu="rtx-4090"))
    cfg = check(CheckOptions(files=(path,), gpu="rtx-4090", seq_len=2048)).config
    assert cfg["model"] == "llama-3.1-8b-instruct" and cfg["method"] == "qlora"
    assert cfg["lora"]["targets"] == ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                      "down_proj"]
    assert (cfg["micro_batch_size"], cfg["grad_accum"], cfg["grad_ckpt"]) == (2, 8, True)
    full = read_files(CheckOptions(files=(str(CORPUS / "torchtune/llama3_1_8B_full_single_device"
                                               ".yaml"),))).run
    assert (full["method"], full["precision"], full["optimizer"]) == (
        "full", "pure-bf16", "paged-adamw-8bit")


def test_tune_run_reads_the_config_it_names(tmp_path):
    (tmp_path / "my.yaml").write_text((CORPUS / TUNE).read_text())
    script = _script(tmp_path, "tune run --nproc_per_node 2 lora_finetune_distributed "
                     "--config my.yaml\n")
    reading = read_files(CheckOptions(files=(script,)))
    assert reading.run["hardware"]["gpus_per_node"] == 2 and reading.run["zero"] == 3
    assert reading.run["method"] == "qlora"


# torchtune's README ("Memory and training speed": batch 2, packed to 2048, compile on):
# the verdict on the card it names. The configs are read with the torchtune stack (its
# LinearCrossEntropyLoss, optimizer_in_bwd and paged 8-bit AdamW of the full recipe);
# their own compile: False is kept, so the estimates are eager (above the README's)
TORCHTUNE_README = [
    ("torchtune/llama3_1_8B_qlora_single_device.yaml", 7.4, "fits"),
    ("torchtune/llama3_1_8B_lora_single_device.yaml", 16.2, "fits"),
    ("torchtune/llama3_1_8B_full_single_device.yaml", 18.9, "fits"),
]
@pytest.mark.parametrize("name,published_gib,verdict", TORCHTUNE_README)
def test_torchtune_verdicts_on_the_4090_of_its_readme(name, published_gib, verdict):
    result = check(CheckOptions(files=(str(CORPUS / name),), gpu="rtx-4090", seq_len=2048))
    assert published_gib * 2**30 < result.gpu_memory_bytes  # the README ran it on a 4090
    assert result.verdict == verdict  # never out_of_memory for a run that ran
    assert result.config["stack"] == "torchtune"


def test_torchtune_compile_reaches_the_estimate(tmp_path):
    """compile: True in the recipe turns on the partitioner's saved tensors and says so;
    this config's LinearCrossEntropyLoss stays eager (its releases skipped compiling it),
    so its peak (the loss) does not move (tests/memory/test_torchtune_stack.py shows the
    chunked-output loss that does)."""
    text = (CORPUS / "torchtune/llama3_1_8B_lora_single_device.yaml").read_text()
    assert "compile: False" in text
    (tmp_path / "compiled.yaml").write_text(text.replace("compile: False", "compile: True"))
    eager = check(CheckOptions(files=(str(CORPUS / "torchtune/llama3_1_8B_lora_single_device"
                                                   ".yaml"),), gpu="rtx-4090", seq_len=2048))
    compiled = check(CheckOptions(files=(str(tmp_path / "compiled.yaml"),), gpu="rtx-4090",
                                  seq_len=2048))
    assert compiled.config["stack_options"]["compile"] is True
    assert "compile" not in eager.config["stack_options"] or \
        eager.config["stack_options"]["compile"] is False
    assert compiled.device_peak_bytes <= eager.device_peak_bytes
    assert any("compile: torch.compile" in a and "min-cut partitioner" in a
               for a in compiled.assumptions)


# ---- launches that name a configuration, DeepSpeed files the script writes -----------------
def test_llamafactory_cli_and_axolotl_launches_read_their_yaml(tmp_path):
    for folder, name in (("llama-factory", "llama3_lora_sft.yaml"), ("axolotl", "qlora.yml")):
        (tmp_path / name).write_text((CORPUS / folder / name).read_text())
    lf = _script(tmp_path, "export NPROC_PER_NODE=4\nFORCE_TORCHRUN=1 llamafactory-cli train "
                 "llama3_lora_sft.yaml\n")
    reading = read_files(CheckOptions(files=(lf,)))
    assert reading.kind == "llamafactory" and reading.run["hardware"]["gpus_per_node"] == 4
    assert reading.run["method"] == "lora" and reading.run["seq_len"] == 1024
    ax = _script(tmp_path, "accelerate launch --num_processes 2 -m axolotl.cli.train qlora.yml\n")
    reading = read_files(CheckOptions(files=(ax,)))
    assert reading.kind == "axolotl" and reading.run["hardware"]["gpus_per_node"] == 2
    missing = _script(tmp_path, "llamafactory-cli train nowhere.yaml\n")
    with pytest.raises(ConfigError, match="'nowhere.yaml' not found"):
        read_files(CheckOptions(files=(missing,)))


def test_a_deepspeed_file_written_by_a_heredoc_is_read(tmp_path):
    path = _script(tmp_path, "STAGE=3\ncat <<EOF > ds.json\n{\"zero_optimization\": "
                   "{\"stage\": $STAGE, \"offload_optimizer\": {\"device\": \"cpu\"}}}\nEOF\n"
                   "torchrun --nproc_per_node 4 train.py --model_name_or_path "
                   "qwen2.5-7b-instruct --model_max_length 1024 --deepspeed ds.json\n")
    run = read_files(CheckOptions(files=(path,))).run
    assert (run["zero"], run["offload"], run["hardware"]["gpus_per_node"]) == (3, "optimizer", 4)


def test_a_fix_edits_the_literal_a_variable_holds(tmp_path):
    path = _script(tmp_path, "BS=16\npython train.py --model_name_or_path qwen2.5-7b-instruct "
                   "--model_max_length 1024 --bf16 True --per_device_train_batch_size $BS\n")
    result = check(CheckOptions(files=(path,), gpu="rtx-4090", method="lora"))
    assert result.exit_code == 1 and result.diffs
    new = result.new_texts[path]
    assert new.splitlines()[1].startswith("BS=") and new.splitlines()[1] != "BS=16"
    assert "$BS" in new


def test_the_legacy_distributed_launch_and_its_boolean_flag():
    s = _shell("python -m torch.distributed.launch --use_env --nproc_per_node=8 train.py --a 1\n")
    found = find_launch(s, "run.sh")
    assert (found.launcher, found.program, found.gpus) == ("torchrun", "train.py", 8)


# ---- properties ------------------------------------------------------------------------------
_LITERAL = st.text(st.sampled_from("abcxyz019_./-"), min_size=1, max_size=12).filter(
    lambda v: not v.startswith("-"))


@settings(max_examples=40, deadline=None)
@given(value=_LITERAL, quoted=st.booleans(), default=st.booleans())
def test_a_variable_reads_back_its_literal_and_its_span(value, quoted, default):
    written = f'"{value}"' if quoted else value
    text = (f"X=${{X:-{written}}}\n" if default else f"X={written}\n") + "run --k $X\n"
    s = _shell(text)
    word = s.commands[-1].argv[-1]
    assert word.value == value
    if not default:
        start, end = word.span
        assert text[start:end] == value  # a fix edits exactly the literal


def test_slurm_srun_runs_one_task_per_gpu():
    s = _shell('GPUS_PER_NODE=${GPUS_PER_NODE:-8}\nSRUN_ARGS=${SRUN_ARGS:-""}\n'
               "srun -p part --gres=gpu:${GPUS_PER_NODE} --ntasks-per-node=${GPUS_PER_NODE} "
               "--kill-on-bad-exit=1 ${SRUN_ARGS} python -u train.py --a 1\n")
    found = find_launch(s, "run.sh")
    assert (found.launcher, found.program, found.gpus) == ("srun", "train.py", 8)
    assert [w.value for w in found.args] == ["--a", "1"]


def test_llamafactory_arguments_on_the_command_line_and_its_yaml_launch():
    base = "llama-factory-0.6/examples"
    lora = read_files(CheckOptions(files=(str(CORPUS / base / "lora_single_gpu/sft.sh"),)))
    assert lora.kind == "llamafactory" and lora.run["method"] == "lora"
    assert lora.run["lora"]["targets"] == ["q_proj", "v_proj"] and lora.run["seq_len"] == 1024
    assert lora.run["precision"] == "fp16" and lora.run["hardware"]["gpus_per_node"] == 1
    q = read_files(CheckOptions(files=(str(CORPUS / base / "qlora_single_gpu/bitsandbytes.sh"),)))
    assert q.run["method"] == "qlora" and q.run["quantization"]["bits"] == 4
    full = read_files(CheckOptions(files=(str(CORPUS / base / "full_multi_gpu/single_node.sh"),)))
    assert full.run["method"] == "full" and full.run["zero"] == 3
    assert full.run["hardware"]["gpus_per_node"] == 4  # --nproc_per_node $NPROC_PER_NODE


def test_hf_and_axolotl_torch_compile_reach_the_compile_mechanism(tmp_path):
    """TrainingArguments.torch_compile (a launch flag, or axolotl's key that it passes on)
    turns on the partitioner's saved tensors for the layers; the loss stays eager."""
    path = _script(tmp_path, "python train.py --model_name_or_path qwen2.5-7b-instruct "
                   "--model_max_length 1024 --bf16 True --torch_compile True\n")
    launch = read_files(CheckOptions(files=(path,))).run
    assert launch["stack_options"] == {"compile": True}
    text = (CORPUS / "axolotl/lora-8b.yml").read_text()
    assert "torch_compile" not in text
    (tmp_path / "lora.yml").write_text(text + "torch_compile: true\n")
    eager = check(CheckOptions(files=(str(CORPUS / "axolotl/lora-8b.yml"),), gpu="a100-80gb"))
    compiled = check(CheckOptions(files=(str(tmp_path / "lora.yml"),), gpu="a100-80gb"))
    assert compiled.config["stack_options"]["compile"] is True
    assert compiled.device_peak_bytes <= eager.device_peak_bytes
