"""Evaluation during and after training: loss, and predict_with_generate.

An OOM here halves only the evaluation batch (every rank agrees through one
all_reduce per batch) and redoes the batch that failed; the training micro
batch is untouched. Ranks walk their shards in lockstep so that they call
the collectives equally often.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ...dataset.records import IGNORE_INDEX, Example
from ...fileio import write_atomic
from .batches import collate, label_tokens
from .losses import token_loss_sum
from .memlog import EVAL_LOG
from .oom import TrainingOOMError, first_line, release_memory


class Evaluator:
    def __init__(self, trainer: Any) -> None:
        self.t = trainer
        examples = trainer.eval_data.examples
        d = trainer.dist
        self.shard = list(range(d.rank, len(examples), d.world_size))
        self.lockstep_len = math.ceil(len(examples) / d.world_size)

    def _batches(self, fn: Any, phase: str) -> list[Any]:
        """Apply ``fn`` to consecutive eval batches; OOM halves the eval batch."""
        import torch

        t, out, pos = self.t, [], 0
        while pos < self.lockstep_len:
            size = t.eval_batch_size
            idx = self.shard[pos:pos + size]
            n_batches = math.ceil(self.lockstep_len / size)
            error, value = "", None
            try:
                t.injector.check("eval", t.eval_round, pos // size, n_batches)
                value = fn([t.eval_data.examples[i] for i in idx]) if idx else None
            except torch.OutOfMemoryError as err:
                error = first_line(err)
            if not t.dist.any_true(bool(error)):
                out.append(value)
                pos += size
                continue
            release_memory(lambda: None, t.device)
            if size == 1:
                raise TrainingOOMError(f"out of memory in {phase} at evaluation batch 1 "
                                       f"(step {t.step}): {error}; lower eval.max_new_tokens "
                                       "or seq_len")
            t.eval_batch_size = size // 2
            t.log.event("eval_oom", f"OOM in {phase}: eval batch {size} -> {size // 2} "
                        "(training micro batch unchanged)", t.step, error=error,
                        eval_batch_before=size, eval_batch_after=size // 2)
        return [v for v in out if v is not None]

    def _loss(self, examples: list[Example]) -> tuple[float, float]:
        import torch

        batch = collate(examples, self.t.pad_id, self.t.device, self.t.vision)
        labels = batch.pop("labels")
        with torch.no_grad(), self.t._autocast():
            loss = token_loss_sum(self.t.engine.forward(batch), labels)
        return float(loss), float(label_tokens(examples))

    def _generate(self, examples: list[Example]) -> list[dict[str, Any]]:
        import torch

        tok, t = self.t.tokenizer, self.t
        prompts, refs = [], []
        for ex in examples:
            first = next(i for i, lab in enumerate(ex.labels) if lab != IGNORE_INDEX)
            prompts.append(list(ex.input_ids[:first]))
            refs.append([x for x in ex.labels if x != IGNORE_INDEX])
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), t.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):  # left padding for generation
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        extra: dict[str, Any] = {}
        images = [p for ex in examples for p in ex.images]
        if images and t.vision is not None:
            from ...dataset.vision import pixel_inputs

            extra = pixel_inputs(t.vision, images, t.device)
        with torch.no_grad(), t._autocast():
            out = t.engine.module.generate(**extra, input_ids=ids.to(t.device),
                                           attention_mask=mask.to(t.device),
                                           max_new_tokens=t.cfg.eval.max_new_tokens or 64,
                                           do_sample=False, pad_token_id=t.pad_id,
                                           use_cache=True)
        rows = []
        for ex, ref, gen in zip(examples, refs, out[:, width:].tolist(), strict=True):
            pred = tok.decode(gen, skip_special_tokens=True).strip()
            reference = tok.decode(ref, skip_special_tokens=True).strip()
            rows.append({"line": ex.lines[0], "prediction": pred, "reference": reference,
                         "exact_match": pred == reference})
        return rows

    def run(self) -> dict[str, Any]:
        t = self.t
        t.eval_round += 1
        t.engine.module.eval()
        try:
            parts = self._batches(self._loss, "evaluation")
            loss_sum, tokens = t.dist.all_reduce([sum(p[0] for p in parts),
                                                  sum(p[1] for p in parts)])
            metrics: dict[str, Any] = {"step": t.step, "eval_loss": loss_sum / max(tokens, 1),
                                       "eval_batch_size": t.eval_batch_size}
            if t.cfg.eval.predict_with_generate:
                rows = [r for part in self._batches(self._generate, "generation") for r in part]
                hits, n = t.dist.all_reduce([sum(r["exact_match"] for r in rows), len(rows)])
                metrics["exact_match"] = hits / max(n, 1)
                self._write_predictions(rows)
        finally:
            t.engine.module.train()
        if t.dist.is_main:
            t.log.append(EVAL_LOG, metrics)
        extra = {k: v for k, v in metrics.items() if k != "step"}
        t.log.event("eval", f"eval loss {metrics['eval_loss']:.4f}", t.step, **extra)
        return metrics

    def _write_predictions(self, rows: list[dict[str, Any]]) -> None:
        t = self.t
        path = t.run_dir / f"predictions-step{t.step:06d}-rank{t.dist.rank}.jsonl"
        write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
