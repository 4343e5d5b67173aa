"""Run-configuration options shared by estimate, trace and measure."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, get_args

from ..config import Offload, Precision, Reference, Stage
from ..knobs import ATTENTIONS, METHODS, OPTIMIZERS

# flag → dotted RunConfig key
_FLAG_KEYS = {
    "method": "method", "precision": "precision", "optim": "optimizer",
    "batch_size": "micro_batch_size", "grad_accum": "grad_accum", "seq_len": "seq_len",
    "grad_ckpt": "grad_ckpt", "attn": "attn", "lora_r": "lora.r",
    "lora_dropout": "lora.dropout", "zero": "zero", "offload": "offload",
    "nodes": "hardware.nodes", "host_ram_gb": "hardware.host_ram_gb",
    "eval_batch_size": "eval.batch_size", "max_new_tokens": "eval.max_new_tokens",
    "images": "data.images_per_sample", "stage": "stage", "image_size": "vision.image_size",
    "max_pixels": "vision.max_pixels", "freeze_tower": "vision.freeze_tower",
    "reference": "rlhf.reference",
}


def add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL|CONFIG.yaml",
                   help="catalog name (see `oomless models`), HF id in the local cache, "
                   "a config.json or model folder, or an oomless.yaml run configuration")
    g = p.add_argument_group("run options (override the YAML's values)")
    g.add_argument("--method", choices=list(METHODS))
    g.add_argument("--precision", choices=list(get_args(Precision)))
    g.add_argument("--optim", choices=list(OPTIMIZERS))
    g.add_argument("--quant", choices=["nf4", "fp4", "int8"], help="QLoRA quantization (nf4)")
    g.add_argument("--batch-size", type=int, help="micro batch per GPU")
    g.add_argument("--grad-accum", type=int)
    g.add_argument("--seq-len", type=int, help="tokens per sample")
    g.add_argument("--grad-ckpt", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--attn", choices=list(ATTENTIONS))
    g.add_argument("--lora-r", type=int)
    g.add_argument("--lora-dropout", type=float)
    g.add_argument("--lora-targets", help="comma-separated module names, or all-linear")
    g.add_argument("--zero", type=int, choices=[0, 1, 2, 3], help="DeepSpeed ZeRO stage")
    g.add_argument("--offload", choices=list(get_args(Offload)))
    g.add_argument("--gpu", help="GPU and count: 4090x8, 'a100-40gb x8' (see `oomless gpus`)")
    g.add_argument("--nodes", type=int)
    g.add_argument("--host-ram-gb", type=float, help="host RAM per node (offload)")
    g.add_argument("--eval-batch-size", type=int)
    g.add_argument("--max-new-tokens", type=int, help="generation during evaluation")
    g.add_argument("--images", type=int, help="images per sample (vision-language models)")
    g.add_argument("--image-size", type=int, help="side of an input image in pixels")
    g.add_argument("--max-pixels", type=int, help="Qwen2-VL family: largest image area")
    g.add_argument("--freeze-tower", action=argparse.BooleanOptionalAction, default=None,
                   help="vision tower frozen (default) or trained")
    g.add_argument("--stage", choices=list(get_args(Stage)), help="training stage (sft)")
    g.add_argument("--reference", choices=list(get_args(Reference)),
                   help="dpo/kto/ppo reference model (auto)")
    g.add_argument("--expandable-segments", action="store_true",
                   help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")


def _is_run_file(text: str) -> bool:
    return text.endswith((".yaml", ".yml")) and Path(text).is_file()


def run_config_from_args(args: argparse.Namespace):
    """RunConfig from an optional YAML plus the flags the user gave."""
    from ..config import build_run_config, load_yaml_with_lines, set_dotted
    from ..models.hardware import parse_gpu_arg

    data: dict[str, Any]
    lines: dict[str, int] = {}
    source = "<options>"
    if _is_run_file(args.model):
        data, lines = load_yaml_with_lines(args.model)
        source = args.model
    else:
        data = {"model": args.model}
    for flag, key in _FLAG_KEYS.items():
        value = getattr(args, flag, None)
        if value is not None:
            set_dotted(data, key, value)
    if args.lora_targets:
        targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
        set_dotted(data, "lora.targets", "all-linear" if targets == ["all-linear"] else targets)
    if args.quant:
        set_dotted(data, "quantization.bits", 8 if args.quant == "int8" else 4)
        if args.quant != "int8":
            set_dotted(data, "quantization.type", args.quant)
    if args.gpu:
        cluster = parse_gpu_arg(args.gpu)
        set_dotted(data, "hardware.gpu", cluster.gpu.name)
        set_dotted(data, "hardware.gpus_per_node", cluster.gpus_per_node)
    return build_run_config(data, source, lines)

