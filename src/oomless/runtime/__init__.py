"""The only part of oomless that imports torch, transformers, peft and friends.

Import its modules lazily (inside functions) from the CLI and the core.

Importing this package (torch-free: ``logging`` only) silences one advisory that
bitsandbytes prints on every import on a CPU with AVX512-BF16 when the optional
``kernels`` package is absent (``bitsandbytes/backends/cpu/ops.py`` 0.50:
``logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: ...")``):
its 4-bit CPU matmul then falls back to its own code, which oomless's CPU paths use.
Only records of that logger starting with that text are dropped.
"""

from __future__ import annotations

import logging

BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
BNB_KERNELS_ADVICE = "Failed to load CPU gemm_4bit_forward"


def _not_kernels_advice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(BNB_KERNELS_ADVICE)


def quiet_bitsandbytes_kernels_advice() -> None:
    """Drop bitsandbytes' "install kernels" advisory (once per process)."""
    logger = logging.getLogger(BNB_CPU_LOGGER)
    if _not_kernels_advice not in logger.filters:
        logger.addFilter(_not_kernels_advice)


quiet_bitsandbytes_kernels_advice()
