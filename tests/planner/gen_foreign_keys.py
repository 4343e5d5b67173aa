"""Regenerate src/oomless/planner/foreign_keys.py (not a test; run by hand).

    pip download llamafactory==0.9.5 --no-deps -d /tmp/lf
    .venv/bin/python tests/planner/gen_foreign_keys.py /tmp/lf/llamafactory-0.9.5-py3-none-any.whl

LLaMA-Factory cannot be installed next to this project's pins (it requires
transformers <= 5.6, peft <= 0.18.1, accelerate <= 1.11), so its argument
dataclasses are read as data: the field names and Literal/enum choices are
taken from the wheel's source with ``ast``, without importing it. The Hugging
Face TrainingArguments and PEFT LoraConfig fields come from the installed
packages (tests/planner/test_check.py checks they still match).
"""

from __future__ import annotations

import ast
import dataclasses
import sys
import zipfile
from pathlib import Path

LF_MODULES = ("model_args", "data_args", "training_args", "finetuning_args", "generating_args")
LF_ENUMS = ("AttentionFunction", "QuantizationMethod")
OUT = Path(__file__).resolve().parents[2] / "src" / "oomless" / "planner" / "foreign_keys.py"


def _literal(node: ast.AST) -> list | None:
    if isinstance(node, ast.Subscript) and getattr(node.value, "id", "") == "Literal":
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return [e.value for e in elts if isinstance(e, ast.Constant)]
    if isinstance(node, ast.BinOp):  # Literal[...] | None
        return _literal(node.left) or _literal(node.right)
    return None


def lf_fields(wheel: str) -> tuple[list[str], dict[str, list]]:
    names: set[str] = set()
    choices: dict[str, list] = {}
    enums: dict[str, list] = {}
    with zipfile.ZipFile(wheel) as zf:
        consts = ast.parse(zf.read("llamafactory/extras/constants.py"))
        for node in consts.body:
            if isinstance(node, ast.ClassDef) and node.name in LF_ENUMS:
                enums[node.name] = [s.value.value for s in node.body
                                    if isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant)]
        for mod in LF_MODULES:
            tree = ast.parse(zf.read(f"llamafactory/hparams/{mod}.py"))
            for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
                for stmt in cls.body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                        name = stmt.target.id
                        if name.startswith("_"):
                            continue
                        names.add(name)
                        lit = _literal(stmt.annotation)
                        ann = getattr(stmt.annotation, "id", None)
                        if lit:
                            choices[name] = lit
                        elif ann in enums:
                            choices[name] = enums[ann]
    return sorted(names), dict(sorted(choices.items()))


def hf_fields() -> tuple[list[str], list[str]]:
    from transformers import Seq2SeqTrainingArguments, TrainingArguments

    base = sorted(f.name for f in dataclasses.fields(TrainingArguments) if f.init)
    extra = sorted({f.name for f in dataclasses.fields(Seq2SeqTrainingArguments) if f.init}
                   - set(base))
    return base, extra


def lora_fields() -> list[str]:
    from peft import LoraConfig

    return sorted(f.name for f in dataclasses.fields(LoraConfig) if f.init)


def deepspeed_zero_fields() -> list[str]:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    names = set()
    for name, f in DeepSpeedZeroConfig.model_fields.items():
        names.add(name)
        if f.alias:
            names.add(f.alias)
    return sorted(names)


def _fmt(name: str, values: list[str]) -> str:
    body = "".join(f"    {v!r},\n" for v in values)
    return f"{name} = frozenset({{\n{body}}})\n"


def main(wheel: str) -> None:
    import deepspeed
    import peft
    import transformers

    lf, choices = lf_fields(wheel)
    ta, s2s = hf_fields()
    text = (
        '"""Argument names of the tools `oomless check` reads (generated; do not edit).\n\n'
        "Regenerate with tests/planner/gen_foreign_keys.py. Sources:\n"
        f"- LLaMA-Factory 0.9.5 argument dataclasses ({', '.join(LF_MODULES)}), read\n"
        "  from the wheel's source (it does not install beside this project's pins)\n"
        f"- transformers {transformers.__version__} TrainingArguments / Seq2SeqTrainingArguments\n"
        f"- peft {peft.__version__} LoraConfig\n"
        f"- deepspeed {deepspeed.__version__} DeepSpeedZeroConfig (fields and aliases; extra keys forbidden)\n"
        '"""\n\n'
        "# ruff: noqa: E501\n\n"
        + _fmt("LLAMAFACTORY_KEYS", lf) + "\n"
        + "LLAMAFACTORY_CHOICES = " + repr(choices) + "\n\n"
        + _fmt("TRAINING_ARGUMENTS_KEYS", ta) + "\n"
        + _fmt("SEQ2SEQ_EXTRA_KEYS", s2s) + "\n"
        + _fmt("PEFT_LORA_KEYS", lora_fields()) + "\n"
        + _fmt("DEEPSPEED_ZERO_KEYS", deepspeed_zero_fields())
    )
    OUT.write_text(text)
    print(f"wrote {OUT}: {len(lf)} LLaMA-Factory, {len(ta)} TrainingArguments keys")


if __name__ == "__main__":
    main(sys.argv[1])
