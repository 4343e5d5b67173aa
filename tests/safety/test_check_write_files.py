"""Issue 18, item 5: `check --write` edits the file a user named as it is (through a
symlink, CRLF line ends, a byte-order mark, its permission bits), and the one YAML reader
refuses what it would otherwise read wrong (a duplicate key, a tab after ``key:``) or name
wrongly (a big file without aliases), each with its line."""

from __future__ import annotations

import os

import pytest

from oomless.cli import main
from oomless.config import MAX_YAML_NODES, parse_yaml_with_lines
from oomless.errors import ConfigError

# Full fine-tuning of a 0.5B model at micro batch 8 does not fit a 24 GB card: the
# smallest fix replaces micro_batch_size and adds grad_accum (one line replaced, one added).
LINES = ["model: qwen2.5-0.5b", "method: full", "micro_batch_size: 8"]


def _check_write(path) -> int:
    return main(["check", str(path), "--gpu", "rtx-4090", "--write"])


def test_write_goes_through_a_symlink_to_its_target(tmp_path):
    target = tmp_path / "real" / "run.yaml"
    target.parent.mkdir()
    target.write_text("\n".join(LINES) + "\n")
    link = tmp_path / "run.yaml"
    link.symlink_to(target)
    assert _check_write(link) == 1
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert "grad_accum: 8" in target.read_text()
    assert (tmp_path / "run.yaml.orig").read_text() == "\n".join(LINES) + "\n"
    assert main(["check", str(link), "--gpu", "rtx-4090"]) == 0  # the fix reached the target


def test_crlf_file_gets_crlf_lines_and_keeps_its_bom_and_mode(tmp_path):
    path = tmp_path / "run.yaml"
    original = b"\xef\xbb\xbf" + "\r\n".join(LINES).encode() + b"\r\n"
    path.write_bytes(original)
    path.chmod(0o640)
    assert _check_write(path) == 1
    new = path.read_bytes()
    assert new.startswith(b"\xef\xbb\xbf")
    assert b"grad_accum: 8\r\n" in new and new.count(b"\n") == new.count(b"\r\n") == 4
    assert path.stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "run.yaml.orig").read_bytes() == original


def test_an_lf_file_stays_lf(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("\n".join(LINES) + "\n")
    assert _check_write(path) == 1
    assert b"\r" not in path.read_bytes()


@pytest.mark.parametrize("command", ["check", "estimate"])
def test_a_tab_after_a_key_names_the_line(tmp_path, capsys, command):
    path = tmp_path / "run.yaml"
    path.write_text("model: qwen2.5-0.5b\nmethod:\tlora\n")
    assert main([command, str(path), "--gpu", "rtx-4090"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: a tab after 'method:'" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["check", "estimate", "plan", "train"])
def test_a_duplicate_key_is_refused_with_both_lines(tmp_path, capsys, command):
    path = tmp_path / "run.yaml"
    path.write_text("model: qwen2.5-0.5b\nmethod: lora\nlora:\n  r: 8\nmethod: full\n")
    gpu = [] if command == "train" else ["--gpu", "rtx-4090"]
    assert main([command, str(path), *gpu]) == 2
    assert f"{path}:5: key 'method' appears twice (first on line 2)" in capsys.readouterr().err


def test_nested_duplicates_are_found_and_merge_keys_are_not_duplicates():
    with pytest.raises(ConfigError, match=r"x.yaml:3: key 'r' appears twice \(first on line 2\)"):
        parse_yaml_with_lines("lora:\n  r: 8\n  r: 16\n", "x.yaml")
    data, _ = parse_yaml_with_lines("base: &b {r: 8}\nlora:\n  <<: *b\n  r: 16\n", "x.yaml")
    assert data["lora"] == {"r": 16}  # an explicit key overrides a merged one (YAML 1.1)


def test_a_big_file_without_aliases_is_refused_for_its_size_not_for_aliases(tmp_path, capsys):
    """The probe's 15 MB YAML: a long list, no anchor, no alias."""
    item = '  - "item {} with some padding text, as long as a real line"\n'
    text = "model: qwen2.5-0.5b\nnotes:\n" + "".join(item.format(i) for i in range(250_000))
    assert len(text) > 15 * 10**6
    path = tmp_path / "big.yaml"
    path.write_text(text)
    assert main(["estimate", str(path), "--gpu", "rtx-4090"]) == 2
    err = capsys.readouterr().err
    assert f"holds more than {MAX_YAML_NODES:,} values" in err
    assert "anchors and aliases" not in err


def test_a_duplicate_key_in_a_json_config_is_refused_with_both_lines(tmp_path, capsys):
    path = tmp_path / "training_args.json"
    path.write_text('{\n  "per_device_train_batch_size": 4,\n  "gradient_accumulation_steps": 2,'
                    '\n  "per_device_train_batch_size": 8\n}\n')
    assert main(["check", str(path), "--gpu", "rtx-4090", "--model", "qwen2.5-0.5b"]) == 2
    err = capsys.readouterr().err
    assert 'line 4: key "per_device_train_batch_size" appears twice (first on line 2)' in err
