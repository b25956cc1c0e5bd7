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

Precision: in float32 the certificate itself is only accurate to a few ``1e-7 * S``;
``tol`` far below ``1e-6`` needs float64 (``with jax.enable_x64(True):`` and float64
inputs).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import cho_factor, cho_solve

__all__ = [
    "ProjectionInfo",
    "ProjectionState",
    "init_projection_state",
    "pair_kernel",
    "project",
]

METHODS = ("dykstra", "laplacian")
_CHECK_EVERY = 10  # solver iterations between two certificates
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


def _reduce(x, radii_sq):
    n, p = x.shape
    dtype = x.dtype
    eye = jnp.eye(n, dtype=bool)
    r = jnp.sqrt(jnp.maximum(radii_sq.astype(dtype), 0.0))
    r = jnp.where(eye, jnp.inf, r)
    labels = _components(r == 0)
    count = jax.ops.segment_sum(jnp.ones((n,), dtype), labels, n)
    live = count > 0
    mass = jnp.where(live, count, 1.0)
    mu = jnp.mean(x, axis=0)
    xc = x - mu
    wbar = jax.ops.segment_sum(xc, labels, n) / mass[:, None]
    rmin = jax.ops.segment_min(r, labels, n)  # [slot, client]
    rmin = jax.ops.segment_min(rmin.T, labels, n).T  # [slot, slot]
    radius = jnp.where(live[:, None] & live[None, :] & ~eye, rmin, jnp.inf)
    if p > n:
        basis, _ = jnp.linalg.qr(wbar.T)  # [p, n]
        w = wbar @ basis
    else:
        basis, w = None, wbar
    scale = 0.5 * jnp.sum(xc * xc)
    return _Reduced(labels, mass, w, radius, mu, basis, scale)


def _restore(th, radius):
    """Shrink toward the (weighted) mean, here 0, until every constraint holds."""
    eps = jnp.finfo(th.dtype).eps
    d = jnp.sqrt(_sq_dists_exact(th))
    ok = jnp.isfinite(radius) & (d > 0)
    ratio = jnp.where(ok, radius * (1.0 - 4.0 * eps) / jnp.where(ok, d, 1.0), jnp.inf)
    beta = jnp.minimum(1.0, jnp.min(ratio))
    return th * beta


def _primal(th, red):
    return 0.5 * jnp.sum(red.mass[:, None] * (th - red.w) ** 2)


def _dual_parts(lam, red, *, gram):
    """theta(lam), certified g(lam) and the inverse of M + L_lam."""
    n = lam.shape[0]
    a = jnp.diag(red.mass + jnp.sum(lam, axis=1)) - lam
    fac = cho_factor(a, lower=True)
    a_inv = cho_solve(fac, jnp.eye(n, dtype=lam.dtype))
    rhs = red.mass[:, None] * red.w
    th = a_inv @ rhs
    d2 = _sq_dists_gram(th) if gram else _sq_dists_exact(th)
    fin = jnp.isfinite(red.radius)
    slack = jnp.where(fin, d2 - jnp.where(fin, red.radius, 0.0) ** 2, 0.0)
    lag = _primal(th, red) + 0.25 * jnp.sum(lam * slack)
    # theta is only an approximate minimizer of the Lagrangian; since M + L >= I the
    # Lagrangian exceeds its minimum by at most 1/2 ||residual||^2.
    res = rhs - a @ th
    g = lag - 0.5 * jnp.sum(res * res)
    return th, g, a_inv, d2


def _certify(th, lam, red):
    """(restored theta, delta) for a primal iterate and a dual iterate."""
    th = _restore(th, red.radius)
    _, g, _, _ = _dual_parts(lam, red, gram=False)
    return th, jnp.maximum(_primal(th, red) - g, 0.0)


def _dual_mask(red):
    n = red.radius.shape[0]
    return jnp.isfinite(red.radius) & ~jnp.eye(n, dtype=bool)


# ------------------------------------------------------------------------ solvers


def _dykstra(red, q0, *, tol, max_iter):
    """Parallel Dykstra on the merged problem; q0: [m, k] pair increments."""
    n = red.w.shape[0]
    pi, pj = np.triu_indices(n, 1)
    rp = red.radius[pi, pj]
    mi, mj = red.mass[pi], red.mass[pj]
    msum = (mi + mj)[:, None]
    q0 = jnp.where(jnp.isfinite(rp)[:, None], q0, 0.0)

    def theta_of(q):
        # Primal-dual relation of Dykstra: theta_i = w_i - 1/(n-1) sum_j m_j Q_ij with
        # Q antisymmetric; averaging the n-1 pair copies uniformly keeps the metric.
        acc = jax.ops.segment_sum(mj[:, None] * q, pi, n)
        acc = acc - jax.ops.segment_sum(mi[:, None] * q, pj, n)
        return red.w - acc / (n - 1)

    def step(_, q):
        th = theta_of(q)
        d = th[pi] - th[pj] + msum * q
        norm = jnp.sqrt(jnp.sum(d * d, axis=-1))
        shrink = jnp.where(norm > rp, 1.0 - rp / jnp.where(norm > 0, norm, 1.0), 0.0)
        return shrink[:, None] * d / msum

    def lam_of(q, th):
        d = th[pi] - th[pj]
        d2 = jnp.sum(d * d, axis=-1)
        val = mi * mj / (n - 1) * jnp.sum(q * d, axis=-1) / jnp.where(d2 > 0, d2, 1.0)
        val = jnp.where(jnp.isfinite(rp) & (d2 > 0), jnp.maximum(val, 0.0), 0.0)
        lam = jnp.zeros((n, n), red.w.dtype).at[pi, pj].set(val)
        return lam + lam.T

    def check(q):
        th = theta_of(q)
        lam = lam_of(q, th)
        th, delta = _certify(th, lam, red)
        return th, lam, delta

    def cond(c):
        _, _, _, _, it, done = c
        return (~done) & (it < max_iter)

    def body(c):
        q, _, _, _, it, _ = c
        k = jnp.minimum(_CHECK_EVERY, max_iter - it)
        q = jax.lax.fori_loop(0, k, step, q)
        th, lam, delta = check(q)
        return q, th, lam, delta, it + k, delta <= tol * red.scale

    th, lam, delta = check(q0)
    init = (q0, th, lam, delta, jnp.int32(0), delta <= tol * red.scale)
    q, th, lam, delta, it, done = jax.lax.while_loop(cond, body, init)
    return th, lam, q, delta, it, done


def _laplacian(red, lam0, *, tol, max_iter):
    """Projected dual ascent on the n x n multipliers.

    The search direction of pair ``(c, d)`` is the exact maximizer of the dual along
    that coordinate alone, ``(||theta_c - theta_d|| / R_cd - 1) / e_cd`` with ``e_cd``
    the effective resistance ``b^T (M + L)^{-1} b``; the step length along the
    projected path ``max(0, lam + a * dir)`` is chosen by Armijo backtracking, so the
    dual value increases monotonically.
    """
    n = red.w.shape[0]
    gram = n > _GRAM_ABOVE
    mask = _dual_mask(red)
    rad = jnp.where(mask, red.radius, 1.0)
    lam0 = jnp.where(mask, jnp.maximum(lam0, 0.0), 0.0)
    lam0 = 0.5 * (lam0 + lam0.T)
    evaluate = functools.partial(_dual_parts, red=red, gram=gram)

    def direction(lam, a_inv, d2):
        dg = jnp.diag(a_inv)
        res = dg[:, None] + dg[None, :] - 2.0 * a_inv
        res = jnp.where(mask, jnp.maximum(res, 1e-30), 1.0)
        dirn = (jnp.sqrt(d2) / rad - 1.0) / res
        grad = 0.5 * (d2 - rad**2)
        dirn = jnp.where(mask & ~((lam <= 0) & (dirn < 0)), dirn, 0.0)
        return dirn, jnp.where(mask, grad, 0.0)

    def line_search(lam, g, grad, dirn, a0):
        def trial(a):
            new = jnp.maximum(lam + a * dirn, 0.0)
            th, g_new, a_inv, d2 = evaluate(new)
            gain = 0.5 * jnp.sum(grad * (new - lam))
            ok = g_new >= g + 1e-4 * gain
            return new, th, g_new, a_inv, d2, ok

        def cond(c):
            a, k, out = c
            return (~out[-1]) & (k < 30)

        def body(c):
            a, k, _ = c
            a = 0.5 * a
            return a, k + 1, trial(a)

        a, _, out = jax.lax.while_loop(cond, body, (a0, 0, trial(a0)))
        return a, out

    def cond(c):
        return (~c["done"]) & (c["it"] < max_iter)

    def body(c):
        def one(_, s):
            dirn, grad = direction(s["lam"], s["a_inv"], s["d2"])
            a, (lam, th, g, a_inv, d2, ok) = line_search(s["lam"], s["g"], grad, dirn, s["a"])
            keep = lambda new, old: jnp.where(ok, new, old)
            return dict(
                lam=keep(lam, s["lam"]),
                th=keep(th, s["th"]),
                g=keep(g, s["g"]),
                a_inv=keep(a_inv, s["a_inv"]),
                d2=keep(d2, s["d2"]),
                a=jnp.minimum(2.0 * a, 1.0),
            )

        k = jnp.minimum(_CHECK_EVERY, max_iter - c["it"])
        s = jax.lax.fori_loop(0, k, one, c["s"])
        th, delta = _certify(s["th"], s["lam"], red)
        return dict(s=s, th_out=th, delta=delta, it=c["it"] + k, done=delta <= tol * red.scale)

    th, g, a_inv, d2 = evaluate(lam0)
    s = dict(lam=lam0, th=th, g=g, a_inv=a_inv, d2=d2, a=jnp.asarray(1.0, lam0.dtype))
    th_out, delta = _certify(th, lam0, red)
    init = dict(s=s, th_out=th_out, delta=delta, it=jnp.int32(0), done=delta <= tol * red.scale)
    c = jax.lax.while_loop(cond, body, init)
    return c["th_out"], c["s"]["lam"], c["delta"], c["it"], c["done"]


# ------------------------------------------------------------------------ driver


@functools.partial(jax.jit, static_argnames=("method", "tol", "max_iter"))
def _project_flat(x, radii_sq, state, *, method, tol, max_iter):
    """Core on flattened personalized coordinates. x: [n, p] -> ([n, p], info)."""
    global _TRACE_COUNT
    _TRACE_COUNT += 1
    n, p = x.shape
    dtype = x.dtype
    red = _reduce(x, radii_sq)
    # Radii of the slots back to the original clients' lam indices is not needed: the
    # dual state lives on slots, which coincide with clients when no radius is zero.
    if method == "dykstra":
        q0 = state.pair_dual.astype(dtype)
        if red.basis is not None:
            q0 = q0 @ red.basis
        th, lam, q, delta, it, done = _dykstra(red, q0, tol=tol, max_iter=max_iter)
        pair_dual = q if red.basis is None else q @ red.basis.T
    else:
        th, lam, delta, it, done = _laplacian(
            red, state.lam.astype(dtype), tol=tol, max_iter=max_iter
        )
        pair_dual = jnp.zeros((0, p), dtype)
    slots = th if red.basis is None else th @ red.basis.T
    out = (slots + red.mu)[red.labels]
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
    m = n * (n - 1) // 2 if method == "dykstra" else 0
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
            out[idx] = jnp.broadcast_to(jnp.mean(x, axis=0, keepdims=True), x.shape).astype(x.dtype)
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
        flat, jnp.asarray(radii_sq), state, method=method, tol=float(tol), max_iter=int(max_iter)
    )
    start = 0
    for idx, (x, m) in enumerate(zip(leaves, mask, strict=True)):
        if m:
            shape = jnp.shape(x)
            size = int(np.prod(shape[1:]))
            out[idx] = theta[:, start : start + size].reshape(shape).astype(jnp.result_type(x))
            start += size
    return jax.tree.unflatten(treedef, out), info
