"""Intervals and tests for sweep reports and probes, small enough to read in one sitting.

- Proportions (scores that are all 0 or 1): the Wilson score interval.  Unlike the normal
  approximation it stays inside [0, 1] and keeps a width at 0/n and n/n (0/20 gives
  [0, 0.161], not 0 +- 0).  Tests pin it to SciPy's ``binomtest(...).proportion_ci("wilson")``.
- Other scores (a fluency measure, a probe's output): a percentile bootstrap of the mean, with a
  fixed seed so that a report reproduces exactly.
- Steering against random controls: with N control directions, each one eval, the one-sided
  Monte Carlo p-value ``(1 + #{controls scoring >= steering}) / (N + 1)``.  Its smallest value
  is 1 / (N + 1): 19 directions are needed before it can reach 0.05.
- Steering minus control, per question: a paired bootstrap (questions resampled, each with its
  steered score less the control directions' mean score on it).
- Dose-response, the one pre-specified test of a sweep: the least-squares slope of score on
  coefficient over every question answered at every coefficient, against a permutation null that
  shuffles each question's scores across the coefficients (so the questions' own difficulty is
  kept).  One test per layer, whatever the number of coefficients: no multiplicity to adjust.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
BOOTSTRAP_RESAMPLES = 10_000
SMALL_BOOTSTRAP_N = 5
"""At this many values or fewer a percentile bootstrap interval of the mean is too narrow (it
covers the true mean well below 95% of the time); reports say so beside it."""


@dataclass(frozen=True)
class Interval:
    """A point estimate with a 95% interval, and the method that gave it."""

    estimate: float
    low: float
    high: float
    method: str

    def __str__(self) -> str:
        return f"{self.estimate:.3f} [{self.low:.3f}, {self.high:.3f}]"


def wilson_interval(successes: int, n: int, z: float = Z95) -> Interval:
    """Wilson score interval for ``successes`` out of ``n``."""
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: need 0 <= successes <= n and n > 0, got {successes}/{n}")
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # at 0/n and n/n the bound is exactly 0 or 1, which rounding would miss
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return Interval(p, low, high, "Wilson score")


def bootstrap_interval(values: list[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> Interval:
    """Percentile bootstrap interval of the mean of ``values``."""
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0 or not np.isfinite(data).all():
        raise ValueError(f"bootstrap_interval: need finite values, got {data.size} values")
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, data.size, size=(resamples, data.size))].mean(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    return Interval(float(data.mean()), float(low), float(high), f"percentile bootstrap ({resamples} resamples)")


def mean_interval(values: list[float]) -> Interval:
    """Wilson for 0/1 values, else the bootstrap: the interval a report shows for one point."""
    if values and all(v in (0.0, 1.0) for v in values):
        return wilson_interval(int(sum(values)), len(values))
    return bootstrap_interval(values)


def control_p_value(steering: float, controls: list[float]) -> float:
    """One-sided Monte Carlo p-value of ``steering`` against the control directions' scores:
    the chance that a random direction of the same norm scores at least as high."""
    if not controls:
        raise ValueError("control_p_value: no control scores")
    return (1 + sum(c >= steering for c in controls)) / (len(controls) + 1)


def holm_adjusted(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment of ``p_values`` (in their order): the k-th smallest is multiplied
    by (m - k + 1), capped at 1 and made non-decreasing.  It bounds the chance of any false
    positive among the m tests, whatever their dependence."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


PERMUTATION_CHUNK = 500


@dataclass(frozen=True)
class SlopeTest:
    """A dose-response slope with its one-sided permutation p-value (slope > 0)."""

    slope: float
    p_value: float
    questions: int
    coefs: list[float]
    permutations: int
    method: str


def dose_response(scores: dict[object, dict[float, float]], permutations: int = 9_999, seed: int = 0) -> SlopeTest:
    """Slope of score on coefficient over the questions in ``scores`` ({question: {coef: score}})
    that were answered at every coefficient any of them has, and the one-sided p-value
    ``(1 + #{permuted slopes >= slope}) / (permutations + 1)`` with each question's scores shuffled
    across its coefficients."""
    coefs = sorted({c for by_coef in scores.values() for c in by_coef})
    complete = [by_coef for by_coef in scores.values() if all(c in by_coef for c in coefs)]
    if len(coefs) < 2 or not complete:
        raise ValueError(f"dose_response: need two coefficients and a question answered at all; got {coefs}")
    x = np.asarray(coefs, dtype=np.float64)
    y = np.asarray([[by_coef[c] for c in coefs] for by_coef in complete], dtype=np.float64)
    centred = (x - x.mean()) / ((x - x.mean()) ** 2).sum()  # slope = centred . mean over questions of y

    def slope(table: np.ndarray) -> np.ndarray:
        return table.mean(axis=-2) @ centred

    observed = float(slope(y))
    rng = np.random.default_rng(seed)
    exceed = 0
    for start in range(0, permutations, PERMUTATION_CHUNK):  # bounded memory for large sweeps
        count = min(PERMUTATION_CHUNK, permutations - start)
        shuffled = rng.permuted(np.broadcast_to(y, (count, *y.shape)), axis=-1)
        exceed += int((slope(shuffled) >= observed - 1e-12).sum())
    return SlopeTest(
        observed,
        (1 + exceed) / (permutations + 1),
        len(complete),
        coefs,
        permutations,
        f"least-squares slope, one-sided permutation test ({permutations} shuffles within questions, seed {seed})",
    )


def mcnemar_p_value(first_correct: list[bool], second_correct: list[bool]) -> float:
    """Exact two-sided McNemar test of two classifiers on the same samples: of the samples exactly
    one of them gets right, how unlikely so uneven a split is if each is as likely as the other."""
    if len(first_correct) != len(second_correct):
        raise ValueError("mcnemar_p_value: both classifiers must be scored on the same samples")
    only_first = sum(a and not b for a, b in zip(first_correct, second_correct, strict=True))
    only_second = sum(b and not a for a, b in zip(first_correct, second_correct, strict=True))
    n = only_first + only_second
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(only_first, only_second) + 1)) / 2**n
    return min(1.0, 2 * tail)
