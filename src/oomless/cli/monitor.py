"""``oomless monitor [--once] [--csv FILE] [--interval S]``: live GPU memory per GPU and process."""

from __future__ import annotations

import argparse

from ._options import POSITIVE, number

ORDER = 70


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "monitor",
        help="live per-GPU memory, utilisation and per-process memory (NVML)",
        description="Per-GPU memory and utilisation and per-process memory through NVML, with "
        "a warning when the GPUs of one job hold unequal memory. Exits 1 without an NVIDIA GPU.",
    )
    p.add_argument("--once", action="store_true", help="print one reading and exit")
    p.add_argument("--interval", type=number(0.0, 86_400.0, low_open=True), default=2.0, metavar="S",
                   help="seconds between readings (default 2)")
    p.add_argument("--csv", metavar="FILE", help="append every reading to this CSV file")
    p.add_argument("--count", type=POSITIVE, metavar="N", help="stop after N readings")
    p.set_defaults(func=_run)


def _table(snapshot, warnings: list[str]):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from ..units import fmt_bytes

    table = Table(title="GPU memory (NVML: what nvidia-smi shows)", title_justify="left")
    for column in ("GPU", "name", "used", "total", "used %", "util %", "processes"):
        table.add_column(column, justify="right" if column in {"used", "total"} else "left")
    for g in snapshot.gpus:
        share = g.used_bytes / g.total_bytes if g.total_bytes else 0.0
        style = "red" if share > 0.95 else "yellow" if share > 0.85 else ""
        procs = ", ".join(
            f"{p.pid} {p.name or '?'} {'?' if p.used_bytes is None else fmt_bytes(p.used_bytes)}"
            for p in g.processes
        ) or "-"
        util = "-" if g.utilization_pct is None else str(g.utilization_pct)
        table.add_row(str(g.index), Text(g.name), fmt_bytes(g.used_bytes),
                      fmt_bytes(g.total_bytes), Text(f"{100 * share:.0f}", style=style), util,
                      Text(procs))  # Text: process names are shown as is, never as markup
    return Group(table, *(Text(f"warning: {w}", style="yellow") for w in warnings))


def _check(args: argparse.Namespace) -> None:
    from ..errors import ConfigError

    if args.interval <= 0:
        raise ConfigError(f"--interval {args.interval}: expected seconds > 0, e.g. --interval 2")
    if args.count is not None and args.count < 1:
        raise ConfigError(f"--count {args.count}: expected at least 1 reading")


def _loop(nv, args: argparse.Namespace, console, log) -> None:
    import time

    from rich.live import Live

    from ..runtime.monitor import imbalance_warnings, sample_gpus

    count = 1 if args.once else args.count
    if count == 1:  # plain output: pipes and logs get one table, no live refresh
        snap = sample_gpus(nv)
        if log:
            log.write(snap)
        console.print(_table(snap, imbalance_warnings(snap)))
        return
    with Live(console=console, auto_refresh=False) as live:
        done = 0
        while count is None or done < count:
            snap = sample_gpus(nv)
            if log:
                log.write(snap)
            live.update(_table(snap, imbalance_warnings(snap)), refresh=True)
            done += 1
            if count is None or done < count:
                time.sleep(args.interval)


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..runtime.monitor import CsvLog, nvml

    _check(args)
    with nvml() as nv:  # no GPU: GPUUnavailableError, exit 1, no CSV file created
        log = CsvLog(args.csv) if args.csv else None
        try:
            _loop(nv, args, Console(), log)
        except KeyboardInterrupt:
            pass  # Ctrl-C ends a live view normally
        finally:
            if log:
                log.close()
    return 0
