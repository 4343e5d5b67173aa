"""The supervisor's one door to ``oomless check`` and ``oomless diagnose``.

Everything ``oomless run`` needs from them goes through this module: reading
the command's configuration the way ``check`` reads it (LLaMA-Factory YAML,
GLM-4 YAML, a TrainingArguments JSON with its DeepSpeed JSON, or the
TrainingArguments flags of the command line, seen as such a JSON), checking
it before the start, diagnosing the log of a process that died, and writing a
fix with check's edit machinery into a copy of the configuration. The
user's files are read, never written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...check import foreign_keys as K
from ...check.checker import CheckOptions, apply_edits, check, edits_for
from ...check.readers_glm import read_glm4
from ...check.readers_hf import read_hf_deepspeed
from ...check.readers_lf import read_llamafactory
from ...check.sources import Source, detect_kind, load_source, source_from_text
from ...check.textedit import set_json, unified_diff
from ...config import RunConfig, build_run_config
from ...diagnose import diagnose_text
from ...errors import ConfigError, OomlessError
from ...fileio import write_atomic
from .command import Command, is_glm_finetune

TA_KEYS = K.keys_of(*K.TRAINING_ARGUMENTS)  # every version of TrainingArguments
SEQ_KEYS = ("max_seq_length", "max_length", "cutoff_len", "model_max_length")
EVAL_CAUSES = {"evaluation", "generation"}


@dataclass
class ConfigView:
    """A command's configuration as check reads it."""

    kind: str  # llamafactory | glm4 | hf-json | hf-args | none
    command: Command
    reading: Any = None  # check.sources.Reading
    cfg: RunConfig | None = None
    check_files: tuple[str, ...] = ()  # the files check reads (see check_text)
    check_text: str | None = None  # TrainingArguments JSON that check reads, written on demand
    output_dir: str | None = None
    model: str | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Change:
    """A fix that keeps the effective batch, as RunConfig keys."""

    changes: dict[str, Any]
    text: str
    phase: str  # train | eval


def _typed(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _flags_dict(cmd: Command) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, index in cmd.flags.items():
        if key not in TA_KEYS:
            continue
        if index < 0:
            out[key] = True
        else:
            word = cmd.argv[index]
            out[key] = _typed(word.partition("=")[2] if word.startswith(f"--{key}=") else word)
    return out


def _hf_view(cmd: Command, kind: str, data: dict[str, Any], src: Source,
             model: str | None) -> ConfigView:
    """A TrainingArguments view (keys of other dataclasses set aside) and the JSON check reads."""
    ta = {k: v for k, v in data.items() if k in TA_KEYS}
    model = model or data.get("model_name_or_path")
    seq = next((data[k] for k in SEQ_KEYS if isinstance(data.get(k), int)), None)
    ta_src = Source("training_args", src.path, src.text, src.fmt, ta, src.lines)
    reading = read_hf_deepspeed(ta_src, None, model or "unknown", None, seq)
    return ConfigView(kind, cmd, reading, check_text=json.dumps(ta, indent=2) + "\n",
                      output_dir=ta.get("output_dir"), model=model, notes=list(reading.notes))


def read_view(cmd: Command, model: str | None = None) -> ConfigView:
    """The configuration of ``cmd`` (kind 'none' with a note when there is none to read)."""
    try:
        view = _read(cmd, model)
    except OomlessError as err:
        return ConfigView("none", cmd, notes=[f"configuration not read: {err}"])
    if view.reading is not None:
        run = dict(view.reading.run)
        run["hardware"] = {"gpus_per_node": max(1, cmd.nproc)}
        view.cfg = build_run_config(run, "command")
    return view


def _read(cmd: Command, model: str | None) -> ConfigView:
    path = cmd.config_file
    if path is not None:
        src = load_source(path, "main")
        kind = detect_kind(src)
        if kind == "glm4":
            glm_model = model or (cmd.argv[cmd.positionals[1]] if is_glm_finetune(cmd) else None)
            reading = read_glm4(src, glm_model)
            ta = src.data.get("training_args") or {}
            return ConfigView("glm4", cmd, reading, check_files=(path,),
                              output_dir=ta.get("output_dir"), model=glm_model)
        if kind == "llamafactory":
            reading = read_llamafactory(src, model)
            return ConfigView("llamafactory", cmd, reading, check_files=(path,),
                              output_dir=src.data.get("output_dir"),
                              model=str(reading.run["model"]))
        if kind == "training_args":
            return _hf_view(cmd, "hf-json", src.data, src, model)
        raise ConfigError(f"'{path}' is a {kind} file; oomless run reads LLaMA-Factory and "
                          "GLM-4 YAML, TrainingArguments JSON and TrainingArguments flags")
    data = _flags_dict(cmd)
    if not data:
        raise ConfigError("the command has no configuration file and no TrainingArguments "
                          "flags to read")
    data.update({k: _typed(cmd.flag(k) or "") for k in ("model_name_or_path",) + SEQ_KEYS
                 if k in cmd.flags and cmd.flags[k] >= 0})
    text = json.dumps({k: v for k, v in data.items() if k in TA_KEYS}, indent=2) + "\n"
    src = source_from_text(Path.cwd() / "command-line.json", "training_args", text)
    return _hf_view(cmd, "hf-args", data, src, model)


# ---- check and diagnose ---------------------------------------------------------------
def check_view(view: ConfigView, gpu: str | None, folder: Path) -> Any:
    """check's verdict on the configuration (None when the model or GPU is unknown);
    a TrainingArguments view is written into ``folder`` for check to read."""
    if view.kind == "none" or not view.model or not gpu:
        return None
    if view.check_text is not None:
        path = folder / "training_args.json"
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(path, view.check_text)
        view.check_files = (str(path),)
    if "x" not in gpu.lower() and "*" not in gpu and view.command.nproc > 1:
        gpu = f"{gpu} x{view.command.nproc}"
    return check(CheckOptions(files=view.check_files, gpu=gpu, model=view.model))


def change_from_check(result: Any) -> Change | None:
    """The check's smallest change that fits, as a Change (None: fits or no fix)."""
    if result is None or result.fix is None:
        return None
    from ..train.preflight import config_changes

    new = RunConfig.model_validate(result.fix["config"])
    old = RunConfig.model_validate(result.config)
    changes = {k: b for k, (_a, b) in config_changes(old, new).items()
               if not k.startswith("hardware.")}
    text = ", ".join(f"{k} {v}" for k, v in changes.items())
    return Change(changes, f"predicted to fit: {text}", "train") if changes else None


def diagnose_log(text: str, view: ConfigView) -> Any:
    """diagnose's findings for a log (with the configuration when its model resolves)."""
    if view.cfg is not None and view.model:
        try:
            return diagnose_text(text, view.cfg.replace(model=view.model))
        except OomlessError:
            pass
    return diagnose_text(text)


def _divisor_at_most(total: int, limit: int) -> int:
    return max(d for d in range(1, max(1, limit) + 1) if total % d == 0)


@dataclass(frozen=True)
class Setting:
    """What a training OOM depends on that a relaunch can change: rows per forward and
    gradient checkpointing (the sequence length, model and GPU stay)."""

    micro_batch_size: int
    grad_ckpt: bool

    def covers(self, other: Setting) -> bool:
        """When this setting ran out of memory, ``other`` would too: as many rows per
        forward or more, and gradient checkpointing on only where it was on here too."""
        return other.micro_batch_size >= self.micro_batch_size and (
            self.grad_ckpt or not other.grad_ckpt)

    @property
    def text(self) -> str:
        return f"micro batch {self.micro_batch_size}" + (
            " with gradient checkpointing" if self.grad_ckpt else "")


def failed_settings(view: ConfigView, events: list[dict], phase: str) -> list[Setting]:
    """The training settings one attempt ran out of memory with: the configuration's own
    (a training OOM ended it) and each one the protected Trainer tried in-process
    (``oom``, ``oom_exit``, ``oom_unrecoverable`` events carry ``failed``)."""
    out = [Setting(**e["failed"]) for e in events
           if isinstance(e.get("failed"), dict) and e.get("phase", "train") == "train"]
    if view.cfg is not None and phase == "train":
        out.insert(0, Setting(view.cfg.micro_batch_size, view.cfg.grad_ckpt))
    return out


def oom_phase(diagnosis: Any, events: list[dict]) -> str:
    """train | eval: the protected Trainer's last OOM event, else diagnose's causes."""
    ooms = [e for e in events if e.get("event") in ("oom", "oom_exit", "eval_oom")]
    causes = {c.code for f in diagnosis.findings for c in f.causes}
    return ooms[-1].get("phase", "train") if ooms else (
        "eval" if causes & EVAL_CAUSES else "train")


def _ladder(micro: int, ckpt: bool, per_gpu: int, start: int) -> list[Setting]:
    """The relaunch settings in order: fewer rows per forward down to 1, then
    checkpointing on (the protected Trainer's order), from ``start`` rows."""
    out: list[Setting] = []
    if micro > 1:
        rows = _divisor_at_most(per_gpu, start)
        out.append(Setting(rows, ckpt))
        while rows > 1:
            rows = _divisor_at_most(per_gpu, rows // 2)
            out.append(Setting(rows, ckpt))
    if not ckpt:
        out.append(Setting(1, True))
    return out


def choose_change(view: ConfigView, diagnosis: Any, events: list[dict],
                  failed: list[Setting] = ()) -> Change | None:
    """The smallest change that keeps the effective batch, for the OOM that ended a run
    (evaluation or training), never a training setting that ``failed`` already covers."""
    cfg = view.cfg
    if cfg is None:
        return None
    ooms = [e for e in events if e.get("event") in ("oom", "oom_exit", "eval_oom")]
    if oom_phase(diagnosis, events) == "eval":
        current = cfg.eval_batch_size
        hints = [e["eval_batch_after"] for e in ooms if e.get("eval_batch_after")]
        new = min([current // 2, *hints])
        if current <= 1 or new < 1:
            return None
        return Change({"eval.batch_size": new}, f"eval batch {current} -> {new}", "eval")
    micro, per_gpu = cfg.micro_batch_size, cfg.micro_batch_size * cfg.grad_accum
    # the smallest change: half the micro batch, or less where the protected Trainer
    # already found in-process that less was needed
    limits = [micro // 2] + [e["micro_batch_after"] for e in ooms if e.get("micro_batch_after")]
    known = list(failed) or [Setting(micro, cfg.grad_ckpt)]
    pick = next((s for s in _ladder(micro, cfg.grad_ckpt, per_gpu, min(limits))
                 if not any(f.covers(s) for f in known)), None)
    if pick is None:
        return None
    why = "; tried and out of memory: " + ", ".join(dict.fromkeys(f.text for f in known))
    if pick.micro_batch_size == micro:
        return Change({"grad_ckpt": True}, "gradient checkpointing on (micro batch already "
                      f"{micro}){why}", "train")
    changes: dict[str, Any] = {"micro_batch_size": pick.micro_batch_size,
                               "grad_accum": per_gpu // pick.micro_batch_size}
    text = (f"micro batch {micro} -> {pick.micro_batch_size}, accumulation {cfg.grad_accum} "
            f"-> {per_gpu // pick.micro_batch_size} (effective batch unchanged)")
    if pick.grad_ckpt and not cfg.grad_ckpt:
        changes["grad_ckpt"] = True
        text += ", gradient checkpointing on"
    return Change(changes, text + why, "train")


# ---- writing the fix into copies ---------------------------------------------------------
def _flag_values(cmd: Command, changed: dict[str, Any]) -> tuple[dict[int, str], list[str]]:
    values: dict[int, str] = {}
    appended: list[str] = []
    for key, value in changed.items():
        text = str(value)
        index = cmd.flags.get(key)
        if index is None or index < 0:
            appended += [f"--{key}", text]
        elif cmd.argv[index].startswith(f"--{key}="):
            values[index] = f"--{key}={text}"
        else:
            values[index] = text
    return values, appended


def _copy(src: Source, text: str, folder: Path) -> Path:
    dest = folder / src.path.name
    if dest.resolve() == src.path.resolve():
        raise ConfigError(f"refusing to write over '{src.path}': give --run-dir elsewhere")
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(dest, text)
    return dest


def write_change(view: ConfigView, change: Change, folder: Path) -> tuple[Command, dict[str, str]]:
    """The command that runs with ``change``, its edited copies in ``folder``; unified diffs."""
    new = view.cfg.replace(**change.changes)
    texts = apply_edits(view.reading, edits_for(view.reading, new, view.cfg, ""))
    sources = view.reading.sources
    cmd = view.command
    diffs = {str(s.path): unified_diff(s.text, texts[r], s.path.name)
             for r, s in sources.items() if texts[r] != s.text}
    copies = {r: _copy(s, texts[r], folder) for r, s in sources.items()
              if texts[r] != s.text and not (view.kind == "hf-args" and r == "training_args")}
    values: dict[int, str] = {}
    appended: list[str] = []
    if view.kind == "hf-args":
        old = sources["training_args"].data
        changed = {k: v for k, v in json.loads(texts["training_args"]).items() if old.get(k) != v}
        if "deepspeed" in copies:
            changed["deepspeed"] = str(copies["deepspeed"])
        values, appended = _flag_values(cmd, changed)
        diffs = {k: v for k, v in diffs.items() if not k.endswith("command-line.json")}
        diffs["command line"] = "\n".join(f"--{k} {v}" for k, v in changed.items())
    else:
        if "deepspeed" in copies and "main" not in sources:  # TrainingArguments JSON
            main = copies.get("training_args") or sources["training_args"].path
            text = set_json(Path(main).read_text(), ("deepspeed",), str(copies["deepspeed"]))
            copies["training_args"] = _copy(sources["training_args"], text, folder)
        main_role = "main" if "main" in sources else "training_args"
        if main_role in copies:
            values[cmd.config_index] = str(copies[main_role])
    return cmd.with_values(values, appended), diffs
