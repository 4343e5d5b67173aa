"""`oomless ui` as a process: what it serves, what it refuses, and how it fails."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from ui_helpers import FIXTURES, OOM_LOG, start_server, stop_server, ui_extra_installed

from oomless.ui import service


def request(url: str, body: bytes | None = None, headers: dict | None = None):
    req = urllib.request.Request(url, data=body, headers=headers or {},
                                 method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


def post(url: str, payload: dict) -> tuple[int, dict]:
    status, _headers, body = request(url, json.dumps(payload).encode(),
                                     {"content-type": "application/json"})
    return status, json.loads(body)


def test_serves_the_page_and_the_choices_from_this_machine_only(server_url):
    status, headers, body = request(server_url)
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert b"http" not in body, "the page loads nothing from elsewhere (offline)"
    for name in ("common.js", "chart.js", "estimate.js", "tabs.js", "style.css"):
        status, _h, body = request(f"{server_url}static/{name}")
        assert status == 200 and len(body) > 1000, name
    status, _h, body = request(f"{server_url}api/choices")
    choices = json.loads(body)
    assert status == 200 and choices == json.loads(json.dumps(service.choices()))


def test_an_estimate_over_http_is_the_adapter_estimate(server_url, workspace):
    knobs = {**service.page_defaults(), "batch_size": 2, "grad_ckpt": True}
    status, body = post(f"{server_url}api/estimate", knobs)
    assert status == 200
    assert body == json.loads(json.dumps(service.estimate_view(workspace, knobs)))


@pytest.mark.parametrize("path, payload, message", [
    ("api/estimate", {"model": "llama-9000", "gpu": "rtx-4090"}, "unknown model 'llama-9000'"),
    ("api/estimate", {"model": "qwen2.5-7b-instruct", "gpu": "rtx-9999"}, "unknown GPU"),
    ("api/estimate", {"model": "qwen2.5-7b-instruct", "batch_size": "many"},
     "argument --batch-size: expected a whole number, got 'many'"),
    ("api/check", {"files": [{"name": "t.yaml", "text": "a: [b\n"}], "gpu": "t4"},
     "'t.yaml' is not valid YAML"),
    ("api/diagnose", {"log": "all good\n"}, None),
    ("api/report", {"path": "/no/such/run"}, "does not exist"),
])
def test_bad_input_gets_a_message_never_a_traceback(server_url, path, payload, message):
    status, body = post(server_url + path, payload)
    text = json.dumps(body)
    assert "Traceback" not in text and "File \"" not in text
    if message is None:  # a log without an OOM is an answer
        assert status == 200 and body["found"] is False
    else:
        assert status == 400 and message in body["error"], body


def test_refuses_other_hosts_and_non_json_posts(server_url):
    status, _h, _b = request(server_url, headers={"Host": "attacker.example"})
    assert status == 400  # DNS rebinding: a page elsewhere cannot read ours
    status, _h, body = request(f"{server_url}api/diagnose", b"log=x",
                               {"content-type": "application/x-www-form-urlencoded"})
    assert status == 415 and b"application/json" in body
    status, _h, body = request(f"{server_url}api/diagnose", b"{not json",
                               {"content-type": "application/json"})
    assert status == 400 and b"not valid JSON" in body
    status, _body = post(f"{server_url}api/diagnose", [OOM_LOG.read_text()])
    assert status == 400


def test_uploads_are_removed_when_the_server_stops():
    import tempfile
    from pathlib import Path

    if not ui_extra_installed():
        pytest.skip("the ui extra is not installed")
    folders = set(Path(tempfile.gettempdir()).glob(".oomless-ui.*"))
    proc, url, _seconds = start_server()
    try:
        upload = {"name": "glm", "text": (FIXTURES / "configs" / "glm-4-9b-chat" /
                                          "config.json").read_text()}
        status, _body = post(f"{url}api/estimate", {"model_config": upload, "gpu": "t4"})
        assert status == 200
        assert set(Path(tempfile.gettempdir()).glob(".oomless-ui.*")) - folders
    finally:
        assert "Traceback" not in stop_server(proc)  # SIGTERM: a graceful stop
    assert set(Path(tempfile.gettempdir()).glob(".oomless-ui.*")) == folders


def test_listens_on_this_machine_only_by_default(server_url):
    assert server_url.startswith("http://127.0.0.1:")


def _run_ui(*args: str, code: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    program = code + f"from oomless.cli import main; raise SystemExit(main({['ui', *args]!r}))"
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120, env=env)


def test_a_port_in_use_is_a_clear_error():
    pytest.importorskip("uvicorn")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        out = _run_ui("--port", str(port))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "--port" in out.stderr


def test_without_the_ui_extra_it_says_how_to_install_it():
    block = ("import sys\nclass Block:\n    def find_spec(self, name, path=None, target=None):\n"
             "        if name.split('.')[0] in ('starlette', 'uvicorn'):\n"
             "            raise ImportError(name=name)\n"
             "sys.meta_path.insert(0, Block())\n")
    out = _run_ui(code=block)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "pip install 'oomless[ui]'" in out.stderr


LIGHT = """
import json, sys, contextlib, io
import oomless
from oomless.cli import build_parser, main
build_parser()
with contextlib.redirect_stdout(io.StringIO()):
    rc = main(["estimate", "qwen2.5-7b", "--gpu", "4090", "--json"])
heavy = sorted(m for m in ("starlette", "uvicorn", "selenium", "anyio", "plotly", "torch")
               if m in sys.modules)
print(json.dumps({"rc": rc, "heavy": heavy}))
"""


def test_the_cli_stays_light():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", LIGHT], capture_output=True, text=True,
                         check=True, env=env)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"rc": 0, "heavy": []}
