"""Each client's smoothness constant ``L_i`` of the linear models' losses, in one place.

The losses of :mod:`karula_jax.models` (``ridge_loss``, ``logistic_loss``) carry it as
``loss.smoothness(data)``, in JAX (traceable). The product-space constants of
:mod:`karula_jax.algorithms.ridge` and the study's rate rules
(:func:`karula_jax.protocol.smoothness_constants`) take it in float64 numpy. Both come
from :func:`linear_smoothness`; a loss without a closed form is estimated by
:func:`karula_jax.algorithms.smoothness_estimate` instead.

This module imports nothing from ``karula_jax`` but ``_checks`` and ``_linalg``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from karula_jax import _linalg

__all__ = ["linear_smoothness"]


def linear_smoothness(data, lam, *, intercept: bool, curvature: float, float64: bool = False):
    """``L_i = curvature * lambda_max(Z_i^T Z_i / N_i) + lam`` for every client.

    ``Z_i`` is client ``i``'s real rows of ``x`` (``[N_i, d]``), with a column of ones
    appended when ``intercept``; padding rows never count, even when they hold inf. A
    client without rows has ``L_i = lam``. Ridge regression is ``curvature = 1`` without
    intercept (the Hessian is ``X_i^T X_i / N_i + lam I``); logistic regression with a
    bias is ``curvature = 1/4`` with intercept (``sigma' <= 1/4`` bounds its Hessian).

    Args:
      data: a ``ClientData`` with ``x`` of shape ``[n, N_max, d]`` and ``counts [n]``.
      lam: the L2 penalty ``>= 0``, already checked by the caller; may be traced unless
        ``float64``.
      intercept: append the ones column.
      curvature: the factor on the Gram matrix's largest eigenvalue (a Python float).
      float64: compute in float64 numpy (concrete data; NaN or inf on a real row is a
        ValueError) instead of in JAX in ``x``'s dtype (traceable).

    Returns:
      ``L_i``, an array of shape ``[n]``: float64 numpy with ``float64``, else JAX.

    Raises:
      ValueError: ``data.x`` is not ``[n, N_max, d]``; (``float64``) NaN or inf on a
        real row.
    """
    xp = np if float64 else jnp
    x = np.asarray(data.x, np.float64) if float64 else jnp.asarray(data.x)
    if x.ndim != 3:
        raise ValueError(f"data.x must have shape [n, N_max, d], got {x.shape}")
    counts = np.asarray(data.counts) if float64 else jnp.asarray(data.counts)
    mask = xp.arange(x.shape[1])[None, :] < counts[:, None]
    x = xp.where(mask[..., None], x, 0.0)
    if float64 and not np.all(np.isfinite(x)):
        raise ValueError("data.x contains NaN or infinite values on real rows")
    if intercept:
        x = xp.concatenate([x, mask[..., None].astype(x.dtype)], axis=-1)
    rows = np.maximum(counts, 1) if float64 else jnp.maximum(counts.astype(x.dtype), 1.0)
    gram = xp.einsum("nki,nkj->nij", x, x) / rows[:, None, None]
    top = (np.linalg.eigvalsh if float64 else _linalg.eigvalsh)(gram)[:, -1]
    return (top if curvature == 1 else curvature * top) + lam
