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
        finite repetitions at that position; otherwise NaN propagates.

    Returns:
      ``(mean, band)`` with ``axis`` removed, in float64, where
      ``band = num_se * std(values, ddof=1) / sqrt(S)``.

    Raises:
      ValueError: if fewer than 2 repetitions lie along ``axis``, or ``num_se`` < 0.
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
    if ignore_nan:
        count = np.sum(~np.isnan(a), axis=axis)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.nansum(a, axis=axis) / np.where(count > 0, count, np.nan)
            dev = np.where(np.isnan(a), 0.0, a - np.expand_dims(mean, axis))
            var = np.sum(dev**2, axis=axis) / np.where(count > 1, count - 1, np.nan)
            se = np.sqrt(var / count)
    else:
        count = a.shape[axis]
        mean = np.mean(a, axis=axis)
        se = np.std(a, axis=axis, ddof=1) / np.sqrt(count)
    return mean, num_se * se


def paired_difference(
    a: Any, b: Any, axis: int = 0, *, num_se: float = 2.0
) -> tuple[np.ndarray, np.ndarray]:
    """Mean and ``num_se`` SE of ``a - b`` for runs paired by seed (same data and draws).

    Pairing removes the seed-to-seed variation both methods share, so the band of the
    difference is usually much narrower than the two separate bands suggest.
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
    """
    if not isinstance(tree, Mapping):
        raise TypeError(f"tree must be a dict of arrays, got {type(tree).__name__}")
    out = {}
    for name, values in tree.items():
        mean, band = mean_and_se(values, axis=axis, num_se=num_se)
        out[name] = {"mean": mean, "se2": band}
    return out


def format_mean_se(mean: Any, band: Any, *, digits: int = 2, scale: float = 1.0) -> str:
    """``"91.30 ± 0.75"`` for scalars (``scale=100`` turns fractions into percent)."""
    m = float(np.asarray(mean)) * scale
    s = float(np.asarray(band)) * scale
    return f"{m:.{digits}f} ± {s:.{digits}f}"
