"""Fixtures of the `oomless ui` tests: the server as a user starts it, and a workspace."""

from __future__ import annotations

import pytest
from ui_helpers import start_server, stop_server, ui_extra_installed


@pytest.fixture(scope="module")
def server_url():
    if not ui_extra_installed():
        pytest.skip("the ui extra (starlette, uvicorn) is not installed")
    proc, url, _seconds = start_server()
    yield url
    err = stop_server(proc)
    assert "Traceback" not in err, err


@pytest.fixture
def workspace():
    from oomless.ui.service import Workspace

    ws = Workspace()
    yield ws
    ws.close()
