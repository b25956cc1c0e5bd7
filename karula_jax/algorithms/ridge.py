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

    Args:
      data: clients with ``x`` of shape ``[n, N_max, d]`` (padded rows are ignored).
      lam: ridge penalty ``>= 0``.
      weights: optional ``alpha`` of shape ``[n]`` (default ``client_weights(counts)``).
      per_client: return ``max_i alpha_i L_i`` (the paper's constant) instead.

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
    L = float(np.max(alpha * L_i))
    return L if per_client else L / x.shape[0]
