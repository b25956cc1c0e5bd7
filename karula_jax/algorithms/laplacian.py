"""Laplacian penalty (FedU style): the penalty counterpart of Karula's constraint.

Karula constrains ``||theta_i - theta_j||^2 <= t D_ij``; this ablation uses the same ``D``
as graph weights ``w_ij`` decreasing in ``D_ij`` and penalizes instead::

    minimize  (1/n) sum_i alpha_i f_i(theta_i) + (mu / 2) sum_{i<j} w_ij ||theta_i - theta_j||^2

The penalty is ``(mu / 2) tr(theta^T (L kron I) theta)`` with ``L = diag(W 1) - W`` the
graph Laplacian of ``W``. One round is Karula's with the projection replaced by the
proximal step of the penalty::

    nu_i  = m_i / n + 1[i in S] (G_i - m_i) / s       (E_S[nu_i] = alpha_i grad f_i / n)
    m_i   = G_i                                       for i in S
    theta = (I + eta mu L)^{-1} (theta - eta nu)      (along the client axis)

The inverse is applied through ``L = U diag(lambda) U^T``, so it is exact and stable for
every ``mu`` in ``[0, inf]`` and works for a traced ``mu``. The decomposition is computed
once per run: when the algorithm is built for a concrete ``D`` (float64 numpy), else by
``init`` (float32), and carried in ``state.extra`` (:class:`LaplacianExtra`). Batched
runs (``training.run_many``) build the algorithm inside every round, so a decomposition
made at build time from a traced ``D`` would be made again each round.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax import _linalg
from karula_jax._checks import (
    check_nonnegative,
    check_positive,
    check_positive_int,
    concrete,
    defer,
)
from karula_jax.algorithms._graph import check_dissimilarity, graph_laplacian, weights_numpy
from karula_jax.algorithms._personalized import check_personalized, personalized_flags
from karula_jax.algorithms._rounds import begin_round, own_params, round_info
from karula_jax.algorithms._sampling import init_and_run_keys
from karula_jax.algorithms._trees import all_finite, broadcast
from karula_jax.algorithms._validation import (
    check_clients_per_round,
    check_params,
    check_weights,
    resolve_weights,
)
from karula_jax.algorithms.base import Algorithm, FedState, LossFn
from karula_jax.algorithms.variance_reduction import init_memory, saga_round
from karula_jax.data.clients import ClientData

__all__ = ["LaplacianExtra", "graph_laplacian", "graph_weights", "laplacian_penalty"]


class LaplacianExtra(NamedTuple):
    """The Laplacian penalty's ``FedState.extra``: the spectrum of the graph Laplacian
    ``L = U diag(eigenvalues) U^T`` that every round's proximal step applies.

    Attributes:
      eigenvalues: ``[n]`` float32, ascending, ``>= 0``; exactly 0 on the null space (one
        per connected component of the graph).
      eigenvectors: ``[n, n]`` float32, orthonormal columns ``U``.
    """

    eigenvalues: jnp.ndarray
    eigenvectors: jnp.ndarray


def graph_weights(D, *, scale=None) -> jnp.ndarray:
    """Similarity weights ``w_ij = exp(-D_ij / scale)`` of a dissimilarity matrix.

    ``scale`` defaults to the median of the finite off-diagonal entries of ``D`` (a
    bandwidth in the units of ``D``, so the weights do not depend on those units). Edge
    cases: when that median is 0 (more than half the pairs identical) the median of the
    positive finite off-diagonal entries is used; when there is none (every ``D_ij`` is 0
    or inf, or ``n = 1``) ``scale = 1``. Hence ``D_ij = 0`` gives ``w_ij = 1``,
    ``D_ij = inf`` gives ``w_ij = 0`` (no edge), and the diagonal is 0. The weights are
    symmetric, in ``[0, 1]`` and decreasing in ``D_ij``. Works on traced ``D``.

    Args:
      D: dissimilarities, array of shape ``[n, n]``: symmetric, ``>= 0``, no NaN, may
        contain ``inf``.
      scale: optional bandwidth ``> 0`` (may be traced) replacing the median.

    Returns:
      ``W``, float array of shape ``[n, n]`` (float32 unless ``D`` is float64).

    Raises:
      ValueError: ``D`` not square, not symmetric, negative or NaN; ``scale`` not
        finite and positive.
    """
    check_dissimilarity(D)
    if scale is not None:
        check_positive("scale", scale)
    d = concrete(D)
    dtype = jnp.float64 if jnp.result_type(D) == jnp.float64 else jnp.float32
    if d is not None and (scale is None or concrete(scale) is not None):
        return jnp.asarray(weights_numpy(d, scale), dtype)
    D = jnp.asarray(D, dtype)
    n = D.shape[0]
    off = ~jnp.eye(n, dtype=bool)
    if scale is None:
        finite = off & jnp.isfinite(D)
        med = jnp.nanmedian(jnp.where(finite, D, jnp.nan)) if n > 1 else jnp.nan
        med_pos = jnp.nanmedian(jnp.where(finite & (D > 0), D, jnp.nan)) if n > 1 else jnp.nan
        scale = jnp.where(med > 0, med, jnp.where(med_pos > 0, med_pos, 1.0))
    scale = jnp.asarray(scale, dtype)
    return jnp.where(off, jnp.exp(-D / scale), 0.0).astype(dtype)


def _check_weight_matrix(W, n: int) -> None:
    w = concrete(W)
    if w is None:
        if jnp.shape(W) != (n, n):
            raise ValueError(f"graph_weights must have shape ({n}, {n}), got {jnp.shape(W)}")
        w = jnp.asarray(W)
        defer("graph_weights are not finite", jnp.all(jnp.isfinite(w)))
        defer("graph_weights are negative (they must be >= 0)", jnp.all(~(w < 0)))
        close = jnp.abs(w - w.T) <= 1e-8 + 1e-5 * jnp.abs(w.T)
        defer("graph_weights are not symmetric", jnp.all(close))
        return
    if w.shape != (n, n):
        raise ValueError(f"graph_weights must have shape ({n}, {n}) like D, got {w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError("graph_weights must be finite and >= 0")
    if not np.allclose(w, w.T, rtol=1e-5, atol=1e-8):
        raise ValueError("graph_weights must be symmetric")


def _spectrum(W) -> tuple[jnp.ndarray, jnp.ndarray]:
    """``(lambda, U)`` of the Laplacian of ``W``; eigenvalues at rounding level set to 0.

    A numpy ``W`` is decomposed in float64 with numpy (the result stored in float32); a
    traced one with ``jnp.linalg.eigh`` in float32. Eigenvalues below
    ``10 n eps lambda_max`` are the Laplacian's null space (one per connected component)
    and become exactly 0, so that ``mu = inf`` leaves those components' means untouched.
    """
    if isinstance(W, np.ndarray):
        n = W.shape[0]
        W = np.where(np.eye(n, dtype=bool), 0.0, W)
        lam, U = np.linalg.eigh(np.diag(W.sum(1)) - W)
        eps = np.finfo(np.float64).eps
        lam = np.where(lam <= 10 * n * eps * max(lam[-1], 0.0), 0.0, lam)
        return jnp.asarray(lam, jnp.float32), jnp.asarray(U, jnp.float32)
    n = W.shape[0]
    lam, U = _linalg.eigh(graph_laplacian(W))
    eps = jnp.finfo(lam.dtype).eps
    lam = jnp.where(lam <= 10 * n * eps * jnp.maximum(lam[-1], 0.0), 0.0, lam)
    return lam, U


def _shrink_factors(lam, eta, mu) -> jnp.ndarray:
    """``h(lambda) = 1 - 1 / (1 + eta mu lambda)`` in ``[0, 1]``, 0 on the null space.

    ``(I + eta mu L)^{-1} = I - U diag(h) U^T``. Written so that ``mu = 0`` gives
    ``h = 0`` exactly (no move) and ``mu = inf`` gives ``h = 1`` off the null space
    (the projection onto it) even when ``eta = 0``.
    """
    mu_inf = jnp.isinf(mu)
    x = eta * jnp.where(mu_inf, 0.0, mu) * lam  # >= 0
    finite = 1.0 / (1.0 + 1.0 / x)  # x = 0 -> 0, x = inf -> 1
    return jnp.where(lam > 0, jnp.where(mu_inf, 1.0, finite), 0.0)


def _weight_matrix(D, graph_weights, n: int):
    """The graph's weights ``W`` ``[n, n]``: float64 numpy when known, else float32."""
    if graph_weights is None:
        d = concrete(D)
        return weights_numpy(d) if d is not None else _default_weights(D)
    W = graph_weights(D) if callable(graph_weights) else graph_weights
    _check_weight_matrix(W, n)
    w = concrete(W)
    return np.asarray(w, np.float64) if w is not None else jnp.asarray(W, jnp.float32)


def _prox(theta_half, flags, h, U):
    """The penalty's proximal step ``(I - U diag(h) U^T) theta_half`` on personalized
    leaves; shared leaves take the mean over clients."""

    def leaf(flag, a):
        if not flag:  # shared: the consensus step, exactly the mean
            return jnp.broadcast_to(jnp.mean(a, axis=0), a.shape)
        x = a.reshape(a.shape[0], -1)
        Ua = U.astype(x.dtype)
        move = Ua @ (h.astype(x.dtype)[:, None] * (Ua.T @ x))
        return (x - move).reshape(a.shape)

    return jax.tree.map(leaf, flags, theta_half)


def laplacian_penalty(
    loss: LossFn,
    D,
    *,
    mu,
    learning_rate,
    clients_per_round: int,
    batch_size: int,
    weights=None,
    personalized: Any = True,
    graph_weights: Any = None,
) -> Algorithm:
    """Laplacian-penalized personalization on the graph of ``D`` (FedU style, proximal).

    Minimizes ``(1/n) sum_i alpha_i f_i(theta_i) + (mu/2) sum_{i<j} w_ij ||theta_i -
    theta_j||^2`` by the round in the module docstring: Karula's SAGA step (same memory,
    same normalization ``E[nu_i] = alpha_i grad f_i / n``, same keys) followed by the
    proximal step of the penalty, ``theta <- (I + eta mu L)^{-1} theta_half``, instead of
    the projection onto ``K``. The fixed point of a round with exact gradients is the
    minimizer. The proximal step is exact and stable for any ``mu``, so the step size
    only has to suit the losses (as for Karula), not ``mu``.

    Limits (same ``D``, key and ``learning_rate``):

    * ``mu = 0``: no coupling; equals :func:`karula` at ``t = inf`` (each client its
      own SAGA steps; :func:`local` at ``s = n``).
    * ``mu = inf``: the proximal step is the projection onto the null space of ``L``,
      i.e. the mean over clients when the graph is connected (no ``D_ij = inf``
      separating it); equals :func:`karula` at ``t = 0`` (one global model). On a
      disconnected graph each connected component keeps its own mean.

    Weights: by default ``w_ij = exp(-D_ij / median_{k != l} D_kl)``
    (:func:`graph_weights`): 1 for identical clients, ``e^-1`` at the median
    dissimilarity, 0 where ``D_ij = inf``. ``graph_weights`` may replace them.

    Shared leaves (``personalized`` False) are kept identical across clients, as in
    Karula: they take the mean over clients of ``theta_half`` (the ``mu = inf`` step).
    The penalty acts on the personalized leaves, each coordinate separately.

    Args:
      loss: ``loss(params, x, y, mask) -> scalar``, mean over the masked rows.
      D: dissimilarities, array ``[n, n]``: symmetric, ``>= 0``, no NaN, may contain
        ``inf``. The eigendecomposition of ``L`` is computed here (in float64 when ``D``
        is concrete).
      mu: penalty strength ``>= 0``, may be ``inf``; may be traced (vmap over ``mu``).
      learning_rate: ``eta >= 0``, the step on ``nu`` (Karula's ``eta``); may be traced.
      clients_per_round: ``s``, static, ``1 <= s <= n``.
      batch_size: ``B``, static; ``B >= N_max`` gives exact gradients.
      weights: optional client weights ``alpha`` of shape ``[n]``.
      personalized: True, False or a pytree of bools like ``params`` (see above and
        :mod:`~karula_jax.algorithms._personalized`). Default True: every leaf per client.
      graph_weights: ``None`` (the default above), an array ``W`` ``[n, n]``
        (symmetric, finite, ``>= 0``; diagonal ignored) or a callable ``D -> W``.

    Returns:
      An :class:`Algorithm`: ``init(params, data, *, key)`` starts every client from
      ``params``, fills the SAGA memory with one minibatch gradient per client and holds
      the Laplacian's spectrum (``state.extra``, a :class:`LaplacianExtra`);
      ``client_params`` is each client's own model. ``RoundInfo`` has no projection
      statistics (zeros); ``finite`` flags NaN/inf.

    Raises:
      ValueError: ``D`` not square/symmetric, negative or NaN; ``mu`` negative or NaN;
        ``learning_rate`` negative, NaN or inf; ``clients_per_round`` or ``batch_size``
        < 1 (``s > n`` at ``init``/``round``); bad ``weights`` or ``graph_weights``;
        ``personalized`` None, or not shaped like ``params`` (at ``init``).
    """
    check_dissimilarity(D)
    check_nonnegative("mu", mu, allow_inf=True)
    check_nonnegative("learning_rate", learning_rate)
    s = check_positive_int("clients_per_round", clients_per_round)
    B = check_positive_int("batch_size", batch_size)
    check_weights(weights)
    check_personalized(personalized)
    n = jnp.shape(D)[0]
    # Known weights (numpy float64) are decomposed here, once; traced ones by init, since
    # a batched run builds the algorithm again inside every round (where W goes unused).
    W = _weight_matrix(D, graph_weights, n)
    spectrum = _spectrum(W) if isinstance(W, np.ndarray) else None
    D = jnp.asarray(D, jnp.float32)
    mu = jnp.asarray(mu, jnp.float32)

    def _check_data(data: ClientData) -> None:
        if data.num_clients != n:
            raise ValueError(f"D has shape {D.shape} but data hold {data.num_clients} clients")
        check_clients_per_round(s, n)

    def _flags(params):
        return personalized_flags(personalized, params)

    def init(params, data: ClientData, *, key) -> FedState:
        check_params(loss, params, data)
        _flags(params)  # its structure
        _check_data(data)
        key_init, key_run = init_and_run_keys(key)
        theta = broadcast(params, n)
        alpha = resolve_weights(weights, data)
        memory = init_memory(loss, theta, data, alpha, key_init, B)
        lam, U = spectrum if spectrum is not None else _spectrum(W)
        return FedState(
            params=theta,
            memory=memory,
            proj_state=(),
            extra=LaplacianExtra(lam, U),
            key=key_run,
            round=jnp.zeros((), jnp.int32),
        )

    def round_fn(state: FedState, data: ClientData):
        _check_data(data)
        alpha, mask, idx, key_batch = begin_round(state, data, s, weights)
        a_s = alpha[idx]
        values, G, nu, memory = saga_round(
            loss, state.params, state.memory, data, idx, key_batch, a_s, B
        )
        eta = learning_rate
        theta_half = jax.tree.map(lambda th, d: th - eta * d, state.params, nu)
        lam, U = state.extra
        theta = _prox(theta_half, _flags(theta_half), _shrink_factors(lam, eta, mu), U)
        info = round_info(values, a_s, mask, all_finite(values, G, theta))
        return state._replace(params=theta, memory=memory, round=state.round + 1), info

    return Algorithm(init=init, round=round_fn, client_params=own_params)


_default_weights = graph_weights
