"""A grid of Karula's ``t`` from the data: where its pairs start and stop binding."""

from __future__ import annotations

from typing import Any

import numpy as np

from karula_jax._checks import check_positive_int

__all__ = ["binding_t_grid"]


def binding_t_grid(
    D: Any,
    sq_distances: Any,
    *,
    num: int = 6,
    binding_share: float = 0.9,
    limits: bool = False,
) -> tuple[float, ...]:
    """Values of ``t`` from where most pairs bind to where none does, from the data.

    Pair ``(i, j)`` of models ``theta`` binds Karula's constraint ``||theta_i -
    theta_j||^2 <= t D_ij`` while ``t < r_ij = ||theta_i - theta_j||^2 / D_ij``. With the
    clients' own models (Local, or :func:`karula_jax.algorithms.local_optima`) as
    ``theta``, ``t`` above every ``r_ij`` leaves each client alone (Karula is Local there)
    and ``t`` below every ``r_ij`` pulls every pair in: the points between are where a grid
    of ``t`` tells methods apart (points beyond them repeat the same model, and CV scores
    tie). The grid is geometric from the ratio that ``binding_share`` of the pairs exceed to
    the largest ratio. Pairs with ``D_ij = 0`` bind at every finite ``t`` and pairs of
    equal models at none; neither enters the ratios.

    Args:
      D: ``[n, n]`` dissimilarities (:func:`karula_jax.embedding.dissimilarities`).
      sq_distances: ``[n, n]`` squared distances between the clients' own models
        (:func:`karula_jax.evaluation.pairwise_sq_distances`).
      num: number of grid points (``>= 1``).
      binding_share: the share of pairs that bind at the grid's smallest point, in
        ``(0, 1]``.
      limits: add the natural limits ``0`` (every model equal) and ``inf`` (no coupling).

    Returns:
      Increasing ``t`` values, 3 significant digits (readable labels; the largest rounded
      up and the smallest down); ``(inf,)`` (with
      ``limits``: ``(0.0, inf)``) where no pair can bind (every ratio is 0 or undefined).

    Raises:
      ValueError: shapes that are not one ``[n, n]``; a negative or NaN entry off the
        diagonal; ``binding_share`` outside ``(0, 1]``.
      TypeError: ``num`` not an int.

    Examples:
      >>> import numpy as np
      >>> from karula_jax.protocol import binding_t_grid
      >>> D = np.array([[0.0, 1.0, 4.0], [1.0, 0.0, 1.0], [4.0, 1.0, 0.0]])
      >>> sq = np.array([[0.0, 2.0, 4.0], [2.0, 0.0, 8.0], [4.0, 8.0, 0.0]])  # ratios 2, 1, 8
      >>> binding_t_grid(D, sq, num=4, binding_share=1.0)  # from the smallest ratio
      (1.0, 2.0, 4.0, 8.0)
    """
    num = check_positive_int("num", num)
    if not 0.0 < float(binding_share) <= 1.0:
        raise ValueError(f"binding_share must lie in (0, 1], got {binding_share}")
    D, sq = np.asarray(D, np.float64), np.asarray(sq_distances, np.float64)
    if D.ndim != 2 or D.shape[0] != D.shape[1] or sq.shape != D.shape:
        raise ValueError(
            f"D and sq_distances must both have shape [n, n], got {D.shape} and {sq.shape}"
        )
    upper = np.triu_indices(D.shape[0], k=1)
    d, s = D[upper], sq[upper]
    for name, values in (("D", d), ("sq_distances", s)):
        if np.isnan(values).any() or (values < 0).any():
            raise ValueError(f"{name} must be >= 0 off the diagonal, with no NaN")
    finite = (d > 0) & np.isfinite(d) & np.isfinite(s) & (s > 0)
    ratios = np.sort(s[finite] / d[finite])
    ends = (0.0, float("inf")) if limits else (float("inf"),)
    if ratios.size == 0:
        return ends
    low = float(np.quantile(ratios, 1.0 - float(binding_share)))
    high = float(ratios[-1])
    points = np.geomspace(low, high, num) if high > low else np.asarray([high])
    inner = {float(f"{p:.3g}") for p in points[1:-1]}
    grid = sorted(inner | {_three_digits(points[0], up=False), _three_digits(high, up=True)})
    return (0.0, *grid, float("inf")) if limits else tuple(grid)


def _three_digits(value: float, *, up: bool) -> float:
    """``value`` rounded to 3 significant digits up or down (the grid's ends keep their
    promise: no pair binds above the top, the share binds at the bottom)."""
    scale = 10.0 ** (np.floor(np.log10(value)) - 2)
    return float(f"{(np.ceil if up else np.floor)(value / scale) * scale:.3g}")
