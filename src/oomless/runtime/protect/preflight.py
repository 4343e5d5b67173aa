"""The preflight of a protected Trainer: its run as a RunConfig, estimated before step 1.

What the Trainer says is read from the Trainer itself: the model's config
path (``config._name_or_path``), PEFT LoRA settings, 4-bit loading (QLoRA),
TrainingArguments precision, optimizer, batches, checkpointing, DeepSpeed
ZeRO stage, and accelerate's FSDP plugin (:func:`fsdp_from_plugin`). The sequence length is TRL's ``max_length`` when set, else the
longest of the first 512 training samples (a sample of the data: the longest
sample overall may be longer, which the estimate's assumptions say).
"""

from __future__ import annotations

from typing import Any

from ...config import RunConfig
from ...errors import OomlessError
from ...knobs import optimizer_from_hf
from ...units import fmt_bytes

SAMPLES_SCANNED = 512
DEFAULT_SEQ_LEN = 2048


def _seq_len(trainer: Any) -> tuple[int, str]:
    length = getattr(trainer.args, "max_length", None)
    if isinstance(length, int) and length > 0:
        return length, "max_length"
    data = trainer.train_dataset
    try:
        n = min(len(data), SAMPLES_SCANNED)
        longest = max(len(data[i]["input_ids"]) for i in range(n))
    except (TypeError, KeyError, IndexError, ValueError):
        return DEFAULT_SEQ_LEN, f"not readable from the data: {DEFAULT_SEQ_LEN} assumed"
    return longest, f"longest of the first {n} training samples"


def _lora(model: Any) -> dict[str, Any] | None:
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    pc = next(iter(configs.values()))
    targets = getattr(pc, "target_modules", None)
    if isinstance(targets, str):
        targets = "all-linear" if targets == "all-linear" else [targets]
    return {"r": int(getattr(pc, "r", 8)), "alpha": float(getattr(pc, "lora_alpha", 16)),
            "dropout": float(getattr(pc, "lora_dropout", 0.0)),
            "targets": sorted(targets) if isinstance(targets, (set, list)) else "all-linear"}


def _zero(args: Any) -> tuple[int, str]:
    ds = getattr(args, "hf_deepspeed_config", None)
    config = getattr(ds, "config", None)
    if not isinstance(config, dict):
        return 0, "none"
    from ...check.dsfiles import zero_from_deepspeed

    return zero_from_deepspeed(config, "TrainingArguments.deepspeed")


# torch ShardingStrategy names (FSDP1) → the ZeRO stage oomless shards as
_FSDP_STAGE = {"FULL_SHARD": 3, "HYBRID_SHARD": 3, "SHARD_GRAD_OP": 2,
               "_HYBRID_SHARD_ZERO2": 2, "NO_SHARD": 0}


def fsdp_from_plugin(plugin: Any) -> tuple[int, str, dict[str, Any]]:
    """(stage, offload, the run's ``fsdp`` section) of accelerate's live
    FullyShardedDataParallelPlugin (accelerate 1.15 utils/dataclasses.py: FSDP1 keeps a
    ShardingStrategy in ``sharding_strategy`` and a CPUOffload; FSDP2 a bool
    ``reshard_after_forward`` and an OffloadPolicy, CPUOffloadPolicy when offloading)."""
    version = int(getattr(plugin, "fsdp_version", 1) or 1)
    offload_policy = getattr(plugin, "cpu_offload", None)
    if version == 2:
        stage = 3 if getattr(plugin, "reshard_after_forward", True) else 2
        offloads = type(offload_policy).__name__ == "CPUOffloadPolicy"
        return stage, "all" if offloads and stage == 3 else "none", {"version": 2}
    strategy = getattr(getattr(plugin, "sharding_strategy", None), "name", "FULL_SHARD")
    stage = _FSDP_STAGE.get(strategy, 3)
    offloads = bool(getattr(offload_policy, "offload_params", False))
    prefetch = getattr(plugin, "backward_prefetch", None)
    return stage, "all" if offloads and stage == 3 else "none", {
        "version": 1, "limit_all_gathers": bool(plugin.limit_all_gathers),
        "backward_prefetch": getattr(prefetch, "name", "NO_PREFETCH"),
        "forward_prefetch": bool(plugin.forward_prefetch),
        "use_orig_params": bool(plugin.use_orig_params)}


def _sharding(trainer: Any) -> tuple[int, str, dict[str, Any] | None]:
    """ZeRO stage, offload and FSDP section: DeepSpeed's config, or accelerate's FSDP plugin."""
    plugin = getattr(getattr(getattr(trainer, "accelerator", None), "state", None),
                     "fsdp_plugin", None)
    if getattr(trainer, "is_fsdp_enabled", False) and plugin is not None:
        return fsdp_from_plugin(plugin)
    return (*_zero(trainer.args), None)


def trainer_run_config(trainer: Any, gpu: str | None = None) -> tuple[RunConfig, list[str]]:
    """The Trainer's run as a RunConfig, and notes on what was assumed."""
    import torch

    args, model = trainer.args, trainer.model
    lora = _lora(model)
    base = model.get_base_model() if lora and hasattr(model, "get_base_model") else model
    name = getattr(base.config, "_name_or_path", "") or getattr(base, "name_or_path", "")
    qlora = bool(getattr(base, "is_loaded_in_4bit", False))
    precision = ("bf16" if args.bf16 else "fp16" if args.fp16 else
                 "pure-bf16" if base.dtype == torch.bfloat16 else "fp32")
    zero, offload, fsdp = _sharding(trainer)
    if zero and precision == "pure-bf16":
        precision = "bf16"
    if qlora and precision == "fp32":
        precision = "bf16"
    seq_len, seq_note = _seq_len(trainer)
    optim = getattr(args.optim, "value", str(args.optim))
    run: dict[str, Any] = {
        "model": str(name), "method": "qlora" if qlora else ("lora" if lora else "full"),
        "precision": precision, "optimizer": optimizer_from_hf(optim) or "adamw",
        "micro_batch_size": args.per_device_train_batch_size,
        "grad_accum": args.gradient_accumulation_steps, "seq_len": seq_len,
        "grad_ckpt": bool(args.gradient_checkpointing
                          or getattr(base, "is_gradient_checkpointing", False)),
        "zero": zero, "offload": offload,
        "hardware": {"gpu": gpu, "gpus_per_node": max(1, args.world_size)},
    }
    if lora:
        run["lora"] = lora
    if fsdp:
        run["fsdp"] = fsdp
    if str(getattr(args.eval_strategy, "value", args.eval_strategy)) != "no":
        run["eval"] = {"batch_size": args.per_device_eval_batch_size}
    notes = [f"sequence length {seq_len}: {seq_note}"]
    if not optimizer_from_hf(optim):
        notes.append(f"optim '{optim}' estimated as AdamW")
    return RunConfig.model_validate(run), notes


def run_preflight(ctx: Any, mode: str, gpu: str | None) -> None:
    """Estimate the run; an event says what was found; ``refuse`` stops a run that won't fit."""
    from ...fileio import write_json_atomic
    from ..train.preflight import PreflightError, detect_cluster

    if mode == "off":
        return
    try:
        cfg, notes = trainer_run_config(ctx.trainer, gpu)
        cluster = detect_cluster(cfg)
        if cluster is None:
            ctx.event("preflight", "no GPU present or named (protect(..., gpu=NAME)): memory "
                      "not checked before training", checked=False)
            return
        from ...api import estimate

        est = estimate(cfg, model=cfg.model, cluster=cluster)
    except (OomlessError, ValueError) as err:
        ctx.event("preflight", f"memory not checked: {err}", checked=False)
        return
    ctx.predicted_peak_bytes = est.peak_allocated_bytes
    if ctx.dist.is_main:
        write_json_atomic(ctx.run_dir / "estimate.json", est.to_dict())
    verdict = (f"fits on {cluster.describe()}: predicted {fmt_bytes(est.device_peak_bytes)} of "
               f"{fmt_bytes(est.gpu_memory_bytes)}" if est.fits else
               f"predicted OUT OF MEMORY on {cluster.describe()}: the {est.peak_phase} phase "
               f"needs {fmt_bytes(est.device_peak_bytes)} of {fmt_bytes(est.gpu_memory_bytes)}")
    ctx.event("preflight", verdict, checked=True, fits=est.fits, notes=notes,
              predicted_peak_bytes=est.peak_allocated_bytes,
              device_peak_bytes=est.device_peak_bytes, gpu_memory_bytes=est.gpu_memory_bytes)
    if not est.fits:
        advice = ("; the recovery will cut micro batches as needed, or run `oomless check` on "
                  "your configuration for a setting that fits")
        if mode == "refuse":
            raise PreflightError(verdict + " (preflight='refuse': stopped before step 1)" + advice)
        import warnings

        warnings.warn("oomless: " + verdict + advice, stacklevel=2)
