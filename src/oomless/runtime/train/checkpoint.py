"""Checkpoints that resume exactly: weights, optimizer, scheduler, RNG, data position.

Layout: ``RUN/checkpoints/step-000012/`` holding the adapter (PEFT) or the
model (``save_pretrained``, safetensors), ``optimizer.pt``, ``scheduler.pt``,
``rng-rank{R}.pt`` (one per process; DeepSpeed: ``deepspeed/`` with each rank's
optimizer partition), ``trainer_state.json`` (run id, configuration, step,
current micro batch, checkpointing switch, sample schedule, fault-injection
state) and ``manifest.json`` (size and SHA-256 of every other file, written
last). Everything is written into a temporary folder that is renamed into
place, so a checkpoint either exists completely or not at all. Several
processes need a shared file system (rank 0 renames).

Loading runs no code from the folder: every ``.pt`` file is read with
``torch.load(weights_only=True)`` (the state is plain tensors, numbers and
lists), and DeepSpeed's files, which DeepSpeed unpickles itself, are first
read the same way with only DeepSpeed's own state classes allowed
(:func:`check_pickles`). A checkpoint whose files do not match its manifest is
skipped on resume in favour of an older one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...errors import ConfigError, OutputError
from ...fileio import new_temp_dir, publish_dir, sha256_file, write_json_atomic
from ...units import fmt_bytes

CHECKPOINTS = "checkpoints"
STATE = "trainer_state.json"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used (corrupt, incomplete, or not plain data)."""


class CheckpointWriteError(OutputError):
    """A checkpoint or the final weights could not be written (disk full, read-only)."""


# errno values that mean the file system refused the write, not a bug in the writer
_REFUSED = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO,
            errno.EFBIG}


def _free_bytes(folder: Path) -> int | None:
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _refusal(err: BaseException, free: int | None) -> int | None:
    """The errno with which the file system refused a write, or None (not a file-system
    error). torch's zip writer (caffe2 inline_container.cc) re-raises a failed write as a
    RuntimeError whose ``__context__`` is the OSError; safetensors reports it in its own
    type without the errno: a file system with no space left after the failure (a short
    write fills it) tells disk-full apart."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _REFUSED:
            return seen.errno
        seen = seen.__cause__ or seen.__context__
    return errno.ENOSPC if free == 0 else None


_FIX = {errno.ENOSPC: "free space", errno.EDQUOT: "free space (a disk quota is full)",
        errno.EROFS: "make the folder writable", errno.EACCES: "make the folder writable",
        errno.EPERM: "make the folder writable"}


@contextlib.contextmanager
def writing(tmp: Path, what: str, run_dir: Path) -> Iterator[None]:
    """Writes into ``tmp``; on a failure the temporary folder is removed and a write that
    the file system refused becomes one CheckpointWriteError naming it and the fix."""
    try:
        yield
    except BaseException as err:
        code = _refusal(err, _free_bytes(tmp if tmp.is_dir() else run_dir))
        shutil.rmtree(tmp, ignore_errors=True)
        if code is None or not isinstance(err, Exception):
            raise
        free = _free_bytes(run_dir)
        latest = latest_checkpoint(run_dir)
        resume = (f"`oomless train CONFIG --resume` continues from {latest.name}" if latest
                  else "start again (no checkpoint was written yet)")
        raise CheckpointWriteError(
            f"could not write {what} in '{run_dir}': {os.strerror(code)} "
            f"({type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}); the "
            "half-written folder was removed"
            + (f", {fmt_bytes(free)} free there now" if free is not None else "")
            + f". {_FIX.get(code, 'check the disk').capitalize()}, then {resume}") from None


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"step-{step:06d}"


def checkpoints_newest_first(run_dir: Path) -> list[Path]:
    """Published checkpoint folders (step-N with a trainer state), newest first."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / STATE).is_file()]
    return [p for _, p in sorted(found, reverse=True)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = checkpoints_newest_first(run_dir)
    return found[0] if found else None


def rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": [kind, keys.tolist(), pos, has_gauss, cached]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config")


def save_weights(model: Any, folder: Path) -> None:
    """The adapter (LoRA) or the whole model, safetensors."""
    model.save_pretrained(str(folder), safe_serialization=True)


def load_weights(model: Any, folder: Path) -> None:
    from safetensors.torch import load_file

    if _is_peft(model):
        from peft import set_peft_model_state_dict

        state = load_file(str(folder / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(model, state)
        bad = [k for k in getattr(result, "unexpected_keys", []) if "lora" in k]
        if bad:
            raise ConfigError(f"checkpoint '{folder}' does not match the LoRA settings "
                              f"(unexpected {bad[:3]}); resume with the same lora config")
        return
    state: dict[str, Any] = {}
    for shard in sorted(folder.glob("model*.safetensors")):
        state.update(load_file(str(shard)))
    missing, _ = model.load_state_dict(state, strict=False)
    tied = getattr(model.config, "tie_word_embeddings", False)
    if [k for k in missing if not (tied and k.endswith("lm_head.weight"))]:
        raise ConfigError(f"checkpoint '{folder}' lacks weights {missing[:3]}; "
                          "it belongs to a different model")


def prepare_tmp(run_dir: Path, step: int) -> Path:
    """Rank 0: a fresh, uniquely named temporary folder for the checkpoint of ``step``."""
    return new_temp_dir(run_dir / CHECKPOINTS, f"step-{step:06d}")


def write_rank_rng(tmp: Path, rank: int) -> None:
    import torch

    torch.save(rng_state(), tmp / f"rng-rank{rank}.pt")


def write_main(tmp: Path, scheduler: Any, state: dict[str, Any]) -> None:
    """Rank 0: scheduler, the trainer state, then the manifest of every file (last)."""
    import torch

    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    write_json_atomic(tmp / STATE, state)
    files = sorted(p for p in tmp.rglob("*") if p.is_file() and p.name != MANIFEST)
    write_json_atomic(tmp / MANIFEST, {str(p.relative_to(tmp)): [p.stat().st_size,
                                                                 sha256_file(p)]
                                       for p in files})


def verify(folder: Path) -> str | None:
    """Why ``folder`` cannot be trusted (a file missing, changed or torn), or None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"no readable {MANIFEST} (incomplete, or written before manifests)"
    if not isinstance(manifest, dict):
        return f"{MANIFEST} is not a JSON object"
    for name, entry in manifest.items():
        path = folder / name
        if not path.is_file() or path.is_symlink():
            return f"'{name}' is missing"
        if not (isinstance(entry, list) and len(entry) == 2):
            return f"{MANIFEST} entry of '{name}' is malformed"
        if path.stat().st_size != entry[0] or sha256_file(path) != entry[1]:
            return f"'{name}' differs from what was written (size or SHA-256)"
    return None


def safe_load(path: Path, allowed: tuple[Any, ...] = ()) -> Any:
    """``torch.load`` that runs no code: plain data only (plus ``allowed`` classes)."""
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError,
            AttributeError, TypeError) as err:
        first = (str(err).splitlines() or [type(err).__name__])[0][:200]
        raise CheckpointError(f"'{path.name}' is not plain saved state ({first}); "
                              "nothing in it was run") from None


def publish(run_dir: Path, tmp: Path, step: int, keep: int | None) -> Path:
    """Rank 0: rename the finished temporary folder into place; prune old ones."""
    final = publish_dir(tmp, checkpoint_dir(run_dir, step))
    if keep:
        prune(run_dir, keep)
    return final


def prune(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest ``step-N`` folders (``save_total_limit``); a
    symbolic link among them is left alone (nothing is deleted through a link) with a
    warning. Returns the links skipped."""
    root = run_dir / CHECKPOINTS
    steps = sorted((int(m.group(1)), p) for p in root.iterdir()
                   if (m := _STEP_DIR.match(p.name)))
    skipped = []
    for _step, old in steps[:-keep]:
        if old.is_symlink() or not old.is_dir():
            skipped.append(old)
            print(f"oomless: warning: {old} is a symbolic link or not a folder; not deleted "
                  "(save_total_limit deletes only the checkpoint folders it wrote)",
                  file=sys.stderr, flush=True)
            continue
        shutil.rmtree(old)
    return skipped


def check_pickles(folder: Path, allowed: tuple[Any, ...]) -> None:
    """Read every file under ``folder`` as :func:`safe_load` does, before a library that
    unpickles without restrictions (DeepSpeed) loads them: a file that holds anything
    but plain state and the ``allowed`` classes is refused unread."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        if path.suffix in (".pt", ".pth", ".bin") or not path.suffix:
            safe_load(path, allowed)


def read_state(folder: Path) -> dict[str, Any]:
    try:
        state = json.loads((folder / STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"'{folder / STATE}' is unreadable ({err})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"'{folder / STATE}' is not a JSON object")
    return state


def restore(folder: Path, scheduler: Any, rank: int) -> dict:
    """Load the scheduler and this rank's RNG (the engine loads weights and optimizer)."""
    rng_file = folder / f"rng-rank{rank}.pt"
    if not rng_file.is_file():
        raise ConfigError(f"checkpoint '{folder}' has no RNG state for rank {rank}; "
                          "resume with the same number of processes")
    scheduler_state = safe_load(folder / "scheduler.pt")
    rng = safe_load(rng_file)
    scheduler.load_state_dict(scheduler_state)
    set_rng_state(rng)
    return read_state(folder)


def seed_everything(seed: int) -> None:
    """The same seed for Python, NumPy and torch (every rank: identical initial replicas)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
