"""Padded, client-stacked data: the one container every other module consumes.

Clients hold different numbers of samples. To run all of them in one compiled
program we pad every client to the largest count ``N_max`` and carry the true
counts alongside; ``mask`` marks the real rows so padding never reaches a loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

__all__ = ["ClientData", "client_weights", "from_client_arrays"]


class ClientData(NamedTuple):
    """Data of ``n`` clients padded to a common size.

    Attributes:
      x: features, array of shape ``[n, N_max, *feature_shape]``; padded rows are 0.
      y: targets, array of shape ``[n, N_max, *target_shape]`` (integer labels for
        classification, floats for regression); padded rows are 0.
      counts: number of real samples per client, int32 array of shape ``[n]``.
    """

    x: jnp.ndarray  # [n, N_max, ...] float32
    y: jnp.ndarray  # [n, N_max, ...] float32 or int32
    counts: jnp.ndarray  # [n] int32

    @property
    def num_clients(self) -> int:
        return self.x.shape[0]

    @property
    def max_count(self) -> int:
        return self.x.shape[1]

    @property
    def mask(self) -> jnp.ndarray:
        """Boolean array of shape ``[n, N_max]``: True on real samples."""
        return jnp.arange(self.max_count)[None, :] < self.counts[:, None]

    def subset(self, clients) -> ClientData:
        """The data of the clients with the given indices (same padding)."""
        idx = np.asarray(clients)
        return ClientData(self.x[idx], self.y[idx], self.counts[idx])


def _check_finite(name: str, i: int, a: np.ndarray) -> None:
    if np.issubdtype(a.dtype, np.number) and not np.all(np.isfinite(a)):
        raise ValueError(f"{name}[{i}] contains NaN or infinite values")


def from_client_arrays(
    xs: Sequence[np.ndarray],
    ys: Sequence[np.ndarray],
    *,
    num_classes: int | None = None,
    max_count: int | None = None,
    dtype=jnp.float32,
) -> ClientData:
    """Builds :class:`ClientData` from per-client arrays, validating them.

    Args:
      xs: one array per client, shape ``[N_i, *feature_shape]``; all clients must share
        ``feature_shape``.
      ys: one array per client, shape ``[N_i, *target_shape]``.
      num_classes: if given, targets are class labels: they must be integers in
        ``[0, num_classes)`` and are stored as int32.
      max_count: pad to this many rows instead of ``max_i N_i`` (useful to keep shapes
        static across data sets); must be at least ``max_i N_i``.
      dtype: floating dtype for features (and regression targets).

    Returns:
      The padded :class:`ClientData`.

    Raises:
      ValueError: on empty input, mismatched lengths or shapes, empty clients,
        NaN/infinite values, or labels that are not integers in range.
      TypeError: when an element is not array-like.
    """
    if len(xs) == 0:
        raise ValueError("xs must hold at least one client, got an empty sequence")
    if len(xs) != len(ys):
        raise ValueError(f"xs and ys must have one entry per client, got {len(xs)} and {len(ys)}")
    xs_np, ys_np = [], []
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        try:
            x = np.asarray(x)
            y = np.asarray(y)
        except Exception as e:  # noqa: BLE001 - re-raised with context
            raise TypeError(f"client {i}: xs and ys entries must be array-like ({e})") from e
        if x.ndim < 1 or x.shape[0] == 0:
            raise ValueError(f"client {i} has no samples (xs[{i}].shape = {x.shape})")
        if y.ndim < 1 or y.shape[0] != x.shape[0]:
            raise ValueError(
                f"client {i}: xs[{i}] has {x.shape[0]} rows but ys[{i}] has shape {y.shape}"
            )
        if not (np.issubdtype(x.dtype, np.number) or x.dtype == bool):
            raise TypeError(f"xs[{i}] must be numeric, got dtype {x.dtype}")
        _check_finite("xs", i, x)
        _check_finite("ys", i, y)
        if x.ndim == 1:
            x = x[:, None]
        if xs_np and x.shape[1:] != xs_np[0].shape[1:]:
            raise ValueError(
                f"feature shapes differ between clients: xs[0] has {xs_np[0].shape[1:]}, "
                f"xs[{i}] has {x.shape[1:]}"
            )
        if ys_np and y.shape[1:] != ys_np[0].shape[1:]:
            raise ValueError(
                f"target shapes differ between clients: ys[0] has {ys_np[0].shape[1:]}, "
                f"ys[{i}] has {y.shape[1:]}"
            )
        if num_classes is not None:
            if np.issubdtype(y.dtype, np.floating):
                if not np.all(y == np.round(y)):
                    raise ValueError(f"ys[{i}] must hold integer class labels, found non-integers")
            elif not np.issubdtype(y.dtype, np.integer):
                raise TypeError(f"ys[{i}] must hold integer class labels, got dtype {y.dtype}")
            if y.size and (y.min() < 0 or y.max() >= num_classes):
                raise ValueError(
                    f"ys[{i}] labels must lie in [0, {num_classes}), found range "
                    f"[{y.min()}, {y.max()}]"
                )
        xs_np.append(x)
        ys_np.append(y)

    counts = np.array([x.shape[0] for x in xs_np], dtype=np.int32)
    n_max = int(counts.max())
    if max_count is not None:
        if max_count < n_max:
            raise ValueError(f"max_count={max_count} is smaller than the largest client ({n_max})")
        n_max = int(max_count)
    y_dtype = np.int32 if num_classes is not None else np.dtype(dtype)
    x_pad = np.zeros((len(xs_np), n_max, *xs_np[0].shape[1:]), dtype=np.dtype(dtype))
    y_pad = np.zeros((len(ys_np), n_max, *ys_np[0].shape[1:]), dtype=y_dtype)
    for i, (x, y) in enumerate(zip(xs_np, ys_np, strict=True)):
        x_pad[i, : x.shape[0]] = x
        y_pad[i, : y.shape[0]] = y
    return ClientData(jnp.asarray(x_pad), jnp.asarray(y_pad), jnp.asarray(counts))


def client_weights(counts) -> jnp.ndarray:
    """Client weights ``alpha_i`` proportional to ``N_i``, normalized so mean(alpha) = 1.

    Args:
      counts: array of shape ``[n]`` with positive sample counts.

    Returns:
      Float32 array of shape ``[n]``.
    """
    counts = jnp.asarray(counts, dtype=jnp.float32)
    return counts * counts.shape[0] / jnp.sum(counts)
