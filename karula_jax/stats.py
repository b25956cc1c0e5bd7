"""Summaries over repeated runs: means with +-2 standard-error bands.

Results are reported as ``mean +- 2 SE`` over seeds, where ``SE = s / sqrt(S)`` with ``s``
the sample standard deviation (``ddof=1``) over the ``S`` seeds. Host-side helpers: they take
numpy or jax arrays and return numpy arrays.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["format_mean_se", "mean_and_se", "paired_difference", "summarize"]


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
    difference is usually much narrower than the two separate bands suggest.

    Examples:
      >>> from karula_jax.stats import paired_difference
      >>> mine, theirs = [0.90, 0.92, 0.94], [0.89, 0.90, 0.93]  # the same 3 seeds
      >>> diff, band = paired_difference(mine, theirs)
      >>> round(float(diff), 4), round(float(band), 4)  # decided: the difference exceeds its band
      (0.0133, 0.0067)
    """
    a = _as_float_array("a", a)
    b = _as_float_array("b", b)
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape, got {a.shape} and {b.shape}")
    return mean_and_se(a - b, axis=axis, num_se=num_se)


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
