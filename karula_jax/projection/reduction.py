"""The projection problem reduced to its core: merged zero-radius components, centred
and rotated coordinates, pairwise distances, and the shrink that restores feasibility."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from karula_jax import _linalg


def client_mean(x):
    """Mean over the leading client axis as one matrix-vector product.

    XLA:CPU runs ``jnp.mean(x, axis=0)`` on a wide leaf (e.g. a shared ``[30, 784, 100]``
    layer) as a strided reduction, slower than the same sum as a BLAS matvec
    (``docs/implementation_notes.md``).
    """
    n = x.shape[0]
    flat = jnp.reshape(x, (n, -1))
    return jnp.reshape(jnp.full((n,), 1.0 / n, flat.dtype) @ flat, x.shape[1:])


def sq_dists_exact(th):
    """Squared distances between rows from explicit differences. [n, r] -> [n, n]."""
    row = lambda t: jnp.sum((th - t) ** 2, axis=-1)
    n = th.shape[0]
    if n * n * th.shape[1] <= (1 << 24):
        return jax.vmap(row)(th)
    return jax.lax.map(row, th, batch_size=max(1, (1 << 24) // (n * th.shape[1])))


def sq_dists_gram(th):
    """Squared distances between rows through the Gram matrix (fast, less exact)."""
    sq = jnp.sum(th * th, axis=-1)
    return jnp.maximum(sq[:, None] + sq[None, :] - 2.0 * (th @ th.T), 0.0)


def sq_dists_of_gram(gm):
    """Squared distances between rows from their Gram matrix ``gm`` [n, n] (as
    :func:`sq_dists_gram`, the norms from its diagonal), without a product."""
    sq = jnp.diag(gm)
    return jnp.maximum(sq[:, None] + sq[None, :] - 2.0 * gm, 0.0)


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


class Reduced(NamedTuple):
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
    """Orthonormal columns whose span holds the rows of ``a`` [n, p] (p >= n). [p, n].

    Householder QR of ``a^T``: ``Q`` is orthonormal even when ``a`` is rank deficient (then
    some columns are directions no row uses, on which every row has coordinate 0), so
    ``a @ Q`` keeps every distance. (One LAPACK call instead of Gram-Schmidt's ``n``
    sequential steps: ``docs/implementation_notes.md``.)
    """
    return _linalg.qr_q(a.T)


def reduce_problem(x, radii_sq, *, rotate):
    n, p = x.shape
    dtype = x.dtype
    eye = jnp.eye(n, dtype=bool)
    r = jnp.sqrt(jnp.maximum(radii_sq.astype(dtype), 0.0))
    # the smaller of r_ij and r_ji (equal up to the input check's 1e-6 when concrete;
    # traced, only NaN, negative and inf-facing-finite radii are flagged, by
    # api._radii_ok): symmetric to the bit, as the components and the dual solver's pair
    # arrays must be
    r = jnp.where(eye, jnp.inf, jnp.minimum(r, r.T))
    labels = _components(r == 0)
    count = jax.ops.segment_sum(jnp.ones((n,), dtype), labels, n)
    live = count > 0
    mass = jnp.where(live, count, 1.0)
    mu = client_mean(x)
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
    return Reduced(labels, mass, w, radius, mu, basis, scale, count, wbar)


def pull_violated(th, radius, mass, sweeps):
    """Moves the two ends of every violated pair toward each other, ``sweeps`` times.

    One sweep: each violated pair ``(i, j)`` asks for the shortest move that brings it to
    its radius, split in proportion to the other end's mass (the pair's centre of mass
    stays); each row takes the average of its requests, times 1.5 (over-relaxed
    component averaging). A heuristic repair, not a projection: after a dual solver's
    iterate ``theta(lam)``, whose violations are small and spread over the active pairs,
    a few sweeps leave a point whose shrink (:func:`restore`) costs far less than the
    shrink of ``theta(lam)`` itself, which pays for the worst pair on every pair.
    ``th`` [n, k], ``radius`` [n, n] (inf where unconstrained), ``mass`` [n] (> 0),
    ``sweeps`` a (traced) count; distances from the Gram matrix.
    """
    share = mass[None, :] / (mass[:, None] + mass[None, :])  # of pair (i, j), i's part

    def sweep(_, th):
        d = jnp.sqrt(sq_dists_gram(th))
        violated = d > radius  # false on the diagonal and where unconstrained
        pull = jnp.where(violated, (d - radius) / jnp.where(violated, d, 1.0), 0.0) * share
        count = jnp.maximum(jnp.sum(violated, axis=1), 1).astype(th.dtype)[:, None]
        return th - 1.5 * (jnp.sum(pull, axis=1)[:, None] * th - pull @ th) / count

    return jax.lax.fori_loop(0, sweeps, sweep, th)


def restore(th, radius, *, gram=False, sq_dists=None):
    """Shrink toward the (weighted) mean, here 0, until every constraint holds.

    ``sq_dists``: the squared distances of ``th``'s rows where the caller has them
    (:func:`sq_dists_of_gram` of a Gram matrix it formed); else measured here, through
    the Gram matrix with ``gram``, by explicit differences without.

    The margin (4 eps of each radius) covers the rounding of the distances and of the
    ratio, not all of the product's: ``th * beta`` rounds each coordinate by up to ``eps``
    of its size, which can exceed the margin where rows are much longer than a radius
    (float32 rows near 100 and a small radius in a review's test: violations up to about
    2% of that radius after one shrink, fewer and smaller after a second). The caller's final ``v +
    move`` in the original coordinates adds up to ``eps`` times a row's norm likewise. The
    projection reports what is left in ``max_violation`` rather than buys it back with a
    shrink (that would cost float32 its certificate at the default tolerance).
    """
    eps = jnp.finfo(th.dtype).eps
    if sq_dists is None:
        sq_dists = sq_dists_gram(th) if gram else sq_dists_exact(th)
    d = jnp.sqrt(sq_dists)
    ok = jnp.isfinite(radius) & (d > 0)
    ratio = jnp.where(ok, radius * (1.0 - 4.0 * eps) / jnp.where(ok, d, 1.0), jnp.inf)
    beta = jnp.minimum(1.0, jnp.min(ratio))
    return th * beta
