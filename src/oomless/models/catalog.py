"""The built-in model catalog and model-name resolution (torch-free).

Entries live in ``oomless/data/models.json``: a canonical name, aliases, the
Hugging Face id, and the model's released ``config.json`` content with the
place it was copied from (``source``). A catalog ModelSpec is derived from that
stored config by :func:`oomless.models.hf_config.spec_from_hf_config`, the same code
path a user's own config.json takes.

:func:`resolve_model` turns what a user typed into a spec, in this order:
catalog name or alias (case-insensitive), a local config.json file or model
folder, a model id in the local Hugging Face cache (offline).
"""

from __future__ import annotations

import copy
import difflib
import json
import re
from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import UnknownModelError
from .hf_cache import config_path_for, read_config_file
from .hf_config import buildable_hf_config, spec_from_hf_config, with_quantization
from .spec import ModelSpec


@dataclass(frozen=True)
class CatalogEntry:
    """One built-in model: names, where its config came from, and the config itself."""

    name: str  # canonical, lower-case: "qwen2.5-7b-instruct"
    hf_id: str  # "Qwen/Qwen2.5-7B-Instruct"
    aliases: tuple[str, ...]
    source: str  # where the stored config.json content was copied from
    family: str = ""
    # exact | copy-edited | reconstructed | transcribed (models.json "notes" defines them)
    provenance: str = "transcribed"
    published_params: int | None = None  # the count the model card/paper states, if stated exactly
    notes: str = ""
    _config_json: str = field(default="{}", repr=False)  # kept as text: the entry stays immutable
    _preprocessor_json: str = field(default="null", repr=False)
    # the ModelSpec read from the model's own code on the meta device, for families the
    # formulas do not know (models.json "structure"; scripts/catalog_structure.py writes it
    # and tests/test_catalog_params.py rebuilds it); "null": the formulas read the config
    _structure_json: str = field(default="null", repr=False)

    @property
    def preprocessor_config(self) -> dict[str, Any] | None:
        """The released preprocessor_config.json of a vision-language model, if stored."""
        return json.loads(self._preprocessor_json)

    @property
    def config(self) -> dict[str, Any]:
        """A fresh copy of the stored config.json content."""
        return json.loads(self._config_json)

    @property
    def spec(self) -> ModelSpec:
        return _spec_for(self.name)

    @property
    def hf_config(self) -> dict[str, Any] | None:
        """The config transformers can build the model from (see buildable_hf_config)."""
        return buildable_hf_config(self.config)

    def to_dict(self) -> dict[str, Any]:
        spec = self.spec
        return {
            "name": self.name,
            "hf_id": self.hf_id,
            "aliases": list(self.aliases),
            "family": self.family,
            "model_type": spec.model_type,
            "param_count": spec.param_count,
            "active_param_count": spec.active_param_count,
            "vision": spec.vision is not None,
            "moe": spec.is_moe,
            "source": self.source,
            "provenance": self.provenance,
            "notes": self.notes,
        }


@dataclass(frozen=True)
class ResolvedModel:
    """What a model argument resolved to.

    ``hf_config``: the config dict transformers can build the real model from
    (``AutoConfig.for_model(**hf_config)``), for the tracer and trainer; None
    where transformers has no class for it (GLM-4V, MoE-LLaVA remote code).
    ``original_config``: the config.json content as read (or as stored in the catalog).
    ``source``: "catalog:NAME", "file:PATH" or "hf-cache:PATH".
    """

    spec: ModelSpec
    hf_config: dict[str, Any] | None
    source: str
    original_config: dict[str, Any] | None = None
    entry: CatalogEntry | None = None


def _key(text: str) -> str:
    """Case- and separator-insensitive lookup key ("Qwen2.5 7B" == "qwen2.5-7b")."""
    return re.sub(r"[\s_]+", "-", text.strip().lower())


@lru_cache(maxsize=1)
def _entries() -> dict[str, CatalogEntry]:
    raw = json.loads(resources.files("oomless.data").joinpath("models.json").read_text("utf-8"))
    out: dict[str, CatalogEntry] = {}
    for item in raw["models"]:
        entry = CatalogEntry(
            name=item["name"],
            hf_id=item["hf_id"],
            aliases=tuple(item.get("aliases", ())),
            source=item["source"],
            family=item.get("family", ""),
            published_params=item.get("published_params"),
            notes=item.get("notes", ""),
            provenance=item.get("provenance", "transcribed"),
            _config_json=json.dumps(item["config"], sort_keys=True),
            _preprocessor_json=json.dumps(item.get("preprocessor_config")),
            _structure_json=json.dumps(item.get("structure")),
        )
        if entry.name in out:
            raise ValueError(f"models.json: duplicate name {entry.name}")
        out[entry.name] = entry
    return out


def _tokens(text: str) -> tuple[str, ...]:
    """Words and numbers of a model name: "Qwen2.5-7B_Instruct" -> (qwen, 2.5, 7, b, instruct)."""
    return tuple(re.findall(r"[a-z]+|\d+(?:\.\d+)?", text.strip().lower()))


def _numbers(tokens: tuple[str, ...]) -> set[str]:
    return {t for t in tokens if t[0].isdigit()}


@lru_cache(maxsize=1)
def _index() -> dict[str, str]:
    """lookup key -> canonical name, over names, aliases, hf ids and their last path part;
    each also under its token key ("qwen2.5 7b instruct" finds qwen2.5-7b-instruct)."""
    index: dict[str, str] = {}
    ambiguous: set[str] = set()
    by_tokens: dict[str, str] = {}
    for entry in _entries().values():
        keys = {entry.name, entry.hf_id, entry.hf_id.split("/")[-1], *entry.aliases}
        for key in keys:
            owner = index.setdefault(_key(key), entry.name)
            if owner != entry.name:
                raise ValueError(f"models.json: alias '{key}' names both {owner} and {entry.name}")
            token_key = "-".join(_tokens(key.split("/")[-1]))
            if by_tokens.setdefault(token_key, entry.name) != entry.name:
                ambiguous.add(token_key)
    for token_key, name in by_tokens.items():
        if token_key not in ambiguous:
            index.setdefault(token_key, name)
    return index


@lru_cache(maxsize=256)
def _spec_for(name: str) -> ModelSpec:
    entry = _entries()[name]
    structure = json.loads(entry._structure_json)
    if structure is not None:  # read from the model's code when the catalog was written
        spec = with_quantization(ModelSpec.from_dict(structure | {"name": entry.name}),
                                 entry.config, f"catalog entry '{entry.name}'")
    else:
        spec = spec_from_hf_config(entry.config, entry.name,
                                   where=f"catalog entry '{entry.name}'")
    return replace(spec, aliases=entry.aliases)


def list_models() -> list[CatalogEntry]:
    """All catalog entries, in catalog order."""
    return list(_entries().values())


def find_entry(text: str) -> CatalogEntry | None:
    """The entry a name, alias or hf id names (case-, separator-insensitive), or None."""
    index = _index()
    name = index.get(_key(text)) or index.get("-".join(_tokens(text.split("/")[-1])))
    return _entries()[name] if name else None


def get_entry(name: str) -> CatalogEntry:
    entry = find_entry(name)
    if entry is None:
        raise _unknown(name)
    return entry


def close_names(text: str, n: int = 5) -> list[str]:
    """Catalog names closest to ``text``, token-aware: the family word must match, then
    numbers decide ("Qwen3-4B-Instruct-2508" ranks qwen3-4b first: every number of it is
    in the query), a word of the name the query lacks even misspelt costs as much as a
    number ("vl" of qwen3-vl-4b-instruct), then the spelling (difflib ratio)."""
    query = _tokens(text.split("/")[-1])
    numbers = _numbers(query)
    family = next((t for t in query if not t[0].isdigit() and len(t) > 1), None)
    scores: dict[str, float] = {}
    for key, name in _index().items():
        tokens = _tokens(key.split("/")[-1])
        candidate = _numbers(tokens)
        if family and family not in tokens:
            continue  # the family word ("qwen", "llama", "gemma") must be there
        score = len(numbers & candidate) - len(candidate - numbers)
        words = [t for t in query if not t[0].isdigit()]
        score -= sum(not difflib.get_close_matches(t, words, n=1, cutoff=0.8)
                     for t in tokens if not t[0].isdigit() and len(t) > 1)
        score += difflib.SequenceMatcher(None, "-".join(query), "-".join(tokens)).ratio()
        if score > 0.5:
            scores[name] = max(score, scores.get(name, float("-inf")))
    return sorted(scores, key=lambda name: (-scores[name], name))[:n]


def _unknown(text: str) -> UnknownModelError:
    names = close_names(text)
    hint = f" Closest catalog names: {', '.join(names)}." if names else ""
    page = (f" (https://huggingface.co/{text.strip()}/blob/main/config.json)"
            if re.fullmatch(r"[\w.-]+/[\w.-]+", text.strip()) else "")
    return UnknownModelError(
        f"unknown model '{text}': not a catalog name or alias, not a local config.json or "
        f"model folder, and not a model id in the local Hugging Face cache.{hint} "
        "Pass a catalog name (`oomless models` lists them), or the model's config.json: "
        f"download it from the model's page{page} and run `oomless estimate path/to/config.json` "
        "(a model folder works too; oomless works offline and downloads nothing)."
    )


def resolve_model(text: str) -> ResolvedModel:
    """Resolve a model argument: catalog name/alias, local file/folder, or HF-cache id."""
    entry = find_entry(text)
    if entry is not None:
        return ResolvedModel(
            spec=entry.spec,
            hf_config=entry.hf_config,
            source=f"catalog:{entry.name}",
            original_config=entry.config,
            entry=entry,
        )
    path = config_path_for(text)
    if path is None:
        raise _unknown(text)
    config = read_config_file(path)
    in_cache = not Path(text).expanduser().exists()
    name = text if in_cache else _name_from_path(path)
    spec = spec_from_hf_config(config, name, where=str(path), folder=path.parent)
    return ResolvedModel(
        spec=spec,
        hf_config=buildable_hf_config(config),
        source=f"{'hf-cache' if in_cache else 'file'}:{path}",
        original_config=copy.deepcopy(config),
    )


def _name_from_path(path: Path) -> str:
    """A readable model name for a config file: its folder, or the HF-cache repo name."""
    parts = path.resolve().parts
    for part in parts:
        if part.startswith("models--"):
            return part.removeprefix("models--").replace("--", "/")
    return path.parent.name or path.stem


def family_of_model_type(model_type: str) -> str | None:
    """The catalog family of a ``model_type`` (a local config.json of a catalog family),
    or None where the catalog has no model of that type or several families share it."""
    families = {e.family for e in list_models() if e.spec.model_type == model_type}
    return families.pop() if len(families) == 1 else None
