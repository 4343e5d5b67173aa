"""The Runs tab: `oomless report` of a run folder or an estimate JSON the user names
(torch-free, no web framework). It opens only what a report reads — a folder holding
memlog.jsonl, events.jsonl or estimate.json, or a .json estimate — and names a file it
cannot read without quoting it (it may hold secrets).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from ..errors import ConfigError, OomlessError
from .service import _text

MAX_ESTIMATE_JSON_BYTES = 50_000_000


def report_source(text: str) -> Path:
    """The path the Runs tab may open: a run folder (one holding a file `oomless report`
    reads) or an estimate JSON file; anything else is refused before it is read."""
    from ..report.data import ESTIMATE_NAMES, EVENT_NAMES, MEMLOG_NAMES

    path = Path(text).expanduser()
    if path.is_dir():
        names = MEMLOG_NAMES + EVENT_NAMES + ESTIMATE_NAMES
        if not any((path / n).is_file() for n in names):
            raise ConfigError(f"'{text}' is not a run folder: it holds none of "
                              f"{', '.join(names)}; give the output_dir of an `oomless train` "
                              "run or an `oomless estimate --json` file")
        return path
    if not path.exists():
        raise ConfigError(f"'{text}' does not exist; give a run folder or an estimate JSON "
                          "file")
    if path.suffix.lower() != ".json" or not path.is_file():
        raise ConfigError(f"'{text}' is neither a run folder nor a .json file; the Runs tab "
                          "opens run folders and `oomless estimate --json` files only")
    if path.stat().st_size > MAX_ESTIMATE_JSON_BYTES:
        raise ConfigError(f"'{text}' is larger than {MAX_ESTIMATE_JSON_BYTES:,} bytes: not "
                          "an estimate JSON")
    return path


def report_view(request: dict[str, Any]) -> dict[str, Any]:
    """`oomless report` of a run folder (or estimate JSON) the user names. A file that
    cannot be read is named with the kind of problem, never quoted (it may hold secrets);
    `oomless report` in a terminal prints the details."""
    from ..report import load_report_data, render_html

    text = _text(request, "path", "the run folder").strip()
    source = report_source(text)
    try:
        data = load_report_data(source)
    except OomlessError as err:
        raise type(err)(f"'{text}' could not be read as a run folder or an estimate JSON "
                        f"({type(err).__name__}); run `oomless report {text}` in a terminal "
                        "for the details") from None
    except OSError as err:
        raise ConfigError(f"'{text}' could not be read: {err.strerror}") from None
    summary = {"title": data.title, "steps": len(data.steps), "events": len(data.events),
               "ooms": sum(e.is_oom for e in data.events),
               "measured_peak_bytes": data.measured_peak_bytes,
               "measured_peak_label": data.measured_peak_label,
               "predicted_peak_bytes": data.predicted_peak_bytes,
               "gpu_memory_bytes": data.gpu_memory_bytes}
    return {"summary": summary, "html": render_html(data),
            "command": shlex.join(["oomless", "report", text])}

