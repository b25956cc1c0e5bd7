"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar and Smith 2020): FedAvg with a proximal term."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from karula_jax._checks import check_nonnegative, check_positive_int
from karula_jax.algorithms._local import aggregate
from karula_jax.algorithms._personalized import (
    check_personalized,
    personalized_flags,
    shared_leaves,
)
from karula_jax.algorithms._rounds import begin_round, own_params, round_info, start_state
from karula_jax.algorithms._sampling import client_batch, client_keys, run_key
from karula_jax.algorithms._trees import all_finite, first_row, gather, weighted_mean
from karula_jax.algorithms._validation import check_clients_per_round, check_params, check_weights
from karula_jax.algorithms.base import Algorithm, LossFn
from karula_jax.data.clients import ClientData

__all__ = ["fedprox"]


def fedprox(
    loss: LossFn,
    *,
    mu,
    learning_rate,
    clients_per_round: int,
    batch_size: int,
    local_steps: int = 5,
    weights=None,
    personalized: Any = False,
) -> Algorithm:
    """FedProx: :func:`fedavg` whose local steps also pull towards the received model.

    Each participant starts from the model it receives, ``w0`` (the global model, plus
    its own personalized leaves), and takes ``E = local_steps`` SGD steps on
    ``f_i(w) + mu/2 ||w - w0||^2``, a fresh minibatch each step::

        w_i <- w_i - learning_rate * (g_i(w_i) + mu * (w_i - w0))

    then the server replaces the shared leaves by ``sum_S alpha_i w_i / sum_S alpha_i``
    exactly as :func:`fedavg` does. The keys and minibatches are FedAvg's, so
    ``mu = 0`` reproduces :func:`fedavg` bit for bit. A larger ``mu`` keeps the local
    models closer to ``w0``, which limits client drift (and slows local progress).

    Fixed point with full participation and exact gradients on quadratics
    ``f_i(w) = w^T A_i w / 2 - b_i^T w``: a client's ``E`` steps are affine in ``w0``,
    ``w_i = P_i w0 + q_i`` with ``M_i = I - lr (A_i + mu I)``, ``S_i = sum_{k<E} M_i^k``,
    ``P_i = M_i^E + lr mu S_i`` and ``q_i = lr S_i b_i``; the fixed point solves
    ``(I - sum_i p_i P_i) w = sum_i p_i q_i`` with ``p_i = alpha_i / sum_j alpha_j``.

    Args:
      loss: ``loss(params, x, y, mask) -> scalar``.
      mu: proximal weight ``mu >= 0`` (finite); may be traced.
      learning_rate: local step size ``>= 0``; may be traced.
      clients_per_round: ``s`` (static).
      batch_size: ``B`` (static).
      local_steps: ``E`` (static), default 5.
      weights: optional ``alpha`` of shape ``[n]``.
      personalized: True, False or a pytree of bools like ``params``
        (:mod:`~karula_jax.algorithms._personalized`): True leaves are kept by each client
        and never averaged (as in :func:`fedavg`; the proximal term pulls them towards the
        client's own previous value). Default False: one global model.

    Returns:
      An :class:`Algorithm`; ``state.params`` holds the global leaves once (``[1, ...]``)
      and personalized leaves per client (``[n, ...]``); ``client_params`` gives each
      client's model.
    """
    check_nonnegative("mu", mu)
    check_nonnegative("learning_rate", learning_rate)
    s = check_positive_int("clients_per_round", clients_per_round)
    B = check_positive_int("batch_size", batch_size)
    E = check_positive_int("local_steps", local_steps)
    check_weights(weights)
    check_personalized(personalized)

    def client(w0, x, y, count, key):
        def step(p, e):
            xb, yb, mb = client_batch(jax.random.fold_in(key, e), x, y, count, B)
            value, g = jax.value_and_grad(loss)(p, xb, yb, mb)
            p = jax.tree.map(lambda a, b, c: a - learning_rate * (b + mu * (a - c)), p, g, w0)
            return p, value

        w, values = lax.scan(step, w0, jnp.arange(E))
        return w, values[0]

    def init(params, data: ClientData, *, key):
        check_params(loss, params, data)
        check_clients_per_round(s, data.num_clients)
        shared = shared_leaves(personalized, params)
        return start_state(params, data.num_clients, run_key(key), shared=shared)

    def round_fn(state, data: ClientData):
        alpha, mask, idx, key_batch = begin_round(state, data, s, weights)
        keys = client_keys(key_batch, idx)
        rows, values = jax.vmap(client)(
            gather(state.params, idx), data.x[idx], data.y[idx], data.counts[idx], keys
        )
        a_s = alpha[idx]
        avg = weighted_mean(rows, a_s, otherwise=first_row(state.params))
        params = aggregate(state.params, idx, rows, avg, personalized_flags(personalized, avg))
        info = round_info(values, a_s, mask, all_finite(values, rows))
        return state._replace(params=params, round=state.round + 1), info

    return Algorithm(init=init, round=round_fn, client_params=own_params)
