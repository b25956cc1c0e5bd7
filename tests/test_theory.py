"""The paper's theory, checked numerically against independent references.

- Theorem 4.3 on ridge clients with partial participation: with the theorem's step
  ``3 / (8 L_max)``, exact gradients and tight projections, the seed-averaged
  ``min_{k<K} ||G_eta(theta^k)||^2`` stays under ``(8 L / 3)(f(theta^0) - f*) / K`` for
  every ``K`` (``f*`` from cvxpy, ``G_eta`` with a float64 projection); with minibatches
  it stays under the bound with the floor ``4 sigma^2 (s + 1) / s``, ``sigma^2`` from the
  closed-form variance of a minibatch drawn without replacement.
- The proof's average form (``theory.theorem_4_3_proof_bound``, constant ``64 L / 3``):
  ``(1/K) sum_{k<K} E ||G||^2 <= (64 L / 3)(f(theta^0) - E f(theta^K)) / K`` within 10x of
  what is measured at every ``K`` (exact gradients), so a constant wrong by 10x fails.
- Proposition 3.4: ``||theta_i* - theta_j*||^2 <= 2 L_X W1(P_i, P_j) / gamma`` for the
  local ridge optima, with W1 exact (POT's network simplex) and ``L_X``, ``gamma`` computed
  from the data.

Instances where the bounds are attained (the statement's ``8 L / 3`` failing, a missing
factor 2 in Proposition 3.4 failing, a non-convex MLP) are in ``test_theory_tight.py``.
"""

from __future__ import annotations

import cvxpy as cp
import jax
import jax.numpy as jnp
import numpy as np
import ot
import pytest
from _alg_problems import LAM, LOSS, alphas, problem, quadratics
from _tolerances import EPS64, reordered_sum

from karula_jax import theory
from karula_jax.algorithms import karula, lipschitz_ridge

ROUNDS = 200
SEEDS = 8
S = 3  # of n = 6: the theorem needs 2 <= s <= n - 1
# Clarabel's default tolerances (tol_gap_abs, tol_gap_rel, tol_feas): cvxpy's optimal value
# is within this much (absolute, and relative to it) of the true optimum
CLARABEL_TOL = 1e-8


def _radii(ds):
    """Squared radii under which several pairs bind at the optimum: a twentieth of the
    squared distances between the generating models (float32-exact, as Karula uses them)."""
    th = np.asarray(ds.theta_true, np.float64)
    d2 = ((th[:, None] - th[None]) ** 2).sum(-1)
    return np.asarray(np.float32(0.05) * d2.astype(np.float32), np.float64)


def _objective(data, theta) -> np.ndarray:
    """``f(theta) = (1/n) sum_i alpha_i f_i(theta_i)`` up to a constant (float64), theta
    ``[..., n, p]``."""
    A, b = quadratics(data)
    a = alphas(data)
    th = np.asarray(theta, np.float64)
    per_client = 0.5 * np.einsum("...ni,nij,...nj->...n", th, A, th) - np.einsum(
        "ni,...ni->...n", b, th
    )
    return (a * per_client).sum(-1) / len(a)


def _cvxpy_optimum(data, radii_sq) -> float:
    A, b = quadratics(data)
    a = alphas(data)
    n, p = b.shape
    W = cp.Variable((n, p))
    terms = [a[i] * (0.5 * cp.quad_form(W[i], A[i]) - b[i] @ W[i]) for i in range(n)]
    cons = [
        cp.sum_squares(W[i] - W[j]) <= radii_sq[i, j] for i in range(n) for j in range(i + 1, n)
    ]
    problem_ = cp.Problem(cp.Minimize(sum(terms) / n), cons)
    problem_.solve(solver=cp.CLARABEL)
    return float(problem_.value)


def _iterates(data, radii_sq, eta, batch_size, *, seeds=SEEDS, rounds=ROUNDS, cap=None):
    """Karula's iterates theta^0 .. theta^{K-1}, ``[seeds, K, n, p]`` float64; the
    projection certified to 1e-12 (``cap=None``), or to 1e-3 within ``cap`` iterations."""
    alg = karula(
        LOSS,
        jnp.asarray(radii_sq),
        t=1.0,
        learning_rate=eta,
        clients_per_round=S,
        batch_size=batch_size,
        projection_tol=1e-12 if cap is None else 1e-3,
        projection_max_iter=20000 if cap is None else cap,
    )
    p0 = jnp.zeros(data.x.shape[-1], jnp.float64)

    def one(key):
        state = alg.init(p0, data, key=key)

        def body(st, _):
            before = alg.client_params(st, data)
            st, info = alg.round(st, data)
            return st, (before, info.proj_delta, info.proj_converged)

        return jax.lax.scan(body, state, None, length=rounds)[1]

    keys = jax.random.split(jax.random.key(7), seeds)
    return jax.jit(jax.vmap(one))(keys)


_mapping_sq_norms = jax.jit(theory.gradient_mapping_sq_norms, static_argnums=0)


def _mapping_norms(data, theta, radii_sq, eta) -> np.ndarray:
    """``||G_eta(theta)||^2`` for every iterate, ``theta: [..., n, p]`` (float64)."""
    x, y = jnp.asarray(data.x, jnp.float64), jnp.asarray(data.y, jnp.float64)
    mask = jnp.arange(x.shape[1])[None, :] < jnp.asarray(data.counts)[:, None]
    args = (jnp.asarray(alphas(data)), jnp.asarray(radii_sq), jnp.float64(eta))
    sq, ok = _mapping_sq_norms(LOSS, jnp.asarray(theta), x, y, mask, *args)
    assert bool(jnp.all(ok))
    return np.asarray(sq)


def _minibatch_sigma_sq(data, theta, batch_size) -> float:
    """Assumption 4.2's ``sigma^2`` along the iterates: ``max_i E||G_i - alpha_i grad f_i||^2``.

    Closed form for a mean over ``B`` rows drawn without replacement from ``N``:
    ``(N - B) / (B (N - 1))`` times the population variance of the per-row gradients.
    """
    x = np.asarray(data.x, np.float64)
    y = np.asarray(data.y, np.float64)
    a = alphas(data)
    worst = 0.0
    for i, N in enumerate(np.asarray(data.counts)):
        th = np.asarray(theta, np.float64)[..., i, :].reshape(-1, x.shape[-1])
        resid = th @ x[i, :N].T - y[i, :N]  # [T, N]
        per_row = resid[..., None] * x[i, :N][None]  # [T, N, p] (the penalty is common)
        var = ((per_row - per_row.mean(1, keepdims=True)) ** 2).sum(-1).mean(1)
        B = min(batch_size, N)
        factor = (N - B) / (B * (N - 1)) if N > 1 else 0.0
        worst = max(worst, float(a[i] ** 2 * factor * var.max()))
    return worst


def _sigma_sq_rtol(data, theta) -> float:
    """Relative float32 error bound of the library's ``sigma^2`` at ``theta`` (float32 of
    the float64 ``theta``) against :func:`_minibatch_sigma_sq`: a per-row gradient ``r x +
    lam theta`` rounds by ``p + 4`` roundings of its magnitude ``M = (|x| |theta| + |y|)
    |x| + lam |theta|``, which moves the variance ``mean ||g - mean g||^2`` by at most ``4
    sqrt(var) max ||delta g||``; its sums over ``N`` rows add ``N + p`` roundings."""
    x, y = np.asarray(data.x, np.float64), np.asarray(data.y, np.float64)
    th = np.asarray(theta, np.float64)
    p = x.shape[-1]
    worst = 0.0
    for i, N in enumerate(np.asarray(data.counts)):
        xi, yi = x[i, :N], y[i, :N]
        g = (xi @ th[i] - yi)[:, None] * xi
        var = ((g - g.mean(0)) ** 2).sum(-1).mean()
        size = (np.abs(xi) @ np.abs(th[i]) + np.abs(yi))[:, None] * np.abs(xi)
        dg = reordered_sum(p + 4) / 2 * np.linalg.norm(size + LAM * np.abs(th[i]), axis=1).max()
        if var > 0:
            worst = max(worst, 4 * dg / np.sqrt(var) + reordered_sum(N + p))
    return worst


@pytest.fixture(scope="module")
def setting():
    data = problem().train
    radii_sq = _radii(problem())
    L = lipschitz_ridge(data, LAM, per_client=True)
    eta = float(theory.theorem_step(L))
    f_star = _cvxpy_optimum(data, radii_sq)
    return data, radii_sq, L, eta, f_star


@pytest.fixture(scope="module")
def exact_run(setting):
    """Iterates, certified deltas and mapping norms ``[seeds, K]`` with exact gradients
    and projections (shared by the tests that compare against it)."""
    data, radii_sq, L, eta, f_star = setting
    with jax.enable_x64(True):
        theta, deltas, converged = _iterates(data, radii_sq, eta, batch_size=64)
        assert bool(jnp.all(converged))
        return theta, deltas, _mapping_norms(data, theta, radii_sq, eta)


def test_theorem_4_3_exact_gradients_every_k(setting, exact_run):
    data, radii_sq, L, eta, f_star = setting
    theta, deltas, norms = exact_run
    f0 = float(_objective(data, np.zeros((6, 3))))
    gap0 = f0 - f_star
    assert gap0 > 0
    # the expectation over participation draws, estimated by the seed mean
    running_min = np.minimum.accumulate(norms.mean(0))
    K = np.arange(1, ROUNDS + 1)
    delta = float(np.max(theory.paper_delta(np.asarray(deltas), eta)))
    bound = np.asarray(theory.theorem_4_3_bound(L, gap0, K, delta=delta))
    assert np.all(running_min <= bound), np.flatnonzero(running_min > bound)[:5]
    # not vacuous: the mapping really falls (by a factor 5), and the bound is within two
    # orders of it (effect sizes of the theorem, not roundings: the run is in float64)
    assert running_min[-1] < 0.2 * running_min[0]
    assert bound[0] < 100 * running_min[0]
    # the iterates approach the constrained optimum (f above f* by little at the end: 5%
    # of the initial gap); below f* only by cvxpy's own tolerance (was 1e-9, below it;
    # the iterates are feasible, in float64)
    f_last = _objective(data, theta[:, -1]).mean()
    assert f_star - CLARABEL_TOL * (1 + abs(f_star)) <= f_last <= f_star + 0.05 * gap0
    # the constraints bind at the optimum: the problem is not an unconstrained one (a pair
    # within 10% of its radius counts as binding; more than a fifth of the pairs bind)
    final = np.asarray(theta[:, -1])
    d2 = ((final[:, :, None] - final[:, None]) ** 2).sum(-1)
    iu = np.triu_indices(6, 1)
    assert np.mean(d2[:, iu[0], iu[1]] >= 0.9 * radii_sq[iu]) > 0.2


def _average_form(data, theta, norms):
    """``(1/K) sum_{k<K} E ||G||^2`` and ``f(theta^0) - E f(theta^K)`` for ``K = 1 ..
    rounds - 1`` (seed means; ``theta`` holds ``theta^0 .. theta^{rounds-1}``)."""
    K = np.arange(1, theta.shape[1])
    avg = np.cumsum(norms.mean(0))[:-1] / K
    f = _objective(data, np.asarray(theta))
    return K, avg, f[:, 0].mean() - f[:, 1:].mean(0)


def test_theorem_4_3_proof_bound_within_ten_times_at_every_k(setting, exact_run):
    """The proof's telescoped inequality, ``(1/K) sum_{k<K} E||G||^2 <= (64 L / 3)
    (f(theta^0) - E f(theta^K)) / K``, holds at every ``K`` and is within 10x: measured
    0.120-0.126 of it. A gradient step at ``eta`` decreases ``f`` by about ``eta ||G||^2``,
    so the average is about ``(1 / eta)`` times the decrease per round, and ``64 L / 3 = 8 /
    eta``: a tenth of the constant (or any constant under ``6.4 L / 3``) fails."""
    data, radii_sq, L, eta, f_star = setting
    theta, deltas, norms = exact_run
    K, avg, decrease = _average_form(data, theta, norms)
    delta = float(np.max(theory.paper_delta(np.asarray(deltas), eta)))
    bound = np.asarray(theory.theorem_4_3_proof_bound(L, decrease, K, delta=delta))
    ratio = avg / bound
    # effect sizes, not roundings (float64): the ratio is 0.120-0.126 over K, with
    # margins of 20% to 0.1 and 8x to 1 for the error of the 8-draw seed mean
    assert np.all(ratio <= 1.0) and np.all(ratio > 0.1), (ratio.min(), ratio.max())


def test_theorem_4_3_floor_grows_with_minibatch_noise(setting, exact_run):
    data, radii_sq, L, eta, f_star = setting
    with jax.enable_x64(True):
        theta, deltas, _ = _iterates(data, radii_sq, eta, batch_size=2)
        norms = _mapping_norms(data, theta, radii_sq, eta)
    sigma_sq = _minibatch_sigma_sq(data, theta, 2)
    assert sigma_sq > 0
    # the library's sigma^2 (per-row gradients by autodiff) against the numpy closed form
    last = np.asarray(theta[0, -1])
    ours = theory.minibatch_sigma_sq(
        LOSS,
        jnp.asarray(last, jnp.float32),
        jnp.asarray(data.x),
        jnp.asarray(data.y),
        jnp.asarray(data.counts),
        jnp.asarray(alphas(data), jnp.float32),
        2,
    )
    want = _minibatch_sigma_sq(data, last, 2)
    np.testing.assert_allclose(float(ours), want, rtol=_sigma_sq_rtol(data, last))
    gap0 = float(_objective(data, np.zeros((6, 3)))) - f_star
    running_min = np.minimum.accumulate(norms.mean(0))
    K = np.arange(1, ROUNDS + 1)
    delta = float(np.max(theory.paper_delta(np.asarray(deltas), eta)))
    bound = np.asarray(theory.theorem_4_3_bound(L, gap0, K, sigma_sq=sigma_sq, s=S, delta=delta))
    assert np.all(running_min <= bound)
    # the proof's average form with its noise term 32 sigma^2 (s + 1) / s holds too
    Ka, avg, decrease = _average_form(data, theta, norms)
    proved = theory.theorem_4_3_proof_bound(L, decrease, Ka, sigma_sq=sigma_sq, s=S, delta=delta)
    assert np.all(avg <= np.asarray(proved))
    # the noise raises the floor: the last quarter's E||G||^2 is above the exact run's
    # (an effect size; both float64). Both bounds are far above it (the statement's
    # by 1,000x and more): their noise terms are not tested here, but in
    # test_theory_tight.py, where the statement's fails
    last = slice(-(ROUNDS // 4), None)
    exact = exact_run[2].mean(0)
    assert norms.mean(0)[last].mean() > 2 * exact[last].mean()


def test_theorem_4_3_floor_grows_with_the_projection_error(setting, exact_run):
    """Projections capped at one iteration: the bound with the measured delta holds at every
    K, delta is not negligible (some projections stop short), and the mapping's floor is
    above the exact-projection run's, as the ``2 delta`` term says."""
    data, radii_sq, L, eta, f_star = setting
    with jax.enable_x64(True):
        theta, deltas, converged = _iterates(data, radii_sq, eta, batch_size=64, cap=1)
        capped = _mapping_norms(data, theta, radii_sq, eta).mean(0)
    exact = exact_run[2].mean(0)
    assert not bool(jnp.all(converged))
    delta = float(np.max(theory.paper_delta(np.asarray(deltas), eta)))
    assert delta > 1e-6  # not negligible: a million times the exact run's certified 1e-12
    gap0 = float(_objective(data, np.zeros((6, 3)))) - f_star
    K = np.arange(1, ROUNDS + 1)
    bound = np.asarray(theory.theorem_4_3_bound(L, gap0, K, delta=delta))
    running_min = np.minimum.accumulate(capped)
    assert np.all(running_min <= bound), np.flatnonzero(running_min > bound)[:5]
    last = slice(-(ROUNDS // 4), None)
    assert capped[last].mean() > exact[last].mean()


def _ridge_optimum(A, b) -> np.ndarray:
    return np.linalg.solve(A, b)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_proposition_3_4_w1_bound_on_random_ridge(seed):
    """``||theta_i* - theta_j*||^2 <= 2 L_X W1(P_i, P_j) / gamma`` for every pair.

    ``f_i(theta) = E_{P_i} (x.theta - y)^2 / 2 + lam/2 ||theta||^2`` (empirical ``P_i``).
    Quadratic growth: ``gamma = min_i lambda_min(X_i^T X_i / N_i) + lam``. Data
    Lipschitz constant of ``l(theta, (x, y)) = (x.theta - y)^2 / 2`` on the ball
    ``||(x, y)|| <= R`` holding every sample, at the models the proof evaluates
    (``theta_i*``, ``theta_j*``): ``|grad_xi l| = |x.theta - y| ||(theta, -1)||
    <= R (||theta||^2 + 1)``. ``W1`` with the Euclidean ground cost on ``(x, y)``.
    """
    rng = np.random.default_rng(seed)
    n, p = 5, 3
    lam = 0.5
    centres = rng.normal(size=(n, p))
    xs, ys = [], []
    for i in range(n):
        N = int(rng.integers(8, 20))
        x = rng.normal(size=(N, p)) + 0.5 * rng.normal(size=(1, p))
        y = x @ centres[i] + 0.1 * rng.normal(size=N)
        xs.append(x)
        ys.append(y)
    A = [x.T @ x / len(x) + lam * np.eye(p) for x in xs]
    b = [x.T @ y / len(x) for x, y in zip(xs, ys, strict=True)]
    opt = np.stack([_ridge_optimum(Ai, bi) for Ai, bi in zip(A, b, strict=True)])
    gamma = min(np.linalg.eigvalsh(Ai)[0] for Ai in A)
    R = max(
        np.linalg.norm(np.column_stack([x, y]), axis=1).max() for x, y in zip(xs, ys, strict=True)
    )
    for i in range(n):
        for j in range(i + 1, n):
            zi, zj = np.column_stack([xs[i], ys[i]]), np.column_stack([xs[j], ys[j]])
            wi, wj = np.full(len(zi), 1 / len(zi)), np.full(len(zj), 1 / len(zj))
            w1 = ot.emd2(wi, wj, ot.dist(zi, zj, metric="euclidean"))
            L_X = R * (max(opt[i] @ opt[i], opt[j] @ opt[j]) + 1.0)
            lhs = float(((opt[i] - opt[j]) ** 2).sum())
            rhs = 2.0 * L_X * w1 / gamma
            assert lhs <= rhs, (i, j, lhs, rhs)
    # the bound is loose on ridge (L_X a worst case over the data ball): a missing factor 2
    # would pass here; test_theory_tight.py has an instance with equality, where it fails.
    # Here a W1 or a distance too large by more than the smallest ratio would fail.


def test_karula_theorem_step_is_three_eighths_over_weighted_max():
    """``learning_rate="theorem"`` is ``3 / (8 max_i alpha_i L_i)``, ``L_i`` from the data:
    n times smaller than ``3 / (8 L)`` with the product-space ``L``."""
    data = problem().train
    D = jnp.ones((6, 6)) - jnp.eye(6)
    alg = karula(LOSS, D, t=1.0, learning_rate="theorem", clients_per_round=S, batch_size=4)
    state = alg.init(jnp.zeros(3), data, key=jax.random.key(0))
    L_max = lipschitz_ridge(data, LAM, per_client=True)
    # the float32 step: L_max rounded, 8 L_max and the division (3 roundings)
    np.testing.assert_allclose(
        float(state.extra.learning_rate), 3 / (8 * L_max), rtol=reordered_sum(3)
    )
    # float64: max / (max / n), two roundings
    ratio = L_max / lipschitz_ridge(data, LAM)
    np.testing.assert_allclose(ratio, 6, rtol=reordered_sum(2, eps=EPS64))
    with pytest.raises(ValueError, match="learning_rate must be .* 'theorem'"):
        karula(LOSS, D, t=1.0, learning_rate="paper", clients_per_round=S, batch_size=4)


ZEROS = jnp.zeros((2, 1))


def test_theory_functions_refuse_arguments_outside_the_theorem():
    """A negative step or smoothness, rounds < 1, a negative gap, sigma^2 > 0 without s
    gave negative 'bounds' or raw Python errors; an array or traced sigma_sq works."""
    bad = [
        (lambda: theory.theorem_step(-1.0), "smoothness_max"),
        (lambda: theory.theorem_4_3_bound(1.0, 1.0, -5), "rounds"),
        (lambda: theory.theorem_4_3_bound(1.0, -1.0, 10), "initial_gap"),
        (lambda: theory.theorem_4_3_bound(1.0, 1.0, 10, sigma_sq=1.0), "s \\(participants"),
        (lambda: theory.theorem_4_3_bound(1.0, 1.0, 10, sigma_sq=-1.0, s=2), "sigma_sq"),
        (lambda: theory.paper_delta(0.1, 0.0), "eta"),
        (lambda: theory.gradient_mapping(ZEROS, ZEROS, jnp.ones((2, 2)), 0.0), "eta"),
    ]
    for call, name in bad:
        with pytest.raises(ValueError, match=name):
            call()
    with pytest.raises(ValueError, match="s must be >= 1"):
        theory.theorem_4_3_bound(1.0, 1.0, 10, sigma_sq=1.0, s=0)
    two = theory.theorem_4_3_bound(1.0, 1.0, 10, sigma_sq=jnp.array([0.0, 1.0]), s=2)
    # the bound's 8 float32 operations (of positive terms) against float64
    np.testing.assert_allclose(two, (8 / 3) * (0.1 + np.array([0.0, 6.0])), rtol=reordered_sum(8))
    jitted = jax.jit(lambda s2: theory.theorem_4_3_bound(1.0, 1.0, 10, sigma_sq=s2, s=2))(1.0)
    np.testing.assert_allclose(jitted, two[1], rtol=reordered_sum(8))  # compiled, and eager
