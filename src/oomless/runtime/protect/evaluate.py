"""The protected ``prediction_step``: evaluation and prediction OOMs halve only the eval batch.

The Trainer's ``prediction_step`` (the subclass's: Seq2SeqTrainer's
``predict_with_generate``, LLaMA-Factory's, TRL's) runs on row chunks of the
batch; the outputs are joined back into one batch: the loss as the mean of
the chunk means weighted by their label tokens (what the batch mean averages
over), logits and generated tokens concatenated by rows, padded in their
second dimension (generated tokens with the pad token, the rest with -100,
as the evaluation loop pads across batches). The smaller eval chunk is kept
for the rest of the run; training batches are not touched.

With several ranks the evaluation loop gathers after every batch, and a
rank that stops to split cannot be waited for: the OOM ends in the restart
exit with half the eval batch suggested.
"""

from __future__ import annotations

from typing import Any

from ..train.oom import first_line, release_memory
from .batch import batch_rows, join_outputs, loss_items, row_chunks, weighted_loss
from .context import ProtectContext
from .exit import exit_for_restart
from .guard import oom_types


def _pad_id(trainer: Any) -> int:
    for holder in (getattr(trainer, "processing_class", None),
                   getattr(getattr(trainer, "processing_class", None), "tokenizer", None),
                   getattr(getattr(trainer, "model", None), "generation_config", None),
                   getattr(getattr(trainer, "model", None), "config", None)):
        pad = getattr(holder, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    return -100


class EvalGuard:
    def __init__(self, ctx: ProtectContext, original: Any) -> None:
        self.ctx = ctx
        self.original = original
        self.oom_types = oom_types()

    def __call__(self, model: Any, inputs: Any, prediction_loss_only: bool,
                 ignore_keys: Any = None, **gen_kwargs: Any) -> Any:
        c = self.ctx
        c.eval_batch += 1
        rows = batch_rows(inputs)
        rows = None if rows is None else c.layout.units(rows)
        while True:
            try:
                c.injector.check("eval", c.eval_round, c.eval_batch, c.eval_batch + 1)
                return self._run(model, inputs, rows, (prediction_loss_only, ignore_keys),
                                 gen_kwargs)
            except self.oom_types as err:
                self._recover(err, rows)

    def _run(self, model: Any, inputs: Any, units: int | None, args: tuple, gen: dict) -> Any:
        size, layout = self.ctx.eval_rows, self.ctx.layout
        if units is None or size is None or size >= units:
            return self.original(model, inputs, *args, **gen)
        chunks = row_chunks(inputs, batch_rows(inputs), 0, size, layout)
        outs = [self.original(model, chunk, *args, **gen) for _n, chunk in chunks]
        shifts = getattr(self.ctx.trainer, "_loss_shifts_labels", True)
        weights = [loss_items(chunk, n, shifts, layout) for n, chunk in chunks]
        loss = weighted_loss([o[0] for o in outs], weights)
        if loss is not None and outs[0][0] is not None:
            loss = loss.to(outs[0][0].dtype)
        predictions = join_outputs([o[1] for o in outs], _pad_id(self.ctx.trainer))
        labels = join_outputs([o[2] for o in outs], -100)
        return loss, predictions, labels

    def _recover(self, err: BaseException, rows: int | None) -> None:
        c = self.ctx
        if not c.enabled:
            raise err
        if c.dist.active or c.kind in ("deepspeed", "fsdp"):
            exit_for_restart(c, err, "the other ranks are inside the evaluation loop's "
                             "gathers", phase="eval")
        release_memory(lambda: None, c.trainer.args.device)
        before = c.eval_rows or rows or 1
        if before <= 1:
            c.event("oom_unrecoverable", f"out of memory in evaluation round {c.eval_round} "
                    "with one row per batch; lower max_new_tokens or the eval sequence length",
                    phase="eval", error=first_line(err))
            raise err
        c.eval_rows = before // 2
        c.event("eval_oom", f"OOM in evaluation round {c.eval_round}: {rows or '?'} rows now "
                f"run {c.eval_rows} at a time; training batches unchanged", phase="eval",
                error=first_line(err), eval_batch_before=before, eval_batch_after=c.eval_rows,
                per_device_eval_batch_size=c.trainer.args.per_device_eval_batch_size,
                round=c.eval_round)
