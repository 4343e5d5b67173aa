"""`oomless ui` driven in a real headless Chromium, as a person uses it.

Debian's chromium and chromedriver (.ci/run installs them), driven through
Selenium's WebDriver client. The network is cut off (every host name resolves
to nothing; the page is reached by its IP address), so anything that needed the
internet would stay empty. Screenshots are checked for drawn, coloured content.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ui_helpers import FIXTURES, LF_YAML, OOM_LOG

from oomless.diagnose import diagnose_text
from oomless.ui import service
from oomless.units import fmt_bytes

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
try:
    import selenium  # noqa: F401
except ImportError:
    selenium = None
if (CHROMIUM is None or CHROMEDRIVER is None or selenium is None) and os.environ.get("CI"):
    raise RuntimeError("CI must have chromium, chromedriver (.ci/run installs them) and "
                       "selenium (the dev extra) for the ui browser test")
# a headless Chromium per test (about 15 s together): with the longer checks (make test-slow)
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None or selenium is None,
                                 reason="chromium, chromedriver or selenium is not installed")]

WIDTH, HEIGHT = 1400, 1000


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    tmp = tmp_path_factory.mktemp("chromium")
    downloads = tmp / "downloads"
    downloads.mkdir()
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                f"--user-data-dir={tmp / 'profile'}", f"--window-size={WIDTH},{HEIGHT}",
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"):
        options.add_argument(arg)
    options.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                              "download.prompt_for_download": False})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.execute_cdp_cmd("Page.setDownloadBehavior",
                           {"behavior": "allow", "downloadPath": str(downloads)})
    driver.downloads = downloads
    yield driver
    driver.quit()


def wait_for(predicate, timeout_s: float = 60.0, what: str = "the page"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def settled(driver, key: str = "updates") -> int:
    """Wait until the page has answered every knob moved and drawn the result."""
    def quiet():
        before = driver.execute_script(f"return window.oomlessUI.{key}")
        time.sleep(0.4)
        after = driver.execute_script(f"return window.oomlessUI.{key}")
        busy = driver.execute_script("return window.oomlessUI.busy")
        return after if before == after and after and not busy else None
    return wait_for(quiet, what=f"the page's {key}")


def open_page(driver, url: str) -> None:
    driver.get(url)
    wait_for(lambda: driver.execute_script("return window.oomlessUI && window.oomlessUI.updates"),
             what="the first estimate")
    settled(driver)


def peak_bar(driver) -> tuple[int, bool, str]:
    """What the chart draws for the peak phase: the bytes of its stacked rectangles,
    whether the stack's top reaches above the GPU memory line, and the verdict badge."""
    stacked, above = driver.execute_script("""
        const peak = window.oomlessUI.lastEstimate.peak_phase;
        const rects = [...document.querySelectorAll('#est-chart rect.bar')]
            .filter((r) => r.dataset.category === peak && r.getBBox().height > 0);
        const top = Math.min(...rects.map((r) => r.getBoundingClientRect().top));
        const line = document.querySelector('#est-chart line.limit').getBoundingClientRect().top;
        return [rects.reduce((sum, r) => sum + Number(r.dataset.bytes), 0), top < line];""")
    return stacked, above, driver.find_element("id", "verdict-badge").text


def assert_drawn(png: Path, min_colours: int = 150, min_coloured_share: float = 0.02) -> None:
    """Not blank: many distinct colours, and a share of saturated (chart, badge) pixels."""
    from PIL import Image

    image = Image.open(png).convert("RGB")
    small = image.resize((image.width // 4, image.height // 4))
    pixels = list(small.getdata())
    coloured = sum(1 for r, g, b in pixels if max(r, g, b) - min(r, g, b) > 60)
    assert len(set(pixels)) > min_colours, f"{png.name} is nearly uniform: nothing drawn"
    assert coloured > min_coloured_share * len(pixels), f"{png.name}: {coloured} coloured pixels"


def set_select(driver, element_id: str, value: str) -> None:
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element("id", element_id)).select_by_value(value)


def test_moving_the_batch_slider_changes_the_bar_and_the_verdict(browser, server_url, tmp_path,
                                                                  workspace):
    from selenium.webdriver.common.keys import Keys

    open_page(browser, server_url)
    browser.find_element("id", "grad_ckpt").click()  # checkpointing on: batch 1 fits a 4090
    settled(browser)
    expected = {b: service.estimate_view(workspace, {**service.page_defaults(),
                                                     "grad_ckpt": True, "batch_size": b})
                for b in (1, 12)}
    assert peak_bar(browser) == (expected[1]["device_peak_bytes"], False, "FITS")
    shot = tmp_path / "estimate-fits.png"
    browser.save_screenshot(str(shot))
    assert_drawn(shot)

    slider = browser.find_element("id", "batch_size-range")
    slider.click()
    slider.send_keys(Keys.HOME)
    for _ in range(11):  # a person pressing → on the focused slider: batch 1 → 12
        slider.send_keys(Keys.ARROW_RIGHT)
    settled(browser)
    assert browser.find_element("id", "batch_size").get_attribute("value") == "12"
    assert peak_bar(browser) == (expected[12]["device_peak_bytes"], True, "OUT OF MEMORY")
    assert browser.find_element("id", "verdict-text").text in expected[12]["verdict"]["text"]
    shot = tmp_path / "estimate-oom.png"
    browser.save_screenshot(str(shot))
    assert_drawn(shot)

    settled(browser, "effectsUpdates")
    rows = browser.find_elements("css selector", "#effects tbody tr")
    assert rows, "the knob effects table is filled"
    halve = next(r for r in rows if r.text.startswith("micro batch 12 → 6"))
    halve.click()  # applying a row moves the knob
    settled(browser)
    assert browser.find_element("id", "batch_size").get_attribute("value") == "6"


def test_an_uploaded_config_json_is_the_model_estimated(browser, server_url, workspace):
    config = FIXTURES / "configs" / "glm-4-9b-chat" / "config.json"
    open_page(browser, server_url)
    browser.find_element("css selector", "#model-upload summary").click()
    browser.find_element("id", "model-file").send_keys(str(config))
    wait_for(lambda: browser.find_element("id", "model-json").get_attribute("value"),
             what="the file read into the box")
    browser.find_element("id", "model-use").click()
    settled(browser)
    assert "config.json: glm-4-9b-chat" in browser.find_element("id", "model-own").text
    shown = browser.execute_script("return window.oomlessUI.lastEstimate")
    request = {**service.page_defaults(),
               "model_config": {"name": "glm-4-9b-chat", "text": config.read_text()}}
    request.pop("model")
    expected = service.estimate_view(workspace, request)
    assert shown["model"] == "glm-4-9b-chat"
    assert shown["device_peak_bytes"] == expected["device_peak_bytes"]


def test_a_tight_verdict_and_its_band_have_their_place(browser, server_url):
    open_page(browser, server_url)
    browser.execute_script("""
        const d = structuredClone(window.oomlessUI.lastEstimate);
        d.verdict = {state: 'tight', text: 'TIGHT on rtx-4090: within the band',
                     low_bytes: d.device_peak_bytes * 0.9, high_bytes: d.device_peak_bytes * 1.1};
        return window.oomlessUI.renderEstimate(d);""")
    verdict = browser.find_element("id", "verdict")
    assert "tight" in verdict.get_attribute("class")
    assert browser.find_element("id", "verdict-badge").text == "TIGHT"
    assert "likely between" in browser.find_element("id", "verdict-band").text
    assert len(browser.find_elements("css selector", "#est-chart g.band line")) == 3


def test_check_a_real_llamafactory_yaml_and_download_a_diff_that_applies(browser, server_url,
                                                                         tmp_path):
    open_page(browser, server_url)
    set_select(browser, "gpu", "t4")
    browser.find_element("css selector", '#tabs button[data-tab="check"]').click()
    browser.find_element("id", "check-file").send_keys(str(LF_YAML))
    browser.find_element("id", "check-model").send_keys("llama-3.1-8b-instruct")
    browser.find_element("id", "check-run").click()
    button = wait_for(lambda: browser.find_elements("id", "check-download"), what="the fix")[0]
    assert browser.find_element("id", "check-badge").text == "OUT OF MEMORY"
    assert "+deepspeed:" in browser.find_element("id", "check-diff").text
    shot = tmp_path / "check.png"
    browser.save_screenshot(str(shot))
    assert_drawn(shot)

    button.click()
    diff = wait_for(lambda: [p for p in browser.downloads.glob("*.diff")], what="the download")[0]
    work = tmp_path / "apply"
    work.mkdir()
    shutil.copy(LF_YAML, work / LF_YAML.name)
    subprocess.run(["git", "apply", "--verbose", str(diff)], cwd=work, check=True,
                   capture_output=True)
    fixed = (work / LF_YAML.name).read_text()
    assert fixed != LF_YAML.read_text() and "deepspeed:" in fixed


def test_paste_an_oom_log_and_see_its_numbers(browser, server_url, tmp_path):
    open_page(browser, server_url)
    browser.find_element("css selector", '#tabs button[data-tab="diagnose"]').click()
    text = OOM_LOG.read_text()
    box = browser.find_element("id", "diag-log")
    browser.execute_script("arguments[0].focus()", box)
    browser.execute_cdp_cmd("Input.insertText", {"text": text})  # what a paste inserts
    assert box.get_attribute("value") == text
    browser.find_element("id", "diag-run").click()
    card = wait_for(lambda: browser.find_elements("css selector", ".card.event"),
                    what="the diagnosis")[0]
    event = diagnose_text(text).findings[0].event
    for key in ("requested_bytes", "free_bytes", "total_bytes", "allocated_bytes"):
        assert fmt_bytes(event.numbers[key]) in card.text, key
    assert "Cause:" in card.text
    shot = tmp_path / "diagnose.png"
    browser.save_screenshot(str(shot))
    assert_drawn(shot, min_colours=60, min_coloured_share=0.003)  # text, a button, a badge


def test_bad_input_shows_the_cli_message(browser, server_url):
    from selenium.webdriver.common.keys import Keys

    open_page(browser, server_url)
    def shown(box_id: str, start: str) -> str:
        def text():
            box = browser.find_element("id", box_id)
            return box.text if box.is_displayed() and start in box.text else None
        return wait_for(text, what=f"'{start}' in #{box_id}")

    open_page(browser, server_url)
    model = browser.find_element("id", "model")
    model.clear()  # an empty model is a mistake too, with its own message
    assert shown("est-error", "no model").startswith("no model: pick one")
    model.send_keys("llama-9000", Keys.ENTER)
    message = shown("est-error", "llama-9000")
    assert message.startswith("unknown model 'llama-9000'") and "Traceback" not in message
    # nothing of the previous model's result stays under the error
    assert not browser.find_element("id", "est-result").is_displayed()
    assert not browser.find_elements("css selector", "#est-chart rect, #effects tbody tr")
    assert browser.execute_script("return window.oomlessUI.lastEstimate") is None
    browser.find_element("css selector", '#tabs button[data-tab="check"]').click()
    browser.find_element("id", "check-text").send_keys("model_name_or_path: [x\n")
    browser.find_element("id", "check-run").click()
    message = shown("check-error", "YAML")
    assert "'pasted.yaml' is not valid YAML" in message and "Traceback" not in message


def test_the_runs_tab_opens_a_run_report(browser, server_url, tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "report"))
    from report_fixtures import write_run_dir

    run = write_run_dir(tmp_path / "run")
    open_page(browser, server_url)
    browser.find_element("css selector", '#tabs button[data-tab="runs"]').click()
    browser.find_element("id", "runs-path").send_keys(str(run))
    browser.find_element("id", "runs-run").click()
    frame = wait_for(lambda: [f for f in browser.find_elements("id", "runs-frame")
                              if f.is_displayed()], what="the report")[0]
    assert "30 steps" in browser.find_element("id", "runs-summary").text
    browser.switch_to.frame(frame)
    try:
        wait_for(lambda: browser.find_elements("css selector", "#memory-steps .main-svg"),
                 what="the report's memory chart")
    finally:
        browser.switch_to.default_content()
