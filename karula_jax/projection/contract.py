"""What every projection solver takes and returns (the types only; solvers.py lists them).

A solver works on the reduced problem of :mod:`karula_jax.projection.reduction`: merged
slots with masses ``m`` (``[n]``), centred (and possibly rotated) values ``w``
(``[n, k]``) and slot radii ``R`` (``[n, n]``, ``inf`` where unconstrained). It solves

    min_theta 1/2 sum_c m_c ||theta_c - w_c||^2  s.t.  ||theta_c - theta_d|| <= R_cd,

and must return a point that is exactly feasible (made so by
:func:`~karula_jax.projection.certificate.restore_and_certify`) with a certified gap from
the Lagrangian dual bound of :mod:`karula_jax.projection.certificate`. Adding a solver is one
module with a function of the :class:`Solver` ``solve`` signature and one row in
``karula_jax.projection.solvers.SOLVERS``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp

__all__ = ["ProjectionState", "Solver", "SolverResult"]


class ProjectionState(NamedTuple):
    """Dual state of the projection, carried across calls for warm starts.

    Attributes:
      lam: multipliers of ``||theta_i - theta_j||^2 <= r_ij^2`` (per merged slot),
        symmetric with zero diagonal. ``[n, n]``.
      pair_dual: one vector per pair ``i < j`` (row order of ``np.triu_indices(n, 1)``) in
        the flattened personalized coordinates, ``[n(n-1)/2, p]``, for solvers that keep
        per-pair state (Dykstra's increments); ``[0, p]`` for the others.
    """

    lam: jnp.ndarray
    pair_dual: jnp.ndarray


class SolverResult(NamedTuple):
    """One solver's answer on a reduced problem (``n`` slots, ``k`` coordinates).

    Attributes:
      theta: ``[n, k]`` feasible point (restored), in the reduced coordinates.
      state: :class:`ProjectionState` in the reduced coordinates (``pair_dual`` ``[m, k]``).
      gap: ``[]`` certified suboptimality ``1/2 sum m ||theta - w||^2 - g(lam) >= 0``.
      iterations: ``[]`` int32, the solver's own iteration count.
      converged: ``[]`` bool, ``gap <= tol * S``.
    """

    theta: jnp.ndarray
    state: ProjectionState
    gap: jnp.ndarray
    iterations: jnp.ndarray
    converged: jnp.ndarray


class Solver(NamedTuple):
    """A registry row.

    Attributes:
      solve: ``solve(red, warm, *, tol, max_iter, skip) -> SolverResult``. ``red`` is a
        :class:`~karula_jax.projection.reduction.Reduced`; ``warm`` a
        :class:`ProjectionState` in its coordinates (any value is a valid start); ``tol``
        (relative to ``red.scale``) and ``max_iter`` traced scalars; ``skip`` a traced
        bool that makes the solver return its start at once (set under ``vmap`` for members
        a screen has answered). Must run under ``jit``, ``vmap`` and ``lax.scan``.
      pair_state: whether ``ProjectionState.pair_dual`` has one row per pair.
      rotate: ``rotate(n, p) -> bool``, static: solve on an orthonormal basis of the span
        of the centred models (``k = min(n, p)``) instead of the ``p`` coordinates.
    """

    solve: Callable[..., SolverResult]
    pair_state: bool
    rotate: Callable[[int, int], bool]
