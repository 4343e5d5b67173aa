"""The training loop: exact OOM recovery, memory log, checkpoints, resume.

Why our own loop and not a ``transformers.Trainer`` subclass: recovering from
an OOM *without changing the training* needs control over which samples an
optimizer step uses and how they are cut into micro batches. Trainer pulls
fixed-size batches from a DataLoader inside its ~600-line inner loop, so a
retry would either skip those samples or repeat them. Here a step is a list
of sample indices (oomless.runtime.train.batches), cut into micro batches of the
current size; the loss is the sum of token losses divided by the label
tokens of the *whole* optimizer step (all ranks), so any cut gives the same
gradient. On an OOM every rank learns about it through one all_reduce, drops
the step's gradients, restores the RNG, halves the micro batch (doubling the
accumulation) and redoes the same step with the same samples.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...config import RunConfig
from ...dataset.records import load_examples, load_tokenizer
from ...errors import ConfigError, OomlessError
from ..loading import build_optimizer, build_scheduler, enable_grad_ckpt, load_model, torch_dtypes
from . import checkpoint as ckpt
from .batches import SampleSchedule, collate, label_tokens, micro_batches
from .checkpoint import seed_everything
from .dist import Dist, init_dist
from .engines import make_engine
from .losses import token_loss_sum
from .memlog import Progress, RunLog, device_memory
from .oom import (
    FaultInjector,
    TrainingOOMError,
    budget_mode,
    diagnosis,
    first_line,
    next_setting,
    release_memory,
    state_tensors,
    storage_bytes,
)
from .persistence import CheckpointedRun, Signals
from .preflight import predicted_estimate
from .run_folder import RunFolder, TrainResult


class StepOOM(Exception):
    """An OOM in a micro batch (this rank's message, or empty: another rank had one)."""

    def __init__(self, message: str, in_backward: bool = False) -> None:
        super().__init__(message)
        self.in_backward = in_backward


@dataclass
class _Progress:
    """How far the current optimizer step got: samples whose gradients are in."""

    done: int = 0
    loss_sum: float = 0.0


class TrainingInterrupted(OomlessError):
    """SIGINT/SIGTERM: a checkpoint was written; ``--resume`` continues."""

    exit_code = 130


class Trainer(CheckpointedRun):
    def __init__(self, cfg: RunConfig, run_dir: Path | None = None, resume: bool = False,
                 progress: bool = False, auto_fit: bool = False,
                 on_step_end: Callable[[Trainer, dict[str, Any]], None] | None = None,
                 start_over: bool = False) -> None:
        self.cfg = cfg
        self.auto_fit = auto_fit
        self.run_dir = Path(run_dir or cfg.training.output_dir)
        self.folder = RunFolder(self.run_dir)
        self.resume = resume
        self.start_over = start_over
        self.first_loss: float | None = None  # the run's first step (kept across resumes)
        self.show_progress = progress
        self.on_step_end = on_step_end
        self.step = 0  # optimizer steps completed
        self.eval_round = 0
        self.tracked_peak_bytes = 0  # simulated budget mode: highest step peak so far
        self.step_peak_bytes = 0

    # ---- setup ----------------------------------------------------------------
    def _setup(self) -> None:
        from ...dataset.vision import is_vision_model, load_processor
        from ..loading import resolve_model_dir

        self.dist: Dist = init_dist()
        self.device = self.dist.device
        self.folder.is_main = self.dist.is_main
        if not self.cfg.data.train_file:
            raise ConfigError("data.train_file is not set; point it at a .jsonl, .json or "
                              ".parquet file of training records")
        model_dir = resolve_model_dir(self.cfg.model)
        self._claim_folder()
        self.log = RunLog(self.run_dir, enabled=self.dist.is_main, resume=self.resume,
                          run_id=self.folder.run_id)
        self._preflight(model_dir)
        cfg, t = self.cfg, self.cfg.training
        seed_everything(t.seed)  # same seed on every rank: identical initial replicas
        self.tokenizer = load_tokenizer(str(model_dir), t.trust_remote_code)
        self.vision = (load_processor(model_dir, t.trust_remote_code)
                       if is_vision_model(model_dir) else None)
        rd = self.run_dir if self.dist.is_main else None
        self.train_data = load_examples(cfg.data.train_file, self.tokenizer, cfg.data,
                                        cfg.seq_len, rd, vision=self.vision)
        self.eval_data = (load_examples(cfg.data.eval_file, self.tokenizer, cfg.data,
                                        cfg.seq_len, rd, "eval_token_stats.json", self.vision)
                          if cfg.data.eval_file else None)
        self.data_fingerprints = {"train": data_fingerprint(cfg.data.train_file),
                                  "eval": data_fingerprint(cfg.data.eval_file)}
        self.schedule = SampleSchedule(len(self.train_data.examples),
                                       cfg.micro_batch_size * cfg.grad_accum * self.dist.world_size,
                                       self.dist.world_size, t.seed)
        self.total_steps = self.schedule.total_steps(t.epochs, t.max_steps)
        self.model, self.model_dir = load_model(cfg, self.device)
        _, self.autocast_dtype = torch_dtypes(cfg, self.device.type)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(cfg, self.params, self.device.type)
        self.scheduler = build_scheduler(cfg, self.optimizer, self.total_steps)
        self.engine = make_engine(self)  # may wrap model and optimizer (DeepSpeed)
        self.injector = FaultInjector(t.inject_oom, self.dist.rank)
        self.pad_id = self.tokenizer.pad_token_id

    def _claim_folder(self) -> None:
        """Rank 0 locks and claims the run folder; every rank learns the run id (or the
        refusal, so that no rank waits for the others in vain)."""
        message = None
        if self.dist.is_main:
            try:
                message = "ok:" + self.folder.claim(self.resume, self.start_over)
            except OomlessError as err:
                message = "error:" + str(err)
        message = str(self.dist.broadcast_str(message))
        if message.startswith("error:"):
            raise ConfigError(message.removeprefix("error:"))
        self.folder.run_id = message.removeprefix("ok:")

    def _preflight(self, model_dir: Path) -> None:
        """Estimate before loading weights; stop, or apply the plan with --auto-fit."""
        from .preflight import apply, run_preflight
        pre = run_preflight(self.cfg, model_dir)
        fitted = apply(pre, self.cfg, self.auto_fit or self.cfg.training.auto_fit)
        if fitted is not self.cfg:
            self.log.event("auto_fit", "predicted OOM; applied the best plan that fits "
                           "(same effective batch)", 0, changes=pre.changes,
                           predicted_peak_bytes=pre.estimate.device_peak_bytes)
            self.cfg = fitted
        self.preflight_note = pre.note
        self.micro_batch_size = self.cfg.micro_batch_size
        self.grad_ckpt = self.cfg.grad_ckpt
        self.eval_batch_size = self.cfg.eval_batch_size
        self.estimate = predicted_estimate(self.cfg, model_dir, pre.cluster)
        self.predicted_peak_bytes = self.estimate.peak_allocated_bytes if self.estimate else None

    def schedule_dict(self) -> dict[str, int]:
        s = self.schedule
        return {"num_samples": s.num_samples, "effective_batch": s.effective_batch,
                "world_size": s.world_size, "seed": s.seed}

    # ---- one optimizer step ---------------------------------------------------------------
    def _autocast(self) -> Any:
        import torch

        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _accumulate(self, indices: list[int], denom: float, progress: _Progress) -> None:
        """Forward and backward the step's samples not done yet, in micro batches.

        The loss is divided by the whole step's label tokens, so each sample's
        gradient does not depend on how the step is cut: after an OOM before a
        backward, the samples already done keep their gradients and the rest
        continue with the smaller micro batch.
        """
        import torch

        chunks = micro_batches(indices[progress.done:], self.micro_batch_size)
        budget = self.cfg.training.memory_budget_gb
        mode = (budget_mode(budget, storage_bytes(state_tensors(self.model, self.optimizer)))
                if budget else contextlib.nullcontext())
        scale = self.engine.grad_scale / denom
        with mode:
            for i, chunk in enumerate(chunks):
                loss_sum = self._forward_loss(chunk, i, len(chunks))
                try:
                    self.engine.backward(loss_sum * scale, last=i == len(chunks) - 1)
                    self.injector.check("train", self.step + 1, i, len(chunks), "backward")
                except torch.OutOfMemoryError as err:
                    raise StepOOM(first_line(err), in_backward=True) from None
                progress.done += len(chunk)
                progress.loss_sum += loss_sum.item()
                del loss_sum
        if budget:  # the peak of the attempt that succeeded
            self.step_peak_bytes = mode.peak_bytes
            self.tracked_peak_bytes = max(self.tracked_peak_bytes, mode.peak_bytes)

    def _forward_loss(self, chunk: list[int], index: int, count: int) -> Any:
        """One micro batch's summed token loss; engines agree on an OOM before backward."""
        import torch

        error = ""
        try:
            batch = collate([self.train_data.examples[j] for j in chunk], self.pad_id,
                            self.device, self.vision)
            labels = batch.pop("labels")
            with self._autocast():
                logits = self.engine.forward(batch)
            loss_sum = token_loss_sum(logits, labels)
            del logits, batch, labels
            self.injector.check("train", self.step + 1, index, count)
        except torch.OutOfMemoryError as err:
            error = first_line(err)
        if self.engine.agree_each_micro and self.dist.any_true(bool(error)):
            raise StepOOM(error)  # empty message: another rank had the OOM
        if error:
            raise StepOOM(error)
        return loss_sum

    def _recover(self, step: int, indices: list[int], errors: list[str], redo: bool) -> None:
        """Every rank: smaller micro batch (or checkpointing), or stop with a diagnosis."""
        ranks = [r for r, e in enumerate(errors) if e] or list(range(self.dist.world_size))
        error = errors[ranks[0]]
        release_memory(self.engine.discard if redo else (lambda: None), self.device)
        before = self.micro_batch_size
        rec = next_setting(self.micro_batch_size, self.grad_ckpt)
        if rec is None:
            longest = max(len(self.train_data.examples[j]) for j in indices)
            budget = self.cfg.training.memory_budget_gb
            text = diagnosis(step, longest, self.predicted_peak_bytes,
                             int(budget * 2**30) if budget else None, error)
            self.log.event("oom_unrecoverable", text, step, ranks=ranks)
            raise TrainingOOMError(text)
        self.micro_batch_size = rec.micro_batch_size
        if rec.grad_ckpt and not self.grad_ckpt:
            enable_grad_ckpt(self.model)
            self.grad_ckpt = True
        self.log.event("oom", f"OOM at step {step} on rank(s) {ranks}: {rec.action}; the same "
                       "step goes on with the same samples", step, ranks=ranks, error=error,
                       micro_batch_before=before, micro_batch_after=self.micro_batch_size,
                       grad_accum_after=math.ceil(len(indices) / self.micro_batch_size),
                       grad_ckpt=self.grad_ckpt, effective_batch=self.schedule.effective_batch)

    def _attempt(self, indices: list[int], denom: float, progress: _Progress) -> StepOOM | None:
        try:
            self._accumulate(indices, denom, progress)
        except StepOOM as err:
            return err
        return None

    def _train_step(self) -> dict[str, Any]:
        step = self.step + 1
        indices = self.schedule.step_indices(self.step, self.dist.rank)
        examples = [self.train_data.examples[j] for j in indices]
        denom = self.dist.all_reduce([float(label_tokens(examples))])[0]
        rng = ckpt.rng_state()
        start = time.perf_counter()
        progress = _Progress()
        while True:
            oom = self._attempt(indices, denom, progress)
            if not self.dist.any_true(oom is not None):  # the agreement
                break
            if oom and oom.in_backward and self.engine.name != "replica":
                raise TrainingOOMError(
                    f"OOM inside {self.engine.name}'s backward at step {step} ({oom}); its "
                    "collectives cannot be undone in-process: resume (--resume) with "
                    f"micro_batch_size {max(1, self.micro_batch_size // 2)}")
            redo = bool(oom and oom.in_backward)
            errors = self.dist.gather_objects(str(oom) if oom else "")
            self._recover(step, indices, [str(e) for e in errors], redo)  # every rank changes
            if redo:  # this rank's gradients were dropped: all its samples again
                progress = _Progress()
                ckpt.set_rng_state(rng)
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = self.engine.step()
        self.scheduler.step()
        n_tokens = float(sum(len(e) for e in examples))
        loss_sum, n_tokens = self.dist.all_reduce([progress.loss_sum, n_tokens])
        elapsed = time.perf_counter() - start
        self.step = step
        return {"step": step, "loss": loss_sum / denom, "lr": lr, "tokens": int(n_tokens),
                "label_tokens": int(denom), "step_time_s": round(elapsed, 6),
                "tokens_per_s": round(n_tokens / elapsed, 2), "grad_norm": grad_norm,
                "micro_batch_size": self.micro_batch_size,
                "grad_accum": math.ceil(len(indices) / self.micro_batch_size),
                "grad_ckpt": self.grad_ckpt, "samples": indices}

    def _memory_fields(self) -> dict[str, Any]:
        mem = device_memory(self.device)
        mem["micro_batch_size"] = self.micro_batch_size
        keys = sorted(mem)
        per_rank = self.dist.gather([float(mem[k]) for k in keys])
        out: dict[str, Any] = {}
        for i, k in enumerate(keys):
            values = [int(r[i]) for r in per_rank]
            if k == "micro_batch_size":
                out["micro_batch_size_per_rank"] = values
            else:
                out[k] = values if k != "host_rss_bytes" else max(values)
        if self.cfg.training.memory_budget_gb and self.device.type == "cpu":
            out["simulated_peak_bytes"] = self.step_peak_bytes
        out["predicted_peak_bytes"] = self.predicted_peak_bytes
        return out

    # ---- the run ---------------------------------------------------------------------
    def run(self) -> TrainResult:
        try:
            self._setup()
            return self._run()
        finally:
            self.folder.release()
            if hasattr(self, "dist"):
                self._drop_engine()
                self.dist.close()

    def _drop_engine(self) -> None:
        """Let go of every object that holds a process group (engine, model, optimizer),
        so that Dist.close can shut the groups' backends down (see release_process_groups)."""
        engine = self.__dict__.pop("engine", None)
        if engine is not None:
            try:
                engine.close()
            except Exception as err:  # noqa: BLE001 - teardown must not hide the run's error
                print(f"oomless: rank {self.dist.rank}: closing the {engine.name} engine "
                      f"failed ({type(err).__name__}: {err})", file=sys.stderr)
        for name in ("model", "optimizer", "scheduler", "params"):
            self.__dict__.pop(name, None)

    def _run(self) -> TrainResult:
        from .evaluate import Evaluator
        if self.resume:
            self.resume_from_checkpoint()
        self.write_run_files()
        t = self.cfg.training
        evaluator = Evaluator(self) if self.eval_data else None
        result = TrainResult(self.run_dir, self.step)
        bar = Progress(self.total_steps, self.step, self.show_progress and self.dist.is_main)
        self.engine.module.train()
        try:
            with Signals() as signals:
                while self.step < self.total_steps:
                    record = self._train_step()
                    record.update(self._memory_fields())
                    if self.step % t.logging_steps == 0 or self.step == self.total_steps:
                        self.log.step(record)
                    result.losses.append(record["loss"])
                    if self.first_loss is None:
                        self.first_loss = record["loss"]
                    bar.update(self.step, f"loss {record['loss']:.4f}")
                    if evaluator and self.cfg.eval.steps and self.step % self.cfg.eval.steps == 0:
                        result.eval_losses.append(evaluator.run()["eval_loss"])
                    if t.save_steps and self.step % t.save_steps == 0:
                        self.save_checkpoint()
                    if self.on_step_end:
                        self.on_step_end(self, record)
                    if self.dist.any_true(signals.caught is not None):
                        folder = self.save_checkpoint()
                        self.log.event("interrupted", "stopped by a signal; checkpoint "
                                       "written", self.step, checkpoint=str(folder))
                        raise TrainingInterrupted(
                            f"stopped at step {self.step}/{self.total_steps}; checkpoint in "
                            f"'{self.run_dir / ckpt.CHECKPOINTS}'. Continue with: "
                            "oomless train CONFIG --resume")
        finally:
            bar.close()
        if evaluator and not (self.cfg.eval.steps and self.step % self.cfg.eval.steps == 0):
            result.eval_losses.append(evaluator.run()["eval_loss"])
        return self.finish(result)

def data_fingerprint(path: str | None) -> dict[str, Any] | None:
    """Size and SHA-256 of a data file: a resumed run must read the same records."""
    if not path:
        return None
    from ...fileio import sha256_file

    return {"bytes": Path(path).stat().st_size, "sha256": sha256_file(path)}


def train(cfg: RunConfig, run_dir: str | Path | None = None, resume: bool = False,
          progress: bool = False, auto_fit: bool = False,
          on_step_end: Callable | None = None, start_over: bool = False) -> TrainResult:
    """Fine-tune as ``cfg`` says; the run folder gets logs, checkpoints and the result.

    ``start_over``: a folder holding another run is cleared first (else refused)."""
    return Trainer(cfg, Path(run_dir) if run_dir else None, resume, progress, auto_fit,
                   on_step_end, start_over).run()
