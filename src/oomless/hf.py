"""Protect the transformers Trainer you already have: ``trainer = oomless.hf.protect(trainer)``.

Works on ``transformers.Trainer`` and its subclasses (``Seq2SeqTrainer``,
TRL's ``SFTTrainer`` / ``DPOTrainer``, LLaMA-Factory's trainers), already
built, before ``trainer.train()``:

    from oomless.hf import protect
    trainer = protect(SFTTrainer(model=model, args=args, train_dataset=data))
    trainer.train()

What it adds (details in docs/hf.md):

- a micro batch that runs out of memory is redone in halves — the same
  samples, the same loss normalisation, gradients equal to the unsplit step —
  down to one row, then with gradient checkpointing; the smaller size is kept
  for later steps; the effective batch never changes; several ranks agree
  and split together;
- an evaluation or prediction OOM halves only the eval batch;
- each recovery is one line on stderr (above tqdm's bar), and the end of the
  training prints a summary of what was changed;
- ``OUTPUT_DIR/oomless/memlog.jsonl`` and ``events.jsonl`` (``oomless report``
  reads them), and a preflight estimate at the start that warns, or stops
  before step 1 with ``preflight="refuse"``;
- under DeepSpeed or FSDP, an OOM it cannot undo in-process ends the process
  with exit code 75 after saying why, for ``oomless run`` to relaunch.

This module imports nothing heavy: torch and transformers load on the call.
"""

from __future__ import annotations

import os
from typing import Any


def protect(trainer: Any, *, preflight: str | None = None, gpu: str | None = None,
            run_dir: str | os.PathLike[str] | None = None,
            memory_budget_gb: float | None = None, inject: str | None = None) -> Any:
    """Protect ``trainer`` in place and return it.

    ``preflight``: "warn" (default), "refuse" or "off". ``gpu``: the GPU to
    check against when the run is not on one (e.g. "rtx-4090"). ``run_dir``:
    where the logs go (default ``args.output_dir``/oomless). ``memory_budget_gb``:
    a simulated GPU of that size (CPU tests). ``inject``: fault injection,
    e.g. "train:3" or "eval:1" (see OOMLESS_INJECT_OOM in docs/hf.md).
    """
    from .runtime.protect import install

    return install(trainer, preflight=preflight, gpu=gpu, run_dir=run_dir,
                   memory_budget_gb=memory_budget_gb, inject=inject)
