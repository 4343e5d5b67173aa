"""A disk that fills while a checkpoint is written (issue 18's probe): one clear error
(exit 2), no half-written ``.step-*.tmp`` folder left, and ``--resume`` continues to the
same result as a run that never stopped. A symbolic link among the old checkpoints that
``save_total_limit`` prunes is skipped with a warning, and a ``--output-dir`` that is
not UTF-8 is a user error."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest
from train_helpers import assert_same_run, tiny_run_config

from oomless.runtime.train import checkpoint as ckpt
from oomless.runtime.train.loop import train

SETTINGS = {"training.max_steps": 6, "training.save_steps": 2}


class FullDisk:
    """A file whose device fills after ``room`` bytes: the write fails as the kernel's
    does (OSError ENOSPC) after writing what fit."""

    def __init__(self, fh, room: int) -> None:
        self.fh, self.room = fh, room

    def write(self, data) -> int:
        data = bytes(data)
        if len(data) > self.room:
            self.fh.write(data[:self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()


def _fill_disk_at(monkeypatch, step_folder: str) -> None:
    """torch's own saver runs; the files it writes inside ``step_folder``'s temporary
    folder go through a device with 1 KiB left."""
    import torch

    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and Path(f).parent.name.startswith(f".{step_folder}."):
            with open(f, "wb") as fh:
                return real_save(obj, FullDisk(fh, 1024), *args, **kwargs)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


@pytest.mark.slow
def test_disk_full_during_a_checkpoint_then_resume(tiny_model_dir, tmp_path, monkeypatch):
    reference = train(tiny_run_config(tiny_model_dir, tmp_path / "reference", **SETTINGS))
    cfg = tiny_run_config(tiny_model_dir, tmp_path / "run", **SETTINGS)
    with monkeypatch.context() as patch:
        _fill_disk_at(patch, "step-000004")
        with pytest.raises(ckpt.CheckpointWriteError,
                           match=r"could not write checkpoint step-000004 .*No space left on "
                                 r"device .*half-written folder was removed.*Free space, then "
                                 r"`oomless train CONFIG --resume` continues from step-000002"):
            train(cfg)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == \
        ["step-000002"]
    assert_same_run(reference, train(cfg, resume=True).run_dir)


def test_a_temporary_folder_left_by_a_killed_writer_is_removed_on_the_next_start(
        tiny_model_dir, tmp_path):
    """A full disk may also stop the lock file's note: the lock still holds, the leftover
    is removed and frees the space."""
    from oomless.runtime.train.run_folder import RunFolder

    folder = RunFolder(tmp_path / "run")
    folder.claim(resume=False, start_over=False)
    folder.release()
    leftover = ckpt.prepare_tmp(folder.path, 4)
    (leftover / "optimizer.pt").write_bytes(b"\0" * 100)
    again = RunFolder(tmp_path / "run")
    again.claim(resume=True, start_over=False)
    again.release()
    assert not leftover.exists()


def test_a_refused_write_is_told_apart_from_a_bug(tmp_path):
    """torch re-raises a failed write as RuntimeError with the OSError as its context."""
    import torch

    root = tmp_path / "run"
    tmp = ckpt.prepare_tmp(root, 4)
    with pytest.raises(ckpt.CheckpointWriteError, match="No space left on device"):
        with ckpt.writing(tmp, "checkpoint step-000004", root), open(tmp / "x.pt", "wb") as fh:
            torch.save({"w": torch.zeros(4096)}, FullDisk(fh, 100))
    assert not tmp.exists()
    tmp = ckpt.prepare_tmp(root, 4)
    with pytest.raises(KeyError), ckpt.writing(tmp, "checkpoint step-000004", root):
        raise KeyError("a bug stays a bug")
    assert not tmp.exists()


def test_a_symlinked_old_checkpoint_is_not_pruned_through(tmp_path, capsys):
    root = tmp_path / "run"
    elsewhere = tmp_path / "kept-by-the-user"
    elsewhere.mkdir()
    (elsewhere / "adapter_model.safetensors").write_bytes(b"weights")
    (root / "checkpoints").mkdir(parents=True)
    (root / "checkpoints" / "step-000001").symlink_to(elsewhere, target_is_directory=True)
    for step in (2, 3):
        ckpt.checkpoint_dir(root, step).mkdir()
    skipped = ckpt.prune(root, keep=1)
    assert skipped == [root / "checkpoints" / "step-000001"]
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == \
        ["step-000001", "step-000003"]
    assert (elsewhere / "adapter_model.safetensors").read_bytes() == b"weights"
    assert "is a symbolic link or not a folder; not deleted" in capsys.readouterr().err


def test_a_non_utf8_output_dir_is_a_user_error(tiny_model_dir, tmp_path, capsys):
    from oomless.cli import main
    from oomless.config import dump_run_config

    config = tmp_path / "oomless.yaml"
    config.write_text(dump_run_config(tiny_run_config(tiny_model_dir, tmp_path / "run")))
    bad = os.fsdecode(os.fsencode(str(tmp_path)) + b"/r\xff")  # as argv decodes it
    assert main(["train", str(config), "--output-dir", bad, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--output-dir" in err and "is not valid UTF-8" in err and "internal" not in err
    assert not Path(os.fsencode(bad).decode("latin-1")).exists()
    assert sys.getfilesystemencoding() == "utf-8"


RUN_ON_A_SMALL_DISK = r'''
set -u
mount -t tmpfs -o size="$SIZE" tmpfs "$DISK" || exit 97
python="$1"; shift
"$python" -m oomless train "$CONFIG" --no-progress > "$OUT/first.txt" 2>&1; echo $? > "$OUT/first.rc"
ls -a "$DISK/run/checkpoints" > "$OUT/after-first.txt"
mount -o remount,size=64m "$DISK"
"$python" -m oomless train "$CONFIG" --no-progress --resume > "$OUT/resume.txt" 2>&1
echo $? > "$OUT/resume.rc"
ls -a "$DISK/run/checkpoints" > "$OUT/after-resume.txt"
cp -r "$DISK/run" "$OUT/run"
'''


@pytest.mark.slow
def test_a_real_full_disk(tiny_model_dir, tmp_path):
    """The probe's case on a real file system: a tmpfs (in a user and mount namespace,
    `unshare -rm`) with room for the run's files and its first checkpoint plus half of
    the second, sized from an uninterrupted run of the same configuration."""
    import shutil
    import subprocess

    from oomless.config import dump_run_config

    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("no user and mount namespaces here (unshare -rm) for a small tmpfs")
    reference = train(tiny_run_config(tiny_model_dir, tmp_path / "reference", **SETTINGS))
    one_checkpoint = sum(p.stat().st_size for p in
                         ckpt.checkpoint_dir(reference.run_dir, 2).rglob("*") if p.is_file())
    run_files = sum(p.stat().st_size for p in reference.run_dir.iterdir() if p.is_file())
    size_kib = (run_files + one_checkpoint * 3 // 2) // 1024 + 1
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    config = tmp_path / "oomless.yaml"
    config.write_text(dump_run_config(tiny_run_config(tiny_model_dir, disk / "run", **SETTINGS)))
    env = {**os.environ, "SIZE": f"{size_kib}k", "DISK": str(disk), "OUT": str(out),
           "CONFIG": str(config),
           "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    done = subprocess.run(["unshare", "-rm", "sh", "-c", RUN_ON_A_SMALL_DISK, "sh",
                           sys.executable], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode == 97:
        pytest.skip(f"tmpfs cannot be mounted here: {done.stderr.strip()[:200]}")
    first = (out / "first.txt").read_text()
    assert (out / "first.rc").read_text().strip() == "2", first[-2000:]
    error = [line for line in first.splitlines() if line.startswith("oomless: error:")]
    assert len(error) == 1 and "could not write checkpoint step-000004" in error[0]
    assert "No space left on device" in error[0] and "internal error" not in first
    assert (out / "after-first.txt").read_text().split() == [".", "..", "step-000002"]
    assert (out / "resume.rc").read_text().strip() == "0", (out / "resume.txt").read_text()
    assert (out / "after-resume.txt").read_text().split() == \
        [".", "..", "step-000002", "step-000004", "step-000006"]
    assert_same_run(reference, out / "run")
