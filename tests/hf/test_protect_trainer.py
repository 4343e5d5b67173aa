"""oomless.hf.protect on the real transformers Trainer (CPU, tiny Qwen2): an OOM inside a
step is redone in smaller pieces and the training ends exactly as without it."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import assert_same_weights, hf_trainer, read_events, weights

from oomless.hf import protect
from oomless.runtime.train.memlog import read_steps


def _train(tiny_model_dir, out, rows, protect_kwargs=None, **overrides):
    trainer, collator = hf_trainer(tiny_model_dir, out, rows, **overrides)
    if protect_kwargs is not None:
        protect(trainer, **protect_kwargs)
    trainer.train()
    return trainer, collator


@pytest.fixture(scope="module")
def baseline(tiny_model_dir, rows, tmp_path_factory):
    """Protected, nothing injected: micro batch 4 x accumulation 2 (effective batch 8)."""
    out = tmp_path_factory.mktemp("baseline")
    trainer, collator = _train(tiny_model_dir, out, rows, {})
    return {"weights": weights(trainer.model), "batches": collator.batches,
            "losses": [s["loss"] for s in read_steps(out / "oomless")], "dir": out}


def _same_training(baseline, trainer, collator, run_dir, atol=1e-5):
    assert collator.batches == baseline["batches"]  # the same samples in the same order
    losses = [s["loss"] for s in read_steps(run_dir)]
    assert losses == pytest.approx(baseline["losses"], abs=atol)
    assert_same_weights(baseline["weights"], weights(trainer.model), atol)
    args = trainer.args  # the effective batch is the user's
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 2)


def test_plain_trainer_equals_the_protected_one(baseline, tiny_model_dir, rows, tmp_path):
    trainer, collator = _train(tiny_model_dir, tmp_path, rows)
    assert collator.batches == baseline["batches"]
    assert_same_weights(baseline["weights"], weights(trainer.model), atol=0)


def test_forward_oom_halves_the_rows_and_keeps_the_training(baseline, tiny_model_dir, rows,
                                                            tmp_path):
    trainer, collator = _train(tiny_model_dir, tmp_path, rows, {"inject": "train:2"})
    (event,) = read_events(tmp_path / "oomless", "oom")
    assert (event["step"], event["micro_batch_before"], event["micro_batch_after"],
            event["in_backward"], event["effective_batch"]) == (2, 4, 2, False, 8)
    assert "fault injection" in event["error"]
    steps = read_steps(tmp_path / "oomless")
    assert [s["micro_batch_size"] for s in steps] == [4, 2, 2, 2]  # kept for later steps
    _same_training(baseline, trainer, collator, tmp_path / "oomless")


def test_backward_oom_redoes_the_step_without_counting_twice(baseline, tiny_model_dir, rows,
                                                            tmp_path):
    # the second micro batch fails after its backward: the first one's gradients are in
    # .grad too and must be dropped and recomputed, not added twice
    trainer, collator = _train(tiny_model_dir, tmp_path, rows,
                               {"inject": "train:3:0:2:backward"})
    ooms = read_events(tmp_path / "oomless", "oom")
    assert [(e["step"], e["micro_batch_after"], e["in_backward"]) for e in ooms] == [
        (3, 2, True), (3, 1, True)]
    _same_training(baseline, trainer, collator, tmp_path / "oomless")


def test_one_row_then_gradient_checkpointing_then_the_oom_stands(tiny_model_dir, rows,
                                                                 tmp_path):
    trainer, _ = hf_trainer(tiny_model_dir, tmp_path, rows)
    protect(trainer, inject="train:1:0:3")
    trainer.train()  # 4 -> 2 -> 1 -> checkpointing, then the step goes through
    ooms = read_events(tmp_path / "oomless", "oom")
    assert [(e["micro_batch_after"], e["grad_ckpt"]) for e in ooms] == [
        (2, False), (1, False), (1, True)]
    assert trainer.model.is_gradient_checkpointing
    trainer, _ = hf_trainer(tiny_model_dir, tmp_path / "again", rows)
    protect(trainer, inject="train:1:0:4")
    with pytest.raises(torch.OutOfMemoryError, match="fault injection"):
        trainer.train()
    (last,) = read_events(tmp_path / "again" / "oomless", "oom_unrecoverable")
    assert last["step"] == 1


def test_simulated_gpu_budget(baseline, tiny_model_dir, rows, tmp_path):
    """A CPU stand-in for a GPU: tensors held inside a step above the budget raise a real
    OutOfMemoryError wherever they are allocated (forward or backward)."""
    probe, _ = _train(tiny_model_dir, tmp_path / "probe", rows, {"memory_budget_gb": 64})
    peaks = [s["simulated_peak_bytes"] for s in read_steps(tmp_path / "probe" / "oomless")]
    # a budget the micro batch of 4 exceeds at its largest step but half of it does not
    budget_gb = 0.85 * max(peaks) / 2**30
    trainer, collator = _train(tiny_model_dir, tmp_path / "tight", rows,
                               {"memory_budget_gb": budget_gb})
    ooms = read_events(tmp_path / "tight" / "oomless", "oom")
    assert ooms and all("simulated GPU budget" in e["error"] for e in ooms)
    steps = read_steps(tmp_path / "tight" / "oomless")
    assert all(s["simulated_peak_bytes"] <= budget_gb * 2**30 for s in steps)
    _same_training(baseline, trainer, collator, tmp_path / "tight" / "oomless")


def test_a_subclass_with_its_own_mean_loss(tiny_model_dir, rows, tmp_path):
    """compute_loss overridden with a per-batch token mean (not normalised by
    num_items_in_batch): the chunks are weighted by their label tokens."""
    from transformers import Trainer

    class MeanLossTrainer(Trainer):
        loss_is_scaled_for_ga = False

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            logits = model(**inputs).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                ignore_index=-100)
            return (loss, None) if return_outputs else loss

    runs = {}
    for name, inject in (("plain", None), ("oom", "train:2:0:2,train:4:0:1:backward")):
        trainer, collator = hf_trainer(tiny_model_dir, tmp_path / name, rows, cls=MeanLossTrainer)
        protect(trainer, inject=inject)
        trainer.train()
        runs[name] = (weights(trainer.model), collator.batches,
                      [s["loss"] for s in read_steps(tmp_path / name / "oomless")])
    assert len(read_events(tmp_path / "oom" / "oomless", "oom")) == 3
    assert runs["oom"][1] == runs["plain"][1]
    assert runs["oom"][2] == pytest.approx(runs["plain"][2], abs=1e-5)
    assert_same_weights(runs["plain"][0], runs["oom"][0])


def test_resume_from_a_checkpoint_appends_the_memory_log(tiny_model_dir, rows, tmp_path):
    trainer, _ = hf_trainer(tiny_model_dir, tmp_path, rows, save_strategy="steps",
                            save_steps=1, max_steps=2)
    protect(trainer)
    trainer.train()
    trainer, _ = hf_trainer(tiny_model_dir, tmp_path, rows, save_strategy="steps",
                            save_steps=1, max_steps=4)
    protect(trainer)
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert [s["step"] for s in read_steps(tmp_path / "oomless")] == [1, 2, 3, 4]
    begins = read_events(tmp_path / "oomless", "train_begin")
    assert [e["resumed"] for e in begins] == [False, True]
