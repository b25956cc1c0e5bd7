"""Tiny ridge problems and their closed forms, shared by the algorithm tests."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

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
