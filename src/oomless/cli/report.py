"""``oomless report RUN_DIR|ESTIMATE.json [--out FILE.html]``: one offline HTML report."""

from __future__ import annotations

import argparse

from ._options import FILE

ORDER = 60


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report",
        help="write one self-contained HTML report of a run or an estimate",
        description="Memory over the steps (allocated, reserved, peak, predicted), the "
        "predicted breakdown next to the measured peak, OOM and recovery events, the trace "
        "timeline and the configuration, as one HTML file that works offline.",
    )
    p.add_argument("source", metavar="RUN_DIR|ESTIMATE.json",
                   help="output_dir of `oomless train`, or a file from `oomless estimate --json`")
    p.add_argument("--out", "-o", type=FILE, metavar="FILE.html",
                   help="where to write (default: RUN_DIR/report.html or ESTIMATE.html)")
    p.add_argument("--estimate", metavar="ESTIMATE.json",
                   help="with a run folder: the estimate to compare against "
                   "(default: RUN_DIR/estimate.json when present)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing FILE.html that is not an oomless report "
                   "(kept as FILE.html.orig)")
    p.set_defaults(func=_run)


def _default_out(source: str) -> str:
    from pathlib import Path

    path = Path(source)
    if path.is_dir():
        return str(path / "report.html")
    return str(path.with_suffix(".html"))


def console_note(note: str) -> None:
    import sys

    print(f"note: {note}", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..report import load_report_data, report_inputs, write_report
    from ..units import fmt_bytes

    data = load_report_data(args.source, args.estimate)
    out = write_report(data, args.out or _default_out(args.source), force=args.force,
                       inputs=report_inputs(args.source, args.estimate))
    for note in data.notes:
        console_note(note)
    console = Console(stderr=False)
    parts = [f"{len(data.steps)} steps", f"{len(data.events)} events"]
    if data.measured_peak_bytes is not None:
        parts.append(f"measured peak {fmt_bytes(data.measured_peak_bytes)}")
    if data.predicted_peak_bytes:
        parts.append(f"predicted {fmt_bytes(data.predicted_peak_bytes)}")
    console.print(f"wrote {out} ({', '.join(parts)})", markup=False, highlight=False,
                  soft_wrap=True)
    return 0
