"""The projection onto the pairwise-distance set by cvxpy (Clarabel): the tests' reference
(:func:`karula_jax.benchmarking.cvxpy_projection`, the benchmarks' too), with a certificate
of its own accuracy.

Clarabel stops at its tolerances, or short of them ("optimal_inaccurate", where only its
reduced tolerances hold), and its last iterations differ by processor. Tests therefore do
not trust its point to a guessed accuracy: :func:`cvxpy_projection` certifies it from
Clarabel's own multipliers, in float64, as the projection's certificate does its point.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from _tolerances import EPS64, certified_distance, reordered_sum

from karula_jax.benchmarking import cvxpy_projection as _reference


class Reference(NamedTuple):
    """cvxpy's projection and certified bounds on its error."""

    theta: np.ndarray  # [n, p] float64, cvxpy's point (feasible only to its tolerance)
    value: float  # its objective 1/2 ||theta - v||^2 (cvxpy's)
    radius: float  # ||theta - theta*|| <= radius, theta* the exact projection
    value_error: float  # |value - F*| <= value_error, F* the optimal value


def cvxpy_projection(v, radii_sq, *, tol: float = 1e-9) -> Reference:
    """``argmin 1/2 ||theta - v||^2`` s.t. ``||theta_i - theta_j||^2 <= radii_sq[i, j]``
    (zero radii: equalities, infinite: none) to Clarabel tolerance ``tol``, certified.

    The certificate: for Clarabel's multipliers (``mu_ij >= 0`` of the norm constraints,
    ``nu_ij`` of the equalities) the Lagrangian ``L(theta)`` is 1-strongly convex, so its
    minimum, the dual value, is at least ``L(x) - 1/2 ||s||^2`` for cvxpy's point ``x`` and a
    subgradient ``s`` there; the optimum ``F*`` lies between that and the objective of a
    feasible point ``x_f`` (``x`` with its zero-radius components merged, then shrunk toward
    the mean until every radius holds), and ``x_f`` is within ``sqrt(2 gap)`` of the
    projection. Float64 rounding of these sums is added to the gap.
    """
    v = np.asarray(v, np.float64)
    radii_sq = np.asarray(radii_sq, np.float64)
    theta, value, prob = _reference(v, radii_sq, tol=tol)
    x = np.asarray(theta, np.float64)
    n, p = x.shape
    sub = x - v  # subgradient of the Lagrangian at x
    lagrangian = 0.5 * np.sum(sub**2)
    magnitude = lagrangian  # the terms' magnitudes, for the rounding of the gap
    zero = np.eye(n, dtype=bool)
    cons = iter(prob.constraints)  # built in this order: i < j, zero then finite radii
    for i in range(n):
        for j in range(i + 1, n):
            d = x[i] - x[j]
            if radii_sq[i, j] == 0:
                nu = np.ravel(next(cons).dual_value)
                sub[i] += nu
                sub[j] -= nu
                lagrangian += nu @ d
                magnitude += np.abs(nu) @ np.abs(d)
                zero[i, j] = zero[j, i] = True
            elif np.isfinite(radii_sq[i, j]):
                mu = max(float(np.ravel(next(cons).dual_value)[0]), 0.0)
                norm, r = np.linalg.norm(d), np.sqrt(radii_sq[i, j])
                unit = d / norm if norm > 0 else np.zeros(p)
                sub[i] += mu * unit
                sub[j] -= mu * unit
                lagrangian += mu * (norm - r)
                magnitude += mu * (norm + r)
    dual_low = lagrangian - 0.5 * np.sum(sub**2)
    feasible = _feasible(x, radii_sq, zero)
    f_feasible = 0.5 * np.sum((feasible - v) ** 2)
    rounding = reordered_sum(n * (n + p), eps=EPS64) * (magnitude + f_feasible)
    gap = max(f_feasible - dual_low, 0.0) + rounding
    radius = float(np.linalg.norm(x - feasible)) + certified_distance(gap)
    value_error = max(f_feasible - value, value - dual_low, 0.0) + rounding
    return Reference(x, float(value), radius, value_error)


def _feasible(x, radii_sq, zero):
    """``x`` with every component of ``zero`` (the zero-radius pairs) set to its mean, then
    shrunk toward the mean of all rows until every finite radius holds (with a margin for
    the float64 rounding of the shrink)."""
    n = len(x)
    reach = zero | np.eye(n, dtype=bool)
    for _ in range(n):  # transitive closure: the components
        reach = (reach.astype(int) @ reach.astype(int)) > 0
    merged = (reach / reach.sum(1, keepdims=True)) @ x
    mean = merged.mean(0)
    d = np.linalg.norm(merged[:, None] - merged[None], axis=-1)
    fin = np.isfinite(radii_sq) & (d > 0)
    ratio = np.where(fin, np.sqrt(np.where(fin, radii_sq, 0.0)) / np.where(fin, d, 1.0), np.inf)
    beta = min(1.0, float(np.min(ratio, initial=1.0)) * (1.0 - 8 * EPS64))
    return mean + beta * (merged - mean)
