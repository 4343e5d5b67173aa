"""Speed of `oomless ui` (issue 14): cold start-up and how fast a moved knob redraws.

    python benchmarks/ui_speed.py [--repeat 5] [--updates 40] [--gradio-python PY]

Written to benchmarks/results/ui_speed.json and ui_speed.md:
- start-up: a fresh `python -m oomless ui --port 0` process, from launch to the
  page served (GET /), and to the first estimate answered (POST /api/estimate);
- update: in headless Chromium (Selenium + Debian's chromedriver), the micro batch
  slider set and its input event fired, to the stacked bar and the verdict redrawn,
  timed inside the page (performance.now); then the same request over HTTP alone,
  the adapter alone (oomless.ui.service.estimate_view) and the estimate alone
  (oomless.api.estimate); and the knob-effects table over HTTP;
- with --gradio-python (an interpreter with gradio installed): the cold start-up of
  a minimal Gradio Blocks app (one slider, one textbox), launch to page served,
  measured the same way, for the choice of framework.
Goals: start-up under 3 s; a knob moved to the chart redrawn under 200 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
GRADIO_APP = """
import gradio as gr
with gr.Blocks() as demo:
    batch = gr.Slider(1, 64, value=1, step=1, label="micro batch")
    out = gr.Textbox()
    batch.change(lambda v: str(v), batch, out)
demo.launch(server_name="127.0.0.1", server_port={port})
"""


def _stats(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"n": len(values), "median": round(statistics.median(values), 4),
            "p95": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 4),
            "min": round(ordered[0], 4), "max": round(ordered[-1], 4)}


def _wait_served(url: str, started: float, timeout_s: float = 300) -> float:
    while time.perf_counter() - started < timeout_s:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return time.perf_counter() - started
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"{url} was not served within {timeout_s} s")


def _post(url: str, payload: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(payload).encode(),
                                 {"content-type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=60) as response:
        return json.loads(response.read())


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


def bench_startup(repeat: int) -> dict:
    from oomless.ui.service import page_defaults

    page, first_estimate = [], []
    for _ in range(repeat):
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "oomless", "ui", "--port", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                env=_env())
        try:
            url = proc.stdout.readline().split()[2]
            page.append(_wait_served(url, started))
            _post(f"{url}api/estimate", page_defaults())
            first_estimate.append(time.perf_counter() - started)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return {"page_served_s": _stats(page), "first_estimate_s": _stats(first_estimate)}


def bench_gradio(python: str, repeat: int) -> dict:
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeat):
            port = 7900 + i
            app = Path(tmp) / "app.py"
            app.write_text(GRADIO_APP.replace("{port}", str(port)))
            started = time.perf_counter()
            proc = subprocess.Popen([python, str(app)], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, env={
                                        "PATH": os.environ.get("PATH", ""),
                                        "GRADIO_ANALYTICS_ENABLED": "False",
                                        "HF_HUB_OFFLINE": "1"})
            try:
                times.append(_wait_served(f"http://127.0.0.1:{port}/", started))
            finally:
                proc.terminate()
                proc.wait(timeout=30)
        version = subprocess.run([python, "-c", "import gradio; print(gradio.__version__)"],
                                 capture_output=True, text=True).stdout.strip()
    return {"gradio": version, "page_served_s": _stats(times)}


# One move of a person who then looks: the page is idle (the previous estimate and its
# knob-effects table done), the slider moves, the bar and verdict are redrawn.
MOVE_SLIDER = """
const done = arguments[arguments.length - 1], value = arguments[0];
const ui = window.oomlessUI, slider = document.getElementById('batch_size');
(function idle() {
  if (ui.busy || ui.effectsBusy) { setTimeout(idle, 20); return; }
  const before = ui.updates, t0 = performance.now();
  slider.value = value;
  slider.dispatchEvent(new Event('input'));
  (function poll() {
    if (ui.updates > before && !ui.busy) done([performance.now() - t0, ui.lastFetchMs]);
    else requestAnimationFrame(poll);
  })();
})();
"""


def _browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    profile = tempfile.mkdtemp(prefix="oomless-bench-")
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", f"--user-data-dir={profile}", "--window-size=1400,1000",
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


def bench_updates(updates: int) -> dict:
    from oomless.api import estimate
    from oomless.ui.service import Workspace, estimate_view, page_defaults, run_config

    proc = subprocess.Popen([sys.executable, "-m", "oomless", "ui", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=_env())
    ws = Workspace()
    try:
        url = proc.stdout.readline().split()[2]
        _wait_served(url, time.perf_counter())
        driver = _browser()
        try:
            driver.set_script_timeout(60)
            driver.get(url)
            while not driver.execute_script("return window.oomlessUI && window.oomlessUI.updates"):
                time.sleep(0.05)
            moves = [driver.execute_async_script(MOVE_SLIDER, 1 + i % 16)
                     for i in range(updates)]
            in_page = [total / 1000 for total, _fetch in moves]
            fetch_in_page = [fetch / 1000 for _total, fetch in moves]
        finally:
            driver.quit()
        knobs = [{**page_defaults(), "batch_size": 1 + i % 16} for i in range(updates)]
        http, effects, adapter, library = [], [], [], []
        for k in knobs:
            started = time.perf_counter()
            _post(f"{url}api/estimate", k)
            http.append(time.perf_counter() - started)
            started = time.perf_counter()
            estimate_view(ws, k)
            adapter.append(time.perf_counter() - started)
            cfg = run_config(ws, k)
            started = time.perf_counter()
            estimate(cfg)
            library.append(time.perf_counter() - started)
        for k in knobs[:10]:
            started = time.perf_counter()
            _post(f"{url}api/effects", k)
            effects.append(time.perf_counter() - started)
    finally:
        ws.close()
        proc.terminate()
        proc.wait(timeout=30)
    return {"knob_to_redraw_in_page_s": _stats(in_page),
            "of_which_answer_in_page_s": _stats(fetch_in_page),
            "estimate_over_http_s": _stats(http),
            "adapter_s": _stats(adapter), "api_estimate_s": _stats(library),
            "effects_over_http_s": _stats(effects)}


def _markdown(result: dict) -> str:
    rows = [("start-up: launch → page served", result["startup"]["page_served_s"]),
            ("start-up: launch → first estimate answered", result["startup"]["first_estimate_s"])]
    rows += [(f"update: {k.replace('_s', '').replace('_', ' ')}", v)
             for k, v in result["updates"].items()]
    if result.get("gradio"):
        rows.append((f"Gradio {result['gradio']['gradio']} minimal app: launch → page served",
                     result["gradio"]["page_served_s"]))
    m = result["machine"]
    lines = ["# `oomless ui` speed", "",
             f"{m['cpus']} CPU cores, load average {m['load_average']} at the start, "
             f"Python {m['python']}, {m['platform']}. Seconds (ms for updates); "
             "`python benchmarks/ui_speed.py` regenerates this file.", "",
             "| measure | median | p95 | min | max | n |", "|---|---|---|---|---|---|"]
    for name, s in rows:
        scale, unit = (1000, " ms") if name.startswith("update") else (1, " s")
        lines.append(f"| {name} | " + " | ".join(
            f"{s[k] * scale:.{1 if scale == 1000 else 2}f}{unit}"
            for k in ("median", "p95", "min", "max")) + f" | {s['n']} |")
    lines += ["", "Start-up: a fresh process each time, from launch to the page served, and to "
              "the first estimate answered. Update: a person's one move of the micro batch "
              "slider, the page idle before it, to the stacked bar and verdict redrawn in "
              "headless Chromium (\"of which answer\": until the server's answer arrived in "
              "the page); then the same estimate over HTTP, through the adapter alone and "
              "through `oomless.api.estimate` alone. Effects: the what-each-knob-does table "
              "(one estimate per alternative), fetched after the bar is drawn. The first "
              "adapter call imports the library's tabs (its max)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="cold starts measured")
    parser.add_argument("--updates", type=int, default=40, help="knob moves measured")
    parser.add_argument("--gradio-python", help="an interpreter with gradio, to compare")
    args = parser.parse_args()
    result = {"machine": {"cpus": os.cpu_count(), "load_average": [round(x, 2) for x in
                                                                   os.getloadavg()],
                          "python": platform.python_version(), "platform": platform.platform()},
              "startup": bench_startup(args.repeat), "updates": bench_updates(args.updates)}
    if args.gradio_python:
        result["gradio"] = bench_gradio(args.gradio_python, args.repeat)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ui_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "ui_speed.md").write_text(_markdown(result))
    print(_markdown(result))


if __name__ == "__main__":
    main()
