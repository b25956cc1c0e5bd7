"""Cyclic Dykstra over round-robin pair matchings (state: one vector per pair)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax.projection.certificate import dual_eval, restore_and_certify, should_stop
from karula_jax.projection.contract import ProjectionState, SolverResult

__all__ = ["pair_kernel", "solve"]

_CHECK_EVERY = 10  # Dykstra sweeps between two certificates


def pair_kernel(a, b, r, *, mass_a=1.0, mass_b=1.0):
    """Projection of one pair onto ``||a - b|| <= r`` (closed form).

    Minimizes ``mass_a ||a' - a||^2 + mass_b ||b' - b||^2`` subject to
    ``||a' - b'|| <= r``: when the constraint is violated both ends move along
    ``d = a - b``, splitting the shortening ``(1 - r/||d||) d`` in inverse proportion to
    their masses (half each for equal masses).

    Args:
      a: array of shape [p].
      b: array of shape [p].
      r: radius, scalar >= 0 (``inf`` = no constraint).
      mass_a: weight of ``a`` in the metric, scalar > 0.
      mass_b: weight of ``b`` in the metric, scalar > 0.

    Returns:
      ``(a', b')``, arrays of shape [p].
    """
    d = a - b
    norm = jnp.sqrt(jnp.sum(d * d))
    shrink = jnp.where(norm > r, 1.0 - r / jnp.where(norm > 0, norm, 1.0), 0.0)
    step = shrink * d / (mass_a + mass_b)
    return a - mass_b * step, b + mass_a * step


def _round_robin(n: int):
    """Split the pairs i < j into n - 1 (n even) or n (n odd) perfect matchings.

    Returns static arrays ``[rounds, n // 2]``: first and second client, pair index
    in ``np.triu_indices(n, 1)`` order, and a validity flag (False for the bye).
    """
    m = n + n % 2
    pid = -np.ones((n, n), np.int64)
    pi, pj = np.triu_indices(n, 1)
    pid[pi, pj] = np.arange(pi.size)
    ring = list(range(m))
    a, b, idx, ok = [], [], [], []
    for _ in range(m - 1):
        pairs = [(ring[k], ring[m - 1 - k]) for k in range(m // 2)]
        pairs = [(min(x, y), max(x, y)) for x, y in pairs]
        a.append([x if y < n else 0 for x, y in pairs])
        b.append([y if y < n else 0 for x, y in pairs])
        # The bye's pair index is out of range (dropped by the scatter): an in-range
        # placeholder would collide with a real pair of the same matching.
        idx.append([pid[x, y] if y < n else pi.size for x, y in pairs])
        ok.append([y < n for x, y in pairs])
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return tuple(np.asarray(z) for z in (a, b, idx, ok))


def solve(red, warm: ProjectionState, *, tol, max_iter, skip=False) -> SolverResult:
    """Cyclic Dykstra on the reduced problem; ``warm.pair_dual``: ``[m, k]`` pair increments
    (``warm.lam`` is not used: the multipliers are read off the increments).

    Pair ``(i, j)`` keeps one increment vector ``q_ij``; the primal point is always
    ``theta_i = w_i - sum_j m_j Q_ij`` (``Q`` antisymmetric), the exact primal-dual
    relation of Dykstra's method, so any ``q0`` is a valid warm start. A sweep visits
    the round-robin perfect matchings of the complete graph in turn; pairs inside a
    matching are disjoint, so each block projection is the pair kernel vmapped over
    them.
    """
    n = red.w.shape[0]
    q0 = warm.pair_dual
    pi, pj = np.triu_indices(n, 1)
    rp = red.radius[pi, pj]
    mi, mj = red.mass[pi], red.mass[pj]
    q0 = jnp.where(jnp.isfinite(rp)[:, None], q0, 0.0)
    lam_cap = jnp.min(red.mass) / (8 * n * jnp.finfo(red.w.dtype).eps)

    def theta_of(q):
        acc = jax.ops.segment_sum(mj[:, None] * q, pi, n)
        acc = acc - jax.ops.segment_sum(mi[:, None] * q, pj, n)
        return red.w - acc

    def kernel(ta, tb, q, r, ma, mb):
        # Pair kernel on (copy of a, copy of b) shifted by the old increment.
        na, nb = pair_kernel(ta + mb * q, tb - ma * q, r, mass_a=ma, mass_b=mb)
        return (ta + mb * q - na) / mb

    kernel_v = jax.vmap(kernel)

    rr_a, rr_b, rr_idx, rr_ok = (jnp.asarray(z) for z in _round_robin(n))

    def sweep_cyclic(_, carry):
        def block(carry, k):
            th, q = carry
            a, b, idx, ok = rr_a[k], rr_b[k], rr_idx[k], rr_ok[k]
            ma, mb = red.mass[a], red.mass[b]
            r = jnp.where(ok, red.radius[a, b], jnp.inf)
            q_old = q.at[idx].get(mode="fill", fill_value=0.0)
            q_new = kernel_v(th[a], th[b], q_old, r, ma, mb)
            q_new = jnp.where(ok[:, None], q_new, q_old)
            dq = q_old - q_new
            th = th.at[a].add(mb[:, None] * dq).at[b].add(-ma[:, None] * dq)
            return (th, q.at[idx].set(q_new, mode="drop")), None

        carry, _ = jax.lax.scan(block, carry, jnp.arange(rr_a.shape[0]))
        return carry

    def run(q, k):
        # theta is carried inside a cyclic sweep and recomputed from q afterwards, so
        # rounding never breaks the primal-dual relation.
        return jax.lax.fori_loop(0, k, sweep_cyclic, (theta_of(q), q))[1]

    def lam_of(q, th):
        # KKT: m_i (theta_i - w_i) + sum_j lam_ij (theta_i - theta_j) = 0, i.e.
        # lam_ij (theta_i - theta_j) = m_i m_j Q_ij at the solution.
        d = th[pi] - th[pj]
        d2 = jnp.sum(d * d, axis=-1)
        val = mi * mj * jnp.sum(q * d, axis=-1) / jnp.where(d2 > 0, d2, 1.0)
        val = jnp.where(jnp.isfinite(rp) & (d2 > 0), jnp.maximum(val, 0.0), 0.0)
        # Any lam >= 0 gives a valid bound, but one beyond lam_cap makes M + L_lam singular
        # in this float type (m_i + sum_j lam_ij rounds to sum_j lam_ij): radii below the
        # data's float resolution read off such multipliers, and the bound came out NaN.
        val = jnp.where(jnp.isfinite(val), jnp.minimum(val, lam_cap), 0.0)
        lam = jnp.zeros((n, n), red.w.dtype).at[pi, pj].set(val)
        return lam + lam.T

    def check(q):
        th = theta_of(q)
        lam = lam_of(q, th)
        g = dual_eval(lam, red, gram=False, certify=True).g
        th, delta = restore_and_certify(th, g, red)
        return th, lam, delta

    def cond(c):
        _, _, _, _, it, done = c
        return (~done) & (it < max_iter)

    def body(c):
        q, _, _, _, it, _ = c
        k = jnp.minimum(_CHECK_EVERY, max_iter - it)
        q = run(q, k)
        th, lam, delta = check(q)
        return q, th, lam, delta, it + k, should_stop(delta, red, tol)

    th, lam, delta = check(q0)
    init = (q0, th, lam, delta, jnp.int32(0), should_stop(delta, red, tol) | skip)
    q, th, lam, delta, it, _ = jax.lax.while_loop(cond, body, init)
    state = ProjectionState(lam=lam, pair_dual=q)
    return SolverResult(th, state, delta, it, delta <= tol * red.scale)
