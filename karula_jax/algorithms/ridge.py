"""The Lipschitz constant behind Karula's step 3/(8L), for ridge regression."""

from __future__ import annotations

import numpy as np

from karula_jax.algorithms import _common as C
from karula_jax.data.clients import ClientData, client_weights

__all__ = ["lipschitz_ridge"]


def lipschitz_ridge(
    data: ClientData, lam: float, weights=None, *, per_client: bool = False
) -> float:
    """Lipschitz constant of ``grad f`` on the product space, for ridge regression.

    The loss is :func:`karula_jax.models.ridge_loss`:
    ``f_i(theta) = mean_i (x . theta - y)^2 / 2 + lam/2 ||theta||^2``.

    ``f(theta) = (1/n) sum_i alpha_i f_i(theta_i)`` has a block-diagonal Hessian with
    blocks ``alpha_i (X_i^T X_i / N_i + lam I) / n``, so
    ``L = max_i alpha_i L_i / n`` with ``L_i = lambda_max(X_i^T X_i / N_i) + lam``.
    DESIGN's step for Karula is then ``3 / (8 L)``.

    Caution: the paper's theorem assumes each ``alpha_i f_i`` is ``L``-smooth, i.e.
    ``L_paper = max_i alpha_i L_i = n * L`` (``per_client=True``), which gives an ``n``
    times smaller step. With ``s < n`` and weakly coupled clients (large ``t``) the
    larger step ``3 / (8 L)`` can diverge: on ``synthetic_ridge(0)`` (n = 30, s = 10,
    full gradients, D = inf) Karula diverged at ``3/(8L)`` and converged at
    ``0.66 * 3/(8L)`` and below; ``RoundInfo.finite`` reports it.

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
    """
    if not isinstance(data, ClientData):
        raise TypeError(f"data must be a ClientData, got {type(data).__name__}")
    C.check_nonnegative("lam", lam)
    x = np.asarray(data.x, dtype=np.float64)
    if x.ndim != 3:
        raise ValueError(f"data.x must have shape [n, N_max, d], got {x.shape}")
    counts = np.asarray(data.counts)
    mask = np.arange(x.shape[1])[None, :] < counts[:, None]
    x = np.where(mask[..., None], x, 0.0)
    if not np.all(np.isfinite(x)):
        raise ValueError("data.x contains NaN or infinite values on real rows")
    gram = np.einsum("nki,nkj->nij", x, x) / np.maximum(counts, 1)[:, None, None]
    L_i = np.linalg.eigvalsh(gram)[:, -1] + lam
    if weights is None:
        alpha = np.asarray(client_weights(counts), dtype=np.float64)
    else:
        C.check_weights(weights, x.shape[0])
        alpha = np.asarray(weights, dtype=np.float64)
    L = float(np.max(alpha * L_i))
    return L if per_client else L / x.shape[0]
