"""Summaries over repeated runs and the decision rule of every verdict table.

Three bands, each for one purpose:

* :func:`mean_and_se` / :func:`paired_difference`: ``mean +- k SE`` (``k = 2`` by
  default), ``SE = s / sqrt(S)`` with ``s`` the sample standard deviation (``ddof=1``)
  over the ``S`` seeds; a quick band for curves and logs.
* :func:`t_interval`: the 95% Student-t interval of a mean, half-width
  ``t(0.975, S - 1) * s * sqrt(1/S + r)``; the ``±`` of every table.
* :func:`paired_test`: the paired difference of two methods over the same seeds, its
  t-interval and the paired t-test's two-sided p-value. :func:`holm` adjusts the p-values
  of one table's comparisons (Holm's step-down), and :func:`decide` calls a comparison
  decided when its adjusted p-value is below 0.05.

``r`` (``test_train_ratio``) is 0 for independent seeds. Where the seeds reuse one pool of
data (repeated random train/test splits), their results are correlated and ``1/S``
understates the variance of the mean: Nadeau and Bengio's corrected resampled t-test
(Machine Learning 52, 2003) replaces it by ``1/S + n_test / n_train``, the ratio of the
test and training set sizes.

Host-side helpers: they take numpy or jax arrays and return numpy arrays.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "Decision",
    "PairedTest",
    "decide",
    "format_mean_se",
    "holm",
    "mean_and_se",
    "paired_difference",
    "paired_test",
    "summarize",
    "t_interval",
]

ALPHA = 0.05  # the level of every verdict: adjusted p < ALPHA is "decided"


def _as_float_array(name: str, values: Any) -> np.ndarray:
    if values is None or isinstance(values, str | bytes):
        raise TypeError(f"{name} must be a numeric array, got {type(values).__name__}")
    try:
        a = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be a numeric array, got {type(values).__name__}") from e
    return a


def mean_and_se(
    values: Any, axis: int = 0, *, num_se: float = 2.0, ignore_nan: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Mean over ``axis`` and ``num_se`` standard errors of that mean.

    Args:
      values: array with the repetitions (seeds) along ``axis``, e.g. final test
        accuracy of shape ``[S]`` or a metric history of shape ``[S, num_evals]``.
      axis: the seed axis.
      num_se: width of the band in standard errors (2 by default).
      ignore_nan: skip NaN entries (diverged runs) per position, using the number of
        remaining repetitions at that position; otherwise NaN propagates.

    Returns:
      ``(mean, band)`` with ``axis`` removed, in float64, where
      ``band = num_se * std(values, ddof=1) / sqrt(S)``. Infinite values are values, not
      gaps: a position holding one has an infinite mean (NaN if both signs occur) and an
      infinite band. A position left with fewer than 2 values by ``ignore_nan`` has a NaN
      band (NaN mean if it has none).

    Raises:
      TypeError: if ``values`` is not numeric.
      ValueError: if fewer than 2 repetitions lie along ``axis``, or ``num_se`` < 0.

    Examples:
      >>> from karula_jax.stats import format_mean_se, mean_and_se
      >>> mean, band = mean_and_se([0.90, 0.92, 0.94])  # a final accuracy on 3 seeds
      >>> round(float(mean), 3), round(float(band), 4)  # band = 2 std / sqrt(3)
      (0.92, 0.0231)
      >>> format_mean_se(mean, band, scale=100)
      '92.00 ± 2.31'
    """
    a = _as_float_array("values", values)
    if a.ndim == 0:
        raise ValueError("values must have at least one axis (the seed axis)")
    axis = int(axis)
    if not -a.ndim <= axis < a.ndim:
        raise ValueError(f"axis={axis} is out of range for values of shape {a.shape}")
    if a.shape[axis] < 2:
        raise ValueError(
            f"a standard error needs at least 2 repetitions along axis {axis}, got shape {a.shape}"
        )
    if num_se < 0:
        raise ValueError(f"num_se must be >= 0, got {num_se}")
    a = np.moveaxis(a, axis, 0)
    gap = np.isnan(a) if ignore_nan else np.zeros(a.shape, bool)
    count = np.sum(~gap, axis=0)
    inf = np.isinf(a)
    finite = np.where(gap | inf, 0.0, a)
    with np.errstate(invalid="ignore", divide="ignore"):
        # Moments of the finite values; infinities are put back afterwards, so that
        # inf - inf never turns a band into NaN.
        n_fin = np.sum(~gap & ~inf, axis=0)
        mean_fin = np.sum(finite, axis=0) / n_fin
        dev = np.where(gap | inf, 0.0, a - mean_fin)
        var = np.sum(dev**2, axis=0) / (count - 1)
        se = np.sqrt(var) / np.sqrt(count)
        total = np.sum(np.where(gap, 0.0, a), axis=0)  # +-inf, or NaN for both signs
        mean = np.where(inf.any(axis=0), total, mean_fin)
    se = np.where(inf.any(axis=0), np.inf, np.where(count > 1, se, np.nan))
    mean = np.where(count > 0, mean, np.nan)
    return mean[()], (num_se * se)[()]


def paired_difference(
    a: Any, b: Any, axis: int = 0, *, num_se: float = 2.0
) -> tuple[np.ndarray, np.ndarray]:
    """Mean and ``num_se`` SE of ``a - b`` for runs paired by seed (same data and draws).

    Pairing removes the seed-to-seed variation both methods share, so the band of the
    difference is usually much narrower than the two separate bands suggest. The band is
    ``num_se`` standard errors, not a test: tables decide with :func:`paired_test` and
    :func:`decide`.

    Examples:
      >>> from karula_jax.stats import paired_difference
      >>> mine, theirs = [0.90, 0.92, 0.94], [0.89, 0.90, 0.93]  # the same 3 seeds
      >>> diff, band = paired_difference(mine, theirs)
      >>> round(float(diff), 4), round(float(band), 4)  # the mean and 2 SE
      (0.0133, 0.0067)
    """
    a = _as_float_array("a", a)
    b = _as_float_array("b", b)
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape, got {a.shape} and {b.shape}")
    return mean_and_se(a - b, axis=axis, num_se=num_se)


def _check_ratio(test_train_ratio: Any) -> float:
    if isinstance(test_train_ratio, bool) or not isinstance(
        test_train_ratio, int | float | np.integer | np.floating
    ):
        raise TypeError(f"test_train_ratio must be a number, got {type(test_train_ratio).__name__}")
    if not (np.isfinite(test_train_ratio) and test_train_ratio >= 0):
        raise ValueError(f"test_train_ratio must be finite and >= 0, got {test_train_ratio}")
    return float(test_train_ratio)


def _check_confidence(confidence: Any) -> float:
    if isinstance(confidence, bool) or not isinstance(
        confidence, int | float | np.integer | np.floating
    ):
        raise TypeError(f"confidence must be a number, got {type(confidence).__name__}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    return float(confidence)


def _mean_and_corrected_se(values, axis, ratio) -> tuple[np.ndarray, np.ndarray, int]:
    """Mean, ``s * sqrt(1/S + ratio)`` and ``S`` (the number of seeds)."""
    a = _as_float_array("values", values)
    mean, se = mean_and_se(a, axis=axis, num_se=1.0)  # se = s / sqrt(S); checks the axis
    S = a.shape[int(axis)]
    return mean, se * np.sqrt(1.0 + S * ratio), S  # s sqrt(1/S + r) = (s / sqrt(S)) sqrt(1 + S r)


def _student_t():
    """:data:`scipy.stats.t`, imported at first use: ``scipy.stats`` takes a second or more
    to import, and most processes that import karula_jax never compute an interval."""
    from scipy import stats  # noqa: PLC0415

    return stats.t


def t_interval(
    values: Any, axis: int = 0, *, confidence: float = 0.95, test_train_ratio: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """Mean over ``axis`` and the half-width of its Student-t confidence interval.

    ``half_width = t((1 + confidence) / 2, S - 1) * s * sqrt(1/S + test_train_ratio)``
    with ``s`` the sample standard deviation (``ddof=1``) of the ``S`` seeds: for normal
    seed results an interval ``mean ± half_width`` covers the true mean with probability
    ``confidence``. The ``±`` of every table (``"± 95% t"`` in its headers).

    Args:
      values: array with the seeds along ``axis``, e.g. ``[S]``.
      axis: the seed axis.
      confidence: the interval's coverage, in (0, 1).
      test_train_ratio: ``n_test / n_train`` where the seeds are repeated random splits
        of one pool (Nadeau and Bengio's corrected variance); 0 for independent seeds.

    Returns:
      ``(mean, half_width)`` with ``axis`` removed, float64. A non-finite value makes its
      position's half-width infinite or NaN, as in :func:`mean_and_se`.

    Raises:
      TypeError: ``values`` not numeric, ``confidence`` or ``test_train_ratio`` not a number.
      ValueError: fewer than 2 seeds, ``confidence`` outside (0, 1), a negative or
        non-finite ``test_train_ratio``.

    Examples:
      >>> from karula_jax.stats import t_interval
      >>> mean, half = t_interval([0.90, 0.92, 0.94])  # 3 seeds: t(0.975, 2) = 4.303
      >>> round(float(mean), 3), round(float(half), 4)  # 4.303 * 0.02 / sqrt(3)
      (0.92, 0.0497)
    """
    q = 0.5 + _check_confidence(confidence) / 2
    mean, se, S = _mean_and_corrected_se(values, axis, _check_ratio(test_train_ratio))
    return mean, (_student_t().ppf(q, S - 1) * se)[()]


class PairedTest(NamedTuple):
    """A paired comparison of two methods over the same seeds (:func:`paired_test`).

    Attributes:
      diff: mean of ``a - b`` over the seeds.
      half_width: half-width of its 95% Student-t interval (``confidence``).
      p_value: two-sided p-value of the paired t-test of ``mean(a - b) = 0``.
      dof: degrees of freedom, ``S - 1``.
    """

    diff: np.ndarray
    half_width: np.ndarray
    p_value: np.ndarray
    dof: int


def paired_test(
    a: Any,
    b: Any,
    axis: int = 0,
    *,
    test_train_ratio: float = 0.0,
    confidence: float = 0.95,
) -> PairedTest:
    """The paired t-test of ``a - b`` for runs paired by seed (same data and draws).

    The statistic is ``mean(d) / (s_d sqrt(1/S + test_train_ratio))`` on ``S - 1``
    degrees of freedom, ``d = a - b`` (with ratio 0, :func:`scipy.stats.ttest_rel`);
    the interval is :func:`t_interval` of ``d``.

    Args:
      a, b: arrays of the same shape, seeds along ``axis`` (``[S]`` for one comparison).
      axis: the seed axis.
      test_train_ratio: see :func:`t_interval`.
      confidence: the interval's coverage.

    Returns:
      A :class:`PairedTest`. Ties: where every difference is equal (zero variance), the
      p-value is 1 if they are 0 (identical runs) and 0 otherwise. A NaN or infinite
      difference gives a NaN p-value (never decided), without a warning.

    Raises:
      TypeError, ValueError: as :func:`t_interval`; ``a`` and ``b`` of different shapes.

    Examples:
      >>> from karula_jax.stats import paired_test
      >>> mine, theirs = [0.90, 0.92, 0.94], [0.89, 0.90, 0.93]  # the same 3 seeds
      >>> test = paired_test(mine, theirs)
      >>> round(float(test.diff), 4), round(float(test.half_width), 4), test.dof
      (0.0133, 0.0143, 2)
      >>> round(float(test.p_value), 3)  # scipy.stats.ttest_rel(mine, theirs).pvalue
      0.057
    """
    a = _as_float_array("a", a)
    b = _as_float_array("b", b)
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape, got {a.shape} and {b.shape}")
    q = 0.5 + _check_confidence(confidence) / 2
    diff, se, S = _mean_and_corrected_se(a - b, axis, _check_ratio(test_train_ratio))
    dof = S - 1
    finite = np.isfinite(diff) & np.isfinite(se)
    with np.errstate(invalid="ignore", divide="ignore"):
        stat = np.where(finite & (se > 0), np.abs(diff) / np.where(se > 0, se, 1.0), 0.0)
        p = 2 * _student_t().sf(stat, dof)
    tie = finite & (se == 0)
    p = np.where(tie, np.where(diff == 0, 1.0, 0.0), np.where(finite, p, np.nan))
    return PairedTest(diff, (_student_t().ppf(q, dof) * se)[()], np.asarray(p, np.float64)[()], dof)


def holm(p_values: Any) -> np.ndarray:
    """Holm's step-down adjustment of the p-values of one family of comparisons.

    Sorted ascending, ``p_(1) <= ... <= p_(m)``, the ``k``-th adjusted value is
    ``min(1, max_{j <= k} (m - j + 1) p_(j))``; rejecting where it is below ``alpha``
    keeps the chance of any false "decided" in the family at most ``alpha``, whatever the
    comparisons' dependence. A NaN p-value counts in ``m``, ranks last and stays NaN.

    Args:
      p_values: ``[m]`` p-values in [0, 1] (or NaN); one table's comparisons.

    Returns:
      ``[m]`` adjusted p-values, float64, in the input's order.

    Raises:
      TypeError: not numeric.
      ValueError: not 1-D, or a value outside [0, 1].

    Examples:
      >>> from karula_jax.stats import holm
      >>> holm([0.01, 0.04, 0.03]).round(3).tolist()  # 3 * 0.01, max(2 * 0.03, .03), ...
      [0.03, 0.06, 0.06]
    """
    p = _as_float_array("p_values", p_values)
    if p.ndim != 1:
        raise ValueError(f"p_values must be 1-D (one family), got shape {p.shape}")
    nan = np.isnan(p)
    if np.any((p[~nan] < 0) | (p[~nan] > 1)):
        raise ValueError(f"p_values must lie in [0, 1], got {p.tolist()}")
    m = p.size
    filled = np.where(nan, 1.0, p)
    order = np.argsort(filled, kind="stable")
    steps = np.maximum.accumulate((m - np.arange(m)) * filled[order])
    adjusted = np.empty(m)
    adjusted[order] = np.minimum(1.0, steps)
    return np.where(nan, np.nan, adjusted)


class Decision(NamedTuple):
    """Verdicts of one family of comparisons (:func:`decide`).

    Attributes:
      adjusted: ``[m]`` Holm-adjusted p-values.
      decided: ``[m]`` bool, ``adjusted < alpha`` (False where NaN).
    """

    adjusted: np.ndarray
    decided: np.ndarray


def decide(p_values: Any, *, alpha: float = ALPHA) -> Decision:
    """The decision rule of every table: Holm over the family, decided below ``alpha``.

    Args:
      p_values: ``[m]`` unadjusted p-values of one table's comparisons
        (:attr:`PairedTest.p_value` of each non-reference row).
      alpha: the family-wise error rate, in (0, 1).

    Returns:
      A :class:`Decision`.

    Examples:
      >>> from karula_jax.stats import decide
      >>> decide([0.01, 0.04, 0.03]).decided.tolist()  # 0.04 alone would be decided
      [True, False, False]
    """
    if isinstance(alpha, bool) or not isinstance(alpha, int | float | np.floating):
        raise TypeError(f"alpha must be a number, got {type(alpha).__name__}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    adjusted = holm(p_values)
    with np.errstate(invalid="ignore"):
        return Decision(adjusted, np.asarray(adjusted < alpha))


def summarize(tree: Mapping[str, Any], axis: int = 0, *, num_se: float = 2.0) -> dict:
    """Applies :func:`mean_and_se` to every array of a dict (e.g. ``RunResult.metrics``).

    Returns:
      dict name -> ``{"mean": ..., "se2": ...}`` (``se2`` is the ``num_se``-SE band).

    Examples:
      >>> import numpy as np
      >>> from karula_jax.stats import summarize
      >>> out = summarize({"accuracy": np.array([[0.5, 0.90], [0.6, 0.92], [0.7, 0.94]])})
      >>> mean, band = out["accuracy"]["mean"], out["accuracy"]["se2"]  # per column
      >>> np.round(mean, 2).tolist(), np.round(band, 3).tolist()
      ([0.6, 0.92], [0.115, 0.023])
    """
    if not isinstance(tree, Mapping):
        raise TypeError(f"tree must be a dict of arrays, got {type(tree).__name__}")
    out = {}
    for name, values in tree.items():
        mean, band = mean_and_se(values, axis=axis, num_se=num_se)
        out[name] = {"mean": mean, "se2": band}
    return out


def format_mean_se(mean: Any, band: Any, *, digits: int = 2, scale: float = 1.0) -> Any:
    """``"91.30 ± 0.75"``: a mean and its band as text (``scale=100`` turns fractions into %).

    Args:
      mean: a number or an array (numpy or jax).
      band: a number or an array broadcastable with ``mean``, e.g. from :func:`mean_and_se`.
      digits: decimals.
      scale: factor applied to both.

    Returns:
      A ``str`` when both are scalars (0-d), otherwise a numpy array of ``str`` of the
      broadcast shape. A NaN band (e.g. a single finite seed) prints as ``± nan``.

    Raises:
      TypeError: if ``mean`` or ``band`` is not numeric, or ``digits`` not an int.
      ValueError: if their shapes do not broadcast, or ``digits`` < 0.

    Examples:
      >>> import numpy as np
      >>> from karula_jax.stats import format_mean_se
      >>> format_mean_se(5.7712, 0.4801)
      '5.77 ± 0.48'
      >>> format_mean_se(np.array([0.913, 0.893]), 0.0075, digits=1, scale=100).tolist()
      ['91.3 ± 0.8', '89.3 ± 0.8']
    """
    m = _as_float_array("mean", mean)
    s = _as_float_array("band", band)
    if isinstance(digits, bool) or not isinstance(digits, int | np.integer):
        raise TypeError(f"digits must be an int, got {type(digits).__name__}")
    if digits < 0:
        raise ValueError(f"digits must be >= 0, got {digits}")
    try:
        m, s = np.broadcast_arrays(m * scale, s * scale)
    except ValueError as e:
        raise ValueError(
            f"mean and band must have broadcastable shapes, got {m.shape} and {s.shape}"
        ) from e
    text = np.vectorize(lambda a, b: f"{a:.{digits}f} ± {b:.{digits}f}", otypes=[object])(m, s)
    return str(text[()]) if text.ndim == 0 else text.astype(str)
