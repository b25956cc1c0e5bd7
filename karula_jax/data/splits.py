"""Each client's rows split into training and test rows: :func:`train_test_split`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax.data.clients import ClientData

__all__ = ["train_test_split"]


def train_test_split(
    data: ClientData, test_fraction: float = 0.25, *, key: jax.Array
) -> tuple[ClientData, ClientData]:
    """Splits every client's real rows at random into training and test rows.

    Client ``i`` keeps ``N_i - m_i`` rows for training and ``m_i = round(test_fraction *
    N_i)`` for testing, with ``m_i`` at least 1 and at most ``N_i - 1`` wherever ``N_i >=
    2`` (both sides hold a row); a client with one row keeps it for training and tests on
    none, one without rows has none on either side. Rows keep their order within each side;
    padding is 0 as in :class:`ClientData`, each side padded to its own largest client.

    Args:
      data: one data set, ``x [n, N_max, ...]`` with concrete ``counts [n]`` (not a stack
        of data sets: split each, then :func:`karula_jax.protocol.stack_datasets`).
      test_fraction: the share of each client's rows held out, in ``(0, 1)``.
      key: a PRNG key; the same key gives the same split.

    Returns:
      ``(train, test)``, two :class:`ClientData` with the clients of ``data`` in order.

    Raises:
      TypeError: ``data`` is not a :class:`ClientData`; ``test_fraction`` not a number.
      ValueError: ``test_fraction`` outside ``(0, 1)``; ``data`` a stack of data sets.

    Examples:
      >>> import jax
      >>> from karula_jax.data import synthetic_ridge, train_test_split
      >>> data = synthetic_ridge(0, num_clients=3, dim=2, min_samples=4, max_samples=8).train
      >>> train, test = train_test_split(data, 0.25, key=jax.random.key(0))
      >>> (train.counts + test.counts).tolist() == data.counts.tolist()
      True
      >>> bool((test.counts >= 1).all())  # every client with 2 rows or more tests on one
      True
    """
    if not isinstance(data, ClientData):
        raise TypeError(f"data must be a ClientData, got {type(data).__name__}")
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, int | float):
        raise TypeError(f"test_fraction must be a number in (0, 1), got {test_fraction!r}")
    if not 0.0 < float(test_fraction) < 1.0:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    counts = np.asarray(data.counts)
    if counts.ndim != 1:
        raise ValueError(
            f"data must be one data set (counts [n]), got counts of shape {counts.shape}: "
            "split each data set, then stack them"
        )
    x, y = np.asarray(data.x), np.asarray(data.y)
    train_rows, test_rows = [], []
    for i, count in enumerate(counts.tolist()):
        held = 0 if count < 2 else min(max(round(test_fraction * count), 1), count - 1)
        order = np.asarray(jax.random.permutation(jax.random.fold_in(key, i), count))
        test_rows.append(np.sort(order[:held]))
        train_rows.append(np.sort(order[held:]))
    return _gather(x, y, train_rows), _gather(x, y, test_rows)


def _gather(x: np.ndarray, y: np.ndarray, rows: list[np.ndarray]) -> ClientData:
    """Client ``i``'s rows ``rows[i]`` of ``x`` and ``y``, padded with zeros."""
    width = max(1, max((len(r) for r in rows), default=0))
    out_x = np.zeros((len(rows), width, *x.shape[2:]), x.dtype)
    out_y = np.zeros((len(rows), width, *y.shape[2:]), y.dtype)
    for i, r in enumerate(rows):
        out_x[i, : len(r)], out_y[i, : len(r)] = x[i, r], y[i, r]
    counts = np.asarray([len(r) for r in rows], np.int32)
    return ClientData(jnp.asarray(out_x), jnp.asarray(out_y), jnp.asarray(counts))
