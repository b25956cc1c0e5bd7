"""Tests of karula_jax.projection against cvxpy (Clarabel) and closed forms.

Accuracy claims are checked in float64 (``jax.enable_x64``), where the certificate is
exact to ~1e-13 of the problem scale; float32 tests check the default path with
tolerances that float32 can honestly reach.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _projection_reference import cvxpy_projection

from karula_jax import projection as proj
from karula_jax.projection import api as proj_api

SOLVERS = ("dykstra", "laplacian")


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


@pytest.mark.parametrize("kind", ["groups", "uneven", "zeros"])
@pytest.mark.parametrize("method", SOLVERS)
def test_matches_cvxpy_float64(method, kind):
    v, radii_sq = _instance(1, 8, 5, kind)
    ref, ref_val = cvxpy_projection(v, radii_sq)
    with jax.enable_x64(True):
        th, info = proj.project(
            jnp.asarray(v), jnp.asarray(radii_sq), method=method, tol=1e-12, max_iter=20000
        )
        th = np.asarray(th)
    assert th.dtype == np.float64 and bool(info.converged)
    np.testing.assert_allclose(th, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    scale = 0.5 * np.sum((v - v.mean(0)) ** 2)
    subopt = _objective(th, v) - ref_val
    # delta certifies the suboptimality (up to cvxpy's own accuracy, ~1e-9 of the scale)
    assert float(info.delta) >= subopt - 2e-9 * scale
    assert float(info.delta) <= 1e-12 * scale * 1.001
    assert _max_violation(th, radii_sq) <= 1e-12 * np.sqrt(np.nanmax(radii_sq))
    assert float(info.max_violation) <= 1e-12 * np.sqrt(np.nanmax(radii_sq))


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
    ref, _ = cvxpy_projection(v[0].astype(np.float64), np.zeros((n, n)))
    th_b, info_b = jax.vmap(lambda a: proj.project(a, radii_sq))(jnp.asarray(v))
    assert np.all(np.asarray(info_b.iterations) == 0)
    for b in range(len(v)):
        th, info = proj.project(jnp.asarray(v[b]), radii_sq)
        th = np.asarray(th)
        assert np.all(th == th[0]), "rows must be equal to the bit"
        atol = 1e-6 * np.abs(v[b]).max()
        np.testing.assert_allclose(th[0], v[b].mean(0), rtol=1e-5, atol=atol)
        assert int(info.iterations) == 0 and float(info.delta) == 0.0
        assert float(info.max_violation) == 0.0 and bool(info.converged)
        np.testing.assert_array_equal(np.asarray(th_b[b]), th)
    np.testing.assert_allclose(np.asarray(th_b[0]), ref, atol=1e-5 * np.abs(ref).max())


def test_p_larger_than_n_and_solvers_agree_float64():
    # p > n exercises the rotation onto the span of the models.
    v, radii_sq = _instance(3, 6, 40, "groups")
    ref, ref_val = cvxpy_projection(v, radii_sq)
    with jax.enable_x64(True):
        outs = [
            proj.project(jnp.asarray(v), jnp.asarray(radii_sq), method=m, tol=1e-12, max_iter=20000)
            for m in SOLVERS
        ]
    (th_d, info_d), (th_l, info_l) = outs
    np.testing.assert_allclose(th_d, th_l, atol=1e-6 * np.abs(ref).max())
    np.testing.assert_allclose(th_l, ref, atol=1e-5 * np.abs(ref).max())
    assert bool(info_d.converged) and bool(info_l.converged)


@pytest.mark.parametrize("method", SOLVERS)
def test_float32_default_path(method):
    v, radii_sq = _instance(4, 8, 5, "groups")
    ref, ref_val = cvxpy_projection(v, radii_sq)
    th, info = proj.project(
        jnp.asarray(v, jnp.float32), jnp.asarray(radii_sq, jnp.float32), max_iter=5000
    )
    scale = 0.5 * np.sum((v - v.mean(0)) ** 2)
    assert bool(info.converged) and float(info.rel_delta) <= 1e-6
    # float32: the certificate itself is exact only to a few 1e-7 of the scale
    subopt = _objective(th, v) - ref_val
    assert float(info.delta) >= subopt - 1e-6 * scale
    assert subopt <= 2e-6 * scale
    np.testing.assert_allclose(th, ref, atol=1e-3 * np.abs(ref).max())
    rmax = np.sqrt(radii_sq.max())
    assert float(info.rel_violation) <= 1e-6
    assert _max_violation(th, radii_sq) <= 1e-6 * rmax


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
    _, ref_val = cvxpy_projection(v, radii_sq, tol=1e-11)
    scale = 0.5 * np.sum((v - v.mean(0)) ** 2)
    dtype = jnp.float64 if x64 else jnp.float32
    rtol = 1e-9 if x64 else 1e-3  # float32: F(theta) rounds to ~1e-7 S, gaps >= 1e-3 S
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
                subopt = obj - ref_val
                delta = float(info.delta)
                where = (method, max_iter, delta / scale, subopt / scale)
                assert subopt > 1e-4 * scale, where  # genuinely truncated
                assert subopt <= delta <= looseness[method] * subopt, where
                gap = obj - _dual_value(info.state.lam, v, radii_sq)
                np.testing.assert_allclose(delta, gap, rtol=rtol, err_msg=str(where))
                np.testing.assert_allclose(float(info.rel_delta), delta / scale, rtol=1e-5)
                assert _max_violation(th, radii_sq) <= (1e-12 if x64 else 1e-6) * np.sqrt(
                    radii_sq.max()
                )
        # The multipliers behind the certificate are a dual point (>= 0, symmetric, zero
        # diagonal) after any number of iterations, the first included: there a Dykstra
        # multiplier that is not clipped at 0 is negative, and g(lam) bounds nothing.
        for method in ("dykstra", "laplacian"):
            for max_iter in (1, 2):
                lam = np.asarray(truncated(method, max_iter)[1].state.lam, np.float64)
                assert lam.min() >= 0, (method, max_iter, lam.min())
                np.testing.assert_allclose(lam, lam.T, rtol=1e-6, atol=0)
                assert np.all(np.diag(lam) == 0) and lam.max() > 0


@pytest.mark.parametrize("method", SOLVERS)
def test_t_zero_collapses_to_mean_and_inf_is_identity(method):
    v, _ = _instance(0, 8, 5)
    vj = jnp.asarray(v, jnp.float32)
    th, info = proj.project(vj, jnp.zeros((8, 8)), method=method)
    np.testing.assert_allclose(th, np.broadcast_to(v.mean(0), v.shape), atol=1e-5)
    assert float(info.max_violation) == 0.0 and bool(info.converged)
    th, info = proj.project(vj, jnp.full((8, 8), jnp.inf), method=method)
    np.testing.assert_array_equal(th, vj)
    assert int(info.iterations) == 0 and bool(info.converged)
    # huge finite radii: nothing moves either
    th, info = proj.project(vj, jnp.full((8, 8), 1e30), method=method)
    np.testing.assert_allclose(th, v, atol=1e-5)


def test_pair_kernel_closed_form():
    a, b = jnp.array([3.0, 0.0]), jnp.array([-1.0, 0.0])
    a2, b2 = proj.pair_kernel(a, b, 2.0)
    # one assertion per end: ``assert_allclose`` returns None, so chaining two with
    # ``and`` never ran the second (a kernel that left ``b`` in place passed)
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
        th, _ = proj.project(tree, jnp.asarray(radii_sq), personalized=mask, tol=1e-12)
        # all leaves personalized: one joint norm over both leaves
        split = {"w": jnp.asarray(v[:, :3].reshape(8, 3, 1)), "b": jnp.asarray(v[:, 3:])}
        both, _ = proj.project(split, jnp.asarray(radii_sq), method="laplacian", tol=1e-12)
    ref, _ = cvxpy_projection(v, radii_sq)
    np.testing.assert_allclose(th["b"], np.broadcast_to(shared.mean(0), (8, 2)), atol=1e-12)
    np.testing.assert_allclose(th["w"], ref, atol=1e-5 * np.abs(ref).max())
    joint = np.concatenate([np.asarray(both["w"]).reshape(8, 3), both["b"]], axis=1)
    np.testing.assert_allclose(joint, ref, atol=1e-5 * np.abs(ref).max())


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
    np.testing.assert_allclose(warm, cold, atol=1e-5 * np.abs(cold).max())


@pytest.mark.parametrize("method", SOLVERS)
def test_warm_started_training_run_matches_cold_solves(method):
    # Projected gradient steps toward each client's own optimum (a training run whose
    # constraints bind every step): each projection warm-started from the last one's
    # state must meet the tolerance and land where a cold solve does. 1/2||theta - v||^2
    # is 1-strongly convex, so a feasible point with certified gap delta lies within
    # sqrt(2 delta) of the projection: the two answers are within the sum of those radii.
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
        gap = np.sqrt(2 * float(info.delta)) + np.sqrt(2 * float(info_c.delta))
        scale = np.sqrt(2 * float(info.delta / jnp.maximum(info.rel_delta, 1e-30)))
        dist = float(jnp.linalg.norm(theta - theta_c))
        assert dist <= gap + 1e-4 * scale, (dist, gap)
        assert float(info.rel_violation) <= 1e-5
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
        return info.state, (th, info.iterations)

    shifts = 0.01 * jnp.arange(3.0)[:, None, None] * jnp.ones((3, 8, 5))
    _, (ths, its) = jax.jit(lambda s: jax.lax.scan(step, s, shifts))(state0)
    direct, _ = proj.project(vj + shifts[2], rj, max_iter=5000)
    # both certified to delta <= 1e-6 S, hence within sqrt(2e-6 S) of the projection
    np.testing.assert_allclose(ths[2], direct, atol=1e-3)
    assert int(its[2]) <= int(its[0])

    # vmapped over a batch of problems with traced radii
    batch = jnp.stack([vj, 2.0 * vj])
    ths, infos = jax.vmap(lambda x, r: proj.project(x, r, method="laplacian"))(
        batch, jnp.stack([rj, 4.0 * rj])
    )
    np.testing.assert_allclose(ths[1], 2.0 * ths[0], rtol=1e-4, atol=1e-4)
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
    monkeypatch.setattr(proj_api, "_in_turn_here", lambda: in_turn)
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
    for k in range(len(members)):
        th, info = solve_one(vs[k], rs[k])
        np.testing.assert_allclose(th_b[k], th, rtol=1e-5, atol=1e-5, err_msg=str(k))
        assert int(info_b.iterations[k]) == int(info.iterations), k
        assert bool(info_b.converged[k]) == bool(info.converged), k
    # the screens answered members 0 and 1; 3 and 4 were cut off at the cap
    np.testing.assert_array_equal(info_b.iterations[:2], 0)
    np.testing.assert_array_equal(info_b.iterations[3:], cap)
    np.testing.assert_array_equal(info_b.converged, [True, True, True, False, False])
    pairs = lambda a: a[1:].reshape(2, 2, *a.shape[1:])
    th_n, info_n = jax.jit(jax.vmap(jax.vmap(solve)))(pairs(vs), pairs(rs))
    # (members 3 and 4 stop at the cap, where the batch layout's rounding shows: 4e-5)
    np.testing.assert_allclose(th_n.reshape(th_b[1:].shape), th_b[1:], rtol=1e-4, atol=1e-4)
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
    assert _max_violation(th, np.ones((3, 3))) <= 1e-6
    np.testing.assert_allclose(np.asarray(th).mean(), 10 / 3, rtol=1e-6)
    for dt in (jnp.float16, jnp.bfloat16):
        th, info = proj.project(v.astype(dt), radii_sq)
        assert th.dtype == dt and bool(info.converged)
        d = np.abs(np.asarray(th, np.float64)[:, None, 0] - np.asarray(th, np.float64)[None, :, 0])
        np.testing.assert_allclose(float(info.max_violation), max(d.max() - 1.0, 0.0), atol=1e-6)
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
        ref, _ = cvxpy_projection(v, radii_sq)
        th, info = proj.project(jnp.asarray(v), jnp.asarray(radii_sq), tol=1e-12)
    assert int(info.iterations) > 0 and bool(info.converged)
    np.testing.assert_allclose(th, ref, atol=1e-5 * np.abs(ref).max())


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
        ref, _ = cvxpy_projection(v, radii_sq)
        th, info = proj.project(jnp.asarray(v), jnp.asarray(radii_sq), tol=1e-12)
    assert int(info.iterations) > 0 and bool(info.converged)
    np.testing.assert_allclose(th, ref, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("n, p", [(2, 3), (9, 40)])
def test_shrink_toward_the_mean_is_certified(n, p):
    """A point just outside (every pair 1e-5 beyond its radius, as after a small move
    from the last round's projection) comes back shrunk toward its mean without a
    solver; its gap (float64, against cvxpy) and its violation bound (float32 and
    float64, against exact distances) hold."""
    rng = np.random.default_rng(n)
    v = rng.normal(size=(n, p)) + 3.0  # rows far from 0: rounding is relative to |v|
    d2 = ((v[:, None] - v[None]) ** 2).sum(-1)
    radii_sq = d2 / (1.0 + 1e-5) ** 2
    np.fill_diagonal(radii_sq, 0.0)
    ref, _ = cvxpy_projection(v, radii_sq)
    scale = 0.5 * np.sum((v - v.mean(0)) ** 2)
    for method in SOLVERS:
        for x64 in (True, False):
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
            assert int(info.iterations) == 0 and bool(info.converged), case
            assert not np.any(np.asarray(info.state.lam)), case
            assert 0 < float(info.rel_delta) <= 1e-6, case
            th = np.asarray(th, np.float64)
            assert _max_violation(th, radii_sq) <= float(info.max_violation) + 1e-15, case
            assert float(info.max_violation) <= 1e-5 * np.sqrt(radii_sq.max()), case
            np.testing.assert_allclose(th.mean(0), v.mean(0), atol=1e-5)
            if x64:  # the certificate: objective minus the optimum is at most delta
                gap = 0.5 * np.sum((th - v) ** 2) - 0.5 * np.sum((ref - v) ** 2)
                assert gap <= float(info.delta) + 1e-9 * scale, case


@pytest.mark.parametrize("n, p, tol_d", [(100, 4, 1e-5), (60, 130, 1e-7)])
def test_large_n_auto_matches_dykstra(n, p, tol_d):
    """Many clients: "auto" (the Laplacian dual after screening; rotated when p >= 2n)
    against the pair-copy Dykstra on the same instance, both certified in float64
    (Dykstra to 1e-5 at n = 100 and 1e-7 at n = 60, for time: at n = 150, 1e-9 takes it
    over 20,000 sweeps; "auto" to 1e-9 in both)."""
    assert proj.choose_method(n, p) == "laplacian"
    v, radii_sq = _instance(12, n, p, "uneven")
    radii_sq *= np.median(((v[:, None] - v[None]) ** 2).sum(-1)) / 10.0
    scale = 0.5 * np.sum((v - v.mean(0)) ** 2)
    rmax = np.sqrt(radii_sq.max())
    with jax.enable_x64(True):
        args = (jnp.asarray(v), jnp.asarray(radii_sq))
        outs = {
            "auto": proj.project(*args, tol=1e-9, max_iter=500),
            "dykstra": proj.project(*args, method="dykstra", tol=tol_d, max_iter=20000),
        }
    for m, (th, info) in outs.items():
        tol = 1e-9 if m == "auto" else tol_d
        assert bool(info.converged) and float(info.delta) <= tol * scale, m
        assert _max_violation(th, radii_sq) <= 1e-9 * rmax, m
    (th_a, info_a), (th_d, info_d) = outs["auto"], outs["dykstra"]
    # each within sqrt(2 delta) of the projection
    bound = np.sqrt(2 * float(info_a.delta)) + np.sqrt(2 * float(info_d.delta))
    assert np.linalg.norm(np.asarray(th_a) - np.asarray(th_d)) <= bound + 1e-9 * np.sqrt(scale)
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
    assert _max_violation(out, radii_sq) <= 1e-9 * np.sqrt(np.nanmax(radii_sq))
    _, ref_val = cvxpy_projection(v, radii_sq)
    subopt = _objective(out, v) - ref_val
    scale = 0.5 * np.sum((v - v.mean(0)) ** 2)
    assert float(info.delta) >= subopt - 1e-9 * scale  # the gap certifies
    assert float(info.delta) > 1e-3 and not bool(info.converged)  # a shrink is not optimal


def test_personalized_has_the_factories_meaning():
    """True (the default) constrains every leaf, False shares every leaf (its mean), a
    mask mixes them, None is refused as in every algorithm factory."""
    v = {"a": jnp.asarray([[0.0, 0.0], [4.0, 0.0], [0.0, 3.0]]), "b": jnp.arange(6.0).reshape(3, 2)}
    radii_sq = jnp.full((3, 3), 1.0)
    default, _ = proj.project(v, radii_sq)
    every, _ = proj.project(v, radii_sq, personalized={"a": True, "b": True})
    chex.assert_trees_all_close(default, every)
    shared, info = proj.project(v, radii_sq, personalized=False)
    mean = jax.tree.map(lambda x: jnp.broadcast_to(x.mean(0), x.shape), v)
    chex.assert_trees_all_close(shared, mean)
    assert int(info.iterations) == 0
    mixed, _ = proj.project(v, radii_sq, personalized={"a": True, "b": False})
    np.testing.assert_allclose(mixed["b"], mean["b"])
    assert _max_violation(mixed["a"], np.asarray(radii_sq)) <= 1e-5
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
        np.testing.assert_allclose(float(gap4), own - float(ev.g), rtol=1e-12)
        assert float(gap4) <= float(gap0)
        if n > 2:
            assert float(gap4) < 0.9 * float(gap0), (float(gap4), float(gap0))


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
    np.testing.assert_allclose(float(got.g), float(exact.g), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(got.th), np.asarray(fast.th))
    # the residual term itself, on a theta far from the Lagrangian's minimizer (numpy)
    th = fast.th + 0.05 * jnp.asarray(rng.normal(size=fast.th.shape), jnp.float32)
    got = certificate.certified(lam, fast._replace(th=th), red)
    mass, w, L = (np.asarray(a, np.float64) for a in (red.mass, red.w, lam))
    a = np.diag(mass + L.sum(1)) - L
    res = mass[:, None] * w - a @ np.asarray(th, np.float64)
    drop = 0.5 * np.sum(res * res)
    assert drop > 1e-3 * abs(float(fast.g))
    np.testing.assert_allclose(float(got.g), float(fast.g) - drop, rtol=1e-5)


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
        for start in (None, jnp.zeros(20), jnp.asarray(rng.normal(size=20)), jnp.asarray(want)):
            got = laplacian._pcg(
                lambda x: m @ x, b, jnp.diag(m), dot, rtol=1e-12, max_iter=200, start=start
            )
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-9, atol=1e-12)
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
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("n, p", [(7, 3), (12, 40), (31, 5)])
def test_newton_step_is_symmetric_to_the_bit(n, p):
    """Radii that differ by an ulp between ``(i, j)`` and ``(j, i)`` (the input check
    allows 1e-6, and skips traced input) become the smaller of the two, and every pair
    array of a Newton step is then symmetric to the bit: a step that is not can fix one
    side of a pair and not the other, and CG then solves another system."""
    from karula_jax.projection import certificate, laplacian, reduction

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
        hx = np.asarray(laplacian._hvp(ev, mask, x + x.T))
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
        assert np.asarray(info.rel_delta).max() <= 1e-6


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

        def value(k, red=red, warm=warm):
            lam = laplacian.solve(red, warm, tol=1e-6, max_iter=k).state.lam
            return certificate.dual_eval(lam, red, gram=False).g

        g = np.asarray(jax.jit(jax.vmap(value))(jnp.arange(41)), np.float64)
        resolution = 64 * np.finfo(np.float32).eps * np.abs(g[:-1])
        assert g[-1] > g[0]
        assert np.all(g[1:] >= g[:-1] - 2 * resolution), np.max(g[:-1] - g[1:])


def test_refined_newton_step_solves_the_system_on_its_face(monkeypatch):
    """With exact CG, the refined step fixes at 0 every free pair that the first step took
    below 0, and on the pairs left free solves ``-H s + mu s = grad`` (``_hvp`` is ``-H``)."""
    from karula_jax.projection import certificate, laplacian, reduction

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
        residual = np.asarray(ev.grad) - np.asarray(laplacian._hvp(ev, mask, jnp.asarray(s)))
        scale = np.abs(np.asarray(ev.grad)[mask]).max()
        assert np.abs(residual[free]).max() <= 1e-8 * scale


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
    for k, r in ((0, _R3), (2, 2.0 * _R3)):
        alone, _ = proj.project(_V3, r, method=method)
        np.testing.assert_allclose(th_b[k], alone, atol=1e-5)


def test_traced_valid_radii_and_options_stay_certified():
    """No false alarm: inf facing inf, a relative asymmetry below 1e-6, a zero radius, a
    NaN or inf diagonal (ignored) and a traced tol in range give the concrete call's
    answer; a larger finite asymmetry (t * D of a D symmetric to karula's 1e-5) is solved
    with the smaller radius, as the concrete call on the symmetrized radii."""
    r = _R3.at[0, 2].set(jnp.inf).at[2, 0].set(jnp.inf).at[1, 2].set(0.0).at[2, 1].set(0.0)
    r = r.at[0, 1].set(1.0 + 1e-7)
    want, _ = proj.project(_V3, r, method="laplacian")
    run = jax.jit(lambda r, t: proj.project(_V3, r, method="laplacian", tol=t))
    for radii in (r, r.at[2, 2].set(jnp.nan).at[0, 0].set(jnp.inf)):
        th, info = run(radii, 1e-6)
        assert bool(info.converged)
        np.testing.assert_allclose(th, want, atol=1e-6)
    th, _ = proj.project(_V3, r.at[2, 2].set(jnp.nan), method="laplacian")  # eager too
    np.testing.assert_allclose(th, want, atol=1e-6)
    lopsided = _R3.at[0, 1].set(1.0 + 1e-4)
    th, info = run(lopsided, 1e-6)
    assert bool(info.converged)
    np.testing.assert_allclose(th, proj.project(_V3, _R3, method="laplacian")[0], atol=1e-6)


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
    assert float(info.delta) >= true_gap - 1e-5
    assert float(info.max_violation) <= 1e-5
