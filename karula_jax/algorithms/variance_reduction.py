"""SAGA gradient memory under client sampling, shared by Karula and FedSGD with memory.

Client ``i`` keeps ``m_i``, its last reported weighted gradient ``alpha_i g_i``. With ``S``
the ``s`` participants of a round (uniform, without replacement) and ``G_i`` their fresh
weighted gradients::

    nu_i = m_i / n + 1[i in S] (G_i - m_i) / s,      m_i <- G_i for i in S.

Over the draw of ``S``, ``E[nu_i] = G_i / n`` whatever the memory holds, so ``nu`` is an
unbiased estimate of the product-space gradient and ``sum_i nu_i`` of the global one.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from karula_jax.algorithms import _common as C
from karula_jax.algorithms.base import LossFn
from karula_jax.data.clients import ClientData

__all__ = ["init_memory", "variance_reduced_direction"]


def init_memory(loss: LossFn, theta: Any, data: ClientData, alpha, key, batch_size: int) -> Any:
    """Every client's first report: ``m_i = alpha_i g_i(theta_i)`` on one minibatch.

    Args:
      loss: ``loss(params, x, y, mask) -> scalar``.
      theta: per-client models, leaves ``[n, ...]``.
      data: the clients' data.
      alpha: client weights ``[n]``.
      key: PRNG key of the minibatches.
      batch_size: static minibatch size ``B``.

    Returns:
      The memory, leaves ``[n, ...]`` like ``theta``.
    """
    everyone = jnp.arange(data.num_clients, dtype=jnp.int32)
    _, grads = C.participant_value_and_grads(loss, theta, data, everyone, key, batch_size)
    return jax.tree.map(lambda g: C.scale_rows(alpha, g), grads)


def variance_reduced_direction(memory: Any, G: Any, idx: jnp.ndarray) -> tuple[Any, Any]:
    """The direction ``nu`` and the updated memory.

    ``nu_i = m_i / n + 1[i in S] (G_i - m_i) / s``; over uniform draws of ``S`` its
    mean is ``E[nu_i] = G_i / n`` (exactly ``alpha_i grad f_i / n`` with exact
    gradients), whatever the memory holds.

    Args:
      memory: ``m``, pytree with leaves ``[n, ...]``.
      G: the participants' weighted gradients, leaves ``[s, ...]``.
      idx: participants, int array ``[s]`` without repeats.

    Returns:
      ``(nu, memory)``: leaves ``[n, ...]``; the memory rows ``idx`` replaced by ``G``.
    """
    s = idx.shape[0]

    def leaf(m, g):
        n = m.shape[0]
        return (m / n).at[idx].add((g - m[idx]) / s)

    return jax.tree.map(leaf, memory, G), C.scatter(memory, idx, G)
