"""Sample token lengths from published summary statistics (mean ± std, min, max).

A dataset described only by its mean, standard deviation, minimum and maximum
does not fix a distribution: these shapes are assumptions, each stated in the
row that uses it, and the run is predicted under two of them to show how much the
prediction depends on the choice.

- ``truncnorm``: a normal truncated to [min, max] whose *truncated* mean and
  standard deviation equal the published ones (the underlying normal's location
  and scale solved for by Newton's method on the closed-form moments);
- ``lognormal``: a log-normal with the published mean and standard deviation,
  samples outside [min, max] redrawn (which moves the moments slightly; the
  achieved ones are reported).
"""

from __future__ import annotations

import math
import random


def _phi(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def truncnorm_moments(mu: float, sigma: float, lo: float, hi: float) -> tuple[float, float]:
    """Mean and standard deviation of N(mu, sigma) truncated to [lo, hi]."""
    a, b = (lo - mu) / sigma, (hi - mu) / sigma
    z = _cdf(b) - _cdf(a)
    mean = mu + sigma * (_phi(a) - _phi(b)) / z
    var = sigma ** 2 * (1 + (a * _phi(a) - b * _phi(b)) / z - ((_phi(a) - _phi(b)) / z) ** 2)
    return mean, math.sqrt(var)


def fit_truncnorm(mean: float, std: float, lo: float, hi: float) -> tuple[float, float]:
    """(mu, sigma) of the normal whose truncation to [lo, hi] has ``mean`` and ``std``."""
    mu, sigma = mean, std
    for _ in range(100):
        m, s = truncnorm_moments(mu, sigma, lo, hi)
        r = (m - mean, s - std)
        if abs(r[0]) < 1e-6 and abs(r[1]) < 1e-6:
            return mu, sigma
        h = 1e-3 * std
        m_mu, s_mu = truncnorm_moments(mu + h, sigma, lo, hi)
        m_sg, s_sg = truncnorm_moments(mu, sigma + h, lo, hi)
        j = ((m_mu - m) / h, (m_sg - m) / h, (s_mu - s) / h, (s_sg - s) / h)
        det = j[0] * j[3] - j[1] * j[2]
        mu -= (j[3] * r[0] - j[1] * r[1]) / det
        sigma = max(1e-3 * std, sigma - (-j[2] * r[0] + j[0] * r[1]) / det)
    raise ValueError(f"no truncated normal on [{lo}, {hi}] has mean {mean} and std {std}")


def sample_lengths(shape: str, n: int, mean: float, std: float, lo: int, hi: int,
                   seed: int = 0) -> list[int]:
    """``n`` integer lengths in [lo, hi] of the given shape (module docstring)."""
    rng = random.Random(seed)
    if shape == "truncnorm":
        mu, sigma = fit_truncnorm(mean, std, lo, hi)

        def draw() -> float:
            return rng.gauss(mu, sigma)
    elif shape == "lognormal":
        s2 = math.log(1 + (std / mean) ** 2)
        m_log, s_log = math.log(mean) - s2 / 2, math.sqrt(s2)

        def draw() -> float:
            return rng.lognormvariate(m_log, s_log)
    else:
        raise ValueError(f"shape '{shape}': expected truncnorm or lognormal")
    out: list[int] = []
    while len(out) < n:
        x = round(draw())
        if lo <= x <= hi:
            out.append(x)
    return out
