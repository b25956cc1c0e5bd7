"""The projection onto the pairwise-distance set by cvxpy (Clarabel): the tests' reference
(:func:`karula_jax.benchmarking.cvxpy_projection`, the benchmarks' too)."""

from __future__ import annotations

from karula_jax.benchmarking import cvxpy_projection as _reference


def cvxpy_projection(v, radii_sq, *, tol: float = 1e-9):
    """``argmin 1/2 ||theta - v||^2`` s.t. ``||theta_i - theta_j||^2 <= radii_sq[i, j]``
    (zero radii: equalities, infinite: none) to Clarabel tolerance ``tol``. Returns
    ``(theta, value)``."""
    theta, value, _ = _reference(v, radii_sq, tol=tol)
    return theta, value
