"""Pytree operations on client-stacked leaves ``[n, ...]``: rows, means, copies, distances.

A leaf of ``FedState.params`` shared by every client may be stored once, as ``[1, ...]``
(:func:`stack_clients`); :func:`gather` broadcasts such a leaf back to the rows it is
asked for.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "all_finite",
    "broadcast",
    "first_row",
    "gather",
    "scale_rows",
    "scatter",
    "stack_clients",
    "tree_sq_dist",
    "weighted_mean",
]


def gather(tree: Any, idx: jnp.ndarray) -> Any:
    """Rows ``idx`` of every leaf (leading client axis).

    A leaf stored once for every client (leading axis 1, see :func:`stack_clients`) gives
    its one row to every index; for such a leaf this equals indexing, without the copy.
    """

    def rows(a):
        if jnp.shape(a)[0] == 1:
            return jnp.broadcast_to(a, (idx.shape[0], *jnp.shape(a)[1:]))
        return a[idx]

    return jax.tree.map(rows, tree)


def scatter(tree: Any, idx: jnp.ndarray, rows: Any, *, after: Any = None) -> Any:
    """``tree`` with rows ``idx`` of every leaf replaced by ``rows``.

    ``after``: values computed from reads of ``tree`` (e.g. a direction built from the
    memory). The write then depends on them, so it is ordered after every read and XLA
    updates a donated ``tree`` in place; with a read left unordered it copies the
    whole ``[n, ...]`` leaf, twice, to keep the read correct. ``rows`` are unchanged
    bit for bit.
    """
    if after is not None:
        total = sum(jnp.sum(a.astype(jnp.float32)) for a in jax.tree.leaves(after))
        always = (total == total) | (total != total)  # True, NaN included; not folded
        rows = jax.tree.map(lambda b: jnp.where(always, b, jnp.zeros_like(b)), rows)
    return jax.tree.map(lambda a, b: a.at[idx].set(b.astype(a.dtype)), tree, rows)


def all_finite(*trees: Any) -> jnp.ndarray:
    """True iff every floating leaf of every tree is free of NaN/inf."""
    leaves = [x for t in trees for x in jax.tree.leaves(t)]
    flags = [jnp.all(jnp.isfinite(x)) for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


def scale_rows(w: jnp.ndarray, a: jnp.ndarray) -> jnp.ndarray:
    """``w[i] * a[i]`` for every row ``i`` of ``a`` (``w`` of shape ``[rows]``)."""
    return (w.reshape((-1,) + (1,) * (a.ndim - 1)) * a).astype(a.dtype)


def weighted_mean(tree: Any, w: jnp.ndarray, *, otherwise: Any = None) -> Any:
    """``sum_i w_i tree[i] / sum_i w_i`` over the leading axis of every leaf.

    Where the weights sum to 0 (a round whose participants all weigh 0: ``weights`` with
    zeros, clients without rows), ``otherwise``: a tree shaped like one row, what the
    caller keeps then (its model as it was, a zero step); default the plain mean over the
    leading axis. Never ``0 / 0``.
    """
    total = jnp.sum(w)
    empty = ~(total > 0)
    safe = jnp.where(empty, 1.0, total)
    mean = jax.tree.map(lambda a: jnp.tensordot(w, a, axes=1) / safe, tree)
    if otherwise is None:
        otherwise = jax.tree.map(lambda a: jnp.mean(a, axis=0), tree)
    return jax.tree.map(
        lambda m, o, a: jnp.where(empty, o, m).astype(a.dtype), mean, otherwise, tree
    )


def first_row(tree: Any) -> Any:
    """Row 0 of every leaf: the model of a state whose shared leaves are stored once
    (``[1, ...]``); on a per-client leaf, client 0's (callers use it only where shared)."""
    return jax.tree.map(lambda a: a[0], tree)


def broadcast(tree: Any, n: int) -> Any:
    """Every leaf repeated along a new leading client axis of size ``n``."""
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *jnp.shape(a))), tree)


def stack_clients(params: Any, n: int, *, shared: Any = None) -> Any:
    """Every client's copy of one model ``params``, as ``FedState.params`` holds it.

    Leaves are repeated along a leading client axis ``[n, ...]``, except the leaves that
    ``shared`` (a pytree of bools like ``params``; ``None``: none) flags as common to all
    clients: those are stored once, as ``[1, ...]``, so that a global model costs one copy
    and not ``n``. :func:`gather` and :func:`karula_jax.algorithms._rounds.own_params`
    broadcast them back.
    """
    if shared is None:
        return broadcast(params, n)
    return jax.tree.map(
        lambda flag, a: jnp.asarray(a)[None] if flag else broadcast(a, n), shared, params
    )


def tree_sq_dist(a: Any, b: Any) -> jnp.ndarray:
    """``||a - b||^2`` summed over all leaves of two pytrees of the same structure."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return sum(jnp.sum((x - y) ** 2) for x, y in zip(la, lb, strict=True))
