"""`oomless ui` stays local unless opened on purpose, and refuses bad bodies with one line.

The probe of issue 18 (item 3): `--host 0.0.0.0` turned the Host check off, `/api/report`
opened any path and quoted a file back, a chunked upload passed the size limit, and
`batch_size: 1e300`, 100k-deep JSON and a lone surrogate gave HTTP 500.
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import pytest
from test_ui_server import _run_ui, post, request
from ui_helpers import start_server, stop_server, ui_extra_installed

from oomless.ui import guard, service


def test_listening_beyond_loopback_needs_allow_remote():
    pytest.importorskip("uvicorn")
    out = _run_ui("--host", "0.0.0.0", "--port", "0")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--allow-remote" in out.stderr and "token" in out.stderr


def test_the_host_allow_list_is_never_a_wildcard():
    for host in ("0.0.0.0", "::", "192.0.2.7", "127.0.0.1"):
        allowed = guard.allowed_hosts(host)
        assert "*" not in allowed and "attacker.example" not in allowed
        assert {"127.0.0.1", "localhost"} <= set(allowed)
    assert "192.0.2.7" in guard.allowed_hosts("192.0.2.7")
    assert "my-box.lan" in guard.allowed_hosts("0.0.0.0", ("my-box.lan",))


@pytest.fixture(scope="module")
def remote():
    if not ui_extra_installed():
        pytest.skip("the ui extra is not installed")
    proc, url, _s = start_server("--host", "0.0.0.0", "--allow-remote")
    parts = urlsplit(url)
    token = parts.query.removeprefix("token=")
    yield f"http://127.0.0.1:{parts.port}/", token
    assert "Traceback" not in stop_server(proc)


def test_remote_serving_needs_the_printed_token(remote):
    base, token = remote
    assert len(token) >= 32
    status, _h, body = request(base)
    assert status == 403 and b"token" in body
    status, _h, _b = request(f"{base}?token=wrong")
    assert status == 403
    status, headers, body = request(f"{base}?token={token}")
    assert status == 200 and b"oomless" in body
    cookie = headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    # the page's next requests carry the cookie, not the query
    status, _h, body = request(f"{base}api/choices", headers={"Cookie": cookie.split(";")[0]})
    assert status == 200 and json.loads(body)["models"]
    status, _h, _b = request(f"{base}api/estimate", json.dumps(service.page_defaults()).encode(),
                             {"content-type": "application/json"})
    assert status == 403
    # DNS rebinding: the right token under a foreign Host is still refused
    status, _h, _b = request(f"{base}?token={token}", headers={"Host": "attacker.example"})
    assert status == 400


def test_report_opens_run_folders_only_and_never_quotes_a_file(server_url, tmp_path):
    secret = tmp_path / "secrets.json"
    secret.write_text('{"api_key": "sk-THIS-MUST-NOT-LEAK", "breakdown": 1}\n')
    other = tmp_path / "notes.txt"
    other.write_text("password=THIS-MUST-NOT-LEAK\n")
    plain = tmp_path / "folder"
    plain.mkdir()
    (plain / "id_rsa").write_text("THIS-MUST-NOT-LEAK")
    broken = tmp_path / "run"
    broken.mkdir()
    (broken / "estimate.json").write_text("{oops THIS-MUST-NOT-LEAK")
    for path, says in ((secret, "could not be read"), (other, "neither a run folder"),
                       (plain, "is not a run folder"), (broken, "could not be read"),
                       ("/etc/passwd", "neither a run folder")):
        status, body = post(f"{server_url}api/report", {"path": str(path)})
        assert status == 400 and says in body["error"], body
        assert "LEAK" not in body["error"] and "\n" not in body["error"]


def _chunked_upload(url: str, total_bytes: int) -> tuple[int, int]:
    """Send up to ``total_bytes`` in whole chunks, never ending the body, until the
    server answers; (status, bytes sent before the answer came)."""
    import select

    parts = urlsplit(url)
    frame = b"%x\r\n%s\r\n" % (1_000_000, b"x" * 1_000_000)
    sent = 0
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(b"POST /api/diagnose HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        while sent < total_bytes and not select.select([sock], [], [], 0)[0]:
            try:
                sock.sendall(frame)  # blocking: a chunk is never cut in the middle
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                break  # the server stopped reading
            sent += 1_000_000
        answer = b""
        deadline = time.monotonic() + 30
        while b"\r\n" not in answer and time.monotonic() < deadline:
            answer += sock.recv(4096)
    return int(answer.split()[1]), sent


def test_a_chunked_upload_over_the_limit_is_refused_without_reading_it_all(server_url):
    status, sent = _chunked_upload(server_url, total_bytes=3 * guard.MAX_BODY_BYTES)
    assert status == 413
    # the server answered while the body was still coming (it never ends here)
    assert sent < 2 * guard.MAX_BODY_BYTES, sent


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("path, raw, says", [
    ("api/estimate", '{"model": "qwen2.5-7b-instruct", "batch_size": 1e300}', "--batch-size"),
    ("api/estimate", '{"model": "qwen2.5-7b-instruct", "seq_len": 1e400}', "infinity"),
    ("api/estimate", '{"model": "qwen2.5-7b-instruct", "batch_size": NaN}', "NaN"),
    ("api/estimate", '{"model": "qwen2.5-7b-instruct", "batch_size": 2.5}', "whole number"),
    ("api/estimate", '{"model": "qwen2.5-7b-instruct", "batch_size": true}', "batch_size"),
    ("api/estimate", '{"model": "\\ud800"}', "surrogate"),
    ("api/estimate", '{"model": ' + DEEP + "}", "nested too deeply"),
    ("api/estimate", '{"model_config": "x"}', "model_config"),
    ("api/estimate", '{"model": "qwen2.5-7b-instruct", "gpu": "t4", "gpus": [2]}', "gpus"),
    ("api/plan", '{"model": "qwen2.5-7b-instruct", "effective_batch": 1e300}', "--effective-batch"),
    ("api/plan", '{"model": "qwen2.5-7b-instruct", "headroom": "lots"}', "headroom"),
    ("api/check", '{"files": [5]}', "file 1"),
    ("api/check", '{"files": "x"}', "check reads"),
    ("api/diagnose", '{"log": ["x"]}', "expected text"),
    ("api/diagnose", b'{"log": "\xff"}', "UTF-8"),
    ("api/report", '{"path": {"a": 1}}', "expected text"),
    ("api/effects", "[1, 2]", "JSON object"),
])
def test_every_bad_body_is_a_4xx_with_one_line(server_url, path, raw, says):
    body = raw if isinstance(raw, bytes) else raw.encode()
    status, _h, answer = request(server_url + path, body, {"content-type": "application/json"})
    assert 400 <= status < 500, (status, answer[:300])
    message = json.loads(answer)["error"]
    assert says in message and "\n" not in message and "Traceback" not in message, message


def test_the_page_refuses_a_batch_the_cli_refuses(workspace, capsys):
    from oomless.cli import main
    from oomless.errors import OomlessError

    request_ = {**service.page_defaults(), "batch_size": 10 ** 35}
    capsys.readouterr()
    cli_code = main(["estimate", request_["model"], "--batch-size", str(10 ** 35)])
    capsys.readouterr()
    if cli_code != 2:
        pytest.skip("the CLI does not refuse batch 10^35 yet (RunConfig's numeric caps)")
    with pytest.raises(OomlessError, match="batch"):
        service.estimate_view(workspace, request_)
