"""Lipschitz constants of ``grad f`` on the product space for the linear models (float64).

Karula's default step (:func:`karula_jax.algorithms.karula_learning_rate`) needs each
client's constant ``L_i``; the losses of :mod:`karula_jax.models` compute them in JAX
(``ridge_smoothness``, ``logistic_smoothness``). The functions here return the
product-space constant of ``f(theta) = (1/n) sum_i alpha_i f_i(theta_i)`` in float64, with
checks, for reporting and for steps chosen by hand.
"""

from __future__ import annotations

import numpy as np

from karula_jax._checks import check_nonnegative
from karula_jax._smoothness import linear_smoothness
from karula_jax.algorithms._validation import check_weights
from karula_jax.data.clients import ClientData, client_weights

__all__ = ["lipschitz_logistic", "lipschitz_ridge"]


def _product_space_constant(
    data: ClientData, lam: float, weights, per_client: bool, *, intercept: bool, scale: float
) -> float:
    """``max_i alpha_i L_i`` (``/ n`` unless ``per_client``) with
    ``L_i = scale * lambda_max(Z_i^T Z_i / N_i) + lam``, ``Z_i = X_i`` or ``[X_i, 1]``."""
    if not isinstance(data, ClientData):
        raise TypeError(f"data must be a ClientData, got {type(data).__name__}")
    check_nonnegative("lam", lam)
    counts = np.asarray(data.counts)
    L_i = linear_smoothness(data, lam, intercept=intercept, curvature=scale, float64=True)
    if weights is None:
        alpha = np.asarray(client_weights(counts), dtype=np.float64)
    else:
        check_weights(weights, counts.shape[0])
        alpha = np.asarray(weights, dtype=np.float64)
    L = float(np.max(alpha * L_i))
    return L if per_client else L / counts.shape[0]


def lipschitz_ridge(
    data: ClientData, lam: float, weights=None, *, per_client: bool = False
) -> float:
    """Lipschitz constant of ``grad f`` on the product space, for ridge regression.

    The loss is :func:`karula_jax.models.ridge_loss`:
    ``f_i(theta) = mean_i (x . theta - y)^2 / 2 + lam/2 ||theta||^2``.

    ``f(theta) = (1/n) sum_i alpha_i f_i(theta_i)`` has a block-diagonal Hessian with
    blocks ``alpha_i (X_i^T X_i / N_i + lam I) / n``, so
    ``L = max_i alpha_i L_i / n`` with ``L_i = lambda_max(X_i^T X_i / N_i) + lam``.
    Karula's default step is ``1 / L`` when every client participates and smaller with
    client sampling (:func:`karula_jax.algorithms.karula_learning_rate`); ``3 / (8L)`` with
    this product-space ``L`` (a step n times Theorem 4.3's) can diverge with ``s < n`` and
    weakly coupled clients.

    The paper's theorem assumes each ``alpha_i f_i`` is ``L``-smooth, i.e.
    ``L_paper = max_i alpha_i L_i = n * L`` (``per_client=True``); its step
    ``3 / (8 L_paper)`` is ``karula(..., learning_rate="theorem")``.

    A client without samples (``N_i = 0``) has ``f_i(theta) = lam/2 ||theta||^2`` (the
    masked mean of :func:`karula_jax.models.ridge_loss` over no row is 0), so its
    ``L_i = lam``; with the default weights its ``alpha_i`` is 0.

    Args:
      data: clients with ``x`` of shape ``[n, N_max, d]`` (padded rows are ignored).
      lam: ridge penalty ``>= 0``.
      weights: optional ``alpha`` of shape ``[n]`` (default ``client_weights(counts)``).
      per_client: return ``max_i alpha_i L_i`` (the paper's constant) instead.

    Returns:
      ``L`` as a Python float.

    Raises:
      TypeError: ``data`` is not a ClientData; ``lam`` not a real number.
      ValueError: ``lam`` negative or not finite; ``data.x`` not ``[n, N_max, d]``, or
        holding NaN/inf on real rows; every count 0 (with default weights); bad
        ``weights``.

    Examples:
      >>> import numpy as np
      >>> import karula_jax as kj
      >>> xs, ys = [np.full((2, 1), 2.0), np.ones((1, 1))], [np.ones(2), np.ones(1)]
      >>> data = kj.data.from_client_arrays(xs, ys)
      >>> L_i = [4.0, 1.0]  # lambda_max(X_i^T X_i / N_i); alpha = [4/3, 2/3]
      >>> round(kj.algorithms.lipschitz_ridge(data, 0.0), 4)  # max_i alpha_i L_i / n
      2.6667
      >>> round(kj.algorithms.lipschitz_ridge(data, 0.0, per_client=True), 4)  # max_i alpha_i L_i
      5.3333
    """
    return _product_space_constant(data, lam, weights, per_client, intercept=False, scale=1.0)


def lipschitz_logistic(
    data: ClientData, lam: float, weights=None, *, per_client: bool = False
) -> float:
    """Lipschitz constant of ``grad f`` on the product space, for logistic regression.

    The loss is :func:`karula_jax.models.logistic_loss` on ``{"w": [d], "b": []}``. With
    ``Z_i = [X_i, 1]`` (the intercept's column) the Hessian of ``f_i`` is
    ``Z_i^T diag(sigma'(z)) Z_i / N_i + diag(lam I, 0)`` with ``sigma' <= 1/4``, so
    ``L_i = lambda_max(Z_i^T Z_i / (4 N_i)) + lam`` bounds it everywhere (it is attained
    up to the unpenalized bias at the zero model). As for :func:`lipschitz_ridge`,
    ``L = max_i alpha_i L_i / n``, or ``max_i alpha_i L_i`` with ``per_client=True``.

    Args:
      data: clients with ``x`` of shape ``[n, N_max, d]`` (padded rows are ignored).
      lam: L2 penalty on ``w``, ``>= 0``.
      weights: optional ``alpha`` of shape ``[n]`` (default ``client_weights(counts)``).
      per_client: return ``max_i alpha_i L_i`` instead.

    Returns:
      ``L`` as a Python float.

    Raises:
      As :func:`lipschitz_ridge`.
    """
    return _product_space_constant(data, lam, weights, per_client, intercept=True, scale=0.25)
