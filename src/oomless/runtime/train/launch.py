"""Several GPUs: ``oomless train`` starts itself once per GPU through ``accelerate launch``.

The run folder gets the files the launch uses, each valid for its tool:
``accelerate.yaml`` (accelerate's config file: processes, machines, the
distributed type) and, for ZeRO, ``deepspeed.json`` (the stage and offload
of the plan, no "auto" values). Every process then runs ``python -m oomless
train CONFIG`` with WORLD_SIZE/RANK/LOCAL_RANK set by accelerate, joins the
process group (NCCL) and drives the engine (oomless.runtime.train.engines).
Multi-node: run the same command on every node with ``--machine-rank`` and
``--main-process-ip`` (the run folder must be on a shared file system).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from ...config import RunConfig
from ...errors import ConfigError
from ...fileio import write_atomic


def distributed_type(cfg: RunConfig) -> str:
    if cfg.training.engine == "fsdp":
        return "FSDP"
    if cfg.zero > 0 or cfg.training.engine == "deepspeed":
        return "DEEPSPEED"
    return "MULTI_GPU"


def accelerate_config(cfg: RunConfig, deepspeed_file: Path | None, machine_rank: int = 0,
                      main_ip: str | None = None, main_port: int = 29500) -> dict[str, Any]:
    """accelerate's config-file keys (accelerate/commands/config/config_args.py ClusterConfig)."""
    h = cfg.hardware
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": distributed_type(cfg),
        "num_machines": h.nodes,
        "num_processes": cfg.world_size,  # all processes, every machine together
        "machine_rank": machine_rank,
        "main_training_function": "main",
        "mixed_precision": "no",  # oomless sets precision itself (autocast / DeepSpeed json)
        "use_cpu": False,
        "rdzv_backend": "static",
        "same_network": True,
    }
    if h.nodes > 1:
        if not main_ip:
            raise ConfigError(f"hardware.nodes is {h.nodes}: pass --main-process-ip (the address "
                              "of machine rank 0) and --machine-rank on every node")
        out.update(main_process_ip=main_ip, main_process_port=main_port)
    if deepspeed_file is not None:
        out["deepspeed_config"] = {"deepspeed_config_file": str(deepspeed_file),
                                   "zero3_init_flag": cfg.zero == 3}
    if out["distributed_type"] == "FSDP":
        out["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": cfg.zero != 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_offload_params": cfg.offload == "all",
            "fsdp_activation_checkpointing": cfg.grad_ckpt,
        }
    return out


def write_launch_files(cfg: RunConfig, run_dir: Path, machine_rank: int = 0,
                       main_ip: str | None = None, main_port: int = 29500) -> Path:
    """accelerate.yaml (+ deepspeed.json) in the run folder; returns the accelerate file."""
    from .engines import deepspeed_config

    run_dir.mkdir(parents=True, exist_ok=True)
    ds_file = None
    if distributed_type(cfg) == "DEEPSPEED":
        ds_file = run_dir / "deepspeed.json"
        _atomic_write(ds_file, json.dumps(deepspeed_config(cfg, cfg.world_size), indent=2))
    acc = accelerate_config(cfg, ds_file, machine_rank, main_ip, main_port)
    acc_file = run_dir / "accelerate.yaml"
    _atomic_write(acc_file, yaml.safe_dump(acc, sort_keys=False))
    return acc_file


def _atomic_write(path: Path, text: str) -> None:
    write_atomic(path, text + ("" if text.endswith("\n") else "\n"))


def launch_command(config_file: str, acc_file: Path, args: Any) -> list[str]:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(acc_file),
           "-m", "oomless", "train", str(config_file)]
    for flag in ("resume", "start_over", "auto_fit", "no_progress"):
        if getattr(args, flag, False):
            cmd.append("--" + flag.replace("_", "-"))
    if getattr(args, "output_dir", None):
        cmd += ["--output-dir", args.output_dir]
    return cmd


def launch(cfg: RunConfig, args: Any) -> int:
    """Write the launch files and run ``accelerate launch`` (or print it with --dry-run)."""
    from .run_folder import RunFolder

    run_dir = Path(cfg.training.output_dir)
    RunFolder(run_dir).check_free()  # never rewrite the launch files of a training run
    acc_file = write_launch_files(cfg, run_dir, getattr(args, "machine_rank", 0) or 0,
                                  getattr(args, "main_process_ip", None),
                                  getattr(args, "main_process_port", 29500) or 29500)
    cmd = launch_command(args.config, acc_file, args)
    print("launching:", shlex.join(cmd), flush=True)
    if getattr(args, "dry_run", False):
        return 0
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(cmd, env=env, check=False).returncode
