"""Two processes (gloo on CPU, torchrun) train a user's script with the protection the
`oomless run` shim installs: an OOM on one rank makes both split together, and the result
equals one process with the same effective batch.

Both runs train in float64, and the weights are compared at an absolute tolerance of
1e-5. Why: gloo all-reduces the two ranks' gradients, summing in another order than one
process does; a sum of n terms rounded in two orders differs by at most about n·u·Σ|g|
(u the unit roundoff). AdamW then divides by sqrt(v) + eps (eps = 1e-8, TrainingArguments'
adam_epsilon), so a gradient element near zero turns a gradient difference δg into an
update difference of up to lr·δg/eps. In float32 (u = 6.0e-8), with per-sample gradients
of about 1e-3 that is 0.005·(8·6.0e-8·1e-3)/1e-8 ≈ 2.4e-5 per step — the size of the
5.9e-5 seen after 3 steps. In float64 (u = 1.1e-16) the same bound, even with Σ|g| = 1,
is 0.005·8·1.1e-16/1e-8 ≈ 4.4e-10 per step: far below 1e-5 over 3 steps, while a
training difference (a skipped or doubled micro batch) moves weights by about lr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hf_helpers import assert_same_weights, read_events

from oomless.runtime.train.memlog import read_steps

SCRIPT = Path(__file__).parent / "scripts" / "hf_train.py"


def script_args(model_dir, out, **overrides) -> dict:
    args = {"model_name_or_path": str(model_dir), "output_dir": str(out),
            "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": 3,
            "learning_rate": 0.005, "lr_scheduler_type": "constant", "logging_steps": 1,
            "save_strategy": "no", "report_to": [], "use_cpu": True, "seed": 7,
            "disable_tqdm": True, "model_dtype": "float64"}
    args.update(overrides)
    return args


def child_env(shim: Path | None = None, **extra: str) -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[2] / "src")
    path = [str(shim)] if shim else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "DS_ACCELERATOR": "cpu", "PYTHONPATH": os.pathsep.join(path + [src]), **extra}
    for key in ("OOMLESS_INJECT_OOM", "OOMLESS_RUN_DIR", "OOMLESS_ATTEMPT"):
        if key not in extra:
            env.pop(key, None)
    return env


def run_script(args_file: Path, env: dict, nproc: int = 1) -> subprocess.CompletedProcess:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={nproc}"] if nproc > 1 else [sys.executable])
    return subprocess.run([*launcher, str(SCRIPT), str(args_file)], env=env,
                          capture_output=True, text=True, timeout=600)


def final_weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "final" / "model.safetensors"))


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory):
    """The reference: one process, micro batch 4 x accumulation 2 (effective batch 8)."""
    root = tmp_path_factory.mktemp("one")
    args_file = root / "args.json"
    args_file.write_text(json.dumps(script_args(tiny_model_dir, root / "out")))
    proc = run_script(args_file, child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "out"


@pytest.mark.multirank
@pytest.mark.slow  # several processes or kill/resume: in CI's slow run
def test_oom_on_rank_1_splits_both_ranks_and_equals_one_process(one_process, tiny_model_dir,
                                                                tmp_path):
    from oomless.runtime.protect.bootstrap import write_shim

    shim = write_shim(tmp_path / "shim")
    args_file = tmp_path / "args.json"
    out = tmp_path / "out"
    # two processes x micro batch 2 x accumulation 2: the same effective batch of 8
    args_file.write_text(json.dumps(script_args(tiny_model_dir, out,
                                                per_device_train_batch_size=2)))
    proc = run_script(args_file, child_env(shim, OOMLESS_INJECT_OOM="train:2:1"), nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (event,) = read_events(out / "oomless", "oom")
    assert (event["step"], event["ranks"], event["micro_batch_after"]) == (2, [1], 1)
    begin = read_events(out / "oomless", "train_begin")[0]
    assert (begin["engine"], begin["world_size"], begin["effective_batch"]) == ("ddp", 2, 8)
    steps = read_steps(out / "oomless")
    assert [s["micro_batch_size"] for s in steps] == [2, 1, 1]
    assert_same_weights(final_weights(one_process), final_weights(out))


@pytest.mark.multirank
@pytest.mark.slow
def test_oom_after_the_backward_on_one_rank_exits_for_a_restart(tiny_model_dir, tmp_path):
    """An OOM after the agreement on one of two ranks cannot be matched in-process: that
    rank writes why and exits 75; torchrun stops the job."""
    from oomless.runtime.protect.bootstrap import write_shim

    shim = write_shim(tmp_path / "shim")
    args_file = tmp_path / "args.json"
    out = tmp_path / "out"
    args_file.write_text(json.dumps(script_args(tiny_model_dir, out,
                                                per_device_train_batch_size=2)))
    proc = run_script(args_file, child_env(shim, OOMLESS_INJECT_OOM="train:2:1:1:backward"),
                      nproc=2)
    assert proc.returncode != 0
    (event,) = read_events(out / "oomless", "oom_exit")
    assert (event["rank"], event["exit_code"], event["micro_batch_after"]) == (1, 75, 1)
    assert "exitcode  : 75" in proc.stdout + proc.stderr or "exit code 75" in proc.stderr
