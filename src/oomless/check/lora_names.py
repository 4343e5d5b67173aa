"""LoRA ``target_modules`` given as a regular expression, resolved against the real module tree.

PEFT (peft/tuners/tuners_utils.py ``check_target_module_exists``) matches a string
``target_modules`` with ``re.fullmatch`` against the full name of every module of the
base model — the vision tower's and the projector's included — and wraps the matching
linear layers. Which names exist is a fact of the model's code, not of the file: the
model is built on the meta device (oomless.runtime.meta, through
oomless.models.structure.linear_module_names) and the expression is matched against its
linear modules. Where the tree cannot be built here (remote code without its files or
without --trust-remote-code), the run is refused as can't-tell with what settles it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..errors import CannotTellError, ConfigError
from ..models.spec import ModelSpec
from .sources import Reading

# the words oomless.runtime.meta_tree uses to keep vision modules out of the decoder layers
VISION_WORDS = ("vision", "visual", "vit", "image", "audio")
PROJECTOR_WORDS = ("projector", "merger", "mm_proj", "aligner")


def _model_tree(model: str, family: str | None
                ) -> tuple[tuple[str, ...] | None, dict[str, str]]:
    """(full names of the model's linear modules, or None where they cannot be listed;
    prefix -> part of the modules outside that list). The whole model built on the meta
    device lists everything; a remote-code model that cannot be built here but whose
    family row says where its code puts a transformers language model (families.json
    ``module_parts``: MiniCPM-V's ``llm.``) lists that language model, prefixed, and
    leaves the other parts (``vpm.``, ``resampler.``) as prefixes."""
    from ..api import resolve_model
    from ..errors import OomlessError
    from ..models.structure import linear_module_names

    try:
        resolved = resolve_model(model)
    except OomlessError:
        return None, {}
    source = resolved.source
    folder = None
    if source.startswith(("file:", "hf-cache:")):
        path = Path(source.split(":", 1)[1])
        folder = path if path.is_dir() else path.parent
    names = linear_module_names(resolved.hf_config, folder)
    parts = _module_parts(family)
    if names is not None or parts is None or resolved.original_config is None:
        return names, {}
    language = parts["language"]
    config = {k: v for k, v in resolved.original_config.items()
              if k not in ("auto_map", "architectures")} | {"model_type": language["model_type"]}
    text = linear_module_names(config, None)
    if text is None:
        return None, {}
    return tuple(language["prefix"] + n for n in text), dict(parts["others"])


def _module_parts(family: str | None) -> dict[str, Any] | None:
    from ..models.families import family_facts

    facts = family_facts(family or "")
    return facts.module_parts if facts else None


def _parts_reached(targets: str, others: dict[str, str]) -> list[str]:
    """The parts (by prefix) under which the expression can match some module name: the
    prefix is the start of a string the expression fullmatches (``regex`` partial
    matching), so a part it cannot reach is proven out without listing its modules."""
    import regex

    return [f"{prefix} ({part})" for prefix, part in others.items()
            if regex.fullmatch(targets, prefix, partial=True) is not None]


def split_by_part(names: tuple[str, ...], prefixes: dict[str, str] | None = None
                  ) -> dict[str, list[str]]:
    """Matched module names by the part of the model they sit in: by the family's
    ``module_parts`` prefixes where its row has them (MiniCPM-V's ``vpm.`` is its vision
    tower, a name no vision word marks), else by the words towers and projectors use."""
    out: dict[str, list[str]] = {"language": [], "vision tower": [], "projector": []}
    for name in names:
        low = name.lower()
        by_prefix = next((part for p, part in (prefixes or {}).items() if name.startswith(p)),
                         None)
        part = by_prefix or ("projector" if any(w in low for w in PROJECTOR_WORDS) else
                             "vision tower" if any(w in low for w in VISION_WORDS) else
                             "language")
        out.setdefault(part, []).append(name)
    return out


def _prefixes(family: str | None) -> dict[str, str]:
    """prefix -> part, from the family's ``module_parts`` (empty without a row)."""
    parts = _module_parts(family)
    if not parts:
        return {}
    return {parts["language"]["prefix"]: "language", **parts["others"]}


def _refuse(targets: str, spec: ModelSpec, why: str) -> CannotTellError:
    return CannotTellError(
        f"LoRA target_modules is a regular expression ('{targets}'): PEFT matches it with "
        "re.fullmatch against every full module name, vision tower included, and "
        f"{why}. Write the module names as a list (e.g. [\"q_proj\", \"v_proj\"]) or "
        f"'all-linear' to have {spec.name} checked.")


def _refuse_partial(targets: str, spec: ModelSpec, matched: list[str],
                    every: list[str]) -> None:
    """An expression that wraps a name in some layers only: the estimate puts LoRA on every
    layer, so it cannot tell."""
    for last in sorted({n.rsplit(".", 1)[-1] for n in matched}):
        hit = sum(n.rsplit(".", 1)[-1] == last for n in matched)
        total = sum(n.rsplit(".", 1)[-1] == last for n in every)
        if hit != total:
            raise _refuse(targets, spec, f"it reaches {hit} of the {total} '{last}' modules of "
                          "the language model, and oomless models LoRA on every layer")


def _refuse_unmodelled(targets: str, spec: ModelSpec, parts: dict[str, list[str]]) -> None:
    """LoRA in a part the estimate has no model of (MiniCPM-o's audio encoder, speech
    decoder): it cannot tell."""
    unmodelled = {k: v for k, v in parts.items()
                  if v and k not in ("language", "vision tower", "projector")}
    if unmodelled:
        raise _refuse(targets, spec, "it reaches " + ", ".join(
            f"{len(v)} linears of the {k}" for k, v in unmodelled.items())
            + ", which oomless does not model")


def _tower_reached(spec: ModelSpec, run: dict[str, Any], targets: list[str]) -> set[str]:
    """The tower linears the estimate wraps for these language targets (memory.vision)."""
    from ..config import RunConfig
    from ..memory.vision import tower_plan

    cfg = RunConfig(model=str(run.get("model")), method=run.get("method", "lora"),
                    lora={**run["lora"], "targets": targets}, data={"images_per_sample": 1},
                    vision={"freeze_tower": False})
    plan = tower_plan(spec, cfg)
    return set(plan.lora) if plan else set()


def resolve_regex_targets(run: dict[str, Any], spec: ModelSpec, reading: Reading) -> None:
    """Replace a regex ``lora.targets`` by the names it reaches in the model's tree."""
    from ..memory.vision import _TOWER_ALIASES

    targets = run["lora"]["targets"]
    try:
        pattern = re.compile(targets)
    except re.error as err:
        raise ConfigError(f"LoRA target_modules '{targets}' is not a valid regular "
                          f"expression ({err}); PEFT compiles it with re.fullmatch") from None
    family = reading.facts.get("family")
    names, others = _model_tree(str(run.get("model")), family)
    if names is None:
        raise _refuse(targets, spec, f"oomless cannot build {spec.name}'s module tree here "
                      "(its code ships with the checkpoint: a local model folder with "
                      "--trust-remote-code builds it)")
    reached = _parts_reached(targets, others)
    if reached:
        raise _refuse(targets, spec, f"it can match module names under {', '.join(reached)}, "
                      f"which {spec.name}'s own code builds and oomless cannot list without it "
                      "(a local model folder with --trust-remote-code builds the whole tree)")
    prefixes = _prefixes(family)
    parts = split_by_part(tuple(n for n in names if pattern.fullmatch(n)), prefixes)
    if not any(parts.values()):
        raise ConfigError(f"LoRA target_modules '{targets}' matches no linear module of "
                          f"{spec.name} (PEFT raises 'Target modules ... not found')")
    _refuse_unmodelled(targets, spec, parts)
    _refuse_partial(targets, spec, parts["language"], split_by_part(names, prefixes)["language"])
    language = sorted({n.rsplit(".", 1)[-1] for n in parts["language"]})
    _refuse_partial(targets, spec, parts["language"], split_by_part(names)["language"])
    tower = {_TOWER_ALIASES.get(n.rsplit(".", 1)[-1], n.rsplit(".", 1)[-1])
             for n in parts["vision tower"]}
    if not language:
        raise _refuse(targets, spec, "it reaches only the vision side "
                      f"({len(parts['vision tower'])} tower, {len(parts['projector'])} "
                      "projector linears), which oomless does not model without LoRA in the "
                      "language model")
    run["lora"] = {**run["lora"], "targets": language}
    frozen = (run.get("vision") or {}).get("freeze_tower")  # the tool froze it (freezeV)
    if spec.vision is not None and not frozen and _tower_reached(spec, run, language) != tower:
        if tower:
            raise _refuse(targets, spec, f"it reaches the vision tower's {', '.join(sorted(tower))}"
                          " but oomless models tower LoRA by the language targets' names")
    if spec.vision is not None and not frozen:  # nothing froze it: the expression decides
        run["vision"] = {**(run.get("vision") or {}), "freeze_tower": not tower}
    reading.notes.append(_note(targets, spec, parts, others, language))


def _note(targets: str, spec: ModelSpec, parts: dict[str, list[str]], others: dict[str, str],
          language: list[str]) -> str:
    counts = ", ".join(f"{len(v)} {k}" for k, v in parts.items() if v)
    built = (f"the module names of {spec.name} built on the meta device" if not others else
             f"{spec.name}'s language model built on the meta device; the expression can "
             f"match no name under {', '.join(others)}")
    return (f"LoRA target_modules '{targets}' (re.fullmatch on {built}): {counts} linears "
            f"({', '.join(language)})")


def lora_reach(spec: ModelSpec, cfg: RunConfig) -> str:
    """Where the LoRA targets land, by layer count: "LoRA on 40 language + 63
    vision-tower layers (query_key_value)" — PEFT matches the names in every module of
    the model, the vision tower's included — and what PEFT's modules_to_save trains next
    to them: "+ vision tower trained fully (modules_to_save vpm), copies of embed_tokens,
    resampler" ("" for full fine-tuning)."""
    from ..memory.states import lora_targets
    from ..memory.vision import copied_parts, tower_plan
    from ..models.saved_modules import saved_parts

    if cfg.method == "full":
        return ""
    targets = cfg.lora.targets
    try:
        language = spec.num_layers if lora_targets(spec, targets) else 0
    except ConfigError:
        language = 0
    plan = tower_plan(spec, cfg)
    names = "all linear layers" if targets == "all-linear" else ", ".join(targets)
    ckpt = ("" if plan is None or spec.vision.checkpointed or not cfg.grad_ckpt
            else ", tower not checkpointed")
    saved = saved_parts(spec, cfg.lora.modules_to_save) if cfg.lora.modules_to_save else ()
    copies = [p.name for p in saved if p.part != "vision tower"]
    tail = f", copies of {', '.join(copies)}" if copies else ""
    if "vision tower" in copied_parts(spec, cfg) and plan is not None:
        tower = next(p.name for p in saved if p.part == "vision tower")
        return (f"LoRA on {language} language layers ({names}) + vision tower trained fully "
                f"(modules_to_save {tower}{ckpt}){tail}")
    if plan is None:
        frozen = " (vision tower frozen)" if spec.vision and cfg.vision.freeze_tower else ""
        return f"LoRA on {language} language layers ({names}){frozen}{tail}"
    return (f"LoRA on {language} language + {spec.vision.num_layers} vision-tower layers "
            f"({names}{ckpt}){tail}")
