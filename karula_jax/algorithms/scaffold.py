"""SCAFFOLD (Karimireddy et al. 2020): FedAvg with control variates against client drift."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from karula_jax._checks import check_positive, check_positive_int
from karula_jax.algorithms._personalized import (
    check_personalized,
    personalized_flags,
    shared_leaves,
)
from karula_jax.algorithms._rounds import begin_round, own_params, round_info, start_state
from karula_jax.algorithms._sampling import client_batch, client_keys, run_key
from karula_jax.algorithms._trees import all_finite, broadcast, gather, scatter, weighted_mean
from karula_jax.algorithms._validation import check_clients_per_round, check_params, check_weights
from karula_jax.algorithms.base import Algorithm, FedState, LossFn
from karula_jax.data.clients import ClientData

__all__ = ["scaffold"]


def _client(loss, learning_rate, E, B, x0, correction, xd, yd, count, key):
    """``E`` steps ``y <- y - lr (g(y) + correction)`` with ``correction = c - c_i``."""

    def step(p, e):
        xb, yb, mb = client_batch(jax.random.fold_in(key, e), xd, yd, count, B)
        value, g = jax.value_and_grad(loss)(p, xb, yb, mb)
        p = jax.tree.map(lambda a, b, d: a - learning_rate * (b + d), p, g, correction)
        return p, value

    y, values = lax.scan(step, x0, jnp.arange(E))
    return y, values[0]


def _new_controls(flags, c_rows, delta, correction, E, learning_rate):
    """Option II controls ``c_i+`` of the participants, 0 on personalized leaves.

    ``c_i+ = c_i - c + (x - y) / (E lr) = -(c - c_i) - (y - x) / (E lr)``; a zero
    ``E lr`` (a traced learning rate of 0) leaves ``c_i+ = c_i - c``.
    """
    denom = E * jnp.asarray(learning_rate, jnp.float32)
    inv = jnp.where(denom > 0, 1.0 / jnp.where(denom > 0, denom, 1.0), 0.0)

    def new_control(f, ci, d, cor):
        return jnp.zeros_like(ci) if f else (-cor - inv * d).astype(ci.dtype)

    return jax.tree.map(new_control, flags, c_rows, delta, correction)


def scaffold(
    loss: LossFn,
    *,
    learning_rate,
    clients_per_round: int,
    batch_size: int,
    local_steps: int = 5,
    global_learning_rate=1.0,
    weights=None,
    personalized: Any = False,
) -> Algorithm:
    """SCAFFOLD with option II control variates.

    The server keeps the global model ``x`` and a control ``c``; client ``i`` keeps a
    control ``c_i`` (all controls start at 0). One round, with ``S`` the ``s`` sampled
    clients, ``lr = learning_rate`` and ``E = local_steps``:

    1. Each participant starts from ``y = x`` and takes ``E`` corrected SGD steps
       (a fresh minibatch each, the keys of :func:`fedavg`)::

           y <- y - lr * (g_i(y) - c_i + c)

    2. It updates its control (option II) ``c_i+ = c_i - c + (x - y) / (E lr)``.
    3. The server moves ``x <- x + global_learning_rate * sum_S alpha_i (y_i - x) /
       sum_S alpha_i`` and ``c <- c + sum_S alpha_i (c_i+ - c_i) / sum_i alpha_i``.

    With equal weights the last update is the paper's ``c + (s/n) mean_S (c_i+ - c_i)``;
    in general it keeps ``c = sum_i alpha_i c_i / sum_i alpha_i``, the weighting of
    ``F = (1/n) sum_i alpha_i f_i``. The corrections ``c - c_i`` replace each client's
    gradient drift by the server's estimate of ``grad F``, so with exact gradients the
    fixed point is ``argmin F`` for every ``E`` (``y_i = x``, ``c_i = grad f_i(x)``,
    ``c = grad F(x) = 0``), whereas :func:`fedavg` with ``E > 1`` stops elsewhere. While
    all controls are 0 (the first round) a round equals FedAvg's at
    ``global_learning_rate = 1``.

    Args:
      loss: ``loss(params, x, y, mask) -> scalar``.
      learning_rate: local step size ``lr > 0``; may be traced (a traced 0 leaves the
        controls unchanged instead of dividing by 0).
      clients_per_round: ``s`` (static).
      batch_size: ``B`` (static).
      local_steps: ``E`` (static), default 5.
      global_learning_rate: server step ``> 0`` on the averaged update, default 1;
        may be traced.
      weights: optional ``alpha`` of shape ``[n]``.
      personalized: True, False or a pytree of bools like ``params``
        (:mod:`~karula_jax.algorithms._personalized`): True leaves are kept by each client
        and never averaged (as in :func:`fedavg`) and get no control variate (their
        controls stay 0: plain local SGD on them). Default False: one global model.

    Returns:
      An :class:`Algorithm`; ``state.params`` holds the global model once (leaves
      ``[1, ...]``) and each client's personalized leaves (``[n, ...]``),
      ``state.memory`` the client controls ``c_i`` (leaves ``[n, ...]``) and
      ``state.extra`` the server control ``c`` (no client axis).
    """
    check_positive("learning_rate", learning_rate)
    s = check_positive_int("clients_per_round", clients_per_round)
    B = check_positive_int("batch_size", batch_size)
    E = check_positive_int("local_steps", local_steps)
    check_positive("global_learning_rate", global_learning_rate)
    check_weights(weights)
    check_personalized(personalized)

    client = functools.partial(_client, loss, learning_rate, E, B)

    def init(params, data: ClientData, *, key) -> FedState:
        check_params(loss, params, data)
        n = data.num_clients
        check_clients_per_round(s, n)
        x = jax.tree.map(jnp.asarray, params)
        zeros = jax.tree.map(jnp.zeros_like, x)
        return start_state(
            x,
            n,
            run_key(key),
            memory=broadcast(zeros, n),
            extra=zeros,
            shared=shared_leaves(personalized, x),
        )

    def round_fn(state: FedState, data: ClientData):
        alpha, mask, idx, key_batch = begin_round(state, data, s, weights)
        a_s = alpha[idx]
        c = state.extra
        x_rows = gather(state.params, idx)
        c_rows = gather(state.memory, idx)
        correction = jax.tree.map(lambda ci, cs: cs[None] - ci, c_rows, c)
        keys = client_keys(key_batch, idx)
        y_rows, values = jax.vmap(client)(
            x_rows, correction, data.x[idx], data.y[idx], data.counts[idx], keys
        )
        delta = jax.tree.map(lambda y, x: y - x, y_rows, x_rows)  # y_i - x, [s, ...]
        flags = personalized_flags(personalized, c)
        c_plus = _new_controls(flags, c_rows, delta, correction, E, learning_rate)
        total = jnp.sum(alpha)
        c = jax.tree.map(
            lambda cs, cp, ci: cs + jnp.tensordot(a_s, cp - ci, axes=1).astype(cs.dtype) / total,
            c,
            c_plus,
            c_rows,
        )
        memory = scatter(state.memory, idx, c_plus)
        no_step = jax.tree.map(lambda d: jnp.zeros_like(d[0]), delta)  # all weights 0
        step = weighted_mean(delta, a_s, otherwise=no_step)

        def new_params(f, p, y, d):
            if f:
                return p.at[idx].set(y)
            return (p[0] + global_learning_rate * d)[None].astype(p.dtype)  # stored once

        params = jax.tree.map(new_params, flags, state.params, y_rows, step)
        info = round_info(values, a_s, mask, all_finite(values, y_rows, c_plus, c))
        new_state = state._replace(params=params, memory=memory, extra=c, round=state.round + 1)
        return new_state, info

    return Algorithm(init=init, round=round_fn, client_params=own_params)
