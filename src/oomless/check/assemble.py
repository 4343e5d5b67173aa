"""What the files say, assembled into what the estimate takes: the model's spec
(oomless.check.assemble.resolve), the GPUs (oomless.check.assemble.gpu_cluster) and the
RunConfig (oomless.check.assemble.run_config), with the command line's options
(oomless.check.assemble.CheckOptions) over the files' own values."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import RunConfig, build_run_config
from ..errors import ConfigError
from ..models.hardware import Cluster, parse_gpu_arg
from ..models.spec import ModelSpec
from . import foreign_keys as K
from .reading import ReadOptions, read_sources
from .scripts.decide import explicit_count
from .sources import Reading, load_source


@dataclass(frozen=True)
class CheckOptions:
    files: tuple[str, ...]
    gpu: str | None = None
    nodes: int | None = None
    model: str | None = None
    seq_len: int | None = None
    method: str | None = None
    images: int | None = None
    headroom: float = 0.10
    host_ram_gb: float | None = None
    strict: bool = False
    data: str | None = None


def read_files(opts: CheckOptions) -> Reading:
    sources = [load_source(f, "main") for f in opts.files]
    reading = read_sources(sources, ReadOptions(opts.model, opts.method, opts.seq_len))
    K.refuse_if_strict(reading.warnings, opts.strict, ", ".join(opts.files))
    return reading


def gpu_cluster(opts: CheckOptions, run: dict[str, Any]) -> Cluster:
    """The GPUs: --gpu over the file's hardware (a card named without a count takes the
    file's GPUs per node)."""
    hw = run.get("hardware") or {}
    host = round(opts.host_ram_gb * 1e9) if opts.host_ram_gb else None
    nodes = opts.nodes or hw.get("nodes", 1)
    if opts.gpu:
        cluster = parse_gpu_arg(opts.gpu, nodes=nodes, host_ram_bytes=host)
        if not explicit_count(opts.gpu) and hw.get("gpus_per_node"):
            cluster = Cluster(cluster.gpu, hw["gpus_per_node"], nodes, host)
        return cluster
    if hw.get("gpu"):
        return parse_gpu_arg(f"{hw['gpu']} x{hw.get('gpus_per_node', 1)}", nodes=nodes,
                             host_ram_bytes=host)
    raise ConfigError("oomless check needs the GPUs: --gpu NAME[xN] (e.g. --gpu 'a100-80gb x8')")


def run_config(reading: Reading, opts: CheckOptions, cluster: Cluster, spec: ModelSpec) -> RunConfig:
    run = dict(reading.run)
    if opts.model:
        run["model"] = opts.model
    if reading.facts.get("deepspeed") and "deepspeed" not in run:
        run["deepspeed"] = reading.facts["deepspeed"]  # the DeepSpeed file's ZeRO buffers
    if run.get("precision") == "bf16" and not cluster.gpu.bf16:
        run["precision"] = "fp16"  # bf16: auto / a card without bf16: the tools fall back
    _lora_targets(run, spec, reading)
    _saved_modules(run, spec, reading)
    if run.get("attn", "sdpa") == "sdpa" and not spec.sdpa_supported:
        run["attn"] = "eager"  # the model's code has no SDPA path (spec assumptions say why)
        reading.notes.append(f"{spec.name}'s code has no SDPA path: its attention runs eager "
                             "(--assumptions says why)")
    run["hardware"] = {**(run.get("hardware") or {}), "gpu": cluster.gpu.name,
                       "gpus_per_node": cluster.gpus_per_node, "nodes": cluster.nodes}
    if opts.images and spec.vision is None:
        raise ConfigError(f"--images {opts.images}: {spec.name} is a text model (no vision "
                          "tower) and cannot take images; drop --images")
    if spec.vision is not None:
        data = dict(run.get("data") or {})
        if opts.images is not None or not data.get("images_per_sample"):
            data["images_per_sample"] = 1 if opts.images is None else opts.images
        run["data"] = data
    main = reading.sources.get("main") or next(iter(reading.sources.values()))
    return build_run_config(run, str(main.path), main.lines)


def _lora_targets(run: dict[str, Any], spec: ModelSpec, reading: Reading) -> None:
    """Keep the LoRA targets that are linears of the language model's layers (a target
    in the vision tower or the projector is said, not counted)."""
    from ..memory.states import lora_targets

    targets = (run.get("lora") or {}).get("targets")
    if isinstance(targets, str) and targets != "all-linear":
        from .lora_names import resolve_regex_targets

        resolve_regex_targets(run, spec, reading)
        targets = run["lora"]["targets"]
    if not isinstance(targets, list):
        return
    kept = []
    for raw in targets:
        try:
            lora_targets(spec, [str(raw).rsplit(".", 1)[-1]])
            kept.append(str(raw).rsplit(".", 1)[-1])
        except ConfigError:
            note = f"LoRA target '{raw}' is not a linear of {spec.name}'s decoder layers: not counted"
            if note not in reading.assumptions:
                reading.assumptions.append(note)
    if kept:
        run["lora"] = {**run["lora"], "targets": kept}


def _saved_modules(run: dict[str, Any], spec: ModelSpec, reading: Reading) -> None:
    """The modules a tool's code trains next to LoRA (PEFT modules_to_save, recorded in
    facts["modules_to_save"]: MiniCPM-V finetune.py's embed_tokens and resampler, and vpm
    with --tune_vision) join the file's own ``lora.modules_to_save``; the estimate counts a
    trainable copy of each (oomless.models.saved_modules)."""
    saved = reading.facts.get("modules_to_save")
    if not saved or run.get("method") not in ("lora", "qlora"):
        return
    lora = dict(run.get("lora") or {})
    names = list(lora.get("modules_to_save") or [])
    run["lora"] = {**lora, "modules_to_save": names + [n for n in saved["names"]
                                                        if n not in names]}
    added = {n: f" (--{flag})" for n, flag in saved["added_by"].items()}
    reading.notes.append(
        f"{saved['who']} trains {', '.join(n + added.get(n, '') for n in saved['names'])} "
        "next to LoRA (PEFT modules_to_save: a trainable copy of each, counted)")


def resolve(reading: Reading, opts: CheckOptions) -> ModelSpec:
    """The model's spec. A local folder that is not on this machine ('./Qwen2.5-7B-Instruct')
    is read as the catalog model of the same name, with a note."""
    from ..api import resolve_model
    from ..errors import UnknownModelError
    from ..models.catalog import find_entry

    named = reading.run.get("model")
    model = opts.model or named
    if not model:
        raise ConfigError("no model: pass --model")
    if opts.model and named and named != opts.model:
        reading.notes.append(f"the file names the model '{named}'; checked as '{opts.model}' "
                             "(--model)")
    try:
        resolved = resolve_model(str(model))
        reading.facts["family"] = family_of(resolved.spec, resolved.entry)
        return as_the_trainer_builds(resolved.spec, resolved.original_config, reading,
                                     reading.facts["family"])
    except UnknownModelError as err:
        entry = find_entry(Path(str(model)).name)
        if entry is None or not str(model).startswith((".", "/", "~")):
            if opts.model:
                raise
            raise UnknownModelError(f"the file names the model '{model}', which oomless "
                                    "cannot resolve: pass --model NAME (a catalog model of the "
                                    f"same architecture) or --model path/to/config.json. {err}"
                                    ) from None
    reading.notes.append(f"'{model}' is not on this machine: read as the catalog model "
                         f"{entry.name} of the same name (--model to choose another)")
    reading.run["model"] = entry.name
    reading.facts["family"] = entry.family
    return as_the_trainer_builds(entry.spec, entry.config, reading, entry.family)


def family_of(spec: ModelSpec, entry: Any) -> str | None:
    """The catalog family of the checked model: its catalog entry's, else the one catalog
    family of its model_type (a local config.json)."""
    from ..models.catalog import family_of_model_type

    return entry.family if entry is not None and entry.family else family_of_model_type(
        spec.model_type)


def as_the_trainer_builds(spec: ModelSpec, config: dict[str, Any] | None,
                          reading: Reading, family: str | None) -> ModelSpec:
    """``spec`` as the file's trainer loads it: the config values the trainer's
    from_pretrained call passes (families.json ``trainer_builds`` of the family, by script
    tool or stack: MiniCPM-o built without the modules its init_* flags leave out); any
    other model unchanged."""
    from dataclasses import replace

    from ..models.families import family_facts
    from ..models.hf_config import spec_from_hf_config

    facts = family_facts(family or "")
    trainer = reading.facts.get("script_tool") or reading.run.get("stack")
    row = (facts.trainer_builds or {}).get(str(trainer)) if facts else None
    if config is None or row is None:
        return spec
    flags = row["config"]
    built = spec_from_hf_config(config | flags, spec.name, where=f"model '{spec.name}'")
    left_out = spec.param_count - built.param_count
    if left_out:
        given = ", ".join(f"{k}={v}" for k, v in flags.items())
        reading.notes.append(f"{spec.name} as {row['who']} loads it ({given}): the "
                             f"{left_out:,} parameters of the modules it does not build are "
                             "not counted")
    return replace(built, aliases=spec.aliases)
