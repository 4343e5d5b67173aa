"""A config.json as transformers reads it: its config object, model class and layer count.

``TraceUnsupported`` is raised here and by oomless.runtime.build when transformers
cannot build a run's model on fake tensors (the analytic estimate is used instead).
"""

from __future__ import annotations

import copy
from typing import Any

from ..errors import ModelConfigError

LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


class TraceUnsupported(Exception):
    """This run cannot be traced; the message says why (the analytic estimate is used)."""


def _layer_holder(d: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The (sub)config dict holding the decoder's layer count, and its key."""
    for holder in (d, d.get("text_config"), d.get("llm_config")):
        if isinstance(holder, dict):
            for key in LAYER_KEYS:
                if isinstance(holder.get(key), int):
                    return holder, key
    sub = d.get("text_config")
    if isinstance(sub, dict):  # left to the text model's defaults (LLaVA-1.5)
        return sub, "num_hidden_layers"
    raise ModelConfigError("config.json has no num_hidden_layers; cannot build the model")


def num_layers_of(hf_config: dict[str, Any]) -> int:
    holder, key = _layer_holder(hf_config)
    if key in holder:
        return holder[key]
    config = transformers_config(hf_config)
    return int(config.get_text_config().num_hidden_layers)


def with_num_layers(hf_config: dict[str, Any], n: int) -> dict[str, Any]:
    """A copy of ``hf_config`` with ``n`` decoder layers; per-layer lists cut to ``n``."""
    old = num_layers_of(hf_config)
    d = copy.deepcopy(hf_config)
    holder, key = _layer_holder(d)
    holder[key] = n
    for k, v in list(holder.items()):
        if isinstance(v, list) and len(v) == old:
            holder[k] = v[:n]  # layer_types and other per-layer lists
    if isinstance(holder.get("mlp_only_layers"), list):
        holder["mlp_only_layers"] = [i for i in holder["mlp_only_layers"] if i < n]
    return d


def transformers_config(hf_config: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    d = copy.deepcopy(hf_config)
    model_type = d.pop("model_type", None)
    if not model_type:
        raise ModelConfigError("config.json has no model_type; cannot build the model")
    try:
        return AutoConfig.for_model(model_type, **d)
    except ValueError as err:
        raise TraceUnsupported(f"transformers has no model type '{model_type}': {err}") from None


def model_class(config: Any) -> Any:
    """The Auto class that builds ``config``'s causal LM (text or image-text-to-text)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        if type(config) in auto._model_mapping:
            return auto
    raise TraceUnsupported(
        f"transformers implements no causal-LM class for model type '{config.model_type}'"
    )


def supports_sdpa(config: Any) -> bool:
    auto = model_class(config)
    return bool(getattr(auto._model_mapping[type(config)], "_supports_sdpa", True))
