"""Local training shared by the model-averaging methods (FedAvg, FedProx, IFCA, Ditto,
clustered FedAvg): ``E`` SGD steps per participant, and the server's write-back.

Conventions (participation, minibatches, weights) are those of
:mod:`karula_jax.algorithms._sampling` and :mod:`karula_jax.algorithms._rounds`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from karula_jax.algorithms._sampling import client_batch, client_keys
from karula_jax.algorithms._trees import gather
from karula_jax.data.clients import ClientData

__all__ = ["aggregate", "local_sgd", "local_train"]


def local_sgd(loss, params: Any, x, y, count, key, *, steps: int, learning_rate, batch_size: int):
    """``steps`` SGD steps on one client's mean loss, a fresh minibatch each step.

    Args:
      loss: the user loss.
      params: ONE client's model (no client axis).
      x: features ``[N_max, ...]``; y: targets ``[N_max, ...]``; count: ``N_i``.
      key: PRNG key; step ``e`` uses ``fold_in(key, e)``.
      steps: number of steps ``E`` (static).
      learning_rate: step size (may be traced).
      batch_size: ``B`` (static).

    Returns:
      ``(params, first_loss)``: the model after ``E`` steps and the minibatch loss
      before the first step.
    """

    def step(p, e):
        xb, yb, mb = client_batch(jax.random.fold_in(key, e), x, y, count, batch_size)
        value, g = jax.value_and_grad(loss)(p, xb, yb, mb)
        return jax.tree.map(lambda a, b: a - learning_rate * b, p, g), value

    params, values = lax.scan(step, params, jnp.arange(steps))
    return params, values[0]


def local_train(loss, params, data: ClientData, idx, key, steps, learning_rate, batch_size):
    """Runs :func:`local_sgd` for the participants ``idx`` from their rows."""
    keys = client_keys(key, idx)

    def one(p, x, y, c, k):
        return local_sgd(
            loss, p, x, y, c, k, steps=steps, learning_rate=learning_rate, batch_size=batch_size
        )

    return jax.vmap(one)(gather(params, idx), data.x[idx], data.y[idx], data.counts[idx], keys)


def aggregate(params, idx, rows, avg, flags):
    """The server's write-back after local training.

    Args:
      params: the state's models, leaves ``[n, ...]`` (per client) or ``[1, ...]`` (shared).
      idx: participants ``[s]``.
      rows: their trained models, leaves ``[s, ...]``.
      avg: the average of ``rows`` (no client axis).
      flags: pytree of bools like ``avg``, True on the per-client leaves
        (:func:`karula_jax.algorithms._personalized.personalized_flags`).

    Returns:
      Shared leaves: ``avg``, stored once (``[1, ...]``); per-client leaves: ``params``
      with the participants' rows replaced by ``rows``.
    """
    if not any(jax.tree.leaves(flags)):
        return jax.tree.map(lambda a: a[None], avg)

    def leaf(flag, p, r, a):
        return p.at[idx].set(r) if flag else a[None].astype(p.dtype)

    return jax.tree.map(leaf, flags, params, rows, avg)
