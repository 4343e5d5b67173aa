"""Helpers for the protected-Trainer tests (tests/hf is on sys.path)."""

from __future__ import annotations

from pathlib import Path

SEQ_LEN = 64


def demo_rows(model_dir, seq_len: int = SEQ_LEN) -> list[dict]:
    """The shipped demo records, tokenized with the tiny model's chat template."""
    from oomless.config import DataConfig
    from oomless.dataset.records import load_examples, load_tokenizer
    from oomless.runtime.tiny import demo_data_path

    tok = load_tokenizer(str(model_dir))
    examples = load_examples(demo_data_path(), tok, DataConfig(), seq_len).examples
    return [{"input_ids": list(e.input_ids), "labels": list(e.labels),
             "attention_mask": [1] * len(e)} for e in examples]


class RecordingCollator:
    """Wraps a data collator and records each batch's rows (unpadded token ids)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.batches: list[list[tuple[int, ...]]] = []

    def __call__(self, features):
        batch = self.inner(features)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        self.batches.append([tuple(r[m.bool()].tolist()) for r, m in zip(ids, mask, strict=True)])
        return batch


def training_args(out: Path, cls=None, **overrides):
    from transformers import TrainingArguments

    values = dict(output_dir=str(out), per_device_train_batch_size=4,
                  gradient_accumulation_steps=2, max_steps=4, learning_rate=5e-3,
                  lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                  report_to=[], use_cpu=True, seed=7, disable_tqdm=True,
                  dataloader_num_workers=0)
    values.update(overrides)
    return (cls or TrainingArguments)(**values)


def load_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


def hf_trainer(model_dir, out, rows, cls=None, eval_rows=None, args_cls=None, **overrides):
    """A transformers Trainer (or ``cls``) on the tiny model, its collator recording."""
    from transformers import DataCollatorForSeq2Seq, Trainer

    from oomless.dataset.records import load_tokenizer

    tok = load_tokenizer(str(model_dir))
    collator = RecordingCollator(DataCollatorForSeq2Seq(tok, padding=True))
    args = training_args(out, cls=args_cls, **overrides)
    trainer = (cls or Trainer)(model=load_model(model_dir), args=args,
                               train_dataset=rows, eval_dataset=eval_rows,
                               data_collator=collator, processing_class=tok)
    return trainer, collator


def weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_weights(a: dict, b: dict, atol: float = 1e-5) -> None:
    import torch

    assert set(a) == set(b)
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=atol, rtol=0)


def read_events(run_dir, kind=None) -> list[dict]:
    from oomless.runtime.train.memlog import read_events as read

    events = read(Path(run_dir))
    return [e for e in events if kind is None or e["event"] == kind]
