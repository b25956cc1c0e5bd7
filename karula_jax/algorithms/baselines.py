"""Baselines on the Karula engine: Local, FedSGD and FedAvg.

All three use the conventions of :mod:`karula_jax.algorithms._sampling` (participation,
minibatches) and :mod:`karula_jax.algorithms._rounds` (weights ``alpha``). Global-model
methods store their model once, leaves ``[1, ...]`` in ``state.params``
(``_trees.stack_clients``); ``client_params`` broadcasts it to ``[n, ...]`` so that
evaluation is the same for every method.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax._checks import check_nonnegative, check_positive_int
from karula_jax.algorithms._gradients import participant_value_and_grads
from karula_jax.algorithms._local import aggregate, local_train
from karula_jax.algorithms._personalized import (
    check_personalized,
    personalized_flags,
    shared_leaves,
)
from karula_jax.algorithms._rounds import begin_round, own_params, round_info, start_state
from karula_jax.algorithms._sampling import init_and_run_keys, run_key
from karula_jax.algorithms._trees import (
    all_finite,
    broadcast,
    first_row,
    gather,
    scale_rows,
    scatter,
    weighted_mean,
)
from karula_jax.algorithms._validation import (
    check_clients_per_round,
    check_params,
    check_weights,
    resolve_weights,
)
from karula_jax.algorithms.base import Algorithm, FedState, LossFn
from karula_jax.algorithms.variance_reduction import init_memory, variance_reduced_direction
from karula_jax.data.clients import ClientData

__all__ = ["fedavg", "fedsgd", "local"]


def local(
    loss: LossFn,
    *,
    learning_rate,
    batch_size: int,
    clients_per_round: int | None = None,
    weights=None,
) -> Algorithm:
    """Local training: every client trains its own model, no communication.

    Each round every participating client (all of them by default) takes one
    gradient step on its share of the product objective ``f``::

        theta_i <- theta_i - learning_rate * alpha_i * grad f_i(theta_i) / n

    This normalization makes ``local`` equal to :func:`karula` at ``t = inf`` with
    ``s = n`` at the same learning rate. (In terms of the client's own mean loss the
    step is ``learning_rate * alpha_i / n``.)

    Args:
      loss: ``loss(params, x, y, mask) -> scalar``.
      learning_rate: ``>= 0``; may be traced.
      batch_size: ``B`` (static); ``B >= N_max`` gives exact gradients.
      clients_per_round: optional ``s``; only the ``s`` sampled clients step. ``None``:
        all ``n`` clients every round.
      weights: optional ``alpha`` of shape ``[n]``.

    Returns:
      An :class:`Algorithm`; ``client_params`` is each client's own model.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import karula_jax as kj
      >>> ds = kj.data.synthetic_ridge(0, num_clients=6, dim=3)
      >>> L = kj.algorithms.lipschitz_ridge(ds.train, 1e-6)
      >>> alg = kj.algorithms.local(
      ...     kj.models.ridge_loss(1e-6), learning_rate=1 / L, batch_size=ds.train.max_count
      ... )
      >>> res = kj.training.run(
      ...     alg, jnp.zeros(3), ds.train, key=jax.random.key(1), num_rounds=300, chunk_size=300,
      ...     progress=False,
      ... )
      >>> theta = alg.client_params(res.state, ds.train)  # each client's own model
      >>> own, _ = kj.evaluation.ridge_solutions(ds.train, 1e-6)  # the closed-form local fits
      >>> bool(jnp.allclose(theta, own, atol=1e-3))
      True
    """
    check_nonnegative("learning_rate", learning_rate)
    B = check_positive_int("batch_size", batch_size)
    if clients_per_round is not None:
        check_positive_int("clients_per_round", clients_per_round)
    check_weights(weights)

    def _s(data):
        s = data.num_clients if clients_per_round is None else clients_per_round
        check_clients_per_round(s, data.num_clients)
        return s

    def init(params, data: ClientData, *, key) -> FedState:
        check_params(loss, params, data)
        _s(data)
        return start_state(params, data.num_clients, run_key(key))

    def round_fn(state: FedState, data: ClientData):
        n = data.num_clients
        alpha, mask, idx, key_batch = begin_round(state, data, _s(data), weights)
        values, grads = participant_value_and_grads(loss, state.params, data, idx, key_batch, B)
        a_s = alpha[idx]
        rows = jax.tree.map(
            lambda p, g: p - learning_rate * scale_rows(a_s / n, g),
            gather(state.params, idx),
            grads,
        )
        params = scatter(state.params, idx, rows)
        info = round_info(values, a_s, mask, all_finite(values, grads, params))
        return state._replace(params=params, round=state.round + 1), info

    return Algorithm(init=init, round=round_fn, client_params=own_params)


def fedsgd(
    loss: LossFn,
    *,
    learning_rate,
    clients_per_round: int,
    batch_size: int,
    memory: bool = False,
    weights=None,
) -> Algorithm:
    """FedSGD: one global model, one server gradient step per round.

    Without memory the step is the ``alpha``-weighted average of the participants'
    gradients (a gradient step on ``F(w) = (1/n) sum_i alpha_i f_i(w)`` when ``s = n``)::

        w <- w - learning_rate * sum_{i in S} alpha_i g_i / sum_{i in S} alpha_i

    With ``memory=True`` the direction is the SAGA estimate used by Karula, unbiased
    for ``grad F(w)`` (memory ``m_i = alpha_i g_i`` from client i's last report)::

        w <- w - learning_rate * (mean_i m_i + (1/s) sum_{i in S} (alpha_i g_i - m_i))

    and :func:`karula` at ``t = 0`` with step ``eta`` equals this at
    ``learning_rate = eta / n``.

    Args:
      loss: ``loss(params, x, y, mask) -> scalar``.
      learning_rate: ``>= 0``; may be traced.
      clients_per_round: ``s`` (static).
      batch_size: ``B`` (static).
      memory: use the SAGA-style gradient memory (filled at ``init`` with one gradient
        per client).
      weights: optional ``alpha`` of shape ``[n]``.

    Returns:
      An :class:`Algorithm`; ``state.params`` holds the global model once (leaves
      ``[1, ...]``); ``client_params`` broadcasts it to ``[n, ...]``.
    """
    check_nonnegative("learning_rate", learning_rate)
    s = check_positive_int("clients_per_round", clients_per_round)
    B = check_positive_int("batch_size", batch_size)
    check_weights(weights)
    if not isinstance(memory, bool | np.bool_):
        raise TypeError(f"memory must be True or False, got {memory!r}")

    def init(params, data: ClientData, *, key) -> FedState:
        check_params(loss, params, data)
        n = data.num_clients
        check_clients_per_round(s, n)
        shared = shared_leaves(False, params)  # one global model, stored once
        if not memory:
            return start_state(params, n, run_key(key), shared=shared)
        key_init, key_run = init_and_run_keys(key)
        alpha = resolve_weights(weights, data)
        mem = init_memory(loss, broadcast(params, n), data, alpha, key_init, B)
        return start_state(params, n, key_run, memory=mem, shared=shared)

    def round_fn(state: FedState, data: ClientData):
        alpha, mask, idx, key_batch = begin_round(state, data, s, weights)
        values, grads = participant_value_and_grads(loss, state.params, data, idx, key_batch, B)
        a_s = alpha[idx]
        w = first_row(state.params)
        mem = state.memory
        if memory:
            # sum_i nu_i = mean(m) + sum_S (G_i - m_i) / s: Karula's estimate, summed
            G = jax.tree.map(lambda g: scale_rows(a_s, g), grads)
            nu, mem = variance_reduced_direction(mem, G, idx)
            direction = jax.tree.map(lambda v: jnp.sum(v, axis=0), nu)
        else:
            # a round of zero-weight participants takes no step
            direction = weighted_mean(grads, a_s, otherwise=jax.tree.map(jnp.zeros_like, w))
        w = jax.tree.map(lambda p, d: p - learning_rate * d, w, direction)
        params = jax.tree.map(lambda a: a[None], w)
        info = round_info(values, a_s, mask, all_finite(values, grads, w))
        return state._replace(params=params, memory=mem, round=state.round + 1), info

    return Algorithm(init=init, round=round_fn, client_params=own_params)


def fedavg(
    loss: LossFn,
    *,
    learning_rate,
    clients_per_round: int,
    batch_size: int,
    local_steps: int = 5,
    weights=None,
    personalized: Any = False,
) -> Algorithm:
    """FedAvg: ``E`` local SGD steps per participant, then a weighted model average.

    Each participant starts from the global model ``w`` and takes ``E = local_steps``
    SGD steps on its own mean loss ``f_i`` (learning rate ``learning_rate``, a fresh
    minibatch per step); the server replaces ``w`` by the average of the returned
    models weighted by ``alpha_i`` (proportional to ``N_i``). With ``E = 1`` one
    round equals :func:`fedsgd` (no memory) at the same learning rate. With ``E > 1``
    and heterogeneous clients FedAvg's fixed point is NOT the minimizer of ``F``
    (client drift).

    Args:
      loss: ``loss(params, x, y, mask) -> scalar``.
      learning_rate: local step size ``>= 0``; may be traced.
      clients_per_round: ``s`` (static).
      batch_size: ``B`` (static).
      local_steps: ``E`` (static), default 5.
      weights: optional ``alpha`` of shape ``[n]``.
      personalized: True, False or a pytree of bools like ``params``
        (:mod:`~karula_jax.algorithms._personalized`): True leaves are kept by each client
        and never averaged (FedPer style). Default False: one global model, FedAvg as
        published.

    Returns:
      An :class:`Algorithm`; ``state.params`` holds the global leaves once (``[1, ...]``)
      and personalized leaves per client (``[n, ...]``); ``client_params`` gives each
      client's model.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import karula_jax as kj
      >>> ds = kj.data.synthetic_ridge(0, num_clients=6, dim=3)
      >>> alg = kj.algorithms.fedavg(
      ...     kj.models.ridge_loss(1e-6), learning_rate=0.05, clients_per_round=3,
      ...     batch_size=ds.train.max_count, local_steps=5,
      ... )
      >>> res = kj.training.run(
      ...     alg, jnp.zeros(3), ds.train, key=jax.random.key(1), num_rounds=100, chunk_size=100,
      ...     progress=False,
      ... )
      >>> res.state.params.shape  # the global model, stored once
      (1, 3)
      >>> theta = alg.client_params(res.state, ds.train)  # broadcast to every client
      >>> theta.shape, float(jnp.abs(theta - theta[0]).max())
      ((6, 3), 0.0)
      >>> round(float(kj.evaluation.estimation_error(theta, ds.theta_true).mean()), 1)
      0.6
    """
    check_nonnegative("learning_rate", learning_rate)
    s = check_positive_int("clients_per_round", clients_per_round)
    B = check_positive_int("batch_size", batch_size)
    E = check_positive_int("local_steps", local_steps)
    check_weights(weights)
    check_personalized(personalized)

    def init(params, data: ClientData, *, key) -> FedState:
        check_params(loss, params, data)
        check_clients_per_round(s, data.num_clients)
        shared = shared_leaves(personalized, params)
        return start_state(params, data.num_clients, run_key(key), shared=shared)

    def round_fn(state: FedState, data: ClientData):
        alpha, mask, idx, key_batch = begin_round(state, data, s, weights)
        rows, values = local_train(loss, state.params, data, idx, key_batch, E, learning_rate, B)
        a_s = alpha[idx]
        avg = weighted_mean(rows, a_s, otherwise=first_row(state.params))
        params = aggregate(state.params, idx, rows, avg, personalized_flags(personalized, avg))
        info = round_info(values, a_s, mask, all_finite(values, rows))
        return state._replace(params=params, round=state.round + 1), info

    return Algorithm(init=init, round=round_fn, client_params=own_params)
