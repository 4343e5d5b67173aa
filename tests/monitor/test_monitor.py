"""`oomless monitor`: the no-GPU exit, job grouping, imbalance warnings, the CSV log."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oomless.cli import main
from oomless.runtime.monitor import (
    CSV_FIELDS,
    CsvLog,
    GPUProcess,
    GPUSample,
    Snapshot,
    _parent_pid,
    _proc_name,
    imbalance_warnings,
    job_memory,
)
from oomless.units import GiB


def _nvidia_present() -> bool:
    try:
        import pynvml
    except ImportError:
        return False
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def _gpu(index: int, *procs: GPUProcess, total: int = 80 * GiB) -> GPUSample:
    used = sum(p.used_bytes or 0 for p in procs) + GiB // 2
    return GPUSample(index=index, name="NVIDIA H100 80GB HBM3", used_bytes=used,
                     total_bytes=total, utilization_pct=97, memory_utilization_pct=40,
                     processes=procs)


def _rank(pid: int, used: int | None, parent: str = "torchrun") -> GPUProcess:
    return GPUProcess(pid=pid, used_bytes=used, name="train.py", parent_pid=100,
                      parent_name=parent)


@pytest.mark.skipif(_nvidia_present(), reason="an NVIDIA GPU is present")
def test_without_a_gpu_one_line_and_exit_1(tmp_path: Path, capsys) -> None:
    log = tmp_path / "gpu.csv"
    assert main(["monitor", "--once", "--csv", str(log)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no NVIDIA GPU found" in err and "Traceback" not in err
    assert not log.exists(), "no CSV file without a GPU"


@pytest.mark.parametrize("argv, match", [
    (["--interval", "0"], "--interval: expected a finite number in (0, 86400], got 0"),
    (["--count", "0"], "--count: expected a whole number 1 or more, got 0"),
])
def test_bad_options_are_user_errors(argv: list[str], match: str, capsys) -> None:
    assert main(["monitor", *argv]) == 2
    assert match in capsys.readouterr().err


def test_ranks_of_one_launcher_are_one_job_and_a_spread_warns() -> None:
    snap = Snapshot(0.0, (_gpu(0, _rank(1, 70 * GiB)), _gpu(1, _rank(2, 40 * GiB))))
    assert job_memory(snap) == {"torchrun (pid 100)": {0: 70 * GiB, 1: 40 * GiB}}
    (warning,) = imbalance_warnings(snap)
    assert "GPU 0 holds 70.00 GiB, GPU 1 40.00 GiB (30.00 GiB apart over 2 GPUs)" in warning


def test_balanced_jobs_and_shell_siblings_do_not_warn() -> None:
    balanced = Snapshot(0.0, (_gpu(0, _rank(1, 70 * GiB)), _gpu(1, _rank(2, 69 * GiB))))
    assert imbalance_warnings(balanced) == []
    # two separate runs started from one shell are two jobs, each on one GPU
    siblings = Snapshot(0.0, (_gpu(0, _rank(1, 70 * GiB, "bash")),
                              _gpu(1, _rank(2, 10 * GiB, "bash"))))
    assert len(job_memory(siblings)) == 2 and imbalance_warnings(siblings) == []


def test_one_process_split_over_gpus_is_a_job() -> None:
    proc = GPUProcess(pid=7, used_bytes=None, name="infer.py")
    split = Snapshot(0.0, (_gpu(0, GPUProcess(7, 60 * GiB, "infer.py")),
                           _gpu(1, GPUProcess(7, 12 * GiB, "infer.py"))))
    assert len(imbalance_warnings(split)) == 1
    unknown = Snapshot(0.0, (_gpu(0, proc), _gpu(1, proc)))
    assert job_memory(unknown) == {} and imbalance_warnings(unknown) == []


@given(st.lists(st.integers(0, 80 * GiB), min_size=2, max_size=8))
def test_warning_iff_spread_exceeds_the_limit(used: list[int]) -> None:
    snap = Snapshot(0.0, tuple(_gpu(i, _rank(i + 1, u)) for i, u in enumerate(used)))
    spread = max(used) - min(used)
    assert bool(imbalance_warnings(snap)) == (spread > max(GiB, int(0.1 * 80 * GiB)))
    reversed_snap = Snapshot(0.0, tuple(_gpu(i, _rank(i + 1, u)) for i, u in
                                        enumerate(reversed(used))))
    assert len(imbalance_warnings(reversed_snap)) == len(imbalance_warnings(snap))


def test_csv_log_appends_rows_with_one_header(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "gpu.csv"
    snap = Snapshot(1_700_000_000.0, (_gpu(0, _rank(11, 5 * GiB)), _gpu(1)))
    for _ in range(2):  # two runs of the monitor append to the same file
        log = CsvLog(path)
        log.write(snap)
        log.close()
    rows = list(csv.DictReader(path.open()))
    assert path.read_text().count("timestamp") == 1 and len(rows) == 4
    assert tuple(rows[0]) == CSV_FIELDS
    assert [int(r["gpu"]) for r in rows] == [0, 1, 0, 1]
    assert rows[0]["processes"] == f"11:{5 * GiB}" and rows[1]["processes"] == ""
    assert int(rows[0]["used_bytes"]) == snap.gpus[0].used_bytes


def test_process_names_and_parents_come_from_proc() -> None:
    assert _parent_pid(os.getpid()) == os.getppid()
    assert _proc_name(os.getpid())  # python's script or module name
    assert _parent_pid(2**22 + 12345) is None and _proc_name(2**22 + 12345) == ""


def test_table_shows_gpus_processes_and_warnings() -> None:
    from rich.console import Console

    from oomless.cli.monitor import _table

    snap = Snapshot(0.0, (_gpu(0, _rank(1, 70 * GiB)), _gpu(1, _rank(2, 40 * GiB))))
    console = Console(record=True, width=200)
    console.print(_table(snap, imbalance_warnings(snap)))
    text = console.export_text()
    assert "NVIDIA H100 80GB HBM3" in text and "70.00 GiB" in text and "warning: unbalanced" in text


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA GPU")
def test_monitor_sees_this_process_on_a_real_gpu(tmp_path: Path) -> None:
    import torch

    from oomless.runtime.monitor import nvml, sample_gpus

    block = torch.empty(GiB, dtype=torch.uint8, device="cuda:0")
    with nvml() as nv:
        snap = sample_gpus(nv)
    mine = [p for p in snap.gpus[0].processes if p.pid == os.getpid()]
    # containers may hide pids from NVML; the card's used memory always counts the block
    assert snap.gpus[0].used_bytes >= GiB
    if mine and mine[0].used_bytes is not None:
        assert mine[0].used_bytes >= GiB
    log = tmp_path / "gpu.csv"
    assert main(["monitor", "--once", "--csv", str(log)]) == 0
    assert len(list(csv.DictReader(log.open()))) == torch.cuda.device_count()
    del block
