"""Means, bands and the tables' decision rule, checked against scipy and hand-made cases."""

import jax.numpy as jnp
import numpy as np
import pytest
from _tolerances import EPS64, reordered_sum
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from karula_jax.stats import (
    decide,
    format_mean_se,
    holm,
    mean_and_se,
    paired_difference,
    paired_test,
    summarize,
    t_interval,
)


def test_mean_and_se_matches_scipy_sem():
    rng = np.random.default_rng(0)
    values = rng.normal(size=(10, 4, 3))
    for axis in (0, 1, -1):
        mean, band = mean_and_se(values, axis=axis)
        # float64 sums over at most 10 values, in scipy's order and ours, and the deviations'
        # squares, the square root and the divisions: of the values' magnitude (a mean near
        # 0 has no relative error to speak of)
        atol = reordered_sum(10 + 4, eps=EPS64) * np.abs(values).max()
        np.testing.assert_allclose(mean, values.mean(axis=axis), rtol=0, atol=atol)
        want = 2 * sps.sem(values, axis=axis, ddof=1)
        np.testing.assert_allclose(band, want, rtol=0, atol=2 * atol)
    mean, band = mean_and_se(jnp.asarray(values[:, 0, 0]), num_se=1.0)  # jax input too
    # the jax array holds the values in float32: each rounded by EPS32 / 2 of the values,
    # the standard error computed from them as above, in float32 at worst
    atol = reordered_sum(10 + 4) * np.abs(values[:, 0, 0]).max()
    np.testing.assert_allclose(band, sps.sem(values[:, 0, 0]), rtol=0, atol=atol)


def test_band_covers_true_mean_about_95_percent():
    # Monte Carlo: for normal data the +-2 SE band contains the mean ~95% of the time
    # (a t interval with 29 dof at +-2 has coverage 1 - 2 * sf(2, 29)).
    rng = np.random.default_rng(1)
    values = rng.normal(loc=3.0, size=(30, 4000))
    mean, band = mean_and_se(values)
    coverage = np.mean(np.abs(mean - 3.0) <= band)
    expected = 1 - 2 * sps.t.sf(2.0, df=29)
    # 4.5 standard errors of a proportion over the 4000 draws (fixed draws): 0.016, was
    # 0.015 (4.2 of them)
    se = np.sqrt(expected * (1 - expected) / values.shape[1])
    assert abs(coverage - expected) < 4.5 * se


def test_ignore_nan_uses_finite_seeds_only():
    values = np.array([[1.0, 2.0], [3.0, np.nan], [5.0, 4.0], [np.nan, 6.0]])
    mean, band = mean_and_se(values, ignore_nan=True)
    for j in range(2):
        col = values[:, j][~np.isnan(values[:, j])]
        rtol = reordered_sum(len(col) + 4, eps=EPS64)  # as above, of positive values
        np.testing.assert_allclose(mean[j], col.mean(), rtol=rtol)
        np.testing.assert_allclose(band[j], 2 * sps.sem(col), rtol=rtol)
    assert np.isnan(mean_and_se(values)[0]).all()


def test_paired_difference_and_summarize():
    rng = np.random.default_rng(2)
    base = rng.normal(size=8) * 10
    a, b = base + 1.0 + 0.1 * rng.normal(size=8), base
    diff, band = paired_difference(a, b)
    # float64 sums over the 8 differences (and the 4 steps of a standard error), of their size
    tol = reordered_sum(8 + 4, eps=EPS64)
    np.testing.assert_allclose(band, 2 * sps.sem(a - b), rtol=0, atol=2 * tol * np.abs(a - b).max())
    assert band < mean_and_se(a)[1]  # pairing removes the shared seed variation
    out = summarize({"acc": np.stack([a, b], 1)})
    scale = max(np.abs(a).max(), np.abs(b).max())
    np.testing.assert_allclose(out["acc"]["mean"], [a.mean(), b.mean()], rtol=0, atol=tol * scale)
    assert format_mean_se(0.913, 0.0075, scale=100) == "91.30 ± 0.75"


def test_bad_input():
    with pytest.raises(ValueError, match="at least 2 repetitions"):
        mean_and_se(np.ones((1, 3)))
    with pytest.raises(ValueError, match="at least one axis"):
        mean_and_se(1.0)
    with pytest.raises(ValueError, match="out of range"):
        mean_and_se(np.ones((3, 2)), axis=2)
    with pytest.raises(ValueError, match="same shape"):
        paired_difference(np.ones(3), np.ones(4))
    with pytest.raises(TypeError, match="numeric"):
        mean_and_se(["a", "b"])
    with pytest.raises(ValueError, match="num_se"):
        mean_and_se(np.ones(3), num_se=-1)


def test_ignore_nan_keeps_infinities_as_infinite_bands():
    values = np.array([[1.0, 1.0, 1.0], [np.inf, np.nan, -np.inf], [3.0, 2.0, np.inf]])
    mean, band = mean_and_se(values, ignore_nan=True)
    assert mean[0] == np.inf and band[0] == np.inf
    assert np.isnan(mean[2]) and band[2] == np.inf  # +inf and -inf: no mean, no bound
    rtol = reordered_sum(2 + 4, eps=EPS64)  # two positive values, as above
    np.testing.assert_allclose([mean[1], band[1]], [1.5, 2 * sps.sem([1.0, 2.0])], rtol=rtol)
    mean, band = mean_and_se(values)  # without ignore_nan the NaN still propagates
    assert mean[0] == np.inf and band[0] == np.inf and np.isnan(mean[1])
    mean, band = mean_and_se(np.array([np.nan, 2.0, np.nan]), ignore_nan=True)
    assert mean == 2.0 and np.isnan(band)  # one value left: unknown band


def test_format_mean_se_takes_arrays():
    mean, band = mean_and_se(np.array([[0.9, 0.5], [0.92, 0.7]]))
    text = format_mean_se(mean, band, scale=100, digits=1)
    assert text.shape == (2,) and text.tolist() == ["91.0 ± 2.0", "60.0 ± 20.0"]
    assert format_mean_se(jnp.float32(0.5), np.float64(0.25)) == "0.50 ± 0.25"
    assert format_mean_se(np.array([1.0]), 0.5).tolist() == ["1.00 ± 0.50"]
    assert format_mean_se(1.0, np.nan) == "1.00 ± nan"


def test_format_mean_se_rejects_bad_input_naming_the_argument():
    with pytest.raises(TypeError, match="mean must be a numeric array"):
        format_mean_se("a", 1.0)
    with pytest.raises(TypeError, match="band must be a numeric array"):
        format_mean_se(1.0, None)
    with pytest.raises(ValueError, match="mean and band must have broadcastable shapes"):
        format_mean_se(np.ones(3), np.ones(2))
    with pytest.raises(TypeError, match="digits must be an int"):
        format_mean_se(1.0, 1.0, digits=1.5)
    with pytest.raises(ValueError, match="digits must be >= 0"):
        format_mean_se(1.0, 1.0, digits=-1)
    with pytest.raises(TypeError, match="values must be a numeric array"):
        mean_and_se([object(), object()])


def _holm_reference(p):
    """Holm's step-down written out: at step k (1-based, p ascending) the adjusted value
    is the largest of (m - j + 1) p_(j) over j <= k, capped at 1."""
    m = len(p)
    order = sorted(range(m), key=lambda i: p[i])
    out, running = [0.0] * m, 0.0
    for k, i in enumerate(order):
        running = max(running, (m - k) * p[i])
        out[i] = min(1.0, running)
    return out


def _p_tol(stat: float, terms: int) -> float:
    """Two float64 evaluations of a t statistic differ by ``terms`` roundings of its size
    (a mean, a standard deviation, a division); a two-sided p-value moves by at most
    2 pdf(t) <= 0.8 per unit of t."""
    return max(abs(stat), 1.0) * reordered_sum(terms, eps=EPS64)


@pytest.mark.parametrize("S", [2, 3, 10])
def test_paired_test_matches_scipy_ttest_rel_and_t_ppf(S):
    rng = np.random.default_rng(S)
    base = rng.normal(size=(S, 4)) * 5
    a, b = base + 0.7 + rng.normal(size=(S, 4)), base
    test = paired_test(a, b)
    ref = sps.ttest_rel(a, b, axis=0)
    d = a - b
    # float64 sums of S differences and a standard error's 4 steps, of the differences' size
    atol = reordered_sum(S + 4, eps=EPS64) * np.abs(d).max()
    np.testing.assert_allclose(test.diff, d.mean(0), rtol=0, atol=atol)
    want = sps.t.ppf(0.975, S - 1) * sps.sem(d, axis=0)
    np.testing.assert_allclose(test.half_width, want, rtol=0, atol=2 * atol * want.max())
    for p, p_ref, stat in zip(test.p_value, ref.pvalue, ref.statistic, strict=True):
        assert p == pytest.approx(p_ref, abs=_p_tol(stat, S + 6))
    assert test.dof == S - 1


def test_t_interval_is_scipys_interval_and_the_corrected_variance_widens_it():
    values = np.array([0.90, 0.92, 0.94, 0.89, 0.95])
    mean, half = t_interval(values)
    lo, hi = sps.t.interval(0.95, 4, loc=values.mean(), scale=sps.sem(values))
    tol = reordered_sum(5 + 6, eps=EPS64)  # as above, relative to values of size 1
    assert mean - half == pytest.approx(lo, abs=tol) and mean + half == pytest.approx(hi, abs=tol)
    _, half90 = t_interval(values, confidence=0.9)
    assert half90 == pytest.approx(sps.t.ppf(0.95, 4) * sps.sem(values), abs=tol)
    # Nadeau and Bengio: the variance factor 1/S + r instead of 1/S
    r = 184 / 556
    _, corrected = t_interval(values, test_train_ratio=r)
    want = sps.t.ppf(0.975, 4) * values.std(ddof=1) * np.sqrt(1 / 5 + r)
    assert corrected == pytest.approx(want, abs=tol)
    a, b = values, values - np.array([0.01, 0.03, 0.0, 0.02, 0.015])
    test = paired_test(a, b, test_train_ratio=r)
    d = a - b
    stat = d.mean() / (d.std(ddof=1) * np.sqrt(1 / 5 + r))
    assert test.p_value == pytest.approx(2 * sps.t.sf(abs(stat), 4), abs=_p_tol(stat, 11))
    assert test.p_value > paired_test(a, b).p_value  # correlated splits: less evidence


def test_t_interval_covers_95_percent_where_two_se_falls_short():
    # Monte Carlo at S = 3 (2 degrees of freedom): the t interval covers the mean 95% of
    # the time, +-2 SE only 1 - 2 sf(2, 2) = 82%
    rng = np.random.default_rng(3)
    values = rng.normal(loc=1.0, size=(3, 4000))
    mean, half = t_interval(values)
    coverage = np.mean(np.abs(mean - 1.0) <= half)
    se = np.sqrt(0.95 * 0.05 / values.shape[1])  # of a proportion over the 4000 draws
    assert abs(coverage - 0.95) < 4.5 * se  # 4.5 standard errors (fixed draws)
    two_se = np.mean(np.abs(mean - 1.0) <= mean_and_se(values)[1])
    assert abs(two_se - (1 - 2 * sps.t.sf(2.0, 2))) < 4.5 * se


def test_holm_on_hand_made_cases():
    np.testing.assert_allclose(holm([0.01, 0.04, 0.03]), [0.03, 0.06, 0.06], rtol=1e-15)
    np.testing.assert_allclose(holm([0.02, 0.5]), [0.04, 0.5], rtol=1e-15)
    np.testing.assert_allclose(holm([0.3, 0.001, 0.2]), [0.4, 0.003, 0.4], rtol=1e-15)
    np.testing.assert_allclose(holm([0.6, 0.7]), [1.0, 1.0])  # capped at 1
    assert holm([0.04]).tolist() == [0.04]  # a family of one: unchanged
    assert holm([]).shape == (0,)
    out = holm([0.01, np.nan, 0.02])  # NaN counts in m, stays NaN
    np.testing.assert_allclose(out[[0, 2]], [0.03, 0.04], rtol=1e-15)
    assert np.isnan(out[1])


def test_decide_just_below_and_just_above_alpha_after_correction():
    # two comparisons: the smaller p doubles
    below = decide([0.0249, 0.3])
    assert below.decided.tolist() == [True, False]
    assert below.adjusted[0] == pytest.approx(0.0498, rel=1e-12)
    above = decide([0.0251, 0.3])
    assert above.decided.tolist() == [False, False]  # 0.0502: decided alone, not in the family
    # step-down: the second smallest is compared at alpha / (m - 1)
    assert decide([0.001, 0.0249, 0.5]).decided.tolist() == [True, True, False]
    assert decide([0.001, 0.0251, 0.5]).decided.tolist() == [True, False, False]
    assert decide([np.nan, 0.001]).decided.tolist() == [False, True]


def test_decide_from_paired_tests_just_around_alpha():
    # d = (x, -x / 2, ..) built so that the raw p lands at 0.03 and the Holm p of a family
    # of two at 0.06: decided alone, not after the correction
    rng = np.random.default_rng(5)
    d = rng.normal(size=6)
    d = (d - d.mean()) / d.std(ddof=1)  # mean 0, sd 1
    shift = sps.t.ppf(1 - 0.03 / 2, 5) / np.sqrt(6)  # the mean that gives p = 0.03
    a = np.zeros(6)
    test = paired_test(a + d + shift, a)
    assert test.p_value == pytest.approx(0.03, abs=_p_tol(2.9, 12))
    verdict = decide([test.p_value, 0.5])
    assert not verdict.decided[0] and verdict.adjusted[0] == pytest.approx(0.06, abs=1e-12)


def test_ties_and_non_finite_values_are_never_decided_and_warn_nothing():
    # pytest turns warnings into errors: a NaN warning here fails the test
    runs = np.array([0.8, 0.9, 0.85])
    tie = paired_test(runs, runs.copy())
    assert (tie.diff, tie.half_width, tie.p_value) == (0.0, 0.0, 1.0)
    assert not decide([tie.p_value]).decided[0]
    offset = paired_test(runs + 0.5, runs - 0.5)  # the same difference on every seed
    assert offset.diff == pytest.approx(1.0) and offset.p_value < 1e-10
    for bad in (np.nan, np.inf, -np.inf):
        test = paired_test(np.array([1.0, bad, 2.0]), np.array([0.0, 0.5, 1.0]))
        assert np.isnan(test.p_value) and not decide([test.p_value, 0.001]).decided[0]
    two = paired_test(np.array([[1.0, 1.0], [2.0, 2.0]]), np.array([[0.0, 1.0], [1.0, 2.0]]))
    assert two.p_value.tolist() == [0.0, 1.0]  # per column, S = 2


def test_decision_rule_rejects_bad_input_naming_the_argument():
    with pytest.raises(ValueError, match="same shape"):
        paired_test(np.ones(3), np.ones(4))
    with pytest.raises(ValueError, match="at least 2 repetitions"):
        paired_test(np.ones(1), np.ones(1))
    with pytest.raises(ValueError, match="test_train_ratio must be finite and >= 0"):
        paired_test(np.ones(3), np.ones(3), test_train_ratio=-0.1)
    with pytest.raises(TypeError, match="test_train_ratio must be a number"):
        t_interval(np.ones(3), test_train_ratio="0.3")
    with pytest.raises(ValueError, match="confidence must lie in"):
        t_interval(np.ones(3), confidence=1.0)
    with pytest.raises(TypeError, match="a must be a numeric array"):
        paired_test("abc", np.ones(3))
    with pytest.raises(ValueError, match="1-D"):
        holm(np.ones((2, 2)) * 0.1)
    with pytest.raises(ValueError, match=r"p_values must lie in \[0, 1\]"):
        holm([0.1, 1.5])
    with pytest.raises(ValueError, match="alpha must lie in"):
        decide([0.1], alpha=0.0)
    with pytest.raises(TypeError, match="alpha must be a number"):
        decide([0.1], alpha="0.05")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12))
def test_holm_matches_the_written_out_procedure(p):
    got = holm(p)
    # the adjusted values are products of a p-value and an integer <= 12, or maxima of
    # them, or 1: each one rounding of float64
    np.testing.assert_allclose(got, _holm_reference(p), rtol=EPS64, atol=0)
    assert np.all(got >= np.asarray(p)) and np.all(got <= 1.0)
    order = np.argsort(p, kind="stable")
    assert np.all(np.diff(got[order]) >= 0)  # step-down keeps the order of the p-values
