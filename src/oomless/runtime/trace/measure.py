"""``oomless measure``: run the configuration for real and report its memory.

On an NVIDIA GPU: the model is built from its config on the GPU with random
weights (runtime/build.py, mode "real"), HF Trainer's step runs a few times
(oomless.runtime.trace.hf_step), and the result holds ``torch.cuda.max_memory_allocated`` /
``max_memory_reserved`` per phase and the device memory NVML reports
(nvidia-ml-py), sampled through the steps; the CUDA context is measured on its
own, before the model exists.

Without a GPU: the same build and steps run on real CPU tensors under the
storage tracker, with the same CUDA emulation and allocator simulation as
``oomless trace``; this is what tests compare the fake-tensor trace with.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from ...allocator import AllocatorConfig
from ...config import RunConfig
from ...errors import ConfigError, GPUUnavailableError
from ...models.hardware import Cluster
from ...result import MemoryEstimate

CPU_MAX_PARAMS = 200_000_000  # a CPU measurement is for small models (host RAM, time)


def measure_training(cfg: RunConfig, cluster: Cluster | None = None, *, resolved: Any = None,
                     device: str = "auto", steps: int = 3,
                     alloc_conf: str | None = None) -> MemoryEstimate:
    """Measure ``cfg`` on ``device`` ("auto": the GPU when there is one)."""
    import torch

    from ...models.catalog import resolve_model

    resolved = resolved or resolve_model(cfg.model)
    if resolved.hf_config is None:
        raise ConfigError(
            f"model type '{resolved.spec.model_type}' has no transformers class; it cannot be "
            "run here. Use `oomless estimate` for it")
    if steps < 2:
        raise ConfigError(f"--steps {steps}: measure needs at least 2 steps (the second has "
                          "optimizer state); use --steps 2 or more")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise GPUUnavailableError("--device cuda: no CUDA GPU is visible to PyTorch here")
        _apply_alloc_conf(alloc_conf)
        return _measure_gpu(resolved, cfg, cluster, steps)
    if device != "cpu":
        raise ConfigError(f"--device {device}: expected auto, cuda or cpu")
    return _measure_cpu(resolved, cfg, cluster, steps, alloc_conf)


# ---- CPU: the tracker on real tensors ---------------------------------------------------
def measure_cpu_stats(hf_config: dict[str, Any], cfg: RunConfig, cluster: Cluster | None,
                      steps: int = 2, alloc_conf: str | None = None) -> Any:
    """TraceStats of real CPU tensors: same build, step, emulation and analysis as a trace."""
    import torch

    from ..build import build_model
    from .analysis import analyze, module_peaks
    from .cuda_emulation import CudaEmulation
    from .expansion import stream_of
    from .fake import _wants_eval
    from .hf_step import make_batch
    from .tracked_run import run_tracked

    torch.manual_seed(cfg.training.seed)
    built = build_model(hf_config, cfg, mode="real", device="cpu")
    if built.param_count > CPU_MAX_PARAMS:
        raise ConfigError(
            f"{built.param_count:,} parameters: measuring on CPU is meant for small models "
            f"(≤ {CPU_MAX_PARAMS:,}); run it on a GPU or use `oomless trace`")
    batch = make_batch(built.model, cfg.micro_batch_size, cfg.seq_len, "cpu")
    eval_batch = (make_batch(built.model, cfg.eval_batch_size, cfg.seq_len, "cpu")
                  if _wants_eval(cfg) else None)
    from .fake import _cublas_bytes

    tracker = run_tracked(built.model, cfg, batch, eval_batch, device_type="cpu",
                          num_layers=built.num_layers, iterations=steps,
                          emulation=CudaEmulation(cublas_bytes=_cublas_bytes(cluster)))
    stats = analyze(stream_of(tracker), AllocatorConfig.from_conf(alloc_conf),
                    num_layers=built.num_layers, param_count=built.param_count,
                    trainable_params=built.trainable_params, module_peaks=module_peaks(tracker))
    stats.traced_layers = built.num_layers
    stats.losses = [float(x) for x in tracker.losses]
    return stats


def _measure_cpu(resolved: Any, cfg: RunConfig, cluster: Cluster | None, steps: int,
                 alloc_conf: str | None) -> MemoryEstimate:
    from ...memory.overheads import non_pytorch_bytes
    from .fake import _assumptions

    if resolved.spec.param_count > CPU_MAX_PARAMS:  # before building it for real
        raise ConfigError(
            f"{resolved.spec.name} has {resolved.spec.param_count:,} parameters: measuring on "
            f"CPU is meant for small models (≤ {CPU_MAX_PARAMS:,}); run it on a GPU or use "
            "`oomless trace`")
    started = time.perf_counter()
    stats = measure_cpu_stats(resolved.hf_config, cfg, cluster, steps, alloc_conf)
    totals = stats.phase_peaks
    peak_phase = max(totals, key=totals.__getitem__)
    reserved = max(stats.peak_reserved_bytes, totals[peak_phase])
    non_pt = non_pytorch_bytes(cluster, cfg.world_size)
    notes = ["measured on CPU: the storage tracker on real tensors (no GPU here); "
             "allocated/reserved follow the same CUDA emulation and allocator simulation "
             "as a trace, device memory adds the analytic CUDA context"]
    return MemoryEstimate(
        method="measure", model=resolved.spec.name, param_count=stats.param_count,
        trainable_params=stats.trainable_params, peak_phase=peak_phase,
        peak_allocated_bytes=totals[peak_phase], peak_reserved_bytes=reserved,
        device_peak_bytes=reserved + sum(non_pt.values()), breakdown=stats.breakdown,
        non_pytorch_bytes=non_pt, assumptions=tuple(notes + _assumptions(cfg, [stats], None)),
        config=cfg.to_dict(), gpu=cluster.gpu.name if cluster else None,
        gpu_memory_bytes=cluster.gpu.memory_bytes if cluster else None,
        extra={"device": "cpu", "per_module_peak": stats.module_peaks,
               "timeline": stats.timeline, "allocator": stats.allocator,
               "tensor_peaks": stats.tensor_peaks, "losses": stats.losses,
               "measure_seconds": round(time.perf_counter() - started, 2)},
    )


# ---- GPU: torch.cuda statistics and NVML ------------------------------------------------
def _apply_alloc_conf(conf: str | None) -> None:
    """PYTORCH_CUDA_ALLOC_CONF for this run: the environment before CUDA starts."""
    import torch

    if not conf:
        return
    if torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings(conf)
    else:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf


class NvmlSampler:
    """Device memory used (NVML), this process's if NVML can see it, sampled in a thread.

    Built without touching CUDA: the device is found from CUDA_VISIBLE_DEVICES, so
    the memory used before the CUDA context exists can be read first.
    """

    def __init__(self, cuda_index: int = 0, interval_s: float = 0.005):
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        self.handle = self._handle(cuda_index)
        self.interval_s = interval_s
        self.peak_device_bytes = 0
        self.peak_process_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _handle(self, cuda_index: int) -> Any:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        if not visible:
            return self._nvml.nvmlDeviceGetHandleByIndex(cuda_index)
        entry = visible.split(",")[cuda_index].strip()
        if entry.startswith(("GPU-", "MIG-")):
            return self._nvml.nvmlDeviceGetHandleByUUID(entry)
        return self._nvml.nvmlDeviceGetHandleByIndex(int(entry))

    def device_used(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def total(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self.handle).total)

    def process_used(self) -> int | None:
        """This process's device memory, or None where NVML cannot attribute it
        (containers without the host's PID namespace)."""
        for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
        return None

    def sample(self) -> None:
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_used())
        used = self.process_used()
        if used is not None:
            self.peak_process_bytes = max(self.peak_process_bytes, used)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.interval_s)

    def __enter__(self) -> NvmlSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        self.sample()


def _cuda_context(index: int) -> tuple[NvmlSampler, int, int]:
    """Create the CUDA context and measure it: NVML used after − before − reserved."""
    import torch

    sampler = NvmlSampler(index)
    existed = torch.cuda.is_initialized()
    before = sampler.device_used()  # without a context yet, unless one existed
    torch.cuda.set_device(index)
    torch.empty(1, device="cuda")  # context + first allocation
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    if existed:  # the context predates us: this process's memory minus PyTorch's
        own = sampler.process_used()
        if own is None:
            raise GPUUnavailableError(
                "CUDA was already in use in this process and NVML cannot attribute memory "
                "to it, so the CUDA context cannot be measured; run measure in a fresh process")
        return sampler, sampler.device_used() - own, max(0, own - reserved)
    after = sampler.device_used()
    return sampler, before, max(0, after - before - reserved)


def _measure_gpu(resolved: Any, cfg: RunConfig, cluster: Cluster | None,
                 steps: int) -> MemoryEstimate:
    import torch

    from ..build import build_model
    from .fake import _wants_eval
    from .hf_step import make_batch, run_steps

    sampler, device_before, context_bytes = _cuda_context(0)
    torch.manual_seed(cfg.training.seed)
    built = build_model(resolved.hf_config, cfg, mode="real", device="cuda")
    batch = make_batch(built.model, cfg.micro_batch_size, cfg.seq_len, "cuda")
    eval_batch = (make_batch(built.model, cfg.eval_batch_size, cfg.seq_len, "cuda")
                  if _wants_eval(cfg) else None)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before_step = torch.cuda.memory_allocated()
    phases: dict[str, list[int]] = {}
    current: list[str] = []

    def on_phase(name: str, iteration: int) -> None:
        torch.cuda.synchronize()
        if current:
            _close_phase(phases, current[0])
        current[:] = [name]
        torch.cuda.reset_peak_memory_stats()

    started = time.perf_counter()
    with sampler:
        losses = run_steps(built.model, cfg, batch, device_type="cuda", iterations=steps,
                           on_phase=on_phase, eval_batch=eval_batch)
        torch.cuda.synchronize()
        _close_phase(phases, current[0])
    seconds = time.perf_counter() - started
    return _gpu_result(resolved, cfg, cluster, built, phases, before_step, sampler,
                       device_before, context_bytes, seconds, [float(x) for x in losses])


def _close_phase(phases: dict[str, list[int]], name: str) -> None:
    import torch

    top = phases.setdefault(name, [0, 0])
    top[0] = max(top[0], torch.cuda.max_memory_allocated())
    top[1] = max(top[1], torch.cuda.max_memory_reserved())


def _gpu_result(resolved: Any, cfg: RunConfig, cluster: Cluster | None, built: Any,
                phases: dict[str, list[int]], before_step: int, sampler: NvmlSampler,
                device_before: int, context_bytes: int, seconds: float,
                losses: list[float]) -> MemoryEstimate:
    import torch

    breakdown = {p: {"before_step": before_step, "step": max(0, a - before_step)}
                 for p, (a, _) in phases.items()}
    peak_phase = max(phases, key=lambda p: phases[p][0])
    peak_alloc = phases[peak_phase][0]
    peak_reserved = max(r for _, r in phases.values())
    process_peak = sampler.peak_process_bytes or None
    device_peak = process_peak or max(0, sampler.peak_device_bytes - device_before)
    other = max(0, device_peak - peak_reserved - context_bytes)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return MemoryEstimate(
        method="measure", model=resolved.spec.name, param_count=built.param_count,
        trainable_params=built.trainable_params, peak_phase=peak_phase,
        peak_allocated_bytes=peak_alloc, peak_reserved_bytes=peak_reserved,
        device_peak_bytes=device_peak, breakdown=breakdown,
        non_pytorch_bytes={"cuda_context": context_bytes, "other": other},
        assumptions=(
            f"measured on {props.name}: {len(losses)} steps with random weights; "
            "allocated/reserved from torch.cuda peak statistics per phase, device memory "
            "from NVML sampled every 5 ms (this process where NVML attributes it, else the "
            "device's growth since before the CUDA context)",
        ),
        config=cfg.to_dict(), gpu=cluster.gpu.name if cluster else None,
        gpu_memory_bytes=cluster.gpu.memory_bytes if cluster else sampler.total(),
        extra={"device": "cuda", "gpu_name": props.name,
               "compute_capability": f"{props.major}.{props.minor}",
               "torch": torch.__version__, "cuda": torch.version.cuda,
               "phase_reserved_bytes": {p: r for p, (_, r) in phases.items()},
               "nvml_device_peak_bytes": sampler.peak_device_bytes,
               "nvml_device_before_bytes": device_before,
               "nvml_process_peak_bytes": process_peak,
               "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
               "losses": losses, "step_seconds": round(seconds / max(1, len(losses)), 3)},
    )
