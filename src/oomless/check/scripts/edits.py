"""A fix written back into a launch script read by oomless.check.scripts.reader: the
planner knobs a fix may change there (:func:`writable_knobs`) and the edits that write
them (:func:`script_edits`), in the flags the script writes and only where a flag's
value is one literal.
"""

from __future__ import annotations

from typing import Any

from ...config import RunConfig
from ..common import HF_KEYS, knob_edits
from ..readers_hf import launch_edits as llava_edits
from ..shellargs import BARE
from ..sources import Reading, Source
from . import flags as F


def writable_knobs(s: dict[str, F.Setting], tool: str | None, src: Source) -> tuple[str, ...]:
    """Planner knobs a fix may change in this script: those with a flag taking a value,
    and a bare flag (store_true) the fix can add. ZeRO and offload of a tool that takes
    them as flags (DeepSpeed-Chat, OpenRLHF) when the stage is a literal of the script."""
    out = ["micro_batch"]
    if "global_batch" not in s:
        out.append("grad_accum")
    bare = set(F.TOOLS[tool].get("bare_flags", ())) if tool else set()
    if "grad_ckpt" not in s or s["grad_ckpt"].key not in bare:
        out.append("grad_ckpt")
    elif s["grad_ckpt"].value is not True:
        out.append("grad_ckpt")  # a bare flag a fix adds (never removes)
    stage = s.get("zero_stage")
    if bare and stage is not None and literal_in_script(src, stage.key) and _flag_for(
            tool, ("offload_all", "offload_optimizer"), src):
        out.append("zero")
    return tuple(out)


def _flag_for(tool: str | None, meanings: tuple[str, ...], src: Source) -> str | None:
    """The tool's flag for one of ``meanings``, in the style the script writes (OpenRLHF's
    dotted ``--ds.zero_stage`` or the older ``--zero_stage``)."""
    dotted = any("." in key for key in src.data)
    rows = [r["flag"] for r in F.ROWS if tool in r["tools"] and r["meaning"] in meanings]
    return next((f for f in rows if ("." in f) == dotted), rows[0] if rows else None)


def literal_in_script(src: Source, key: str) -> bool:
    """Whether the flag's value is written as one literal a fix can edit (or is absent)."""
    arg = src.command.args.get(key) if src.command else None
    return arg is None or (len(arg.spans) == 1 and arg.spans[0] is not None)


def script_edits(cfg: RunConfig, old: RunConfig, reading: Reading,
                 model_type: str) -> list[tuple[str, tuple, Any]]:
    """The edits (file, key path, value) that write ``cfg``'s changes from ``old`` into
    the script (a LLaVA launch: oomless.check.readers_hf.launch_edits)."""
    if "script_tool" not in reading.facts:
        return llava_edits(cfg, old, reading, model_type)
    s = F.settings(reading.sources["main"].data, reading.facts["script_tool"])
    out: list[tuple[str, tuple, Any]] = []
    put = lambda key, value: out.append(("main", (key,), value))  # noqa: E731
    keys = {"micro": s["micro_batch"].key if "micro_batch" in s else HF_KEYS["micro"],
            "accum": s["grad_accum"].key if "grad_accum" in s else HF_KEYS["accum"],
            "grad_ckpt": s["grad_ckpt"].key if "grad_ckpt" in s else "gradient_checkpointing"}
    src = reading.sources["main"]
    bare = set(F.TOOLS[reading.facts["script_tool"] or ""].get("bare_flags", ())) if \
        reading.facts["script_tool"] else set()
    if "global_batch" in s:  # OpenRLHF: the accumulation follows from the global batch
        keys.pop("accum")
    if keys["grad_ckpt"] in bare:
        keys.pop("grad_ckpt")
        if cfg.grad_ckpt and not old.grad_ckpt:
            put(s["grad_ckpt"].key if "grad_ckpt" in s else "gradient_checkpointing", BARE)
    knob_edits(cfg, old,
               lambda key, value: put(key, value) if literal_in_script(src, key) else None, keys)
    _zero_edits(cfg, old, s, reading.facts["script_tool"], src, put)
    return out


def _zero_edits(cfg: RunConfig, old: RunConfig, s: dict[str, F.Setting], tool: str | None,
                src: Source, put: Any) -> None:
    """The stage written where the script writes it; offload turned on by the tool's bare
    flag (DeepSpeed-Chat --offload: optimizer, and parameters under ZeRO-3; OpenRLHF
    --adam_offload: the optimizer). A change the flags cannot say reads back differently
    and is not proposed (checker._written)."""
    if "zero_stage" not in s or not F.TOOLS[tool or ""].get("bare_flags"):
        return
    if cfg.zero != old.zero and literal_in_script(src, s["zero_stage"].key):
        put(s["zero_stage"].key, cfg.zero)
    if cfg.offload != old.offload and old.offload == "none":
        flag = _flag_for(tool, ("offload_all", "offload_optimizer"), src)
        if flag:
            put(flag, BARE)
