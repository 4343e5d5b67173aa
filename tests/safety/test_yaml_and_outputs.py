"""YAML alias bombs and hostile YAML for every reader; outputs that would overwrite an
input or a user's file (plan, report) are refused, with --force keeping FILE.orig."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import pytest

from oomless.cli import main
from oomless.config import MAX_YAML_NODES, load_run_config, parse_yaml_with_lines
from oomless.errors import ConfigError


def lol_bomb(levels: int = 9) -> str:
    """The "billion laughs": 9 lines, each naming the previous one 9 times (9^9 values)."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        prev, cur = chr(96 + i), chr(97 + i)
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    return "\n".join(lines) + "\n"


LLAMAFACTORY_BOMB = ("model_name_or_path: Qwen/Qwen2.5-7B-Instruct\nstage: sft\ndo_train: true\n"
                     "finetuning_type: lora\nlora_target: all\ndataset: alpaca_en_demo\n"
                     "template: qwen\ncutoff_len: 2048\nper_device_train_batch_size: 2\n"
                     "gradient_accumulation_steps: 8\nlearning_rate: 1.0e-4\nbf16: true\n"
                     "output_dir: saves/qwen\n" + lol_bomb())


def _peak_mib(fn) -> float:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def test_the_alias_bomb_of_the_report_is_small_and_refused():
    bomb = lol_bomb()
    assert len(bomb) < 400  # the 352-byte file grew to 13.7 GB in `check`
    with pytest.raises(ConfigError, match=rf"expand to more than {MAX_YAML_NODES:,} values"):
        parse_yaml_with_lines(bomb, "bomb.yaml")


@pytest.mark.parametrize("argv", [
    ["check", "{f}"], ["estimate", "{f}"], ["plan", "{f}"], ["train", "{f}"],
])
@pytest.mark.parametrize("text", [lol_bomb(), LLAMAFACTORY_BOMB], ids=["lol", "llamafactory"])
def test_every_command_refuses_an_alias_bomb_in_bounded_memory(tmp_path, capsys, argv, text):
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    codes = []
    peak = _peak_mib(lambda: codes.append(main([a.format(f=path) for a in argv])))
    err = capsys.readouterr().err
    assert codes == [2] and "Traceback" not in err
    assert "anchors and aliases expand" in err and str(path) in err
    assert peak < 64


def test_report_refuses_a_bomb_in_the_run_folder(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "memlog.jsonl").write_text(json.dumps({"step": 1, "peak_bytes": [1]}) + "\n")
    (run / "oomless.yaml").write_text(lol_bomb())
    assert main(["report", str(run)]) == 2
    assert "anchors and aliases expand" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "match"), [
    ("a: &a [*a]\n", "an alias refers to itself"),
    ("a: " + "[" * 100 + "]" * 100 + "\n", "nested more than 64 levels"),
    ("- " * 10_000 + "x\n", "nested more than 64 levels"),
    ("model: x\n1: 2\n", r":2: a key must be a name; got int '1'"),
    ("model: x\n[a]: 2\n", "a key must be a name"),
    ("seq_len: " + "9" * 5000 + "\n", "a value cannot be read"),
    ("created: 2024-13-45\n", "a value cannot be read"),
    ("model: !!python/object/apply:os.system [echo hi]\n", "not valid YAML"),
    ("- a\n- b\n", "got a list"),
    ("just text\n", "got a single value"),
    ("a: 1\n---\nb: 2\n", "not valid YAML"),
])
def test_hostile_yaml_is_a_config_error(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_yaml_with_lines(text, "f.yaml")


def test_yaml_merge_keys_and_shared_anchors_still_work():
    data, lines = parse_yaml_with_lines("base: &b {r: 8}\nlora:\n  <<: *b\n  alpha: 16\n", "f")
    assert data["lora"] == {"r": 8, "alpha": 16} and lines["lora.alpha"] == 4


@pytest.mark.parametrize(("yaml_text", "match"), [
    ("model: llama-3.1-8b-instruct\nhardware:\n", None),  # an empty section plus a flag: the flag wins
    ("model: llama-3.1-8b-instruct\nhardware: 4090\n", r"'hardware' is 4090, not a section"),
    ("model: llama-3.1-8b-instruct\nhardware:\n  host_ram_gb: .nan\n", "finite number"),
    ("model: llama-3.1-8b-instruct\ntraining:\n  learning_rate: .inf\n", "finite number"),
])
def test_sections_and_non_finite_numbers(tmp_path, capsys, yaml_text, match):
    path = tmp_path / "run.yaml"
    path.write_text(yaml_text)
    code = main(["estimate", str(path), "--gpu", "4090", "--nodes", "1"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if match is None:
        assert code in (0, 1), err
    else:
        assert code == 2 and __import__("re").search(match, err), err


def test_a_file_too_big_for_a_configuration_is_refused_unread(tmp_path):
    path = tmp_path / "big.yaml"
    with open(path, "wb") as fh:
        fh.truncate(17 * 2**20)
    with pytest.raises(ConfigError, match="a file of this kind is at most"):
        load_run_config(path)


# ---- outputs ----------------------------------------------------------------------------
def _users_plan_folder(tmp_path: Path) -> Path:
    out = tmp_path / "mine"
    out.mkdir()
    for name, text in {"oomless.yaml": "model: mine\n", "training_args.json": "{}\n",
                       "deepspeed.json": '{"zero_optimization": {"stage": 3}}\n'}.items():
        (out / name).write_text(text)
    return out


def test_plan_out_never_replaces_a_users_files_without_force(tmp_path, capsys):
    out = _users_plan_folder(tmp_path)
    argv = ["plan", "llama-3.1-8b-instruct", "--gpu", "a100-80gb", "--out", str(out)]
    assert main(argv) == 2
    assert "holds files oomless did not write (deepspeed.json, oomless.yaml, training_args" \
        in capsys.readouterr().err
    assert (out / "oomless.yaml").read_text() == "model: mine\n"
    assert main([*argv, "--force"]) == 0
    assert (out / "oomless.yaml.orig").read_text() == "model: mine\n"
    assert (out / "training_args.json.orig").read_text() == "{}\n"
    written = set(json.loads((out / ".oomless-files.json").read_text()))
    if "deepspeed.json" not in written:  # the user's stale ZeRO file is not left beside ours
        assert (out / "deepspeed.json.orig").is_file() and not (out / "deepspeed.json").exists()
    assert main(argv) == 0  # a rerun replaces its own files without --force
    assert not (out / "oomless.yaml.orig.1").exists()


def test_plan_out_never_writes_over_its_input(tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["plan", "llama-3.1-8b-instruct", "--gpu", "a100-80gb", "--out", str(out)]) == 0
    assert main(["plan", str(out / "oomless.yaml"), "--gpu", "a100-80gb", "--out",
                 str(out), "--force"]) == 2
    assert "is an input of this command" in capsys.readouterr().err


@pytest.mark.parametrize("out", ["/dev/null", "a-file"])
def test_plan_out_that_is_not_a_folder(tmp_path, capsys, out):
    target = Path(out) if out.startswith("/") else tmp_path / out
    if not out.startswith("/"):
        target.write_text("x")
    assert main(["plan", "llama-3.1-8b-instruct", "--gpu", "a100-80gb", "--out", str(target)]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def _run_folder(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "memlog.jsonl").write_text(json.dumps({"step": 1, "peak_bytes": [2**30]}) + "\n")
    return run


@pytest.mark.parametrize("name", ["memlog.jsonl", "oomless.yaml"])
def test_report_never_writes_over_its_input(tmp_path, capsys, name):
    pytest.importorskip("plotly")
    run = _run_folder(tmp_path)
    if name == "oomless.yaml":
        (run / name).write_text("model: llama-3.1-8b-instruct\n")
    before = (run / name).read_text()
    assert main(["report", str(run), "--out", str(run / name), "--force"]) == 2
    assert "is an input of this command" in capsys.readouterr().err
    assert (run / name).read_text() == before


def test_report_replaces_its_own_html_but_not_a_users(tmp_path, capsys):
    pytest.importorskip("plotly")
    run = _run_folder(tmp_path)
    assert main(["report", str(run)]) == 0
    assert main(["report", str(run)]) == 0  # its own report: replaced
    page = tmp_path / "page.html"
    page.write_text("<html>mine</html>")
    assert main(["report", str(run), "--out", str(page)]) == 2
    assert "is not an oomless report" in capsys.readouterr().err
    assert main(["report", str(run), "--out", str(page), "--force"]) == 0
    assert (tmp_path / "page.html.orig").read_text() == "<html>mine</html>"
    assert main(["report", str(run), "--out", "/dev/null"]) == 2
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


def test_rich_markup_in_a_path_is_printed_as_is(tmp_path, capsys):
    out = tmp_path / "run[link=file:x]x[/link][bold]"
    assert main(["plan", "llama-3.1-8b-instruct", "--gpu", "a100-80gb", "--out", str(out)]) == 0
    assert f"wrote {out}/oomless.yaml" in capsys.readouterr().out.replace("\n", "")
