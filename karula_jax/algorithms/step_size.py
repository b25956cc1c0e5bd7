"""Karula's default step size and the per-client smoothness constants it is built from.

The rule and its derivation are in ``docs/karula.md``. This module computes it:

* :func:`stability_factor` ``c(p)``: the exact mean-square stability limit of the SAGA
  estimator on one uncoupled quadratic client, in units of ``s / (alpha_i L_i)``;
* :func:`consensus_stability_factor` ``b(n, s)``: the same at ``t = 0``, where the
  projection is the mean (FedSGD with SAGA memory), in units of ``n / (alpha_i L_i)``;
* :func:`karula_learning_rate`: the default step from the constants ``L_i`` and the
  coupling ``kappa``;
* :func:`local_optima` and :func:`coupling`: ``kappa``, how strongly the constraints at
  ``t`` damp the clients' own dynamics, from the projection of approximate local optima;
* :func:`smoothness_estimate`: ``L_i`` of any loss by power iteration with Hessian-vector
  products (for losses without a formula; ``ridge_loss`` and ``logistic_loss`` of
  :mod:`karula_jax.models` carry theirs as ``loss.smoothness``);
* :func:`client_smoothness`: which of these ``karula`` uses.

Everything here is traceable: ``init`` computes the step inside ``jit``/``vmap`` (data,
``t`` and ``D`` may be traced).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.flatten_util import ravel_pytree

from karula_jax import _linalg
from karula_jax._checks import check_key, check_positive, check_positive_int, concrete, defer
from karula_jax.algorithms._graph import graph_laplacian
from karula_jax.algorithms._sampling import client_batch, client_keys
from karula_jax.algorithms._trees import broadcast, scale_rows
from karula_jax.algorithms._validation import check_clients_per_round, check_params
from karula_jax.data.clients import ClientData

__all__ = [
    "client_smoothness",
    "consensus_stability_factor",
    "coupling",
    "karula_learning_rate",
    "local_optima",
    "smoothness_estimate",
    "stability_factor",
    "theorem_learning_rate",
]

#: Power-iteration steps of :func:`smoothness_estimate` when ``karula`` calls it.
DEFAULT_ITERATIONS = 20
#: Factor on the power-iteration estimate (see :func:`smoothness_estimate`).
DEFAULT_SAFETY = 2.0
#: Gradient steps of :func:`local_optima` when ``karula`` calls it.
PILOT_STEPS = 20
#: :func:`coupling` counts a pair multiplier as at most this (zero radii count as it):
#: beyond ``kappa = 1`` the step is the consensus one, so larger weights change nothing
#: that matters, and bounded weights keep the float32 eigenvalues accurate.
MAX_MULTIPLIER = 10.0


def stability_factor(p):
    """``c(p) = 4 / ((2 - p) (1 + sqrt(1 + 8 (1 - p) / (2 - p))))`` for ``p = s / n``.

    The positive root of ``(2 - p)(1 - p) c^2 + (2 - p) c - 2 = 0``: one uncoupled client
    with curvature ``a`` is mean-square stable under Karula's round iff
    ``eta a < s c(s / n)`` (derivation in ``docs/karula.md``).
    ``c(1) = 2`` (gradient descent's ``2 / L``); ``c`` decreases to
    ``(sqrt(5) - 1) / 2 = 0.618`` as ``p -> 0``.

    Args:
      p: participation fraction ``s / n`` in ``(0, 1]`` (float or array).

    Returns:
      ``c(p)``, same shape as ``p``.
    """
    p = jnp.asarray(p, jnp.float32)
    return 4.0 / ((2.0 - p) * (1.0 + jnp.sqrt(1.0 + 8.0 * (1.0 - p) / (2.0 - p))))


def _second_moments_tied(g: float, n: int, s: int) -> np.ndarray:
    """Second-moment recursion of FedSGD with SAGA memory on identical 1-D quadratics.

    Curvature 1, step ``g``; state ``w`` and the memory points ``phi_1..phi_n``. By
    symmetry the moments reduce to ``W = E w^2``, ``X = E w phi_i``, ``Y = E phi_i^2``
    and ``Z = E phi_i phi_j`` (``i != j``), with inclusion probabilities ``p = s/n`` and
    ``q = s(s-1)/(n(n-1))``.
    """
    p, q, r = s / n, s * (s - 1) / (n * (n - 1)), 1 / s - 1 / n
    return np.array(
        [
            [(1 - g) ** 2, 0.0, g * g * r, -g * g * r],
            [p * (1 - g), (1 - p) * (1 - g), -(1 - p) * g / n, (1 - p) * g / n],
            [p, 0.0, 1 - p, 0.0],
            [q, 2 * (p - q), 0.0, 1 - 2 * p + q],
        ]
    )


@functools.lru_cache(maxsize=256)
def consensus_stability_factor(n: int, s: int) -> float:
    """``b(n, s)``: the mean-square stability limit of Karula at ``t = 0``, per unit curvature.

    At ``t = 0`` Karula is FedSGD with SAGA memory at step ``eta / n``; on ``n``
    identical quadratic clients of curvature ``a`` it is mean-square stable iff
    ``(eta / n) a < b(n, s)``. Found by bisection on the spectral radius of the 4 x 4
    recursion of the second moments (the stable steps form an interval, checked for
    every ``1 <= s < n <= 40``). ``b(n, n) = 2``; ``b(n, 1)`` decreases to 1 (plain
    SAGA); e.g. ``b(6, 2) = 1.457``, ``b(30, 10) = 1.876``.

    Args:
      n: number of clients (static).
      s: participants per round (static), ``1 <= s <= n``.

    Returns:
      ``b(n, s)`` as a Python float in ``[1, 2]``.
    """
    if s >= n:
        return 2.0
    lo, hi = 0.0, 2.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if np.max(np.abs(np.linalg.eigvals(_second_moments_tied(mid, n, s)))) < 1.0:
            lo = mid
        else:
            hi = mid
    return lo


def karula_learning_rate(
    smoothness, weights, clients_per_round: int, *, consensus=False, coupling=0.0
):
    """Karula's default step ``eta`` from each client's smoothness constant.

    With ``a_i = alpha_i L_i``, ``L_max = max_i a_i``, ``Lbar = mean_i a_i``, ``p = s / n``,
    ``c = stability_factor(p)``, ``b = consensus_stability_factor(n, s)`` and the
    coupling ``kappa >= 0`` (:func:`coupling`)::

        free  = s c / (2 L_max)                                   uncoupled clients
        tied  = max(n b / (2 L_F(s)), free)                       every radius 0
        L_F(s) = (n (s - 1) Lbar + (n - s) L_max) / (s (n - 1))   (Lbar when s = n)
        eta   = tied                                              every radius 0
        eta   = min(tied, free / (1 - kappa))                     else (tied if kappa >= 1)

    ``free`` is half the mean-square stability limit of uncoupled clients, ``tied`` half
    the limit of FedSGD with SAGA memory, which is what Karula is when the projection
    is the mean. Active constraints damp every direction but the mean by at least
    ``kappa`` times the curvature, which lifts the uncoupled limit by ``1 / (1 - kappa)``;
    the mean is never damped, hence the cap. With every client participating
    ``free = n / L_max = 1 / L`` (:func:`lipschitz_ridge`'s ``L``) and ``tied = n / Lbar``.
    Derivation: ``docs/karula.md``.

    Args:
      smoothness: ``L_i``, Lipschitz constants of ``grad f_i`` (each client's own mean
        loss, unweighted), array ``[n]`` or a scalar; may be traced.
      weights: ``alpha`` of shape ``[n]``; may be traced.
      clients_per_round: ``s``, static, ``1 <= s <= n``.
      consensus: (traced) bool, True when every radius is 0 (``t = 0`` or ``D = 0``).
      coupling: (traced) ``kappa >= 0``; 0 gives ``free`` (the step of ``t = inf``).

    Returns:
      ``eta``, a float32 scalar (``inf`` when every ``a_i`` is 0).
    """
    alpha = jnp.asarray(weights, jnp.float32)
    n = alpha.shape[0]
    s = check_positive_int("clients_per_round", clients_per_round)
    check_clients_per_round(s, n)
    a = alpha * jnp.broadcast_to(jnp.asarray(smoothness, jnp.float32), (n,))
    l_max, l_bar = jnp.max(a), jnp.mean(a)
    free = s * stability_factor(s / n) / (2.0 * l_max)
    l_f = l_bar if s == n else (n * (s - 1) * l_bar + (n - s) * l_max) / (s * (n - 1))
    tied = jnp.maximum(n * consensus_stability_factor(n, s) / (2.0 * l_f), free)
    kappa = jnp.asarray(coupling, jnp.float32)
    damped = jnp.where(kappa < 1.0, free / jnp.maximum(1.0 - kappa, 1e-30), jnp.inf)
    coupled = jnp.minimum(tied, jnp.maximum(damped, free))
    return jnp.where(jnp.asarray(consensus), tied, coupled).astype(jnp.float32)


def theorem_learning_rate(smoothness, weights):
    """Theorem 4.3's step ``3 / (8 L_max)``, ``L_max = max_i alpha_i L_i``.

    Assumption 4.1 asks each weighted loss ``alpha_i f_i`` to be ``L``-smooth, so the
    theorem's ``L`` is ``L_max`` (``lipschitz_ridge(..., per_client=True)`` for ridge),
    not the product-space constant ``L_max / n``; see ``docs/theory.md``.

    Args:
      smoothness: ``L_i`` of shape ``[n]`` or a scalar; may be traced.
      weights: ``alpha`` of shape ``[n]``; may be traced.

    Returns:
      ``eta``, a float32 scalar (``inf`` when every ``alpha_i L_i`` is 0).
    """
    alpha = jnp.asarray(weights, jnp.float32)
    a = alpha * jnp.broadcast_to(jnp.asarray(smoothness, jnp.float32), alpha.shape)
    return (3.0 / (8.0 * jnp.max(a))).astype(jnp.float32)


def local_optima(loss, params: Any, data: ClientData, smoothness, *, steps: int = PILOT_STEPS):
    """Each client's model after ``steps`` full-batch gradient steps at ``1 / L_i``.

    Client ``i`` starts from ``params`` and descends its own mean loss ``f_i`` over all
    its real rows, ``theta <- theta - grad f_i(theta) / L_i`` (a client with
    ``L_i = 0`` stays). This is gradient descent at the step that decreases ``f_i``
    monotonically; along curvature near ``L_i`` it reaches the local optimum in a few
    steps, along flat directions it falls short (so the separation of the clients,
    and the :func:`coupling` computed from it, is underestimated, not overestimated).

    Args:
      loss: ``loss(params, x, y, mask) -> scalar``.
      params: ONE model (no client axis).
      data: the clients' data.
      smoothness: ``L_i``, shape ``[n]`` (or a scalar), ``>= 0``.
      steps: number of gradient steps (static, ``>= 0``).

    Returns:
      The clients' models, leaves ``[n, ...]``.
    """
    n = data.num_clients
    L = jnp.broadcast_to(jnp.asarray(smoothness, jnp.float32), (n,))
    inv = jnp.where(L > 0, 1.0 / jnp.where(L > 0, L, 1.0), 0.0)
    theta = broadcast(params, n)
    grad = jax.vmap(jax.grad(loss))

    def step(th, _):
        g = grad(th, data.x, data.y, data.mask)
        return jax.tree.map(lambda a, b: a - scale_rows(inv, b), th, g), None

    return lax.scan(step, theta, None, length=steps)[0]


def coupling(lam, radii_sq) -> jnp.ndarray:
    """``kappa``: the algebraic connectivity of the projection's multiplier graph.

    ``lam`` are the pair multipliers of a projection onto ``||theta_i - theta_j||^2 <=
    radii_sq[i, j]`` (``ProjectionState.lam``; KKT ``theta - v + L_lam theta = 0``).
    Weights ``min(lam_ij, MAX_MULTIPLIER)``, and ``MAX_MULTIPLIER`` where the radius is
    0 (pairs tied exactly, which the projection merges); ``kappa`` is the second
    smallest eigenvalue of this graph's Laplacian (0 when the graph is disconnected or
    ``n = 1``). Projecting the clients' local optima, ``lam`` is the solution's
    multipliers in units of the clients' curvature (see ``karula``'s docstring).

    Args:
      lam: ``[n, n]`` nonnegative pair multipliers, symmetric.
      radii_sq: ``[n, n]`` squared radii (``inf`` allowed).

    Returns:
      ``kappa >= 0``, a float32 scalar.
    """
    lam = jnp.asarray(lam, jnp.float32)
    n = lam.shape[0]
    if n < 2:
        return jnp.zeros((), jnp.float32)
    w = jnp.where(jnp.asarray(radii_sq) == 0, MAX_MULTIPLIER, jnp.clip(lam, 0.0, MAX_MULTIPLIER))
    laplacian = graph_laplacian(0.5 * (w + w.T))
    return jnp.maximum(_linalg.eigvalsh(laplacian)[1], 0.0)


def smoothness_estimate(
    loss,
    params: Any,
    data: ClientData,
    *,
    key,
    iterations: int = DEFAULT_ITERATIONS,
    safety: float = DEFAULT_SAFETY,
) -> jnp.ndarray:
    """Each client's ``L_i`` at ``params`` by power iteration with Hessian-vector products.

    For client ``i``, ``H_i`` is the Hessian of ``f_i`` (its mean loss over all its real
    rows) at ``params``; ``v <- H_i v / ||H_i v||`` from a random unit ``v``, with
    ``H_i v = jax.jvp(jax.grad(f_i), (params,), (v,))`` (one linearization, then one
    Jacobian-vector product per step). The estimate is ``safety * ||H_i v||`` after
    ``iterations`` steps; ``||H_i v|| <= max |eigenvalue of H_i|`` and approaches it from
    below (geometrically when the top eigenvalue is separated).

    ``safety = 2`` covers the power iteration's shortfall and curvature that grows
    along the run, together with the factor 1/2 of the step rule (a margin of 4 on the
    curvature at initialization). Quadratics (ridge) have constant curvature, and
    logistic regression its largest at the zero model; on the small ReLU MLP of
    ``tests/test_step_size.py`` the largest alpha-weighted curvature after 300 rounds
    at the default step was up to 2.4 times that at initialization (one client's up
    to 3.6 times) and no run diverged. Nothing is guaranteed for other non-convex
    models: pass ``smoothness`` to ``karula`` when you know better.

    Args:
      loss: ``loss(params, x, y, mask) -> scalar``.
      params: ONE model (no client axis), a pytree of floating arrays.
      data: the clients' data.
      key: PRNG key of the start vectors (client ``i`` uses ``fold_in(key, i)``).
      iterations: power-iteration steps (static, ``>= 1``).
      safety: factor ``> 0`` on the estimate.

    Returns:
      ``L_i``, float32 array of shape ``[n]``.

    Raises:
      TypeError/ValueError: ``params`` that do not fit the data (see
        ``_validation.check_params``), a bad key, ``iterations < 1`` or ``safety <= 0``.
    """
    check_params(loss, params, data)
    check_key("key", key)
    iterations = check_positive_int("iterations", iterations)
    check_positive("safety", safety)
    return (safety * _power_iteration(loss, params, data, key, iterations)).astype(jnp.float32)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _power_iteration(loss, params, data, key, iterations):
    flat, unravel = ravel_pytree(params)
    keys = client_keys(key, jnp.arange(data.num_clients))

    def one_client(x, y, count, k):
        xb, yb, mb = client_batch(k, x, y, count, x.shape[0])  # every real row

        def grad(v):
            return ravel_pytree(jax.grad(loss)(unravel(v), xb, yb, mb))[0]

        _, hvp = jax.linearize(grad, flat)
        v = jax.random.normal(k, flat.shape, flat.dtype)
        v = v / jnp.linalg.norm(v)

        def step(v, _):
            hv = hvp(v)
            norm = jnp.linalg.norm(hv)
            return hv / jnp.maximum(norm, jnp.finfo(hv.dtype).tiny), norm

        _, norms = lax.scan(step, v, None, length=iterations)
        return norms[-1]

    return jax.vmap(one_client)(data.x, data.y, data.counts, keys)


def _check_smoothness_value(value, n: int | None, where: str) -> None:
    v = concrete(value)
    if v is None:
        v = jnp.asarray(value)
        defer(f"smoothness ({where}) is not finite", jnp.all(jnp.isfinite(v)))
        defer(f"smoothness ({where}) is negative (it must be >= 0)", jnp.all(~(v < 0)))
        return
    if v.dtype == bool or not np.issubdtype(v.dtype, np.number):
        raise TypeError(f"smoothness must be real numbers, got {where} of dtype {v.dtype}")
    if v.ndim > 1 or (v.ndim == 1 and n is not None and v.shape[0] != n):
        raise ValueError(f"smoothness must be a scalar or of shape [{n}], got {where} {v.shape}")
    if not np.all(np.isfinite(v)) or np.any(v < 0):
        raise ValueError(f"smoothness must be finite and >= 0, got {where} {v}")


def check_smoothness(smoothness, n: int) -> None:
    """Factory-time check of ``karula``'s ``smoothness`` argument (None, callable or values)."""
    if smoothness is None or callable(smoothness):
        return
    _check_smoothness_value(smoothness, n, "values")


def client_smoothness(loss, params: Any, data: ClientData, smoothness=None, *, key):
    """``L_i`` of shape ``[n]`` as ``karula`` resolves its ``smoothness`` argument.

    In order: values given (a scalar or ``[n]``); a callable ``smoothness(data) -> [n]``;
    the loss's own ``loss.smoothness(data)`` when it has one (``ridge_loss``,
    ``logistic_loss``); else :func:`smoothness_estimate` at ``params`` with ``key``.

    Raises:
      TypeError/ValueError: (concrete values) not real, of another shape than ``[n]``,
        negative or not finite.
    """
    n = data.num_clients
    if smoothness is None:
        own = getattr(loss, "smoothness", None)
        if callable(own):
            values, where = own(data), "loss.smoothness(data)"
        else:
            values, where = smoothness_estimate(loss, params, data, key=key), "estimate"
    elif callable(smoothness):
        values, where = smoothness(data), "smoothness(data)"
    else:
        values, where = smoothness, "values"
    _check_smoothness_value(values, n, where)
    return jnp.broadcast_to(jnp.asarray(values, jnp.float32), (n,))
