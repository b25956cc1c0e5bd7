"""The participants' minibatch losses and gradients, one client's kernel vmapped over them.

The gradient of ``f_i`` (client ``i``'s mean loss over its minibatch,
:func:`karula_jax.algorithms._sampling.client_batch`) at ``params[i]``, unweighted: each
method applies its client weights ``alpha_i``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from karula_jax.algorithms._sampling import client_batch, client_keys
from karula_jax.algorithms._trees import gather
from karula_jax.data.clients import ClientData

__all__ = ["participant_value_and_grads"]


def _client_value_and_grad(loss, batch_size, params, x, y, count, key):
    xb, yb, mb = client_batch(key, x, y, count, batch_size)
    return jax.value_and_grad(loss)(params, xb, yb, mb)


def participant_value_and_grads(
    loss, params: Any, data: ClientData, idx: jnp.ndarray, key: jnp.ndarray, batch_size: int
) -> tuple[jnp.ndarray, Any]:
    """Minibatch loss and gradient of ``f_i`` at ``params[i]`` for the clients ``idx``.

    Args:
      loss: ``loss(params, x, y, mask) -> scalar``.
      params: client-stacked parameters, leaves ``[n, ...]``.
      data: the clients' padded data.
      idx: participants, int array of shape ``[s]``.
      key: PRNG key of the round's minibatches (client ``i``: ``fold_in(key, i)``).
      batch_size: ``B`` (static).

    Returns:
      ``(values, grads)``: losses of shape ``[s]`` and gradients with leaves ``[s, ...]``
      (unweighted: gradients of ``f_i`` itself).
    """
    # Client i's minibatch uses fold_in(fold_in(key, i), 0): the same rows as step 0 of
    # _local.local_sgd(key=fold_in(key, i)), so FedAvg with E = 1 reproduces FedSGD exactly.
    keys = jax.vmap(lambda k: jax.random.fold_in(k, 0))(client_keys(key, idx))
    kernel = jax.vmap(lambda p, x, y, c, k: _client_value_and_grad(loss, batch_size, p, x, y, c, k))
    return kernel(gather(params, idx), data.x[idx], data.y[idx], data.counts[idx], keys)
