"""Regenerate src/oomless/data/foreign_keys.json (not a test; run by hand).

The keys a configuration file may hold are the argument names of the tool that
reads it, in every version a user may run. They are read with ``ast`` from the
tools' own sources, without installing them (most cannot be installed beside
this project's pins):

    mkdir -p /tmp/fk && cd /tmp/fk
    for v in 4.31.0 4.32.1 ... 5.23.0; do pip download --no-deps transformers==$v; done
    (likewise llamafactory 0.8.3, 0.9.0-0.9.5; trl 0.8.6-1.16; peft 0.10-0.21;
     axolotl 0.5-0.19; accelerate 0.21-1.15: the versions are listed in VERSIONS)
    .venv/bin/python tests/check/gen_foreign_keys.py /tmp/fk SOURCES_DIR

Tools that are not on PyPI are read from their source files in SOURCES_DIR
(download them from the URLs in ``REPO_SOURCES``; only the field names of
their argument dataclasses are used). DeepSpeed's ``zero_optimization`` keys
come from the installed deepspeed (a pydantic model with extra keys
forbidden, so the installed version is the one that refuses).

The JSON stores, per tool, the versions read and for each key the version
ranges that accept it, e.g. ``"warmup_ratio": "4.31.0..5.1.0"``.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import tarfile
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "src" / "oomless" / "data" / "foreign_keys.json"

# tool -> (wheel name, files or folders inside the wheel to parse, classes whose
# fields (with inherited ones) make the key set)
WHEEL_TOOLS = {
    "transformers:TrainingArguments": (
        "transformers", ("transformers/training_args.py",), ("TrainingArguments",)),
    "transformers:Seq2SeqTrainingArguments": (
        "transformers", ("transformers/training_args.py", "transformers/training_args_seq2seq.py"),
        ("Seq2SeqTrainingArguments",)),
    "llamafactory": ("llamafactory", ("llamafactory/hparams/",), ("*",)),
    "trl:SFTConfig": ("trl", ("trl/trainer/",), ("SFTConfig",)),
    "trl:DPOConfig": ("trl", ("trl/trainer/",), ("DPOConfig",)),
    "trl:KTOConfig": ("trl", ("trl/trainer/",), ("KTOConfig",)),
    "trl:ORPOConfig": ("trl", ("trl/trainer/",), ("ORPOConfig",)),
    "trl:CPOConfig": ("trl", ("trl/trainer/",), ("CPOConfig",)),
    "trl:RewardConfig": ("trl", ("trl/trainer/",), ("RewardConfig",)),
    "trl:PPOConfig": ("trl", ("trl/trainer/",), ("PPOConfig", "PPOv2Config")),
    "trl:GRPOConfig": ("trl", ("trl/trainer/",), ("GRPOConfig",)),
    "trl:ModelConfig": ("trl", ("trl/trainer/",), ("ModelConfig",)),
    "trl:ScriptArguments": ("trl", ("trl/commands/", "trl/scripts/", "trl/utils.py"),
                            ("ScriptArguments", "SFTScriptArguments", "DPOScriptArguments")),
    "peft:LoraConfig": ("peft", ("peft/config.py", "peft/tuners/lora/"), ("LoraConfig",)),
    "peft:PrefixTuningConfig": ("peft", ("peft/config.py", "peft/tuners/prefix_tuning/"),
                                ("PrefixTuningConfig",)),
    "axolotl": ("axolotl", ("axolotl/utils/",), ("AxolotlInputConfig",)),
    "accelerate:ClusterConfig": ("accelerate", ("accelerate/commands/config/config_args.py",),
                                 ("ClusterConfig",)),
}
# Tools read from source files (not on PyPI): label -> [(file, commit URL, classes)]
REPO_SOURCES = {
    "llava": [("llava_train.py", "https://github.com/haotian-liu/LLaVA/blob/"
               "0034661529f5cbadb50aaaaa72fe4ff046048378/llava/train/train.py",
               ("ModelArguments", "DataArguments", "TrainingArguments"))],
    "moe-llava": [("moellava_train.py", "https://github.com/PKU-YuanGroup/MoE-LLaVA/blob/"
                   "15bcee805c69853afc3699de0d93cb2935e81f5b/moellava/train/train.py",
                   ("ModelArguments", "DataArguments", "TrainingArguments"))],
    "glm4-finetune": [
        ("glm4_finetune_demo.py", "https://github.com/THUDM/GLM-4/blob/"
         "081f0fb96c4cfa6390797c2e214282e1533c9738/finetune_demo/finetune.py",
         ("FinetuningConfig",)),
        ("glm4_finetune_0414.py", "https://github.com/THUDM/GLM-4/blob/"
         "9c0e42152a8695b2dbec905f99a63b044d6b1c04/finetune/finetune.py", ("FinetuningConfig",))],
    "glm4-finetune:data_config": [
        ("glm4_finetune_0414.py", "https://github.com/THUDM/GLM-4/blob/"
         "9c0e42152a8695b2dbec905f99a63b044d6b1c04/finetune/finetune.py", ("DataConfig",))],
    "alignment-handbook": [("alignment_configs.py", "https://github.com/huggingface/"
                            "alignment-handbook/blob/125b292c92168d14011f4aae3e94dab9d9b4827b/"
                            "src/alignment/configs.py",
                            ("ModelArguments", "DataArguments", "SFTConfig", "DPOConfig"))],
}
LF_ENUMS = ("AttentionFunction", "QuantizationMethod", "EngineName", "RopeScaling")


def _version_key(text: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in re.split(r"[.+]", text))


def _is_init_false(value: ast.AST | None) -> bool:
    if not isinstance(value, ast.Call):
        return False
    return any(k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
               for k in value.keywords)


def _alias(value: ast.AST | None) -> str | None:
    if isinstance(value, ast.Call):
        for k in value.keywords:
            if k.arg == "alias" and isinstance(k.value, ast.Constant):
                return k.value.value
    return None


class ClassIndex:
    """Classes of some modules: their own annotated fields and base-class names."""

    def __init__(self) -> None:
        self.fields: dict[str, dict[str, ast.AST]] = {}
        self.bases: dict[str, list[str]] = {}

    def add_source(self, text: str) -> None:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            return
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            own = self.fields.setdefault(cls.name, {})
            self.bases.setdefault(cls.name, [])
            self.bases[cls.name] += [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                                     for b in cls.bases]
            for stmt in cls.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    own[stmt.target.id] = stmt

    def keys(self, name: str, seen: frozenset[str] = frozenset()) -> set[str]:
        if name not in self.fields or name in seen:
            return set()
        out: set[str] = set()
        for base in self.bases.get(name, []):
            out |= self.keys(base, seen | {name})
        for key, stmt in self.fields[name].items():
            if key.startswith("_") or _is_init_false(stmt.value):
                continue
            out.add(key)
            alias = _alias(stmt.value)
            if alias:
                out.add(alias)
        return out


def _members(archive: Path):
    """(path inside the package, bytes) of the .py files of a wheel or an sdist; an
    sdist's "pkg-1.0/src/" prefix is dropped so that both name files alike."""
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as zf:
            for name in zf.namelist():
                if name.endswith(".py"):
                    yield name, zf.read(name)
        return
    with tarfile.open(archive) as tf:
        for member in tf.getmembers():
            if member.isfile() and member.name.endswith(".py"):
                name = re.sub(r"^[^/]+/(?:src/)?", "", member.name)
                yield name, tf.extractfile(member).read()


def _wheel_index(wheel: Path, parts: tuple[str, ...]) -> ClassIndex:
    index = ClassIndex()
    for name, data in _members(wheel):
        if any(name == p or (p.endswith("/") and name.startswith(p)) for p in parts):
            index.add_source(data.decode("utf-8", "replace"))
    return index


def _wheels(folder: Path, package: str) -> list[tuple[str, Path]]:
    """(version, archive) of every wheel or sdist of ``package`` in ``folder``."""
    found = []
    for archive in [*folder.glob(f"**/{package}-*.whl"), *folder.glob(f"**/{package}-*.tar.gz")]:
        version = archive.name.removesuffix(".tar.gz").split("-")[1]
        found.append((version, archive))
    return sorted(found, key=lambda vw: _version_key(vw[0]))


def _ranges(versions: list[str], present: list[bool]) -> str:
    """'4.31.0..5.1.0, 5.3.0..5.3.0': the runs of versions that have the key."""
    out: list[str] = []
    start = None
    for i, here in enumerate(present + [False]):
        if here and start is None:
            start = i
        if not here and start is not None:
            out.append(f"{versions[start]}..{versions[i - 1]}")
            start = None
    return ", ".join(out)


def versioned(key_sets: list[tuple[str, set[str]]]) -> dict:
    versions = [v for v, _ in key_sets]
    every = sorted(set().union(*(keys for _, keys in key_sets)))
    return {"versions": versions,
            "keys": {k: _ranges(versions, [k in keys for _, keys in key_sets]) for k in every}}


def wheel_tool(folder: Path, tool: str) -> dict:
    package, parts, classes = WHEEL_TOOLS[tool]
    sets = []
    for version, wheel in _wheels(folder, package):
        index = _wheel_index(wheel, parts)
        names = list(index.fields) if classes == ("*",) else classes
        keys = set().union(*(index.keys(c) for c in names))
        if keys:
            sets.append((version, keys))
    return versioned(sets)


def _literal(node: ast.AST) -> list | None:
    if isinstance(node, ast.Subscript) and getattr(node.value, "id", "") == "Literal":
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return [e.value for e in elts if isinstance(e, ast.Constant)]
    if isinstance(node, ast.BinOp):  # Literal[...] | None
        return _literal(node.left) or _literal(node.right)
    if isinstance(node, ast.Subscript) and getattr(node.value, "id", "") == "Optional":
        return _literal(node.slice)
    return None


def lf_choices(folder: Path) -> dict[str, list]:
    """Literal / enum values LLaMA-Factory accepts, over all versions read."""
    choices: dict[str, set] = {}
    for _version, wheel in _wheels(folder, "llamafactory"):
        files = dict(_members(wheel))
        enums: dict[str, list] = {}
        if "llamafactory/extras/constants.py" in files:
            for node in ast.parse(files["llamafactory/extras/constants.py"]).body:
                if isinstance(node, ast.ClassDef) and node.name in LF_ENUMS:
                    enums[node.name] = [s.value.value for s in node.body
                                        if isinstance(s, ast.Assign)
                                        and isinstance(s.value, ast.Constant)]
        for name in (n for n in files if n.startswith("llamafactory/hparams/")):
            for cls in (n for n in ast.walk(ast.parse(files[name])) if isinstance(n, ast.ClassDef)):
                for stmt in cls.body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                        values = _literal(stmt.annotation) or enums.get(
                            getattr(stmt.annotation, "id", None) or "")
                        if values:
                            choices.setdefault(stmt.target.id, set()).update(values)
    return {k: sorted(v, key=str) for k, v in sorted(choices.items())}


def repo_tool(sources: Path, label: str) -> dict:
    keys: set[str] = set()
    for file, _url, classes in REPO_SOURCES[label]:
        index = ClassIndex()
        index.add_source((sources / file).read_text(encoding="utf-8"))
        for c in classes:
            keys |= index.keys(c)
    return {"versions": ["source"], "keys": {k: "source..source" for k in sorted(keys)}}


def deepspeed_zero_fields() -> dict:
    import deepspeed
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    names = set()
    for name, f in DeepSpeedZeroConfig.model_fields.items():
        names.add(name)
        if f.alias:
            names.add(f.alias)
    v = deepspeed.__version__
    return {"versions": [v], "keys": {k: f"{v}..{v}" for k in sorted(names)}}


def main(wheels: str, sources: str) -> None:
    folder, src = Path(wheels), Path(sources)
    tools = {tool: wheel_tool(folder, tool) for tool in WHEEL_TOOLS}
    tools.update({label: repo_tool(src, label) for label in REPO_SOURCES})
    tools["deepspeed:zero_optimization"] = deepspeed_zero_fields()
    about = {tool: f"{WHEEL_TOOLS[tool][0]} {t['versions'][0]}–{t['versions'][-1]} "
             f"({len(t['versions'])} versions), classes {', '.join(WHEEL_TOOLS[tool][2])}"
             for tool, t in tools.items() if tool in WHEEL_TOOLS}
    about.update({label: "; ".join(url for _f, url, _c in REPO_SOURCES[label])
                  for label in REPO_SOURCES})
    about["deepspeed:zero_optimization"] = "the installed deepspeed's DeepSpeedZeroConfig"
    data = {
        "about": "Argument names of the tools `oomless check` reads, with the versions that "
                 "accept each. Generated by tests/check/gen_foreign_keys.py; do not edit by hand.",
        "sources": about,
        "tools": tools,
        "llamafactory_choices": lf_choices(folder),
    }
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {OUT}: " + ", ".join(f"{t} {len(v['keys'])}" for t, v in tools.items()))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
