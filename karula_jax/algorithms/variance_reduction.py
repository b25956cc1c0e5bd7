"""SAGA gradient memory under client sampling: Karula, its penalty ablation, FedSGD with memory.

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

from karula_jax.algorithms._gradients import participant_value_and_grads
from karula_jax.algorithms._trees import scale_rows, scatter
from karula_jax.algorithms.base import LossFn
from karula_jax.data.clients import ClientData
from karula_jax.projection.reduction import client_mean

__all__ = ["init_memory", "saga_round", "variance_reduced_direction"]


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
    _, grads = participant_value_and_grads(loss, theta, data, everyone, key, batch_size)
    return jax.tree.map(lambda g: scale_rows(alpha, g), grads)


def variance_reduced_direction(
    memory: Any, G: Any, idx: jnp.ndarray, *, shared: Any = None
) -> tuple[Any, Any]:
    """The direction ``nu`` and the updated memory.

    ``nu_i = m_i / n + 1[i in S] (G_i - m_i) / s``; over uniform draws of ``S`` its
    mean is ``E[nu_i] = G_i / n`` (exactly ``alpha_i grad f_i / n`` with exact
    gradients), whatever the memory holds.

    Args:
      memory: ``m``, pytree with leaves ``[n, ...]``.
      G: the participants' weighted gradients, leaves ``[s, ...]``.
      idx: participants, int array ``[s]`` without repeats.
      shared: optional pytree of bools like ``memory``: for a True leaf (a leaf every
        client holds in common, stored once) only the client mean of ``nu`` is needed
        and returned, ``[1, ...]``, in ``O(s)`` rows of work plus one pass over ``m``.

    Returns:
      ``(nu, memory)``: ``nu`` with leaves ``[n, ...]`` (``[1, ...]`` where ``shared``),
      the memory with rows ``idx`` replaced by ``G``.
    """
    s = idx.shape[0]

    def leaf(m, g):
        n = m.shape[0]
        return (m / n).at[idx].add((g - m[idx]) / s)

    def mean_leaf(m, g):
        # (1/n) sum_i nu_i = mean(m) / n + sum_S (G_i - m_i) / (s n)
        n = m.shape[0]
        total = client_mean(m) / n + jnp.sum(g - m[idx], axis=0) / (s * n)
        return total[None].astype(m.dtype)

    if shared is None:
        nu = jax.tree.map(leaf, memory, G)
    else:
        nu = jax.tree.map(lambda f, m, g: mean_leaf(m, g) if f else leaf(m, g), shared, memory, G)
    # The write waits for nu, i.e. for every read of m: the memory is updated in place.
    return nu, scatter(memory, idx, G, after=nu)


def saga_round(
    loss: LossFn,
    params: Any,
    memory: Any,
    data: ClientData,
    idx,
    key,
    a_s,
    B: int,
    *,
    shared: Any = None,
):
    """The participants' fresh weighted gradients and the SAGA direction of one round.

    Args:
      loss: ``loss(params, x, y, mask) -> scalar``.
      params: per-client models, leaves ``[n, ...]`` (or ``[1, ...]`` if stored once).
      memory: ``m``, leaves ``[n, ...]``.
      data: the clients' data.
      idx: participants ``[s]``; ``key``: PRNG key of their minibatches.
      a_s: the participants' weights ``alpha[idx]``.
      B: static minibatch size.
      shared: leaves stored once, see :func:`variance_reduced_direction`.

    Returns:
      ``(values, G, nu, memory)``: the participants' losses ``[s]``, their weighted
      gradients ``G_i = alpha_i g_i`` (leaves ``[s, ...]``), the direction and the updated
      memory of :func:`variance_reduced_direction`.
    """
    values, grads = participant_value_and_grads(loss, params, data, idx, key, B)
    G = jax.tree.map(lambda g: scale_rows(a_s, g), grads)
    nu, memory = variance_reduced_direction(memory, G, idx, shared=shared)
    return values, G, nu, memory
