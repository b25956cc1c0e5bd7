"""The Newton ascent with its Newton systems formed and factorized (``laplacian_direct``).

Its accuracy against cvxpy runs in tests/test_projection*.py with every other solver; here:
the formed pair Hessian is the operator CG multiplies by, the direct step solves its
system, and where the free pairs exceed the cap the solver is the CG one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerances import EPS32, reordered_sum

from karula_jax import projection as proj
from karula_jax.projection import certificate, laplacian, pair_algebra, reduction


def _problem(seed, n, p, c=0.05):
    """A reduced problem with multipliers on about half of the pairs."""
    rng = np.random.default_rng(seed)
    v = rng.normal(size=(n, p)).astype(np.float32)
    d = rng.uniform(0.5, 1.5, size=(n, n))
    radii_sq = np.float32(c * p) * np.minimum(d, d.T).astype(np.float32)
    np.fill_diagonal(radii_sq, 0.0)
    red = reduction.reduce_problem(jnp.asarray(v), jnp.asarray(radii_sq), rotate=p >= 2 * n)
    mask = certificate.dual_mask(red)
    lam = np.abs(rng.normal(size=(n, n))) * (rng.uniform(size=(n, n)) < 0.5)
    lam = pair_algebra.symmetric(jnp.where(mask, jnp.asarray(lam, jnp.float32), 0.0))
    return v, radii_sq, red, mask, certificate.dual_eval(lam, red, gram=True)


def _operator_columns(ev, mask, n):
    """The Hessian-vector product's matrix over the pairs ``i < j``, column by column."""
    iu, ju = np.triu_indices(n, 1)
    units = np.zeros((len(iu), n, n), np.float32)
    units[np.arange(len(iu)), iu, ju] = units[np.arange(len(iu)), ju, iu] = 1.0
    products = jax.vmap(lambda x: pair_algebra.hvp(ev, mask, x))(jnp.asarray(units))
    return np.asarray(products)[:, iu, ju].T, iu, ju


@pytest.mark.parametrize("n,p", [(2, 1), (5, 3), (8, 30), (13, 4), (16, 2)])
def test_formed_pair_hessian_is_the_hessian_vector_product(n, p):
    # every product path of hvp (the Gram one, and the factor one where 3k < 2n)
    _, _, red, mask, ev = _problem(n, n, p)
    want, iu, ju = _operator_columns(ev, mask, n)
    i, j = jnp.asarray(iu), jnp.asarray(ju)
    got = np.asarray(laplacian.pair_hessian(ev.a_inv, i, j) * laplacian.pair_hessian(ev.gram, i, j))
    # each entry: two sums of n products (the operator's) against four gathers and a
    # product (the formed one), relative to the entries' largest magnitude
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= reordered_sum(4 * n + 8) * scale
    assert np.allclose(got, got.T, rtol=0, atol=reordered_sum(8) * scale)


@pytest.mark.parametrize("n,p", [(6, 4), (11, 20)])
def test_direct_step_solves_the_damped_system_on_the_free_pairs(n, p):
    _, _, red, mask, ev = _problem(n + 100, n, p)
    rng = np.random.default_rng(n)
    free = mask & jnp.asarray(np.triu(rng.uniform(size=(n, n)) < 0.6, 1))
    free = free | free.T
    rhs = jnp.where(
        free, pair_algebra.symmetric(jnp.asarray(rng.normal(size=(n, n)), jnp.float32)), 0.0
    )
    mu = jnp.float32(1e-3)
    cap = n * (n - 1) // 2
    step, ok = laplacian._pair_newton_step(ev, free, rhs, mu, cap)
    assert bool(ok)
    step = np.asarray(step)
    assert np.array_equal(step, step.T) and np.all(step[~np.asarray(free)] == 0)
    # (H_FF + mu I) s = rhs on the free pairs, up to the ridge the step adds and the
    # solve's rounding (condition number times a few eps)
    h, iu, ju = _operator_columns(ev, mask, n)
    on = np.asarray(free)[iu, ju]
    h_ff = h[np.ix_(on, on)] + float(mu) * np.eye(on.sum())
    s_f, b_f = step[iu, ju][on], np.asarray(rhs)[iu, ju][on]
    ridge = laplacian._DIRECT_RIDGE * EPS32 * np.abs(np.diag(h[np.ix_(on, on)])).max()
    kappa = np.linalg.cond(h_ff)
    bound = (ridge * np.linalg.norm(s_f)) + reordered_sum(
        3 * on.sum() + 2
    ) * kappa * np.linalg.norm(b_f)
    assert np.linalg.norm(h_ff @ s_f - b_f) <= bound
    # more free pairs than the cap: not ok (the caller takes CG)
    _, ok = laplacian._pair_newton_step(ev, free, rhs, mu, int(on.sum()) - 1)
    assert not bool(ok)


def test_over_the_cap_it_is_the_cg_solver(monkeypatch):
    # a cap of one pair a client: every Newton system falls back to CG, so the iterations
    # and the answer are the CG solver's (k = 12 of n = 14: not low_rank, so the direct
    # path is compiled and reached)
    rng = np.random.default_rng(3)
    n, p = 14, 12
    v = jnp.asarray(rng.normal(size=(n, p)), jnp.float32)
    radii_sq = jnp.full((n, n), 0.004 * p, jnp.float32) * (1 - jnp.eye(n))
    monkeypatch.setattr(laplacian, "_DIRECT_PAIRS_PER_CLIENT", 1)
    jax.clear_caches()
    try:
        th_d, info_d = proj.project(v, radii_sq, method="laplacian_direct", tol=1e-6)
        th_c, info_c = proj.project(v, radii_sq, method="laplacian", tol=1e-6)
    finally:
        jax.clear_caches()
    assert float(jnp.mean(info_c.state.lam > 0)) > 2.0 / n  # more pairs than the cap
    assert int(info_d.iterations) == int(info_c.iterations) and bool(info_d.converged)
    np.testing.assert_array_equal(np.asarray(th_d), np.asarray(th_c))


def test_within_the_cap_no_step_is_taken_by_cg(monkeypatch):
    # CG poisoned (NaN steps; its branch is still compiled): the direct solver takes the
    # same iterations to the same answer as unpoisoned on instances whose free pairs fit
    # the cap, so no step came from CG; the CG solver's own path does change (its line
    # search falls back to the diagonal step: 58 against 14 iterations, measured), shown
    # on the first instance (each run of a solver on an instance is a compile)
    rng = np.random.default_rng(5)
    cases = []
    for n, p in [(7, 6), (20, 40)]:  # k = 6 and 20: not low_rank, the direct path runs
        v = jnp.asarray(rng.normal(size=(n, p)), jnp.float32)
        d = rng.uniform(0.5, 1.5, size=(n, n))
        cases.append((v, jnp.asarray(0.01 * p * np.minimum(d, d.T) * (1 - np.eye(n)), jnp.float32)))

    def run(method, cases=cases):
        jax.clear_caches()
        return [proj.project(v, r2, method=method, tol=1e-6) for v, r2 in cases]

    clean_direct, clean_cg = run("laplacian_direct"), run("laplacian", cases[:1])
    monkeypatch.setattr(laplacian, "_pcg", lambda op, b, pre, *a, **k: jnp.full_like(pre, jnp.nan))
    try:
        poisoned_direct, poisoned_cg = run("laplacian_direct"), run("laplacian", cases[:1])
    finally:
        jax.clear_caches()
    for (th, info), (th_p, info_p) in zip(clean_direct, poisoned_direct, strict=True):
        assert bool(info.converged) and int(info.iterations) > 1
        assert int(info_p.iterations) == int(info.iterations)
        # the same path; the poisoned branch changes XLA's fusions, so the rounding of
        # the ~15 iterations' sums (n terms each) differs: a few eps of the largest entry
        th = np.asarray(th)
        atol = reordered_sum(th.shape[0], rounds=15) * np.abs(th).max()
        np.testing.assert_allclose(np.asarray(th_p), th, rtol=0, atol=atol)
    pairs = zip(clean_cg, poisoned_cg, strict=True)
    assert all(int(a[1].iterations) != int(b[1].iterations) for a, b in pairs)


@pytest.mark.parametrize("n,p", [(8, 1), (12, 1), (12, 3), (15, 9)])
def test_where_the_models_span_few_dimensions_it_is_the_cg_solver(n, p):
    # low_rank (3k < 2n): the direct solver runs CG throughout, the same iterations to the
    # same answer, bit for bit (the same program)
    rng = np.random.default_rng(n + p)
    v = jnp.asarray(rng.normal(size=(n, p)), jnp.float32)
    d = rng.uniform(0.5, 1.5, size=(n, n))
    radii_sq = jnp.asarray(0.01 * p * np.minimum(d, d.T) * (1 - np.eye(n)), jnp.float32)
    th_d, info_d = proj.project(v, radii_sq, method="laplacian_direct", tol=1e-6)
    th_c, info_c = proj.project(v, radii_sq, method="laplacian", tol=1e-6)
    assert int(info_c.iterations) > 0 and bool(info_d.converged)
    assert int(info_d.iterations) == int(info_c.iterations)
    np.testing.assert_array_equal(np.asarray(th_d), np.asarray(th_c))


@pytest.mark.parametrize("n", [8, 12])
def test_singular_pair_hessian_gives_an_ascent_step_or_cg(n):
    # p = 1: many more free pairs than the pair Hessian's rank, and the solver's own tiny
    # mu (eps times the largest diagonal): the formed system is singular up to its ridge.
    # A step the direct solve accepts ascends (x . b > 0). (The solver itself takes CG
    # there, p = 1 being low_rank: the test above.)
    _, _, red, mask, ev = _problem(n + 200, n, 1, c=0.01)
    free = mask
    rhs = jnp.where(free, pair_algebra.symmetric(ev.grad), 0.0)
    da = jnp.diag(ev.a_inv)
    d2 = 2.0 * ev.grad + jnp.where(mask, red.radius, 0.0) ** 2
    hdiag = jnp.where(mask, (da[:, None] + da[None, :] - 2.0 * ev.a_inv) * d2, 0.0)
    mu = EPS32 * jnp.max(hdiag)
    step, ok = laplacian._pair_newton_step(ev, free, rhs, mu, n * (n - 1) // 2)
    assert not bool(ok) or float(pair_algebra.pair_dot(step, rhs)) > 0
    assert np.all(np.isfinite(np.asarray(step))) or not bool(ok)
