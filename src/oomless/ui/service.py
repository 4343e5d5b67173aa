"""The one place the web page meets the library (torch-free, no web framework).

The Estimate, Check and Diagnose tabs call one function here (Plan and
Inference: planning.py; Runs: runs.py); each takes the page's JSON
request (a dict), calls the library's public entry points — the same ones the
command line calls — and returns plain JSON values. Nothing here models memory:
byte counts, verdicts, plans, fixes and diagnoses all come from the library.
User mistakes raise :class:`oomless.errors.OomlessError` with the library's own
message (the CLI prints the same text); the server shows it as is.

Uploads (a config.json, a configuration to check) live in a private temporary
folder, a :class:`Workspace`, removed when the server stops; messages never show
that folder's path.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shlex
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, get_args

from ..api import cluster_for, estimate
from ..config import RunConfig, Stack, Stage, build_run_config
from ..errors import ConfigError, OomlessError
from ..fileio import new_temp_dir, write_atomic
from ..units import fmt_bytes, fmt_count
from . import commands, views

MAX_UPLOAD_CHARS = 20_000_000  # one pasted log or file; the server refuses larger bodies
# The tabs import the library's heavier parts when first used (or when warm_up runs,
# after the server listens): the page is served sooner.
_TAB_MODULES = ("oomless.check.checker", "oomless.planner", "oomless.planner.writers",
                "oomless.diagnose", "oomless.diagnose.render", "oomless.report",
                "oomless.cli._options", "oomless.cli._render_plan")


def warm_up() -> None:
    """Import what the tabs use (run in the background once the server listens)."""
    import importlib

    for name in _TAB_MODULES:
        importlib.import_module(name)



class Workspace:
    """A private temporary folder for what the user uploads (removed by ``close``)."""

    def __init__(self) -> None:
        self.root = new_temp_dir(tempfile.gettempdir(), "oomless-ui")

    def folder(self, kind: str) -> Path:
        """A new folder of its own for one request (requests run in parallel threads)."""
        return Path(tempfile.mkdtemp(dir=self.root, prefix=f"{kind}-"))

    def save(self, folder: Path, name: str, text: str) -> Path:
        return write_atomic(folder / safe_name(name), text)

    def model_config(self, name: str, text: str) -> Path:
        """The uploaded config.json as a model folder named ``name``: one per content,
        kept while the server runs (every moved knob estimates the same upload)."""
        digest = hashlib.sha256(f"{name}\0{text}".encode()).hexdigest()[:16]
        folder = self.root / f"model-{digest}" / safe_name(name)
        path = folder / "config.json"
        if not path.exists():
            folder.mkdir(parents=True, exist_ok=True)
            write_atomic(path, text)
        return path

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    @contextmanager
    def clean_errors(self):
        """Library messages name the files read; show the uploaded names, not our folder."""
        try:
            yield
        except OomlessError as err:
            text = str(err)
            for folder in sorted(self.root.glob("*"), key=lambda p: -len(str(p))):
                text = text.replace(f"{folder}/", "")
            if text == str(err):
                raise
            raise type(err)(text) from None


def safe_name(name: str) -> str:
    """A plain file name for an uploaded file (its base name, odd characters replaced)."""
    base = Path(str(name).replace("\\", "/")).name.strip() or "upload"
    cleaned = "".join(c if c.isalnum() or c in "._-" else "_" for c in base).lstrip(".")
    return cleaned[:100] or "upload"


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{what}: expected an object with \"name\" and \"text\", got "
                          f"{type(value).__name__}")
    return value


def _text(request: dict[str, Any], key: str, what: str, required: bool = True) -> str:
    value = request.get(key) or ""
    if not isinstance(value, str):
        raise ConfigError(f"{what}: expected text, got {type(value).__name__}")
    if required and not value.strip():
        raise ConfigError(f"{what} is empty: paste it or choose a file")
    if len(value) > MAX_UPLOAD_CHARS:
        raise ConfigError(f"{what} is {len(value):,} characters; at most "
                          f"{MAX_UPLOAD_CHARS:,} are read")
    return value


def _number(request: dict[str, Any], key: str, kind: type = int) -> Any:
    """A number of the page as the CLI's option parser reads it: a whole number for an
    integer option (1e300 is not one), a finite one for a decimal option."""
    value = request.get(key)
    if value in (None, ""):
        return None
    if isinstance(value, bool) or isinstance(value, (list, dict)):
        raise ConfigError(f"'{key}': expected a number, got {value!r}")
    try:
        number = float(value) if kind is float else _whole(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"'{key}': expected a {'whole ' if kind is int else ''}number, "
                          f"got {str(value)[:40]!r}") from None
    if kind is float and number != number or number in (float("inf"), float("-inf")):
        raise ConfigError(f"'{key}': expected a finite number, got {str(value)[:40]!r}")
    return number


def _whole(value: Any) -> int:
    if isinstance(value, float):
        if not value.is_integer() or abs(value) > 2 ** 53:
            raise ValueError(value)
        return int(value)
    if isinstance(value, str) and len(value.strip()) > 40:
        raise ValueError(value)
    return int(value)


def gpu_text(request: dict[str, Any]) -> str | None:
    """The `--gpu` text ("rtx-4090 x2") the page's GPU and count stand for."""
    gpu = request.get("gpu")
    if not gpu:
        return None
    count = _number(request, "gpus") or 1
    return f"{gpu} x{count}" if count != 1 else str(gpu)


# ---- choices ---------------------------------------------------------------
def choices() -> dict[str, Any]:
    """What the page's lists offer: catalog models, GPUs, and every knob's values."""
    from ..config import Offload, Precision
    from ..knobs import ATTENTIONS, METHODS, OPTIMIZERS
    from ..models.catalog import list_models
    from ..models.hardware import gpu_catalog

    models = [{"name": e.name, "hf_id": e.hf_id, "aliases": list(e.aliases),
               "params": fmt_count(e.spec.param_count), "vision": e.spec.vision is not None,
               "moe": e.spec.is_moe} for e in list_models()]
    gpus = [{"name": g.name, "label": f"{g.display_name} ({fmt_bytes(g.memory_bytes)})",
             "memory_bytes": g.memory_bytes} for g in gpu_catalog().values()]
    return {
        "models": models, "gpus": gpus, "methods": list(METHODS),
        "precisions": list(get_args(Precision)), "optimizers": list(OPTIMIZERS),
        "attentions": list(ATTENTIONS), "offloads": list(get_args(Offload)),
        "zero": [0, 1, 2, 3], "stacks": list(get_args(Stack)), "stages": list(get_args(Stage)),
        "quant": ["nf4", "fp4", "int8"], "defaults": page_defaults(),
    }


DEFAULT_MODEL, DEFAULT_GPU = "qwen2.5-7b-instruct", "rtx-4090"


def page_defaults() -> dict[str, Any]:
    """The knobs' first values: RunConfig's own defaults, on a common model and GPU."""
    cfg = RunConfig(model=DEFAULT_MODEL)
    return {"model": DEFAULT_MODEL, "gpu": DEFAULT_GPU, "gpus": 1, "method": cfg.method,
            "precision": cfg.precision, "optim": cfg.optimizer, "quant": cfg.quantization.type,
            "batch_size": cfg.micro_batch_size, "grad_accum": cfg.grad_accum,
            "seq_len": cfg.seq_len, "grad_ckpt": cfg.grad_ckpt, "attn": cfg.attn,
            "lora_r": cfg.lora.r, "lora_targets": cfg.lora.targets if isinstance(
                cfg.lora.targets, str) else ",".join(cfg.lora.targets),
            "zero": cfg.zero, "offload": cfg.offload, "stack": cfg.stack, "stage": cfg.stage}


# ---- estimate --------------------------------------------------------------
def _model_text(ws: Workspace, request: dict[str, Any]) -> str:
    """A catalog name, or the path of the uploaded config.json saved in the workspace."""
    upload = request.get("model_config")
    if upload:
        upload = _object(upload, "model_config")
        text = _text(upload, "text", "config.json")
        return str(ws.model_config(str(upload.get("name") or "uploaded-model"), text))
    model = request.get("model")
    if not model or not isinstance(model, str):
        raise ConfigError("no model: pick one from the catalog or upload a config.json")
    return model.strip()


def _model(ws: Workspace, request: dict[str, Any]) -> tuple[str, str, bool]:
    """(model text the library reads, model the copied command shows, uploaded?)."""
    text = _model_text(ws, request)
    uploaded = bool(request.get("model_config"))
    return text, "./config.json" if uploaded else text, uploaded


def estimate_options(ws: Workspace, request: dict[str, Any],
                     kind_of: str = "estimate") -> argparse.Namespace:
    """The `oomless estimate` options the page's knobs stand for, read by its parser."""
    model, _shown, uploaded = _model(ws, request)
    return commands.parse(request, kind_of, model, uploaded)


def run_config(ws: Workspace, request: dict[str, Any]) -> RunConfig:
    """RunConfig through the CLI's own path (parser and run_config_from_args)."""
    from ..cli._options import run_config_from_args

    return run_config_from_args(estimate_options(ws, request))


def command_for(ws: Workspace, request: dict[str, Any], kind_of: str) -> str:
    return commands.command_line(request, kind_of, _model(ws, request)[1])


def estimate_view(ws: Workspace, request: dict[str, Any]) -> dict[str, Any]:
    """The estimate of the page's knobs: per-phase stacked groups, peak and verdict."""
    from ..check.checker import phase_device_bytes
    from ..models.catalog import resolve_model

    with ws.clean_errors():
        cfg = run_config(ws, request)
        est = estimate(cfg)
        cluster = cluster_for(cfg)
        device = phase_device_bytes(resolve_model(cfg.model).spec, cfg, cluster) \
            if cluster else None
    return views.estimate_payload(est.to_dict(), device, verdict_of(est),
                                  command_for(ws, request, "estimate"))


def verdict_of(est) -> dict[str, Any]:
    """The estimate's three-valued fit verdict (fits / tight / out of memory, from its
    uncertainty band: memory/band.py) and the band, as the page draws them."""
    from rich.text import Text

    from ..cli._render import verdict

    state = None if est.verdict is None else est.verdict.replace(" ", "-")
    return {"state": state, "low_bytes": est.low_bytes, "high_bytes": est.high_bytes,
            "text": Text.from_markup(verdict(est)).plain}


def knob_effects(ws: Workspace, request: dict[str, Any]) -> dict[str, Any]:
    """What changing each knob alone does to the device peak."""
    with ws.clean_errors():
        cfg = run_config(ws, request)
        base = estimate(cfg)
    rows = []
    for knob in views.knob_alternatives(request, cfg.to_dict()):
        try:
            est = estimate(run_config(ws, {**request, **knob[3]}))
        except OomlessError:  # not a valid combination (e.g. offload without ZeRO)
            continue
        rows.append(views.effect_row(knob, est.device_peak_bytes, verdict_of(est),
                                     base.device_peak_bytes))
    return {"base_bytes": base.device_peak_bytes, "rows": views.sort_effects(rows)}


# ---- check -----------------------------------------------------------------
def check_view(ws: Workspace, request: dict[str, Any]) -> dict[str, Any]:
    """`oomless check` of one uploaded file (or a DeepSpeed + TrainingArguments pair)."""
    from ..check.checker import CheckOptions, check
    from ..cli._render_check import read_as
    from ..cli._render_plan import change_text

    uploads = request.get("files") or []
    if not isinstance(uploads, list) or not 1 <= len(uploads) <= 2:
        raise ConfigError("check reads one configuration file, or a DeepSpeed JSON and a "
                          "TrainingArguments JSON: choose or paste one")
    uploads = [_object(u, f"file {i + 1}") for i, u in enumerate(uploads)]
    texts = [_text(upload, "text", f"file {i + 1}") for i, upload in enumerate(uploads)]
    folder = ws.folder("check")
    try:
        names: list[str] = []
        for i, (upload, text) in enumerate(zip(uploads, texts, strict=True)):
            name = safe_name(upload.get("name") or _pasted_name(text))
            names.append(f"{i + 1}-{name}" if name in names else name)
            ws.save(folder, names[-1], text)
        with ws.clean_errors():
            result = check(CheckOptions(
                files=tuple(str(folder / n) for n in names), gpu=gpu_text(request),
                model=_word(request, "model"), seq_len=_number(request, "seq_len"),
                method=_word(request, "method"), images=_number(request, "images"),
                headroom=_number(request, "headroom", float) or 0.10))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    fix_changes = [change_text(c) for c in result.fix["changes"]] if result.fix else []
    words = ["oomless", "check", *names, *commands.gpu_words(request)]
    words += [f"--{k.replace('_', '-')}={request[k]}" for k in ("model", "seq_len", "method")
              if request.get(k)]
    return views.check_payload(result.to_dict(), f"{folder}/", fix_changes,
                               read_as(result.config)) | {"command": shlex.join(words)}


def _word(request: dict[str, Any], key: str) -> str | None:
    value = request.get(key)
    return str(value) if value not in (None, "") else None


_LAUNCHERS = re.compile(r"^\s*(deepspeed|torchrun|accelerate\s+launch|python3?|llamafactory-cli"
                        r"|swift|axolotl)\s", re.MULTILINE)


def _pasted_name(text: str) -> str:
    """A pasted file's name by what it holds (check reads a file by its kind): JSON, a
    launch script (a #! line, or a deepspeed / torchrun / python … command), else YAML."""
    if text.lstrip().startswith("{"):
        return "pasted.json"
    if text.startswith("#!") or _LAUNCHERS.search(text):
        return "pasted.sh"
    return "pasted.yaml"


# ---- diagnose --------------------------------------------------------------
def diagnose_view(ws: Workspace, request: dict[str, Any]) -> dict[str, Any]:
    """`oomless diagnose` of a pasted log, optionally with the run's oomless.yaml and GPU."""
    from ..config import parse_yaml_with_lines
    from ..diagnose import diagnose_text
    from ..diagnose.render import _numbers, _title  # the CLI's own headings of a finding

    log = _text(request, "log", "the log")
    cfg = cluster = None
    with ws.clean_errors():
        config_text = _text(request, "config", "the run configuration", required=False)
        if config_text.strip():
            data, lines = parse_yaml_with_lines(config_text, "run configuration")
            cfg = build_run_config(data, "run configuration", lines)
        if request.get("gpu"):
            from ..diagnose.predict import choose_cluster

            cluster = choose_cluster(cfg, gpu_text(request), None)
        diagnosis = diagnose_text(log, cfg, cluster)
    count = len(diagnosis.findings)
    headings = []
    for i, finding in enumerate(diagnosis.findings, 1):
        numbers = _numbers(finding)
        headings.append((_title(finding, i, count).plain, numbers.plain if numbers else ""))
    words = ["oomless", "diagnose", "train.log", *commands.gpu_words(request)]
    if config_text.strip():
        words += ["--config", "oomless.yaml"]
    return views.diagnosis_payload(diagnosis.to_dict(), headings) | {
        "command": shlex.join(words), "hints": _stated(diagnosis.hints.to_dict())}


def _stated(hints: dict[str, Any]) -> dict[str, Any]:
    """The settings the log states (plain values; what it does not state is left out)."""
    return {k: v for k, v in hints.items() if isinstance(v, (int, float, str))}
