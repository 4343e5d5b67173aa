"""What keeps `oomless ui` local unless the user opens it on purpose, and what it reads.

- **Hosts**: the server answers only requests whose ``Host`` header names this
  machine (loopback names, the address it listens on, and — when serving other
  machines — this machine's own names and addresses, plus ``--allow-host``): a
  page elsewhere cannot reach it through DNS rebinding. Always on.
- **Token**: listening on anything but loopback needs ``--allow-remote``, and then
  every request carries a random token (the printed address has it; the page
  keeps it in an HttpOnly, SameSite=Strict cookie). Requests without it get 403.
- **Body**: a JSON object, read in chunks and refused (413) as soon as it passes
  :data:`MAX_BODY_BYTES` (chunked uploads included, never buffered whole); JSON
  too deep, NaN/Infinity, or text that is not valid Unicode (a lone surrogate)
  is a 400 with one line.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import secrets
import socket
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qs

from ..errors import ConfigError

MAX_BODY_BYTES = 80_000_000  # a pasted log of 20 M characters, 4 UTF-8 bytes each
TOKEN_COOKIE = "oomless_token"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]", "::1")
WILDCARDS = ("0.0.0.0", "::", "")


class BadBody(ValueError):
    """A request body the server refuses: the status code and the one line it answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_listen(host: str, allow_remote: bool) -> None:
    """Listening beyond this machine is the user's explicit choice (``--allow-remote``)."""
    if not is_loopback(host) and not allow_remote:
        raise ConfigError(
            f"--host {host or repr(host)}: other machines could reach this page (it opens "
            "run folders and runs the planner); add --allow-remote to serve it anyway "
            "(every request then needs the token printed with the address), or keep the "
            "default --host 127.0.0.1")


def new_token() -> str:
    return secrets.token_urlsafe(24)


def allowed_hosts(host: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The Host header values answered (without port): never '*'."""
    names = set(LOOPBACK_NAMES) | {h.strip() for h in extra if h.strip()}
    if host not in WILDCARDS:
        names.add(f"[{host}]" if ":" in host else host)
    if not is_loopback(host):  # this machine's own names and addresses
        names |= _own_names()
    return sorted(names)


def _own_names() -> set[str]:
    names = {socket.gethostname(), socket.getfqdn()}
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None)
    except OSError:
        infos = []
    for info in infos:
        address = str(info[4][0])
        names.add(f"[{address}]" if ":" in address else address)
    return {n for n in names if n}


class TokenGate:
    """ASGI middleware: every request must carry the token (query ``token=``, the
    ``x-oomless-token`` header, or the cookie the first page load sets)."""

    def __init__(self, app: Any, token: str) -> None:
        self.app, self.token = app, token

    def _given(self, scope: dict) -> tuple[bool, bool]:
        """(has the token, came in the query: set the cookie)."""
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        if any(self._same(t) for t in query.get("token", [])):
            return True, True
        if self._same(headers.get("x-oomless-token", "")):
            return True, False
        cookie = SimpleCookie()
        try:
            cookie.load(headers.get("cookie", ""))
        except Exception:  # a malformed cookie header is no token
            return False, False
        morsel = cookie.get(TOKEN_COOKIE)
        return (morsel is not None and self._same(morsel.value)), False

    def _same(self, value: str) -> bool:
        return hmac.compare_digest(value.encode("utf-8", "replace"), self.token.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        ok, from_query = self._given(scope)
        if not ok:
            body = json.dumps({"error": "this oomless ui needs its token: open the address "
                               "`oomless ui --allow-remote` printed (it ends in ?token=…)"})
            await send({"type": "http.response.start", "status": 403,
                        "headers": [(b"content-type", b"application/json")]})
            return await send({"type": "http.response.body", "body": body.encode()})
        if not from_query:
            return await self.app(scope, receive, send)
        cookie = (f"{TOKEN_COOKIE}={self.token}; Path=/; HttpOnly; SameSite=Strict").encode()

        async def send_with_cookie(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"set-cookie", cookie)]}
            await send(message)

        return await self.app(scope, receive, send_with_cookie)


async def read_body(request: Any, limit: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """The request's JSON object, read chunk by chunk; refused past ``limit`` bytes."""
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        raise BadBody(415, "send the request as application/json")
    try:
        declared = int(request.headers.get("content-length") or 0)
    except ValueError:
        raise BadBody(400, "the Content-Length header is not a number") from None
    if declared > limit:
        raise BadBody(413, f"the request is larger than {limit:,} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:  # stop reading: the rest never reaches memory
            raise BadBody(413, f"the request is larger than {limit:,} bytes")
        chunks.append(chunk)
    return parse_body(b"".join(chunks))


def _refuse_constant(name: str) -> Any:
    raise BadBody(400, f"the request holds {name}, which is not a number JSON allows")


def parse_body(raw: bytes) -> dict[str, Any]:
    """A JSON object of valid Unicode text and finite numbers, or a BadBody."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadBody(400, "the request is not UTF-8 text") from None
    try:
        body = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise BadBody(400, "the request's JSON is nested too deeply") from None
    except ValueError as err:
        if isinstance(err, BadBody):
            raise
        raise BadBody(400, "the request is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadBody(400, "the request must be a JSON object")
    try:
        json.dumps(body, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except UnicodeEncodeError:
        raise BadBody(400, "the request holds text that is not valid Unicode (a lone "
                      "surrogate \\ud800–\\udfff)") from None
    except ValueError:  # 1e400 reads as infinity
        raise BadBody(400, "the request holds a number too large for JSON (infinity)") \
            from None
    except RecursionError:
        raise BadBody(400, "the request's JSON is nested too deeply") from None
    return body
