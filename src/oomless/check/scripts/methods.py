"""Method, precision and ZeRO of a script, from its flags by meaning.

LoRA is on when a boolean says so (Qwen/MiniCPM-V ``--use_lora``), when a rank
above 0 turns it on (DeepSpeed-Chat ``--lora_dim``, OpenRLHF ``--lora_rank``,
InternVL ``--use_llm_lora``) or when the tool's mode names it (Firefly
``train_mode``, ms-swift ``--tuner_type``). The base is 4-bit with ``--q_lora``,
``--load_in_4bit`` or ``--quant_bits 4``. DeepSpeed-Chat adds LoRA layers but
trains every weight unless ``--only_optimize_lora`` (its main.py). A mode no
table knows is undecided (check says it cannot tell; --method settles it).
"""

from __future__ import annotations

import re
from typing import Any

from ..sources import Reading, Source, source_from_text
from . import flags as F
from .decide import cannot_tell

_FULL, _LORA, _QLORA = {"full"}, {"lora"}, {"qlora"}
_DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
           "fp32": "fp32", "float32": "fp32", "float": "fp32"}


def _value(s: dict[str, F.Setting], meaning: str) -> Any:
    return s[meaning].value if meaning in s else None


def _targets(s: dict[str, F.Setting], r: Reading) -> Any:
    """The targets as PEFT receives them. A ``lora_targets_regex`` flag is the value
    LoraConfig(target_modules=...) gets (MiniCPM-V's ``lora_target_modules: str``): a
    string stays a string, which check resolves as PEFT does (re.fullmatch on the full
    module names, oomless.check.lora_names). A ``lora_targets`` flag is a list field
    (HfArgumentParser nargs): one word is a list of one name."""
    regex = _value(s, "lora_targets_regex")
    value = _value(s, "lora_targets") if regex is None else regex
    if "lora_targets_prefix" in s and value is None:
        r.assumptions.append(f"LoRA on every linear under '{s['lora_targets_prefix'].value}' "
                             "(DeepSpeed-Chat's lora_module_name): read as all linear layers")
        return "all-linear"
    if value is None or value in ("all-linear", "all", ["all-linear"], ["all"]):
        return "all-linear"
    if isinstance(value, str) and regex is not None:
        return value
    return value if isinstance(value, list) else [value]


def _lora_on(s: dict[str, F.Setting], src: Source, r: Reading) -> tuple[bool, int | None]:
    """(LoRA on, bits of the quantized base or None)."""
    on, bits = bool(_value(s, "lora") is True), None
    enables = _value(s, "lora_rank_enables")
    if isinstance(enables, int) and enables > 0:
        on = True
    mode = s.get("train_mode")
    if mode is not None:
        word = str(mode.value).lower()
        if word in _LORA | _QLORA:
            on, bits = True, (4 if word in _QLORA else None)
        elif word not in _FULL:
            cannot_tell(r, f"{mode.key} {mode.value}", src.where(mode.key),
                        {"topic": "the method", "settles": "--method"})
        else:
            on = False
    if _value(s, "qlora") is True or _value(s, "load_in_4bit") is True:
        bits = 4
    if _value(s, "load_in_8bit") is True:
        bits = 8
    if _value(s, "quant_bits") in (4, 8):
        bits = _value(s, "quant_bits")
    return on, bits


def method_of(s: dict[str, F.Setting], tool: str | None, src: Source,
              r: Reading) -> tuple[str, dict[str, Any]]:
    on, bits = _lora_on(s, src, r)
    extra: dict[str, Any] = {}
    _vision(s, tool, extra)
    rank = _value(s, "lora_rank") or _value(s, "lora_rank_enables")
    if on and tool == "deepspeed-chat" and _value(s, "lora_only") is not True:
        r.assumptions.append(f"{src.where('lora_dim')}: LoRA layers of rank {rank} are added "
                             "but every weight still trains (no --only_optimize_lora, "
                             "DeepSpeed-Chat main.py): estimated as full fine-tuning")
        return "full", extra
    llm_frozen = _value(s, "tune_llm") is False or _value(s, "freeze_llm") is True
    if not on and llm_frozen:
        key = s["tune_llm"].key if "tune_llm" in s else s["freeze_llm"].key
        r.assumptions.append(f"{src.where(key)}: the language model is frozen and only the "
                             "vision side trains: estimated as LoRA rank 8 on the language "
                             "model (a frozen 16-bit base, a backward through every "
                             "activation)")
        extra["lora"] = {"r": 8, "alpha": 16, "dropout": 0.0, "targets": "all-linear"}
        r.fixed.add("lora")
        return "lora", extra
    if not on:
        return "full", extra
    extra["lora"] = {"r": int(rank) if isinstance(rank, int) and rank > 0 else 8,
                     "alpha": _value(s, "lora_alpha") or 16,
                     "dropout": float(_value(s, "lora_dropout") or 0.0),
                     "targets": _targets(s, r)}
    if bits:
        method_q = _value(s, "quant_method")
        extra["quantization"] = {"bits": bits, "type": "nf4", "double_quant": True}
        if tool == "qwen-finetune":
            r.assumptions.append("Qwen finetune.py --q_lora loads the GPTQ Int4 checkpoint "
                                 "(GPTQConfig(bits=4, disable_exllama=True)): sized as 4-bit "
                                 "weights like bitsandbytes nf4")
        elif method_q not in (None, "bnb"):
            r.assumptions.append(f"quant_method {method_q}: a pre-quantized {bits}-bit base, "
                                 "sized as bitsandbytes {bits}-bit weights")
        return "qlora", extra
    return "lora", extra


def saved_modules(name: str, method: str, tool: str | None, s: dict[str, F.Setting],
                  r: Reading) -> None:
    """Qwen finetune.py trains the embedding and the output layer (PEFT modules_to_save
    ["wte", "lm_head"]) when LoRA runs on a model whose name has no 'chat' (its README:
    "LoRA (emb)"). A tool whose row names the modules_to_save its code passes to LoraConfig
    (``lora_modules_to_save``: always, and those a true flag adds) records them in
    ``facts["modules_to_save"]``: check decides against the model's parts what they are
    (oomless.check.assemble)."""
    saved = (F.TOOLS[tool].get("lora_modules_to_save") if tool else None) or {}
    if method in ("lora", "qlora") and saved:
        names, added_by = list(saved["always"]), {}
        for flag, more in saved.get("when_true", {}).items():
            if any(x.key == flag and x.value is True for x in s.values()):
                names += more
                added_by |= dict.fromkeys(more, flag)
        r.facts["modules_to_save"] = {"names": names, "added_by": added_by,
                                      "who": F.TOOLS[tool]["label"]}
    given = s.get("lora_modules_to_save")
    if method in ("lora", "qlora") and given is not None and given.value:
        value, who = given.value, F.TOOLS[tool]["label"] if tool else "the script"
        r.facts["modules_to_save"] = {
            "names": [str(v) for v in (value if isinstance(value, list) else [value])],
            "added_by": {}, "who": f"{who} --{given.key}"}
    if tool == "qwen-finetune" and method == "lora" and "chat" not in name.lower():
        # QwenLM/Qwen finetune.py train(): modules_to_save = None if q_lora or is_chat_model
        # else ["wte", "lm_head"] (is_chat_model: 'chat' in the model name)
        r.facts["modules_to_save"] = {"names": ["wte", "lm_head"], "added_by": {},
                                      "who": f"Qwen finetune.py (for '{name}', no 'chat' in "
                                             "its name)"}


def _vision(s: dict[str, F.Setting], tool: str | None, extra: dict[str, Any]) -> None:
    vision = {}
    if "tune_vision" in s:
        vision["freeze_tower"] = s["tune_vision"].value is not True
    elif "freeze_vision" in s:
        vision["freeze_tower"] = s["freeze_vision"].value is True
    if "freeze_projector" in s:
        vision["freeze_projector"] = s["freeze_projector"].value is True
    if vision:
        extra["vision"] = vision


# Read, said in the assumptions, not (yet) in the estimate
_UNMODELLED = ("vision_lora_rank", "image_slices", "image_size")


def unmodelled(s: dict[str, F.Setting], src: Source, r: Reading) -> None:
    for meaning in _UNMODELLED:
        if meaning in s and s[meaning].value not in (0, None, False):
            got = s[meaning]
            where = src.where(got.key) if not got.default else "the tool's default"
            r.assumptions.append(f"{where}: {got.key} {got.value} ({F.MEANINGS[meaning]}) is "
                                 "read but the estimator does not model it yet")


def precision_of(s: dict[str, F.Setting], method: str, r: Reading) -> str:
    loaded = _value(s, "load_dtype")
    if isinstance(loaded, str) and _DTYPES.get(loaded.lower()) in ("bf16", "fp16"):
        if method == "full" and _DTYPES[loaded.lower()] == "bf16":
            r.assumptions.append(f"{s['load_dtype'].key} {loaded} with full fine-tuning: the "
                                 "Trainer trains the weights in the dtype they are loaded in "
                                 "(AdamW states bf16, no fp32 master copy): pure bf16")
            return "pure-bf16"
        return _DTYPES[loaded.lower()]
    name = _value(s, "dtype")
    if isinstance(name, str) and name.lower() in _DTYPES:
        return _DTYPES[name.lower()]
    if _value(s, "bf16") is True:
        return "bf16"
    return "fp16" if _value(s, "fp16") is True else "fp32"


def zero_of(s: dict[str, F.Setting], tool: str | None, src: Source,
            r: Reading) -> tuple[int, str]:
    """ZeRO stage and offload: a DeepSpeed JSON (or ms-swift's zero2/zero3 names), or the
    stage and offload flags of the tool."""
    from ..dsfiles import deepspeed_source, read_deepspeed

    ds = _value(s, "deepspeed")
    if isinstance(ds, str):
        m = re.fullmatch(r"zero([0-3])(_offload)?", ds)
        if m:
            stage = int(m.group(1))
            return stage, ("none" if not m.group(2) else "all" if stage == 3 else "optimizer")
        shell = src.command.shell if src.command else None
        written = shell.files.get(ds) if shell else None
        if written is not None:
            ds_src = source_from_text(src.path.parent / ds, "deepspeed", written)
            r.notes.append(f"{ds}: the DeepSpeed JSON the script writes (heredoc)")
            return read_deepspeed(ds_src, r)
        _src, zero = deepspeed_source(ds, src.path, {}, r)
        return zero
    stage = _value(s, "zero_stage")
    if not isinstance(stage, int):
        return 0, "none"
    if _value(s, "offload_all") is True:
        return stage, "all" if stage == 3 else "optimizer"
    if _value(s, "offload_optimizer") is True:
        return stage, "optimizer"
    return stage, "none"
