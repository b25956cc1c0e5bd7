"""Ditto (Li, Hu, Beirami and Smith 2021): a FedAvg global model and proximal personal models."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from karula_jax._checks import check_nonnegative, check_positive_int
from karula_jax.algorithms._local import local_sgd
from karula_jax.algorithms._personalized import check_personalized, personalized_flags
from karula_jax.algorithms._rounds import begin_round, own_params, round_info, start_state
from karula_jax.algorithms._sampling import client_batch, client_keys, run_key
from karula_jax.algorithms._trees import all_finite, broadcast, gather, scatter, weighted_mean
from karula_jax.algorithms._validation import check_clients_per_round, check_params, check_weights
from karula_jax.algorithms.base import Algorithm, FedState, LossFn
from karula_jax.data.clients import ClientData

__all__ = ["ditto"]


def _shrink(lam, personal_learning_rate) -> jnp.ndarray:
    """``1 / (1 + plr * lam)``, exactly 0 at ``lam = inf`` (also when ``plr = 0``)."""
    lam = jnp.asarray(lam, jnp.float32)
    plr = jnp.asarray(personal_learning_rate, jnp.float32)
    safe = jnp.where(jnp.isinf(lam), 0.0, lam)
    return jnp.where(jnp.isinf(lam), 0.0, 1.0 / (1.0 + plr * safe))


def _combine(flags, v, w):
    """Personal leaves from ``v``, the others from ``w`` (same shapes)."""
    return jax.tree.map(lambda f, a, b: a if f else b, flags, v, w)


def _client(loss, personalized, lam, learning_rate, plr, steps, B, w, v, x, y, count, k_w, k_v):
    """One participant's round: FedAvg's steps from ``w`` and the personal steps of ``v``.

    ``steps = (E, P)``: the global and the personal steps; ``k_w`` and ``k_v`` are the
    keys of their minibatches. Returns ``(w_i, v, loss)``.
    """
    E, P = steps
    w_i, _ = local_sgd(
        loss, w, x, y, count, k_w, steps=E, learning_rate=learning_rate, batch_size=B
    )
    flags = personalized_flags(personalized, w)
    shrink = _shrink(lam, plr)

    def step(v, e):
        xb, yb, mb = client_batch(jax.random.fold_in(k_v, e), x, y, count, B)
        value, g = jax.value_and_grad(loss)(v, xb, yb, mb)

        def leaf(f, a, b, c):
            if not f:
                return c
            return (c + shrink * (a - plr * b - c)).astype(a.dtype)

        return jax.tree.map(leaf, flags, v, g, w), value

    v, values = lax.scan(step, _combine(flags, v, w), jnp.arange(P))
    return w_i, v, values[0]


def ditto(
    loss: LossFn,
    *,
    lam,
    learning_rate,
    clients_per_round: int,
    batch_size: int,
    local_steps: int = 5,
    personal_learning_rate=None,
    personal_steps: int | None = None,
    weights=None,
    personalized: Any = True,
) -> Algorithm:
    """Ditto: a global model trained by FedAvg and one personal model per client.

    Client ``i``'s personal model solves
    ``v_i(w) = argmin_v f_i(v) + lam/2 ||v - w||^2`` around the global model ``w``,
    and ``w`` itself is trained by :func:`fedavg`. One round, with ``S`` the ``s``
    sampled clients and ``w`` the global model they receive:

    1. Global: each participant takes ``E = local_steps`` SGD steps
       ``w_i <- w_i - learning_rate * g_i(w_i)`` from ``w``; the server sets
       ``w <- sum_S alpha_i w_i / sum_S alpha_i``. These are :func:`fedavg`'s steps
       with the same keys, so ``w`` follows FedAvg's trajectory exactly.
    2. Personal: each participant takes ``personal_steps`` steps on
       ``f_i(v) + lam/2 ||v - w||^2`` from its current ``v_i``, the loss by a gradient
       step and the penalty implicitly (a proximal step, stable for every ``lam``)::

           v_i <- (v_i - plr * g_i(v_i) + plr * lam * w) / (1 + plr * lam)
                = w + (v_i - plr * g_i(v_i) - w) / (1 + plr * lam)

       with ``plr = personal_learning_rate``. Its fixed point satisfies
       ``grad f_i(v) + lam (v - w) = 0``. ``lam = 0`` is local training of ``v_i`` on
       ``f_i`` alone; ``lam = inf`` gives ``v_i = w`` exactly. Non-participants keep
       their ``v_i``.

    Minibatches: global step ``e`` of client ``i`` uses the rows of :func:`fedavg`
    (``fold_in(fold_in(k, i), e)`` with ``k`` the round's minibatch key); personal
    step ``e`` uses ``fold_in(fold_in(k', i), e)`` with ``k'`` the second half of
    ``split(k)``, an independent stream.

    Partial personalization: with a ``personalized`` mask only its True leaves form
    the personal model; False leaves of every client's model are the global model's
    (as if ``lam = inf`` on them).

    Fixed point with ``E = 1``, full participation and exact gradients: ``w`` is
    ``argmin_w sum_i alpha_i f_i(w)`` and, for a quadratic
    ``f_i(v) = v^T A_i v / 2 - b_i^T v``, ``v_i = (A_i + lam I)^{-1} (b_i + lam w)``.

    Args:
      loss: ``loss(params, x, y, mask) -> scalar``.
      lam: proximal weight ``lam >= 0``, may be ``inf``; may be traced.
      learning_rate: FedAvg's local step size ``>= 0``; may be traced.
      clients_per_round: ``s`` (static).
      batch_size: ``B`` (static).
      local_steps: ``E`` (static), FedAvg's local steps, default 5.
      personal_learning_rate: ``plr >= 0`` of the personal steps; may be traced.
        ``None``: ``learning_rate``.
      personal_steps: number of personal steps per round (static). ``None``:
        ``local_steps``.
      weights: optional ``alpha`` of shape ``[n]``.
      personalized: True, False or a pytree of bools like ``params``
        (:mod:`~karula_jax.algorithms._personalized`): the leaves that form the personal
        model. Default True: every leaf (Ditto as published); False makes every client's
        model the global one.

    Returns:
      An :class:`Algorithm`; ``state.params`` are the clients' models ``[n, ...]``
      (personal leaves ``v_i``, the others the global model), ``state.extra`` is the
      global model ``w`` (no client axis), and ``client_params`` returns
      ``state.params``. ``RoundInfo.loss`` is the participants' loss at their personal
      models on the first personal minibatch.
    """
    check_nonnegative("lam", lam, allow_inf=True)
    check_nonnegative("learning_rate", learning_rate)
    s = check_positive_int("clients_per_round", clients_per_round)
    B = check_positive_int("batch_size", batch_size)
    E = check_positive_int("local_steps", local_steps)
    plr = learning_rate if personal_learning_rate is None else personal_learning_rate
    check_nonnegative("personal_learning_rate", plr)
    P = E if personal_steps is None else check_positive_int("personal_steps", personal_steps)
    check_weights(weights)
    check_personalized(personalized)

    client = functools.partial(_client, loss, personalized, lam, learning_rate, plr, (E, P), B)

    def init(params, data: ClientData, *, key) -> FedState:
        check_params(loss, params, data)
        personalized_flags(personalized, params)  # its structure
        n = data.num_clients
        check_clients_per_round(s, n)
        w = jax.tree.map(jnp.asarray, params)
        return start_state(w, n, run_key(key), extra=w)

    def round_fn(state: FedState, data: ClientData):
        n = data.num_clients
        alpha, mask, idx, key_batch = begin_round(state, data, s, weights)
        w = state.extra
        keys_global = client_keys(key_batch, idx)
        keys_personal = client_keys(jax.random.split(key_batch)[1], idx)
        w_rows, v_rows, values = jax.vmap(client, in_axes=(None, 0, 0, 0, 0, 0, 0))(
            w,
            gather(state.params, idx),
            data.x[idx],
            data.y[idx],
            data.counts[idx],
            keys_global,
            keys_personal,
        )
        a_s = alpha[idx]
        w = weighted_mean(w_rows, a_s, otherwise=state.extra)
        personal = scatter(state.params, idx, v_rows)
        params = _combine(personalized_flags(personalized, w), personal, broadcast(w, n))
        info = round_info(values, a_s, mask, all_finite(values, w_rows, v_rows, w))
        return state._replace(params=params, extra=w, round=state.round + 1), info

    return Algorithm(init=init, round=round_fn, client_params=own_params)
