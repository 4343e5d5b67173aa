"""A Python training script (Unsloth, plain transformers / PEFT / TRL) read with ``ast``,
never executed.

The literal keyword arguments of the calls that decide memory are collected as the
script's "flags": ``from_pretrained`` (the model, ``load_in_4bit``, ``max_seq_length``,
``dtype``), ``BitsAndBytesConfig``, ``get_peft_model`` / ``LoraConfig`` (LoRA on, rank,
targets, Unsloth's ``use_gradient_checkpointing``), ``TrainingArguments`` and TRL's
``*Config`` and ``*Trainer``. A name is followed to its module-level literal
assignment (``max_seq_length = 2048``). A memory setting whose value is not a
literal is undecided (check says it cannot tell), except Unsloth's
``is_bfloat16_supported()``, which is bf16 where the card has it.
"""

from __future__ import annotations

import ast
from pathlib import PurePosixPath
from typing import Any

from ...errors import ConfigError

_ARGS_CLASSES = ("TrainingArguments", "Seq2SeqTrainingArguments")
_UNDECIDED = object()
# Keyword arguments read from each call (by the call's last name)
_MODEL_KEYS = {"load_in_4bit": "load_in_4bit", "load_in_8bit": "load_in_8bit",
               "max_seq_length": "max_seq_length", "dtype": "torch_dtype",
               "torch_dtype": "torch_dtype", "attn_implementation": "attn_implementation"}
_LORA_KEYS = {"r": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
              "target_modules": "lora_target_modules", "modules_to_save": "modules_to_save",
              "use_gradient_checkpointing": "gradient_checkpointing"}
_TRAINER_KEYS = {"max_seq_length": "max_seq_length", "max_length": "max_length",
                 "packing": "packing"}


def _name(func: ast.AST) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


class _Reader:
    def __init__(self, tree: ast.Module) -> None:
        self.literals: dict[str, Any] = {}
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                    node.targets[0], ast.Name):
                value = self.value(node.value)
                if value is not _UNDECIDED:
                    self.literals[node.targets[0].id] = value
        self.data: dict[str, Any] = {}
        self.lines: dict[str, int] = {}
        self.undecided: dict[str, int] = {}

    def value(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Name) and node.id in getattr(self, "literals", {}):
            return self.literals[node.id]
        if isinstance(node, ast.Call) and _name(node.func) == "is_bfloat16_supported":
            return "auto-bf16"
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) and isinstance(
                node.operand, ast.Call) and _name(node.operand.func) == "is_bfloat16_supported":
            return "auto-not-bf16"
        try:
            return ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return _UNDECIDED

    def put(self, key: str, node: ast.AST, line: int) -> None:
        got = self.value(node)
        if got is _UNDECIDED:
            self.undecided[key] = line
            return
        self.data[key], self.lines[key] = got, line

    def call(self, node: ast.Call) -> None:
        name = _name(node.func)
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        if name == "from_pretrained" and not self.data.get("model_name_or_path"):
            first = node.args[0] if node.args else kw.get("model_name",
                                                           kw.get("pretrained_model_name_or_path"))
            if first is not None:
                self.put("model_name_or_path", first, node.lineno)
            self._keys(kw, _MODEL_KEYS)
        elif name == "BitsAndBytesConfig":
            self._keys(kw, {"load_in_4bit": "load_in_4bit", "load_in_8bit": "load_in_8bit"})
        elif name in ("get_peft_model", "LoraConfig"):
            self.data["use_lora"], self.lines["use_lora"] = True, node.lineno
            self._keys(kw, _LORA_KEYS)
        elif name in _ARGS_CLASSES or (name.endswith("Config") and name[:-6] in (
                "SFT", "DPO", "ORPO", "KTO", "CPO", "GRPO", "Reward", "PPO")):
            for key, value in kw.items():
                self.put(key, value, value.lineno)
        elif name.endswith("Trainer"):
            self._keys(kw, _TRAINER_KEYS)

    def _keys(self, kw: dict[str, ast.AST], keys: dict[str, str]) -> None:
        for arg, key in keys.items():
            if arg in kw:
                self.put(key, kw[arg], kw[arg].lineno)


def read_python(text: str, path: str) -> tuple[dict[str, Any], dict[str, int], dict[str, int]]:
    """(flags, their lines, memory settings whose values are not literals)."""
    try:
        tree = ast.parse(text, filename=path)
    except SyntaxError as err:
        raise ConfigError(f"'{path}' is not valid Python (line {err.lineno}): {err.msg}") from None
    reader = _Reader(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            reader.call(node)
    data = reader.data
    if data.get("gradient_checkpointing") == "unsloth":
        data["gradient_checkpointing"] = True  # Unsloth's offloaded checkpointing
    for key in ("bf16", "fp16"):
        if data.get(key) in ("auto-bf16", "auto-not-bf16"):
            data[key] = (data[key] == "auto-bf16") == (key == "bf16")
    if data.get("torch_dtype", "") is None:
        data.pop("torch_dtype")  # Unsloth: None picks bf16 where the card has it
        data.setdefault("bf16", True)
    reader.undecided.pop("model_name_or_path", None)  # no literal model: check asks --model
    return data, reader.lines, reader.undecided


def is_python(path: str) -> bool:
    return PurePosixPath(path).suffix == ".py"
