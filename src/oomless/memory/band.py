"""The uncertainty band of an estimate and the three-valued fit verdict.

The band comes from ``benchmarks/published.py``: every row there compares an
``oomless estimate`` command with what someone measured on a real GPU. The band uses
the rows whose counter is known (max_memory_allocated / reserved, vLLM's profiler)
and the fit limits of real runs (the longest sequence that fitted a card), for a
configuration known at its peak (``band: true`` in benchmarks/published_rows.yaml); rows
that report a monitoring screenshot of unknown meaning, or whose peak batch is not
logged, are listed but not used. For a
prediction P and a measurement M the relative error is e = P / M − 1, so the true
value is M = P / (1 + e). Over the rows:

- ``HIGH_FACTOR`` = 1 / (1 + e_min): e_min is the largest under-estimate seen (or
  ``MIN_MARGIN`` when none is larger), so the upper bound covers the worst
  under-estimate of the benchmark;
- ``LOW_FACTOR`` = 1 / (1 + e_max): e_max is the largest over-estimate seen.

The verdict (result.fit_verdict): a configuration **fits** when the upper bound fits
the GPU, is **out of memory** when even the lower bound does not, and is **tight** in
between. A measurement (``oomless measure``) carries no band.

The numbers below are those of ``benchmarks/results/published.json``; the benchmark
prints them again, and tests/memory/test_band.py checks they agree with the committed
results.
"""

from __future__ import annotations

# largest under- and over-estimate of benchmarks/results/published.json (signed P / M − 1)
WORST_UNDER_ESTIMATE = -0.1268
WORST_OVER_ESTIMATE = 0.0816
MIN_MARGIN = 0.05  # the band is never narrower than ±5%: rows are few

HIGH_FACTOR = 1 / (1 + min(WORST_UNDER_ESTIMATE, -MIN_MARGIN))
LOW_FACTOR = 1 / (1 + max(WORST_OVER_ESTIMATE, MIN_MARGIN))

def band_bytes(device_peak_bytes: int, method: str = "analytic") -> tuple[int, int]:
    """(low, high) bytes around a predicted device peak; a measurement has no band."""
    if method == "measure":
        return device_peak_bytes, device_peak_bytes
    return round(device_peak_bytes * LOW_FACTOR), round(device_peak_bytes * HIGH_FACTOR)


def band_assumption() -> str:
    return (f"band: −{1 - LOW_FACTOR:.0%} / +{HIGH_FACTOR - 1:.0%} around the device peak, from "
            "the largest over- and under-estimate on published GPU measurements "
            "(benchmarks/results/published.md)")
