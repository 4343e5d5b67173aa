"""Find and read ``config.json``: a file, a model folder, or a model id in the local HF cache.

Offline only: the Hugging Face cache is read from disk, nothing is downloaded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import ModelConfigError, UnknownModelError


def hf_cache_dirs() -> list[Path]:
    """Where huggingface_hub keeps downloaded repos (HF_HUB_CACHE, HF_HOME/hub, ~/.cache)."""
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    xdg = os.environ.get("XDG_CACHE_HOME")
    dirs.append(Path(xdg) / "huggingface" / "hub" if xdg else Path.home() / ".cache/huggingface/hub")
    return dirs


def find_cached_config(model_id: str) -> Path | None:
    """config.json of ``org/name`` in the local HF cache (refs/main snapshot first), or None."""
    if model_id.count("/") != 1 or model_id.startswith((".", "/")):
        return None
    folder = "models--" + model_id.replace("/", "--")
    for cache in hf_cache_dirs():
        repo = cache / folder
        if not repo.is_dir():
            continue
        ref = repo / "refs" / "main"
        if ref.is_file():
            candidate = repo / "snapshots" / ref.read_text().strip() / "config.json"
            if candidate.is_file():
                return candidate
        snapshots = sorted(
            (repo / "snapshots").glob("*/config.json"), key=lambda p: p.stat().st_mtime
        )
        if snapshots:
            return snapshots[-1]
    return None


def read_config_file(path: Path) -> dict[str, Any]:
    """A config.json (UTF-8, size-bounded, valid JSON); failures name the file."""
    from ..fileio import read_json

    data = read_json(path, "a config.json (a JSON object)", ModelConfigError)
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: expected a JSON object (a config.json).")
    return data


def config_path_for(path_or_id: str) -> Path | None:
    """The config.json a local file, local folder or cached model id points at, or None."""
    path = Path(path_or_id).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if (path / "config.json").is_file():
            return path / "config.json"
        raise UnknownModelError(
            f"folder '{path_or_id}' has no config.json. Pass a model folder that holds "
            "config.json, the config.json file itself, or a catalog name (`oomless models`)."
        )
    return find_cached_config(path_or_id)


def locate_hf_config(path_or_id: str) -> Path:
    """The config.json a file, a model folder or a model id in the local HF cache names."""
    path = config_path_for(path_or_id)
    if path is None:
        caches = ", ".join(str(d) for d in hf_cache_dirs())
        raise UnknownModelError(
            f"'{path_or_id}' is neither a config.json file, a model folder, nor a model id "
            f"in the local Hugging Face cache ({caches}). oomless works offline: download "
            "the model (or just its config.json) first, or pass a catalog name (`oomless models`)."
        )
    return path


def load_hf_config(path_or_id: str) -> dict[str, Any]:
    """Read config.json from a file, a model folder, or a model id in the local HF cache (offline)."""
    return read_config_file(locate_hf_config(path_or_id))
