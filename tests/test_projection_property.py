"""Every solver against cvxpy on generated instances: n from 2 to 40, odd and even.

The first cyclic solver silently stalled on 29 of 108 random instances, all with odd n
(the bye of the round-robin schedule collided with a real pair): fixed shapes in the
other test file never showed it. Here hypothesis draws the sizes (p below and above n),
the radii (zeros, infinities, 1e-6 to 1e6 times the models' spread) and the models, and every
solver must return the cvxpy solution, exactly feasible and certified.

Each drawn shape compiles the solvers anew (about 2 s each on a 2-core CPU), so the
example counts are small; the schedule itself is checked exhaustively for every n.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _projection_reference import cvxpy_projection
from _tolerances import EPS64, certified_distance, reordered_sum
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from karula_jax import projection as proj
from karula_jax.projection.dykstra import _round_robin

SOLVERS = (
    "dykstra",
    "laplacian",
    "laplacian_direct",
    "fista",
)  # "auto" is one of these (test_projection.py)
KINDS = ("cauchy", "groups", "zeros", "extreme")


def instance(n: int, p: int, seed: int, kind: str, *, orders: float = 6.0, offset=None):
    """Models ``v`` [n, p] and squared radii [n, n] with many active constraints.

    ``cauchy`` is the family of the bug report: a random rank-one spread plus noise and
    heavy-tailed dissimilarities, t at 0.3 of the median ratio. ``zeros`` adds exact
    ties (zero radii, merged clients) and unconstrained pairs; ``extreme`` scales all
    squared radii by ``10**-orders`` to ``10**orders`` against the models' spread (from
    nearly one model to nearly none active), spreads them over two more orders, and moves
    the models far from the origin (by 100, or by ``offset`` times their spread).
    """
    rng = np.random.default_rng(seed)
    if kind == "groups":
        centres = 2.0 * rng.normal(size=(3, p))
        g = rng.integers(0, 3, n)
        v = centres[g] + rng.normal(size=(n, p))
        D = np.linalg.norm(centres[g][:, None] - centres[g][None], axis=-1) + 0.5
        D = 0.5 * D
    else:
        v = rng.normal(size=(n, p)) + 3 * rng.normal(size=(n, 1)) * rng.normal(size=(1, p))
        D = np.minimum(np.abs(rng.standard_cauchy((n, n))), 50.0)
    if kind == "extreme":
        D = D * 10.0 ** rng.uniform(-1.0, 1.0, size=(n, n))
        spread = 10.0 ** rng.uniform(-3, 3)
        shift = 100.0 if offset is None else offset * spread
        v = spread * v + shift * rng.normal(size=(1, p))
    D = np.triu(D, 1)
    D = D + D.T
    iu = np.triu_indices(n, 1)
    d2 = ((v[:, None] - v[None]) ** 2).sum(-1)
    ratio = np.median(d2[iu]) / max(np.median(D[iu]), 1e-300)
    factor = 10.0 ** rng.uniform(-orders, orders) if kind == "extreme" else 0.3
    radii_sq = factor * ratio * D
    if kind == "zeros" and n > 2:
        pick = rng.random((n, n)) < 2.0 / n
        pick = np.triu(pick, 1)
        radii_sq[pick | pick.T] = 0.0
        inf = np.triu(rng.random((n, n)) < 0.1, 1)
        radii_sq[inf | inf.T] = np.inf
    np.fill_diagonal(radii_sq, 0.0)
    return v, radii_sq


def pair_violation(th, radii_sq, *, eps=0.0) -> float:
    """max_ij (||th_i - th_j|| - r_ij)_+ over constrained pairs, relative to max finite r,
    less ``2 eps`` times the largest row norm (the rounding of the output's own dtype)."""
    th = np.asarray(th, np.float64)
    d = np.linalg.norm(th[:, None] - th[None], axis=-1)
    fin = np.isfinite(radii_sq) & ~np.eye(len(th), dtype=bool)
    r = np.sqrt(np.where(fin, radii_sq, 0.0))
    viol = np.where(fin, d - r, 0.0).max(initial=0.0) - 2 * eps * np.abs(th).sum(1).max()
    return max(viol, 0.0) / max(r.max(initial=0.0), 1e-300)


def _tolerances(v, th, dtype):
    """What rounding leaves of a solve of ``v`` in ``dtype`` (eps its machine epsilon), as
    ``(gap rounding, distance rounding, violation allowance)``:

    * the certified gap ``delta = F(theta) - g(lam)`` is float sums of ``n^2 + 2 n p``
      terms of total size about ``S`` (one evaluation: ``m eps / 2``), and ``v`` and
      ``theta`` rounded to the dtype move ``F`` and ``F*`` by ``sqrt(2 S) eps / 2`` times
      their norms;
    * the output is ``eps`` of each coordinate from the certified point, and ``v``'s
      rounding moves the projection by as much (it is 1-Lipschitz);
    * its violation beyond :func:`pair_violation`'s ``2 eps`` of a row: restore's distances
      (``k <= p`` terms) and the rotation back (``p`` terms), ``reordered_sum(2 p + 4)`` of
      the largest row norm, relative to the largest radius.
    """
    eps = float(jnp.finfo(dtype).eps)
    n, p = v.shape
    s = 0.5 * float(np.sum((v - v.mean(0)) ** 2))
    norms = np.linalg.norm(v) + np.linalg.norm(th)
    gap = 0.5 * reordered_sum(n * (n + 2 * p), eps=eps) * s + np.sqrt(2 * s) * eps * norms
    return gap, eps * norms, reordered_sum(2 * p + 4, eps=eps) * np.linalg.norm(th, axis=1).max()


def check_against_cvxpy(v, radii_sq, *, dtype, tol, max_iter):
    ref = cvxpy_projection(v, radii_sq, tol=1e-11)
    scale = np.linalg.norm(v - v.mean(0))  # sqrt(2 S): the size of any move
    if scale == 0:
        return
    fin = np.isfinite(radii_sq) & ~np.eye(len(v), dtype=bool)
    rmax = max(np.sqrt(np.where(fin, radii_sq, 0.0)).max(initial=0.0), 1e-300)
    for method in SOLVERS:
        th, info = proj.project(
            jnp.asarray(v, dtype),
            jnp.asarray(radii_sq, dtype),
            method=method,
            tol=tol,
            max_iter=max_iter,
        )
        th = np.asarray(th, np.float64)
        assert th.dtype == np.float64 and th.shape == v.shape
        err = np.linalg.norm(th - ref.theta) / scale
        assert bool(info.converged), (method, int(info.iterations), float(info.rel_delta))
        # both certified: the output within sqrt(2 delta) (with its rounding) of the
        # projection, cvxpy's point within ref.radius
        gap, rounding, viol = _tolerances(v, th, dtype)
        err_tol = (certified_distance(float(info.delta) + gap) + rounding + ref.radius) / scale
        assert err <= err_tol, (method, err, err_tol)
        # feasible up to the rounding of the output's dtype, which info reports (measured
        # from float distances of p terms)
        eps = float(jnp.finfo(dtype).eps)
        assert pair_violation(th, radii_sq, eps=eps) <= viol / rmax, method
        measured = reordered_sum(v.shape[1] + 2, eps=eps) + reordered_sum(v.shape[1] + 2, eps=EPS64)
        assert float(info.rel_violation) >= pair_violation(th, radii_sq) - measured, method
        # The certificate, on a run of the same program truncated after a few iterations
        # (max_iter is traced: no new compile), where the suboptimality is not ~0: its gap
        # bounds the true suboptimality. (How tight it is depends on the instance: one
        # Laplacian step from a cold start was 14x loose on a drawn n = 27; the fixed
        # instance of test_projection.py's test_certificate_of_truncated_runs checks that.)
        # This replaces 0.5 (err scale)^2 <= delta + (err_tol scale)^2, which held
        # whenever err <= err_tol did.
        th, info = proj.project(
            jnp.asarray(v, dtype),
            jnp.asarray(radii_sq, dtype),
            method=method,
            tol=tol,
            max_iter=10 if method == "dykstra" else 1,
        )
        th = np.asarray(th, np.float64)
        subopt = 0.5 * np.sum((th - v) ** 2) - ref.value
        delta = float(info.delta)
        # up to cvxpy's value's error and the gap's rounding
        slack = ref.value_error + _tolerances(v, th, dtype)[0]
        assert delta >= subopt - slack, (method, delta, subopt, slack)


sizes = st.tuples(
    st.integers(2, 40),
    st.sampled_from(("below", "above")),
    st.integers(0, 2**31 - 1),
    st.sampled_from(KINDS),
)


def _shape(n, where, seed):
    rng = np.random.default_rng(seed)
    return n, int(rng.integers(1, n + 1)) if where == "below" else int(rng.integers(n + 1, 61))


# derandomize: CI sees the same draws every run; set KARULA_EXPLORE=1 to search anew.
EXPLORE = os.environ.get("KARULA_EXPLORE") == "1"
SETTINGS = dict(
    deadline=None, derandomize=not EXPLORE, suppress_health_check=[HealthCheck.too_slow]
)


@settings(max_examples=30 if EXPLORE else 3, **SETTINGS)
@given(sizes)
def test_every_solver_matches_cvxpy_float64(draw):
    n, where, seed, kind = draw
    n, p = _shape(n, where, seed)
    v, radii_sq = instance(n, p, seed, kind)
    with jax.enable_x64(True):
        check_against_cvxpy(
            v,
            radii_sq,
            dtype=jnp.float64,
            tol=1e-10,  # certifies ||theta - theta*|| <= 1e-5 sqrt(2 S)
            max_iter=300_000,
        )


@settings(max_examples=15 if EXPLORE else 2, **SETTINGS)
@given(sizes)
def test_every_solver_matches_cvxpy_float32(draw):
    n, where, seed, kind = draw
    n, p = _shape(n, where, seed)
    # float32 resolves a model to ~1e-7 of its norm: far from the origin, or with radii far
    # below the spread, the models' rounding swamps the radii (float64 covers those).
    v, radii_sq = instance(n, p, seed, kind, orders=3.0, offset=1.0)
    check_against_cvxpy(
        v,
        radii_sq,
        dtype=jnp.float32,
        tol=1e-5,  # the certificate's own float32 rounding is of this order at n = 40
        max_iter=100_000,
    )


@pytest.mark.parametrize("n, p", [(5, 3), (7, 20), (9, 4), (11, 3)])
def test_reported_odd_n_instances(n, p):
    """Shapes of the bug report, several seeds each (one compile per shape)."""
    with jax.enable_x64(True):
        for seed in range(3):
            v, radii_sq = instance(n, p, seed, "cauchy")
            check_against_cvxpy(
                v,
                radii_sq,
                dtype=jnp.float64,
                tol=1e-10,
                max_iter=300_000,
            )


@pytest.mark.parametrize("n", range(1, 42))
def test_round_robin_covers_every_pair_once(n):
    """Each pair i < j appears exactly once per sweep; within a matching no client and no
    in-range pair index repeats (the bye's index is out of range and is dropped)."""
    a, b, idx, ok = _round_robin(n)
    num_pairs = n * (n - 1) // 2
    seen = np.zeros(num_pairs, int)
    pi, pj = np.triu_indices(n, 1)
    for k in range(a.shape[0]):
        real = ok[k]
        clients = np.concatenate([a[k][real], b[k][real]])
        assert len(set(clients.tolist())) == clients.size
        assert np.all(idx[k][~real] >= num_pairs)
        np.testing.assert_array_equal(pi[idx[k][real]], a[k][real])
        np.testing.assert_array_equal(pj[idx[k][real]], b[k][real])
        np.add.at(seen, idx[k][real], 1)
    np.testing.assert_array_equal(seen, 1)
