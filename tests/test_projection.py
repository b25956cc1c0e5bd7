"""Tests of karula_jax.projection against cvxpy (Clarabel) and closed forms.

Accuracy claims are checked in float64 (``jax.enable_x64``), where the certificate is
exact to ~1e-13 of the problem scale; float32 tests check the default path with
tolerances that float32 can honestly reach.
"""

import collections
import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _projection_reference import cvxpy_projection
from _tolerances import EPS32, EPS64, certified_distance, reordered_sum

from karula_jax import _platform
from karula_jax import projection as proj
from karula_jax.projection import api as proj_api

SOLVERS = ("dykstra", "laplacian", "laplacian_direct", "fista")
DEFAULT_TOL = inspect.signature(proj.project).parameters["tol"].default


def _instance(seed, n, p, kind="groups"):
    """Random models and squared radii with many active constraints."""
    rng = np.random.default_rng(seed)
    centres = 2.0 * rng.normal(size=(3, p))
    groups = rng.integers(0, 3, n)
    v = centres[groups] + rng.normal(size=(n, p))
    dist = np.linalg.norm(centres[groups][:, None] - centres[groups][None], axis=-1) + 0.5
    radii_sq = 0.5 * dist
    if kind == "uneven":  # radii spread over four orders of magnitude
        u = 10.0 ** rng.uniform(-3, 1, size=(n, n))
        radii_sq = np.minimum(u, u.T)
    elif kind == "zeros":  # two zero-radius chains plus some unconstrained pairs
        radii_sq[0, 1] = radii_sq[1, 0] = 0.0
        radii_sq[1, 2] = radii_sq[2, 1] = 0.0
        radii_sq[3, 4] = radii_sq[4, 3] = 0.0
        radii_sq[5, 6] = radii_sq[6, 5] = np.inf
    np.fill_diagonal(radii_sq, 0.0)
    return v, radii_sq


def _objective(th, v):
    return 0.5 * float(np.sum((np.asarray(th, np.float64) - v) ** 2))


def _max_violation(th, radii_sq):
    th = np.asarray(th, np.float64)
    d = np.linalg.norm(th[:, None] - th[None], axis=-1)
    with np.errstate(invalid="ignore"):
        viol = np.where(np.isfinite(radii_sq), d - np.sqrt(radii_sq), 0.0)
    np.fill_diagonal(viol, 0.0)
    return max(float(viol.max()), 0.0)


# Tolerances. The output is within certified_distance(delta) of the exact projection (the
# objective 1/2 ||theta - v||^2 is 1-strongly convex), cvxpy's point within ref.radius
# (certified by _projection_reference); float rounding enters as below, in the solver's
# dtype (eps its machine epsilon).


def _eps(x) -> float:
    return float(jnp.finfo(jnp.asarray(x).dtype).eps)


def _gap_rounding(n, p, scale, eps) -> float:
    """Rounding of a certified gap ``delta = F(theta) - g(lam)`` against its exact value at
    the same point: sums of ``2 n p + n^2`` terms (the primal values, the dual's pair terms)
    of total size about ``S``, one evaluation (Higham's gamma_m = m eps / 2)."""
    return 0.5 * reordered_sum(n * (n + 2 * p), eps=eps) * scale


def _objective_rounding(v, th, scale, eps) -> float:
    """How far rounding moves a suboptimality ``F(theta) - F*`` measured in float64 against
    ``v`` from the solver's ``delta``: the gap's rounding, and ``v`` and ``theta`` rounded
    to the dtype (``eps / 2`` of each coordinate), which moves ``F`` and ``F*`` by at most
    ``sqrt(2 S) eps / 2 (|v| + |theta|)`` each."""
    n, p = np.shape(v)
    norms = np.linalg.norm(v) + np.linalg.norm(np.asarray(th, np.float64))
    return _gap_rounding(n, p, scale, eps) + np.sqrt(2 * scale) * eps * norms


def _distance(info, v, th, scale) -> float:
    """Bound on ``||theta - P(v)||`` for an output ``theta`` of ``v``: the certified distance
    of the solver's point (its gap with the gap's rounding), plus the output's rounding
    (``v + move``: ``eps`` of each coordinate) and ``v``'s rounding to the dtype (the
    projection is 1-Lipschitz)."""
    n, p = np.shape(v)
    eps = _eps(th)
    gap = float(info.delta) + _gap_rounding(n, p, scale, eps)
    rounding = eps * (np.linalg.norm(np.asarray(th, np.float64)) + np.linalg.norm(v))
    return certified_distance(gap) + rounding


def _rounding_violation(th, eps) -> float:
    """Violation the output's own rounding can leave: restore's shrink and its distances
    (``k <= p`` terms, beyond its margin of ``4 eps``), the rotation back (``p``-term
    products) and the final ``v + move`` round a row by at most ``(p + 2) eps / 2`` of its
    norm, at both ends of a pair (the screen's shrink: ``2 eps (|x_i| + |x_j|)``):
    ``reordered_sum(2 p + 4)`` times the largest row norm."""
    th = np.asarray(th, np.float64)
    return reordered_sum(2 * th.shape[1] + 4, eps=eps) * float(np.linalg.norm(th, axis=1).max())


def _scale(v) -> float:
    """``S = 1/2 sum_i ||v_i - mean(v)||^2`` in float64."""
    v = np.asarray(v, np.float64)
    return 0.5 * float(np.sum((v - v.mean(0)) ** 2))


def _scale_rtol(v, eps) -> float:
    """Relative rounding of the solver's ``S`` against :func:`_scale`: its mean over n rows
    and the centring round each centred coordinate by ``(n + 1) eps / 2`` of ``max |v|``,
    its sum of ``n p`` squares by ``n p eps / 2``, and ``v``'s own rounding to the dtype."""
    v = np.asarray(v, np.float64)
    n, p = v.shape
    centred = np.abs(v - v.mean(0)).sum()
    return reordered_sum(n + 2, eps=eps) * np.abs(v).max() * centred / _scale(v) + reordered_sum(
        n * p + 2, eps=eps
    )


@pytest.mark.parametrize("kind", ["groups", "uneven", "zeros"])
@pytest.mark.parametrize("method", SOLVERS)
def test_matches_cvxpy_float64(method, kind):
    v, radii_sq = _instance(1, 8, 5, kind)
    ref = cvxpy_projection(v, radii_sq)
    tol = 1e-12
    with jax.enable_x64(True):
        th, info = proj.project(
            jnp.asarray(v), jnp.asarray(radii_sq), method=method, tol=tol, max_iter=20000
        )
        th = np.asarray(th)
    assert th.dtype == np.float64 and bool(info.converged)
    scale = _scale(v)
    # both certified: within their distances of the exact projection
    atol = _distance(info, v, th, scale) + ref.radius
    np.testing.assert_allclose(th, ref.theta, rtol=0, atol=atol)
    subopt = _objective(th, v) - ref.value
    # delta certifies the suboptimality, up to cvxpy's value's error and the gap's rounding
    slack = ref.value_error + _objective_rounding(v, th, scale, EPS64)
    assert float(info.delta) >= subopt - slack
    # converged: delta <= tol S, the solver's S rounded against ours
    assert float(info.delta) <= tol * scale * (1 + _scale_rtol(v, EPS64))
    # feasible up to the output's float64 rounding; the report measures it from differences
    viol = _rounding_violation(th, EPS64)
    assert _max_violation(th, radii_sq) <= viol
    assert float(info.max_violation) <= viol


def test_zero_radii_merge_clients_exactly():
    v, radii_sq = _instance(2, 8, 5, "zeros")
    for method in SOLVERS:
        th, _ = proj.project(
            jnp.asarray(v, jnp.float32), jnp.asarray(radii_sq), method=method, max_iter=5000
        )
        th = np.asarray(th)
        assert np.array_equal(th[0], th[1]) and np.array_equal(th[1], th[2])
        assert np.array_equal(th[3], th[4])


@pytest.mark.parametrize("n,p", [(2, 3), (8, 20), (13, 4)])
def test_all_zero_radii_give_the_mean_exactly(n, p):
    """Every pair at radius 0 (t = 0): the projection is the mean in every row, found by
    the screen before any solver (no iteration), with a zero certified gap and no
    violation; the same alone and vmapped, and equal to cvxpy's projection."""
    rng = np.random.default_rng(n * 100 + p)
    scales = np.float32(10.0) ** rng.integers(-3, 4, size=(3, 1, 1))
    v = rng.standard_normal((3, n, p)).astype(np.float32) * scales
    radii_sq = jnp.zeros((n, n))
    ref = cvxpy_projection(v[0].astype(np.float64), np.zeros((n, n)))
    th_b, info_b = jax.vmap(lambda a: proj.project(a, radii_sq))(jnp.asarray(v))
    # two float32 means of n rows (a matvec with 1 / n, numpy's sum and division)
    mean_rtol = reordered_sum(n + 2)
    assert np.all(np.asarray(info_b.iterations) == 0)
    for b in range(len(v)):
        th, info = proj.project(jnp.asarray(v[b]), radii_sq)
        th = np.asarray(th)
        assert np.all(th == th[0]), "rows must be equal to the bit"
        atol = mean_rtol * np.abs(v[b]).max()
        np.testing.assert_allclose(th[0], v[b].mean(0), rtol=0, atol=atol)
        assert int(info.iterations) == 0 and float(info.delta) == 0.0
        assert float(info.max_violation) == 0.0 and bool(info.converged)
        np.testing.assert_array_equal(np.asarray(th_b[b]), th)
    atol = mean_rtol * np.abs(v[0]).max() + ref.radius  # the float32 mean, cvxpy's certificate
    np.testing.assert_allclose(np.asarray(th_b[0]), ref.theta, rtol=0, atol=atol)


def test_p_larger_than_n_and_solvers_agree_float64():
    # p > n exercises the rotation onto the span of the models.
    v, radii_sq = _instance(3, 6, 40, "groups")
    ref = cvxpy_projection(v, radii_sq)
    with jax.enable_x64(True):
        outs = [
            proj.project(jnp.asarray(v), jnp.asarray(radii_sq), method=m, tol=1e-12, max_iter=20000)
            for m in SOLVERS
        ]
    scale = _scale(v)
    th_0, dist_0 = outs[0][0], _distance(outs[0][1], v, outs[0][0], scale)
    for th, info in outs:
        # each certified: within its distance of the exact projection, so of each other
        dist = _distance(info, v, th, scale)
        np.testing.assert_allclose(th, th_0, rtol=0, atol=dist_0 + dist)
        np.testing.assert_allclose(th, ref.theta, rtol=0, atol=dist + ref.radius)
        assert bool(info.converged)


@pytest.mark.parametrize("method", SOLVERS)
def test_float32_default_path(method):
    v, radii_sq = _instance(4, 8, 5, "groups")
    ref = cvxpy_projection(v, radii_sq)
    th, info = proj.project(
        jnp.asarray(v, jnp.float32), jnp.asarray(radii_sq, jnp.float32), max_iter=5000
    )
    scale = _scale(v)
    # converged: delta <= tol S (float32: the division by S rounds once more)
    assert bool(info.converged) and float(info.rel_delta) <= DEFAULT_TOL * (1 + 2 * EPS32)
    # float32: the certificate holds up to its own rounding and that of v and theta
    subopt = _objective(th, v) - ref.value
    slack = ref.value_error + _objective_rounding(v, th, scale, EPS32)
    assert float(info.delta) >= subopt - slack
    assert subopt <= DEFAULT_TOL * scale + slack
    atol = _distance(info, v, th, scale) + ref.radius
    np.testing.assert_allclose(th, ref.theta, rtol=0, atol=atol)
    rmax = np.sqrt(radii_sq.max())
    # feasible up to the output's rounding; the report measures distances of p terms
    viol = _rounding_violation(th, EPS32)
    assert float(info.rel_violation) <= viol / rmax + reordered_sum(v.shape[1] + 2)
    assert _max_violation(th, radii_sq) <= viol


def _dual_value(lam, v, radii_sq):
    """The Lagrangian dual ``g(lam)`` in float64, written out independently of
    certificate.py: ``theta(lam) = (I + L_lam)^-1 v`` (``L_lam`` the Laplacian of the
    pair multipliers) and ``g = 1/2 ||theta - v||^2 + 1/2 sum_{i<j} lam_ij
    (||theta_i - theta_j||^2 - r_ij^2)``. Clients are not merged (no zero radius)."""
    lam = np.asarray(lam, np.float64)
    n = len(v)
    th = np.linalg.solve(np.eye(n) + np.diag(lam.sum(1)) - lam, v)
    d2 = ((th[:, None] - th[None]) ** 2).sum(-1)
    iu = np.triu_indices(n, 1)
    assert np.all(np.isfinite(radii_sq[iu]) & (radii_sq[iu] > 0))
    return 0.5 * np.sum((th - v) ** 2) + 0.5 * np.sum(lam[iu] * (d2[iu] - radii_sq[iu]))


@pytest.mark.parametrize("x64", [False, True], ids=["float32", "float64"])
def test_certificate_of_truncated_runs(x64):
    """Runs stopped after a few iterations are far from the optimum (suboptimality 1e-3
    to 0.2 of S). ``delta`` is ``1/2 ||theta - v||^2 - g(lam)`` for the returned (feasible)
    theta and multipliers (``info.state.lam``), so it must: bound the true suboptimality
    (against cvxpy), not by orders of magnitude too much (measured at most 3x), and equal
    that primal-dual gap recomputed in numpy. A certificate of half (or 0) the gap fails
    the last check, and on most of these runs the first. Same shapes as the other tests
    of this module (no new compile: tol and max_iter are traced)."""
    v, radii_sq = _instance(5, 8, 5, "groups")
    ref = cvxpy_projection(v, radii_sq, tol=1e-11)
    scale = _scale(v)
    dtype = jnp.float64 if x64 else jnp.float32
    eps = EPS64 if x64 else EPS32
    truncated = lambda method, max_iter: proj.project(
        jnp.asarray(v, dtype),
        jnp.asarray(radii_sq, dtype),
        method=method,
        tol=1e-14,
        max_iter=max_iter,
    )
    # Dykstra's delta is within 1.2x of the truth here. After one Laplacian iteration the
    # repaired primal point is already near the optimum while the dual bound is not yet:
    # delta is 36x the suboptimality there.
    looseness = {"dykstra": 10, "laplacian": 100}
    with jax.enable_x64(x64):
        for method, its in (("dykstra", (10, 30)), ("laplacian", (1, 3))):
            for max_iter in its:
                th, info = truncated(method, max_iter)
                assert not bool(info.converged) and int(info.iterations) == max_iter
                assert np.asarray(th).dtype == dtype
                obj = _objective(th, v)
                subopt = obj - ref.value
                delta = float(info.delta)
                where = (method, max_iter, delta / scale, subopt / scale)
                assert subopt > 1e-4 * scale, where  # genuinely truncated
                # the gap's rounding (and v's, theta's) in the solver's dtype
                rounding = _objective_rounding(v, th, scale, eps)
                assert subopt - ref.value_error - rounding <= delta, where
                assert delta <= looseness[method] * subopt, where
                gap = obj - _dual_value(info.state.lam, v, radii_sq)
                np.testing.assert_allclose(delta, gap, rtol=0, atol=rounding, err_msg=str(where))
                rtol = _scale_rtol(v, eps)  # rel_delta = delta / S, S in the solver's dtype
                np.testing.assert_allclose(float(info.rel_delta), delta / scale, rtol=rtol)
                assert _max_violation(th, radii_sq) <= _rounding_violation(th, eps)
        # The multipliers behind the certificate are a dual point (>= 0, symmetric, zero
        # diagonal) after any number of iterations, the first included: there a Dykstra
        # multiplier that is not clipped at 0 is negative, and g(lam) bounds nothing.
        for method in ("dykstra", "laplacian"):
            for max_iter in (1, 2):
                lam = np.asarray(truncated(method, max_iter)[1].state.lam, np.float64)
                assert lam.min() >= 0, (method, max_iter, lam.min())
                # built symmetric: Dykstra's as lam + lam^T, the Laplacian's steps symmetrized
                np.testing.assert_array_equal(lam, lam.T)
                assert np.all(np.diag(lam) == 0) and lam.max() > 0


@pytest.mark.parametrize("method", SOLVERS)
def test_t_zero_collapses_to_mean_and_inf_is_identity(method):
    v, _ = _instance(0, 8, 5)
    vj = jnp.asarray(v, jnp.float32)
    th, info = proj.project(vj, jnp.zeros((8, 8)), method=method)
    # the float32 mean of 8 rounded rows: 8 + 2 roundings of values up to max |v|
    atol = reordered_sum(8 + 2) * np.abs(v).max()
    np.testing.assert_allclose(th, np.broadcast_to(v.mean(0), v.shape), rtol=0, atol=atol)
    assert float(info.max_violation) == 0.0 and bool(info.converged)
    th, info = proj.project(vj, jnp.full((8, 8), jnp.inf), method=method)
    np.testing.assert_array_equal(th, vj)
    assert int(info.iterations) == 0 and bool(info.converged)
    # huge finite radii: nothing moves either
    th, info = proj.project(vj, jnp.full((8, 8), 1e30), method=method)
    np.testing.assert_allclose(th, v, rtol=EPS32)  # v's rounding to float32


def test_pair_kernel_closed_form():
    a, b = jnp.array([3.0, 0.0]), jnp.array([-1.0, 0.0])
    a2, b2 = proj.pair_kernel(a, b, 2.0)
    # one assertion per end: ``assert_allclose`` returns None, so chaining two with
    # ``and`` never ran the second (a kernel that left ``b`` in place passed)
    # dyadic inputs and answers: exact but for a rounding of the kernel's ratio r / |d|,
    # which the default rtol 1e-7 (> EPS32 / 2) allows
    np.testing.assert_allclose(a2, [2.0, 0.0])
    np.testing.assert_allclose(b2, [0.0, 0.0])
    a2, b2 = proj.pair_kernel(a, b, 2.0, mass_a=3.0, mass_b=1.0)  # heavy end moves less
    np.testing.assert_allclose(a2, [2.5, 0.0])
    np.testing.assert_allclose(b2, [0.5, 0.0])
    a2, b2 = proj.pair_kernel(a, b, 5.0)
    np.testing.assert_array_equal(a2, a)
    np.testing.assert_array_equal(b2, b)


def test_personalized_and_shared_leaves():
    v, radii_sq = _instance(7, 8, 5, "groups")
    shared = np.random.default_rng(1).normal(size=(8, 2))
    mask = {"w": True, "b": False}
    with jax.enable_x64(True):
        tree = {"w": jnp.asarray(v), "b": jnp.asarray(shared)}
        th, info = proj.project(tree, jnp.asarray(radii_sq), personalized=mask, tol=1e-12)
        # all leaves personalized: one joint norm over both leaves
        split = {"w": jnp.asarray(v[:, :3].reshape(8, 3, 1)), "b": jnp.asarray(v[:, 3:])}
        both, info_b = proj.project(split, jnp.asarray(radii_sq), method="laplacian", tol=1e-12)
    ref = cvxpy_projection(v, radii_sq)
    # the shared leaf: two float64 means of 8 rows
    atol = reordered_sum(8 + 2, eps=EPS64) * np.abs(shared).max()
    np.testing.assert_allclose(th["b"], np.broadcast_to(shared.mean(0), (8, 2)), atol=atol)
    scale = _scale(v)
    atol = _distance(info, v, th["w"], scale) + ref.radius  # both certified
    np.testing.assert_allclose(th["w"], ref.theta, rtol=0, atol=atol)
    joint = np.concatenate([np.asarray(both["w"]).reshape(8, 3), both["b"]], axis=1)
    atol = _distance(info_b, v, joint, scale) + ref.radius
    np.testing.assert_allclose(joint, ref.theta, rtol=0, atol=atol)


@pytest.mark.parametrize("method", SOLVERS)
def test_warm_start_from_neighbouring_problem(method):
    v, radii_sq = _instance(8, 8, 5, "groups")
    v2 = v + 0.01 * np.random.default_rng(0).normal(size=v.shape)
    with jax.enable_x64(True):
        kw = dict(method=method, tol=1e-10, max_iter=20000)
        _, info = proj.project(jnp.asarray(v), jnp.asarray(radii_sq), **kw)
        cold, info_cold = proj.project(jnp.asarray(v2), jnp.asarray(radii_sq), **kw)
        warm, info_warm = proj.project(
            jnp.asarray(v2), jnp.asarray(radii_sq), warm_start=info.state, **kw
        )
    assert bool(info_cold.converged) and bool(info_warm.converged)
    assert int(info_warm.iterations) < int(info_cold.iterations)
    scale = _scale(v2)  # both certified: within their distances of the projection of v2
    atol = _distance(info_warm, v2, warm, scale) + _distance(info_cold, v2, cold, scale)
    np.testing.assert_allclose(warm, cold, rtol=0, atol=atol)


@pytest.mark.parametrize("method", SOLVERS)
def test_warm_started_training_run_matches_cold_solves(method):
    # Projected gradient steps toward each client's own optimum (a training run whose
    # constraints bind every step): each projection warm-started from the last one's
    # state must meet the tolerance and land where a cold solve does. 1/2||theta - v||^2
    # is 1-strongly convex, so a feasible point with certified gap delta lies within
    # sqrt(2 delta) of the projection: the two answers are within the sum of those radii
    # (with the float32 rounding of the gaps and of the points, _distance).
    v0, radii_sq = _instance(11, 9, 6)
    rng = np.random.default_rng(12)
    optima = v0 + 2.0 * rng.normal(size=v0.shape)
    tol = 1e-4  # the experiments' tolerance (Dykstra needs more than 500 sweeps for 1e-6)
    run = jax.jit(
        lambda v, state: proj.project(v, radii_sq, method=method, tol=tol, warm_start=state)
    )
    cold = jax.jit(lambda v: proj.project(v, radii_sq, method=method, tol=tol))
    theta = jnp.asarray(v0, jnp.float32)
    state = proj.init_projection_state(theta, method=method)
    its_warm = its_cold = 0
    for _ in range(12):
        v = theta - 0.3 * (theta - optima)
        theta, info = run(v, state)
        state = info.state
        theta_c, info_c = cold(v)
        assert bool(info.converged) and bool(info_c.converged)
        v64, scale = np.asarray(v, np.float64), _scale(v)
        gap = _distance(info, v64, theta, scale) + _distance(info_c, v64, theta_c, scale)
        dist = float(jnp.linalg.norm(theta - theta_c))
        assert dist <= gap, (dist, gap)
        # feasible up to the output's rounding; the report measures distances of p terms
        viol = _rounding_violation(theta, EPS32) / np.sqrt(np.max(radii_sq))
        assert float(info.rel_violation) <= viol + reordered_sum(v0.shape[1] + 2)
        its_warm += int(info.iterations)
        its_cold += int(info_c.iterations)
    assert 0 < its_warm < its_cold, (its_warm, its_cold)


def test_compiles_once_and_runs_in_jit_scan_vmap(monkeypatch):
    v, radii_sq = _instance(9, 8, 5, "groups")
    vj, rj = jnp.asarray(v, jnp.float32), jnp.asarray(radii_sq, jnp.float32)
    chex.clear_trace_counter()
    counted = chex.assert_max_traces(proj_api._project_core, n=1)
    monkeypatch.setattr(proj_api, "_project_flat", jax.jit(counted, static_argnames="method"))
    for scale in (1.0, 2.0, 3.0, 4.0):  # a second trace would raise
        proj.project(vj * scale, rj * scale)
    monkeypatch.undo()

    # inside lax.scan, carrying the warm start (what a training loop does)
    state0 = proj.init_projection_state(vj, rj)

    def step(state, shift):
        th, info = proj.project(vj + shift, rj, warm_start=state, max_iter=5000)
        return info.state, (th, info.iterations, info.delta)

    shifts = 0.01 * jnp.arange(3.0)[:, None, None] * jnp.ones((3, 8, 5))
    _, (ths, its, deltas) = jax.jit(lambda s: jax.lax.scan(step, s, shifts))(state0)
    direct, info_direct = proj.project(vj + shifts[2], rj, max_iter=5000)
    # both certified: each within its distance of the projection of vj + shifts[2]
    v2 = np.asarray(vj + shifts[2], np.float64)
    scale = _scale(v2)
    atol = _distance(info_direct._replace(delta=deltas[2]), v2, ths[2], scale)
    atol += _distance(info_direct, v2, direct, scale)
    np.testing.assert_allclose(ths[2], direct, rtol=0, atol=atol)
    assert int(its[2]) <= int(its[0])

    # vmapped over a batch of problems with traced radii
    batch = jnp.stack([vj, 2.0 * vj])
    ths, infos = jax.vmap(lambda x, r: proj.project(x, r, method="laplacian"))(
        batch, jnp.stack([rj, 4.0 * rj])
    )
    # P(2 v; 4 r^2) = 2 P(v; r^2): each member within its certified distance of its own
    v1 = np.asarray(vj, np.float64)
    member = lambda k: jax.tree.map(lambda a: a[k], infos)  # noqa: E731
    atol = _distance(member(1), 2 * v1, ths[1], _scale(2 * v1))
    atol += 2 * _distance(member(0), v1, ths[0], _scale(v1))
    np.testing.assert_allclose(ths[1], 2.0 * ths[0], rtol=0, atol=atol)
    assert bool(jnp.all(infos.converged))


@pytest.mark.parametrize(
    "method, in_turn",
    [("dykstra", True), ("laplacian", True), ("laplacian", False)],
    ids=["dykstra-in_turn", "laplacian-in_turn", "laplacian-lockstep"],
)
def test_vmapped_members_are_solved_as_if_alone(method, in_turn, monkeypatch):
    """A batch mixing an as-is member, a certified shrink and solver members (one easy,
    two cut off by max_iter) gives each member its unbatched answer, iterations included,
    whether the members are solved in turn (the CPU's rule) or as one lockstep batch (an
    accelerator's, forced here): in the lockstep batch the members that a screen answered
    or that stopped skip the solver's loops without changing anyone's result. A nested
    vmap gives the same answers."""
    monkeypatch.setattr(_platform, "members_in_turn", lambda: in_turn)
    jax.clear_caches()  # the batched jaxprs of the other mode are cached
    v, radii_sq = _instance(21, 7, 4, "uneven")
    sq = np.sum((v[:, None] - v[None]) ** 2, axis=-1)
    members = [
        (v, 4.0 * sq),  # feasible: returned as is
        (v, 0.9998 * sq),  # a shrink toward the mean, certified by the screen
        (v, np.where(np.arange(7)[:, None] + np.arange(7) == 1, 0.5, 4.0) * sq),  # one pair
        (v, radii_sq),
        (2.0 * v, radii_sq),
    ]
    vs = jnp.asarray(np.stack([m[0] for m in members]), jnp.float32)
    rs = jnp.asarray(np.stack([m[1] for m in members]), jnp.float32)
    cap = 10
    solve = lambda x, r: proj.project(x, r, method=method, tol=1e-6, max_iter=cap)
    th_b, info_b = jax.jit(jax.vmap(solve))(vs, rs)
    solve_one = jax.jit(solve)
    member = lambda info, k: jax.tree.map(lambda a: a[k], info)  # noqa: E731
    # a member and its unbatched solve, each within its certified distance of the projection
    dist = lambda info, k, th: _distance(info, vk(k), th, _scale(vk(k)))  # noqa: E731
    vk = lambda k: np.asarray(vs[k], np.float64)  # noqa: E731
    for k in range(len(members)):
        th, info = solve_one(vs[k], rs[k])
        atol = dist(member(info_b, k), k, th_b[k]) + dist(info, k, th)
        np.testing.assert_allclose(th_b[k], th, rtol=0, atol=atol, err_msg=str(k))
        assert int(info_b.iterations[k]) == int(info.iterations), k
        assert bool(info_b.converged[k]) == bool(info.converged), k
    # the screens answered members 0 and 1; 3 and 4 were cut off at the cap
    np.testing.assert_array_equal(info_b.iterations[:2], 0)
    np.testing.assert_array_equal(info_b.iterations[3:], cap)
    np.testing.assert_array_equal(info_b.converged, [True, True, True, False, False])
    pairs = lambda a: a[1:].reshape(2, 2, *a.shape[1:])
    th_n, info_n = jax.jit(jax.vmap(jax.vmap(solve)))(pairs(vs), pairs(rs))
    for k in range(1, len(members)):
        th_k, info_k = member((th_n, info_n), divmod(k - 1, 2))  # [2, 2] from member 1 on
        atol = dist(info_k, k, th_k) + dist(member(info_b, k), k, th_b[k])
        np.testing.assert_allclose(th_k, th_b[k], rtol=0, atol=atol, err_msg=str(k))
    np.testing.assert_array_equal(info_n.iterations.reshape(-1), info_b.iterations[1:])
    jax.clear_caches()


def test_bad_input_raises():
    v, radii_sq = _instance(10, 4, 3, "groups")
    vj = jnp.asarray(v, jnp.float32)
    bad = {
        "negative": np.where(np.eye(4) > 0, 0.0, -radii_sq),
        "NaN": np.where(np.eye(4) > 0, 0.0, np.nan),
        "symmetric": radii_sq + np.triu(np.ones((4, 4)), 1),
    }
    for word, r in bad.items():
        with pytest.raises(ValueError, match=word):
            proj.project(vj, jnp.asarray(r))
    with pytest.raises(ValueError, match="shape"):
        proj.project(vj, jnp.ones((3, 3)))
    with pytest.raises(ValueError, match="personalized"):
        proj.project({"a": vj, "b": vj}, radii_sq, personalized={"a": True})
    with pytest.raises(ValueError, match="client axis"):
        proj.project({"a": vj, "b": vj[:3]}, jnp.ones((4, 4)))
    with pytest.raises(ValueError, match="method"):
        proj.project(vj, radii_sq, method="pocs")
    with pytest.raises(ValueError, match="warm_start"):
        proj.project(vj, radii_sq, warm_start=proj.init_projection_state(vj[:3]))


def test_dtypes_integer_half_and_nan():
    """Integers come back as floats; half precision is solved in float32 and rounded back
    with its true violation reported; NaN under jit stops at once, unconverged."""
    v = jnp.array([[0], [3], [7]], jnp.int32)
    radii_sq = jnp.ones((3, 3))
    th, info = proj.project(v, radii_sq)
    assert jnp.issubdtype(th.dtype, jnp.floating) and bool(info.converged)
    assert _max_violation(th, np.ones((3, 3))) <= _rounding_violation(th, EPS32)
    # the mean is kept: 3 rows, each v + a move rounded (3 + 2 roundings of values <= 7)
    np.testing.assert_allclose(np.asarray(th).mean(), 10 / 3, rtol=0, atol=reordered_sum(5) * 7)
    for dt in (jnp.float16, jnp.bfloat16):
        th, info = proj.project(v.astype(dt), radii_sq)
        assert th.dtype == dt and bool(info.converged)
        d = np.abs(np.asarray(th, np.float64)[:, None, 0] - np.asarray(th, np.float64)[None, :, 0])
        # float32 distances of half-precision rows (p = 1): exact differences and squares,
        # one rounding of the square root
        atol = EPS32 * d.max()
        np.testing.assert_allclose(float(info.max_violation), max(d.max() - 1.0, 0.0), atol=atol)
    nan_v = jnp.zeros((3, 2)).at[0, 0].set(jnp.nan)
    for method in SOLVERS:
        th, info = jax.jit(lambda x, m=method: proj.project(x, radii_sq, method=m))(nan_v)
        assert not bool(info.converged) and int(info.iterations) <= 10
    with pytest.raises(ValueError, match="v: leaf 0"):
        proj.project(nan_v, radii_sq)
    with pytest.raises(TypeError, match="v: leaf 0 has dtype complex"):
        proj.project(v.astype(jnp.complex64), radii_sq)


def test_auto_picks_dykstra_for_one_pair_and_laplacian_from_three():
    assert proj.choose_method(2, 1) == "dykstra"
    assert proj.choose_method(2, 1010) == "dykstra"
    assert proj.choose_method(3, 2) == "laplacian"
    assert proj.choose_method(5, 1010) == "laplacian"
    assert proj.choose_method(6, 2) == "laplacian"
    assert proj.choose_method(30, 1010) == "laplacian"
    assert proj.choose_method(2, 2_000_000) == "laplacian"  # 2e6 floats of pair state
    v = jnp.zeros((50, 3))
    state = proj.init_projection_state(v)
    assert state.lam.shape == (50, 50) and state.pair_dual.shape == (0, 3)
    assert proj.init_projection_state(v[:2]).pair_dual.shape == (1, 3)
    assert proj.init_projection_state(v[:4]).pair_dual.shape == (0, 3)


def test_models_far_inside_their_radii_come_back_as_is():
    """The triangle screen: when ``(|v_i - mean| + |v_j - mean|)^2`` is below every squared
    radius, ``v`` comes back exactly (float32, rows far from 0, one pair unconstrained);
    one tight pair sends it on to the Gram screen and the solver, which still project."""
    v, _ = _instance(13, 8, 6, "groups")
    v = v + 100.0
    norms = np.linalg.norm(v - v.mean(0), axis=1)
    radii_sq = (norms[:, None] + norms[None, :]) ** 2 * 1.001
    radii_sq[2, 5] = radii_sq[5, 2] = np.inf
    vj = jnp.asarray(v, jnp.float32)
    th, info = proj.project(vj, jnp.asarray(radii_sq, jnp.float32))
    np.testing.assert_array_equal(th, vj)
    assert int(info.iterations) == 0 and float(info.delta) == 0.0
    d2 = ((v[:, None] - v[None]) ** 2).sum(-1)
    radii_sq[0, 1] = radii_sq[1, 0] = 0.8 * d2[0, 1]  # now one pair is violated
    with jax.enable_x64(True):
        ref = cvxpy_projection(v, radii_sq)
        th, info = proj.project(jnp.asarray(v), jnp.asarray(radii_sq), tol=1e-12)
    assert int(info.iterations) > 0 and bool(info.converged)
    atol = _distance(info, v, th, _scale(v)) + ref.radius  # both certified
    np.testing.assert_allclose(th, ref.theta, rtol=0, atol=atol)


def test_feasible_input_is_returned_as_is():
    """Screening: a point that meets every constraint is its own projection (lam = 0),
    also with a nonzero warm start; one pair just outside sends it to the solver."""
    v, radii_sq = _instance(11, 9, 4, "groups")
    d2 = ((v[:, None] - v[None]) ** 2).sum(-1)
    radii_sq = 1.01 * d2 + 1e-3
    vj = jnp.asarray(v, jnp.float32)
    for method in SOLVERS:
        warm = proj.init_projection_state(vj, method=method)
        warm = jax.tree.map(jnp.ones_like, warm)
        th, info = proj.project(vj, jnp.asarray(radii_sq), method=method, warm_start=warm)
        np.testing.assert_array_equal(th, vj)
        assert int(info.iterations) == 0 and float(info.delta) == 0.0
        assert not np.any(np.asarray(info.state.lam))
    radii_sq[0, 1] = radii_sq[1, 0] = 0.9 * d2[0, 1]
    with jax.enable_x64(True):
        ref = cvxpy_projection(v, radii_sq)
        th, info = proj.project(jnp.asarray(v), jnp.asarray(radii_sq), tol=1e-12)
    assert int(info.iterations) > 0 and bool(info.converged)
    atol = _distance(info, v, th, _scale(v)) + ref.radius  # both certified
    np.testing.assert_allclose(th, ref.theta, rtol=0, atol=atol)


@pytest.mark.parametrize("n, p", [(2, 3), (9, 40)])
def test_shrink_toward_the_mean_is_certified(n, p):
    """A point just outside (every pair 1e-5 beyond its radius, as after a small move
    from the last round's projection) comes back shrunk toward its mean without a
    solver; its gap (float64, against cvxpy) and its violation bound (float32 and
    float64, against exact distances) hold. The screen runs before any solver, the same
    code whichever is named: float64 for every solver (each dispatches to it), float32
    for the default one only (each is a compile of the whole projection)."""
    rng = np.random.default_rng(n)
    v = rng.normal(size=(n, p)) + 3.0  # rows far from 0: rounding is relative to |v|
    d2 = ((v[:, None] - v[None]) ** 2).sum(-1)
    radii_sq = d2 / (1.0 + 1e-5) ** 2
    np.fill_diagonal(radii_sq, 0.0)
    ref = cvxpy_projection(v, radii_sq)
    scale = _scale(v)
    rmax = np.sqrt(radii_sq.max())
    for method, x64 in [(m, True) for m in SOLVERS] + [("auto", False)]:
        with jax.enable_x64(x64):
            dt = jnp.float64 if x64 else jnp.float32
            warm = proj.init_projection_state(jnp.asarray(v, dt), method=method)
            th, info = proj.project(
                jnp.asarray(v, dt),
                jnp.asarray(radii_sq, dt),
                method=method,
                warm_start=jax.tree.map(jnp.ones_like, warm),
            )
        case = (method, x64)
        eps = EPS64 if x64 else EPS32
        assert int(info.iterations) == 0 and bool(info.converged), case
        assert not np.any(np.asarray(info.state.lam)), case
        # certified by the screen: gap <= tol (float32: one more rounding of it)
        assert 0 < float(info.rel_delta) <= DEFAULT_TOL * (1 + 2 * eps), case
        th = np.asarray(th, np.float64)
        # the reported bound holds, up to our float64 distances of p terms
        measured = reordered_sum(p + 2, eps=EPS64) * rmax
        assert _max_violation(th, radii_sq) <= float(info.max_violation) + measured, case
        # the screen's bound: rounding of the shrunk rows, 2 eps (|x_i| + |x_j|)
        assert float(info.max_violation) <= _rounding_violation(v, eps), case
        # the shrink keeps the mean: n rows rounded, their float mean (n + 3 roundings)
        atol = reordered_sum(n + 3, eps=eps) * np.abs(v).max()
        np.testing.assert_allclose(th.mean(0), v.mean(0), rtol=0, atol=atol)
        if x64:  # the certificate: objective minus the optimum is at most delta
            gap = 0.5 * np.sum((th - v) ** 2) - ref.value
            slack = ref.value_error + _objective_rounding(v, th, scale, EPS64)
            assert gap <= float(info.delta) + slack, case


@pytest.mark.parametrize("n, p, tol_d", [(100, 4, 1e-5), (60, 130, 1e-7)])
def test_large_n_auto_matches_dykstra(n, p, tol_d):
    """Many clients: "auto" (the Laplacian dual after screening; rotated when p >= 2n)
    against the pair-copy Dykstra on the same instance, both certified in float64
    (Dykstra to 1e-5 at n = 100 and 1e-7 at n = 60, for time: at n = 150, 1e-9 takes it
    over 20,000 sweeps; "auto" to 1e-9 in both)."""
    assert proj.choose_method(n, p) == "laplacian"
    v, radii_sq = _instance(12, n, p, "uneven")
    radii_sq *= np.median(((v[:, None] - v[None]) ** 2).sum(-1)) / 10.0
    scale = _scale(v)
    with jax.enable_x64(True):
        args = (jnp.asarray(v), jnp.asarray(radii_sq))
        outs = {
            "auto": proj.project(*args, tol=1e-9, max_iter=500),
            "dykstra": proj.project(*args, method="dykstra", tol=tol_d, max_iter=20000),
        }
    for m, (th, info) in outs.items():
        tol = 1e-9 if m == "auto" else tol_d
        # converged: delta <= tol S, the solver's S rounded against ours
        assert bool(info.converged), m
        assert float(info.delta) <= tol * scale * (1 + _scale_rtol(v, EPS64)), m
        assert _max_violation(th, radii_sq) <= _rounding_violation(th, EPS64), m
    (th_a, info_a), (th_d, info_d) = outs["auto"], outs["dykstra"]
    # each within its certified distance of the projection
    bound = _distance(info_a, v, th_a, scale) + _distance(info_d, v, th_d, scale)
    assert np.linalg.norm(np.asarray(th_a) - np.asarray(th_d)) <= bound
    assert np.linalg.norm(np.asarray(th_a) - v) > 0.1 * np.sqrt(scale)  # it did project
    lam = np.asarray(info_a.state.lam)
    assert 0 < np.count_nonzero(lam) < lam.size / 4  # most pairs inactive


def test_method_none_returns_v_and_the_warm_start():
    """The ablation: ``v`` unchanged (shared leaves too), zero report, the warm start passed
    through, also under jit."""
    v = {"a": jnp.arange(6.0).reshape(3, 2), "b": jnp.ones((3, 4))}
    mask = {"a": True, "b": False}
    warm = proj.init_projection_state(v, personalized=mask, method="none")
    assert warm.pair_dual.shape == (0, 2)
    out, info = jax.jit(
        lambda v, w: proj.project(
            v, jnp.ones((3, 3)), personalized=mask, method="none", warm_start=w
        )
    )(v, warm)
    chex.assert_trees_all_equal(out, v)
    chex.assert_trees_all_equal(info.state, warm)
    assert int(info.iterations) == 0 and float(info.delta) == 0.0 and bool(info.converged)


def test_method_none_refuses_a_warm_start_of_other_clients():
    v = jnp.ones((3, 2))
    other = proj.init_projection_state(v[:2])
    with pytest.raises(ValueError, match="warm_start"):
        proj.project(v, jnp.ones((3, 3)), method="none", warm_start=other)


def test_a_new_solver_is_one_function_and_one_registry_row(monkeypatch):
    """The contract: a toy solver (the restoration of ``w`` at ``lam = 0``, certified by
    ``g(0)``) registered by one row runs through ``project`` with a correct certificate."""
    from karula_jax.projection import certificate, contract, solvers  # noqa: PLC0415

    def shrink(red, warm, *, tol, max_iter, skip=False):
        del max_iter, skip
        lam = jnp.zeros_like(warm.lam)
        th, gap = certificate.restore_and_certify(
            red.w, certificate.dual_eval(lam, red, gram=False, certify=True).g, red
        )
        state = contract.ProjectionState(lam, warm.pair_dual)
        return contract.SolverResult(th, state, gap, jnp.int32(1), gap <= tol * red.scale)

    row = contract.Solver(shrink, pair_state=False, rotate=lambda n, p: False)
    monkeypatch.setitem(solvers.SOLVERS, "shrink", row)
    v, radii_sq = _instance(2, 6, 4, "groups")
    with jax.enable_x64(True):
        out, info = proj.project(jnp.asarray(v), jnp.asarray(radii_sq), method="shrink", tol=1e-3)
        out = np.asarray(out)
    assert int(info.iterations) == 1
    assert _max_violation(out, radii_sq) <= _rounding_violation(out, EPS64)
    ref = cvxpy_projection(v, radii_sq)
    subopt = _objective(out, v) - ref.value
    # the gap certifies, up to cvxpy's value's error and the float64 gap's rounding
    slack = ref.value_error + _objective_rounding(v, out, _scale(v), EPS64)
    assert float(info.delta) >= subopt - slack
    assert float(info.delta) > 1e-3 and not bool(info.converged)  # a shrink is not optimal


def test_personalized_has_the_factories_meaning():
    """True (the default) constrains every leaf, False shares every leaf (its mean), a
    mask mixes them, None is refused as in every algorithm factory."""
    v = {"a": jnp.asarray([[0.0, 0.0], [4.0, 0.0], [0.0, 3.0]]), "b": jnp.arange(6.0).reshape(3, 2)}
    radii_sq = jnp.full((3, 3), 1.0)
    default, _ = proj.project(v, radii_sq)
    every, _ = proj.project(v, radii_sq, personalized={"a": True, "b": True})
    chex.assert_trees_all_equal(default, every)  # the same flat problem, the same program
    shared, info = proj.project(v, radii_sq, personalized=False)
    mean = jax.tree.map(lambda x: jnp.broadcast_to(x.mean(0), x.shape), v)
    mean_rtol = reordered_sum(3 + 2)  # two float32 means of 3 nonnegative rows
    chex.assert_trees_all_close(shared, mean, rtol=mean_rtol, atol=0.0)
    assert int(info.iterations) == 0
    mixed, _ = proj.project(v, radii_sq, personalized={"a": True, "b": False})
    np.testing.assert_allclose(mixed["b"], mean["b"], rtol=mean_rtol)
    assert _max_violation(mixed["a"], np.asarray(radii_sq)) <= _rounding_violation(
        mixed["a"], EPS32
    )
    with pytest.raises(ValueError, match="personalized=None is not accepted"):
        proj.project(v, radii_sq, personalized=None)
    with pytest.raises(ValueError, match="personalized=None is not accepted"):
        proj.init_projection_state(v, personalized=None)


@pytest.mark.parametrize("n", [2, 9])
def test_pulled_certificate_is_feasible_and_no_worse_than_the_shrink(n):
    """A dual iterate's theta(lam) pulled together (``sweeps``) and then shrunk is exactly
    feasible, its reported gap is its own primal value minus g(lam) (recomputed here), and
    it is never worse than the shrink of theta(lam) alone; on these instances it is better."""
    from karula_jax.projection import certificate, reduction  # noqa: PLC0415

    v, radii_sq = _instance(n, n, 3, "groups")
    with jax.enable_x64(True):
        red = reduction.reduce_problem(jnp.asarray(v), jnp.asarray(radii_sq), rotate=False)
        lam = 0.05 * jnp.where(certificate.dual_mask(red), 1.0, 0.0)  # a crude dual point
        ev = certificate.dual_eval(lam, red, gram=False, certify=True)
        shrunk, gap0 = certificate.restore_and_certify(ev.th, ev.g, red)
        pulled, gap4 = certificate.restore_and_certify(ev.th, ev.g, red, sweeps=jnp.int32(4))
        d = np.sqrt(np.asarray(reduction.sq_dists_exact(pulled)))
        radius = np.asarray(red.radius)
        assert np.all(d[np.isfinite(radius)] <= radius[np.isfinite(radius)])
        own = 0.5 * np.sum(np.asarray(red.mass)[:, None] * (np.asarray(pulled) - red.w) ** 2)
        # the same float64 primal value summed in another order (3 n terms), less g
        atol = reordered_sum(3 * n + 2, eps=EPS64) * (own + abs(float(ev.g)))
        np.testing.assert_allclose(float(gap4), own - float(ev.g), rtol=0, atol=atol)
        assert float(gap4) <= float(gap0)
        if n > 2:
            assert float(gap4) < 0.9 * float(gap0), (float(gap4), float(gap0))


@pytest.mark.parametrize("n, p", [(1, 3), (2, 1), (7, 40), (30, 5)])
def test_shrink_takes_the_distances_it_is_given(n, p):
    """``restore(sq_dists=...)`` shrinks by the distances handed to it: given the exact
    ones it is the default shrink bit for bit; given those of the Gram matrix
    (``sq_dists_of_gram``, what the Laplacian solver's iterates pass) it is the Gram shrink,
    which measures them from a second product, up to the rounding of the two. Both match
    float64 distances within the Gram matrix's rounding."""
    from karula_jax.projection import reduction

    rng = np.random.default_rng(n + p)
    th = jnp.asarray(rng.normal(size=(n, p)) + 2.0, jnp.float32)
    th64 = np.asarray(th, np.float64)
    exact64 = ((th64[:, None] - th64[None]) ** 2).sum(-1)
    radius = np.sqrt(0.5 * exact64) + np.diag(np.full(n, np.inf))  # every pair violated
    radius = jnp.asarray(radius, jnp.float32)
    of_gram = reduction.sq_dists_of_gram(th @ th.T)
    # a Gram entry rounds by p eps |th_i| |th_j|; the distance's three terms add two more
    sq = (th64 * th64).sum(-1)
    bound = (p + 2) * EPS32 * (sq[:, None] + sq[None, :])
    assert np.all(np.abs(np.asarray(of_gram, np.float64) - exact64) <= bound)
    given = reduction.restore(th, radius, sq_dists=reduction.sq_dists_exact(th))
    np.testing.assert_array_equal(np.asarray(given), np.asarray(reduction.restore(th, radius)))
    from_gram = reduction.restore(th, radius, sq_dists=of_gram)
    gram = reduction.restore(th, radius, gram=True)
    if n > 1:  # beta < 1: the shrink ran
        assert float(jnp.max(jnp.abs(gram))) < float(jnp.max(jnp.abs(th)))
    # beta from the two measurements: each distance within ``bound`` of the exact one, so
    # beta within half its relative error, times each coordinate
    rel = np.max(np.where(exact64 > 0, bound / np.where(exact64 > 0, exact64, 1.0), 0.0))
    atol = (rel + 4 * EPS32) * float(jnp.max(jnp.abs(th)))
    np.testing.assert_allclose(np.asarray(from_gram), np.asarray(gram), rtol=0, atol=atol)


def test_iterates_certified_from_the_evaluations_gram_take_the_same_path(monkeypatch):
    """Above 96 clients the Laplacian solver certifies its iterates with distances from
    each evaluation's Gram matrix; forming that matrix again (as it did before) takes the
    same iterations to the same answer, within the two certified distances."""
    from karula_jax.projection import laplacian

    v, radii_sq = _instance(3, 100, 80, "uneven")  # k = 80: not low rank, not rotated
    radii_sq *= np.median(((v[:, None] - v[None]) ** 2).sum(-1)) / 10.0
    v, radii_sq = jnp.asarray(v, jnp.float32), jnp.asarray(radii_sq, jnp.float32)
    jax.clear_caches()
    th, info = proj.project(v, radii_sq, method="laplacian")
    monkeypatch.setattr(laplacian, "sq_dists_of_gram", lambda gm: None)
    jax.clear_caches()
    try:
        th_again, info_again = proj.project(v, radii_sq, method="laplacian")
    finally:
        jax.clear_caches()
    assert bool(info.converged) and int(info.iterations) > 1
    assert int(info_again.iterations) == int(info.iterations)
    atol = certified_distance(float(info.delta)) + certified_distance(float(info_again.delta))
    np.testing.assert_allclose(np.asarray(th), np.asarray(th_again), rtol=0, atol=atol)


def test_recertified_gram_evaluation_equals_the_certified_one():
    """Above 96 clients the Laplacian solver's phase 1 starts from phase 0's last (Gram,
    uncertified) evaluation with g's residual term subtracted (``certified``): the same
    as evaluating afresh with ``certify=True``, and a lower bound below the uncertified g."""
    from karula_jax.projection import certificate, reduction

    rng = np.random.default_rng(5)
    n, p = 11, 4
    x = jnp.asarray(rng.normal(size=(n, p)), jnp.float32)
    radii_sq = jnp.asarray(rng.uniform(0.1, 0.5, size=(n, n)), jnp.float32)
    red = reduction.reduce_problem(x, radii_sq + radii_sq.T, rotate=False)
    lam = jnp.asarray(rng.uniform(0.0, 2.0, size=(n, n)), jnp.float32)
    lam = jnp.where(certificate.dual_mask(red), lam + lam.T, 0.0)
    fast = certificate.dual_eval(lam, red, gram=True)
    exact = certificate.dual_eval(lam, red, gram=True, certify=True)
    got = certificate.certified(lam, fast, red)
    # g's float32 sums (n p primal terms, n^2 pair terms, n p residual terms) in another
    # order, relative to the terms' magnitudes
    mass, w, L = (np.asarray(a, np.float64) for a in (red.mass, red.w, lam))
    th64 = np.asarray(fast.th, np.float64)
    d2 = ((th64[:, None] - th64[None]) ** 2).sum(-1)
    r2 = np.where(np.isfinite(red.radius), np.asarray(red.radius, np.float64), 0.0) ** 2
    magnitude = 0.5 * np.sum(mass[:, None] * (th64 - w) ** 2) + 0.25 * np.sum(L * (d2 + r2))
    atol = reordered_sum(n * (n + 2 * p)) * magnitude
    np.testing.assert_allclose(float(got.g), float(exact.g), rtol=0, atol=atol)
    np.testing.assert_array_equal(np.asarray(got.th), np.asarray(fast.th))
    # the residual term itself, on a theta far from the Lagrangian's minimizer (numpy)
    th = fast.th + 0.05 * jnp.asarray(rng.normal(size=fast.th.shape), jnp.float32)
    got = certificate.certified(lam, fast._replace(th=th), red)
    a = np.diag(mass + L.sum(1)) - L
    th64 = np.asarray(th, np.float64)
    res = mass[:, None] * w - a @ th64
    drop = 0.5 * np.sum(res * res)
    assert drop > 1e-3 * abs(float(fast.g))
    # float32 residuals (n-term products, relative to |M w| + |A| |theta|), their n p
    # squares, and the subtraction from g
    res_mag = np.abs(mass[:, None] * w) + np.abs(a) @ np.abs(th64)
    atol = reordered_sum(n + n * p + 2) * (np.sum(np.abs(res) * res_mag) + abs(float(fast.g)))
    np.testing.assert_allclose(float(got.g), float(fast.g) - drop, rtol=0, atol=atol)


def test_pcg_from_a_start_solves_the_system():
    """CG from 0 and from any start reach the solution of an SPD system (the refinement
    passes of the Laplacian solver resume CG from the previous pass's step)."""
    from karula_jax.projection import laplacian

    rng = np.random.default_rng(3)
    with jax.enable_x64(True):
        a = rng.normal(size=(20, 20))
        m = jnp.asarray(a @ a.T + 20 * np.eye(20) * rng.uniform(0.1, 10, size=20))
        b = jnp.asarray(rng.normal(size=20))
        want = np.linalg.solve(np.asarray(m), np.asarray(b))
        dot = lambda u, w: jnp.sum(u * w)
        # CG stops at |r| <= rtol |b| (its recurrence's residual, which drifts from the true
        # one by at most the float64 rounding of its 20-term products over its 200 steps);
        # the error is at most that residual over lambda_min(m)
        eigs = np.linalg.eigvalsh(np.asarray(m))
        drift = reordered_sum(20, rounds=200, eps=EPS64) * eigs[-1] * np.linalg.norm(want)
        error = lambda residual: (residual + drift) / eigs[0]  # noqa: E731
        for start in (None, jnp.zeros(20), jnp.asarray(rng.normal(size=20)), jnp.asarray(want)):
            got = laplacian._pcg(
                lambda x: m @ x, b, jnp.diag(m), dot, rtol=1e-12, max_iter=200, start=start
            )
            atol = error(1e-12 * np.linalg.norm(b))
            np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=atol)
        # Resumed from a start whose residual the caller passes (``b`` unused), down to
        # an absolute squared residual ``stop``.
        start = jnp.asarray(rng.normal(size=20))
        got = laplacian._pcg(
            lambda x: m @ x,
            None,
            jnp.diag(m),
            dot,
            rtol=0.0,
            max_iter=200,
            start=start,
            residual=b - m @ start,
            stop=1e-20,
        )
        # stop is the squared residual: |r| <= 1e-10
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=error(np.sqrt(1e-20)))


@pytest.mark.parametrize("n, p", [(7, 3), (12, 40), (31, 5)])
def test_newton_step_is_symmetric_to_the_bit(n, p):
    """Radii that differ by an ulp between ``(i, j)`` and ``(j, i)`` (the input check
    allows 1e-6, and skips traced input) become the smaller of the two, and every pair
    array of a Newton step is then symmetric to the bit: a step that is not can fix one
    side of a pair and not the other, and CG then solves another system."""
    from karula_jax.projection import certificate, laplacian, pair_algebra, reduction

    v, radii_sq = _instance(n + p, n, p, "uneven")
    radii_sq = radii_sq.astype(np.float32)
    upper = np.triu(np.ones((n, n), bool), 1)
    bumped = np.where(upper, np.nextafter(radii_sq, np.float32(np.inf)), radii_sq)
    red = reduction.reduce_problem(jnp.asarray(v, jnp.float32), jnp.asarray(bumped), rotate=False)
    radius = np.asarray(red.radius)
    np.testing.assert_array_equal(radius, radius.T)
    off = ~np.eye(n, dtype=bool)
    np.testing.assert_array_equal(radius[off], np.sqrt(radii_sq)[off])  # the smaller one
    mask = certificate.dual_mask(red)
    rng = np.random.default_rng(n)
    lam = np.triu(rng.uniform(0, 0.3, size=(n, n)) * (rng.uniform(size=(n, n)) < 0.4), 1)
    lam = jnp.asarray(np.where(np.asarray(mask), lam + lam.T, 0.0), jnp.float32)
    for gram in (False, True):
        ev = certificate.dual_eval(lam, red, gram=gram)
        s, s_diag = (np.asarray(a) for a in laplacian._direction(red, mask, lam, ev, True, 10))
        assert np.abs(s).max() > 0
        np.testing.assert_array_equal(s, s.T)
        np.testing.assert_array_equal(s_diag, s_diag.T)
        x = jnp.asarray(np.where(np.asarray(mask), rng.normal(size=(n, n)), 0.0), jnp.float32)
        hx = np.asarray(pair_algebra.hvp(ev, mask, x + x.T))
        np.testing.assert_array_equal(hx, hx.T)


def test_multipliers_stay_symmetric_on_one_dimensional_hard_instances():
    """With p = 1 the dual Hessian is singular and CG amplifies rounding that differs
    between ``(i, j)`` and ``(j, i)``: before the steps and trial points were symmetrized
    this left multipliers lopsided by 0.045 (n = 5) and projections stalled short of tol
    (``results/bench/README.md``, robustness)."""
    from experiments.bench_projection import hard_instance

    rng = np.random.default_rng(0)
    for n in (5, 7, 10):
        for kind in ("gauss", "clusters", "line", "tiny radii"):
            v, radii_sq = (jnp.asarray(a) for a in hard_instance(n, 1, kind, rng))
            _, info = proj.project(v, radii_sq, method="laplacian", max_iter=500)
            lam = np.asarray(info.state.lam)
            np.testing.assert_array_equal(lam, lam.T, err_msg=f"{n} {kind}")


def test_hard_cold_starts_converge_to_tight_tolerance():
    """A bounded slice of ``bench_projection``'s robustness table (every kind of
    :func:`hard_instance`, twice, float32, cold start, tol 1e-6, 500 iterations), vmapped:
    every projection converges. Where the dual is degenerate (p = 1 and 3, many more
    active pairs than the Hessian's rank) undamped Newton steps needed many halvings and
    17 of these 42 missed tol (``results/bench/README.md``, robustness)."""
    from experiments.bench_projection import KINDS, hard_instance

    rng = np.random.default_rng(1)
    for n, p in ((16, 1), (23, 1), (24, 3)):
        inst = [hard_instance(n, p, kind, rng) for kind in KINDS for _ in range(2)]
        v, radii_sq = (jnp.asarray(np.stack(a)) for a in zip(*inst, strict=True))
        run = lambda a, b: proj.project(a, b, method="laplacian", max_iter=500)[1]  # noqa: E731
        info = jax.vmap(run)(v, radii_sq)
        missed = [KINDS[i // 2] for i in np.flatnonzero(~np.asarray(info.converged))]
        assert not missed, f"n = {n}, p = {p}: {missed}"
        # converged: delta <= tol S (one more float32 rounding in delta / S)
        assert np.asarray(info.rel_delta).max() <= DEFAULT_TOL * (1 + 2 * EPS32)


def test_newton_ascent_is_monotone_on_degenerate_duals():
    """The dual value never drops by more than its float resolution from one Newton
    iteration to the next (p = 1, cold start). A step that lost more used to be accepted
    where the first-order gain was below that resolution (also when negative): g fell by
    up to 1e7 resolutions and projections stalled. The margin is twice the resolution:
    the solver's first phase evaluates g through the Gram matrix, this test with exact
    differences."""
    from experiments.bench_projection import hard_instance
    from karula_jax.projection import certificate, laplacian, reduction
    from karula_jax.projection.contract import ProjectionState

    rng = np.random.default_rng(5)
    for n in (23, 30):
        v, radii_sq = (jnp.asarray(a) for a in hard_instance(n, 1, "gauss", rng))
        red = reduction.reduce_problem(v, radii_sq, rotate=False)
        warm = ProjectionState(jnp.zeros((n, n), jnp.float32), jnp.zeros((0, 1), jnp.float32))

        def value(k, red=red, warm=warm, terms=n * (n + 2)):
            lam = laplacian.solve(red, warm, tol=1e-6, max_iter=k).state.lam
            ev = certificate.dual_eval(lam, red, gram=False)
            # how far the solver's evaluations of g can differ from this one: its Gram
            # distances round by (p + 2) eps (|th_i|^2 + |th_j|^2) (reduction.sq_dists_gram),
            # weighted by lam / 4 in g; both evaluations' float32 sums (n^2 + 2 n p terms)
            sq = jnp.sum(ev.th * ev.th, axis=1)
            gram = 0.25 * (1 + 2) * EPS32 * jnp.sum(lam * (sq[:, None] + sq[None, :]))
            d2 = jnp.sum((ev.th[:, None] - ev.th[None]) ** 2, axis=-1)
            r2 = jnp.where(jnp.isfinite(red.radius), red.radius, 0.0) ** 2
            magnitude = 0.5 * jnp.sum((ev.th - red.w) ** 2) + 0.25 * jnp.sum(lam * (d2 + r2))
            return ev.g, gram + reordered_sum(terms) * magnitude

        g, differ = (np.asarray(a, np.float64) for a in jax.jit(jax.vmap(value))(jnp.arange(41)))
        # the solver accepts a step that loses at most its resolution 64 eps |g|
        # (laplacian.py), judged by its own evaluations of g, which differ from ours by up
        # to `differ` at each end
        resolution = 64 * EPS32 * np.abs(g[:-1])
        assert g[-1] > g[0]
        margin = resolution + 2 * (differ[:-1] + differ[1:])
        assert np.all(g[1:] >= g[:-1] - margin), np.max(g[:-1] - g[1:])


def test_line_search_passes_over_only_trials_that_cannot_pass(monkeypatch):
    """The Laplacian solver's line search skips, unevaluated, the trials whose first-order
    gain is below -64 eps |g| (g concave: none can pass). Evaluating every trial instead
    (``_PASS_OVER_HOPELESS`` off) takes the same iterations to the same answer, bit for
    bit, with more evaluations on a degenerate dual whose Newton steps clipping spoils
    (p = 1: 72 against 78, measured), and as many where none is spoilt."""
    from experiments.bench_floor import counting
    from experiments.bench_projection import hard_instance
    from karula_jax.projection import laplacian

    def run(v, radii_sq, pass_over):
        monkeypatch.setattr(laplacian, "_PASS_OVER_HOPELESS", pass_over)
        counts = collections.Counter()
        with counting(counts):
            th, info = jax.block_until_ready(
                proj.project(v, radii_sq, method="laplacian", tol=1e-6)
            )
        return np.asarray(th), int(info.iterations), counts["evaluations"]

    fewer = []
    for n, p, seed in [(30, 1, 5), (12, 2, 1)]:
        instance = hard_instance(n, p, "gauss", np.random.default_rng(seed))
        v, radii_sq = (jnp.asarray(a) for a in instance)
        th, iterations, evaluations = run(v, radii_sq, True)
        th_all, iterations_all, evaluations_all = run(v, radii_sq, False)
        assert iterations == iterations_all > 1
        np.testing.assert_array_equal(th, th_all)
        assert evaluations <= evaluations_all
        fewer.append(evaluations < evaluations_all)
    assert fewer == [True, False]


def test_refined_newton_step_solves_the_system_on_its_face(monkeypatch):
    """With exact CG, the refined step fixes at 0 every free pair that the first step took
    below 0, and on the pairs left free solves ``-H s + mu s = grad`` (``hvp`` is ``-H``)."""
    from karula_jax.projection import certificate, laplacian, pair_algebra, reduction

    monkeypatch.setattr(laplacian, "_CG_RTOL", 1e-13)
    v, radii_sq = _instance(3, 12, 4, "groups")
    rng = np.random.default_rng(4)
    with jax.enable_x64(True):
        red = reduction.reduce_problem(jnp.asarray(v), jnp.asarray(radii_sq), rotate=False)
        mask = np.asarray(certificate.dual_mask(red))
        lam = np.triu(rng.uniform(0, 0.3, size=(12, 12)) * (rng.uniform(size=(12, 12)) < 0.5), 1)
        lam = jnp.asarray(np.where(mask, lam + lam.T, 0.0))
        ev = certificate.dual_eval(lam, red, gram=False)
        steps = {}
        for refine in (0, 5):  # several passes, whatever the default
            monkeypatch.setattr(laplacian, "_REFINE", refine)
            steps[refine] = np.asarray(laplacian._direction(red, mask, lam, ev, True, 500)[0])
        lam = np.asarray(lam)
        crossed = mask & (lam + steps[0] < 0) & (steps[0] != -lam)
        assert crossed.any()  # the instance exercises the refinement
        s = steps[5]
        fixed = mask & (s == -lam)
        assert fixed[crossed].all()
        free = mask & ~fixed
        residual = np.asarray(ev.grad) - np.asarray(pair_algebra.hvp(ev, mask, jnp.asarray(s)))
        scale = np.abs(np.asarray(ev.grad)[mask]).max()
        # CG to 1e-13 of |grad| (patched); its recurrence drifts from the true residual by
        # the float64 rounding of its n^2-term products, compounded over its <= 500 steps
        # (reordered_sum(144, 500, EPS64) = 1.6e-11) times |H s| = O(|grad|) on these
        # multipliers: 1e-8 of |grad| covers both with a margin for |H| |s| > |H s|
        assert np.abs(residual[free]).max() <= 1e-8 * scale


def test_refinement_goes_on_while_clipping_spoils_the_step(monkeypatch):
    """A refined step that still takes free pairs below 0 can point downhill once clipped:
    its first-order gain along the projected path ``max(lam + s, 0) - lam`` is negative,
    and by concavity the full step cannot increase g. Then the step's face is refined
    again (up to ``_REFINE_SPOILED`` passes in all), which turns the gain positive here;
    a step that clipping leaves uphill keeps its one refinement (``_REFINE``) bit for bit,
    also where free pairs still cross 0."""
    from karula_jax.projection import certificate, laplacian, pair_algebra, reduction

    def steps(seed, n, p):
        v, radii_sq = _instance(seed, n, p, "groups")
        rng = np.random.default_rng(seed)
        red = reduction.reduce_problem(jnp.asarray(v), jnp.asarray(radii_sq), rotate=False)
        mask = np.asarray(certificate.dual_mask(red))
        lam = np.triu(rng.uniform(0, 1, size=(n, n)) * (rng.uniform(size=(n, n)) < 0.4), 1)
        lam = jnp.asarray(np.where(mask, lam + lam.T, 0.0))
        ev = certificate.dual_eval(lam, red, gram=False)
        out = {}
        for passes in (0, laplacian._REFINE_SPOILED):
            monkeypatch.setattr(laplacian, "_REFINE_SPOILED", passes)
            s = laplacian._direction(red, mask, lam, ev, True, 10)[0]
            gain = pair_algebra.pair_dot(ev.grad, jnp.maximum(lam + s, 0.0) - lam)
            out[passes] = np.asarray(s), float(gain)
        crossing = mask & (np.asarray(lam) + out[0][0] < 0) & (out[0][0] != -np.asarray(lam))
        assert crossing.any()  # after one refinement free pairs still cross 0
        return out

    assert laplacian._REFINE_SPOILED > laplacian._REFINE
    with jax.enable_x64(True):  # the gains' signs, not float32 rounding of them
        spoiled = steps(2, 16, 2)  # instances found by a search over random multipliers
        uphill = steps(3, 8, 2)
    (once, gain_once), (again, gain_again) = spoiled.values()
    # measured -125 and 16.6 (float64): the signs are far from rounding
    assert gain_once < 0 < gain_again and not np.array_equal(once, again)
    (once, gain_once), (again, _) = uphill.values()
    assert gain_once > 0  # measured 27.6
    np.testing.assert_array_equal(once, again)


_V3 = jnp.array([[0.0, 0.0], [3.0, 0.0], [0.0, 4.0]])
_R3 = jnp.array([[0.0, 1.0, 1.0], [1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])


@pytest.mark.parametrize(
    "case, radii_sq",
    [
        ("NaN pair", _R3.at[0, 1].set(jnp.nan).at[1, 0].set(jnp.nan)),
        ("negative pair", _R3.at[0, 1].set(-1.0).at[1, 0].set(-1.0)),
        ("inf facing a finite radius", _R3.at[0, 1].set(jnp.inf)),
    ],
)
@pytest.mark.parametrize("method", ["dykstra", "laplacian"])
def test_traced_radii_the_checks_refuse_are_never_certified(case, radii_sq, method):
    """Radii that raise when concrete, arriving traced (jit, or one member of a vmap), give
    NaN models and an unconverged report with a NaN gap; the other members are untouched."""
    with pytest.raises(ValueError, match="radii_sq"):
        proj.project(_V3, radii_sq, method=method)
    th, info = jax.jit(lambda r: proj.project(_V3, r, method=method))(radii_sq)
    assert np.isnan(np.asarray(th)).all(), case
    assert not bool(info.converged) and np.isnan(float(info.delta)), case
    batch = jnp.stack([_R3, radii_sq, 2.0 * _R3])
    th_b, info_b = jax.vmap(lambda r: proj.project(_V3, r, method=method))(batch)
    assert np.asarray(info_b.converged).tolist() == [True, False, True], case
    v, scale = np.asarray(_V3, np.float64), _scale(_V3)
    for k, r in ((0, _R3), (2, 2.0 * _R3)):
        alone, info = proj.project(_V3, r, method=method)
        member = jax.tree.map(lambda a, k=k: a[k], info_b)
        # both certified: each within its distance of the projection
        atol = _distance(member, v, th_b[k], scale) + _distance(info, v, alone, scale)
        np.testing.assert_allclose(th_b[k], alone, rtol=0, atol=atol)


def test_traced_valid_radii_and_options_stay_certified():
    """No false alarm: inf facing inf, a relative asymmetry below 1e-6, a zero radius, a
    NaN or inf diagonal (ignored) and a traced tol in range give the concrete call's
    answer; a larger finite asymmetry (t * D of a D symmetric to karula's 1e-5) is solved
    with the smaller radius, as the concrete call on the symmetrized radii."""
    r = _R3.at[0, 2].set(jnp.inf).at[2, 0].set(jnp.inf).at[1, 2].set(0.0).at[2, 1].set(0.0)
    r = r.at[0, 1].set(1.0 + 1e-7)
    want, info_want = proj.project(_V3, r, method="laplacian")
    run = jax.jit(lambda r, t: proj.project(_V3, r, method="laplacian", tol=t))
    v, scale = np.asarray(_V3, np.float64), _scale(_V3)
    # the same problem solved twice: each answer within its certified distance
    atol = lambda info, th, ref, info_ref: (  # noqa: E731
        _distance(info, v, th, scale) + _distance(info_ref, v, ref, scale)
    )
    for radii in (r, r.at[2, 2].set(jnp.nan).at[0, 0].set(jnp.inf)):
        th, info = run(radii, 1e-6)
        assert bool(info.converged)
        np.testing.assert_allclose(th, want, rtol=0, atol=atol(info, th, want, info_want))
    th, info = proj.project(_V3, r.at[2, 2].set(jnp.nan), method="laplacian")  # eager too
    np.testing.assert_allclose(th, want, rtol=0, atol=atol(info, th, want, info_want))
    lopsided = _R3.at[0, 1].set(1.0 + 1e-4)
    th, info = run(lopsided, 1e-6)
    assert bool(info.converged)
    ref, info_ref = proj.project(_V3, _R3, method="laplacian")
    np.testing.assert_allclose(th, ref, rtol=0, atol=atol(info, th, ref, info_ref))


def test_traced_bad_tol_or_shared_leaf_are_never_certified():
    """A traced tol <= 0 or NaN, or a NaN in a shared leaf: NaN in every floating leaf and
    an unconverged report (the eager checks raise for these)."""
    run = jax.jit(lambda t: proj.project(_V3, _R3, method="laplacian", tol=t))
    for tol in (-1.0, 0.0, float("nan")):
        th, info = run(tol)
        assert np.isnan(np.asarray(th)).all() and not bool(info.converged), tol
    tree = {"a": _V3, "s": jnp.array([[1.0], [jnp.nan], [2.0]])}
    mask = {"a": True, "s": False}
    with pytest.raises(ValueError, match="NaN or inf"):
        proj.project(tree, _R3, personalized=mask)
    out, info = jax.jit(lambda t: proj.project(t, _R3, personalized=mask))(tree)
    assert np.isnan(np.asarray(out["s"])).all() and np.isnan(np.asarray(out["a"])).all()
    assert not bool(info.converged) and np.isnan(float(info.delta))


@pytest.mark.parametrize("method", ["dykstra", "laplacian"])
def test_non_finite_warm_start_is_refused_or_read_as_cold(method):
    """A concrete warm start with NaN/inf is refused naming it; a traced one starts cold
    where it is not finite, with the cold start's answer."""
    state = proj.project(_V3, _R3, method=method)[1].state
    bad = jax.tree.map(lambda a: jnp.full(a.shape, jnp.nan, a.dtype), state)
    with pytest.raises(ValueError, match="warm_start.lam contains NaN"):
        proj.project(_V3, _R3, method=method, warm_start=bad)
    run = jax.jit(lambda ws: proj.project(_V3, _R3, method=method, warm_start=ws))
    th, info = run(bad)
    cold, _ = run(jax.tree.map(jnp.zeros_like, state))
    assert bool(info.converged)
    np.testing.assert_array_equal(th, cold)


@pytest.mark.parametrize("radius_sq", [1e-14, 1e-20])
def test_dykstra_certificate_stays_finite_below_float_resolution(radius_sq):
    """Radii far below float32's resolution of the data: Dykstra's multipliers, read off its
    increments, once made M + L singular in float32 and the certificate NaN. Capped, the
    gap is a finite upper bound on the true one (the optimum is the mean to within the
    radii), and the point is feasible to float32's resolution."""
    v = jnp.array([[0.0, 0.0], [0.0, 0.3], [5.0, 0.0], [0.0, 5.0]])
    th, info = proj.project(v, jnp.full((4, 4), radius_sq), method="dykstra")
    assert np.isfinite(float(info.delta)) and np.isfinite(float(info.rel_delta))
    vv, tt = np.asarray(v, np.float64), np.asarray(th, np.float64)
    mean = vv.mean(0)
    true_gap = 0.5 * np.sum((tt - vv) ** 2) - 0.5 * np.sum((mean - vv) ** 2)
    # up to the float32 gap's rounding; feasible up to the output's rounding
    assert float(info.delta) >= true_gap - _objective_rounding(vv, tt, _scale(vv), EPS32)
    assert float(info.max_violation) <= _rounding_violation(tt, EPS32)
