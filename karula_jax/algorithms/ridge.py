"""The Lipschitz constant behind Karula's step 3/(8L), for ridge regression."""

from __future__ import annotations

import numpy as np

from karula_jax.algorithms import _common as C
from karula_jax.data.clients import ClientData, client_weights

__all__ = ["lipschitz_ridge"]


def lipschitz_ridge(data: ClientData, lam: float, weights=None) -> float:
    """Lipschitz constant of ``grad f`` on the product space, for ridge regression.

    The loss is :func:`karula_jax.models.ridge_loss`:
    ``f_i(theta) = mean_i (x . theta - y)^2 / 2 + lam/2 ||theta||^2``.

    ``f(theta) = (1/n) sum_i alpha_i f_i(theta_i)`` has a block-diagonal Hessian with
    blocks ``alpha_i (X_i^T X_i / N_i + lam I) / n``, so
    ``L = max_i alpha_i L_i / n`` with ``L_i = lambda_max(X_i^T X_i / N_i) + lam``.
    Karula's theoretical step is then ``3 / (8 L)``.

    Args:
      data: clients with ``x`` of shape ``[n, N_max, d]`` (padded rows are ignored).
      lam: ridge penalty ``>= 0``.
      weights: optional ``alpha`` of shape ``[n]`` (default ``client_weights(counts)``).

    Returns:
      ``L`` as a Python float.
    """
    C.check_nonnegative("lam", lam)
    x = np.asarray(data.x, dtype=np.float64)
    if x.ndim != 3:
        raise ValueError(f"data.x must have shape [n, N_max, d], got {x.shape}")
    counts = np.asarray(data.counts)
    mask = np.arange(x.shape[1])[None, :] < counts[:, None]
    x = np.where(mask[..., None], x, 0.0)
    gram = np.einsum("nki,nkj->nij", x, x) / counts[:, None, None]
    L_i = np.linalg.eigvalsh(gram)[:, -1] + lam
    if weights is None:
        alpha = np.asarray(client_weights(counts), dtype=np.float64)
    else:
        C.check_weights(weights, x.shape[0])
        alpha = np.asarray(weights, dtype=np.float64)
    return float(np.max(alpha * L_i) / x.shape[0])
