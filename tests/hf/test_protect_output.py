"""What a user of protect() sees on the terminal (issue 18): the OOM line on a line of its
own above tqdm's bar (not glued to it), and a summary of what was changed at the end."""

from __future__ import annotations

import re

import pytest
from hf_helpers import hf_trainer

from oomless.hf import protect


def test_the_oom_line_is_not_glued_to_the_bar_and_a_summary_ends_the_run(
        tiny_model_dir, rows, tmp_path, capfd):
    trainer, _ = hf_trainer(tiny_model_dir, tmp_path, rows, max_steps=2, disable_tqdm=False)
    protect(trainer, inject="train:2")
    trainer.train()
    err = capfd.readouterr().err
    at = err.index("oomless: OOM at step 2")
    assert "it/s]" in err[:at]  # tqdm's bar was drawn before the OOM line ...
    assert err[at - 1] in "\r\n"  # ... which starts a line of its own
    summary = re.search(r"oomless: protect: (.*)", err).group(1)
    assert summary.startswith("1 training OOM(s) recovered: 2 of 4 rows per forward; the "
                              "effective batch (8) and its samples unchanged; logs in ")
    assert err[err.index("oomless: protect:") - 1] in "\r\n"


def test_the_summary_says_when_nothing_changed(tiny_model_dir, rows, tmp_path, capfd):
    trainer, _ = hf_trainer(tiny_model_dir, tmp_path, rows, max_steps=1)
    protect(trainer)
    trainer.train()
    assert "oomless: protect: no out-of-memory error, nothing changed; logs in " \
        f"{tmp_path / 'oomless'}" in capfd.readouterr().err


def test_only_bitsandbytes_kernels_advice_is_dropped():
    """bitsandbytes 0.50 logs it at import (backends/cpu/ops.py) on CPUs with AVX512-BF16
    without the `kernels` package; the same logger's other records still pass."""
    import logging

    from oomless.runtime import BNB_CPU_LOGGER

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger(BNB_CPU_LOGGER)
    logger.addHandler(handler)
    try:
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. "
                       "Please make sure you already `pip install kernels` and the kernels "
                       ">= 0.11.1", "No module named 'kernels'")
        logger.warning("another bitsandbytes warning")
    finally:
        logger.removeHandler(handler)
    assert seen == ["another bitsandbytes warning"]


@pytest.mark.slow  # a fresh interpreter importing bitsandbytes (and torch): 5-20 s
def test_importing_bitsandbytes_after_oomless_runtime_prints_no_advice():
    import subprocess
    import sys

    from test_protect_distributed import child_env

    out = subprocess.run([sys.executable, "-c", "import oomless.runtime, bitsandbytes"],
                         capture_output=True, text=True, env=child_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "gemm_4bit_forward" not in out.stderr
