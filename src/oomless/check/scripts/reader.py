"""A launch script read as a RunConfig: the command's launcher, the framework it starts
and its flags by meaning (oomless.check.scripts.flags).

``llamafactory-cli train X.yaml`` and ``axolotl train X.yml`` are read through the
YAML they name (looked up in the working directory, next to the script, then in
its parent folders), with the GPU count of the launch. LLaVA and MoE-LLaVA keep
their own reader (oomless.check.readers_hf). Every other program is read by the
meaning of its flags, over the defaults of the tool recognised (DeepSpeed-Chat,
OpenRLHF, Qwen, MiniCPM-V, InternVL, Firefly, ms-swift) or of transformers'
TrainingArguments. What the reading cannot decide is said as "can't tell", with
the oomless option that settles it (oomless.check.scripts.decide).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from ...errors import ConfigError
from .. import foreign_keys as K
from ..common import (
    hf_eval,
    optimizer,
    pre_quantized_note,
    training_args_fsdp,
    transformers_release,
)
from ..readers_hf import read_launch as read_llava
from ..sources import Reading, Source, knob_set, load_source
from . import flags as F
from .decide import cannot_tell, gpu_count
from .edits import literal_in_script, writable_knobs
from .edits import script_edits as script_edits  # re-exported: oomless.check.reading
from .launchers import find_file
from .methods import method_of, precision_of, saved_modules, unmodelled, zero_of

TRAINING_ARGUMENTS_BATCH = 8  # TrainingArguments.per_device_train_batch_size default
# LLaMA-Factory's entry scripts (src/train_bash.py in 0.5-0.6, src/train.py after)
LF_PROGRAMS = ("train_bash.py", "train.py")


def _is_llava(src: Source) -> bool:
    script = src.command.script
    return "llava" in script or "moe_enable" in src.data or any(
        k in src.data for k in ("mm_projector_type", "vision_tower", "lora_enable"))


def read_script(src: Source, model: str | None) -> Reading:
    """The reading of a launch script (see the module docstring)."""
    launch = src.command.launch
    if launch.launcher.startswith(("llamafactory-cli", "lmf", "axolotl")) or (
            launch.kind == "module" and launch.program.startswith("axolotl.cli.train")):
        return _delegate(src, model)
    if PurePosixPath(launch.program).name in LF_PROGRAMS:  # LLaMA-Factory's own scripts
        if any(str(w.value).endswith((".yaml", ".yml")) for w in launch.args[:1]):
            return _delegate(src, model)
        if {"stage", "finetuning_type"} & set(src.data):
            return _lf_command_line(src, model)
    if launch.launcher == "tune run":
        from .torchtune import read_tune_launch

        return read_tune_launch(src, model)
    if _is_llava(src):
        reading = read_llava(src, model)
        gpu_count(src, reading)
        return reading
    return read_by_meaning(src, model)


def _lf_command_line(src: Source, model: str | None) -> Reading:
    """LLaMA-Factory arguments on the command line (``python src/train_bash.py --stage sft
    --finetuning_type lora ...`` of 0.5-0.6, ``llamafactory-cli train --stage sft ...`` of
    the newer examples: read_args parses them with HfArgumentParser when no YAML is given):
    its YAML reader on the flags; a fix
    changes only the batch, checkpointing and the evaluation batch (flags taking a value)."""
    from ..readers_lf import read_llamafactory

    reading = read_llamafactory(src, model)
    reading.label = "LLaMA-Factory command line"
    reading.fixed |= knob_set("grad_ckpt", "eval_batch")
    gpu_count(src, reading)
    return reading


def _delegate(src: Source, model: str | None) -> Reading:
    from ..readers_axolotl import read_axolotl
    from ..readers_lf import read_llamafactory

    launch = src.command.launch
    names = [w.value for w in launch.args if isinstance(w.value, str)]
    ref = next((n for n in names if n.endswith((".yaml", ".yml", ".json"))), None)
    if ref is None and launch.launcher.startswith(("llamafactory-cli", "lmf")) and {
            "stage", "finetuning_type"} & set(src.data):
        return _lf_command_line(src, model)  # its HfArgumentParser reads the flags too
    if ref is None:
        raise ConfigError(f"{src.path}:{launch.command.line}: `{launch.launcher}` without a "
                          "configuration file; check the YAML it should name")
    found = find_file(ref, src.path)
    if found is None:
        raise ConfigError(f"{src.path}:{launch.command.line}: '{ref}' not found (looked in the "
                          f"working directory, next to {src.path.name} and in its parent "
                          "folders); check the YAML directly: oomless check FILE.yaml")
    yaml_src = load_source(found, "main")
    axolotl = "axolotl" in launch.launcher or "axolotl" in launch.program
    reading = (read_axolotl if axolotl else read_llamafactory)(yaml_src, model)
    reading.notes.append(f"{src.path}:{launch.command.line}: `{launch.launcher}` runs "
                         f"{found}: read from there")
    overrides = [n for n in names if "=" in n and not n.startswith("-")]
    for item in overrides:
        key = item.split("=", 1)[0]
        if F.memory_word(key):
            cannot_tell(reading, f"the override {item}", f"{src.path}:{launch.command.line}",
                        F.memory_word(key))
    gpu_count(src, reading)
    return reading


def _unknown_keys(src: Source, tool: str | None) -> dict[str, str]:
    known = F.flags_of(tool) | K.keys_of(*K.TRAINING_ARGUMENTS) | set(
        F.TOOLS[tool]["defaults"] if tool else ()) | set(F.TOOLS[tool].get("known", ())
                                                         if tool else ())
    if tool is None or not F.TOOLS[tool].get("known"):  # no argument classes of its own
        known |= F.flags_of(None)
    return {k: src.where(k) for k in src.data if k not in known}


def read_python_script(src: Source, model: str | None) -> Reading:
    """A Python training script read with ast (oomless.check.scripts.pyscript): its
    literal arguments by meaning; no fix is written into Python code."""
    r = read_by_meaning(src, model, "python-script")
    for key, line in src.undecided.items():
        word = F.memory_word(key) or ({"topic": F.MEANINGS[F.meaning_of(key, None)],
                                       "settles": _settles(key, None)}
                                      if F.meaning_of(key, None) else None)
        if word:
            cannot_tell(r, f"{key}= (not a literal)", f"{src.path}:{line}", word)
    if "unsloth" in src.text:
        r.run["stack"] = "unsloth"
    r.fixed |= knob_set()
    r.facts["batch_not_in_file"] = True
    r.notes.append("fixes are not written into Python code: change the arguments by hand")
    return r


def read_json_by_meaning(src: Source, model: str | None) -> Reading | None:
    """A TrainingArguments JSON of a tool the table knows (Firefly's train_args), or None."""
    tool = F.detect_tool_by_marks(set(src.data))
    return read_by_meaning(src, model, tool) if tool else None


def read_by_meaning(src: Source, model: str | None, json_tool: str | None = None) -> Reading:
    launch = src.command.launch if src.command else None
    a = src.data
    tool = F.detect_tool(launch.program, set(a)) if launch else json_tool
    program = launch.program if launch else src.path.name
    label = F.TOOLS[tool]["label"] if tool else f"{program} (TrainingArguments flags)"
    what = "launch script" if launch else (
        "training script" if src.fmt == "py" else "arguments file")
    r = Reading("python" if src.fmt == "py" else "launch", f"{what}: {label}", {"main": src}, {})
    r.facts["script_tool"] = tool
    unknown = _unknown_keys(src, tool)
    for key, where in unknown.items():
        r.warnings.append(f"{where}: unknown flag '--{key}': not a flag of {label} nor of "
                          "transformers TrainingArguments")
    for item in F.undecided(unknown):
        cannot_tell(r, f"unknown flag --{item['key']}", item["where"], item)
    for key, arg in (src.command.args.items() if launch else ()):
        if arg.unknown is not None and F.meaning_of(key, tool) is not None:
            word = {"topic": F.MEANINGS[F.meaning_of(key, tool)], "settles": _settles(key, tool)}
            cannot_tell(r, f"--{key} {arg.unknown.describe()}", src.where(key), word)
    s = F.settings(a, tool)
    run = _run(s, tool, src, model, r)
    r.run = run
    sharded = None if run.get("zero") else training_args_fsdp(a, src.where, transformers_release())
    if sharded:  # TrainingArguments' own --fsdp (Stanford Alpaca's "full_shard auto_wrap")
        run.update(sharded[0])
        r.assumptions.extend(sharded[1])
    if launch:
        gpu_count(src, r)
        _environment(src, tool, s, r)
        accelerate_config(src, r)
    if "image_max_pixels" in s and isinstance(s["image_max_pixels"].value, int):
        r.facts["image_max_pixels"] = s["image_max_pixels"].value
    _batch(s, run, r)
    r.fixed |= knob_set(*writable_knobs(s, tool, src))
    if sharded:
        r.fixed.add("zero")  # a fix never adds DeepSpeed next to the script's FSDP
    if tool and F.TOOLS[tool].get("bare_flags"):  # a bare flag is added, never removed
        r.facts["may_not_express"] = {"zero", "offload", "grad_ckpt"}
    for meaning in ("micro_batch", "grad_accum"):
        if meaning in s and not literal_in_script(src, s[meaning].key):
            r.facts["batch_not_in_file"] = True
            r.notes.append(f"{src.where(s[meaning].key)}: --{s[meaning].key} is computed by the "
                           "script: a fix never writes over it; it edits the literals the "
                           "script computes from, and proposes only a batch the script's own "
                           "arithmetic then gives")
    return r


def accelerate_config(src: Source, r: Reading) -> None:
    """``accelerate launch --config_file X.yaml``: the accelerate config the script names,
    read as check reads it as a second file (readers_trl.apply_accelerate: processes,
    mixed precision, the DeepSpeed or FSDP plugin); a fix of the sharding edits it. The
    launcher's own ``--num_processes`` wins over the file's, as in accelerate."""
    launch = src.command.launch
    if launch.launcher != "accelerate launch":
        return
    word = launch.launcher_args.get("config_file") or launch.launcher_args.get("config-file")
    if word is None:
        return
    where = f"{src.path}:{launch.command.line}"
    if not isinstance(word.value, str):
        cannot_tell(r, f"--config_file {word.value.describe()}", where,
                    {"topic": "the accelerate config (GPU count, sharding)",
                     "settles": "checking the script with its accelerate config as a second "
                                "file"})
        return
    found = find_file(word.value, src.path)
    if found is None:
        raise ConfigError(f"{where}: the accelerate config '{word.value}' is not in the "
                          "working directory, next to the script or in its parent folders: "
                          "run check from the repository root, or give the config as a second "
                          "file")
    from ..readers_trl import apply_accelerate

    count = (r.run.get("hardware") or {}).get("gpus_per_node") if isinstance(
        launch.gpus, int) else None
    apply_accelerate(load_source(str(found), "accelerate"), r)
    if count:
        r.run["hardware"]["gpus_per_node"] = count
    r.notes.append(f"{where}: the accelerate config {found} (processes, mixed precision, "
                   "sharding)")


def _environment(src: Source, tool: str | None, s: dict[str, F.Setting], r: Reading) -> None:
    """Settings a tool reads from environment variables the script sets (ms-swift's
    MAX_PIXELS) join the flags."""
    launch = src.command.launch
    for name, row in (F.TOOLS[tool].get("env", {}) if tool else {}).items():
        value = launch.env(name, src.command.shell)
        if isinstance(value, str) and value.strip().isdigit():
            s[row["meaning"]] = F.Setting(row["meaning"], name, int(value), False)
            r.notes.append(f"{name}={value} (environment of the command): "
                           f"{F.MEANINGS[row['meaning']]}")


def _settles(key: str, tool: str | None) -> str:
    meaning = F.meaning_of(key, tool) or ""
    if meaning == "model":
        return "--model"
    if meaning == "seq_len":
        return "--seq-len"
    return "--method" if "lora" in meaning or meaning in (
        "qlora", "train_mode", "load_in_4bit", "quant_bits") else "a literal value in the script"


def _run(s: dict[str, F.Setting], tool: str | None, src: Source, model: str | None,
         r: Reading) -> dict[str, Any]:
    name = model or (s["model"].value if "model" in s and not s["model"].default else None)
    if not name:
        raise ConfigError(f"{src.path}: the script does not name the model (no "
                          "--model_name_or_path or the tool's own flag): pass --model")
    pre_quantized_note(str(name), r)
    method, extra = method_of(s, tool, src, r)
    saved_modules(str(name), method, tool, s, r)
    unmodelled(s, src, r)
    zero, offload = zero_of(s, tool, src, r)
    length = s.get("seq_len")
    if length is None or not isinstance(length.value, int):
        cannot_tell(r, "the sequence length", str(src.path), {
            "topic": "the sequence length", "settles": "--seq-len"})
    elif length.default:
        r.notes.append(f"{length.key} not set: {length.value} tokens, the default of "
                       f"{F.TOOLS[tool]['label']} ({F.TOOLS[tool]['source'].split(' ; ')[0]})")
    ckpt = s.get("grad_ckpt")
    attn = s.get("flash_attn") or s.get("attn_implementation")
    flash = bool(attn and (attn.value is True or "flash" in str(attn.value)))
    micro = s["micro_batch"].value if "micro_batch" in s else TRAINING_ARGUMENTS_BATCH
    run: dict[str, Any] = {
        "model": str(name), "method": method, "stage": _stage(tool, src, r),
        "stack": (F.TOOLS[tool]["stack"] if tool else "hf-trainer"),
        "precision": precision_of(s, method, r), "micro_batch_size": micro,
        "grad_accum": s["grad_accum"].value if "grad_accum" in s else 1,
        "seq_len": length.value if length is not None and isinstance(length.value, int)
        else 2048, "grad_ckpt": bool(ckpt and ckpt.value is True),
        "attn": "flash" if flash else "sdpa", "zero": zero, "offload": offload,
        "optimizer": optimizer(str(src.data.get("optim", "adamw_torch")), src.where("optim"), r),
        "eval": hf_eval(src.data, micro, None) if tool in (None, "qwen-finetune") else {},
        **extra,
    }
    if s.get("packing") and s["packing"].value is True:
        run["data"] = {**run.get("data", {}), "packing": True}
    if s.get("compile") and s["compile"].value is True:  # TrainingArguments.torch_compile
        run["stack_options"] = {"compile": True}
        r.assumptions.append(f"{src.where(s['compile'].key)}: torch.compile: the layers' saved "
                             "tensors from the min-cut partitioner's trace, the loss eager")
    return run


def _stage(tool: str | None, src: Source, r: Reading) -> str:
    """The training stage: the tool's table maps its entry points (OpenRLHF's
    openrlhf.cli.train_rm / train_dpo / train_kto); an entry point it does not map is not
    read as SFT: check cannot tell."""
    stages = F.TOOLS[tool].get("stages") if tool else None
    program = src.command.launch.program if src.command else ""
    if not stages:
        return "sft"
    if program in stages:
        return stages[program]
    cannot_tell(r, f"the module {program}", str(src.path), {
        "topic": "the training stage",
        "settles": "a module whose stage oomless models (" + ", ".join(sorted(stages)) + ")"})
    return "sft"


def _batch(s: dict[str, F.Setting], run: dict[str, Any], r: Reading) -> None:
    """A global batch (OpenRLHF's train_batch_size) gives the accumulation steps."""
    total = s.get("global_batch")
    gpus = (run.get("hardware") or {}).get("gpus_per_node")
    if total is None or not isinstance(total.value, int):
        return
    r.facts["global_batch"] = total.value  # accumulation = global / (micro × GPUs)
    if gpus:
        run["grad_accum"] = max(1, total.value // (run["micro_batch_size"] * gpus))
    r.facts["batch_not_in_file"] = True  # the accumulation is computed, not written
