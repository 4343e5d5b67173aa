"""A model's structure from its own code: built on the meta device, read from the module tree.

For a model the formulas of oomless.models do not know (an unknown ``model_type``, or
code that ships with the checkpoint), the real model class is built without weights
the way accelerate's ``init_empty_weights`` / ``create_empty_model`` do —
``AutoModelForCausalLM`` / ``AutoModelForImageTextToText`` / ``AutoModel``
``.from_config`` under ``torch.device("meta")`` — its parameters are counted exactly
and the ModelSpec fields are read from the modules: the decoder layers (the largest
``ModuleList`` of repeated blocks), each layer's linears by name (widths from their
shapes, so a config's ``intermediate_size`` that is not the projection width does not
mislead), norms, experts (``ModuleList`` or fused 3-D expert parameters) and the router,
vocabulary and tied embeddings from the embedding modules. Parameters the layer shapes
do not express (a vision tower, linear-attention kernels, ...) stay in
``ModelSpec.other_params`` so that the count is exact, and the spec says so in its
assumptions.

Remote code runs only with ``trust_remote_code`` and only from a local folder; the hub
is never asked (``HF_HUB_OFFLINE``). :func:`meta_spec` is the one entry.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from pathlib import Path
from typing import Any

from ..errors import ModelConfigError, UnknownModelError
from ..models.spec import ModelSpec
from ..models.structure import register_module_lister, register_structure_reader
from .meta_tree import spec_from_model


@contextlib.contextmanager
def _offline():
    old = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def remote_code_files(config: dict[str, Any]) -> list[str]:
    """The .py files the config's auto_map names (empty: transformers' own classes)."""
    auto_map = config.get("auto_map") or {}
    refs = auto_map.values() if isinstance(auto_map, dict) else []
    files = set()
    for ref in refs:
        for one in ref if isinstance(ref, list) else [ref]:
            if isinstance(one, str) and "." in one:
                files.add(one.split("--")[-1].rsplit(".", 1)[0] + ".py")
    return sorted(files)


def in_library(model_type: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


def build_config(config: dict[str, Any], folder: Path | None, trust_remote_code: bool,
                 where: str) -> Any:
    """The transformers config object: the library's class, or the folder's own code."""
    from transformers import AutoConfig

    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # huggingface_hub before strict config dataclasses
        StrictDataclassError = ValueError  # noqa: N806
    model_type = str(config.get("model_type") or "")
    if model_type and in_library(model_type):
        d = {k: v for k, v in config.items() if k not in ("model_type", "auto_map")}
        try:
            return AutoConfig.for_model(model_type, **d)
        except (ValueError, TypeError, StrictDataclassError) as err:  # the class's validation
            first = (str(err).strip().splitlines() or [""])[-1].strip()
            raise ModelConfigError(f"{where}: transformers' {model_type} config class refuses "
                                   f"this config.json: {first}") from None
    files = remote_code_files(config)
    if not files:
        raise ModelConfigError(
            f"{where}: model_type '{model_type}' is neither a family oomless's formulas know "
            "nor one the installed transformers implements, and the config names no modeling "
            "code (auto_map): oomless cannot size it. Pass a catalog model (`oomless models`) "
            "or upgrade transformers.")
    if not trust_remote_code:
        raise ModelConfigError(
            f"{where}: model_type '{model_type}' ships its own modeling code ({', '.join(files)}); "
            "oomless reads its structure by building it on the meta device, which runs that "
            "code. Pass --trust-remote-code to allow it (the code is read from the model's "
            "local folder; nothing is downloaded), or pass a catalog model (`oomless models`).")
    missing = [f for f in files if folder is None or not (folder / f).is_file()]
    if missing:
        raise ModelConfigError(
            f"{where}: --trust-remote-code needs the model's code next to its config.json, and "
            f"{', '.join(missing)} is not in {folder}; download the whole model folder (the "
            ".py files at least) first — oomless never downloads.")
    with _offline():
        return AutoConfig.from_pretrained(str(folder), trust_remote_code=True,
                                          local_files_only=True)


def _named_class(config_obj: Any) -> Any:
    """The transformers class the config's ``architectures`` names, if transformers has it
    (a vision-language checkpoint names its full model; AutoModelForCausalLM may map the
    model type to the text-only one)."""
    import transformers

    names = getattr(config_obj, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    return cls if isinstance(cls, type) and hasattr(cls, "_from_config") else None


def build_meta_model(config_obj: Any, trust_remote_code: bool) -> Any:
    """The model on the meta device: the class ``architectures`` names, else causal LM,
    image-text-to-text or the base model through the Auto classes."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

    last: Exception | None = None
    named = None if trust_remote_code else _named_class(config_obj)
    builders = ([named._from_config] if named else []) + [
        lambda c, a=auto: a.from_config(c, trust_remote_code=trust_remote_code)
        for auto in (AutoModelForCausalLM, AutoModelForImageTextToText, AutoModel)]
    with _offline(), torch.device("meta"):
        for build in builders:
            try:
                return build(config_obj)
            except (ValueError, KeyError) as err:  # no class of this kind: try the next
                last = err
            except (AssertionError, TypeError, RuntimeError, AttributeError) as err:
                last = err  # the class refuses the config (e.g. padding_idx ≥ vocabulary)
                break
            except ImportError as err:  # remote code importing a package not installed here
                raise ModelConfigError(
                    f"the model's own code (model type '{getattr(config_obj, 'model_type', '?')}')"
                    f" cannot be imported here: {str(err).strip()}. Install what it names, or "
                    "pass a catalog model (`oomless models`).") from None
    raise ModelConfigError(f"transformers could not build model type "
                           f"'{getattr(config_obj, 'model_type', '?')}' from its config: {last}")




def meta_spec(config: dict[str, Any], name: str, *, folder: Path | None = None,
              trust_remote_code: bool = False, where: str | None = None) -> ModelSpec:
    """The one entry: a config.json dict (and its folder, for remote code) -> ModelSpec read
    from the model built on the meta device. Refusals are OomlessErrors naming the fix."""
    where = where or name
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise UnknownModelError(f"{where}: model_type '{config.get('model_type')}' is not a "
                                "family the formulas know, and reading it from its code needs "
                                "torch and transformers (pip install oomless[train])") from None
    config_obj = build_config(config, folder, trust_remote_code, where)
    model = build_meta_model(config_obj, trust_remote_code)
    return spec_from_model(model, config_obj, name)


def structure_reader(config: dict[str, Any], name: str, *, folder: Path | None,
                     trust_remote_code: bool, where: str, must_build: bool) -> ModelSpec | None:
    """meta_spec as oomless.models.structure calls it: with ``must_build`` False (a check
    of a known family), None where the model cannot be built without remote code."""
    if not must_build:
        try:
            import transformers  # noqa: F401
        except ImportError:
            return None
        if not in_library(str(config.get("model_type") or "")):
            return None
        try:
            return meta_spec(config, name, folder=folder, where=where)
        except (ModelConfigError, UnknownModelError, ValueError, TypeError):
            return None
    return meta_spec(config, name, folder=folder, trust_remote_code=trust_remote_code,
                     where=where)


def linear_names(config: dict[str, Any], *, folder: Path | None,
                 trust_remote_code: bool) -> tuple[str, ...] | None:
    """Full names of the linear modules PEFT can wrap (``nn.Linear``, transformers'
    ``Conv1D``) of the model built on the meta device, the output layer included (a
    regular expression can reach it; ``all-linear`` skips it); None where the model
    cannot be built here."""
    key = json.dumps(config, sort_keys=True, default=str)
    return _linear_names(key, str(folder) if folder else "", trust_remote_code)


@functools.lru_cache(maxsize=16)
def _linear_names(key: str, folder: str, trust_remote_code: bool) -> tuple[str, ...] | None:
    try:
        import torch
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    config = json.loads(key)
    try:
        config_obj = build_config(config, Path(folder) if folder else None, trust_remote_code,
                                  str(config.get("model_type")))
        model = build_meta_model(config_obj, trust_remote_code)
    except (ModelConfigError, UnknownModelError, ValueError, TypeError, OSError):
        return None
    return tuple(name for name, mod in model.named_modules()
                 if isinstance(mod, (torch.nn.Linear, Conv1D)))


register_structure_reader(structure_reader)
register_module_lister(linear_names)
