"""Regenerate docs/ui.png, the README's picture of `oomless ui`.

    python scripts/ui_screenshot.py

Starts `oomless ui`, opens it in headless Chromium (Selenium + chromedriver), sets
Qwen2.5-7B LoRA on one RTX 4090 with checkpointing and micro batch 4, and saves a
palette PNG of the Estimate tab.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "docs" / "ui.png"


def main() -> None:
    from PIL import Image
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, "-m", "oomless", "ui", "--port", "0"],
                            stdout=subprocess.PIPE, text=True, env=env)
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--hide-scrollbars", f"--user-data-dir={tempfile.mkdtemp()}",
                "--window-size=1280,1150", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        driver.get(proc.stdout.readline().split()[2])
        while not driver.execute_script("return window.oomlessUI && window.oomlessUI.updates"):
            time.sleep(0.1)
        driver.find_element("id", "grad_ckpt").click()
        driver.execute_script("const s = document.getElementById('batch_size'); s.value = 4;"
                              "s.dispatchEvent(new Event('input'));")
        time.sleep(3)  # the estimate and the knob-effects table
        with tempfile.TemporaryDirectory() as tmp:
            shot = Path(tmp) / "shot.png"
            driver.save_screenshot(str(shot))
            image = Image.open(shot).convert("RGB").quantize(colors=256)
            image.save(OUT, optimize=True)
    finally:
        driver.quit()
        proc.terminate()
        proc.wait(timeout=30)
    print(f"wrote {OUT} ({OUT.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
