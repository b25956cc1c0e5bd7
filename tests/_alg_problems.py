"""Tiny ridge problems and their closed forms, shared by the algorithm tests."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from _tolerances import accumulated_rounding, reordered_sum

from karula_jax.algorithms._sampling import client_keys
from karula_jax.data import client_weights, synthetic_ridge
from karula_jax.models import ridge_loss

LAM = 0.1
N_CLIENTS = 6
DIM = 3


@functools.cache
def problem(seed: int = 0):
    """Six ridge clients in three groups, 5 to 12 rows each, d = 3."""
    return synthetic_ridge(
        seed, num_clients=N_CLIENTS, dim=DIM, min_samples=5, max_samples=12, num_test=5
    )


LOSS = ridge_loss(LAM)


def quadratics(data, lam: float = LAM):
    """``f_i(theta) = theta^T A_i theta / 2 - b_i^T theta + const`` in float64."""
    x = np.asarray(data.x, np.float64)
    y = np.asarray(data.y, np.float64)
    counts = np.asarray(data.counts)
    mask = np.arange(x.shape[1])[None, :] < counts[:, None]
    x = np.where(mask[..., None], x, 0.0)
    y = np.where(mask, y, 0.0)
    A = np.einsum("nki,nkj->nij", x, x) / counts[:, None, None] + lam * np.eye(x.shape[2])
    b = np.einsum("nki,nk->ni", x, y) / counts[:, None]
    return A, b


def alphas(data) -> np.ndarray:
    return np.asarray(client_weights(data.counts), np.float64)


def full_grads(data, theta) -> np.ndarray:
    """``grad f_i(theta_i)`` for every client, ``[n, d]``."""
    A, b = quadratics(data)
    return np.einsum("nij,nj->ni", A, np.asarray(theta, np.float64)) - b


def grad_magnitudes(data, theta, lam: float = LAM, intercept: float = 0.0) -> np.ndarray:
    """Every client's ridge gradient taken in magnitude, ``|X_i|^T (|X_i| |theta_i| + |c| +
    |y_i|) / N_i + lam |theta_i|``, ``[n, d]`` (``theta`` ``[d]`` or ``[n, d]``, ``c`` an
    intercept): the scale that a float32 gradient's rounding is relative to."""
    x = np.abs(np.asarray(data.x, np.float64))
    y = np.abs(np.asarray(data.y, np.float64))
    mask = np.arange(x.shape[1])[None, :] < np.asarray(data.counts)[:, None]
    x, y = np.where(mask[..., None], x, 0.0), np.where(mask, y, 0.0)
    th = np.abs(np.broadcast_to(np.asarray(theta, np.float64), (x.shape[0], x.shape[2])))
    resid = np.einsum("nkd,nd->nk", x, th) + abs(intercept) + y
    counts = np.maximum(np.asarray(data.counts), 1)[:, None]
    return np.einsum("nkd,nk->nd", x, resid) / counts + lam * th


def gd_contraction(data, eta: float) -> float:
    """``max_i |I - eta alpha_i A_i / n|_2``: the factor by which a round of full-batch
    gradient steps on the weighted objective, followed by any nonexpansive map (a proximal
    step, an average over a group), contracts the distance between two iterates."""
    A, _ = quadratics(data)
    a = alphas(data)
    eig = np.linalg.eigvalsh(A)
    return float(np.max(np.abs(1 - eta * a[:, None] * eig / len(a))))


def round_rounding(data, theta, eta: float, extra: int = 0, intercept: float = 0.0) -> float:
    """Norm of one float32 round's rounding near ``theta`` ``[n, d]``: the full-batch ridge
    gradient (``N_max + d + 3`` roundings of its magnitude, :func:`grad_magnitudes`), the step
    ``eta alpha_i / n`` times it, and ``4 + extra`` roundings of ``theta`` (the update, and
    ``extra`` for a proximal step or an average over clients)."""
    terms = np.asarray(data.x).shape[1] + DIM + 3 + extra
    grads = grad_magnitudes(data, theta, intercept=intercept)
    step = eta * alphas(data)[:, None] / len(theta) * grads
    size = np.linalg.norm(step) + np.linalg.norm(theta) + np.sqrt(len(theta)) * abs(intercept)
    return reordered_sum(terms + 4) * float(size)


def fixed_point_error(rho: float, rounds: int, start: float, per_round: float) -> float:
    """Distance of a float32 run of a ``rho``-contraction from its exact fixed point after
    ``rounds`` rounds from a start ``start`` away, each round rounding by ``per_round``: the
    start's error contracted, ``rho^rounds start``, plus the rounding's, at most
    ``per_round / (1 - rho)``."""
    return rho**rounds * start + accumulated_rounding(per_round, 1 - rho)


def power_shortfall(A, key, iterations: int = 20) -> np.ndarray:
    """``1 - |A^k v| / (|A^(k-1) v| lambda_max)`` in float64 for each client's Hessian ``A_i``
    ``[n, d, d]`` and the start that :func:`karula_jax.algorithms.smoothness_estimate` draws
    from ``key``: what ``k`` power steps leave of ``L_i``."""
    keys = client_keys(key, jnp.arange(len(A)))
    out = []
    for A_i, k in zip(A, keys, strict=True):
        v = np.asarray(jax.random.normal(k, (A_i.shape[0],), jnp.float32), np.float64)
        for _ in range(iterations - 1):
            v = A_i @ v
            v /= np.linalg.norm(v)
        out.append(1 - np.linalg.norm(A_i @ v) / np.linalg.eigvalsh(A_i)[-1])
    return np.asarray(out)


def global_ridge(data) -> np.ndarray:
    """``argmin_w sum_i alpha_i f_i(w)``."""
    A, b = quadratics(data)
    a = alphas(data)
    return np.linalg.solve(np.einsum("n,nij->ij", a, A), np.einsum("n,ni->i", a, b))


def true_dissimilarity(seed: int = 0) -> np.ndarray:
    th = np.asarray(problem(seed).theta_true, np.float64)
    return ((th[:, None] - th[None]) ** 2).sum(-1)


def scan_run(alg, params0, data, key, rounds: int):
    """``init``, then ``rounds`` rounds in one ``lax.scan``: (state, infos, client params)."""
    state = alg.init(params0, data, key=key)

    def body(st, _):
        st, info = alg.round(st, data)
        return st, (info, alg.client_params(st, data))

    state, (infos, traj) = jax.lax.scan(body, state, None, length=rounds)
    return state, infos, traj


def intercept_loss(p, x, y, mask):
    """Ridge with an intercept: ``p = {"w": [d], "c": []}``, both penalized by LAM."""
    r = jnp.where(mask, x @ p["w"] + p["c"] - y, 0.0)
    reg = jnp.sum(p["w"] ** 2) + p["c"] ** 2
    return jnp.sum(r * r) / (2 * jnp.sum(mask)) + 0.5 * LAM * reg


def zeros():
    return jnp.zeros((DIM,), jnp.float32)
