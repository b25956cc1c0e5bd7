"""The Lagrangian dual bound g(lam) that certifies any feasible point's suboptimality."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from karula_jax import _linalg
from karula_jax.projection.reduction import (
    pull_violated,
    restore,
    sq_dists_exact,
    sq_dists_of_gram,
)


def primal_value(th, red):
    return 0.5 * jnp.sum(red.mass[:, None] * (th - red.w) ** 2)


def dual_mask(red):
    n = red.radius.shape[0]
    return jnp.isfinite(red.radius) & ~jnp.eye(n, dtype=bool)


class DualEval(NamedTuple):
    th: jnp.ndarray  # [n, k] theta(lam)
    g: jnp.ndarray  # [] g(lam) (certified only when built with certify=True)
    grad: jnp.ndarray  # [n, n] dg/dlam, zero off the constrained pairs
    a_inv: jnp.ndarray  # [n, n] (M + L_lam)^{-1}
    gram: jnp.ndarray  # [n, n] theta theta^T


def dual_eval(lam, red, *, gram, certify=False):
    """theta(lam), g(lam), its gradient and the inverse of M + L_lam.

    An explicit inverse followed by matrix products; ``M + L_lam`` is strictly diagonally
    dominant (``M >= 1``) and symmetric, so :func:`karula_jax._linalg.inv_spd_dominant`
    applies (on the CPU plain array operations that vmap as a batch, no LAPACK). Its
    rounding is covered by the residual term below. ``gram``: squared distances from the
    Gram matrix (one product; rounding up to ``eps (|theta_i|^2 + |theta_j|^2)``) instead
    of explicit differences (``O(n^2 k)`` work and memory).
    """
    a = _system(lam, red)
    a_inv = _linalg.inv_spd_dominant(a)
    a_inv = 0.5 * (a_inv + a_inv.T)
    rhs = red.mass[:, None] * red.w
    th = a_inv @ rhs
    gm = th @ th.T
    ev = _at(lam, th, a_inv, gm, red, gram=gram)
    return certified(lam, ev, red) if certify else ev


def _at(lam, th, a_inv, gm, red, *, gram):
    """The :class:`DualEval` of ``theta(lam) = th``: ``g`` (uncertified) and its gradient
    from the squared distances (through ``gm`` with ``gram``, else exact)."""
    mask = dual_mask(red)
    d2 = sq_dists_of_gram(gm) if gram else sq_dists_exact(th)
    slack = jnp.where(mask, d2 - jnp.where(mask, red.radius, 0.0) ** 2, 0.0)
    g = primal_value(th, red) + 0.25 * jnp.sum(lam * slack)  # 1/2 sum_{i<j}
    return DualEval(th, g, 0.5 * slack, a_inv, gm)


def certified(lam, ev, red, *, exact=False):
    """``ev``, an evaluation ``dual_eval(lam, red, certify=False)``, with its ``g`` made a
    certified bound, as ``certify=True`` would have returned it: one ``[n, n] x [n, k]``
    product instead of a new evaluation (and its inverse). ``exact``: its distances (so
    ``g`` and the gradient) measured again by explicit differences, as ``gram=False``
    would have, where ``ev`` took them from the Gram matrix."""
    if exact:
        ev = _at(lam, ev.th, ev.a_inv, ev.gram, red, gram=False)
    return ev._replace(g=ev.g - _residual_term(_system(lam, red), ev.th, red))


def _system(lam, red):
    """``M + L_lam`` ``[n, n]``: the Lagrangian's Hessian in theta (per coordinate)."""
    return jnp.diag(red.mass + jnp.sum(lam, axis=1)) - lam


def _residual_term(a, th, red):
    """theta is only an approximate minimizer of the Lagrangian; since ``M + L >= I`` the
    Lagrangian exceeds its minimum by at most ``1/2 ||residual||^2``, this term."""
    res = red.mass[:, None] * red.w - a @ th
    return 0.5 * jnp.sum(res * res)


def should_stop(delta, red, tol):
    """Loop exit: certified, or a non-finite gap (NaN input), which no iteration mends."""
    return (delta <= tol * red.scale) | ~jnp.isfinite(delta)


def restore_and_certify(th, g, red, *, gram=False, sweeps=0, sq_dists=None):
    """(restored theta, certified suboptimality) for a primal iterate and a dual bound.

    ``sq_dists``: ``th``'s squared distances where the caller has them, for its shrink
    (:func:`~karula_jax.projection.reduction.restore`).

    With ``sweeps`` (a traced count, > 0 where wanted) the iterate is also repaired by
    :func:`~karula_jax.projection.reduction.pull_violated` before its shrink, and the
    feasible point with the smaller gap is kept; either is exactly feasible.
    """
    shrunk = restore(th, red.radius, gram=gram, sq_dists=sq_dists)
    gap = primal_value(shrunk, red) - g
    if isinstance(sweeps, int) and sweeps == 0:
        return shrunk, jnp.maximum(gap, 0.0)
    pulled = restore(pull_violated(th, red.radius, red.mass, sweeps), red.radius, gram=gram)
    gap_pulled = primal_value(pulled, red) - g
    better = gap_pulled < gap
    th = jnp.where(better, pulled, shrunk)
    return th, jnp.maximum(jnp.where(better, gap_pulled, gap), 0.0)
