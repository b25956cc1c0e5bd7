"""Randomness of a run: its keys, each round's participants and each client's minibatches.

* Keys. ``init(..., key=key)`` splits its key into one for init-time draws and the run's
  ``state.key`` (:func:`init_and_run_keys`), the same way in every algorithm, so one key
  gives the same participants and minibatches in every method (paired comparisons).
* Participation. Each round exactly ``s`` of the ``n`` clients are drawn uniformly
  without replacement (:func:`sample_participants`) from ``fold_in(state.key,
  state.round)``; gradients are computed only for them (gather ``s`` rows, vmap one
  client's kernel, scatter back).
* Minibatches. ``B`` rows drawn without replacement among a client's own ``N_i`` real
  rows (:func:`sample_rows`, :func:`client_batch`); padding is never drawn. A client with
  ``N_i < B`` uses all its rows. When ``B >= N_max`` every client uses all its rows: the
  gradient is exact and deterministic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from karula_jax._checks import check_key

__all__ = [
    "client_batch",
    "client_keys",
    "init_and_run_keys",
    "run_key",
    "sample_participants",
    "sample_rows",
]


def client_keys(key: jnp.ndarray, idx: jnp.ndarray) -> jnp.ndarray:
    """``fold_in(key, i)`` for every ``i`` in ``idx``."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(idx)


def init_and_run_keys(key: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Splits ``init``'s key into (key for init-time draws, ``state.key`` of the run).

    Every algorithm derives ``state.key`` the same way, so one key gives the same
    participants and minibatches in every method (paired comparisons).
    """
    check_key("key", key)
    key_init, key_run = jax.random.split(key)
    return key_init, key_run


def run_key(key: jnp.ndarray) -> jnp.ndarray:
    """``state.key`` of a run started with ``init(..., key=key)``."""
    return init_and_run_keys(key)[1]


def sample_participants(key: jnp.ndarray, n: int, s: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Draws ``s`` of ``n`` clients uniformly without replacement.

    Args:
      key: PRNG key of the round.
      n: number of clients (static).
      s: number of participants (static), ``1 <= s <= n``.

    Returns:
      ``(mask, idx)``: boolean array of shape ``[n]`` with exactly ``s`` True entries,
      and the int32 indices of the participants, shape ``[s]``.
    """
    if s == n:  # everyone: no randomness, and a fixed order keeps runs reproducible
        idx = jnp.arange(n, dtype=jnp.int32)
    else:
        idx = jax.random.permutation(key, n)[:s].astype(jnp.int32)
    mask = jnp.zeros((n,), bool).at[idx].set(True)
    return mask, idx


def sample_rows(key, count, max_count: int, batch_size: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Draws ``B`` rows without replacement among one client's ``count`` real rows.

    Padding rows get key ``+inf`` so that they come after every real row in the
    ordering; the first ``min(B, count)`` picks are therefore real and distinct.

    Args:
      key: PRNG key of this client and step.
      count: number of real rows ``N_i`` (int scalar, may be traced).
      max_count: padded size ``N_max`` (static).
      batch_size: ``B`` (static).

    Returns:
      ``(rows, mask)``: int32 indices of shape ``[min(B, N_max)]`` and a boolean mask of
      the same shape, True on the ``min(B, N_i)`` rows that enter the loss.
    """
    if batch_size >= max_count:  # full batch: all real rows, deterministic
        rows = jnp.arange(max_count, dtype=jnp.int32)
        return rows, rows < count
    u = jax.random.uniform(key, (max_count,))
    u = jnp.where(jnp.arange(max_count) < count, u, jnp.inf)
    _, rows = lax.top_k(-u, batch_size)
    mask = jnp.arange(batch_size) < jnp.minimum(batch_size, count)
    return rows.astype(jnp.int32), mask


def client_batch(key, x, y, count, batch_size):
    """One client's minibatch ``(x_b, y_b, mask_b)`` (see :func:`sample_rows`).

    Rows outside the mask are filled with a copy of the client's first real row, so
    padding values never reach the user's loss, even masked (a loss that multiplies
    by the mask would otherwise turn inf padding into NaN).

    Args:
      key: PRNG key of this client and step; in a round with minibatch key ``k``,
        client ``i``'s step ``e`` uses ``fold_in(fold_in(k, i), e)`` (Karula, FedSGD and
        the SAGA memory use step 0).
      x: the client's padded features ``[N_max, ...]``; y: its targets ``[N_max, ...]``.
      count: its number of real rows ``N_i``.
      batch_size: ``B`` (static).

    Returns:
      ``(x_b, y_b, mask_b)`` with ``min(B, N_max)`` rows and a boolean mask of the rows
      that enter the loss.
    """
    max_count = x.shape[0]
    if batch_size >= max_count:
        rows, mask = jnp.arange(max_count), jnp.arange(max_count) < count
    else:
        rows, mask = sample_rows(key, count, max_count, batch_size)
    rows = jnp.where(mask, rows, 0)
    return x[rows], y[rows], mask
