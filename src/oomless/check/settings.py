"""Settings read from the files that the estimate takes from elsewhere: the data's real
lengths (``check --data``), image sizes, and which read settings the estimator
does not model yet (said in the assumptions, never dropped silently).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from ..config import RunConfig
from ..errors import ConfigError
from ..models.hardware import Cluster
from ..models.spec import ModelSpec
from .sources import Reading

# Qwen2-VL / Qwen2.5-VL merge 2 × 2 patches into one language-model token
# (spatial_merge_size 2 in their vision configs).
SPATIAL_MERGE = 2


def _image_tokens(reading: Reading, spec: ModelSpec, data: dict[str, Any]) -> None:
    pixels = reading.facts.get("image_max_pixels")
    if not pixels or spec.vision is None or not spec.vision.dynamic_resolution:
        return
    per_token = (spec.vision.patch_size * SPATIAL_MERGE) ** 2
    data["image_tokens"] = max(1, math.ceil(pixels / per_token))
    reading.notes.append(f"image_max_pixels {pixels}: at most {data['image_tokens']} tokens per "
                         f"image ({per_token} pixels per token)")


def _data_lengths(reading: Reading, path: str, spec: ModelSpec, run: dict[str, Any]) -> None:
    from ..models.catalog import resolve_model
    from ..planner.datastats import profile_data

    cutoff = int(run.get("seq_len") or 2048)
    resolved = resolve_model(str(run["model"]))
    profile = profile_data(path, spec, resolved, "auto", seq_cap=None, images_per_sample=None)
    if not profile.lengths:
        raise ConfigError(f"--data '{path}': no records read")
    longest = max(profile.lengths)
    packing = bool((run.get("data") or {}).get("packing"))
    if packing or longest >= cutoff:
        reading.notes.append(f"--data: {profile.records} samples, longest {longest} tokens "
                             f"({profile.source}): batches are {cutoff} tokens "
                             f"({'packed' if packing else 'cut at the cutoff'})")
        return
    run["seq_len"] = longest
    reading.notes.append(f"--data: {profile.records} samples, p50 {profile.percentile(50)}, p99 "
                         f"{profile.percentile(99)}, longest {longest} tokens ({profile.source}): "
                         f"batches pad to the longest sample, so the peak is at {longest} tokens, "
                         f"not the cutoff {cutoff}")


def apply_data(reading: Reading, opts: Any, spec: ModelSpec) -> Reading:
    """A reading whose run uses the data file's real lengths and the image size cap."""
    run = dict(reading.run)
    data = dict(run.get("data") or {})
    out = replace(reading, run=run, notes=list(reading.notes))
    _image_tokens(out, spec, data)
    run["data"] = data
    if getattr(opts, "data", None):
        if opts.model:
            run["model"] = opts.model
        _data_lengths(out, opts.data, spec, run)
    return out


# Settings the files hold that the estimator may not model yet: (label, dotted key,
# the value that means "not used").
_PROBES = (
    ("stage", "stage", "sft"),
    ("vision tower trained", "vision.freeze_tower", True),
    ("evaluation by generation", "eval.predict_with_generate", False),
    ("prompt length of generation", "data.max_input_length", None),
)


def unmodelled_settings(spec: ModelSpec, cfg: RunConfig, cluster: Cluster) -> list[str]:
    """'stage dpo is read but does not change the estimate (not modelled yet)' lines."""
    from ..memory import estimate_training

    def peak(c: RunConfig) -> tuple[int, dict[str, int]]:
        est = estimate_training(spec, c, cluster)
        return est.device_peak_bytes, est.phase_peaks()

    out: list[str] = []
    now = None
    for label, key, neutral in _PROBES:
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if value == neutral or (key == "vision.freeze_tower" and spec.vision is None):
            continue
        try:
            other = cfg.replace(**{key: neutral})
        except ConfigError:
            continue
        now = now or peak(cfg)
        if peak(other) == now:
            out.append(f"{label} ({key}: {value}) is read from the file but the estimator does "
                       "not model it yet: estimated as if it were not set")
    return out
