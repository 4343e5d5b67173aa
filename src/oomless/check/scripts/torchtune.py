"""torchtune: ``tune run <recipe> --config <yaml>`` and its YAML, read through the
``_component_`` names: the model builder (``torchtune.models.llama3_1.qlora_llama3_1_8b``
is QLoRA of Llama-3.1-8B; data/script_flags.json maps each builder to the catalog
model of the same shapes), the LoRA arguments of the builder, the optimizer class,
``batch_size``, ``gradient_accumulation_steps``, ``enable_activation_checkpointing``,
``dtype`` and the tokenizer's ``max_seq_len`` (``null``: the length is the data's,
check cannot tell it without --seq-len). Distributed recipes shard with FSDP. The run is
estimated with the torchtune stack (oomless.memory.stacks.stack_effects), its switches
read from the recipe's keys (data/script_flags.json ``stack_keys``: ``compile``,
``optimizer_in_bwd``, ``enable_activation_offloading``).
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from ...config import RunConfig
from ...errors import ConfigError
from ..common import knob_edits
from ..sources import Reading, Source, knob_set, load_source
from .decide import cannot_tell

TABLE: dict[str, Any] = json.loads(resources.files("oomless.data").joinpath(
    "script_flags.json").read_text(encoding="utf-8"))["torchtune"]
KEYS = {"micro": "batch_size", "accum": "gradient_accumulation_steps",
        "grad_ckpt": "enable_activation_checkpointing"}


def is_torchtune(data: dict[str, Any]) -> bool:
    model = data.get("model")
    return isinstance(model, dict) and "_component_" in model


def _builder(component: str, src: Source, model: str | None) -> tuple[str, str | None]:
    """(method, catalog model) of a model builder."""
    name = component.rsplit(".", 1)[-1]
    method = "qlora" if name.startswith("qlora_") else "lora" if name.startswith(
        "lora_") else "full"
    base = name.split("_", 1)[1] if method != "full" else name
    return method, model or TABLE["models"].get(base)


def _lora(m: dict[str, Any]) -> dict[str, Any]:
    targets = [TABLE["lora_modules"].get(t, t) for t in m.get("lora_attn_modules", [])]
    if m.get("apply_lora_to_mlp"):
        targets += TABLE["mlp_modules"]
    return {"r": m.get("lora_rank", 8), "alpha": m.get("lora_alpha", 16),
            "dropout": float(m.get("lora_dropout", 0.0)), "targets": targets or "all-linear"}


def read_torchtune(src: Source, model: str | None, recipe: str | None = None) -> Reading:
    d = src.data
    r = Reading("torchtune", "torchtune config" + (f" ({recipe})" if recipe else ""),
                {"main": src}, {})
    component = str(d["model"]["_component_"])
    method, name = _builder(component, src, model)
    if name is None:
        raise ConfigError(f"{src.where('model._component_')}: torchtune builder '{component}' "
                          "has no catalog model of the same shapes here: pass --model")
    length = (d.get("tokenizer") or {}).get("max_seq_len")
    if not isinstance(length, int):
        cannot_tell(r, f"tokenizer.max_seq_len {length}", src.where("tokenizer"),
                    {"topic": "the sequence length", "settles": "--seq-len"})
    opt = str((d.get("optimizer") or {}).get("_component_", "torch.optim.AdamW"))
    if opt not in TABLE["optimizers"]:
        r.assumptions.append(f"optimizer {opt}: estimated as AdamW (fp32 states)")
    distributed = bool(recipe and "distributed" in recipe)
    pure = d.get("dtype", "bf16") == "bf16" and method == "full" and not distributed
    r.run = {
        "model": name, "method": method, "stage": "sft", "stack": "torchtune",
        "precision": "pure-bf16" if pure else ("fp32" if d.get("dtype") == "fp32" else "bf16"),
        "optimizer": TABLE["optimizers"].get(opt, "adamw"),
        "micro_batch_size": d.get("batch_size", 1),
        "grad_accum": d.get("gradient_accumulation_steps", 1),
        "seq_len": length if isinstance(length, int) else 2048,
        "grad_ckpt": bool(d.get("enable_activation_checkpointing")),
        "zero": 3 if distributed else 0,
        "offload": "all" if distributed and d.get("fsdp_cpu_offload") else "none",
        "data": {"packing": bool((d.get("dataset") or {}).get("packed"))},
    }
    if method != "full":
        r.run["lora"] = _lora(d["model"])
    if method == "qlora":
        r.run["quantization"] = {"bits": 4, "type": "nf4", "double_quant": False}
    r.notes.append(f"{src.where('model._component_')}: {component}: {method} of {name}")
    r.run["stack_options"] = {}
    for key, (option, why) in TABLE["stack_keys"].items():
        if d.get(key) is True:
            r.run["stack_options"][option] = True
            r.assumptions.append(f"{src.where(key)}: {key}: {why}")
    r.fixed |= knob_set("grad_ckpt")
    return r


def read_tune_launch(src: Source, model: str | None) -> Reading:
    from .decide import gpu_count
    from .launchers import find_file

    launch = src.command.launch
    ref = src.command.args.get("config")
    name = ref.values[0] if ref is not None and ref.values else ""
    found = find_file(name, src.path) or find_file(name + ".yaml", src.path)
    if found is None:
        raise ConfigError(f"{src.path}:{launch.command.line}: `tune run {launch.program} "
                          f"--config {name}`: no such file here (a built-in config: copy it "
                          "with `tune cp` and check the copy)")
    reading = read_torchtune(load_source(found, "main"), model, launch.program)
    reading.notes.append(f"{src.path}:{launch.command.line}: `tune run {launch.program}` "
                         f"runs {found}: read from there")
    gpu_count(src, reading)
    return reading


def torchtune_edits(cfg: RunConfig, old: RunConfig, reading: Reading,
                    model_type: str) -> list[tuple[str, tuple, Any]]:
    out: list[tuple[str, tuple, Any]] = []
    knob_edits(cfg, old, lambda key, value: out.append(("main", (key,), value)), KEYS)
    return out
