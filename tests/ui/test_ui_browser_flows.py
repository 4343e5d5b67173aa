"""The page as one flow in a real headless Chromium (issue 21): an OOM in Estimate →
Plan keeps the run → "open in Estimate" shows the same numbers; an error leaves no
old result; the Inference tab says what the CLI says; a copied address opened in
another browser shows the same view. Screenshots are saved under
``OOMLESS_UI_SHOTS`` when set (to look at them) and checked for drawn content.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest
from test_ui_browser import (
    CHROMEDRIVER,
    CHROMIUM,
    HEIGHT,
    WIDTH,
    assert_drawn,
    open_page,
    selenium,
    set_select,
    settled,
    wait_for,
)
from test_ui_flow_service import OOM_RUN

from oomless.ui import planning

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None or selenium is None,
    reason="chromium, chromedriver or selenium is not installed")]


def _driver(folder: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update",
                "--hide-scrollbars", f"--user-data-dir={folder}",
                f"--window-size={WIDTH},{HEIGHT}",
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


@pytest.fixture(scope="module")
def browsers(tmp_path_factory):
    first = _driver(tmp_path_factory.mktemp("chromium-a"))
    second = _driver(tmp_path_factory.mktemp("chromium-b"))  # "a colleague's browser"
    yield first, second
    first.quit()
    second.quit()


def shot(driver, tmp_path: Path, name: str, **kwargs) -> Path:
    folder = Path(os.environ.get("OOMLESS_UI_SHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    driver.save_screenshot(str(path))
    assert_drawn(path, **kwargs)
    return path


def type_into(driver, element_id: str, value: str) -> None:
    box = driver.find_element("id", element_id)
    box.clear()
    box.send_keys(value)


def done(driver, name: str, before: int) -> None:
    wait_for(lambda: driver.execute_script(f"return window.oomlessUI.done['{name}'] || 0")
             > before, what=f"the {name} request")


def count(driver, name: str) -> int:
    return driver.execute_script(f"return window.oomlessUI.done['{name}'] || 0")


def set_estimate_run(driver) -> None:
    set_select(driver, "method", OOM_RUN["method"])
    type_into(driver, "seq_len", str(OOM_RUN["seq_len"]))  # typed, beyond a slider step
    type_into(driver, "batch_size", str(OOM_RUN["batch_size"]))
    settled(driver)


def test_oom_in_estimate_then_plan_keeps_the_run_and_reopens_it(browsers, server_url,
                                                                 workspace, tmp_path):
    driver = browsers[0]
    open_page(driver, server_url)
    set_estimate_run(driver)
    assert driver.find_element("id", "verdict-badge").text == "OUT OF MEMORY"
    expected = planning.plan_view(workspace, {"knobs": OOM_RUN, "method": "keep"})

    driver.find_element("css selector", '#tabs button[data-tab="plan"]').click()
    assert driver.find_element("id", "plan-seq").get_attribute("placeholder") == "4096"
    before = count(driver, "plan")
    driver.find_element("id", "plan-run").click()
    done(driver, "plan", before)
    kept = driver.find_element("id", "plan-kept").text
    assert "sequence 4096, effective batch 8, method lora" in kept
    shown = driver.execute_script("return window.oomlessUI.lastPlan.plans")
    assert [p["device_peak_bytes"] for p in shown] == \
        [p["device_peak_bytes"] for p in expected["plans"]]
    cards = driver.find_elements("css selector", ".card.plan")
    assert "changed from your Estimate" in cards[0].text
    shot(driver, tmp_path, "plan-from-estimate", min_colours=60, min_coloured_share=0.003)

    cards[0].find_element("css selector", "button.open-estimate").click()
    settled(driver)
    estimate = driver.execute_script("return window.oomlessUI.lastEstimate")
    assert estimate["device_peak_bytes"] == expected["plans"][0]["device_peak_bytes"]
    assert driver.find_element("id", "verdict-badge").text in ("FITS", "TIGHT")
    assert driver.find_element("id", "seq_len").get_attribute("value") == "4096"
    shot(driver, tmp_path, "plan-opened-in-estimate")


def test_an_error_in_plan_clears_its_old_result(browsers, server_url):
    driver = browsers[0]
    open_page(driver, server_url)
    driver.find_element("css selector", '#tabs button[data-tab="plan"]').click()
    before = count(driver, "plan")
    shown_before = driver.execute_script("return window.oomlessUI.progressShown || 0")
    # a second click supersedes the first request (both in one script: the first cannot
    # have answered in between): one answer is drawn
    driver.execute_script("const b = document.getElementById('plan-run'); b.click(); b.click();")
    done(driver, "plan", before)
    assert driver.execute_script("return window.oomlessUI.superseded") >= 1
    assert driver.execute_script("return window.oomlessUI.progressShown") == shown_before + 2
    assert count(driver, "plan") == before + 1
    assert not driver.find_element("id", "plan-error").is_displayed()
    assert len(driver.find_elements("id", "plan-kept")) == 1
    assert driver.find_elements("css selector", ".card.plan")
    type_into(driver, "plan-effective", "1000000000000000")  # more than the CLI takes
    before = count(driver, "plan")
    driver.find_element("id", "plan-run").click()
    done(driver, "plan", before)
    assert "effective-batch" in driver.find_element("id", "plan-error").text
    assert not driver.find_elements("css selector", ".card.plan")


def test_the_inference_tab_shows_the_clis_vllm_budget(browsers, server_url, workspace, tmp_path):
    driver = browsers[0]
    open_page(driver, server_url)
    set_select(driver, "gpu", "rtx-a6000")
    settled(driver)
    driver.find_element("css selector", '#tabs button[data-tab="inference"]').click()
    before = count(driver, "inf")
    driver.find_element("id", "inf-run").click()
    done(driver, "inf", before)
    request = {"model": "qwen2.5-7b-instruct", "gpu": "rtx-a6000", "gpus": 1,
               "engine": "vllm", "seq_len": 2048, "max_new_tokens": 512, "max_num_seqs": 256,
               "kv_cache_dtype": "auto"}
    expected = planning.inference_view(workspace, request)
    shown = driver.execute_script("return window.oomlessUI.lastInference")
    assert shown["budget"] == expected["budget"]
    assert shown["engine_args"] == expected["engine_args"]
    numbers = driver.find_element("id", "inf-numbers").text
    assert f"{expected['budget']['num_blocks']:,}" in numbers
    assert driver.find_element("id", "inf-engine-args").text.strip() == \
        expected["engine_args_text"].strip()
    assert shlex.split(shown["command"])[:3] == ["oomless", "estimate", "--inference"]
    shot(driver, tmp_path, "inference-vllm", min_colours=60, min_coloured_share=0.003)


def test_a_copied_address_shows_the_same_view_in_another_browser(browsers, server_url,
                                                                 tmp_path):
    first, second = browsers
    open_page(first, server_url)
    set_estimate_run(first)
    first.find_element("id", "grad_ckpt").click()
    settled(first)
    first.find_element("css selector", "#est-command button.copy").click()
    command = first.execute_script("return window.oomlessUI.copied")
    assert command == first.execute_script("return window.oomlessUI.lastEstimate.command")
    address = first.current_url
    assert "seq_len=4096" in address and "grad_ckpt=1" in address
    view = first.execute_script("return window.oomlessUI.lastEstimate")

    open_page(second, address)
    again = second.execute_script("return window.oomlessUI.lastEstimate")
    assert again["device_peak_bytes"] == view["device_peak_bytes"]
    assert again["command"] == view["command"]
    assert second.find_element("id", "seq_len").get_attribute("value") == "4096"
    shot(second, tmp_path, "estimate-from-a-link")

    first.find_element("css selector", '#tabs button[data-tab="plan"]').click()
    before = count(first, "plan")
    first.find_element("id", "plan-run").click()
    done(first, "plan", before)
    plan_address = first.current_url
    assert "tab=plan" in plan_address
    second.get(plan_address)  # the plan tab reopens and plans the same run
    wait_for(lambda: second.execute_script("return window.oomlessUI.lastPlan"),
             what="the plan from the link")
    assert second.execute_script("return window.oomlessUI.lastPlan.plans") == \
        first.execute_script("return window.oomlessUI.lastPlan.plans")
