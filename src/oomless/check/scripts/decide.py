""""Can't tell" instead of a guess.

A reader that meets what could change the method, the precision, the GPU count or
the length and cannot read it (a flag no table knows, a value computed when the
script runs) records it with :func:`cannot_tell`; :func:`settle` then either takes
the value from the oomless option the user passed (--method, --seq-len, --gpu
NAMExN, --model) or refuses with one line naming the key and that option.
"""

from __future__ import annotations

from typing import Any

from ...errors import CannotTellError, UnknownGPUError
from ..sources import Reading, Source
from .shell import Unknown

GPU_OPTION = "--gpu NAMExN (e.g. --gpu a100-80gbx8)"


def cannot_tell(reading: Reading, what: str, where: str, word: dict[str, str]) -> None:
    item = {"what": what, "where": where, "topic": word["topic"], "settles": word["settles"]}
    if item not in reading.facts.setdefault("undecided", []):
        reading.facts["undecided"].append(item)


def gpu_count(src: Source, reading: Reading) -> None:
    """The launcher's GPU processes per node into the run (or an undecided GPU count)."""
    launch = src.command.launch
    gpus = launch.gpus
    if isinstance(gpus, int):
        reading.run["hardware"] = {**(reading.run.get("hardware") or {}), "gpus_per_node": gpus}
        reading.notes.append(f"{src.path}:{launch.command.line}: `{launch.launcher}` starts "
                             f"{gpus} GPU process{'es' if gpus > 1 else ''} per node")
    elif isinstance(gpus, Unknown):
        cannot_tell(reading, gpus.describe(), f"{src.path}:{launch.command.line}",
                    {"topic": "the GPU count", "settles": GPU_OPTION})


def explicit_count(gpu: str | None) -> bool:
    """Whether --gpu names a count ('a100-80gbx8'), not only a card ('a100-80gb')."""
    from ...models.hardware import get_gpu

    if not gpu:
        return False
    try:
        get_gpu(gpu.strip())
    except UnknownGPUError:
        return True
    return False


def settle(reading: Reading, opts: Any) -> None:
    """Apply the options that settle what the reading could not decide; refuse the rest."""
    undecided = list(reading.facts.get("undecided", []))
    given = {"--method": getattr(opts, "method", None), "--seq-len": getattr(opts, "seq_len", None),
             "--model": getattr(opts, "model", None),
             GPU_OPTION: getattr(opts, "gpu", None) if explicit_count(
                 getattr(opts, "gpu", None)) else None}
    open_items = []
    for item in undecided:
        value = given.get(item["settles"])
        if value is None:
            open_items.append(item)
            continue
        reading.notes.append(f"{item['where']}: {item['what']}: {item['topic']} taken from "
                             f"{item['settles'].split()[0]} {value}")
    total = reading.facts.get("global_batch")
    if total and given[GPU_OPTION] and not (reading.run.get("hardware") or {}).get(
            "gpus_per_node"):
        from ...models.hardware import parse_gpu_arg

        gpus = parse_gpu_arg(given[GPU_OPTION]).gpus_per_node
        reading.run["grad_accum"] = max(1, total // (reading.run["micro_batch_size"] * gpus))
    mine = "script_tool" in reading.facts  # a script read by the meaning of its flags
    for option, key in (("--method", "method"), ("--seq-len", "seq_len")):
        if given[option] and (mine or any(i["settles"] == option for i in undecided)):
            reading.run[key] = given[option]
    if open_items:
        first = open_items[0]
        more = (f" (and {len(open_items) - 1} more: "
                + ", ".join(i["what"] for i in open_items[1:]) + ")") if len(open_items) > 1 else ""
        raise CannotTellError(f"can't tell {first['topic']}: {first['what']} ({first['where']}); "
                              f"settle it with {first['settles']}{more}")
