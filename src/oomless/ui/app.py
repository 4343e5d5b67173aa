"""The web server of ``oomless ui``: one page and a JSON endpoint per tab.

Starlette routes and uvicorn serve (the ``ui`` extra). The page (static/) is
self-contained — its charts are plain SVG — so it works offline; the Runs tab
shows the report `oomless report` writes, which carries plotly.js inline.
Each POST /api/NAME takes a JSON object and answers the JSON of service.py's
function, or {"error": message} with status 400 for a user mistake (the same
message the CLI prints) and 500 for a fault (the details go to the server's log,
never to the page).

The server answers only requests addressed to this machine (a page elsewhere
cannot reach it through DNS rebinding), only JSON POSTs (a form on another site
cannot post to it without the browser asking first), and — when it listens
beyond loopback, which needs ``--allow-remote`` — only requests that carry its
token (guard.py).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import OomlessError
from . import guard, planning, runs, service

LOG = logging.getLogger("oomless.ui")
MAX_BODY_BYTES = guard.MAX_BODY_BYTES
# Out-of-range input reaching arithmetic (a number too large for a float, JSON the
# library nests too deeply): the user's request, not a fault of ours.
_INPUT_ERRORS = (OverflowError, RecursionError, UnicodeError)
_JS = "text/javascript; charset=utf-8"
_STATIC = {"index.html": "text/html; charset=utf-8", "style.css": "text/css; charset=utf-8",
           "common.js": _JS, "chart.js": _JS, "estimate.js": _JS, "tabs.js": _JS}
_HEADERS = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-store"}


def _static(name: str) -> bytes:
    return resources.files("oomless.ui").joinpath("static", name).read_bytes()


def _endpoint(call: Callable[..., dict[str, Any]], takes_ws: bool = True):
    async def endpoint(request: Request) -> Response:
        ws = request.app.state.workspace
        try:
            body = await guard.read_body(request, MAX_BODY_BYTES)
        except guard.BadBody as err:
            return JSONResponse({"error": str(err)}, err.status, headers=_HEADERS)
        try:
            result = await run_in_threadpool(call, ws, body) if takes_ws else \
                await run_in_threadpool(call, body)
        except OomlessError as err:
            return JSONResponse({"error": _one_line(str(err))}, 400, headers=_HEADERS)
        except _INPUT_ERRORS as err:
            LOG.warning("oomless ui: %s refused: %s", request.url.path, type(err).__name__)
            return JSONResponse({"error": "a value in the request is out of range (too large "
                                 "or nested too deeply)"}, 400, headers=_HEADERS)
        except Exception:  # a fault of ours: log it, show no traceback in the page
            LOG.exception("oomless ui: %s failed", request.url.path)
            return JSONResponse({"error": f"internal error in {request.url.path}; the "
                                 "server's log has the details (please report it)"}, 500)
        return JSONResponse(result, headers=_HEADERS)

    return endpoint


def _one_line(text: str) -> str:
    """The library's message as valid text (a lone surrogate of the input is shown escaped)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@contextlib.asynccontextmanager
async def _workspace(app: Starlette):
    """The uploads' folder lives while the server serves: removed at shutdown (Ctrl+C,
    SIGTERM), which uvicorn runs before it ends the process."""
    app.state.workspace = service.Workspace()
    try:
        yield
    finally:
        app.state.workspace.close()


def create_app(host: str = "127.0.0.1", token: str | None = None,
               extra_hosts: tuple[str, ...] = ()) -> Starlette:
    """The Starlette application; ``host``: the address it listens on; ``token``: the
    secret every request must carry (None: loopback only, no token)."""
    if token is None:
        guard.check_listen(host, allow_remote=False)
    pages = {name: _static(name) for name in _STATIC}
    choices: dict[str, Any] = {}  # built on the first request (the catalogs)

    async def page(request: Request) -> Response:
        name = request.path_params.get("name", "index.html")
        if name not in pages:
            return Response("not found", 404)
        return Response(pages[name], media_type=_STATIC[name], headers=_HEADERS)

    async def get_choices(request: Request) -> Response:
        if not choices:
            choices.update(await run_in_threadpool(service.choices))
        return JSONResponse(choices, headers=_HEADERS)

    async def no_icon(request: Request) -> Response:
        return Response(status_code=204)

    routes = [
        Route("/", page), Route("/favicon.ico", no_icon),
        Route("/static/{name}", page), Route("/api/choices", get_choices),
        Route("/api/estimate", _endpoint(service.estimate_view), methods=["POST"]),
        Route("/api/effects", _endpoint(service.knob_effects), methods=["POST"]),
        Route("/api/plan", _endpoint(planning.plan_view), methods=["POST"]),
        Route("/api/inference", _endpoint(planning.inference_view), methods=["POST"]),
        Route("/api/check", _endpoint(service.check_view), methods=["POST"]),
        Route("/api/diagnose", _endpoint(service.diagnose_view), methods=["POST"]),
        Route("/api/report", _endpoint(runs.report_view, takes_ws=False), methods=["POST"]),
    ]
    middleware = [Middleware(TrustedHostMiddleware,
                             allowed_hosts=guard.allowed_hosts(host, extra_hosts))]
    if token is not None:
        middleware.append(Middleware(guard.TokenGate, token=token))
    return Starlette(routes=routes, lifespan=_workspace, middleware=middleware)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket; a port in use is a user error, not a traceback."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise OomlessError(f"cannot listen on {host}:{port}: {err.strerror}; pass another "
                           "--port (or --port 0 for any free one)") from None
    sock.listen(128)
    return sock


def serve(host: str, port: int, announce: Callable[[str], None] = print,
          allow_remote: bool = False, extra_hosts: tuple[str, ...] = ()) -> None:
    """Serve until interrupted; ``announce`` gets the page's address once it listens
    (with ``?token=`` when it serves other machines: ``allow_remote``)."""
    import uvicorn

    guard.check_listen(host, allow_remote)
    token = None if guard.is_loopback(host) else guard.new_token()
    app = create_app(host, token, extra_hosts)
    sock = bind(host, port)
    shown = socket.gethostname() if host in guard.WILDCARDS else \
        f"[{host}]" if ":" in host else host
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    query = f"?token={token}" if token else ""
    announce(f"http://{shown}:{sock.getsockname()[1]}/{query}")
    threading.Thread(target=service.warm_up, name="oomless-ui-warm-up", daemon=True).start()
    uvicorn.Server(config).run(sockets=[sock])
