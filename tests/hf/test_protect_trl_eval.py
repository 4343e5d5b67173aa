"""protect() on TRL's SFTTrainer, on evaluation and generation, and its preflight."""

from __future__ import annotations

import json

import pytest
import torch
from hf_helpers import (
    RecordingCollator,
    assert_same_weights,
    hf_trainer,
    load_model,
    read_events,
    weights,
)

from oomless.hf import protect
from oomless.runtime.train.memlog import read_steps


def _sft(tiny_model_dir, rows, out, inject=None):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from oomless.dataset.records import load_tokenizer

    args = SFTConfig(output_dir=str(out), per_device_train_batch_size=4,
                     gradient_accumulation_steps=2, max_steps=3, learning_rate=5e-3,
                     lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                     report_to=[], use_cpu=True, seed=7, disable_tqdm=True, max_length=64,
                     bf16=False)  # SFTConfig's default bf16 autocast rounds by batch shape
    data = Dataset.from_list([{"input_ids": r["input_ids"]} for r in rows])
    trainer = SFTTrainer(model=load_model(tiny_model_dir), args=args, train_dataset=data,
                         processing_class=load_tokenizer(str(tiny_model_dir)))
    trainer.data_collator = RecordingCollator(trainer.data_collator)
    protect(trainer, inject=inject)
    trainer.train()
    return trainer


def test_trl_sft_trainer_oom_keeps_the_training(tiny_model_dir, rows, tmp_path):
    plain = _sft(tiny_model_dir, rows, tmp_path / "plain")
    hit = _sft(tiny_model_dir, rows, tmp_path / "oom", inject="train:2:0:2,train:3:0:1:backward")
    ooms = read_events(tmp_path / "oom" / "oomless", "oom")
    assert [(e["step"], e["micro_batch_after"], e["in_backward"]) for e in ooms] == [
        (2, 2, False), (2, 1, False), (3, 1, True)]
    assert hit.data_collator.batches == plain.data_collator.batches
    loss = [s["loss"] for s in read_steps(tmp_path / "oom" / "oomless")]
    assert loss == pytest.approx([s["loss"] for s in read_steps(tmp_path / "plain" / "oomless")],
                                 abs=1e-5)
    assert_same_weights(weights(plain.model), weights(hit.model))
    assert hit.model.is_gradient_checkpointing  # micro batch 1 ran out of memory too
    # TRL adds each compute_loss call's tokens to num_tokens: the redone step counts once
    tokens = [[e["num_tokens"] for e in t.state.log_history if "num_tokens" in e]
              for t in (plain, hit)]
    assert tokens[1] == tokens[0] and len(tokens[0]) == 3


def _dpo(tiny_model_dir, out, inject=None):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from oomless.dataset.records import load_tokenizer
    from oomless.runtime.tiny import demo_data_path

    records = [json.loads(line) for line in demo_data_path().read_text().splitlines()][:48]
    pairs = [{"prompt": r["instruction"][:60], "chosen": r["output"][:40],
              "rejected": records[(i + 1) % len(records)]["output"][:40]}
             for i, r in enumerate(records)]
    args = DPOConfig(output_dir=str(out), per_device_train_batch_size=4,
                     gradient_accumulation_steps=2, max_steps=3, learning_rate=5e-3,
                     lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                     report_to=[], use_cpu=True, seed=7, disable_tqdm=True, bf16=False,
                     max_length=64)
    trainer = DPOTrainer(model=load_model(tiny_model_dir), ref_model=load_model(tiny_model_dir),
                         args=args, train_dataset=Dataset.from_list(pairs),
                         processing_class=load_tokenizer(str(tiny_model_dir)))
    protect(trainer, inject=inject)
    trainer.train()
    return trainer


def test_trl_dpo_trainer_splits_pairs_and_weighs_them(tiny_model_dir, tmp_path):
    """DPO batches hold the chosen rows, then the rejected rows, and the loss is a mean over
    pairs (not normalised by num_items_in_batch): chunks keep pairs and weigh by pairs."""
    plain = _dpo(tiny_model_dir, tmp_path / "plain")
    hit = _dpo(tiny_model_dir, tmp_path / "oom", inject="train:2:0:2")
    ooms = read_events(tmp_path / "oom" / "oomless", "oom")
    assert [(e["micro_batch_after"], e["unit"], e["weighting"]) for e in ooms] == [
        (2, "pairs", "mean over rows"), (1, "pairs", "mean over rows")]
    assert_same_weights(weights(plain.model), weights(hit.model))


def test_pair_chunks_keep_each_pairs_rows_together():
    from oomless.runtime.protect.batch import Layout, row_chunks

    ids = torch.arange(8).reshape(8, 1)  # pairs (0, 4), (1, 5), (2, 6), (3, 7)
    batch = {"input_ids": ids, "ref_chosen_logps": torch.arange(4.0), "flag": True}
    chunks = row_chunks(batch, 8, 1, 2, Layout(pairs=True, weight="rows"))
    assert [n for n, _ in chunks] == [2, 1]
    assert chunks[0][1]["input_ids"].flatten().tolist() == [1, 2, 5, 6]
    assert chunks[0][1]["ref_chosen_logps"].tolist() == [1.0, 2.0]
    assert chunks[1][1]["input_ids"].flatten().tolist() == [3, 7]
    assert chunks[1][1]["flag"] is True


@pytest.fixture(scope="module")
def eval_rows(rows):
    return rows[:24]


def test_eval_oom_halves_only_the_eval_batch(tiny_model_dir, rows, eval_rows, tmp_path):
    results = {}
    for name, inject in (("plain", None), ("oom", "eval:1:0:2")):
        trainer, _ = hf_trainer(tiny_model_dir, tmp_path / name, rows, eval_rows=eval_rows,
                                per_device_eval_batch_size=8)
        protect(trainer, inject=inject)
        metrics = trainer.evaluate()
        prediction = trainer.predict(eval_rows)
        results[name] = (metrics["eval_loss"], prediction)
    events = read_events(tmp_path / "oom" / "oomless", "eval_oom")
    assert [(e["eval_batch_before"], e["eval_batch_after"]) for e in events] == [(8, 4), (4, 2)]
    assert results["oom"][0] == pytest.approx(results["plain"][0], abs=1e-6)
    a, b = results["plain"][1], results["oom"][1]
    assert a.predictions.shape == b.predictions.shape
    torch.testing.assert_close(torch.as_tensor(b.predictions), torch.as_tensor(a.predictions),
                               atol=1e-5, rtol=0)
    assert (b.label_ids == a.label_ids).all()
    assert trainer.args.per_device_eval_batch_size == 8  # the user's setting is untouched
    assert not read_events(tmp_path / "oom" / "oomless", "oom")  # training batches untouched


def test_predict_with_generate_oom(tiny_model_dir, rows, tmp_path):
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    prompts = [{"input_ids": r["input_ids"][:12], "labels": r["input_ids"][:12],
                "attention_mask": [1] * 12} for r in rows[:6]]
    outputs = {}
    for name, inject in (("plain", None), ("oom", "eval:1")):
        trainer, _ = hf_trainer(tiny_model_dir, tmp_path / name, rows, cls=Seq2SeqTrainer,
                                args_cls=Seq2SeqTrainingArguments, predict_with_generate=True,
                                per_device_eval_batch_size=6)
        protect(trainer, inject=inject)
        outputs[name] = trainer.predict(prompts, max_new_tokens=4)
    (event,) = read_events(tmp_path / "oom" / "oomless", "eval_oom")
    assert event["eval_batch_after"] == 3
    assert (outputs["oom"].predictions == outputs["plain"].predictions).all()
    assert outputs["oom"].predictions.shape[1] >= 12 + 4  # prompt and new tokens (padded)
    assert outputs["oom"].metrics["test_loss"] == pytest.approx(
        outputs["plain"].metrics["test_loss"], abs=1e-6)


def test_preflight_fits_writes_the_estimate(tiny_model_dir, rows, tmp_path):
    trainer, _ = hf_trainer(tiny_model_dir, tmp_path, rows, max_steps=1)
    protect(trainer, gpu="a100-80gb")
    trainer.train()
    (event,) = read_events(tmp_path / "oomless", "preflight")
    assert event["checked"] and event["fits"]
    estimate = json.loads((tmp_path / "oomless" / "estimate.json").read_text())
    assert estimate["config"]["micro_batch_size"] == 4
    assert estimate["config"]["grad_accum"] == 2
    assert estimate["config"]["method"] == "full"
    (step,) = read_steps(tmp_path / "oomless")
    assert step["predicted_peak_bytes"] == estimate["peak_allocated_bytes"]


def test_preflight_refuse_stops_before_step_one(tiny_model_dir, rows, tmp_path):
    from oomless.runtime.train.preflight import PreflightError

    # logits of 65536 rows x 64 tokens x the vocabulary in fp32 do not fit a 16 GB T4
    trainer, collator = hf_trainer(tiny_model_dir, tmp_path, rows,
                                   per_device_train_batch_size=65536, max_steps=1)
    protect(trainer, gpu="t4", preflight="refuse")
    with pytest.raises(PreflightError, match="OUT OF MEMORY on .*stopped before step 1"):
        trainer.train()
    assert collator.batches == []
    (event,) = read_events(tmp_path / "oomless", "preflight")
    assert event["fits"] is False


def test_protect_twice_is_protect_once(tiny_model_dir, rows, tmp_path):
    trainer, _ = hf_trainer(tiny_model_dir, tmp_path, rows)
    step = protect(trainer).training_step
    assert protect(trainer).training_step is step
    callbacks = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert callbacks.count("OomlessCallback") == 1


@pytest.mark.parametrize(("text", "problem"), [
    ("train", "expected train:STEP"), ("train:x", "step 'x' is not a number"),
    ("train:0", "out of range"), ("eval:1:0:1:backward", "evaluation has no backward"),
    ("fit:2", "expected train:STEP")])
def test_bad_injection_specs_are_refused(text, problem):
    from oomless.errors import ConfigError
    from oomless.runtime.protect.env import parse_inject

    with pytest.raises(ConfigError, match=problem):
        parse_inject(text)


def test_injection_specs_parse():
    from oomless.runtime.protect.env import inject_specs, parse_inject

    a, b = parse_inject("train:3:*:2:backward, eval:1")
    assert (a.phase, a.step, a.rank, a.times, a.during) == ("train", 3, None, 2, "backward")
    assert (b.phase, b.step, b.rank, b.times) == ("eval", 1, 0, 1)
    env = {"OOMLESS_INJECT_OOM": "train:2", "OOMLESS_ATTEMPT": "2"}
    assert inject_specs(env) == []  # a relaunch does not inject again
