"""The protected Trainer's memory in the user's own dashboards: a real transformers
Trainer with ``report_to=["tensorboard"]``, an injected OOM, and TensorBoard's event
files read back offline with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import pytest
from hf_helpers import hf_trainer, read_events

from oomless.hf import protect
from oomless.runtime.protect.dashboards import GIB, PREFIX
from oomless.runtime.train.memlog import read_steps

pytest.importorskip("tensorboard")


def _scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list(log_dir.rglob("events.out.tfevents.*"))
    assert files, f"no TensorBoard event file under {log_dir}"
    acc = EventAccumulator(str(files[0].parent), size_guidance={"scalars": 0})
    acc.Reload()
    # TensorBoardCallback names training values train/NAME
    return {tag.removeprefix("train/"): [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


@pytest.mark.slow  # a real Trainer run with TensorBoard: about 7 s on 2 cores
def test_tensorboard_shows_predicted_and_measured_peaks_and_the_oom_split(tiny_model_dir, rows,
                                                                           tmp_path):
    budget_gb = 64  # a simulated GPU (CPU): tensors held in a step are counted and capped
    trainer, _ = hf_trainer(tiny_model_dir, tmp_path, rows, report_to=["tensorboard"])
    protect(trainer, inject="train:2", gpu="rtx-4090", memory_budget_gb=budget_gb)
    trainer.train()

    scalars = _scalars(tmp_path / "runs")  # TensorBoardCallback's default: output_dir/runs
    steps = read_steps(tmp_path / "oomless")
    (oom,) = read_events(tmp_path / "oomless", "oom")
    # the split: micro batch 4 until the OOM at step 2, then 2; counted and explained there
    assert scalars[PREFIX + "micro_batch"] == [(1, 4.0), (2, 2.0), (3, 2.0), (4, 2.0)]
    assert scalars[PREFIX + "oom_count"] == [(1, 0.0), (2, 1.0), (3, 1.0), (4, 1.0)]
    assert scalars[PREFIX + "oom_micro_batch_before"] == [(2, float(oom["micro_batch_before"]))]
    assert scalars[PREFIX + "oom_micro_batch_after"] == [(2, float(oom["micro_batch_after"]))]
    assert scalars[PREFIX + "oom_in_backward"] == [(2, 0.0)]
    # measured: each step's simulated peak, as the memory log has it (float32 of GiB)
    measured = [v for _s, v in scalars[PREFIX + "simulated_peak_gib"]]
    assert measured == pytest.approx([s["simulated_peak_bytes"] / GIB for s in steps],
                                     rel=1e-6)
    # predicted: the preflight's estimate and its band, constant over the run
    import json

    estimate = json.loads((tmp_path / "oomless" / "estimate.json").read_text())
    for tag, key in (("predicted_peak_allocated_gib", "peak_allocated_bytes"),
                     ("predicted_device_peak_gib", "device_peak_bytes"),
                     ("predicted_low_gib", "low_bytes"), ("predicted_high_gib", "high_bytes")):
        values = [v for _s, v in scalars[PREFIX + tag]]
        assert len(values) == 4 and values == pytest.approx([estimate[key] / GIB] * 4,
                                                            rel=1e-6), tag
    assert "loss" in scalars  # the Trainer's own values stay
    # the Trainer's own history (trainer_state.json) holds them too
    assert trainer.state.log_history[0][PREFIX + "micro_batch"] == 4.0


@pytest.mark.slow  # a real `oomless train` run of the tiny model: about 6 s on 2 cores
def test_oomless_train_writes_the_same_values_to_tensorboard(tiny_model_dir, tmp_path):
    from oomless.cli import main
    from oomless.config import RunConfig, dump_run_config
    from oomless.runtime.tiny import demo_data_path
    from oomless.runtime.train.memlog import read_events

    cfg = RunConfig.model_validate({
        "model": str(tiny_model_dir), "method": "lora", "precision": "fp32",
        "micro_batch_size": 4, "grad_accum": 2, "seq_len": 64,
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"train_file": str(demo_data_path())},
        "training": {"max_steps": 3, "learning_rate": 5e-3, "warmup_ratio": 0.0, "seed": 7,
                     "output_dir": str(tmp_path / "run"), "memory_budget_gb": 64,
                     "inject_oom": [{"step": 2, "rank": 0}]}})
    (tmp_path / "oomless.yaml").write_text(dump_run_config(cfg))
    assert main(["train", str(tmp_path / "oomless.yaml"), "--no-progress",
                 "--tensorboard", str(tmp_path / "tb")]) == 0
    scalars = {k.removeprefix("train/"): v for k, v in _scalars(tmp_path / "tb").items()}
    (oom,) = [e for e in read_events(tmp_path / "run") if e["event"] == "oom"]
    steps = read_steps(tmp_path / "run")
    assert scalars[PREFIX + "micro_batch"] == [(1, 4.0), (2, 2.0), (3, 2.0)]
    assert scalars[PREFIX + "oom_count"] == [(1, 0.0), (2, 1.0), (3, 1.0)]
    assert scalars[PREFIX + "oom_micro_batch_before"] == [(2, float(oom["micro_batch_before"]))]
    assert scalars[PREFIX + "oom_micro_batch_after"] == [(2, float(oom["micro_batch_after"]))]
    measured = [v for _s, v in scalars[PREFIX + "simulated_peak_gib"]]
    assert measured == pytest.approx([s["simulated_peak_bytes"] / GIB for s in steps], rel=1e-6)
    predicted = [v for _s, v in scalars[PREFIX + "predicted_peak_allocated_gib"]]
    assert predicted == pytest.approx([s["predicted_peak_bytes"] / GIB for s in steps],
                                      rel=1e-6)
    import json

    estimate = json.loads((tmp_path / "run" / "estimate.json").read_text())
    for tag, key in (("predicted_device_peak_gib", "device_peak_bytes"),
                     ("predicted_low_gib", "low_bytes"), ("predicted_high_gib", "high_bytes")):
        values = [v for _s, v in scalars[PREFIX + tag]]
        assert values == pytest.approx([estimate[key] / GIB] * 3, rel=1e-6), tag
