"""The page's requests as `oomless` command lines, read by the CLI's own parser.

Every result of the page comes with the command that gives it in a terminal; the
page's values are turned into that command's words, and those words are parsed by
the very parser `oomless` uses (cli/). So the page refuses exactly what the CLI
refuses, with the same message, and the copied command is the one that ran.
"""

from __future__ import annotations

import argparse
import shlex
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import ConfigError

# Page key → (option, kind) of `oomless estimate` (cli/_options.py), in the order shown.
ESTIMATE_OPTIONS: dict[str, tuple[str, type]] = {
    "method": ("--method", str), "quant": ("--quant", str), "precision": ("--precision", str),
    "optim": ("--optim", str), "batch_size": ("--batch-size", int),
    "grad_accum": ("--grad-accum", int), "seq_len": ("--seq-len", int),
    "grad_ckpt": ("--grad-ckpt", bool), "attn": ("--attn", str), "lora_r": ("--lora-r", int),
    "lora_dropout": ("--lora-dropout", float), "lora_targets": ("--lora-targets", str),
    "zero": ("--zero", int), "offload": ("--offload", str), "nodes": ("--nodes", int),
    "host_ram_gb": ("--host-ram-gb", float), "eval_batch_size": ("--eval-batch-size", int),
    "max_new_tokens": ("--max-new-tokens", int), "images": ("--images", int),
    "stage": ("--stage", str), "stack": ("--stack", str),
}
# `oomless plan`: the page's keys (cli/plan.py).
PLAN_OPTIONS: dict[str, tuple[str, type]] = {
    "seq_len": ("--seq-len", int), "effective_batch": ("--effective-batch", int),
    "method": ("--method", str), "headroom": ("--headroom", float),
    "objective": ("--objective", str), "top": ("--top", int), "lora_r": ("--lora-r", int),
    "host_ram_gb": ("--host-ram-gb", float), "images": ("--images", int),
    "max_new_tokens": ("--max-new-tokens", int), "stack": ("--stack", str),
}
# `oomless estimate --inference`: the keys of the Inference tab (cli/estimate.py).
INFERENCE_OPTIONS: dict[str, tuple[str, type]] = {
    "engine": ("--engine", str), "batch_size": ("--batch-size", int),
    "seq_len": ("--seq-len", int), "max_new_tokens": ("--max-new-tokens", int),
    "max_model_len": ("--max-model-len", int), "max_num_seqs": ("--max-num-seqs", int),
    "gpu_memory_utilization": ("--gpu-memory-utilization", float),
    "kv_cache_dtype": ("--kv-cache-dtype", str),
}
COMMANDS = {"estimate": ESTIMATE_OPTIONS, "plan": PLAN_OPTIONS, "inference": INFERENCE_OPTIONS}


def _value(key: str, value: Any, kind: type) -> str:
    if isinstance(value, (list, dict)) or (isinstance(value, bool) and kind is not bool):
        raise ConfigError(f"'{key}': expected {'a number' if kind in (int, float) else 'text'},"
                          f" got {type(value).__name__}")
    if isinstance(value, float) and value.is_integer() and kind is int and abs(value) < 2**53:
        return str(int(value))
    return str(value)


def option_words(request: dict[str, Any], kind_of: str) -> list[str]:
    """The options the page's values stand for (the model and --gpu excluded)."""
    words: list[str] = []
    for key, (option, kind) in COMMANDS[kind_of].items():
        value = request.get(key)
        if value is None or value == "":
            continue
        if kind is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"'{key}': expected true or false, got {value!r}")
            words.append(option if value else "--no-" + option[2:])
        else:
            words.append(f"{option}={_value(key, value, kind)}")
    if kind_of == "inference":
        words.insert(0, "--inference")
        if request.get("method"):  # the adapter vLLM serves LoRA slots for
            words += [f"--method={_value('method', request['method'], str)}"]
            if request.get("lora_r"):
                words += [f"--lora-r={_value('lora_r', request['lora_r'], int)}"]
    return words


def gpu_words(request: dict[str, Any]) -> list[str]:
    gpu = request.get("gpu")
    if not gpu:
        return []
    count = request.get("gpus") or 1
    count_text = _value("gpus", count, int)
    return [f"--gpu={_value('gpu', gpu, str)}" + (f" x{count_text}" if count_text != "1" else "")]


def command_words(request: dict[str, Any], kind_of: str, model: str) -> list[str]:
    """`oomless …` words after the command name: options, --gpu, then the model."""
    return [*option_words(request, kind_of), *gpu_words(request), "--", model]


def command_line(request: dict[str, Any], kind_of: str, shown_model: str) -> str:
    """The command a user types for this result (an uploaded model: ./config.json)."""
    command = "estimate" if kind_of == "inference" else kind_of
    words = command_words(request, kind_of, shown_model)
    words.remove("--")
    return " ".join(shlex.quote(w) for w in ["oomless", command, *words])


@lru_cache(maxsize=1)
def _parsers() -> dict[str, argparse.ArgumentParser]:
    from ..cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found = {}
    for name in ("estimate", "plan"):
        found[name] = sub.choices[name]

        def error(message: str, _name: str = name) -> None:
            raise ConfigError(f"{message} (as `oomless {_name}` says)")

        found[name].error = error  # type: ignore[method-assign]
    return found


def parse(request: dict[str, Any], kind_of: str, model: str,
          uploaded: bool = False) -> argparse.Namespace:
    """The namespace `oomless` builds from this request's command line; ``uploaded``:
    ``model`` is the page's uploaded config.json (any other path is refused)."""
    if not uploaded and Path(model).expanduser().exists():
        raise ConfigError(f"model '{model}' is a path on the server: the page reads catalog "
                          "models, model ids in the local Hugging Face cache, or an uploaded "
                          "config.json")
    command = "estimate" if kind_of == "inference" else kind_of
    return _parsers()[command].parse_args(command_words(request, kind_of, model))
