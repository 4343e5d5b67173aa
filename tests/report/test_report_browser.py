"""The report opened in a real headless Chromium, offline: the charts are drawn.

Chromium comes from Debian's `chromium` package (.ci/run installs it). The
network is cut off (every host name resolves to nothing), so a chart that
needed a CDN would stay empty.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from report_fixtures import write_run_dir

from oomless.report import figures, load_report_data, write_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None and os.environ.get("CI"):
    raise RuntimeError("CI must have chromium for the report browser test (.ci/run installs it)")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")

WIDTH, HEIGHT = 1280, 2400


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}",
        "--host-resolver-rules=MAP * ~NOTFOUND", "--virtual-time-budget=10000", *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)


def _chart_dom(dom: str, div_id: str) -> str:
    """The DOM from this chart's div to the next chart's div."""
    starts = [m.start() for m in re.finditer(r'id="[\w-]+" class="plotly-graph-div', dom)]
    start = dom.index(f'id="{div_id}" class="plotly-graph-div')
    later = [s for s in starts if s > start]
    return dom[start:later[0] if later else len(dom)]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("browser")
    data = load_report_data(write_run_dir(tmp / "run"))
    return data, write_report(data, tmp / "report.html")


def test_every_chart_is_drawn_with_all_its_traces(report, tmp_path: Path) -> None:
    data, html_path = report
    dom = _chromium(tmp_path, "--dump-dom", html_path.as_uri()).stdout
    expected = {
        "memory-steps": ("scatter", len(figures.memory_figure(data).data)),
        "breakdown": ("bars", len(figures.breakdown_figure(data).data)),
        "timeline": ("scatter", len(figures.timeline_figure(data).data)),
        "training": ("scatter", len(figures.training_figure(data).data)),
    }
    for div_id, (kind, traces) in expected.items():
        chart = _chart_dom(dom, div_id)
        assert 'class="main-svg"' in chart, f"{div_id}: plotly drew no SVG"
        drawn = len(re.findall(rf'class="trace {kind}\b', chart))
        assert drawn == traces, f"{div_id}: {drawn} of {traces} traces drawn"
        if kind == "scatter":  # data lines have vertices (L/H/V); legend swatches are "h30"
            lines = re.findall(r'<path class="js-line" d="M([^"]*)"', chart)
            drawn_lines = [p for p in lines if re.search(r"[LHV]", p)]
            assert len(drawn_lines) >= traces, f"{div_id}: {len(drawn_lines)} lines drawn"
        else:
            bars = re.findall(r'<g class="point"><path d="M([^"]*)"', chart)
            assert len(bars) >= traces and all("V" in b for b in bars), f"{div_id}: no bars"


def test_screenshot_shows_coloured_charts(report, tmp_path: Path) -> None:
    from PIL import Image

    _, html_path = report
    shot = tmp_path / "report.png"
    _chromium(tmp_path, f"--screenshot={shot}", f"--window-size={WIDTH},{HEIGHT}",
              html_path.as_uri())
    image = Image.open(shot).convert("RGB")
    assert image.size == (WIDTH, HEIGHT)
    small = image.resize((WIDTH // 4, HEIGHT // 4))
    pixels = list(small.getdata())
    coloured = sum(1 for r, g, b in pixels if max(r, g, b) - min(r, g, b) > 60)
    assert len(set(pixels)) > 200, "the screenshot is nearly uniform: nothing was drawn"
    assert coloured > 0.02 * len(pixels), f"only {coloured} coloured pixels: charts missing"
