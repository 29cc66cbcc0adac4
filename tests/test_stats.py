"""Report statistics against known values: SciPy 1.17.1 computed the references
(``binomtest(k, n).proportion_ci(0.95, method="wilson")`` and ``bootstrap(..., method="percentile")``)."""

from __future__ import annotations

import numpy as np
import pytest

from inspect_tl_vllm.research.stats import (
    bootstrap_interval,
    control_p_value,
    mean_interval,
    wilson_interval,
)

SCIPY_WILSON = [
    (0, 20, 0.0, 0.161125),
    (1, 20, 0.008881, 0.236131),
    (6, 20, 0.145477, 0.518973),
    (19, 20, 0.763869, 0.991119),
    (20, 20, 0.838875, 1.0),
    (9, 120, 0.039957, 0.136409),
    (54, 120, 0.363917, 0.539185),
]


@pytest.mark.parametrize(("k", "n", "low", "high"), SCIPY_WILSON)
def test_wilson_matches_scipy(k: int, n: int, low: float, high: float) -> None:
    interval = wilson_interval(k, n)
    assert interval.estimate == k / n
    assert interval.low == pytest.approx(low, abs=1e-6) and interval.high == pytest.approx(high, abs=1e-6)


def test_wilson_keeps_a_width_at_the_edges_and_stays_in_range() -> None:
    """Where the normal approximation gives 0 +- 0 (0/20, 20/20) or runs below zero (1/20)."""
    assert wilson_interval(0, 20).low == 0.0 and wilson_interval(0, 20).high > 0.15
    assert wilson_interval(20, 20).high == 1.0 and wilson_interval(20, 20).low < 0.85
    assert wilson_interval(1, 20).low > 0.0


@pytest.mark.parametrize(("k", "n"), [(-1, 5), (6, 5), (0, 0)])
def test_wilson_refuses_impossible_counts(k: int, n: int) -> None:
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(k, n)


def test_bootstrap_is_close_to_scipy_and_reproducible() -> None:
    values = [-1.2, -0.8, -2.5, -0.3, -1.1, -0.9, -1.7, -0.6, -1.4, -2.0]
    interval = bootstrap_interval(values)
    assert interval.estimate == pytest.approx(-1.25)
    # SciPy's percentile interval on the same data: [-1.66, -0.87]; resampling differs by a little
    assert interval.low == pytest.approx(-1.66, abs=0.03) and interval.high == pytest.approx(-0.87, abs=0.03)
    assert bootstrap_interval(values) == interval
    assert bootstrap_interval([0.5] * 7).low == bootstrap_interval([0.5] * 7).high == 0.5


def test_bootstrap_refuses_empty_or_non_finite_values() -> None:
    for bad in ([], [1.0, float("nan")]):
        with pytest.raises(ValueError, match="finite"):
            bootstrap_interval(bad)


def test_mean_interval_picks_wilson_for_proportions_only() -> None:
    assert mean_interval([1.0, 0.0, 1.0]).method == "Wilson score"
    assert mean_interval([1.0, 0.5, 1.0]).method.startswith("percentile bootstrap")


def test_control_p_value_counts_directions_at_least_as_good() -> None:
    assert control_p_value(0.9, [0.0] * 19) == pytest.approx(0.05)
    assert control_p_value(0.5, [0.1, 0.5, 0.7, 0.2]) == pytest.approx(3 / 5)
    assert control_p_value(0.0, [0.0, 0.0]) == 1.0
    with pytest.raises(ValueError, match="no control"):
        control_p_value(0.5, [])


def test_holm_adjustment_matches_the_step_down_rule():
    from inspect_tl_vllm.research.stats import holm_adjusted

    # four coefficients each at the smallest p 19 controls allow: 0.05 becomes 0.2
    assert holm_adjusted([0.05] * 4) == pytest.approx([0.2] * 4)
    # statsmodels' multipletests(method="holm") gives 0.03, 0.06, 0.06, 0.02 for these
    assert holm_adjusted([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm_adjusted([0.5, 0.6]) == [1.0, 1.0] and holm_adjusted([]) == []


def test_dose_response_slope_is_least_squares_over_complete_questions():
    from inspect_tl_vllm.research.stats import dose_response

    rng = np.random.default_rng(3)
    scores = {q: {c: float(rng.random() < 0.2 + 0.2 * c) for c in (0.0, 1.0, 2.0)} for q in range(12)}
    scores["partial"] = {0.0: 1.0, 2.0: 0.0}  # not answered at coef 1: left out
    test = dose_response(scores)
    pairs = [(c, s) for q, by_coef in scores.items() if q != "partial" for c, s in by_coef.items()]
    expected = np.polyfit([c for c, _ in pairs], [s for _, s in pairs], 1)[0]
    assert test.slope == pytest.approx(expected, abs=1e-12)
    assert (test.questions, test.coefs) == (12, [0.0, 1.0, 2.0])
    assert dose_response(scores) == test  # seeded


def test_dose_response_p_value_at_its_floor_and_its_ceiling():
    from inspect_tl_vllm.research.stats import dose_response

    rising = {q: {0.0: 0.0, 1.0: 0.0, 2.0: 1.0} for q in range(20)}  # every question flips at the top dose
    assert dose_response(rising, permutations=999).p_value == pytest.approx(1 / 1000)
    flat = {q: {0.0: 0.5, 1.0: 0.5} for q in range(20)}
    test = dose_response(flat, permutations=999)
    assert test.slope == pytest.approx(0.0) and test.p_value == 1.0
    falling = {q: {0.0: 1.0, 1.0: 0.0} for q in range(20)}
    assert dose_response(falling, permutations=999).p_value == 1.0  # one-sided: a falling score is no effect


def test_dose_response_p_value_is_calibrated_under_the_null():
    """With no effect (scores drawn alike at every coefficient), p <= 0.05 in about 5% of sweeps."""
    from inspect_tl_vllm.research.stats import dose_response

    rng = np.random.default_rng(11)
    p_values = [
        dose_response({q: {c: float(rng.random() < 0.4) for c in (0.0, 1.0, 2.0)} for q in range(20)}, 199).p_value
        for _ in range(300)
    ]
    assert 0.02 <= np.mean(np.asarray(p_values) <= 0.05) <= 0.09


def test_dose_response_refuses_a_single_coefficient():
    from inspect_tl_vllm.research.stats import dose_response

    with pytest.raises(ValueError, match="two coefficients"):
        dose_response({"q": {1.0: 1.0}})
