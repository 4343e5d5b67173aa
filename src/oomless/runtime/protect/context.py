"""The state one protected Trainer shares between its step guard, evaluation guard and callback.

It also holds the several-rank agreement: at the end of every training
forward (a forward hook on the model inside any DDP wrapper, so that DDP has
not yet prepared a backward) each rank all-reduces a one-hot vector of "I ran
out of memory"; a rank whose forward failed joins the same all-reduce from
its error handler. Every rank learns which ranks failed and all of them cut
the micro batch together, so the collectives that follow (DDP's gradient
buckets, TRL's metric gathers) stay matched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..train.dist import Dist
from ..train.memlog import RunLog
from ..train.oom import FaultInjector
from .batch import Layout


def say(text: str) -> None:
    """A line on stderr on a line of its own: above tqdm's progress bars when tqdm is
    loaded (``tqdm.write`` clears the bars, writes, and redraws them), else printed."""
    import sys

    tqdm = sys.modules.get("tqdm")
    if tqdm is not None and hasattr(tqdm, "tqdm"):
        tqdm.tqdm.write(text, file=sys.stderr)
        sys.stderr.flush()
    else:
        print(text, file=sys.stderr, flush=True)


def checkpointing_on(model: Any) -> bool:
    """Whether the model runs with gradient checkpointing (however it was switched on:
    TrainingArguments, or the script calling ``gradient_checkpointing_enable``)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # renamed in 5.x
        value = getattr(model, name, None)
        if value is not None:
            return bool(value)
    return False


class PeerOOM(Exception):
    """Another rank ran out of memory in this forward; this one stops it too."""

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(f"out of memory on rank(s) {ranks}")
        self.ranks = ranks


def engine_kind(trainer: Any) -> str:
    """deepspeed | fsdp | ddp (several plain replicas) | single."""
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "deepspeed"
    if getattr(trainer, "is_fsdp_enabled", False):
        return "fsdp"
    return "ddp" if trainer.args.world_size > 1 else "single"


@dataclass
class ProtectContext:
    trainer: Any
    run_dir: Path
    log: RunLog
    dist: Dist
    kind: str
    injector: FaultInjector
    budget_gb: float | None = None
    layout: Layout = field(default_factory=Layout)
    enabled: bool = True  # False: OOMLESS_PROTECT=0, logging only
    supervised: bool = False  # started by `oomless run`: its run folder, appended to
    chunk_rows: int | None = None  # training rows per forward after an OOM (None: whole batch)
    eval_rows: int | None = None  # evaluation rows per prediction_step after an OOM
    grad_ckpt: bool = False  # switched on by the recovery
    recoveries: list[str] = field(default_factory=list)  # "oom" / "eval_oom", in order
    predicted_peak_bytes: int | None = None
    # per optimizer step
    micro_index: int = -1
    micro_count: int = 1  # micro batches in this optimizer step, read before any chunk runs
    step_inputs: list[Any] = field(default_factory=list)
    step_peak_bytes: int = 0
    # per forward/backward attempt
    in_step: bool = False
    in_backward: bool = False
    agreed: bool = False
    eval_round: int = 0
    eval_batch: int = -1
    hooked: set[int] = field(default_factory=set)

    @property
    def step(self) -> int:
        """The optimizer step being computed (1-based)."""
        return self.trainer.state.global_step + 1

    @property
    def keeps_step_inputs(self) -> bool:
        """One process: a backward OOM is recovered by redoing the step's micro batches."""
        return self.enabled and self.kind == "single"

    def event(self, kind: str, message: str, step: int | None = None, **data: Any) -> None:
        """An event line (rank 0); OOMs and recoveries are also said on stderr."""
        if kind in ("oom", "eval_oom"):
            self.recoveries.append(kind)
        if not self.dist.is_main:
            return
        self.log.event(kind, message, self.trainer.state.global_step if step is None else step,
                       **data)
        if "oom" in kind:
            say(f"oomless: {message}")

    # ---- the agreement ------------------------------------------------------------
    def agree(self, failed: bool) -> list[int]:
        """Ranks whose forward ran out of memory (one all-reduce on every rank)."""
        flags = [0.0] * self.dist.world_size
        flags[self.dist.rank] = 1.0 if failed else 0.0
        return [r for r, v in enumerate(self.dist.all_reduce(flags)) if v > 0]

    def forward_hook(self, module: Any, args: Any, output: Any) -> None:
        if not self.in_step or not module.training:
            return
        self.injector.check("train", self.step, self.micro_index, self.micro_count)
        if self.dist.active:
            ranks = self.agree(False)
            self.agreed = True
            if ranks:
                raise PeerOOM(ranks)

    def count_micro_batches(self) -> None:
        t = self.trainer
        self.micro_count = int(getattr(t, "current_gradient_accumulation_steps", 0)
                               or t.args.gradient_accumulation_steps)

    def hook_model(self, model: Any) -> None:
        """Put the forward hook on the module inside DDP (once per module)."""
        if not (self.dist.active or self.injector.specs):
            return
        inner = getattr(model, "module", model) if type(model).__name__ == \
            "DistributedDataParallel" else model
        if id(inner) not in self.hooked:
            inner.register_forward_hook(self.forward_hook)
            self.hooked.add(id(inner))
