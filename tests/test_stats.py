"""Mean +- 2 standard errors, checked against scipy."""

import jax.numpy as jnp
import numpy as np
import pytest
from _tolerances import EPS64, reordered_sum
from scipy import stats as sps

from karula_jax.stats import format_mean_se, mean_and_se, paired_difference, summarize


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
