"""Baselines: FedSGD, FedAvg, IFCA and pFedMe against closed forms and each other."""

from __future__ import annotations

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
    global_ridge,
    intercept_loss,
    problem,
    quadratics,
    scan_run,
    zeros,
)
from _tolerances import EPS32, EPS64, iteration_floor, reordered_sum

from karula_jax.algorithms import (
    fedavg,
    fedsgd,
    ifca,
    ifca_assign,
    lipschitz_ridge,
    local,
    pfedme,
)
from karula_jax.data import from_client_arrays
from karula_jax.training import run_many

FULL = 64
run = jax.jit(scan_run, static_argnums=(0, 4))


def _global_lr(data) -> float:
    """1 / lambda_max of the Hessian of F(w) = (1/n) sum alpha_i f_i(w)."""
    A, _ = quadratics(data)
    H = np.einsum("n,nij->ij", alphas(data), A) / A.shape[0]
    return 1.0 / np.linalg.eigvalsh(H)[-1]


def _minibatch_rounds(batch: int, clients: int, steps: int) -> float:
    """Relative float32 difference of two programs for one minibatch run, ``steps`` local
    steps in all: each a gradient over ``batch`` rows of DIM terms, a mean over ``clients``
    and 2 updates. Minibatch steps need not contract, so the rounding adds up step by step."""
    return reordered_sum(batch * DIM + clients + 2, rounds=steps)


def _floor(H, lr: float, terms: int) -> float:
    """float32's floor (relative) of ``w <- w - lr (H w - b)`` with gradients of ``terms``
    roundings (:func:`iteration_floor`)."""
    ev = np.linalg.eigvalsh(H)
    return iteration_floor(ev[-1] / ev[0], terms, step=lr * ev[-1])


def test_fedavg_one_local_step_is_fedsgd_with_minibatches():
    data = problem().train
    key = jax.random.key(10)
    kw = dict(learning_rate=0.3, clients_per_round=2, batch_size=4)
    sgd = fedsgd(LOSS, **kw)
    _, i1, t1 = run(fedavg(LOSS, local_steps=1, **kw), zeros(), data, key, 60)
    _, i2, t2 = run(sgd, zeros(), data, key, 60)
    np.testing.assert_array_equal(i1.participants, i2.participants)
    # raised from 1e-5 (measured 8e-7): 60 rounds of 2 clients' batches of 4 add up to 1e-4;
    # a squared residual doubles the parameters' relative error in the loss, whose own sums
    # add as much again
    tol = _minibatch_rounds(4, 2, 60)
    np.testing.assert_allclose(np.asarray(i1.loss), np.asarray(i2.loss), rtol=3 * tol)
    scale = float(np.abs(np.asarray(t2)).max())
    np.testing.assert_allclose(np.asarray(t1), np.asarray(t2), rtol=0, atol=tol * scale)
    # minibatches make the trajectory random: a different key gives another one, far beyond
    # the rounding (2e-4 here)
    _, _, t3 = run(sgd, zeros(), data, jax.random.key(11), 60)
    assert np.max(np.abs(np.asarray(t3) - np.asarray(t2))) > 1e-3


def test_fedsgd_converges_to_global_ridge():
    data = problem().train
    lr = _global_lr(data)
    target = global_ridge(data)
    A, _ = quadratics(data)
    # 500 rounds at 1 / L leave (1 - 1 / kappa)^500 = 1e-100 of the start, then float32's
    # floor: gradients over N_max rows of DIM terms, averaged over the clients (4e-6)
    H = np.einsum("n,nij->ij", alphas(data), A) / N_CLIENTS
    atol = _floor(H, lr, data.max_count + DIM + N_CLIENTS + 2) * np.abs(target).max()
    for memory in (False, True):
        alg = fedsgd(LOSS, learning_rate=lr, clients_per_round=N_CLIENTS, batch_size=FULL,
                     memory=memory)  # fmt: skip
        state, infos, _ = run(alg, zeros(), data, jax.random.key(12), 500)
        w = np.asarray(state.params)
        assert np.ptp(w, axis=0).max() == 0.0  # broadcast global model
        np.testing.assert_allclose(w[0], target, rtol=0, atol=atol)
        assert bool(jnp.all(infos.finite))


def test_fedavg_reaches_its_client_drift_fixed_point():
    """With E > 1 FedAvg converges to the fixed point of w -> sum_i p_i T_i^E(w), not w*."""
    data = problem().train
    A, b = quadratics(data)
    p = alphas(data) / alphas(data).sum()
    E = 5
    lr = 0.5 / np.linalg.eigvalsh(A)[:, -1].max()
    # T_i(w) = w - lr (A_i w - b_i) = M_i w + lr b_i; T_i^E(w) = M_i^E w + c_i
    M = np.eye(DIM)[None] - lr * A
    ME = np.stack([np.linalg.matrix_power(m, E) for m in M])
    c = np.stack([sum(np.linalg.matrix_power(m, k) for k in range(E)) @ (lr * bi)
                  for m, bi in zip(M, b, strict=True)])  # fmt: skip
    fixed = np.linalg.solve(np.eye(DIM) - np.einsum("n,nij->ij", p, ME), p @ c)
    alg = fedavg(
        LOSS, learning_rate=lr, clients_per_round=N_CLIENTS, batch_size=FULL, local_steps=E
    )
    state, _, _ = run(alg, zeros(), data, jax.random.key(13), 400)
    w = np.asarray(state.params[0])
    # a round contracts by rho = lambda_max(sum_i p_i M_i^E) (0.59): 400 rounds leave
    # rho^400 of the start; each adds E steps' rounding (gradient and update) and the
    # average's, which the contraction sums to 1 / (1 - rho) of one round's
    rho = np.linalg.eigvalsh(np.einsum("n,nij->ij", p, ME))[-1]
    step = reordered_sum(data.max_count + DIM + 2) * 2 * lr * np.linalg.eigvalsh(A)[:, -1].max()
    rounding = E * (step + EPS32 / 2) + reordered_sum(N_CLIENTS)
    np.testing.assert_allclose(
        w, fixed, rtol=0, atol=(rho**400 + rounding / (1 - rho)) * np.abs(fixed).max()
    )
    drift = np.linalg.norm(fixed - global_ridge(data))
    assert drift > 100 * np.linalg.norm(w - fixed)  # the drift is real and resolved


def test_ifca_with_one_cluster_is_fedavg():
    data = problem().train
    key = jax.random.key(14)
    kw = dict(learning_rate=0.2, clients_per_round=3, batch_size=4, local_steps=2)
    _, i1, t1 = run(ifca(LOSS, num_clusters=1, **kw), zeros(), data, key, 40)
    _, i2, t2 = run(fedavg(LOSS, **kw), zeros(), data, key, 40)
    np.testing.assert_array_equal(i1.participants, i2.participants)
    # 40 rounds of 2 local steps on 3 clients' batches of 4 (measured: equal)
    tol = _minibatch_rounds(4, 3, 40 * 2) * float(np.abs(np.asarray(t2)).max())
    np.testing.assert_allclose(np.asarray(t1), np.asarray(t2), rtol=0, atol=tol)


def _two_groups():
    """Six clients, two groups with true models +2 and -2 (times ones), low noise."""
    rng = np.random.default_rng(0)
    groups = np.array([0, 1, 0, 1, 0, 1])
    xs, ys = [], []
    for i, g in enumerate(groups):
        x = rng.standard_normal((8 + i, DIM))
        theta = (2.0 if g == 0 else -2.0) * np.ones(DIM)
        xs.append(x)
        ys.append(x @ theta + 0.1 * rng.standard_normal(len(x)))
    return from_client_arrays(xs, ys), groups


def test_ifca_recovers_separated_clusters():
    data, groups = _two_groups()
    A, b = quadratics(data)
    a = alphas(data)
    lr = 1.0 / np.linalg.eigvalsh(A)[:, -1].max()
    # local_steps=1, exact gradients: each cluster's fixed point is its group's ridge fit
    alg = ifca(
        LOSS,
        num_clusters=2,
        learning_rate=lr,
        clients_per_round=N_CLIENTS,
        batch_size=FULL,
        local_steps=1,
        init_scale=1.0,
    )
    state, infos, _ = run(alg, zeros(), data, jax.random.key(15), 300)
    assign = np.asarray(ifca_assign(LOSS, state.extra.clusters, data))
    assert len(set(assign[groups == 0])) == 1 and len(set(assign[groups == 1])) == 1
    assert assign[groups == 0][0] != assign[groups == 1][0]
    for g in (0, 1):
        sel = groups == g
        fit = np.linalg.solve(np.einsum("n,nij->ij", a[sel], A[sel]), a[sel] @ b[sel])
        model = np.asarray(state.extra.clusters)[assign[sel][0]]
        # the cluster's step is w <- w - lr (H_g w - b_g), its 3 clients averaged: 300
        # rounds leave 1e-43 of the start, then float32's floor (5e-6 of |fit|)
        H_g = np.einsum("n,nij->ij", a[sel] / a[sel].sum(), A[sel])
        floor = _floor(H_g, lr, data.max_count + DIM + 3 + 2)
        np.testing.assert_allclose(model, fit, rtol=0, atol=floor * np.abs(fit).max())
    per_client = np.asarray(alg.client_params(state, data))
    np.testing.assert_array_equal(per_client, np.asarray(state.extra.clusters)[assign])
    assert bool(jnp.all(infos.finite))


def test_ifca_default_init_perturbs_all_but_the_first_cluster():
    data = problem().train
    params = jnp.arange(DIM, dtype=jnp.float32)
    alg = ifca(LOSS, num_clusters=400, learning_rate=0.1, clients_per_round=2, batch_size=4,
               init_scale=0.5)  # fmt: skip
    state = jax.jit(alg.init)(params, data, key=jax.random.key(16))
    clusters = np.asarray(state.extra.clusters)
    np.testing.assert_array_equal(clusters[0], np.asarray(params))
    noise = clusters[1:] - np.asarray(params)
    # Monte Carlo, 4.5 standard errors of a normal sample's mean and standard deviation
    # (scale / sqrt(N) and scale / sqrt(2 N)); the draw is fixed, the same on any machine
    se_mean, se_std = 0.5 / np.sqrt(noise.size), 0.5 / np.sqrt(2 * noise.size)
    assert abs(noise.std() - 0.5) < 4.5 * se_std and abs(noise.mean()) < 4.5 * se_mean


def test_ifca_with_a_bound_runs_k_traced_and_equals_static_k():
    """``num_clusters`` up to ``max_clusters`` (traced under vmap) gives the static-k run:
    the same first k initial clusters, the same choices, the same models; the clusters
    from k on are never chosen. Bad counts are refused, concretely and when traced."""
    data, _ = _two_groups()
    kw = dict(learning_rate=0.05, clients_per_round=3, batch_size=4, init_scale=1.0)
    key, rounds = jax.random.key(21), 12
    bounded = lambda k: ifca(LOSS, num_clusters=k, max_clusters=5, **kw)
    batch = jax.jit(jax.vmap(lambda k: scan_run(bounded(k), zeros(), data, key, rounds)[0]))
    states = batch(jnp.array([1.0, 2.0, 3.0, 5.0]))
    for g, k in enumerate((1, 2, 3, 5)):
        want, _, _ = run(ifca(LOSS, num_clusters=k, **kw), zeros(), data, key, rounds)
        got = jax.tree.map(lambda a, g=g: a[g], states)
        np.testing.assert_array_equal(got.extra.assignment, want.extra.assignment)
        assert int(np.max(got.extra.assignment)) < k
        # vmapped against static: 12 rounds of 5 local steps on 3 clients' batches of 4
        # (measured 1e-7; the bound is 1e-4 of the models' scale)
        tol = _minibatch_rounds(4, 3, 12 * 5) * float(np.abs(np.asarray(want.extra.clusters)).max())
        np.testing.assert_allclose(got.params, want.params, rtol=0, atol=tol)
        np.testing.assert_allclose(got.extra.clusters[:k], want.extra.clusters, atol=tol)
        chosen = np.asarray(bounded(k).client_params(got, data))
        np.testing.assert_allclose(
            chosen, ifca(LOSS, num_clusters=k, **kw).client_params(want, data), atol=tol
        )
    for bad in (0, 6, 2.5):
        with pytest.raises(
            ValueError, match="num_clusters must be an integer from 1 to max_clusters=5"
        ):
            bounded(bad)
    with pytest.raises(TypeError, match="num_clusters must be an integer from 1"):
        bounded("3")
    with pytest.raises(ValueError, match="leading axis max_clusters=5"):
        ifca(LOSS, num_clusters=2, max_clusters=5, initial_clusters=jnp.zeros((2, DIM)), **kw)
    with pytest.raises(TypeError, match="num_clusters must be a positive Python int"):
        ifca(LOSS, num_clusters=jnp.float32(2.0), **kw)  # no bound: k must be static
    with pytest.raises(
        ValueError, match=r"num_clusters is not an integer from 1 to max_clusters=5.*grid point 1"
    ):
        run_many(
            lambda num_clusters: bounded(num_clusters),
            zeros(),
            data,
            keys=jax.random.split(key, 1),
            num_rounds=1,
            hyper={"num_clusters": jnp.array([2.0, 6.0])},
            progress=False,
        )


def test_pfedme_reaches_moreau_envelope_stationary_point():
    """R = 1, exact gradients, many inner steps: w = sum_i p_i prox_i(w) (closed form)."""
    data = problem().train
    A, b = quadratics(data)
    p = alphas(data) / alphas(data).sum()
    lam = 2.0
    H = A + lam * np.eye(DIM)[None]
    Hinv = np.linalg.inv(H)
    lhs = np.eye(DIM) - lam * np.einsum("n,nij->ij", p, Hinv)
    w_star = np.linalg.solve(lhs, np.einsum("n,nij,nj->i", p, Hinv, b))
    theta_star = np.einsum("nij,nj->ni", Hinv, b + lam * w_star)
    alg = pfedme(
        LOSS,
        learning_rate=0.5 / lam,
        clients_per_round=N_CLIENTS,
        batch_size=FULL,
        lam=lam,
        personal_learning_rate=1.0 / np.linalg.eigvalsh(H)[:, -1].max(),
        inner_steps=40,
        local_steps=1,
    )
    state, infos, _ = run(alg, zeros(), data, jax.random.key(17), 300)
    # the outer step w <- w - (lhs w - c) / 2 contracts by lambda_min(lhs) / 2 (0.15) a
    # round: 300 rounds leave 1e-21 of the start; a round's rounding is the inner solve's
    # float32 floor (40 steps at 1 / L on H_i, whose own error is 3e-11), the client mean
    # and the update, summed over that contraction (3e-5 of the models' scale)
    contraction = np.linalg.eigvalsh(lhs)[0] / 2
    personal_lr = 1.0 / np.linalg.eigvalsh(H)[:, -1].max()
    inner = max(_floor(h, personal_lr, data.max_count + DIM + 2) for h in H)
    floor = (inner + reordered_sum(N_CLIENTS + 2)) / contraction
    scale = max(np.abs(w_star).max(), np.abs(theta_star).max())
    np.testing.assert_allclose(np.asarray(state.extra), w_star, rtol=0, atol=floor * scale)
    np.testing.assert_allclose(
        np.asarray(alg.client_params(state, data)), theta_star, rtol=0, atol=floor * scale
    )
    # personalization is real: the personalized models differ from w and from each other
    assert np.linalg.norm(theta_star - w_star) > 0.1
    assert bool(jnp.all(infos.finite))


def test_lipschitz_ridge_matches_hessian_of_product_objective():
    data = problem().train
    a = alphas(data)

    def f(theta):  # theta [n, d]
        losses = jax.vmap(LOSS)(theta, data.x, data.y, data.mask)
        return jnp.mean(jnp.asarray(a, jnp.float32) * losses)

    hess = jax.jit(jax.hessian(f))(jnp.zeros((N_CLIENTS, DIM)))
    H = np.asarray(hess, np.float64).reshape(N_CLIENTS * DIM, N_CLIENTS * DIM)
    L = lipschitz_ridge(data, LAM)
    # the float32 Hessian's entries round over N_max rows (and DIM + 2 more), which moves
    # its largest eigenvalue by that much of ||H|| (Weyl)
    rtol = reordered_sum(data.max_count + DIM + 2)
    np.testing.assert_allclose(L, np.linalg.eigvalsh(H)[-1], rtol=rtol)
    w = np.linspace(0.5, 1.5, N_CLIENTS)
    L_w = lipschitz_ridge(data, LAM, weights=w)
    A, _ = quadratics(data)
    # both in float64, their Gram matrices summed in other orders
    rtol = reordered_sum(data.max_count + DIM + 2, eps=EPS64)
    np.testing.assert_allclose(L_w, np.max(w * np.linalg.eigvalsh(A)[:, -1]) / N_CLIENTS, rtol=rtol)
    # n (max / n): two float64 roundings
    per_client = lipschitz_ridge(data, LAM, per_client=True)
    np.testing.assert_allclose(per_client, N_CLIENTS * L, rtol=reordered_sum(2, eps=EPS64))


def test_fedavg_personalized_leaves_fedper_fixed_point():
    """Shared w averaged, personalized intercepts c_i kept: with E = 1 and exact gradients
    the fixed point minimizes sum_i alpha_i f_i(w, c_i) jointly (a least-squares problem)."""
    data = problem().train
    n, a = N_CLIENTS, alphas(data)
    x, y, counts = np.asarray(data.x, np.float64), np.asarray(data.y, np.float64), data.counts
    # Stack sqrt(alpha_i / (2 N_i)) [x_i, e_i] rows plus the ridge rows, solve least squares.
    rows, rhs = [], []
    for i, N in enumerate(np.asarray(counts)):
        scale = np.sqrt(a[i] / N)
        block = np.zeros((N, DIM + n))
        block[:, :DIM], block[:, DIM + i] = x[i, :N], 1.0
        rows.append(scale * block)
        rhs.append(scale * y[i, :N])
        reg = np.zeros((DIM + 1, DIM + n))
        reg[:DIM, :DIM] = np.eye(DIM)
        reg[DIM, DIM + i] = 1.0
        rows.append(np.sqrt(a[i] * LAM) * reg)
        rhs.append(np.zeros(DIM + 1))
    stacked = np.concatenate(rows)
    sol = np.linalg.lstsq(stacked, np.concatenate(rhs), rcond=None)[0]
    alg = fedavg(
        intercept_loss,
        learning_rate=0.3,
        clients_per_round=n,
        batch_size=FULL,
        local_steps=1,
        personalized={"w": False, "c": True},
    )
    params0 = {"w": zeros(), "c": jnp.zeros(())}
    state, infos, _ = run(alg, params0, data, jax.random.key(18), 2000)
    w, c = np.asarray(state.params["w"]), np.asarray(state.params["c"])
    assert np.ptp(w, axis=0).max() == 0.0 and np.ptp(c) > 0.1  # the intercepts differ
    # 1e-4: what 2000 rounds leave of the start (measured 1e-7 of it), at least float32's
    # floor on the joint problem (kappa: its least-squares matrix's condition squared; the
    # smallest step, lr on an intercept's curvature 1 + LAM)
    kappa = np.linalg.cond(stacked) ** 2
    floor = iteration_floor(kappa, data.max_count + DIM + n + 2, step=0.3 * (1 + LAM))
    tol = max(1e-4, floor * np.abs(sol).max())
    np.testing.assert_allclose(w[0], sol[:DIM], rtol=1e-4, atol=tol)
    np.testing.assert_allclose(c, sol[DIM:], rtol=1e-4, atol=tol)
    # partial participation: only the participants' own leaves move
    part = fedavg(intercept_loss, learning_rate=0.3, clients_per_round=2, batch_size=FULL,
                  personalized={"w": False, "c": True})  # fmt: skip
    s0 = part.init({"w": zeros(), "c": jnp.zeros(())}, data, key=jax.random.key(19))
    s1, info = jax.jit(part.round)(s0, data)
    moved = np.asarray(s1.params["c"] != s0.params["c"])
    np.testing.assert_array_equal(moved, np.asarray(info.participants))


def test_local_partial_participation_step():
    """Only the s participants move, each by lr * alpha_i grad f_i / n (closed form)."""
    data = problem().train
    lr = 0.7
    alg = local(LOSS, learning_rate=lr, batch_size=FULL, clients_per_round=2)
    s0 = alg.init(zeros(), data, key=jax.random.key(20))
    theta = jax.random.normal(jax.random.key(21), (N_CLIENTS, DIM))
    s0 = s0._replace(params=theta)
    s1, info = jax.jit(alg.round)(s0, data)
    part = np.asarray(info.participants)
    assert part.sum() == 2
    A, b = quadratics(data)
    step = lr * alphas(data)[:, None] * (np.einsum("nij,nj->ni", A, theta) - b) / N_CLIENTS
    expected = np.where(part[:, None], np.asarray(theta) - step, np.asarray(theta))
    # one float32 step: the gradient over N_max rows of DIM terms (magnitudes |A| |theta| +
    # |b|, both sides of the residual), its scaling and the update (4 more)
    th = np.abs(np.asarray(theta, np.float64))
    size = lr * alphas(data)[:, None] * (np.einsum("nij,nj->ni", np.abs(A), th) + np.abs(b))
    atol = reordered_sum(data.max_count + DIM + 4) * (th + 2 * size / N_CLIENTS).max()
    np.testing.assert_allclose(np.asarray(s1.params), expected, rtol=0, atol=atol)


def test_ifca_cluster_without_participants_keeps_its_model():
    data = problem().train
    far = jnp.stack([zeros(), jnp.full((DIM,), 1e3)])  # nobody picks cluster 1
    alg = ifca(LOSS, num_clusters=2, learning_rate=0.1, clients_per_round=3, batch_size=4,
               initial_clusters=far)  # fmt: skip
    state, infos, _ = run(alg, zeros(), data, jax.random.key(22), 20)
    clusters = np.asarray(state.extra.clusters)
    np.testing.assert_array_equal(clusters[1], np.asarray(far[1]))
    assert np.abs(clusters[0]).max() > 0.1  # cluster 0 trained
    assert np.all(np.asarray(state.extra.assignment) == 0)
