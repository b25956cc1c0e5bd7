"""The two ablations that use Karula's D differently: Laplacian penalty and clustered FedAvg.

References are float64 numpy closed forms on the ridge problems of ``_alg_problems``
(the penalized optimum solves one linear system; a group's FedAvg fixed point with one
local step is its weighted ridge fit) and scipy's average linkage.
"""

from __future__ import annotations

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _alg_problems import (
    DIM,
    LAM,
    LOSS,
    N_CLIENTS,
    alphas,
    fixed_point_error,
    gd_contraction,
    global_ridge,
    intercept_loss,
    problem,
    quadratics,
    round_rounding,
    scan_run,
    true_dissimilarity,
    zeros,
)
from _tolerances import EPS32, EPS64, reordered_sum
from jax.extend import core as jax_core
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.cluster.vq import kmeans2
from scipy.spatial.distance import squareform

from karula_jax.algorithms import (
    cluster_clients,
    clustered,
    clustered_fedavg,
    fedavg,
    graph_laplacian,
    graph_weights,
    karula,
    karula_learning_rate,
    laplacian_penalty,
)
from karula_jax.training import vmap_algorithm

FULL = 64
run = jax.jit(scan_run, static_argnums=(0, 4))


@pytest.fixture(autouse=True)
def _fresh_trace_counters():
    chex.clear_trace_counter()


def _weights64(D) -> np.ndarray:
    """The documented default: exp(-D / median of the off-diagonal D), zero diagonal."""
    D = np.asarray(D, np.float64)
    off = ~np.eye(len(D), dtype=bool)
    W = np.exp(-D / np.median(D[off]))
    return np.where(off, W, 0.0)


def _penalized_system(data, D, mu):
    """``(H, g)``: the penalized objective's Hessian and linear term (float64)."""
    A, b = quadratics(data)
    a = alphas(data)
    n, d = b.shape
    W = _weights64(D)
    L = np.diag(W.sum(1)) - W
    H = np.zeros((n * d, n * d))
    for i in range(n):
        H[i * d : (i + 1) * d, i * d : (i + 1) * d] = a[i] * A[i] / n
    H += mu * np.kron(L, np.eye(d))
    return H, (a[:, None] * b / n).reshape(-1)


def _penalized_optimum(data, D, mu) -> np.ndarray:
    """argmin (1/n) sum alpha_i f_i(theta_i) + (mu/2) sum_{i<j} w_ij ||theta_i - theta_j||^2."""
    H, g = _penalized_system(data, D, mu)
    return np.linalg.solve(H, g).reshape(-1, DIM)


def _run_error(data, eta, rounds, ref, extra=2 * N_CLIENTS, **kw) -> float:
    """Bound on ``||theta - ref||`` after ``rounds`` full-participation rounds at ``eta`` from
    0 toward the fixed point ``ref``: gradient steps contract by :func:`gd_contraction`, the
    proximal step (``2 n``-term products with the graph's eigenvectors) is nonexpansive,
    each round rounds by :func:`round_rounding`."""
    rho = gd_contraction(data, eta)
    per_round = round_rounding(data, ref, eta, extra=extra, **kw)
    return fixed_point_error(rho, rounds, float(np.linalg.norm(ref)), per_round)


def _exp_rtol(x) -> float:
    """float32 weights ``exp(-x)``, ``x = D / bandwidth``: D, the bandwidth (a median,
    perhaps of two) and the quotient each round, ``2 EPS32 |x|`` in the exponent, which
    moves exp by as much relatively; exp rounds once more."""
    return EPS32 * (2 * float(np.max(np.where(np.isfinite(x), x, 0.0))) + 1)


def _eta(data) -> float:
    """1 / L with L = max_i alpha_i lambda_max(A_i) / n, the product-space smoothness."""
    A, _ = quadratics(data)
    return float(N_CLIENTS / np.max(alphas(data) * np.linalg.eigvalsh(A)[:, -1]))


def _group_fit(data, sel) -> np.ndarray:
    A, b = quadratics(data)
    a = alphas(data)
    return np.linalg.solve(np.einsum("n,nij->ij", a[sel], A[sel]), a[sel] @ b[sel])


def _same_partition(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return np.array_equal(a[:, None] == a[None], b[:, None] == b[None])


# --------------------------------------------------------------------------- graph weights


def test_graph_weights_default_and_edge_cases():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((7, 2))
    D = np.sqrt(((X[:, None] - X[None]) ** 2).sum(-1))
    W = np.asarray(graph_weights(D), np.float64)
    off = ~np.eye(7, dtype=bool)
    rtol = _exp_rtol(D / np.median(D[off]))
    np.testing.assert_allclose(W, _weights64(D), rtol=rtol, atol=0)
    np.testing.assert_array_equal(W, W.T)
    # strictly decreasing in D over the pairs
    iu = np.triu_indices(7, 1)
    order = np.argsort(D[iu])
    assert np.all(np.diff(W[iu][order]) < 0)
    # the traced path (D under jit) gives the same weights: two float32 evaluations
    np.testing.assert_allclose(np.asarray(jax.jit(graph_weights)(D)), W, rtol=2 * rtol, atol=0)
    # D = 0 -> 1, D = inf -> 0, diagonal 0, n = 1 -> [[0]]
    Z = np.zeros((4, 4))
    np.testing.assert_array_equal(np.asarray(graph_weights(Z)), 1.0 - np.eye(4))
    Dinf = np.array([[0.0, 1.0, np.inf], [1.0, 0.0, np.inf], [np.inf, np.inf, 0.0]])
    Winf = np.asarray(graph_weights(Dinf))
    np.testing.assert_allclose(Winf, [[0, np.exp(-1), 0], [np.exp(-1), 0, 0], [0, 0, 0]],
                               rtol=_exp_rtol(1.0))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(graph_weights(np.zeros((1, 1)))), [[0.0]])
    # more than half the pairs identical: the bandwidth is the median of the positive ones
    Dz = np.zeros((5, 5))
    Dz[4, :4] = Dz[:4, 4] = [2.0, 4.0, 6.0, 8.0]  # median of the positive entries: 5
    rtol = _exp_rtol(0.8)
    np.testing.assert_allclose(np.asarray(graph_weights(Dz))[4, 1], np.exp(-0.8), rtol=rtol)
    np.testing.assert_allclose(np.asarray(jax.jit(graph_weights)(Dz))[4, 1], np.exp(-0.8),
                               rtol=rtol)  # fmt: skip
    np.testing.assert_allclose(np.asarray(graph_weights(D, scale=2.0)),
                               np.where(off, np.exp(-D / 2), 0), rtol=_exp_rtol(D / 2))  # fmt: skip
    for bad in (np.ones((2, 3)), -np.ones((2, 2)), np.array([[0, 1], [2, 0.0]]),
                np.array([[0, np.nan], [np.nan, 0]])):  # fmt: skip
        with pytest.raises(ValueError, match="D must"):
            graph_weights(bad)


# --------------------------------------------------------------------------- Laplacian penalty


def _run_penalty(D, mu, eta, key, data, s, rounds, B=FULL):
    alg = laplacian_penalty(LOSS, D, mu=mu, learning_rate=eta, clients_per_round=s, batch_size=B)
    return scan_run(alg, zeros(), data, key, rounds)


def test_laplacian_penalty_reaches_closed_form_optimum_over_a_vmapped_mu_grid():
    data = problem().train
    D = true_dissimilarity()
    eta = _eta(data)
    mus = np.array([0.0, 0.003, 0.03, 1.0, np.inf, 1e8])
    grid = jax.jit(
        jax.vmap(lambda mu: _run_penalty(D, mu, eta, jax.random.key(1), data, N_CLIENTS, 2500)[0])
    )(jnp.asarray(mus, jnp.float32))
    thetas = np.asarray(grid.params, np.float64)
    assert bool(jnp.all(jnp.isfinite(grid.params)))
    local = _penalized_optimum(data, D, 0.0)
    glob = np.broadcast_to(global_ridge(data), local.shape)
    for mu, theta in zip(mus[:-1], thetas[:-1], strict=True):
        ref = glob if np.isinf(mu) else _penalized_optimum(data, D, mu)
        err = np.linalg.norm(theta - ref) / np.linalg.norm(ref)
        # float32's fixed point after 2500 contracting rounds (the float64 ref exact to it)
        assert err <= _run_error(data, eta, 2500, ref) / np.linalg.norm(ref), (mu, err)
    # the middle values are genuinely between local and global
    mid = _penalized_optimum(data, D, 0.03)
    assert min(np.linalg.norm(mid - local), np.linalg.norm(mid - glob)) > 0.1 * np.linalg.norm(
        local - glob
    )
    # a huge finite mu is stable and near consensus: float32's fixed point of mu = 1e8, that
    # optimum's distance from consensus (float64, solved to cond(H) EPS64 of itself)
    H, g = _penalized_system(data, D, mus[-1])
    huge = np.linalg.solve(H, g).reshape(-1, DIM)
    off_consensus = np.linalg.norm(huge - glob) + np.linalg.cond(H) * EPS64 * np.linalg.norm(huge)
    atol = _run_error(data, eta, 2500, huge) + off_consensus
    np.testing.assert_allclose(thetas[-1], glob, rtol=0, atol=atol)


def test_laplacian_penalty_partial_participation_reaches_optimum():
    """s = 2 of 6 with exact gradients: SAGA memory makes the fixed point the optimum.

    The step is Karula's default rule for s = 2 (0.13 / L here; 0.5 / L diverges)."""
    data = problem().train
    D = true_dissimilarity()
    mu = 0.03
    A, _ = quadratics(data)
    eta = float(karula_learning_rate(np.linalg.eigvalsh(A)[:, -1], alphas(data), 2))
    state, infos, _ = jax.jit(_run_penalty, static_argnums=(5, 6))(
        D, mu, eta, jax.random.key(2), data, 2, 2000
    )
    ref = _penalized_optimum(data, D, mu)
    theta = np.asarray(state.params, np.float64)
    # SAGA with exact memory: in expectation full gradient descent at eta; each client's
    # gradient is refreshed every n / s rounds on average, so the iteration contracts at
    # least like n / s times fewer full rounds, and float32's fixed point is up to n / s
    # times that of full participation
    s = 2
    bound = N_CLIENTS / s * _run_error(data, eta, 2000 * s // N_CLIENTS, ref)
    assert np.linalg.norm(theta - ref) <= bound, (np.linalg.norm(theta - ref), bound)
    assert int(infos.participants.sum(1).max()) == 2 and bool(jnp.all(infos.finite))


def test_laplacian_penalty_limits_equal_karula():
    """mu = 0 is Karula at t = inf, mu = inf Karula at t = 0: same lr, key, minibatches."""
    data = problem().train
    D = true_dissimilarity()
    key = jax.random.key(3)
    kw = dict(learning_rate=0.3, clients_per_round=2, batch_size=4)

    def pen(mu):
        return scan_run(laplacian_penalty(LOSS, D, mu=mu, **kw), zeros(), data, key, 40)[1:]

    def kar(t):
        return scan_run(karula(LOSS, D, t=t, **kw), zeros(), data, key, 40)[1:]

    i1, t1 = jax.jit(jax.vmap(pen))(jnp.array([0.0, jnp.inf]))
    i2, t2 = jax.jit(jax.vmap(kar))(jnp.array([jnp.inf, 0.0]))
    np.testing.assert_array_equal(i1.participants, i2.participants)
    # the same arithmetic in two programs, reordered: a round sums 4 rows of d terms and
    # averages n clients, over 40 (contracting) rounds
    tol = reordered_sum(4 + DIM + N_CLIENTS + 4, rounds=40)
    np.testing.assert_allclose(np.asarray(i1.loss), np.asarray(i2.loss), rtol=2 * tol)
    t1, t2 = np.asarray(t1), np.asarray(t2)
    # mu = 0: bit for bit (the proximal step is a no-op, as is the projection at t = inf)
    np.testing.assert_array_equal(t1[0], t2[0])
    # mu = inf: one model (the mean, through 2 n-term products with the graph's
    # eigenvectors), Karula's t = 0 up to float rounding
    assert np.ptp(t1[1], axis=1).max() <= reordered_sum(2 * N_CLIENTS + 2) * np.abs(t1[1]).max()
    np.testing.assert_allclose(t1[1], t2[1], rtol=tol, atol=tol * np.abs(t2[1]).max())


def test_laplacian_penalty_disconnected_graph_at_infinite_mu_keeps_components():
    """D = inf between groups: mu = inf is consensus within each component only."""
    data = problem().train
    groups = np.asarray(problem().groups)
    D = np.where(groups[:, None] == groups[None], true_dissimilarity(), np.inf)
    state, _, _ = jax.jit(_run_penalty, static_argnums=(5, 6))(
        D, jnp.inf, _eta(data), jax.random.key(4), data, N_CLIENTS, 2500
    )
    theta = np.asarray(state.params, np.float64)
    fits = np.stack([_group_fit(data, groups == g) for g in groups])
    atol = _run_error(data, _eta(data), 2500, fits)  # float32's fixed point, contracting
    for g in np.unique(groups):
        sel = groups == g
        np.testing.assert_allclose(theta[sel], fits[sel], rtol=0, atol=atol)


def test_laplacian_penalty_shared_leaf_matches_closed_form():
    """Personalized slopes w_i penalized on the graph, one shared intercept c."""
    data = problem().train
    D = true_dissimilarity()
    n, d, mu = N_CLIENTS, DIM, 0.03
    a = alphas(data)
    x, y, counts = np.asarray(data.x, np.float64), np.asarray(data.y, np.float64), data.counts
    # variables z = [w_1 .. w_n, c]; gradient of the objective is H z - g
    H = np.zeros((n * d + 1, n * d + 1))
    g = np.zeros(n * d + 1)
    for i, N in enumerate(np.asarray(counts)):
        Xa = np.concatenate([x[i, :N], np.ones((N, 1))], axis=1)
        Ai = Xa.T @ Xa / N + LAM * np.eye(d + 1)
        bi = Xa.T @ y[i, :N] / N
        ix = np.r_[np.arange(i * d, (i + 1) * d), n * d]
        H[np.ix_(ix, ix)] += a[i] * Ai / n
        g[ix] += a[i] * bi / n
    W = _weights64(D)
    H[: n * d, : n * d] += mu * np.kron(np.diag(W.sum(1)) - W, np.eye(d))
    z = np.linalg.solve(H, g)
    alg = laplacian_penalty(intercept_loss, D, mu=mu, learning_rate=0.6 * _eta(data),
                            clients_per_round=n, batch_size=FULL,
                            personalized={"w": True, "c": False})  # fmt: skip
    state, infos, _ = run(alg, {"w": zeros(), "c": jnp.zeros(())}, data, jax.random.key(5), 6000)
    c = np.asarray(state.params["c"])
    assert np.ptp(c) == 0.0
    # float32's fixed point: the round is gradient descent preconditioned by P = diag(1,
    # ..., 1, 1 / n) (the shared c takes the mean of the clients' steps), then the
    # nonexpansive proximal step on w: it contracts by rho in the P^-1/2 norm, which is
    # within sqrt(n) of the Euclidean one
    lr = 0.6 * _eta(data)
    H_f = H - np.pad(mu * np.kron(np.diag(W.sum(1)) - W, np.eye(d)), ((0, 1), (0, 1)))
    P = np.sqrt(np.r_[np.ones(n * d), 1.0 / n])
    rho = float(np.max(np.abs(1 - lr * np.linalg.eigvalsh(P[:, None] * H_f * P[None, :]))))
    per_round = round_rounding(data, z[: n * d].reshape(n, d), lr, extra=2 * n, intercept=z[-1])
    atol = fixed_point_error(rho, 6000, np.sqrt(n) * np.linalg.norm(z), np.sqrt(n) * per_round)
    np.testing.assert_allclose(np.asarray(state.params["w"]), z[: n * d].reshape(n, d),
                               rtol=0, atol=atol)  # fmt: skip
    np.testing.assert_allclose(c[0], z[-1], rtol=0, atol=atol)
    assert bool(jnp.all(infos.finite))


def test_laplacian_penalty_one_round_with_custom_graph_weights():
    """s = n, exact gradients: theta <- (I + eta mu L)^{-1} (theta - eta alpha_i g_i / n)."""
    data = problem().train
    n, eta, mu = N_CLIENTS, 0.2, 3.0
    ring = np.roll(np.eye(n), 1, axis=1)
    W = 0.5 * (ring + ring.T)
    alg = laplacian_penalty(LOSS, true_dissimilarity(), mu=mu, learning_rate=eta,
                            clients_per_round=n, batch_size=FULL,
                            graph_weights=lambda D: jnp.asarray(W))  # fmt: skip
    state = alg.init(zeros(), data, key=jax.random.key(13))
    theta = np.random.default_rng(0).standard_normal((n, DIM))
    state = state._replace(params=jnp.asarray(theta, jnp.float32))
    new, info = jax.jit(alg.round)(state, data)
    A, b = quadratics(data)
    half = theta - eta * alphas(data)[:, None] * (np.einsum("nij,nj->ni", A, theta) - b) / n
    L = np.diag(W.sum(1)) - W
    expected = np.linalg.solve(np.eye(n) + eta * mu * L, half)
    # one float32 round from theta (the float64 reference exact to it)
    atol = round_rounding(data, theta, eta, extra=2 * n)
    np.testing.assert_allclose(np.asarray(new.params), expected, rtol=0, atol=atol)
    assert bool(info.finite) and bool(info.participants.all())


def test_laplacian_penalty_compiles_once_for_traced_mu_and_D():
    """mu and D traced (D's spectrum then comes from jnp.linalg.eigh): one compilation."""
    data = problem().train
    D = true_dissimilarity()
    eta = _eta(data)

    def fn(D, mu, key, data):
        return _run_penalty(D, mu, eta, key, data, N_CLIENTS, 2500)[0].params

    counted = jax.jit(chex.assert_max_traces(fn, n=1))
    for mu in (0.003, 1.0, 50.0):
        theta = np.asarray(counted(jnp.asarray(D, jnp.float32), jnp.float32(mu),
                                   jax.random.key(6), data), np.float64)  # fmt: skip
        ref = _penalized_optimum(data, D, mu)
        # float32's fixed point; D traced: the proximal step from a float32 eigh, whose
        # eigenvectors are orthogonal to about n eps (n more roundings each way)
        bound = _run_error(data, eta, 2500, ref, extra=4 * N_CLIENTS)
        assert np.linalg.norm(theta - ref) <= bound, mu


def _primitives(jaxpr) -> set[str]:
    """Names of every primitive in ``jaxpr``, inside loops and branches too."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax_core.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jax_core.Jaxpr):
                    names |= _primitives(sub)
    return names


def test_laplacian_penalty_decomposes_a_traced_graph_once_per_run_not_every_round():
    """A batched run builds the algorithm inside every round (``vmap_algorithm``): the
    eigendecomposition of a member's traced D belongs to ``init`` (state.extra), and the
    round applies it without decomposing again."""
    data, eta = problem().train, _eta(problem().train)
    D = jnp.stack([jnp.asarray(true_dissimilarity(), jnp.float32)] * 2)
    alg = vmap_algorithm(
        lambda D, mu: laplacian_penalty(LOSS, D, mu=mu, learning_rate=eta,
                                        clients_per_round=2, batch_size=FULL),
        {"mu": jnp.array([0.1, 1.0])},
        batch_kwargs={"D": D},
    )  # fmt: skip
    keys, params = jax.random.split(jax.random.key(0), 2), zeros()
    state = alg.init(params, data, key=keys)
    init_ops = _primitives(jax.make_jaxpr(lambda k: alg.init(params, data, key=k))(keys).jaxpr)
    assert "eigh" in init_ops
    round_ops = _primitives(jax.make_jaxpr(alg.round)(state, data).jaxpr)
    assert "dot_general" in round_ops and "eigh" not in round_ops
    # The spectrum carried is the Laplacian's own: U diag(lam) U^T = L(W(D)) up to a float32
    # eigh's backward error (~ n eps |L|) and the eigenvalues zeroed below 10 n eps lam_max
    # (lam_max <= 2 max |L_ii|): at most 30 n eps max |L| together.
    lam, U = state.extra.eigenvalues[0, 0], state.extra.eigenvectors[0, 0]
    L = np.asarray(graph_laplacian(graph_weights(D[0])), np.float64)
    rebuilt = (
        np.asarray(U, np.float64)
        @ np.diag(np.asarray(lam, np.float64))
        @ np.asarray(U, np.float64).T
    )
    assert np.max(np.abs(rebuilt - L)) <= 30 * N_CLIENTS * EPS32 * np.max(np.abs(L))


# --------------------------------------------------------------------------- clustering


def _planted(rng, sizes, between=(1.0, 2.0), within=(0.0, 0.3)):
    labels = rng.permutation(np.repeat(np.arange(len(sizes)), sizes))
    n = len(labels)
    same = labels[:, None] == labels[None]
    D = np.where(same, rng.uniform(*within, (n, n)), rng.uniform(*between, (n, n)))
    D = np.triu(D, 1)
    return D + D.T, labels


@pytest.mark.parametrize("method", ["spectral", "agglomerative"])
def test_cluster_clients_recovers_planted_groups(method):
    rng = np.random.default_rng(7)
    for sizes in [(2, 3, 4), (1, 5), (3, 3, 3, 3), (4, 1, 2)]:
        D, planted = _planted(rng, sizes)
        labels = cluster_clients(D, len(sizes), method=method)
        assert labels.dtype == np.int32 and labels.shape == planted.shape
        assert _same_partition(labels, planted), (sizes, labels, planted)
        assert labels[0] == 0 and set(labels) == set(range(len(sizes)))
    # infinite dissimilarities between the groups
    D, planted = _planted(rng, (3, 2, 4))
    D = np.where(planted[:, None] == planted[None], D, np.inf)
    assert _same_partition(cluster_clients(D, 3, method=method), planted)
    # k = 1 and k = n
    assert np.all(cluster_clients(D, 1, method=method) == 0)
    np.testing.assert_array_equal(cluster_clients(D, 9, method=method), np.arange(9))
    assert np.array_equal(cluster_clients(np.zeros((1, 1)), 1, method=method), [0])
    # deterministic
    np.testing.assert_array_equal(cluster_clients(D, 2, method=method),
                                  cluster_clients(D, 2, method=method))  # fmt: skip


def test_cluster_clients_on_true_dissimilarity_finds_the_three_groups():
    groups = np.asarray(problem().groups)
    for method in ("spectral", "agglomerative"):
        assert _same_partition(cluster_clients(true_dissimilarity(), 3, method=method), groups)


def test_agglomerative_matches_scipy_average_linkage():
    rng = np.random.default_rng(8)
    for n in (2, 3, 5, 8, 13):
        for _ in range(3):
            X = rng.standard_normal((n, 3))
            D = np.sqrt(((X[:, None] - X[None]) ** 2).sum(-1))
            Z = linkage(squareform(D, checks=False), method="average")
            for k in range(1, n + 1):
                ours = cluster_clients(D, k, method="agglomerative")
                ref = fcluster(Z, k, criterion="maxclust")
                assert _same_partition(ours, ref), (n, k)
                assert len(set(ours)) == k


def test_spectral_keeps_every_group_nonempty_with_duplicate_clients():
    D = np.zeros((5, 5))  # five identical clients
    for k in range(1, 6):
        labels = cluster_clients(D, k)
        assert sorted(set(labels)) == list(range(k))


def test_spectral_kmeans_equals_scipy_kmeans2():
    """The k-means under the spectral method stops once its labels repeat; scipy's
    ``kmeans2`` (same k-means++ draws from the same generator) runs all its iterations.
    Both must give the same labels, also with coincident rows and k = 1 or n."""
    rng = np.random.default_rng(21)
    for trial in range(60):
        n = int(rng.integers(1, 40))
        k = int(rng.integers(1, min(n, 12) + 1))
        X = rng.standard_normal((n, k))
        if trial % 4 == 0:
            X[: (n + 1) // 2] = X[0]  # coincident rows: k-means++ may empty a cluster
        X /= np.linalg.norm(X, axis=1, keepdims=True)
        ours_rng, ref_rng = np.random.default_rng(trial), np.random.default_rng(trial)
        for _ in range(2):  # the generator's state carries over between restarts
            with np.errstate(invalid="ignore", divide="ignore"):
                ours = clustered._lloyd(X, clustered._kmeans_pp(X, k, ours_rng), 300)
            with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
                warnings.simplefilter("ignore", UserWarning)
                _, ref = kmeans2(X, k, iter=300, minit="++", seed=ref_rng, missing="warn")
            np.testing.assert_array_equal(ours, ref, err_msg=f"n={n} k={k} trial={trial}")


# --------------------------------------------------------------------------- clustered FedAvg


def test_clustered_fedavg_one_group_is_fedavg_and_n_groups_is_local_training():
    data = problem().train
    key = jax.random.key(9)
    kw = dict(learning_rate=0.2, clients_per_round=3, batch_size=4, local_steps=2)
    _, i1, t1 = run(clustered_fedavg(LOSS, np.zeros(N_CLIENTS, np.int32), **kw), zeros(), data,
                    key, 40)  # fmt: skip
    _, i2, t2 = run(fedavg(LOSS, **kw), zeros(), data, key, 40)
    np.testing.assert_array_equal(i1.participants, i2.participants)
    # the same arithmetic in two programs: equal up to XLA's fusion choices, i.e. sums in
    # another order: a round's 2 local steps on 4 rows of d terms, an average of 3 clients,
    # over 40 (contracting) rounds
    tol = reordered_sum(2 * (4 + DIM) + 3 + 4, rounds=40)
    np.testing.assert_allclose(np.asarray(i1.loss), np.asarray(i2.loss), rtol=2 * tol)
    t1, t2 = np.asarray(t1), np.asarray(t2)
    np.testing.assert_allclose(t1, t2, rtol=tol, atol=tol * np.abs(t2).max())
    # k = n: every participant keeps its own E local steps (fedavg with everything personal)
    _, _, t3 = run(clustered_fedavg(LOSS, np.arange(N_CLIENTS), **kw), zeros(), data, key, 40)
    _, _, t4 = run(fedavg(LOSS, personalized=True, **kw), zeros(), data, key, 40)
    t3, t4 = np.asarray(t3), np.asarray(t4)
    np.testing.assert_allclose(t3, t4, rtol=tol, atol=tol * np.abs(t4).max())
    assert np.ptp(t3[-1], axis=0).max() > 0.1


def test_clustered_fedavg_groups_reach_their_weighted_ridge_fits():
    data = problem().train
    labels = cluster_clients(true_dissimilarity(), 3)
    A, _ = quadratics(data)
    lr = 1.0 / np.linalg.eigvalsh(A)[:, -1].max()
    alg = clustered_fedavg(LOSS, labels, learning_rate=lr, clients_per_round=N_CLIENTS,
                           batch_size=FULL, local_steps=1)  # fmt: skip
    state, infos, _ = run(alg, zeros(), data, jax.random.key(10), 600)
    theta = np.asarray(state.params, np.float64)
    a = alphas(data)
    fits = np.stack([_group_fit(data, labels == g) for g in labels])
    # float32's fixed point of each group's averaged gradient step, which contracts by
    # |I - lr A_g| (A_g the alpha-weighted mean Hessian of the group); a round rounds the
    # gradients (a step of at most lr times them) and the average over the group's clients
    rho = 0.0
    for g in range(3):
        sel = labels == g
        A_g = np.einsum("n,nij->ij", a[sel], A[sel]) / a[sel].sum()
        rho = max(rho, float(np.max(np.abs(1 - lr * np.linalg.eigvalsh(A_g)))))
    per_round = round_rounding(data, fits, lr * N_CLIENTS / a.min(), extra=N_CLIENTS)
    atol = fixed_point_error(rho, 600, float(np.linalg.norm(fits)), per_round)
    for g in range(3):
        sel = labels == g
        np.testing.assert_allclose(theta[sel], fits[sel], rtol=0, atol=atol)
    assert bool(jnp.all(infos.finite))


def test_clustered_fedavg_groups_without_participants_keep_their_model():
    data = problem().train
    labels = np.array([0, 0, 1, 1, 2, 2])
    alg = clustered_fedavg(intercept_loss, labels, learning_rate=0.1, clients_per_round=1,
                           batch_size=4, personalized={"w": False, "c": True})  # fmt: skip
    s0 = alg.init({"w": zeros(), "c": jnp.zeros(())}, data, key=jax.random.key(11))
    s1, info = jax.jit(alg.round)(s0, data)
    part = np.asarray(info.participants)
    moved_group = labels == labels[part][0]
    w_moved = np.any(np.asarray(s1.params["w"] != s0.params["w"]), axis=1)
    np.testing.assert_array_equal(w_moved, moved_group)
    np.testing.assert_array_equal(np.asarray(s1.params["c"] != s0.params["c"]), part)
    w1 = np.asarray(s1.params["w"])
    np.testing.assert_array_equal(
        w1[moved_group], np.broadcast_to(w1[part][0], w1[moved_group].shape)
    )


def test_clustered_fedavg_compiles_once_for_traced_labels_and_vmaps_over_k():
    data = problem().train
    D = true_dissimilarity()
    key = jax.random.key(12)

    def fn(labels, key, data):
        alg = clustered_fedavg(LOSS, labels, learning_rate=0.2, clients_per_round=3,
                               batch_size=4, local_steps=2)  # fmt: skip
        return scan_run(alg, zeros(), data, key, 15)[0].params

    counted = jax.jit(chex.assert_max_traces(fn, n=1))
    stacked = np.stack([cluster_clients(D, k) for k in (1, 2, 3, 6)])
    singles = np.stack([np.asarray(counted(jnp.asarray(lab), key, data)) for lab in stacked])
    grid = jax.jit(jax.vmap(fn, in_axes=(0, None, None)))(jnp.asarray(stacked), key, data)
    # vmapped and alone: sums in another order, 2 local steps on 4 rows of d terms and an
    # average of 3 clients a round, over 15 rounds
    tol = reordered_sum(2 * (4 + DIM) + 3 + 4, rounds=15)
    atol = tol * np.abs(singles).max()
    np.testing.assert_allclose(np.asarray(grid), singles, rtol=tol, atol=atol)
    assert np.abs(singles[0] - singles[3]).max() > 1e-2  # k changes the result


# --------------------------------------------------------------------------- bad inputs

D3 = np.ones((3, 3)) - np.eye(3)
HP = {"learning_rate": 0.1, "clients_per_round": 2, "batch_size": 2}
DATA3 = None


def _data3():
    from karula_jax.data import from_client_arrays

    return from_client_arrays(
        [np.ones((2, DIM)), np.zeros((3, DIM)), -np.ones((2, DIM))],
        [np.ones(2), np.zeros(3), np.ones(2)],
    )


def _lap(**kw):
    return laplacian_penalty(LOSS, kw.pop("D", D3), **{"mu": 1.0, **HP, **kw})


def _clu(**kw):
    return clustered_fedavg(LOSS, kw.pop("labels", np.array([0, 0, 1])), **{**HP, **kw})


def _init(alg):
    return alg.init(zeros(), _data3(), key=jax.random.key(0))


CASES = [
    ("mu negative", lambda: _lap(mu=-1.0), ValueError, "mu"),
    ("mu nan", lambda: _lap(mu=np.nan), ValueError, "mu"),
    ("mu string", lambda: _lap(mu="big"), TypeError, "mu"),
    ("lap lr negative", lambda: _lap(learning_rate=-0.1), ValueError, "learning_rate"),
    ("lap lr inf", lambda: _lap(learning_rate=np.inf), ValueError, "learning_rate"),
    ("D not square", lambda: _lap(D=np.ones((3, 2))), ValueError, "D must be a square"),
    ("D asymmetric", lambda: _lap(D=np.triu(D3)), ValueError, "D must be symmetric"),
    ("D negative", lambda: _lap(D=-D3), ValueError, "D must be >= 0"),
    ("D nan", lambda: _lap(D=D3 * np.nan), ValueError, "D must not contain NaN"),
    (
        "graph_weights shape",
        lambda: _lap(graph_weights=np.ones((2, 2))),
        ValueError,
        "graph_weights",
    ),
    ("graph_weights negative", lambda: _lap(graph_weights=-D3), ValueError, "graph_weights"),
    ("lap s > n", lambda: _init(_lap(clients_per_round=4)), ValueError, "clients_per_round"),
    ("lap s zero", lambda: _lap(clients_per_round=0), ValueError, "clients_per_round"),
    ("lap D vs data", lambda: _init(_lap(D=np.ones((4, 4)) - np.eye(4))), ValueError, "D has"),
    ("lap personalized", lambda: _init(_lap(personalized={"w": True})), ValueError, "personalized"),
    ("lap weights", lambda: _lap(weights=np.array([1.0, -1.0, 1.0])), ValueError, "weights"),
    ("scale zero", lambda: graph_weights(D3, scale=0.0), ValueError, "scale"),
    ("labels float", lambda: _clu(labels=np.array([0.0, 1.0, 0.0])), TypeError, "labels"),
    ("labels bool", lambda: _clu(labels=np.array([True, False, True])), TypeError, "labels"),
    ("labels 2d", lambda: _clu(labels=np.zeros((3, 1), int)), ValueError, "labels"),
    ("labels negative", lambda: _clu(labels=np.array([0, -1, 0])), ValueError, "labels"),
    ("labels vs data", lambda: _init(_clu(labels=np.array([0, 1]))), ValueError, "labels"),
    ("clu lr negative", lambda: _clu(learning_rate=-1.0), ValueError, "learning_rate"),
    ("clu s > n", lambda: _init(_clu(clients_per_round=4)), ValueError, "clients_per_round"),
    ("clu local_steps", lambda: _clu(local_steps=0), ValueError, "local_steps"),
    ("k zero", lambda: cluster_clients(D3, 0), ValueError, "k must be >= 1"),
    ("k > n", lambda: cluster_clients(D3, 4), ValueError, "k=4 exceeds"),
    ("k float", lambda: cluster_clients(D3, 2.0), TypeError, "k must"),
    ("method", lambda: cluster_clients(D3, 2, method="kmeans"), ValueError, "method"),
    ("cluster D asymmetric", lambda: cluster_clients(np.triu(D3), 2), ValueError, "D must"),
    ("cluster D nan", lambda: cluster_clients(D3 * np.nan, 2), ValueError, "D must"),
]


@pytest.mark.parametrize("call,exc,match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_inputs_are_rejected_by_name(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
