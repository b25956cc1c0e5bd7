"""The projection onto the pairwise-distance set by cvxpy (Clarabel): the tests' reference."""

from __future__ import annotations

import warnings

import cvxpy as cp
import numpy as np


def cvxpy_projection(v, radii_sq, *, tol: float = 1e-9):
    """``argmin 1/2 ||theta - v||^2`` s.t. ``||theta_i - theta_j||^2 <= radii_sq[i, j]``.

    Zero radii are equalities, infinite ones no constraint. Returns ``(theta, value)``.
    Clarabel's "may be inaccurate" warning is silenced: callers compare with tolerances.
    """
    n, p = v.shape
    th = cp.Variable((n, p))
    cons = []
    for i in range(n):
        for j in range(i + 1, n):
            if radii_sq[i, j] == 0:
                cons.append(th[i] == th[j])
            elif np.isfinite(radii_sq[i, j]):
                cons.append(cp.norm(th[i] - th[j]) <= np.sqrt(radii_sq[i, j]))
    prob = cp.Problem(cp.Minimize(0.5 * cp.sum_squares(th - v)), cons)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        prob.solve(solver=cp.CLARABEL, tol_gap_abs=tol, tol_gap_rel=tol, tol_feas=tol)
    assert prob.status in ("optimal", "optimal_inaccurate"), prob.status
    return th.value, prob.value
