"""A rank's process groups are shut down before the interpreter is (oomless.runtime.train.dist).

Why it matters: a gloo group runs collectives on worker threads that drop the finished
work, and its tensors, after the caller has returned; a tensor Python let go of first
needs the GIL to be freed, and a thread asking for the GIL during interpreter shutdown
is ended with pthread_exit through a noexcept destructor: std::terminate, SIGABRT, a
failed torchrun job after a completed run (release_process_groups' docstring).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

# Two ranks: join the group, import a transformers model module afterwards (as the
# trainer does: it imports torch.distributed.nn through torch.distributed.fsdp), run the
# collectives oomless uses, close. torch.distributed.nn binds the default group into its
# functions' default arguments when first imported after init_process_group.
RANK_SCRIPT = """
import os, sys
threads = lambda: len(os.listdir("/proc/self/task"))
start = threads()
from oomless.runtime.train.dist import init_dist, groups_left_behind
d = init_dist()
import transformers.models.qwen2.modeling_qwen2  # noqa: F401
assert "torch.distributed.nn" in sys.modules
d.all_reduce([1.0]); d.gather([float(d.rank)]); d.gather_objects("x"); d.barrier()
during = threads()
d.close()
print(f"rank {d.rank} left {groups_left_behind()} threads {start} {during} {threads()}")
"""


@pytest.mark.slow  # two processes importing transformers (~10 s)
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_close_shuts_the_gloo_groups_down_and_joins_their_threads(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "OOMLESS_DEVICE": "cpu",
           "PYTHONPATH": SRC}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", str(script)], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == 2, proc.stdout
    for line in lines:
        left, counts = line.split(" left ")[1].split(" threads ")
        start, during, after = (int(n) for n in counts.split())
        assert left == "[]", line  # no group is still referenced after close
        assert during > start, line  # the gloo group's worker and transport threads ...
        assert after == start, line  # ... are joined by close, before interpreter shutdown


def test_oomless_ends_a_rank_without_interpreter_shutdown_when_groups_are_left(tmp_path):
    """A group a library still references (oomless.runtime.train.dist.groups_left_behind):
    the CLI ends with the command's exit code and without the interpreter's shutdown
    (atexit handlers are part of it: the one registered here must not run)."""
    code = ("import atexit, sys\n"
            "import oomless.runtime.train.dist as d\n"
            "d._LEFT_BEHIND.append('0')\n"
            "atexit.register(print, 'interpreter shutdown ran')\n"
            "sys.argv = ['oomless', 'no-such-command']\n"
            "from oomless.cli import run\n"
            "run()\n")
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]  # the usage error's code, unchanged
    assert "interpreter shutdown ran" not in proc.stdout
    # and without a group left behind, the shutdown runs as usual
    plain = subprocess.run([sys.executable, "-c", code.replace("d._LEFT_BEHIND.append('0')\n",
                                                               "")],
                           env=env, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 2 and "interpreter shutdown ran" in plain.stdout
