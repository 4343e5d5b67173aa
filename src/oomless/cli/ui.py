"""``oomless ui``: the estimate, plan, check, diagnosis and run reports in a local web page."""

from __future__ import annotations

import argparse

ORDER = 95


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ui", help="open the estimate, plan, check and diagnose in a local web page",
        description="Serve a local web page (offline, nothing leaves the machine): pick a "
        "model and GPUs and move the knobs to see each phase's memory and the verdict; plan "
        "the fastest configuration that fits and download its files; check an existing "
        "LLaMA-Factory / GLM-4 / DeepSpeed file and download the fix as a diff; diagnose an "
        "OOM log; open a run's report. Needs the ui extra: pip install 'oomless[ui]'.")
    p.add_argument("--port", type=int, default=7860, help="port (default 7860; 0: any free one)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; any "
                   "other address needs --allow-remote)")
    p.add_argument("--allow-remote", action="store_true",
                   help="serve other machines (with --host 0.0.0.0 or an address of this "
                   "machine): every request then needs the random token printed in the "
                   "address; the page can open run folders on this machine")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a further Host name the page may be reached by (repeatable), e.g. "
                   "a DNS name of this machine; this machine's own names are allowed")
    p.set_defaults(func=run)


def _require_ui_extra() -> None:
    from ..errors import OomlessError

    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise OomlessError(f"`oomless ui` needs the ui extra ({err.name} is not installed); "
                           "install it with: pip install 'oomless[ui]'") from None


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        from ..errors import ConfigError

        raise ConfigError(f"--port {args.port}: expected 0 to 65535")
    from ..ui.guard import check_listen

    check_listen(args.host, args.allow_remote)
    _require_ui_extra()
    from ..ui.app import serve

    def announce(url: str) -> None:
        print(f"oomless ui: {url} (Ctrl+C stops it)", flush=True)

    serve(args.host, args.port, announce, allow_remote=args.allow_remote,
          extra_hosts=tuple(args.allow_host))
    return 0
