r"""Certified Euclidean projection onto the pairwise-distance constraint set K.

Given client models ``v`` (leaves with a leading client axis ``n``) and squared radii
``radii_sq = t * D`` (``[n, n]``), :func:`project` solves

.. math::

   \min_\theta \tfrac12 \sum_i \|\theta_i - v_i\|^2
   \quad\text{s.t.}\quad \|\theta_i - \theta_j\|^2 \le r_{ij}^2 \ \ \forall i < j,

where the norm runs over the concatenation of all *personalized* leaves; shared leaves
are constrained to be equal across clients and are projected to their mean.

How it is solved (all inside one compiled program):

1. Zero radii are exact equalities, which no finite multiplier enforces. Clients
   joined by zero radii (connected components of the zero-radius graph) are merged
   into one slot with mass ``m_c`` = component size and value = component mean; the
   radius between two slots is the smallest radius between their members. The
   problem keeps its static size ``n``: empty slots have mass 1, value 0 and no
   constraints.
2. Coordinates are centred at the mean (the projection is translation equivariant
   and keeps the mean) and, when ``p > n``, rotated onto an orthonormal basis of the
   span of the centred models (the solution lies in that span), so every iteration
   costs ``O(n^2 min(n, p))``.
3. A solver (parallel Dykstra, or dual ascent on the Laplacian multipliers) runs in a
   ``lax.while_loop``. Every few iterations the current multipliers ``lam`` give a
   certified lower bound on the optimal value through the Lagrangian dual

   .. math::

      g(\lambda) = \min_\theta \tfrac12 \sum_c m_c \|\theta_c - w_c\|^2
      + \tfrac12 \sum_{c<d} \lambda_{cd} (\|\theta_c - \theta_d\|^2 - R_{cd}^2),
      \qquad \theta(\lambda) = (M + L_\lambda)^{-1} M w,

   with ``L_lam`` the graph Laplacian of the weights ``lam`` (an ``n x n`` system).
4. The primal iterate is made exactly feasible by shrinking it toward the mean by
   ``beta = min(1, min R_cd / ||theta_c - theta_d||)``, and ``delta`` = primal value of
   the returned point minus ``g(lam)`` is a certified bound on its suboptimality
   (``1/2 ||theta - theta*||^2 <= delta`` as well, by strong convexity). The loop stops
   when ``delta <= tol * S`` with ``S = 1/2 sum_i ||v_i - mean(v)||^2`` (the value at
   ``t = 0``, an upper bound on the optimal value).

Solvers: ``method="dykstra"`` (default) is Dykstra's algorithm cycling over the
``n - 1`` round-robin perfect matchings of the complete graph (the pair kernel vmapped
over the ``n / 2`` disjoint pairs of a matching; one vector of dual state per pair);
``"dykstra_parallel"`` projects all pairs at once and averages the ``n - 1`` copies of
each client (uniform weights = the product metric); ``"laplacian"`` is a projected
Newton-CG ascent on the ``n x n`` multipliers only (no per-pair vectors), for many
clients. All three return the same certified output.

Precision: the certificate is computed in the input dtype. In float32 it is exact only
up to a few ``1e-7 * S`` (rounding in ``g``), so ``delta`` may undershoot the true
suboptimality by that much and ``tol`` much below ``1e-6`` is out of reach; float64
(``with jax.enable_x64(True):`` and float64 inputs) certifies to ``~1e-13 * S``. The
returned point is feasible up to the rounding of the last additions (the restoration
keeps a margin of ``4 eps`` of every radius).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "ProjectionInfo",
    "ProjectionState",
    "init_projection_state",
    "pair_kernel",
    "project",
]

METHODS = ("dykstra", "laplacian", "dykstra_parallel")
_CHECK_EVERY = 10  # Dykstra sweeps between two certificates
# Conjugate-gradient steps per Newton step; fewer for many clients, where one
# Hessian-vector product costs O(n^3).
_CG_MAX_ITER = 20
_CG_MAX_ITER_LARGE = 5
# Above this many clients the dual solver measures distances through the Gram matrix
# (one BLAS product) instead of explicit differences.
_GRAM_ABOVE = 96

# Incremented each time the core is traced: tests use it to prove single compilation.
_TRACE_COUNT = 0


class ProjectionState(NamedTuple):
    """Dual state of the projection, carried across calls for warm starts.

    Attributes:
      lam: multipliers of ``||theta_i - theta_j||^2 <= r_ij^2`` (per merged slot),
        symmetric with zero diagonal.
      pair_dual: Dykstra increments, one vector per pair ``i < j`` (row order of
        ``np.triu_indices(n, 1)``) in the flattened personalized coordinates;
        ``[0, p]`` for ``method="laplacian"``.
    """

    lam: jnp.ndarray  # [n, n] float
    pair_dual: jnp.ndarray  # [n(n-1)/2, p] float (dykstra) or [0, p] (laplacian)


class ProjectionInfo(NamedTuple):
    """Diagnostics of one projection (scalars unless noted).

    Attributes:
      iterations: solver iterations used.
      max_violation: ``max_ij max(||theta_i - theta_j|| - r_ij, 0)`` on the returned
        point (absolute, computed from explicit differences).
      rel_violation: ``max_violation`` divided by the largest finite radius (by 1 when
        there is none or it is 0).
      delta: certified suboptimality ``1/2||theta - v||^2 - g(lam)`` (>= 0).
      rel_delta: ``delta / S`` with ``S = 1/2 sum_i ||v_i - mean(v)||^2``.
      converged: ``delta <= tol * S``.
      state: :class:`ProjectionState` to pass back as ``warm_start``.
    """

    iterations: jnp.ndarray  # [] int32
    max_violation: jnp.ndarray  # [] float
    rel_violation: jnp.ndarray  # [] float
    delta: jnp.ndarray  # [] float
    rel_delta: jnp.ndarray  # [] float
    converged: jnp.ndarray  # [] bool
    state: ProjectionState


# --------------------------------------------------------------------------- kernels


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


def _client_mean(x):
    """Mean over the leading client axis as one matrix-vector product.

    XLA:CPU runs ``jnp.mean(x, axis=0)`` on a wide leaf (e.g. a shared ``[30, 784, 100]``
    layer) as a slow strided reduction, about 25x slower than the same sum as a BLAS matvec.
    """
    n = x.shape[0]
    flat = jnp.reshape(x, (n, -1))
    return jnp.reshape(jnp.full((n,), 1.0 / n, flat.dtype) @ flat, x.shape[1:])


def _sq_dists_exact(th):
    """Squared distances between rows from explicit differences. [n, r] -> [n, n]."""
    row = lambda t: jnp.sum((th - t) ** 2, axis=-1)
    n = th.shape[0]
    if n * n * th.shape[1] <= (1 << 24):
        return jax.vmap(row)(th)
    return jax.lax.map(row, th, batch_size=max(1, (1 << 24) // (n * th.shape[1])))


def _sq_dists_gram(th):
    """Squared distances between rows through the Gram matrix (fast, less exact)."""
    sq = jnp.sum(th * th, axis=-1)
    return jnp.maximum(sq[:, None] + sq[None, :] - 2.0 * (th @ th.T), 0.0)


def _components(zero):
    """Labels of connected components (label = smallest member index). [n, n] bool."""
    n = zero.shape[0]
    adj = zero | jnp.eye(n, dtype=bool)
    big = jnp.int32(n)

    def body(carry):
        labels, _ = carry
        new = jnp.min(jnp.where(adj, labels[None, :], big), axis=1)
        new = new[new]  # pointer jumping: converges in O(log diameter) sweeps
        return new, jnp.any(new != labels)

    labels, _ = jax.lax.while_loop(
        lambda c: c[1], body, (jnp.arange(n, dtype=jnp.int32), jnp.array(True))
    )
    return labels


class _Reduced(NamedTuple):
    labels: jnp.ndarray  # [n] int32, slot of each client
    mass: jnp.ndarray  # [n] float, component sizes (1 for empty slots)
    w: jnp.ndarray  # [n, k] centred (and rotated) slot values, 0 for empty slots
    radius: jnp.ndarray  # [n, n] slot radii, inf where unconstrained (and diagonal)
    mu: jnp.ndarray  # [p] mean of v
    basis: Any  # [p, k] orthonormal columns, or None when k = p
    scale: jnp.ndarray  # [] S = 1/2 sum_i ||v_i - mu||^2
    count: jnp.ndarray  # [n] component sizes (0 for empty slots)
    wbar: jnp.ndarray  # [n, p] centred slot values in the original coordinates


def _span_basis(a):
    """Orthonormal columns spanning the rows of ``a`` [n, p] (zero columns where a row
    adds no new direction), by Gram-Schmidt with re-orthogonalization. [p, n].

    (LAPACK QR of tall float32 matrices was found to be orders of magnitude slower on
    the CPU than this loop.)
    """
    n, p = a.shape
    floor = 64.0 * n * jnp.finfo(a.dtype).eps * jnp.max(jnp.sqrt(jnp.sum(a * a, axis=1)))

    def body(i, q):
        x = a[i]
        x = x - q @ (q.T @ x)
        x = x - q @ (q.T @ x)
        norm = jnp.sqrt(jnp.sum(x * x))
        col = jnp.where(norm > floor, x / jnp.where(norm > 0, norm, 1.0), 0.0)
        return q.at[:, i].set(col)

    return jax.lax.fori_loop(0, n, body, jnp.zeros((p, n), a.dtype))


def _reduce(x, radii_sq, *, rotate):
    n, p = x.shape
    dtype = x.dtype
    eye = jnp.eye(n, dtype=bool)
    r = jnp.sqrt(jnp.maximum(radii_sq.astype(dtype), 0.0))
    r = jnp.where(eye, jnp.inf, r)
    labels = _components(r == 0)
    count = jax.ops.segment_sum(jnp.ones((n,), dtype), labels, n)
    live = count > 0
    mass = jnp.where(live, count, 1.0)
    mu = _client_mean(x)
    xc = x - mu
    wbar = jax.ops.segment_sum(xc, labels, n) / mass[:, None]
    rmin = jax.ops.segment_min(r, labels, n)  # [slot, client]
    rmin = jax.ops.segment_min(rmin.T, labels, n).T  # [slot, slot]
    radius = jnp.where(live[:, None] & live[None, :] & ~eye, rmin, jnp.inf)
    if rotate and p > n:
        basis = _span_basis(wbar)  # [p, n]
        w = wbar @ basis
    else:
        basis, w = None, wbar
    scale = 0.5 * jnp.sum(xc * xc)
    return _Reduced(labels, mass, w, radius, mu, basis, scale, count, wbar)


def _restore(th, radius, *, gram=False):
    """Shrink toward the (weighted) mean, here 0, until every constraint holds."""
    eps = jnp.finfo(th.dtype).eps
    d = jnp.sqrt(_sq_dists_gram(th) if gram else _sq_dists_exact(th))
    ok = jnp.isfinite(radius) & (d > 0)
    ratio = jnp.where(ok, radius * (1.0 - 4.0 * eps) / jnp.where(ok, d, 1.0), jnp.inf)
    beta = jnp.minimum(1.0, jnp.min(ratio))
    return th * beta


def _primal(th, red):
    return 0.5 * jnp.sum(red.mass[:, None] * (th - red.w) ** 2)


def _dual_mask(red):
    n = red.radius.shape[0]
    return jnp.isfinite(red.radius) & ~jnp.eye(n, dtype=bool)


class _DualEval(NamedTuple):
    th: jnp.ndarray  # [n, k] theta(lam)
    g: jnp.ndarray  # [] g(lam) (certified only when built with certify=True)
    grad: jnp.ndarray  # [n, n] dg/dlam, zero off the constrained pairs
    a_inv: jnp.ndarray  # [n, n] (M + L_lam)^{-1}
    gram: jnp.ndarray  # [n, n] theta theta^T


def _dual_eval(lam, red, *, gram, certify=False):
    """theta(lam), g(lam), its gradient and the inverse of M + L_lam.

    An explicit inverse (LU) followed by matrix products: on the CPU this is several
    times faster than a Cholesky factorization and triangular solves with many
    right-hand sides, and its rounding is covered by the residual term below.
    """
    mask = _dual_mask(red)
    a = jnp.diag(red.mass + jnp.sum(lam, axis=1)) - lam
    a_inv = jnp.linalg.inv(a)
    a_inv = 0.5 * (a_inv + a_inv.T)
    rhs = red.mass[:, None] * red.w
    th = a_inv @ rhs
    gm = th @ th.T
    if gram:
        sq = jnp.diag(gm)
        d2 = jnp.maximum(sq[:, None] + sq[None, :] - 2.0 * gm, 0.0)
    else:
        d2 = _sq_dists_exact(th)
    slack = jnp.where(mask, d2 - jnp.where(mask, red.radius, 0.0) ** 2, 0.0)
    g = _primal(th, red) + 0.25 * jnp.sum(lam * slack)  # 1/2 sum_{i<j}
    if certify:
        # theta is only an approximate minimizer of the Lagrangian; since M + L >= I
        # the Lagrangian exceeds its minimum by at most 1/2 ||residual||^2.
        res = rhs - a @ th
        g = g - 0.5 * jnp.sum(res * res)
    return _DualEval(th, g, 0.5 * slack, a_inv, gm)


def _delta(th, g, red, *, gram=False):
    """(restored theta, certified suboptimality) for a primal iterate and a dual bound."""
    th = _restore(th, red.radius, gram=gram)
    return th, jnp.maximum(_primal(th, red) - g, 0.0)


# ------------------------------------------------------------------------ solvers


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
        idx.append([pid[x, y] if y < n else 0 for x, y in pairs])
        ok.append([y < n for x, y in pairs])
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return tuple(np.asarray(z) for z in (a, b, idx, ok))


def _dykstra(red, q0, *, tol, max_iter, parallel):
    """Dykstra's algorithm on the merged problem; q0: [m, k] pair increments.

    Pair ``(i, j)`` keeps one increment vector ``q_ij``; the primal point is always
    ``theta_i = w_i - (1 / c) sum_j m_j Q_ij`` (``Q`` antisymmetric), the exact
    primal-dual relation of Dykstra's method, so any ``q0`` is a valid warm start.

    ``parallel=False`` (default): cyclic Dykstra over the round-robin perfect
    matchings of the complete graph (``c = 1``); pairs inside a matching are disjoint,
    so each block projection is the pair kernel vmapped over ``n / 2`` pairs.
    ``parallel=True``: every pair projects its own copy of the two clients and the
    ``n - 1`` copies of a client are averaged uniformly (``c = n - 1``), which is the
    projection onto the consensus set in the product metric.
    """
    n = red.w.shape[0]
    pi, pj = np.triu_indices(n, 1)
    rp = red.radius[pi, pj]
    mi, mj = red.mass[pi], red.mass[pj]
    copies = n - 1 if parallel else 1
    q0 = jnp.where(jnp.isfinite(rp)[:, None], q0, 0.0)

    def theta_of(q):
        acc = jax.ops.segment_sum(mj[:, None] * q, pi, n)
        acc = acc - jax.ops.segment_sum(mi[:, None] * q, pj, n)
        return red.w - acc / copies

    def kernel(ta, tb, q, r, ma, mb):
        # Pair kernel on (copy of a, copy of b) shifted by the old increment.
        na, nb = pair_kernel(ta + mb * q, tb - ma * q, r, mass_a=ma, mass_b=mb)
        return (ta + mb * q - na) / mb

    kernel_v = jax.vmap(kernel)

    def sweep_parallel(_, q):
        th = theta_of(q)
        return kernel_v(th[pi], th[pj], q, rp, mi, mj)

    rr_a, rr_b, rr_idx, rr_ok = (jnp.asarray(z) for z in _round_robin(n))

    def sweep_cyclic(_, carry):
        def block(carry, k):
            th, q = carry
            a, b, idx, ok = rr_a[k], rr_b[k], rr_idx[k], rr_ok[k]
            ma, mb = red.mass[a], red.mass[b]
            r = jnp.where(ok, red.radius[a, b], jnp.inf)
            q_old = q[idx]
            q_new = kernel_v(th[a], th[b], q_old, r, ma, mb)
            q_new = jnp.where(ok[:, None], q_new, q_old)
            dq = q_old - q_new
            th = th.at[a].add(mb[:, None] * dq).at[b].add(-ma[:, None] * dq)
            return (th, q.at[idx].set(q_new)), None

        carry, _ = jax.lax.scan(block, carry, jnp.arange(rr_a.shape[0]))
        return carry

    def run(q, k):
        if parallel:
            return jax.lax.fori_loop(0, k, sweep_parallel, q)
        # theta is carried inside a cyclic sweep and recomputed from q afterwards, so
        # rounding never breaks the primal-dual relation.
        return jax.lax.fori_loop(0, k, sweep_cyclic, (theta_of(q), q))[1]

    def lam_of(q, th):
        # KKT: m_i (theta_i - w_i) + sum_j lam_ij (theta_i - theta_j) = 0, i.e.
        # lam_ij (theta_i - theta_j) = m_i m_j Q_ij / c at the solution.
        d = th[pi] - th[pj]
        d2 = jnp.sum(d * d, axis=-1)
        val = mi * mj / copies * jnp.sum(q * d, axis=-1) / jnp.where(d2 > 0, d2, 1.0)
        val = jnp.where(jnp.isfinite(rp) & (d2 > 0), jnp.maximum(val, 0.0), 0.0)
        lam = jnp.zeros((n, n), red.w.dtype).at[pi, pj].set(val)
        return lam + lam.T

    def check(q):
        th = theta_of(q)
        lam = lam_of(q, th)
        g = _dual_eval(lam, red, gram=False, certify=True).g
        th, delta = _delta(th, g, red)
        return th, lam, delta

    def cond(c):
        _, _, _, _, it, done = c
        return (~done) & (it < max_iter)

    def body(c):
        q, _, _, _, it, _ = c
        k = jnp.minimum(_CHECK_EVERY, max_iter - it)
        q = run(q, k)
        th, lam, delta = check(q)
        return q, th, lam, delta, it + k, delta <= tol * red.scale

    th, lam, delta = check(q0)
    init = (q0, th, lam, delta, jnp.int32(0), delta <= tol * red.scale)
    q, th, lam, delta, it, done = jax.lax.while_loop(cond, body, init)
    return th, lam, q, delta, it, done


def _laplacian(red, lam0, *, tol, max_iter):
    r"""Projected Newton (two-metric, Newton-CG) ascent on the n x n multipliers.

    The dual ``g(lam)`` is concave with gradient ``(||theta_i - theta_j||^2 - R_ij^2)/2``
    and Hessian ``-(B^T (M + L)^{-1} B) o (B^T theta)(B^T theta)^T`` (``B`` the pair
    incidence matrix, ``o`` the entrywise product). A Hessian-vector product costs one
    Laplacian product, one multiplication by ``(M + L)^{-1}`` and one Gram product,
    ``O(n^2 k)``, so no pair-by-pair or per-pair-vector storage is needed. Pairs at
    the bound that the diagonal Newton step would push below zero take that scaled
    gradient step (to 0); the others take a Newton step solved by preconditioned CG;
    an Armijo search along the projected path keeps the ascent monotone.
    """
    n = red.w.shape[0]
    gram = n > _GRAM_ABOVE
    cg_iter = _CG_MAX_ITER_LARGE if gram else _CG_MAX_ITER
    mask = _dual_mask(red)
    tiny = jnp.finfo(red.w.dtype).tiny
    eps = jnp.finfo(red.w.dtype).eps
    lam0 = jnp.where(mask, jnp.maximum(0.5 * (lam0 + lam0.T), 0.0), 0.0)
    evaluate = functools.partial(_dual_eval, red=red, gram=gram)
    pdot = lambda a, b: 0.5 * jnp.sum(a * b)  # inner product over pairs i < j

    def kkt(lam, ev):
        rel = 2.0 * ev.grad / jnp.where(mask, red.radius, 1.0) ** 2
        return jnp.max(jnp.where(mask, jnp.where(lam > 0, jnp.abs(rel), rel), 0.0))

    def hvp(ev, a_inv, x):
        # (B^T A^-1 B o (B^T th)(B^T th)^T) x = pair differences of A^-1 L_x th th^T
        yt = a_inv @ (jnp.sum(x, axis=1)[:, None] * ev.gram - x @ ev.gram)
        dg = jnp.diag(yt)
        return jnp.where(mask, dg[:, None] + dg[None, :] - yt - yt.T, 0.0)

    def direction(lam, ev):
        a_inv = ev.a_inv
        da = jnp.diag(a_inv)
        d2 = 2.0 * ev.grad + jnp.where(mask, red.radius, 0.0) ** 2  # ||theta_i-theta_j||^2
        hdiag = jnp.where(mask, (da[:, None] + da[None, :] - 2.0 * a_inv) * d2, 0.0)
        mu = eps * jnp.max(hdiag) + tiny
        pre = hdiag + mu
        diag_step = ev.grad / pre
        active = mask & (ev.grad < 0) & (lam + diag_step <= 0)
        free = mask & ~active
        b = jnp.where(free, ev.grad, 0.0)
        op = lambda x: jnp.where(free, hvp(ev, a_inv, x) + mu * x, 0.0)
        s = _pcg(op, b, jnp.where(free, pre, 1.0), pdot, rtol=0.1, max_iter=cg_iter)
        newton = jnp.where(free, s, jnp.where(active, diag_step, 0.0))
        return newton, jnp.where(mask, diag_step, 0.0)

    def line_search(lam, ev, s):
        def trial(alpha):
            new = jnp.maximum(lam + alpha * s, 0.0)
            ev_new = evaluate(new)
            gain = pdot(ev.grad, new - lam)
            ok = (ev_new.g >= ev.g + 1e-4 * gain) & (ev_new.g > ev.g)
            # Near the solution the gain drops below the float resolution of g: there a
            # step is accepted when it reduces the relative KKT residual instead.
            flat = gain <= 64.0 * eps * jnp.abs(ev.g)
            ok = ok | (flat & (kkt(new, ev_new) < kkt(lam, ev)))
            return new, ev_new, ok

        def cond(c):
            return (~c[3]) & (c[4] < 30)

        def body(c):
            alpha = 0.5 * c[0]
            new, ev_new, ok = trial(alpha)
            return alpha, new, ev_new, ok, c[4] + 1

        new, ev_new, ok = trial(1.0)
        out = jax.lax.while_loop(cond, body, (1.0, new, ev_new, ok, 0))
        return out[1], out[2], out[3]

    def cond(c):
        return (~c[4]) & (c[3] < max_iter)

    def body(c):
        lam, ev, _, it, _, _ = c
        s, s_diag = direction(lam, ev)
        new, ev_new, ok = line_search(lam, ev, s)
        # Fallback when clipping spoilt the Newton step: diagonally scaled gradient.
        new, ev_new, ok = jax.lax.cond(
            ok, lambda: (new, ev_new, ok), lambda: line_search(lam, ev, s_diag)
        )
        lam = jnp.where(ok, new, lam)
        ev = jax.tree.map(lambda a, b: jnp.where(ok, a, b), ev_new, ev)
        _, delta = _delta(ev.th, ev.g, red, gram=gram)
        # A failed line search means float precision is exhausted: stop there.
        return lam, ev, delta, it + 1, (delta <= tol * red.scale) | ~ok, ok

    ev = evaluate(lam0)
    _, delta = _delta(ev.th, ev.g, red, gram=gram)
    init = (lam0, ev, delta, jnp.int32(0), delta <= tol * red.scale, jnp.array(True))
    lam, ev, _, it, _, _ = jax.lax.while_loop(cond, body, init)
    th, delta = _delta(ev.th, evaluate(lam, certify=True).g, red)
    return th, lam, delta, it, delta <= tol * red.scale


def _pcg(op, b, pre, dot, *, rtol, max_iter):
    """Preconditioned conjugate gradients for ``op(x) = b`` (``op`` SPD)."""
    x = jnp.zeros_like(b)
    z = b / pre
    stop = (rtol**2) * dot(b, b)

    def cond(c):
        _, r, _, _, k = c
        return (dot(r, r) > stop) & (k < max_iter)

    def body(c):
        x, r, p, rz, k = c
        ap = op(p)
        alpha = rz / jnp.maximum(dot(p, ap), jnp.finfo(b.dtype).tiny)
        x = x + alpha * p
        r = r - alpha * ap
        z = r / pre
        rz_new = dot(r, z)
        p = z + (rz_new / jnp.maximum(rz, jnp.finfo(b.dtype).tiny)) * p
        return x, r, p, rz_new, k + 1

    return jax.lax.while_loop(cond, body, (x, b, z, dot(b, z), 0))[0]


# ------------------------------------------------------------------------ driver


@functools.partial(jax.jit, static_argnames=("method",))
def _project_flat(x, radii_sq, state, tol, max_iter, *, method):
    """Core on flattened personalized coordinates. x: [n, p] -> ([n, p], info).

    ``tol`` and ``max_iter`` are traced scalars so that changing them never recompiles.
    """
    global _TRACE_COUNT
    _TRACE_COUNT += 1
    n, p = x.shape
    dtype = x.dtype
    # The Dykstra state is O(n^2 k): rotate onto the span when p > n. The dual solver
    # only ever multiplies [n, n] by [n, p], so it keeps the original coordinates.
    red = _reduce(x, radii_sq, rotate=method.startswith("dykstra"))
    if method.startswith("dykstra"):
        q0 = state.pair_dual.astype(dtype)
        if red.basis is not None:
            q0 = q0 @ red.basis
        th, lam, q, delta, it, done = _dykstra(
            red, q0, tol=tol, max_iter=max_iter, parallel=method == "dykstra_parallel"
        )
        pair_dual = q if red.basis is None else q @ red.basis.T
    else:
        th, lam, delta, it, done = _laplacian(
            red, state.lam.astype(dtype), tol=tol, max_iter=max_iter
        )
        pair_dual = jnp.zeros((0, p), dtype)
    # Add the (small) move to v itself, so that clients that do not move come back
    # bit for bit; merged clients take their component's mean plus the move.
    move = th - red.w
    move = move if red.basis is None else move @ red.basis.T
    alone = (red.count[red.labels] == 1)[:, None]
    out = jnp.where(alone, x, red.mu + red.wbar[red.labels]) + move[red.labels]
    r = jnp.sqrt(jnp.maximum(radii_sq.astype(dtype), 0.0))
    fin = jnp.isfinite(r) & ~jnp.eye(n, dtype=bool)
    viol = jnp.where(fin, jnp.sqrt(_sq_dists_exact(out)) - jnp.where(fin, r, 0.0), 0.0)
    viol = jnp.maximum(jnp.max(viol), 0.0)
    rmax = jnp.max(jnp.where(fin, r, 0.0))
    scale = red.scale
    info = ProjectionInfo(
        iterations=it.astype(jnp.int32),
        max_violation=viol,
        rel_violation=viol / jnp.where(rmax > 0, rmax, 1.0),
        delta=delta,
        rel_delta=delta / jnp.where(scale > 0, scale, 1.0),
        converged=done,
        state=ProjectionState(lam=lam, pair_dual=pair_dual),
    )
    return out, info


# ------------------------------------------------------------------- public API


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _split(v, personalized):
    leaves, treedef = jax.tree.flatten(v)
    if not leaves:
        raise ValueError("v: expected a pytree with at least one array leaf, got none")
    if personalized is None:
        mask = [True] * len(leaves)
    else:
        m_leaves, m_def = jax.tree.flatten(personalized)
        if m_def != treedef:
            raise ValueError(
                "personalized: expected a pytree of bools with the same structure as v "
                f"({treedef}), got {m_def}"
            )
        mask = []
        for m in m_leaves:
            if not isinstance(m, (bool, np.bool_)):
                raise TypeError(
                    f"personalized: expected Python bools as leaves, got {type(m).__name__}"
                )
            mask.append(bool(m))
    n = None
    for leaf in leaves:
        shape = jnp.shape(leaf)
        if len(shape) < 1:
            raise ValueError("v: every leaf needs a leading client axis, got a scalar leaf")
        if n is None:
            n = shape[0]
        elif shape[0] != n:
            raise ValueError(f"v: leaves disagree on the client axis: {n} and {shape[0]} clients")
    return leaves, treedef, mask, n


def _flat_dim(leaves, mask) -> int:
    return int(sum(int(np.prod(jnp.shape(x)[1:])) for x, m in zip(leaves, mask, strict=True) if m))


def _flat_dtype(leaves, mask):
    dts = [jnp.result_type(x) for x, m in zip(leaves, mask, strict=True) if m]
    dt = jnp.result_type(*dts) if dts else jnp.float32
    return dt if jnp.issubdtype(dt, jnp.floating) else jnp.result_type(float)


def _check_radii(radii_sq, n: int) -> None:
    shape = jnp.shape(radii_sq)
    if shape != (n, n):
        raise ValueError(f"radii_sq: expected shape ({n}, {n}) (clients of v), got {shape}")
    if not _is_concrete(radii_sq):
        return
    r = np.asarray(radii_sq, dtype=np.float64)
    if np.isnan(r).any():
        raise ValueError("radii_sq: contains NaN; expected values in [0, inf]")
    off = ~np.eye(n, dtype=bool)
    if (r[off] < 0).any():
        raise ValueError("radii_sq: contains negative entries; expected values in [0, inf]")
    fin = np.isfinite(r) & np.isfinite(r.T)
    mism = (np.isinf(r) != np.isinf(r.T)) & off
    rf = np.where(fin, r, 0.0)
    tol = 1e-6 * np.maximum(np.abs(rf), np.abs(rf.T))
    if mism.any() or (np.abs(rf - rf.T) > tol).any():
        raise ValueError("radii_sq: expected a symmetric matrix (radii_sq == radii_sq.T)")


def _check_options(method, tol, max_iter) -> None:
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    if not (isinstance(tol, (int, float)) and tol > 0):
        raise ValueError(f"tol: expected a positive float, got {tol!r}")
    if not (isinstance(max_iter, (int, np.integer)) and max_iter >= 1):
        raise ValueError(f"max_iter: expected a positive int, got {max_iter!r}")


def init_projection_state(v, radii_sq=None, *, personalized=None, method="dykstra"):
    """Zero dual state of the fixed shape that :func:`project` carries.

    Args:
      v: pytree of client-stacked leaves ``[n, ...]`` (only shapes are used).
      radii_sq: unused except for a shape check (may be None).
      personalized: optional pytree of bools like ``v``.
      method: ``"dykstra"`` or ``"laplacian"``.

    Returns:
      :class:`ProjectionState` with ``lam`` ``[n, n]`` and ``pair_dual``
      ``[n(n-1)/2, p]`` (dykstra) or ``[0, p]`` (laplacian), ``p`` the flattened size
      of the personalized leaves.
    """
    _check_options(method, 1.0, 1)
    leaves, _, mask, n = _split(v, personalized)
    if radii_sq is not None and jnp.shape(radii_sq) != (n, n):
        raise ValueError(f"radii_sq: expected shape ({n}, {n}), got {jnp.shape(radii_sq)}")
    p = _flat_dim(leaves, mask)
    dtype = _flat_dtype(leaves, mask)
    m = n * (n - 1) // 2 if method.startswith("dykstra") else 0
    return ProjectionState(lam=jnp.zeros((n, n), dtype), pair_dual=jnp.zeros((m, p), dtype))


def project(
    v,
    radii_sq,
    *,
    personalized=None,
    method: str = "dykstra",
    tol: float = 1e-6,
    max_iter: int = 500,
    warm_start: ProjectionState | None = None,
):
    r"""Certified projection of client models onto the pairwise-distance set.

    Solves ``min_theta 1/2 sum_i ||theta_i - v_i||^2`` subject to
    ``||theta_i - theta_j||^2 <= radii_sq[i, j]`` for all ``i < j`` (norm over all
    personalized leaves jointly), with shared leaves set to their mean over clients.
    The result is always feasible (up to float rounding of the final sums), and
    ``info.delta`` certifies how far its objective is from the optimum.

    Works under ``jit``, ``vmap`` and ``lax.scan`` with traced ``v``, ``radii_sq`` and
    ``warm_start``; ``method``, ``tol`` and ``max_iter`` are static. Value checks on
    ``radii_sq`` run only when it is concrete.

    Args:
      v: pytree of arrays with a leading client axis ``[n, ...]``.
      radii_sq: array ``[n, n]``, squared radii ``t * D``: symmetric, ``>= 0``, ``inf``
        for no constraint; the diagonal is ignored. Zero radii merge clients exactly.
      personalized: optional pytree of Python bools with the structure of ``v``
        (True: constrained leaf; False: shared leaf, set to the mean). None: all True.
      method: ``"dykstra"`` (parallel Dykstra over all pairs; state ``O(n^2 p)``) or
        ``"laplacian"`` (dual ascent on the ``n x n`` multipliers; for many clients).
      tol: stop when ``delta <= tol * S``, ``S = 1/2 sum_i ||v_i - mean(v)||^2`` over
        the personalized leaves (the objective of collapsing to the mean).
      max_iter: iteration cap (the loop checks the certificate every 10 iterations).
      warm_start: a previous :class:`ProjectionState` of the same method and shapes
        (e.g. ``info.state`` of the last call), or None for a cold start.

    Returns:
      ``(theta, info)``: ``theta`` has the structure and shapes of ``v``; ``info`` is a
      :class:`ProjectionInfo`.

    Raises:
      ValueError: bad shapes, negative/NaN/asymmetric radii, mask structure mismatch,
        unknown method, bad ``tol``/``max_iter`` or a ``warm_start`` of the wrong shape.
    """
    _check_options(method, tol, max_iter)
    leaves, treedef, mask, n = _split(v, personalized)
    _check_radii(radii_sq, n)
    pers = [x for x, m in zip(leaves, mask, strict=True) if m]
    out = [None] * len(leaves)
    for idx, (x, m) in enumerate(zip(leaves, mask, strict=True)):
        if not m:
            x = jnp.asarray(x)
            out[idx] = jnp.broadcast_to(_client_mean(x)[None], x.shape).astype(x.dtype)
    dtype = _flat_dtype(leaves, mask)
    p = _flat_dim(leaves, mask)
    zero_state = init_projection_state(v, personalized=personalized, method=method)
    if warm_start is None:
        state = zero_state
    else:
        want = jax.tree.map(jnp.shape, zero_state)
        got = jax.tree.map(jnp.shape, warm_start)
        if not isinstance(warm_start, ProjectionState) or want != got:
            raise ValueError(
                f"warm_start: expected a ProjectionState with shapes {want} "
                f"(method={method!r}), got {got}"
            )
        state = warm_start
    if not pers or p == 0 or n == 1:
        for idx, (x, m) in enumerate(zip(leaves, mask, strict=True)):
            if m:
                out[idx] = jnp.asarray(x)
        zero = jnp.zeros((), dtype)
        info = ProjectionInfo(
            iterations=jnp.int32(0),
            max_violation=zero,
            rel_violation=zero,
            delta=zero,
            rel_delta=zero,
            converged=jnp.array(True),
            state=state,
        )
        return jax.tree.unflatten(treedef, out), info
    flat = jnp.concatenate([jnp.reshape(x, (n, -1)).astype(dtype) for x in pers], axis=1)
    theta, info = _project_flat(
        flat,
        jnp.asarray(radii_sq),
        state,
        jnp.asarray(tol, dtype),
        jnp.asarray(max_iter, jnp.int32),
        method=method,
    )
    start = 0
    for idx, (x, m) in enumerate(zip(leaves, mask, strict=True)):
        if m:
            shape = jnp.shape(x)
            size = int(np.prod(shape[1:]))
            out[idx] = theta[:, start : start + size].reshape(shape).astype(jnp.result_type(x))
            start += size
    return jax.tree.unflatten(treedef, out), info
