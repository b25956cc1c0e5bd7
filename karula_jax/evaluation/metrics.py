"""Per-client metrics of client models on client data, each an array ``[n]``.

jit/vmap friendly, padding masked by ``counts``: :func:`estimation_error`,
:func:`mean_squared_error`, :func:`r2_score`, :func:`accuracy`, :func:`log_loss`. Models
enter through ``apply_fn(params_i, x) -> outputs``, the convention of
:mod:`karula_jax.models` (``model.apply`` for flax models, ``lambda theta, x: x @ theta``
for a linear model).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from karula_jax._checks import check_targets
from karula_jax.data.clients import ClientData

__all__ = [
    "ApplyFn",
    "accuracy",
    "estimation_error",
    "log_loss",
    "mean_squared_error",
    "r2_score",
]

ApplyFn = Callable[[Any, jnp.ndarray], jnp.ndarray]


def _per_client(fn, apply_fn: ApplyFn, params, data: ClientData) -> jnp.ndarray:
    """``fn(outputs_i, y_i, mask_i)`` for every client, ``[n]``."""
    out = jax.vmap(apply_fn)(params, data.x)
    return jax.vmap(fn)(out, data.y, data.mask)


def _masked_mean(values: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    total = jnp.sum(jnp.where(mask, values, 0.0))
    return total / jnp.maximum(jnp.sum(mask.astype(values.dtype)), 1.0)


def estimation_error(params: Any, params_true: Any) -> jnp.ndarray:
    """``||theta_i - theta_i*||^2`` per client, summed over all leaves, ``[n]``.

    Args:
      params: client models, leaves ``[n, ...]``.
      params_true: the true models, same structure and shapes.

    Examples:
      >>> import jax.numpy as jnp
      >>> from karula_jax.evaluation import estimation_error
      >>> estimation_error(jnp.ones((2, 3)), jnp.array([[1.0, 1.0, 1.0], [0.0, 1.0, 3.0]])).tolist()
      [0.0, 5.0]
    """

    def one(a, b):
        return jnp.sum(((a - b) ** 2).reshape(a.shape[0], -1), axis=1)

    return sum(jax.tree.leaves(jax.tree.map(one, params, params_true)))


def mean_squared_error(apply_fn: ApplyFn, params: Any, data: ClientData) -> jnp.ndarray:
    """Each client's mean squared prediction error on its own real rows, ``[n]``.

    Args:
      apply_fn: ``apply_fn(params_i, x [N_max, ...]) -> predictions [N_max]``.
      params: client models, leaves ``[n, ...]``.
      data: ``x`` ``[n, N_max, ...]``, ``y`` ``[n, N_max]``.

    Returns:
      ``sum_k mask (pred - y)^2 / max(N_i, 1)`` per client (0 for a client with no rows).
    """

    def one(pred, y, mask):
        check_targets(y, pred.shape, "apply_fn's predictions")
        return _masked_mean((pred - y) ** 2, mask)

    return _per_client(one, apply_fn, params, data)


def r2_score(apply_fn: ApplyFn, params: Any, data: ClientData) -> jnp.ndarray:
    """Coefficient of determination of each client's model on its own rows, ``[n]``.

    ``R^2_i = 1 - sum (y - pred)^2 / sum (y - mean_i y)^2`` over client ``i``'s real rows
    (``-inf`` or NaN when its targets are constant).

    Args:
      apply_fn: ``apply_fn(params_i, x [N_max, ...]) -> predictions [N_max]``.
      params: client models, leaves ``[n, ...]``.
      data: ``x`` ``[n, N_max, ...]``, ``y`` ``[n, N_max]``.
    """

    def one(pred, y, mask):
        check_targets(y, pred.shape, "apply_fn's predictions")
        ybar = jnp.sum(jnp.where(mask, y, 0.0)) / jnp.maximum(jnp.sum(mask), 1)
        sse = jnp.sum(jnp.where(mask, (y - pred) ** 2, 0.0))
        return 1.0 - sse / jnp.sum(jnp.where(mask, (y - ybar) ** 2, 0.0))

    return _per_client(one, apply_fn, params, data)


def accuracy(apply_fn: ApplyFn, params: Any, data: ClientData) -> jnp.ndarray:
    """Fraction of each client's real rows classified correctly, ``[n]``.

    Args:
      apply_fn: ``apply_fn(params_i, x) -> logits``: ``[N_max, C]`` (class = arg-max) or
        ``[N_max]`` for a binary model (class 1 where the logit is positive).
      params: client models, leaves ``[n, ...]``.
      data: integer labels ``y`` ``[n, N_max]``.
    """

    def one(z, y, mask):
        pred = jnp.argmax(z, axis=-1) if z.ndim == 2 else (z > 0).astype(jnp.int32)
        check_targets(y, pred.shape, "apply_fn's rows")
        real = mask.reshape(mask.shape + (1,) * (z.ndim - 1))
        diverged = jnp.any(jnp.where(real, ~jnp.isfinite(z), False))  # argmax(NaN) = 0
        return jnp.where(diverged, jnp.nan, _masked_mean((pred == y).astype(jnp.float32), mask))

    return _per_client(one, apply_fn, params, data)


def log_loss(apply_fn: ApplyFn, params: Any, data: ClientData) -> jnp.ndarray:
    """Each client's mean cross-entropy on its own real rows, ``[n]``.

    Args:
      apply_fn: ``apply_fn(params_i, x) -> logits``: ``[N_max, C]`` (softmax) or
        ``[N_max]`` (binary: ``log(1 + e^z) - y z``).
      params: client models, leaves ``[n, ...]``.
      data: integer labels ``y`` ``[n, N_max]``.
    """

    def one(z, y, mask):
        if z.ndim == 2:
            picked = jnp.take_along_axis(z, y[:, None].astype(jnp.int32), axis=-1)[:, 0]
            nll = jax.nn.logsumexp(z, axis=-1) - picked
        else:
            nll = jax.nn.softplus(z) - y.astype(z.dtype) * z
        return _masked_mean(nll, mask)

    return _per_client(one, apply_fn, params, data)
