"""A grid of Karula's ``t`` from the data: where its pairs start and stop binding."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from karula_jax._checks import check_positive_int
from karula_jax.algorithms.step_size import local_optima
from karula_jax.data.clients import ClientData
from karula_jax.evaluation.diagnostics import pairwise_sq_distances

__all__ = ["binding_t_grid", "member_t_grid"]


def binding_t_grid(
    D: Any,
    sq_distances: Any,
    *,
    num: int = 6,
    binding_share: float = 0.9,
    depth: float = 0.01,
    limits: bool = False,
) -> tuple[float, ...]:
    """Values of ``t`` from where most pairs bind to where none does, from the data.

    Pair ``(i, j)`` of models ``theta`` binds Karula's constraint ``||theta_i -
    theta_j||^2 <= t D_ij`` while ``t < r_ij = ||theta_i - theta_j||^2 / D_ij``. With the
    clients' own models (Local, or :func:`karula_jax.algorithms.local_optima`) as
    ``theta``, ``t`` above every ``r_ij`` leaves each client alone (Karula is Local there)
    and ``t`` below every ``r_ij`` pulls every pair in: the points between are where a grid
    of ``t`` tells methods apart. Above the largest ratio every point repeats the same
    models (CV scores tie); below the smallest, every pair binds and the models keep moving
    together as ``t`` falls, so the grid goes on below it: it is geometric from ``depth``
    times the ratio that ``binding_share`` of the pairs exceed (where those pairs may stay
    at most ``sqrt(depth)`` of their own distance apart: 10% at the default) to the
    largest ratio. Pairs with ``D_ij = 0`` bind at every finite ``t`` and pairs of
    equal models at none; neither enters the ratios. Stacked problems (``[B, n, n]``, the
    members of a study) pool their pairs: one grid for all of them.

    Args:
      D: ``[n, n]`` dissimilarities (:func:`karula_jax.embedding.dissimilarities`), or
        ``[..., n, n]`` stacked.
      sq_distances: squared distances between the clients' own models
        (:func:`karula_jax.evaluation.pairwise_sq_distances`), the shape of ``D``.
      num: number of grid points (``>= 1``).
      binding_share: the share of pairs whose ratio sets the grid's low end, in ``(0, 1]``
        (at least that share binds at every point below it).
      depth: the smallest point over that ratio, in ``(0, 1]`` (``1``: the grid stops
        where ``binding_share`` of the pairs start to bind).
      limits: add the natural limits ``0`` (every model equal) and ``inf`` (no coupling).

    Returns:
      Increasing ``t`` values, 3 significant digits (readable labels; the largest rounded
      up and the smallest down); ``(inf,)`` (with
      ``limits``: ``(0.0, inf)``) where no pair can bind (every ratio is 0 or undefined).

    Raises:
      ValueError: shapes that are not ``[..., n, n]`` and equal; a negative or NaN entry
        off the diagonal; ``binding_share`` outside ``(0, 1]``.
      TypeError: ``num`` not an int.

    Examples:
      >>> import numpy as np
      >>> from karula_jax.protocol import binding_t_grid
      >>> D = np.array([[0.0, 1.0, 4.0], [1.0, 0.0, 1.0], [4.0, 1.0, 0.0]])
      >>> sq = np.array([[0.0, 2.0, 4.0], [2.0, 0.0, 8.0], [4.0, 8.0, 0.0]])  # ratios 2, 1, 8
      >>> binding_t_grid(D, sq, num=4, binding_share=1.0, depth=1.0)  # the ratios' range
      (1.0, 2.0, 4.0, 8.0)
      >>> binding_t_grid(D, sq, num=4, binding_share=1.0)  # two decades further down
      (0.01, 0.0928, 0.862, 8.0)
    """
    num = check_positive_int("num", num)
    if not 0.0 < float(binding_share) <= 1.0:
        raise ValueError(f"binding_share must lie in (0, 1], got {binding_share}")
    if not 0.0 < float(depth) <= 1.0:
        raise ValueError(f"depth must lie in (0, 1], got {depth}")
    D, sq = np.asarray(D, np.float64), np.asarray(sq_distances, np.float64)
    if D.ndim < 2 or D.shape[-1] != D.shape[-2] or sq.shape != D.shape:
        raise ValueError(
            "D and sq_distances must both have shape [n, n] (or [..., n, n]), got "
            f"{D.shape} and {sq.shape}"
        )
    upper = np.triu_indices(D.shape[-1], k=1)
    d, s = D[..., upper[0], upper[1]].ravel(), sq[..., upper[0], upper[1]].ravel()
    for name, values in (("D", d), ("sq_distances", s)):
        if np.isnan(values).any() or (values < 0).any():
            raise ValueError(f"{name} must be >= 0 off the diagonal, with no NaN")
    finite = (d > 0) & np.isfinite(d) & np.isfinite(s) & (s > 0)
    ratios = np.sort(s[finite] / d[finite])
    ends = (0.0, float("inf")) if limits else (float("inf"),)
    if ratios.size == 0:
        return ends
    low = float(depth) * float(np.quantile(ratios, 1.0 - float(binding_share)))
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


def member_t_grid(
    loss,
    params: Any,
    train: ClientData,
    D: Any,
    smoothness: Any,
    *,
    steps: int = 500,
    personalized: Any = True,
    **grid,
) -> tuple[float, ...]:
    """:func:`binding_t_grid` of a study's members, from their own training rows.

    Each member's clients train alone (:func:`~karula_jax.algorithms.local_optima`,
    ``steps`` full-batch steps at ``1 / L_i``, the step that decreases every ``f_i``),
    and the squared distances of those models over the ``personalized`` leaves, against
    each member's ``D``, give the pairs' binding ratios; the ratios of every member are
    pooled into one grid (one compiled run then serves every member). Only rows a
    member trains on enter: its validation and test rows do not.

    Args:
      loss: ``loss(params, x, y, mask) -> scalar``, the loss the methods train.
      params: ONE starting model (no client or member axis).
      train: the members' training data, leaves ``[B, n, N, ...]``.
      D: ``[B, n, n]`` the members' dissimilarities.
      smoothness: ``[B, n]`` (or ``[B]``) each client's ``L_i``.
      steps: gradient steps of the local models (static); too few underestimate the
        distances along flat directions, which lowers the grid.
      personalized: the leaves Karula's constraint measures (``True``: all).
      **grid: :func:`binding_t_grid`'s ``num``, ``binding_share``, ``depth``, ``limits``.

    Returns:
      :func:`binding_t_grid` of the pooled pairs.
    """
    train = jax.tree.map(np.asarray, train)
    L = np.broadcast_to(
        np.asarray(smoothness, np.float32).reshape(len(train.counts), -1), train.counts.shape
    )
    models = jax.jit(jax.vmap(lambda d, c: local_optima(loss, params, d, c, steps=steps)))(train, L)
    sq = np.stack(
        [
            pairwise_sq_distances(jax.tree.map(lambda a, b=b: a[b], models), personalized)
            for b in range(len(train.counts))
        ]
    )
    return binding_t_grid(D, sq, **grid)
