"""Karula: variance-reduced projected gradient over the Wasserstein-constrained set K.

One round (DESIGN §4), with ``S`` the ``s`` participants and ``G_i`` the weighted
stochastic gradient ``alpha_i * grad f_i(theta_i)`` of participant ``i``::

    nu_i  = m_i / n + 1[i in S] (G_i - m_i) / s     (E_S[nu_i] = alpha_i grad f_i / n)
    m_i   = G_i                                       for i in S
    theta = P_K(theta - eta * nu)

with ``K = {theta : ||theta_i - theta_j||^2 <= t D_ij for all i, j}``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax.algorithms import _common as C
from karula_jax.algorithms.base import Algorithm, FedState, LossFn, RoundInfo
from karula_jax.algorithms.variance_reduction import init_memory, variance_reduced_direction
from karula_jax.data.clients import ClientData

__all__ = ["karula", "radii_squared"]


def _check_dissimilarity(D) -> None:
    d = C.concrete(D)
    if d is None:
        return
    if d.ndim != 2 or d.shape[0] != d.shape[1]:
        raise ValueError(f"D must be a square matrix of shape [n, n], got shape {d.shape}")
    if np.any(np.isnan(d)):
        raise ValueError("D must not contain NaN")
    if np.any(d < 0):
        raise ValueError(f"D must be >= 0 (inf allowed), found minimum {d.min()}")
    if not np.array_equal(d, d.T) and not np.allclose(
        np.where(np.isinf(d), 0, d), np.where(np.isinf(d.T), 0, d.T), rtol=1e-5, atol=1e-6
    ):
        raise ValueError("D must be symmetric")


def radii_squared(t, D) -> jnp.ndarray:
    """Squared radii ``t * D_ij`` of shape ``[n, n]``, with ``0 * inf = 0`` either way.

    ``t = 0`` gives radius 0 even where ``D = inf`` (one global model), and ``D_ij = 0``
    gives radius 0 even when ``t = inf`` (identical clients stay tied).
    """
    D = jnp.asarray(D, dtype=jnp.float32)
    t = jnp.asarray(t, dtype=jnp.float32)
    return jnp.where((D == 0) | (t == 0), 0.0, t * D)


def karula(
    loss: LossFn,
    D,
    *,
    t,
    learning_rate,
    clients_per_round: int,
    batch_size: int,
    personalized: Any = None,
    weights=None,
    projection_method: str = "dykstra",
    projection_tol: float = 1e-6,
    projection_max_iter: int = 1000,
) -> Algorithm:
    """The Karula algorithm as pure ``init`` / ``round`` / ``client_params`` functions.

    Solves ``min_theta (1/n) sum_i alpha_i f_i(theta_i)`` subject to
    ``||theta_i - theta_j||^2 <= t D_ij`` by the round described in the module
    docstring. The projection is :func:`karula_jax.projection.project`, warm-started
    from the previous round's dual state (``state.proj_state``).

    Step-size normalization: ``nu`` estimates the gradient of ``f`` on the product
    space, i.e. ``alpha_i grad f_i / n`` for client ``i``. Hence

    * at ``t = 0`` the projection is the mean over clients and one round equals
      :func:`fedsgd` with ``memory=True`` at learning rate ``learning_rate / n``;
    * at ``t = inf`` (or ``D = inf``) with ``s = n`` one round equals :func:`local`
      at the same ``learning_rate`` (step ``alpha_i grad f_i / n`` per client);
    * DESIGN's step is ``3 / (8 L)`` with ``L = max_i alpha_i L_i / n``
      (:func:`lipschitz_ridge` for ridge regression). With ``s < n`` and large ``t``
      this step can diverge (the memory term ``m_i / n`` is applied every round, the
      fresh gradient only when ``i`` participates); the paper's theorem uses an ``n``
      times larger ``L`` (see :func:`lipschitz_ridge`). Divergence shows as
      ``RoundInfo.finite = False``.

    Args:
      loss: ``loss(params, x, y, mask) -> scalar``, mean over the masked rows.
      D: dissimilarities, array ``[n, n]``, symmetric, ``>= 0``, may contain ``inf``.
      t: radius scale ``>= 0``, may be ``inf``; may be a traced value (vmap over t).
      learning_rate: ``eta >= 0``; may be traced.
      clients_per_round: ``s``, static, ``1 <= s <= n``.
      batch_size: ``B``, static; ``B >= N_max`` gives exact gradients.
      personalized: optional pytree of bools with the structure of ``params``; True
        leaves are personalized, False leaves are shared (projected to consensus).
        ``None``: every leaf personalized.
      weights: optional client weights ``alpha`` of shape ``[n]`` (default
        proportional to ``N_i`` with mean 1).
      projection_method: solver of the projection (see ``karula_jax.projection``).
      projection_tol: its tolerance.
      projection_max_iter: its iteration cap.

    Returns:
      An :class:`Algorithm`. ``init(params, data, *, key)`` starts every client from
      ``params`` and fills the memory with one minibatch gradient per client.
      ``round`` reports in :class:`RoundInfo` the projection's certified gap
      (``proj_delta``), its max constraint violation, iterations and whether it met
      ``projection_tol`` within ``projection_max_iter`` (``proj_converged``); ``finite`` is
      False as soon as a loss, gradient or parameter is NaN/inf (the run is not
      stopped: the driver must check it).

    Raises:
      ValueError: ``D`` not square/symmetric, negative or NaN; ``t`` or
        ``learning_rate`` negative or NaN; ``clients_per_round`` or ``batch_size``
        < 1 (``s > n`` is detected by ``init``/``round``); bad ``weights``; at
        ``init``, ``params`` that do not fit the data (see ``_common.check_params``).
    """
    from karula_jax import projection as P  # noqa: PLC0415 - sibling module, import late

    _check_dissimilarity(D)
    C.check_nonnegative("t", t, allow_inf=True)
    C.check_nonnegative("learning_rate", learning_rate)
    s = C.check_positive_int("clients_per_round", clients_per_round)
    B = C.check_positive_int("batch_size", batch_size)
    C.check_weights(weights)
    D = jnp.asarray(D, dtype=jnp.float32)
    n = D.shape[0]
    t = jnp.asarray(t, jnp.float32)

    def _check_data(data: ClientData) -> None:
        if data.num_clients != n:
            raise ValueError(f"D has shape {D.shape} but data hold {data.num_clients} clients")
        C.check_clients_per_round(s, n)

    def _radii():
        return radii_squared(t, D)

    def _project(v, warm_start):
        return P.project(
            v,
            _radii(),
            personalized=personalized,
            method=projection_method,
            tol=projection_tol,
            max_iter=projection_max_iter,
            warm_start=warm_start,
        )

    def init(params, data: ClientData, *, key) -> FedState:
        C.check_params(loss, params, data)
        _check_data(data)
        key_init, key_run = C.init_and_run_keys(key)
        theta = C.broadcast(params, n)
        alpha = C.resolve_weights(weights, data)
        memory = init_memory(loss, theta, data, alpha, key_init, B)
        proj_state = P.init_projection_state(
            theta, _radii(), personalized=personalized, method=projection_method
        )
        return FedState(
            params=theta,
            memory=memory,
            proj_state=proj_state,
            extra=(),
            key=key_run,
            round=jnp.zeros((), jnp.int32),
        )

    def round_fn(state: FedState, data: ClientData) -> tuple[FedState, RoundInfo]:
        _check_data(data)
        alpha, mask, idx, key_batch = C.begin_round(state, data, s, weights)
        values, grads = C.participant_value_and_grads(loss, state.params, data, idx, key_batch, B)
        a_s = alpha[idx]
        G = jax.tree.map(lambda g: C.scale_rows(a_s, g), grads)
        nu, memory = variance_reduced_direction(state.memory, G, idx)
        v = jax.tree.map(lambda th, d: th - learning_rate * d, state.params, nu)
        theta, pinfo = _project(v, state.proj_state)
        info = RoundInfo(
            loss=C.weighted_mean(values, a_s),
            participants=mask,
            proj_delta=jnp.asarray(pinfo.delta, jnp.float32),
            proj_violation=jnp.asarray(pinfo.max_violation, jnp.float32),
            proj_iterations=jnp.asarray(pinfo.iterations, jnp.int32),
            proj_converged=jnp.asarray(pinfo.converged, bool),
            finite=C.all_finite(values, G, theta),
        )
        new_state = FedState(
            params=theta,
            memory=memory,
            proj_state=pinfo.state,
            extra=(),
            key=state.key,
            round=state.round + 1,
        )
        return new_state, info

    return Algorithm(init=init, round=round_fn, client_params=C.own_params)
