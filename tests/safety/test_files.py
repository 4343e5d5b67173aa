"""Files: atomic writes never follow a planted link, appends refuse links, devices and
folders are never written over, reads name the file and line of what is wrong."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from oomless.errors import ConfigError, DataError, ModelConfigError, OutputError
from oomless.fileio import (
    OutputFolder,
    cut_torn_tail,
    open_append,
    parse_jsonl,
    read_text,
    split_lines,
    write_atomic,
    write_json_atomic,
)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text("precious")
    return path


def _plant_links(folder: Path, name: str, victim: Path) -> None:
    """Links at every predictable temporary name an older writer used."""
    for tmp in (f"{name}.tmp", f".{name}.tmp", f"{name}.partial"):
        os.symlink(victim, folder / tmp)


@pytest.mark.parametrize("writer", [
    lambda p: write_atomic(p, "new"),
    lambda p: write_json_atomic(p, {"new": 1}),
])
def test_atomic_writes_never_follow_a_planted_link(tmp_path, victim, writer):
    target = tmp_path / "plan.yaml"
    _plant_links(tmp_path, target.name, victim)
    writer(target)
    assert victim.read_text() == "precious"
    os.symlink(victim, tmp_path / "linked.yaml")  # the target itself a link: replaced
    writer(tmp_path / "linked.yaml")
    assert victim.read_text() == "precious"
    assert not (tmp_path / "linked.yaml").is_symlink()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")
                 and not p.is_symlink()]
    assert leftovers == []


def test_log_rewrites_and_rejected_records_do_not_follow_links(tmp_path, victim):
    from oomless.dataset.records import _write_rejected
    from oomless.runtime.train.memlog import MEMLOG, truncate_after

    run = tmp_path / "run"
    run.mkdir()
    (run / "real.jsonl").write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 5})
                                    + "\n")
    os.symlink(run / "real.jsonl", run / MEMLOG)
    _plant_links(run, MEMLOG, victim)
    truncate_after(run, 2)
    assert json.loads((run / MEMLOG).read_text()) == {"step": 1}
    assert not (run / MEMLOG).is_symlink() and victim.read_text() == "precious"
    os.symlink(victim, run / "rejected.jsonl")
    _write_rejected(run / "rejected.jsonl", [])
    assert victim.read_text() == "precious"


def test_appends_refuse_a_link_and_anything_but_a_file(tmp_path, victim):
    link = tmp_path / "events.jsonl"
    os.symlink(victim, link)
    with pytest.raises(OutputError, match="is a symbolic link"):
        open_append(link)
    from oomless.runtime.train.memlog import RunLog

    with pytest.raises(OutputError, match="symbolic link"):
        RunLog(tmp_path, resume=True).event("start", "x")
    assert victim.read_text() == "precious"
    with pytest.raises(OutputError, match="not a regular file"):
        open_append("/dev/null")


@pytest.mark.parametrize("target", ["/dev/null", "folder"])
def test_a_device_or_a_folder_is_never_replaced(tmp_path, target):
    path = tmp_path / target if target == "folder" else Path(target)
    if target == "folder":
        path.mkdir()
    with pytest.raises(OutputError, match="is a folder|not a regular file"):
        write_atomic(path, "x")
    assert path.is_dir() if target == "folder" else stat.S_ISCHR(os.stat(path).st_mode)


def test_unwritable_and_too_long_paths_are_output_errors(tmp_path):
    with pytest.raises(OutputError, match="cannot write"):
        write_atomic(tmp_path / ("x" * 300), "x")
    with pytest.raises(OutputError, match="cannot write"):
        write_atomic(tmp_path / "missing" / "f.txt", "x")


def test_cut_torn_tail(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": 2}\n{"c"' + b"x" * 100_000)
    assert cut_torn_tail(path) == 100_004
    assert path.read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    assert cut_torn_tail(path) == 0
    assert cut_torn_tail(tmp_path / "absent") == 0


def test_lines_split_on_newline_only():
    separators = "\u2028\u2029\u0085\x1c\x1d\x1e\x0b\x0c"
    text = "".join(json.dumps({"t": f"a{s}b"}, ensure_ascii=False) + "\n" for s in separators)
    text += "\r\n" + json.dumps({"t": "last"}) + "\r\n"
    numbers = [n for n, _ in split_lines(text)]
    assert numbers == list(range(1, len(separators) + 1)) + [len(separators) + 2]
    log = parse_jsonl(text, "f")
    assert [obj["t"][1] for _, obj in log.rows[:-1]] == list(separators)


def test_a_torn_last_line_is_reported_a_bad_middle_line_is_listed():
    log = parse_jsonl('{"a": 1}\n{"b\n{"c": 3}\n{"d": 4', "f.jsonl")
    assert [n for n, _ in log.rows] == [1, 3]
    assert log.torn_line == 4 and log.bad == ["f.jsonl:2: not valid JSON"]
    assert parse_jsonl('{"a": 1}', "f").rows == [(1, {"a": 1})]  # complete, no newline


@pytest.mark.parametrize(("reader", "error"), [
    (lambda p: read_text(p, "configuration", ConfigError), ConfigError),
    (lambda p: __import__("oomless.config", fromlist=["x"]).load_run_config(p), ConfigError),
    (lambda p: __import__("oomless.models.hf_cache", fromlist=["x"]).read_config_file(p),
     ModelConfigError),
])
def test_non_utf8_names_the_file_and_line(tmp_path, reader, error):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("model: x\nname: caf\xe9\n".encode("latin-1"))
    with pytest.raises(error, match=r"latin1\.yaml:2: not UTF-8 text \(byte 0xe9\); save the"):
        reader(path)


def test_data_records_with_line_separators_keep_their_line_numbers(tmp_path):
    from oomless.dataset.records import iter_raw_records

    path = tmp_path / "d.jsonl"
    records = [{"instruction": "a\u2028b", "output": "c\u2029d"}, {"instruction": "x\x85",
                                                                   "output": "y"}]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
                    + "{broken\n", encoding="utf-8")
    rows = list(iter_raw_records(path))
    assert [(n, r) for n, r in rows[:2]] == [(1, records[0]), (2, records[1])]
    assert rows[2][0] == 3 and rows[2][1].raw == "{broken"
    path.write_bytes(b'{"instruction": "\xff"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:1: not UTF-8"):
        list(iter_raw_records(path))


def test_output_folder_replaces_its_own_files_and_refuses_a_users(tmp_path):
    out = tmp_path / "plan"
    folder = OutputFolder(out, False, "--out")
    folder.prepare(["a.json", "b.json"], known=("a.json", "b.json"))
    folder.write("a.json", "1")
    folder.write("b.json", "1")
    folder.finish()
    again = OutputFolder(out, False, "--out")  # a rerun: its own files, b.json now stale
    again.prepare(["a.json"], known=("a.json", "b.json"))
    again.write("a.json", "2")
    again.finish()
    assert sorted(p.name for p in out.iterdir()) == [".oomless-files.json", "a.json"]
    (out / "a.json").write_text("edited by hand")
    (out / "notes.md").write_text("mine")
    with pytest.raises(OutputError, match=r"holds files oomless did not write \(a\.json, "
                                          r"notes\.md\).*--force"):
        OutputFolder(out, False, "--out").prepare(["a.json"], known=("a.json",))
    forced = OutputFolder(out, True, "--out")
    forced.prepare(["a.json"], known=("a.json",))
    forced.write("a.json", "3")
    assert (out / "a.json.orig").read_text() == "edited by hand"
    assert (out / "notes.md").read_text() == "mine"
    with pytest.raises(OutputError, match="is a file, not a folder"):
        OutputFolder(out / "a.json", False, "--out")
