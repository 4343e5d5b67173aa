"""Checkpoints that resume exactly: weights, optimizer, scheduler, RNG, data position.

Layout: ``RUN/checkpoints/step-000012/`` holding the adapter (PEFT) or the
model (``save_pretrained``, safetensors), ``optimizer.pt``, ``scheduler.pt``,
``rng-rank{R}.pt`` (one per process; DeepSpeed: ``deepspeed/`` with each rank's
optimizer partition) and ``trainer_state.json`` (step,
current micro batch, checkpointing switch, sample schedule, fault-injection
state). Everything is written into a temporary folder that is renamed into
place, so a checkpoint either exists completely or not at all. Several
processes need a shared file system (rank 0 renames).
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ...fileio import new_temp_dir, publish_dir, write_json_atomic

CHECKPOINTS = "checkpoints"
STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"step-{step:06d}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / STATE).is_file()]
    return max(found)[1] if found else None


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
    """Rank 0: scheduler and the trainer state (written last)."""
    import torch

    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    write_json_atomic(tmp / STATE, state)


def publish(run_dir: Path, tmp: Path, step: int, keep: int | None) -> Path:
    """Rank 0: rename the finished temporary folder into place; prune old ones."""
    final = publish_dir(tmp, checkpoint_dir(run_dir, step))
    if keep:
        root = run_dir / CHECKPOINTS
        steps = sorted(int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)))
        for old in steps[:-keep]:
            shutil.rmtree(checkpoint_dir(run_dir, old))
    return final


def read_state(folder: Path) -> dict[str, Any]:
    return json.loads((folder / STATE).read_text())


def restore(folder: Path, scheduler: Any, rank: int) -> dict:
    """Load the scheduler and this rank's RNG (the engine loads weights and optimizer)."""
    import torch

    scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=False))
    rng_file = folder / f"rng-rank{rank}.pt"
    if not rng_file.is_file():
        raise ConfigError(f"checkpoint '{folder}' has no RNG state for rank {rank}; "
                          "resume with the same number of processes")
    set_rng_state(torch.load(rng_file, weights_only=False))
    return read_state(folder)


def seed_everything(seed: int) -> None:
    """The same seed for Python, NumPy and torch (every rank: identical initial replicas)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
