"""Ditto, FedProx and SCAFFOLD against closed forms, FedAvg and each other."""

from __future__ import annotations

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
    global_ridge,
    intercept_loss,
    problem,
    quadratics,
    scan_run,
    zeros,
)
from _tolerances import EPS32, iteration_floor, reordered_sum

from karula_jax.algorithms import ditto, fedavg, fedprox, scaffold
from karula_jax.training import product_grid, vmap_algorithm

FULL = 64
run = jax.jit(scan_run, static_argnums=(0, 4))


@pytest.fixture(autouse=True)
def _fresh_trace_counters():
    chex.clear_trace_counter()


def _max_eig(data) -> float:
    A, _ = quadratics(data)
    return float(np.linalg.eigvalsh(A)[:, -1].max())


def _fedavg_fixed_point(data, lr, E, mu=0.0):
    """Fixed point of w -> sum_i p_i (P_i w + q_i), client i's E FedProx steps (mu=0: FedAvg)."""
    A, b = quadratics(data)
    p = alphas(data) / alphas(data).sum()
    P, q = [], []
    for Ai, bi in zip(A, b, strict=True):
        M = np.eye(DIM) - lr * (Ai + mu * np.eye(DIM))
        S = sum(np.linalg.matrix_power(M, k) for k in range(E))
        P.append(np.linalg.matrix_power(M, E) + lr * mu * S)
        q.append(lr * S @ bi)
    P, q = np.stack(P), np.stack(q)
    return np.linalg.solve(np.eye(DIM) - np.einsum("n,nij->ij", p, P), p @ q)


def _round_floor(data, lr, E, mu=0.0) -> tuple[float, float]:
    """``(rho, floor)`` of the round ``w -> sum_i p_i (P_i w + q_i)`` of
    :func:`_fedavg_fixed_point` in float32: ``rho = lambda_max(sum_i p_i P_i)`` its
    contraction, and ``floor`` the relative error its rounding keeps up, at any round: E
    steps' gradients (N_max rows of DIM terms, of the residual's two magnitudes, times
    lr L) and updates, and the client mean, summed over ``1 / (1 - rho)`` rounds."""
    A, _ = quadratics(data)
    p = alphas(data) / alphas(data).sum()
    M = np.eye(DIM)[None] - lr * (A + mu * np.eye(DIM))
    S = sum(np.linalg.matrix_power(M, k) for k in range(E))
    P = np.stack([np.linalg.matrix_power(m, E) for m in M]) + lr * mu * S
    rho = float(np.linalg.eigvalsh(np.einsum("n,nij->ij", p, P))[-1])
    grad = reordered_sum(data.max_count + DIM + 2) * 2 * lr * (_max_eig(data) + mu)
    rounding = E * (grad + EPS32 / 2) + reordered_sum(N_CLIENTS)
    return rho, rounding / (1.0 - rho)


def _floor(H, lr: float, terms: int) -> float:
    """float32's floor (relative) of ``w <- w - lr (H w - b)`` with gradients of ``terms``
    roundings (:func:`iteration_floor`)."""
    ev = np.linalg.eigvalsh(H)
    return iteration_floor(ev[-1] / ev[0], terms, step=lr * ev[-1])


def _minibatch_rounds(batch: int, clients: int, steps: int) -> float:
    """Relative float32 difference of two programs for one minibatch run, ``steps`` local
    steps in all: each a gradient over ``batch`` rows of DIM terms, a mean over ``clients``
    and 2 updates. Minibatch steps need not contract, so the rounding adds up step by step."""
    return reordered_sum(batch * DIM + clients + 2, rounds=steps)


# --------------------------------------------------------------------------- Ditto


def test_ditto_global_model_is_fedavg_and_lam_inf_copies_it():
    data = problem().train
    key = jax.random.key(30)
    kw = dict(learning_rate=0.2, clients_per_round=3, batch_size=4, local_steps=3)
    _, i1, t1 = run(fedavg(LOSS, **kw), zeros(), data, key, 20)
    alg = ditto(LOSS, lam=jnp.inf, **kw)
    state, i2, t2 = run(alg, zeros(), data, key, 20)
    np.testing.assert_array_equal(i1.participants, i2.participants)
    np.testing.assert_array_equal(np.asarray(state.extra), np.asarray(t1[-1, 0]))
    # lam = inf: a participant's personal model is exactly the global model it received
    s1, info = jax.jit(alg.round)(state, data)
    part = np.asarray(info.participants)
    v0, v1 = np.asarray(state.params), np.asarray(s1.params)
    np.testing.assert_array_equal(
        v1[part], np.broadcast_to(np.asarray(state.extra), v1[part].shape)
    )
    np.testing.assert_array_equal(v1[~part], v0[~part])
    assert bool(jnp.all(i2.finite))


def test_ditto_grid_reaches_closed_forms():
    """E = 1, exact gradients, full participation: w = argmin F and
    v_i = (A_i + lam I)^{-1} (b_i + lam w); lam = 0 is local ridge, lam = inf is w.
    The lam grid runs vmapped (traced lam) and matches single runs."""
    data = problem().train
    A, b = quadratics(data)
    lams = np.array([0.0, 2.0, np.inf])
    L = _max_eig(data)

    def make(lam):
        return ditto(LOSS, lam=lam, learning_rate=1.0 / L, clients_per_round=N_CLIENTS,
                     batch_size=FULL, local_steps=1, personal_steps=4)  # fmt: skip

    keys = jax.random.split(jax.random.key(31), 1)
    batched = vmap_algorithm(make, product_grid(lam=lams))
    state, infos, _ = run(batched, zeros(), data, keys, 400)
    w_star = global_ridge(data)
    eye = np.eye(DIM)[None]
    p = alphas(data) / alphas(data).sum()
    local = np.linalg.solve(A, b[..., None])[..., 0]
    ditto2 = np.linalg.solve(A + 2.0 * eye, (b + 2.0 * w_star)[..., None])[..., 0]
    scale = max(np.abs(w_star).max(), np.abs(local).max(), np.abs(ditto2).max())
    # the global model: w <- w - (H w - b) / L with H = sum_i p_i A_i, 400 rounds leaving
    # 1e-17 of the start, then float32's floor (gradients averaged over the n clients)
    terms = data.max_count + DIM + 2
    floor_w = _floor(np.einsum("n,nij->ij", p, A), 1.0 / L, terms + N_CLIENTS)
    # a personal model: 4 steps a round of gradient descent on A_i + lam I at the step
    # (1 / L) / (1 + lam / L) (the proximal form), toward a target that moves with w
    floors = [
        floor_w + max(_floor(a + lam * eye[0], 1.0 / (L + lam), terms) for a in A)
        for lam in (0.0, 2.0)
    ]
    np.testing.assert_allclose(
        np.asarray(state.extra[0]), np.stack([w_star] * 3), rtol=0, atol=floor_w * scale
    )
    v = np.asarray(batched.client_params(state, data))[0]  # [G, n, d]
    np.testing.assert_allclose(v[0], local, rtol=0, atol=floors[0] * scale)
    np.testing.assert_allclose(v[1], ditto2, rtol=0, atol=floors[1] * scale)
    w_rows = np.broadcast_to(w_star, v[2].shape)
    np.testing.assert_allclose(v[2], w_rows, rtol=0, atol=floor_w * scale)  # lam = inf: w
    # personalization is real: lam = 2 lies strictly between local and global
    assert np.linalg.norm(ditto2 - local) > 0.05 and np.linalg.norm(ditto2 - w_star) > 0.05
    assert bool(jnp.all(infos.finite))
    single, _, _ = run(make(2.0), zeros(), data, keys[0], 400)
    # two float32 runs, each within its floor of the exact one (measured 1e-7 apart)
    np.testing.assert_allclose(np.asarray(single.params), v[1], rtol=0, atol=2 * floors[1] * scale)


def test_ditto_personalized_intercept_closed_form():
    """Only the intercept is personal: w-leaves are the global model's, and
    c_i = argmin_c f_i(w*, c) + lam/2 (c - c*)^2 with (w*, c*) the global ridge fit."""
    data = problem().train
    a = alphas(data)
    x, y = np.asarray(data.x, np.float64), np.asarray(data.y, np.float64)
    counts = np.asarray(data.counts)
    # global fit of [w, c]: augmented features [x, 1], ridge on both
    rows, rhs = [], []
    for i, N in enumerate(counts):
        xa = np.concatenate([x[i, :N], np.ones((N, 1))], axis=1)
        rows.append(np.sqrt(a[i] / N) * xa)
        rhs.append(np.sqrt(a[i] / N) * y[i, :N])
        rows.append(np.sqrt(a[i] * LAM) * np.eye(DIM + 1))
        rhs.append(np.zeros(DIM + 1))
    stacked = np.concatenate(rows)
    g = np.linalg.lstsq(stacked, np.concatenate(rhs), rcond=None)[0]
    w_star, c_star = g[:DIM], g[DIM]
    lam = 0.5
    resid = np.array([np.mean(y[i, :N] - x[i, :N] @ w_star) for i, N in enumerate(counts)])
    c_ref = (resid + lam * c_star) / (1.0 + LAM + lam)
    alg = ditto(intercept_loss, lam=lam, learning_rate=0.2, clients_per_round=N_CLIENTS,
                batch_size=FULL, local_steps=1, personal_steps=3,
                personalized={"w": False, "c": True})  # fmt: skip
    state, _, _ = run(alg, {"w": zeros(), "c": jnp.zeros(())}, data, jax.random.key(32), 600)
    params = alg.client_params(state, data)
    w_rows = np.asarray(params["w"])
    np.testing.assert_array_equal(
        w_rows, np.broadcast_to(np.asarray(state.extra["w"]), w_rows.shape)
    )
    # 1e-4: what 600 rounds at 0.2 leave of the start (measured 3e-7 of it), at least
    # float32's floor of the global fit (its Hessian: the stacked rows' Gram over sum alpha)
    # and of the intercepts, which follow w (twice the floor, of the fit's scale)
    floor = _floor(stacked.T @ stacked / a.sum(), 0.2, counts.max() + DIM + N_CLIENTS + 3)
    tol = max(1e-4, 2 * floor * np.abs(g).max())
    np.testing.assert_allclose(w_rows[0], w_star, rtol=1e-4, atol=tol)
    np.testing.assert_allclose(np.asarray(params["c"]), c_ref, rtol=1e-4, atol=tol)
    assert np.ptp(c_ref) > 0.05  # the intercepts really differ


# --------------------------------------------------------------------------- FedProx


def test_fedprox_mu_zero_is_fedavg_bit_for_bit():
    data = problem().train
    key = jax.random.key(33)
    kw = dict(learning_rate=0.3, clients_per_round=2, batch_size=4, local_steps=3)
    _, i1, t1 = run(fedavg(LOSS, **kw), zeros(), data, key, 30)
    _, i2, t2 = run(fedprox(LOSS, mu=0.0, **kw), zeros(), data, key, 30)
    np.testing.assert_array_equal(np.asarray(i1.loss), np.asarray(i2.loss))
    np.testing.assert_array_equal(np.asarray(t1), np.asarray(t2))
    # with a personalized intercept too
    pers = {"w": False, "c": True}
    p0 = {"w": zeros(), "c": jnp.zeros(())}
    _, _, t3 = run(fedavg(intercept_loss, personalized=pers, **kw), p0, data, key, 10)
    _, _, t4 = run(fedprox(intercept_loss, mu=0.0, personalized=pers, **kw), p0, data, key, 10)
    chex.assert_trees_all_equal(t3, t4)


def test_fedprox_reaches_its_closed_form_fixed_point():
    data = problem().train
    E, mu = 5, 0.5
    lr = 0.5 / (_max_eig(data) + mu)
    fixed = _fedavg_fixed_point(data, lr, E, mu)
    alg = fedprox(LOSS, mu=mu, learning_rate=lr, clients_per_round=N_CLIENTS, batch_size=FULL,
                  local_steps=E)  # fmt: skip
    state, infos, _ = run(alg, zeros(), data, jax.random.key(34), 300)
    w = np.asarray(state.params)
    assert np.ptp(w, axis=0).max() == 0.0
    # rho^300 of the start (rho = 0.6) and float32's floor (3e-5 of |w|)
    rho, floor = _round_floor(data, lr, E, mu)
    np.testing.assert_allclose(w[0], fixed, rtol=0, atol=(rho**300 + floor) * np.abs(fixed).max())
    # the proximal term moves the fixed point: it lies between FedAvg's and argmin F
    avg = _fedavg_fixed_point(data, lr, E)
    star = global_ridge(data)
    assert np.linalg.norm(fixed - star) < np.linalg.norm(avg - star)
    assert np.linalg.norm(fixed - avg) > 100 * np.linalg.norm(w[0] - fixed)  # resolved
    assert bool(jnp.all(infos.finite))


# --------------------------------------------------------------------------- SCAFFOLD


# what the rounds leave of the start (measured 2e-7 and 7e-8 of argmin F)
@pytest.mark.parametrize(("s", "rounds", "left"), [(N_CLIENTS, 60, 1e-5), (2, 200, 1e-4)])
def test_scaffold_removes_client_drift(s, rounds, left):
    data = problem().train
    E = 5
    lr = 0.5 / _max_eig(data)
    star = global_ridge(data)
    drift = np.linalg.norm(_fedavg_fixed_point(data, lr, E) - star) / np.linalg.norm(star)
    assert drift > 1e-2  # FedAvg stops at a measurable distance from argmin F
    alg = scaffold(LOSS, learning_rate=lr, clients_per_round=s, batch_size=FULL, local_steps=E)
    state, infos, _ = run(alg, zeros(), data, jax.random.key(35), rounds)
    w = np.asarray(state.params)
    assert np.ptp(w, axis=0).max() == 0.0
    rel = np.linalg.norm(w[0] - star) / np.linalg.norm(star)
    # at least float32's floor of such a round (its corrected steps contract as FedAvg's):
    # 4.7e-5, which raises the full-participation case from 1e-5
    tol = max(left, _round_floor(data, lr, E)[1])
    assert rel < tol < drift, (rel, drift)
    # the server control stays the alpha-weighted mean of the client controls: updated
    # by increments, whose rounding (a mean of n) adds up over the rounds; raised from 1e-5
    # (measured 1.4e-7) to that bound, 3e-5 to 1e-4 of the controls' scale
    a = alphas(data)
    memory = np.asarray(state.memory, np.float64)
    c_mean = np.einsum("n,ni->i", a, memory) / a.sum()
    atol = reordered_sum(N_CLIENTS + 2, rounds=rounds) * np.abs(memory).max()
    np.testing.assert_allclose(np.asarray(state.extra), c_mean, atol=atol)
    # ... and with full participation each client control converges to grad f_i(argmin F):
    # off by L times w's distance, and the gradients' own rounding of |A| |w| + |b|
    if s == N_CLIENTS:
        A, b = quadratics(data)
        size = np.abs(A) @ np.abs(star) + np.abs(b)
        atol = (
            _max_eig(data) * tol * np.linalg.norm(star)
            + reordered_sum(data.max_count + DIM + 2) * np.abs(size).max()
        )
        np.testing.assert_allclose(np.asarray(state.memory), A @ star - b, rtol=0, atol=atol)
    assert bool(jnp.all(infos.finite))


def test_scaffold_first_round_is_fedavg_and_personalized_leaves_have_no_control():
    data = problem().train
    key = jax.random.key(36)
    kw = dict(learning_rate=0.2, clients_per_round=3, batch_size=4, local_steps=3)
    _, _, t1 = run(fedavg(LOSS, **kw), zeros(), data, key, 1)
    _, _, t2 = run(scaffold(LOSS, **kw), zeros(), data, key, 1)
    # one round, 3 local steps on 3 clients' batches of 4; raised from 1e-6 (measured: equal)
    tol = _minibatch_rounds(4, 3, 3) * float(np.abs(np.asarray(t1)).max())
    np.testing.assert_allclose(np.asarray(t1), np.asarray(t2), rtol=0, atol=tol)
    alg = scaffold(intercept_loss, personalized={"w": False, "c": True}, **kw)
    p0 = {"w": zeros(), "c": jnp.zeros(())}
    state, infos, _ = run(alg, p0, data, key, 10)
    assert np.all(np.asarray(state.memory["c"]) == 0) and np.asarray(state.extra["c"]) == 0
    assert np.abs(np.asarray(state.memory["w"])).max() > 1e-3  # controls of O(1) gradients
    assert np.ptp(np.asarray(state.params["w"]), axis=0).max() == 0.0
    assert np.ptp(np.asarray(state.params["c"])) > 1e-3  # intercepts of O(1) labels differ
    assert bool(jnp.all(infos.finite))


# --------------------------------------------------------------------------- compile once, grids


@pytest.mark.parametrize(
    ("make", "values"),
    [
        (
            lambda h: ditto(
                LOSS, lam=h, learning_rate=0.1, clients_per_round=2, batch_size=4, local_steps=2
            ),
            [0.0, 1.0, jnp.inf],
        ),  # fmt: skip
        (
            lambda h: fedprox(LOSS, mu=h, learning_rate=0.1, clients_per_round=2, batch_size=4),
            [0.0, 0.5, 2.0],
        ),
        (
            lambda h: scaffold(
                LOSS, learning_rate=0.1, global_learning_rate=h, clients_per_round=2, batch_size=4
            ),
            [1.0, 0.5, 2.0],
        ),  # fmt: skip
    ],
    ids=["ditto", "fedprox", "scaffold"],
)
def test_traced_hyperparameters_compile_once_and_batch(make, values):
    data = problem().train
    key = jax.random.key(37)

    def final(h, key):
        return scan_run(make(h), zeros(), data, key, 5)[0].params

    counted = jax.jit(chex.assert_max_traces(final, n=1))
    singles = [np.asarray(counted(jnp.float32(h), key)) for h in values]  # a retrace raises
    assert all(np.all(np.isfinite(x)) for x in singles)
    # vmapped against single runs: 5 rounds of at most 5 + 5 steps (local, personal) on 2
    # clients' batches of 4 (measured 1e-7; the bound is 6e-5 of the models' scale)
    tol = _minibatch_rounds(4, 2, 5 * 10) * float(np.abs(np.stack(singles)).max())
    # the hyperparameter matters: beyond the rounding (measured 0.03 to 0.45); was 1e-6
    assert np.abs(singles[1] - singles[0]).max() > tol
    grid = jax.jit(jax.vmap(final, in_axes=(0, None)))(jnp.asarray(values, jnp.float32), key)
    np.testing.assert_allclose(np.asarray(grid), np.stack(singles), rtol=0, atol=tol)


# --------------------------------------------------------------------------- bad inputs

HP = dict(learning_rate=0.1, clients_per_round=2, batch_size=4)
MAKERS = {
    "ditto": lambda **kw: ditto(LOSS, **{"lam": 1.0, **HP, **kw}),
    "fedprox": lambda **kw: fedprox(LOSS, **{"mu": 0.1, **HP, **kw}),
    "scaffold": lambda **kw: scaffold(LOSS, **{**HP, **kw}),
}
BAD = [
    ("ditto", {"lam": -1.0}, ValueError, "lam"),
    ("ditto", {"lam": float("nan")}, ValueError, "lam"),
    ("ditto", {"lam": "big"}, TypeError, "lam"),
    ("ditto", {"personal_learning_rate": -0.1}, ValueError, "personal_learning_rate"),
    ("ditto", {"personal_steps": 0}, ValueError, "personal_steps"),
    ("ditto", {"personal_steps": 2.0}, TypeError, "personal_steps"),
    ("ditto", {"local_steps": 1.5}, TypeError, "local_steps"),
    ("fedprox", {"mu": -0.1}, ValueError, "mu"),
    ("fedprox", {"mu": float("inf")}, ValueError, "mu"),
    ("fedprox", {"mu": float("nan")}, ValueError, "mu"),
    ("fedprox", {"learning_rate": float("nan")}, ValueError, "learning_rate"),
    ("fedprox", {"local_steps": 0}, ValueError, "local_steps"),
    ("scaffold", {"learning_rate": 0.0}, ValueError, "learning_rate"),
    ("scaffold", {"learning_rate": -1.0}, ValueError, "learning_rate"),
    ("scaffold", {"global_learning_rate": float("nan")}, ValueError, "global_learning_rate"),
    ("scaffold", {"local_steps": 0}, ValueError, "local_steps"),
    ("scaffold", {"batch_size": 0}, ValueError, "batch_size"),
    ("scaffold", {"clients_per_round": True}, TypeError, "clients_per_round"),
]


@pytest.mark.parametrize(("name", "kw", "exc", "match"), BAD)
def test_bad_hyperparameters_named(name, kw, exc, match):
    with pytest.raises(exc, match=match):
        MAKERS[name](**kw)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_bad_init_named(name):
    data = problem().train
    key = jax.random.key(38)
    with pytest.raises(ValueError, match="clients_per_round=7 exceeds the number of clients n=6"):
        MAKERS[name](clients_per_round=7).init(zeros(), data, key=key)
    with pytest.raises(ValueError, match="personalized must have the tree structure"):
        MAKERS[name](personalized={"w": True}).init(zeros(), data, key=key)
    with pytest.raises(ValueError, match="params do not fit the data"):
        MAKERS[name]().init(jnp.zeros(DIM + 1), data, key=key)
