"""pFedMe (Dinh, Tran and Nguyen 2020): personalization through Moreau envelopes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from karula_jax._checks import check_nonnegative, check_positive, check_positive_int
from karula_jax.algorithms._rounds import begin_round, own_params, round_info, start_state
from karula_jax.algorithms._sampling import client_batch, client_keys, run_key
from karula_jax.algorithms._trees import all_finite, scatter, tree_sq_dist, weighted_mean
from karula_jax.algorithms._validation import check_clients_per_round, check_params, check_weights
from karula_jax.algorithms.base import Algorithm, FedState, LossFn
from karula_jax.data.clients import ClientData

__all__ = ["pfedme"]


def pfedme(
    loss: LossFn,
    *,
    learning_rate,
    clients_per_round: int,
    batch_size: int,
    lam: float = 15.0,
    personal_learning_rate: float = 0.01,
    inner_steps: int = 5,
    local_steps: int = 5,
    beta: float = 1.0,
    weights=None,
) -> Algorithm:
    """pFedMe: a global model ``w`` and personalized models near it.

    Client ``i``'s personalized model is the proximal point
    ``theta_i(w) = argmin_theta f_i(theta) + lam/2 ||theta - w||^2``, and the global
    model minimizes the weighted Moreau envelopes ``sum_i alpha_i M_i(w)`` with
    ``grad M_i(w) = lam (w - theta_i(w))``. One round:

    1. Each participant copies ``w_i = w`` and repeats ``R = local_steps`` times: draw a
       minibatch; approximate ``theta_i(w_i)`` on it by ``K = inner_steps`` gradient
       steps of size ``personal_learning_rate``, starting from ``w_i``; then
       ``w_i <- w_i - learning_rate * lam * (w_i - theta_i)`` (a gradient step on the
       envelope, so ``learning_rate`` plays the role of a step on ``M_i``).
    2. The server sets ``w <- (1 - beta) w + beta * sum_S alpha_i w_i / sum_S alpha_i``
       (pFedMe averages uniformly; weighting by ``alpha`` ~ ``N_i`` matches the other
       baselines here and equals it when clients have equal sizes).

    Choices the paper leaves open: the inner solve restarts from ``w_i`` at every local
    step (the reference code carries the personalized model instead; with ``K`` large
    both reach the same proximal point); the participant's last ``theta_i`` is its
    personalized model, and non-participants keep theirs (initially ``w``).

    Fixed point with ``R = 1``, exact inner solves and full gradients:
    ``w = sum_i alpha_i theta_i(w) / sum_i alpha_i``.

    Args:
      loss: ``loss(params, x, y, mask) -> scalar``.
      learning_rate: step on the envelope, ``>= 0``; may be traced.
      clients_per_round: ``s`` (static).
      batch_size: ``B`` (static).
      lam: proximal weight ``lambda > 0``.
      personal_learning_rate: inner step size ``> 0``.
      inner_steps: ``K`` (static).
      local_steps: ``R`` (static).
      beta: server mixing ``beta > 0`` (1 = plain average; pFedMe uses 1 to 2).
      weights: optional ``alpha`` of shape ``[n]``.

    Returns:
      An :class:`Algorithm`; ``state.params`` are the personalized models ``[n, ...]``,
      ``state.extra`` the global model ``w`` (no client axis).
    """
    check_nonnegative("learning_rate", learning_rate)
    s = check_positive_int("clients_per_round", clients_per_round)
    B = check_positive_int("batch_size", batch_size)
    check_positive("lam", lam)
    check_positive("personal_learning_rate", personal_learning_rate)
    K = check_positive_int("inner_steps", inner_steps)
    R = check_positive_int("local_steps", local_steps)
    check_positive("beta", beta)
    check_weights(weights)

    def client(w, x, y, count, key):
        def prox_objective(theta, center, xb, yb, mb):
            value = loss(theta, xb, yb, mb)
            return value + 0.5 * lam * tree_sq_dist(theta, center), value

        grad = jax.grad(prox_objective, has_aux=True)

        def local_step(carry, r):
            w_i, _ = carry
            xb, yb, mb = client_batch(jax.random.fold_in(key, r), x, y, count, B)

            def inner(theta, _):
                g, value = grad(theta, w_i, xb, yb, mb)
                theta = jax.tree.map(lambda a, b: a - personal_learning_rate * b, theta, g)
                return theta, value

            theta, values = lax.scan(inner, w_i, None, length=K)
            w_i = jax.tree.map(lambda a, b: a - learning_rate * lam * (a - b), w_i, theta)
            return (w_i, theta), values[0]

        (w_i, theta), values = lax.scan(local_step, (w, w), jnp.arange(R))
        return w_i, theta, values[0]

    def init(params, data: ClientData, *, key) -> FedState:
        check_params(loss, params, data)
        n = data.num_clients
        check_clients_per_round(s, n)
        w = jax.tree.map(jnp.asarray, params)
        return start_state(w, n, run_key(key), extra=w)

    def round_fn(state: FedState, data: ClientData):
        alpha, mask, idx, key_batch = begin_round(state, data, s, weights)
        w = state.extra
        keys = client_keys(key_batch, idx)
        w_rows, thetas, values = jax.vmap(client, in_axes=(None, 0, 0, 0, 0))(
            w, data.x[idx], data.y[idx], data.counts[idx], keys
        )
        a_s = alpha[idx]
        avg = weighted_mean(w_rows, a_s, otherwise=w)
        w = jax.tree.map(lambda old, new: (1 - beta) * old + beta * new, w, avg)
        params = scatter(state.params, idx, thetas)
        info = round_info(values, a_s, mask, all_finite(values, thetas, w))
        return state._replace(params=params, extra=w, round=state.round + 1), info

    return Algorithm(init=init, round=round_fn, client_params=own_params)
