"""Accelerated projected gradient ascent on the n x n multipliers, in fixed-trip blocks.

Every iteration is the same few ``[n, n]``-sized kernels, independent of the number of
coordinates after the reduction: one inverse of ``M + L_lambda``, one ``[n, n] x [n, k]``
product for ``theta(lambda)``, one Gram product for the distances and elementwise work on
``[n, n]`` arrays. No inner loop has a data-dependent trip count: ``_BLOCK`` iterations
run as one ``lax.scan`` and the stopping test (the certificate of
:mod:`~karula_jax.projection.certificate`) runs once a block, so on an accelerator the host
reads one predicate per ``_BLOCK`` iterations.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from karula_jax.projection.certificate import (
    certified,
    dual_eval,
    dual_mask,
    primal_value,
    restore_and_certify,
    should_stop,
)
from karula_jax.projection.contract import ProjectionState, SolverResult
from karula_jax.projection.pair_algebra import hvp, low_rank, pair_dot, symmetric

__all__ = ["solve"]

# Iterations of one compiled block (one ``lax.scan``) between two certificates.
_BLOCK = 10
# Power iterations a block for the step: the largest eigenvalue of the diagonally scaled
# dual Hessian on the pairs that may move, times _SAFETY (the power method underestimates;
# a fall of g doubles L). 1.0 against 1.5: warm projections at n = 100, p = 1010 took 40
# instead of 50-60 iterations, 1.5x and 2.6x the Newton-CG time in two loaded runs against
# 2.3x (results/bench/fista.md).
_POWER = 6
_SAFETY = 1.0
# Sweeps of pull_violated before a certificate's shrink, as laplacian._SWEEPS.
_SWEEPS = 4


def solve(red, warm: ProjectionState, *, tol, max_iter, skip=False) -> SolverResult:
    r"""FISTA on the concave dual ``g(lambda)``, ``lambda >= 0`` over the constrained pairs.

    The gradient is ``(||theta_i - theta_j||^2 - R_ij^2) / 2`` at ``theta(lambda) = (M +
    L_lambda)^{-1} M w``. Steps are taken in the metric of the dual Hessian's diagonal
    ``h_ij = (A^-1_ii + A^-1_jj - 2 A^-1_ij) ||theta_i - theta_j||^2`` (``A = M +
    L_lambda``), scaled by ``1 / L`` with ``L`` the largest eigenvalue of the scaled
    Hessian ``h^{-1/2} H h^{-1/2}`` on the pairs with ``lambda > 0`` or a positive gradient
    (``_POWER`` power iterations at the start of each block, times ``_SAFETY``). Nesterov
    momentum with the gradient restart of O'Donoghue and Candes (momentum reset when the
    step's gradient mapping points against the last move) and with a value safeguard
    (momentum reset, back to the last iterate, and ``L`` doubled for the rest of the
    block when ``g`` falls by more than its float resolution ``64 eps |g|``). ``_BLOCK``
    iterations run as one ``lax.scan`` (past ``max_iter`` the carry is frozen); after
    each block the last evaluation is certified (exactly feasible point, certified gap;
    the best certificate so far is kept) and the loop stops at ``tol``. ``warm.lam``
    starts it (symmetrized, clipped at 0); ``iterations`` counts evaluations of ``g``
    (at most ``max_iter``); the returned ``lam`` is the certified one; the state has no
    per-pair part (``pair_dual`` ``[0, k]``).

    Per iteration: one inverse of ``A`` (``O(n^3)``), two ``[n, n] x [n, k]``-sized
    products and ``[n, n]`` elementwise work; per block ``_POWER`` Hessian products
    (``O(n^2 min(n, k))`` each) and one certificate. No loop inside an iteration.
    """
    n, k = red.w.shape
    dtype = red.w.dtype
    is_low_rank = low_rank(n, k)
    mask = dual_mask(red)
    eps = jnp.finfo(dtype).eps
    lam0 = jnp.where(mask, jnp.maximum(symmetric(warm.lam), 0.0), 0.0)
    evaluate = functools.partial(dual_eval, red=red, gram=True)

    def hdiag(ev):
        da = jnp.diag(ev.a_inv)
        d2 = 2.0 * ev.grad + jnp.where(mask, red.radius, 0.0) ** 2
        h = jnp.where(mask, (da[:, None] + da[None, :] - 2.0 * ev.a_inv) * d2, 0.0)
        return h + eps * jnp.max(h) + jnp.finfo(dtype).tiny

    def step_scale(lam, ev):
        """Largest eigenvalue of the scaled Hessian on the pairs that may move."""
        free = mask & ((lam > 0) | (ev.grad > 0))
        scale = jnp.where(free, jax.lax.rsqrt(hdiag(ev)), 0.0)

        def body(_, c):
            y, _ = c  # y: a vector in the scaled coordinates, unit norm
            hy = scale * hvp(ev, mask, scale * y)  # h^-1/2 H h^-1/2 y (H here: -Hessian)
            hy = jnp.where(free, symmetric(hy), 0.0)
            rho = pair_dot(y, hy)
            norm = jnp.sqrt(pair_dot(hy, hy))
            return jnp.where(norm > 0, hy / jnp.where(norm > 0, norm, 1.0), y), rho

        y0 = jnp.where(free, 1.0, 0.0)
        y0 = y0 / jnp.sqrt(jnp.maximum(pair_dot(y0, y0), 1.0))
        _, rho = jax.lax.fori_loop(0, _POWER, body, (y0, jnp.zeros((), dtype)))
        return _SAFETY * jnp.maximum(rho, 1.0)

    def iteration(c, live):
        lam, lam_prev, t, lip, last = c
        beta = 2.0 * (t - 1.0) / (1.0 + jnp.sqrt(1.0 + 4.0 * t * t))  # (t_k - 1) / t_{k+1}
        y = symmetric(jnp.where(mask, jnp.maximum(lam + beta * (lam - lam_prev), 0.0), 0.0))
        ev = evaluate(y)
        new = symmetric(jnp.where(mask, jnp.maximum(y + ev.grad / (lip * hdiag(ev)), 0.0), 0.0))
        # Restarts: g fell below the last evaluation by more than its float resolution
        # (then go on from the last iterate, whose step from the previous y ascends), or
        # the gradient mapping points against the last move (O'Donoghue and Candes).
        falls = ev.g < last[1].g - 64.0 * eps * jnp.abs(last[1].g)
        against = pair_dot(new - y, new - lam) < 0
        restart = falls | against
        t_next = jnp.where(restart, 1.0, 0.5 * (1.0 + jnp.sqrt(1.0 + 4.0 * t * t)))
        lam_next = jnp.where(falls, lam, new)
        lam_prev = jnp.where(restart, lam_next, lam)
        # A fall also halves the step for the rest of the block (the power estimate of
        # L may be short), so that a step too long cannot repeat without end.
        out = (lam_next, lam_prev, t_next, jnp.where(falls, 2.0 * lip, lip), (y, ev))
        # Past max_iter (the last block's tail) the carry stays as it was.
        return jax.tree.map(lambda a, b: jnp.where(live, a, b), out, c), None

    def certify(lam, ev):
        """(feasible theta, certified gap) at an evaluation, as the Laplacian dual's last
        certificate: ``g`` with the residual term (distances measured again by explicit
        differences up to 96 clients), the shrink from explicit differences (so that its
        margin covers the rounding), repaired first where the span is small."""
        ev = certified(lam, ev, red, exact=n <= 96)
        if not is_low_rank:
            return restore_and_certify(ev.th, ev.g, red)
        lagrangian_gap = primal_value(ev.th, red) - ev.g
        sweeps = jnp.where(lagrangian_gap <= tol * red.scale, _SWEEPS, 0)
        return restore_and_certify(ev.th, ev.g, red, sweeps=sweeps)

    def cond(c):
        return (~c[-1]) & (c[-2] < max_iter)

    def body(c):
        lam, lam_prev, t, last, cert, it, _ = c
        lip = step_scale(*last)
        trips = jnp.minimum(_BLOCK, max_iter - it)
        (lam, lam_prev, t, _, last), _ = jax.lax.scan(
            iteration, (lam, lam_prev, t, lip, last), jnp.arange(_BLOCK) < trips
        )
        # The last evaluation (g at y, a valid lambda >= 0) is certified; the best
        # certificate so far is kept (g is flat at float resolution near the optimum, so
        # the iterate with the best g need not be the one with the smallest violations).
        new_cert = (*certify(*last), last[0])
        cert = jax.tree.map(lambda a, b: jnp.where(new_cert[1] < cert[1], a, b), new_cert, cert)
        it = it + trips
        return lam, lam_prev, t, last, cert, it, should_stop(cert[1], red, tol)

    ev0 = evaluate(lam0)
    last = (lam0, ev0)
    cert = (*certify(lam0, ev0), lam0)
    stop = should_stop(cert[1], red, tol) | skip
    one = jnp.ones((), dtype)
    init = (lam0, lam0, one, last, cert, jnp.int32(0), stop)
    _, _, _, _, cert, it, _ = jax.lax.while_loop(cond, body, init)
    th, delta, lam = cert
    state = ProjectionState(lam=lam, pair_dual=jnp.zeros((0, k), dtype))
    return SolverResult(th, state, delta, it, delta <= tol * red.scale)
