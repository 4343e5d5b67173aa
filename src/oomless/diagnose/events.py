"""The frozen values a diagnosis hands over: events, causes, fixes, hints.

Everything here is JSON-serialisable through ``to_dict``; byte quantities are
integers and their keys end in ``_bytes``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Event kinds, one per family of message.
CUDA_OOM = "cuda_oom"  # PyTorch caching allocator (1.x and 2.x wording), cudaMallocAsync
CUDA_ERROR_OOM = "cuda_error_oom"  # "CUDA error: out of memory", CUBLAS_STATUS_ALLOC_FAILED
BNB_OOM = "bitsandbytes_oom"  # bitsandbytes' C error line "Error out of memory at line …"
NCCL_OOM = "nccl_oom"  # NCCL's own cudaMalloc failed
VLLM_NO_KV = "vllm_no_kv_cache"  # "No available memory for the cache blocks"
VLLM_MAX_LEN = "vllm_max_len"  # max_model_len larger than the KV cache holds
VLLM_FREE_MEMORY = "vllm_free_memory"  # free memory below the requested utilization
VLLM_SAMPLER = "vllm_sampler_warmup"  # "CUDA out of memory occurred when warming up sampler"
HOST_OOM = "host_oom"  # kernel OOM killer, cgroup/slurm/k8s OOM kills, CPU allocator
PROCESS_KILLED = "process_killed"  # SIGKILL / exit code -9 or 137 without a kernel line

GPU_KINDS = (CUDA_OOM, CUDA_ERROR_OOM, BNB_OOM, NCCL_OOM)
VLLM_KINDS = (VLLM_NO_KV, VLLM_MAX_LEN, VLLM_FREE_MEMORY, VLLM_SAMPLER)
HOST_KINDS = (HOST_OOM, PROCESS_KILLED)


@dataclass(frozen=True)
class ProcessMemory:
    """One process the CUDA allocator listed in its message (PyTorch ≥ 2.1, NVML)."""

    pid: int | None  # None: "this process" (PyTorch names it, not its pid)
    memory_bytes: int
    is_self: bool


@dataclass(frozen=True)
class OomEvent:
    """One out-of-memory event found in the text, with the numbers its message gave."""

    kind: str
    source: str  # pytorch-2.x, pytorch-1.x, cuda-malloc-async, bitsandbytes, deepspeed, vllm, nccl, kernel, torchrun, ...
    line: int  # 1-based line of the log where the message starts
    message: str  # the message, whitespace-normalised, at most 600 characters
    rank: int | None = None
    device: int | None = None
    numbers: dict[str, int | float] = field(default_factory=dict)
    processes: tuple[ProcessMemory, ...] = ()
    phase: str = "unknown"
    frames: tuple[str, ...] = ()  # "path:function" of the traceback, outermost first
    library: str | None = None  # innermost library in the traceback: bitsandbytes, deepspeed, vllm, ...
    occurrences: int = 1  # identical messages of the same rank merged into this one

    def number(self, key: str) -> int | float | None:
        return self.numbers.get(key)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["processes"] = [asdict(p) for p in self.processes]
        d["frames"] = list(self.frames)
        return d


@dataclass(frozen=True)
class Cause:
    """Why the event happened, with the numbers that show it."""

    code: str  # fragmentation, other_process, evaluation, generation, logits, replicas, long_sample, ...
    title: str
    evidence: str
    numbers: dict[str, int | float] = field(default_factory=dict)


@dataclass(frozen=True)
class Fix:
    """One change that removes the cause, and what memory it leads to.

    ``changes`` are run-configuration keys (``RunConfig.replace`` syntax) or
    environment/engine settings; ``keeps_training`` is True when the trained
    result stays the same (same effective batch, same data, same model).
    ``predicted_peak_bytes`` comes from the estimator (``prediction`` =
    "estimator") or from arithmetic on the logged numbers ("arithmetic").
    """

    code: str
    text: str
    changes: dict[str, Any] = field(default_factory=dict)
    keeps_training: bool = True
    predicted_peak_bytes: int | None = None
    gpu_memory_bytes: int | None = None
    prediction: str = "none"  # estimator | arithmetic | none
    fits: bool | None = None
    domain: str = "training"  # what it changes: training | serving (an inference engine) | environment

    @property
    def summary(self) -> str:
        """The fix with its prediction, e.g. '…: predicted 31.20 GiB of 40.00 GiB'."""
        from ..units import fmt_bytes

        if self.predicted_peak_bytes is None or self.gpu_memory_bytes is None:
            return self.text
        verdict = "" if self.fits is None or self.fits else " (still too much)"
        return (
            f"{self.text}: predicted {fmt_bytes(self.predicted_peak_bytes)} "
            f"of {fmt_bytes(self.gpu_memory_bytes)}{verdict}"
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["summary"] = self.summary
        return d


@dataclass(frozen=True)
class RunHints:
    """Training and engine settings read from the log itself (command lines, arg dumps)."""

    micro_batch_size: int | None = None
    grad_accum: int | None = None
    eval_batch_size: int | None = None
    seq_len: int | None = None
    max_new_tokens: int | None = None
    zero_stage: int | None = None
    grad_ckpt: bool | None = None
    world_size: int | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    steps_done: int | None = None  # training steps completed before the first event
    vllm_profile: dict[str, int | float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Finding:
    """One event with its causes (most likely first) and fixes (training-preserving first)."""

    event: OomEvent
    causes: tuple[Cause, ...]
    fixes: tuple[Fix, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "event": self.event.to_dict(),
            "causes": [asdict(c) for c in self.causes],
            "fixes": [f.to_dict() for f in self.fixes],
        }


@dataclass(frozen=True)
class Diagnosis:
    """Everything ``oomless diagnose`` found in one text."""

    findings: tuple[Finding, ...]
    hints: RunHints
    notes: tuple[str, ...] = ()
    gpu: str | None = None  # the GPU the predictions were made for
    gpu_memory_bytes: int | None = None

    @property
    def found(self) -> bool:
        return bool(self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {
            "found": self.found,
            "summary": None if self.found else NO_EVENT,
            "events": [f.to_dict() for f in self.findings],
            "hints": self.hints.to_dict(),
            "notes": list(self.notes),
            "gpu": self.gpu,
            "gpu_memory_bytes": self.gpu_memory_bytes,
        }


NO_EVENT = "no out-of-memory event found"
