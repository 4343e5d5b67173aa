"""Run-configuration options shared by estimate, trace and measure."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, get_args

from ..config import Offload, Precision, QuantStorage, Reference, Stack, Stage
from ..knobs import ATTENTIONS, METHODS, OPTIMIZERS
from ..limits import CAPS

# Counts and sizes above this are typing mistakes, not runs (2^40: a trillion).
MAX_NUMBER = 2**40


def count(low: int = 1, high: int = MAX_NUMBER, why: str = ""):
    """An argparse type: an integer in [low, high]; anything else is a usage error (exit 2).
    ``why``: the reason for ``high`` (limits.CAPS), said when a value exceeds it."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not low <= value <= high:
            upper = f"to {high:,}" if high < MAX_NUMBER else "or more"
            reason = (f" ({why})" if why else " (at most 2^40)") if value > high else ""
            raise argparse.ArgumentTypeError(f"expected a whole number {low} {upper}, "
                                             f"got {value:,}{reason}")
        return value

    parse.__name__ = "count"
    return parse


def number(low: float = 0.0, high: float = MAX_NUMBER, low_open: bool = False,
           high_open: bool = False, why: str = ""):
    """An argparse type: a finite number in the range (open ends excluded)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        too_low = value <= low if low_open else value < low
        too_high = value >= high if high_open else value > high
        if value != value or too_low or too_high:  # NaN fails every comparison
            lo, hi = "(" if low_open else "[", ")" if high_open else "]"
            top = f"{high:.15g}" if high < MAX_NUMBER else "2^40"
            reason = f" ({why})" if why and too_high else ""
            raise argparse.ArgumentTypeError(f"expected a finite number in {lo}{low:g}, {top}{hi},"
                                             f" got {text}{reason}")
        return value

    parse.__name__ = "number"
    return parse


def lengths_list(text: str) -> list[int]:
    """An argparse type: token lengths, as samples (180,420,768: each equally frequent)
    or as percentiles of the data (p50=180,p90=420,max=768: 1000 samples, each as long
    as the next percentile given, an upper bound of its length)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        if any("=" in p for p in parts):
            return _percentile_samples(parts)
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected token lengths such as 180,420,768 or percentiles such as "
            f"p50=180,p90=420,max=768, got {text!r}")
    return values


def _percentile_samples(parts: list[str]) -> list[int]:
    points = []
    for part in parts:
        key, _, value = part.partition("=")
        key = key.strip().lower()
        q = 100.0 if key == "max" else float(key.removeprefix("p"))
        if not key.startswith("p") and key != "max" or not 0 < q <= 100 or int(value) < 1:
            raise ValueError(part)
        points.append((q, int(value)))
    points.sort()
    if points[-1][0] != 100 or any(b[1] < a[1] for a, b in zip(points, points[1:], strict=False)):
        raise ValueError("the percentiles must end with max and grow")
    out, done = [], 0
    for q, length in points:
        count = round(q * 10) - done  # per mille
        out += [length] * count
        done += count
    return out


def add_run_sim_options(p: argparse.ArgumentParser, check: bool = False) -> None:
    """A run over variable-length data through the caching-allocator model (``check``:
    the command has its own --data, and the run is replayed only with --steps)."""
    from ..planner.runsim import DEFAULT_STEPS, ORDERS

    g = p.add_argument_group(
        "a run, not a step: variable-length batches through PyTorch's caching allocator "
        "(traces the step at three lengths)")
    if not check:
        src = g.add_mutually_exclusive_group()
        src.add_argument("--data", metavar="FILE", help="the training file (.json/.jsonl/"
                         ".parquet): its samples' token lengths drive the steps")
        src.add_argument("--lengths", type=lengths_list, metavar="L1,L2,…",
                         help="sample lengths instead of a file: 180,420,768 (each equally "
                              "frequent) or percentiles p50=180,p90=420,max=768")
    g.add_argument("--steps", type=count(1, 100_000), default=None if check else DEFAULT_STEPS,
                   help="with --data: replay this many optimizer steps" if check else
                   f"optimizer steps to replay ({DEFAULT_STEPS})")
    g.add_argument("--order", choices=list(ORDERS), default="random",
                   help="the loader's order: random shuffle (HF default), group_by_length, "
                        "sorted (shortest first), packing")
    g.add_argument("--seed", type=int, default=42, help="the loader's shuffle seed (42)")
    g.add_argument("--alloc-conf", metavar="CONF",
                   help="PYTORCH_CUDA_ALLOC_CONF of the run, e.g. max_split_size_mb:256 "
                        "(default: the environment's)")
    g.add_argument("--empty-cache-steps", type=count(1), metavar="N", default=0,
                   help="the loop calls torch.cuda.empty_cache() every N steps "
                        "(transformers' torch_empty_cache_steps)")


def run_alloc_conf(args: argparse.Namespace) -> str | None:
    """The run's PYTORCH_CUDA_ALLOC_CONF: --alloc-conf, else the environment's, plus
    --expandable-segments where the command has it."""
    import os

    conf = args.alloc_conf if args.alloc_conf is not None else os.environ.get(
        "PYTORCH_CUDA_ALLOC_CONF")
    if getattr(args, "expandable_segments", False):
        conf = ",".join(filter(None, [conf, "expandable_segments:True"]))
    return conf


POSITIVE = count(1)
NON_NEGATIVE = count(0)
GIB = number(0.0, MAX_NUMBER, low_open=True)  # a memory size in GiB, > 0
FRACTION = number(0.0, 1.0, high_open=True)  # [0, 1)
UTILIZATION = number(0.0, 1.0, low_open=True)  # (0, 1]


def capped(key: str, low: int = 1):
    """count() up to the cap of ``key`` in limits.CAPS, the cap RunConfig validates."""
    return count(low, CAPS[key].high, CAPS[key].why)


def capped_gib(key: str):
    """A size in GB, > 0, up to the cap of ``key`` in limits.CAPS."""
    return number(0.0, CAPS[key].high, low_open=True, why=CAPS[key].why)


def text_arg(what: str):
    """An argparse type: text that is not empty or blank (``--out ''`` names no folder,
    ``--gpu ''`` no GPU: refused rather than read as "not given")."""
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"empty; give {what}")
        return text

    parse.__name__ = "text"
    return parse


GPU_TEXT = text_arg("a GPU and count (--gpu 4090, --gpu 'a100-80gb x8', --gpu 24gb)")
FOLDER = text_arg("a folder to write to")
FILE = text_arg("a file to write to")


def lora_targets(text: str) -> list[str] | str:
    """--lora-targets: comma-separated module names, or all-linear."""
    from ..errors import ConfigError

    targets = [t.strip() for t in text.split(",") if t.strip()]
    if not targets:
        raise ConfigError(f"--lora-targets {text!r} names no module; give module names "
                          "(q_proj,v_proj) or all-linear")
    return "all-linear" if targets == ["all-linear"] else targets


# flag → dotted RunConfig key
_FLAG_KEYS = {
    "method": "method", "precision": "precision", "optim": "optimizer",
    "batch_size": "micro_batch_size", "grad_accum": "grad_accum", "seq_len": "seq_len",
    "grad_ckpt": "grad_ckpt", "attn": "attn", "lora_r": "lora.r",
    "lora_dropout": "lora.dropout", "zero": "zero", "offload": "offload",
    "nodes": "hardware.nodes", "host_ram_gb": "hardware.host_ram_gb",
    "eval_batch_size": "eval.batch_size", "max_new_tokens": "eval.max_new_tokens",
    "images": "data.images_per_sample", "stack": "stack",
    "transformers_version": "stack_options.transformers_version",
    "stack_version": "stack_options.stack_version", "quant_storage": "quantization.storage",
    "stage": "stage", "image_size": "vision.image_size",
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
    g.add_argument("--quant-storage", choices=list(get_args(QuantStorage)),
                   help="bnb_4bit_quant_storage (default bfloat16 under ZeRO-3, else uint8)")
    g.add_argument("--batch-size", type=capped("micro_batch_size"), help="micro batch per GPU")
    g.add_argument("--grad-accum", type=capped("grad_accum"))
    g.add_argument("--seq-len", type=capped("seq_len"), help="tokens per sample")
    g.add_argument("--grad-ckpt", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--attn", choices=list(ATTENTIONS))
    g.add_argument("--lora-r", type=capped("lora.r"))
    g.add_argument("--lora-dropout", type=FRACTION)
    g.add_argument("--lora-targets", help="comma-separated module names, or all-linear")
    g.add_argument("--zero", type=int, choices=[0, 1, 2, 3], help="DeepSpeed ZeRO stage")
    g.add_argument("--offload", choices=list(get_args(Offload)))
    g.add_argument("--gpu", type=GPU_TEXT, help="GPU and count: 4090x8, 'a100-40gb x8' (see `oomless gpus`), "
                   "or a size: 12gb, 24GiB x2")
    g.add_argument("--gpu-memory-gb", type=capped_gib("gpu_memory_gb"), metavar="GB",
                   help="a generic GPU with this much memory (GB = 10^9 bytes); same as --gpu 12gb")
    g.add_argument("--nodes", type=capped("hardware.nodes"))
    g.add_argument("--host-ram-gb", type=capped_gib("hardware.host_ram_gb"),
                   help="host RAM per node (offload)")
    g.add_argument("--eval-batch-size", type=capped("eval.batch_size"))
    g.add_argument("--max-new-tokens", type=capped("eval.max_new_tokens", 0),
                   help="generation during evaluation")
    g.add_argument("--images", type=capped("data.images_per_sample", 0),
                   help="images per sample (vision-language models)")
    g.add_argument("--image-size", type=capped("vision.image_size"),
                   help="side of an input image in pixels")
    g.add_argument("--max-pixels", type=capped("vision.max_pixels"),
                   help="Qwen2-VL family: largest image area")
    g.add_argument("--freeze-tower", action=argparse.BooleanOptionalAction, default=None,
                   help="vision tower frozen (default) or trained")
    g.add_argument("--stage", choices=list(get_args(Stage)), help="training stage (sft)")
    g.add_argument("--reference", choices=list(get_args(Reference)),
                   help="dpo/kto/ppo reference model (auto)")
    g.add_argument("--expandable-segments", action="store_true",
                   help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    add_stack_options(g)


def add_vllm_parallel_options(g: Any) -> None:
    """vLLM's own parallel flags (vllm serve --help), per engine."""
    g.add_argument("--tensor-parallel-size", type=POSITIVE, default=1,
                   help="vLLM: GPUs one layer is split over (weights and KV heads per GPU)")
    g.add_argument("--pipeline-parallel-size", type=POSITIVE, default=1,
                   help="vLLM: pipeline stages (layers split over GPUs)")
    g.add_argument("--data-parallel-size", type=POSITIVE, default=1,
                   help="vLLM: engine replicas (each TP × PP GPUs)")


def add_stack_options(g: Any) -> None:
    """--stack and the versions that select its loss and LoRA paths (docs/stacks.md)."""
    g.add_argument("--stack", choices=list(get_args(Stack)),
                   help="the software that runs the step (default hf-trainer; docs/stacks.md)")
    g.add_argument("--transformers-version", metavar="X.Y",
                   help="transformers release of the run (default: the installed one)")
    g.add_argument("--stack-version", metavar="X.Y",
                   help="release of the stack's own package, e.g. trl (default: installed); "
                   "with --inference --engine vllm, the vLLM release whose KV sizing applies")


def _is_run_file(text: str) -> bool:
    return text.endswith((".yaml", ".yml")) and Path(text).is_file()


def run_config_from_args(args: argparse.Namespace):
    """RunConfig from an optional YAML plus the flags the user gave."""
    from ..config import build_run_config, load_yaml_with_lines, set_dotted
    from ..errors import ConfigError
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
    if args.lora_targets is not None:
        set_dotted(data, "lora.targets", lora_targets(args.lora_targets))
    if args.quant:
        method = (data.get("method") or "lora") if isinstance(data, dict) else None
        if method != "qlora":
            raise ConfigError(
                f"--quant {args.quant} quantizes the frozen base of a QLoRA run; the method is "
                f"{method}, whose base is not quantized: add --method qlora, or drop --quant")
        set_dotted(data, "quantization.bits", 8 if args.quant == "int8" else 4)
        if args.quant != "int8":
            set_dotted(data, "quantization.type", args.quant)
    gpu_arg = args.gpu
    if getattr(args, "gpu_memory_gb", None) is not None:
        if args.gpu:
            raise ConfigError(
                f"--gpu {args.gpu} and --gpu-memory-gb {args.gpu_memory_gb:g} both name the GPU; give "
                f"one: --gpu-memory-gb {args.gpu_memory_gb:g}, or --gpu {args.gpu_memory_gb:g}gbx2 for two")
        gpu_arg = f"{args.gpu_memory_gb:g}gb"
    if gpu_arg is not None:  # an empty text is refused by parse_gpu_arg, not skipped
        cluster = parse_gpu_arg(gpu_arg)
        set_dotted(data, "hardware.gpu", cluster.gpu.name)
        set_dotted(data, "hardware.gpus_per_node", cluster.gpus_per_node)
    return build_run_config(data, source, lines)



def inference_options(args: argparse.Namespace):
    """oomless.api.InferenceOptions from `estimate --inference`'s parsed flags."""
    from dataclasses import fields

    from ..api import InferenceOptions

    return InferenceOptions(**{f.name: getattr(args, f.name) for f in fields(InferenceOptions)})
