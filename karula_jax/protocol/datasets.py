"""The data of a study: stacked data sets, the CV layout, and what each member needs from its
data (Karula's D, the clients' groups).

A study has ``S`` seeds, each with its own training and test data. :func:`cv_datasets`
stacks the ``S (K + 1)`` data sets a cross-validated comparison trains on, seed-major on
one *member* axis: member ``s (K + 1) + f`` holds fold ``f``'s training rows (``evals``:
its validation rows) for ``f < K`` and all training rows (``evals``: the test rows) for
``f = K``, the seed's final fit. With ``K = 0`` the members are the final fits alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax import _platform
from karula_jax import algorithms as A
from karula_jax import evaluation as ev
from karula_jax._checks import check_key, is_concrete
from karula_jax.data.clients import ClientData
from karula_jax.embedding import dissimilarities
from karula_jax.training import default_batch_mesh, split_members
from karula_jax.training._compile import compile_loops
from karula_jax.training.checkpoint import is_key

__all__ = [
    "CVData",
    "cluster_labels",
    "cv_datasets",
    "mean_normalized",
    "member_dissimilarities",
    "stack_datasets",
]


def _pad_rows(data: ClientData, rows: int) -> ClientData:
    """Pads the row axis (the one after ``counts``' axes) with zeros to ``rows``."""
    lead = data.counts.ndim
    if data.x.shape[lead] > rows:
        raise ValueError(f"rows must be >= the data's {data.x.shape[lead]} rows, got {rows}")
    # host-side (numpy): data plumbing, not worth an XLA compilation per shape
    pad = lambda a: np.pad(
        np.asarray(a),
        [(0, 0)] * lead + [(0, rows - a.shape[lead])] + [(0, 0)] * (a.ndim - lead - 1),
    )
    return ClientData(pad(data.x), pad(data.y), np.asarray(data.counts))


def stack_datasets(items: Sequence[ClientData], *, rows: int | None = None) -> ClientData:
    """Stacks data sets with the same clients on a new leading axis, padding their rows.

    Args:
      items: data sets with equal client counts and feature shapes.
      rows: rows per client after padding (default: the largest of ``items``).

    Returns:
      A :class:`ClientData` with host (numpy) leaves ``[len(items), n, rows, ...]``.

    Examples:
      >>> import numpy as np
      >>> import karula_jax as kj
      >>> def rows(*counts):  # one feature, target 1
      ...     xs = [np.ones((c, 1)) for c in counts]
      ...     return kj.data.from_client_arrays(xs, [np.ones(c) for c in counts])
      >>> a, b = rows(2, 3), rows(5, 1)  # two data sets of the same 2 clients
      >>> both = kj.protocol.stack_datasets([a, b])  # rows padded to the largest, 5
      >>> both.x.shape, both.counts.tolist()
      ((2, 2, 5, 1), [[2, 3], [5, 1]])
    """
    if not items:
        raise ValueError("items must hold at least one data set")
    rows = max(int(d.x.shape[1]) for d in items) if rows is None else rows
    shapes = {(d.x.shape[0], d.x.shape[2:], d.y.shape[2:]) for d in items}
    if len(shapes) != 1:
        raise ValueError(f"items must share clients and feature shapes, got {sorted(shapes)}")
    return jax.tree.map(lambda *a: np.stack(a), *(_pad_rows(d, rows) for d in items))


class CVData(NamedTuple):
    """``S (K + 1)`` data sets on one member axis (layout: module docstring)."""

    train: ClientData  # leaves [S (K + 1), n, N, ...]
    evals: ClientData  # leaves [S (K + 1), n, N_eval, ...]
    num_seeds: int
    num_folds: int

    def final(self, tree: Any) -> Any:
        """The final-fit members ``[S, ...]`` of a member-stacked ``tree``."""
        K = self.num_folds
        return jax.tree.map(lambda a: a[K :: K + 1], tree)

    def per_member(self, tree: Any) -> Any:
        """Repeats per-seed leaves ``[S, ...]`` for every member ``[S (K + 1), ...]``."""
        repeat = lambda a: (np if isinstance(a, np.ndarray) else jnp).repeat(
            a, self.num_folds + 1, axis=0
        )
        return jax.tree.map(repeat, tree)


def cv_datasets(
    train: ClientData, test: ClientData, num_folds: int, *, key=None, folds=None
) -> CVData:
    """Splits each seed's training rows into ``K`` folds and stacks folds and final fits.

    Args:
      train: training data per seed, leaves ``[S, n, N, ...]``.
      test: test data per seed, leaves ``[S, n, N_test, ...]``.
      num_folds: ``K >= 2``; or 0: no folds, the members are the ``S`` final fits (a
        study whose hyperparameters are fixed), ``evals`` is ``test`` unpadded.
      key: stacked keys ``[S]`` drawing each seed's folds (:func:`~karula_jax.evaluation.fold_ids`).
      folds: or explicit fold ids ``[S, n, N]`` (``-1`` on padding); exactly one of the two
        (neither when ``num_folds`` is 0).

    Returns:
      A :class:`CVData` (host leaves with folds); validation and test rows are padded to a
      common row count.

    Raises:
      ValueError: a client with rows has fewer than ``num_folds`` of them (a fold would
        leave it no validation or no training row); explicit ``folds`` with ids outside
        ``[0, K)`` on real rows or not ``-1`` on padding.

    Examples:
      >>> import jax
      >>> import karula_jax as kj
      >>> from karula_jax import protocol
      >>> draws = [kj.data.synthetic_ridge(s, num_clients=4, dim=2, num_test=20) for s in range(2)]
      >>> train = protocol.stack_datasets([d.train for d in draws])
      >>> test = protocol.stack_datasets([d.test for d in draws])
      >>> cv = protocol.cv_datasets(train, test, 3, key=jax.random.split(jax.random.key(0), 2))
      >>> cv.num_seeds, cv.num_folds, cv.train.counts.shape  # S (K + 1) members of n clients
      (2, 3, (8, 4))
      >>> bool((cv.evals.counts[3] == 20).all())  # member 3: seed 0's final fit, its test rows
      True
    """
    if num_folds and (key is None) == (folds is None):
        raise ValueError("pass exactly one of key and folds")
    if not num_folds and (key is not None or folds is not None):
        raise ValueError("num_folds=0 has no folds: pass neither key nor folds")
    if train.counts.ndim != 2 or test.counts.ndim != 2:
        raise ValueError("train and test must have leaves [S, n, N, ...] (a seed axis)")
    if train.counts.shape != test.counts.shape:
        raise ValueError(
            f"train and test must have the same seeds and clients, got counts "
            f"{train.counts.shape} and {test.counts.shape}"
        )
    K, S = num_folds, int(train.counts.shape[0])
    if K == 0:
        return CVData(train, test, S, 0)
    # One compiled program: run op by op under vmap, the split compiled each of its
    # operations alone (the synthetic study's 10 seeds: 3.2 s against 1.1 s; the same bits).
    _check_fold_sizes(np.asarray(train.counts), K)
    if folds is not None:
        ev.check_fold_ids(np.asarray(train.counts), K, np.asarray(folds))
    given = {"key": key} if folds is None else {"folds": jnp.asarray(folds)}
    fit, val = jax.jit(jax.vmap(lambda d, g: ev.kfold_split(d, K, **g)))(train, given)
    rows = max(int(train.x.shape[2]), int(test.x.shape[2]))
    val, test = _pad_rows(val, rows), _pad_rows(test, rows)
    join = lambda a, b: np.concatenate([np.asarray(a), np.asarray(b)[:, None]], 1).reshape(
        (-1,) + a.shape[2:]
    )
    return CVData(jax.tree.map(join, fit, train), jax.tree.map(join, val, test), S, K)


def _check_fold_sizes(counts: np.ndarray, num_folds: int) -> None:
    """Every client with rows has at least ``K``, so that each fold leaves it a validation
    and a training row (fewer gave clients without rows in some fold: NaN dissimilarities,
    empty validation sets)."""
    real = counts[counts > 0]
    smallest = int(real.min()) if real.size else num_folds
    if smallest < num_folds:
        fix = f"use num_folds <= {smallest}" if smallest >= 2 else "one row cannot be split"
        raise ValueError(
            f"num_folds={num_folds} exceeds the smallest client's {smallest} row(s): each "
            f"fold must leave every client a validation and a training row ({fix}; or drop "
            f"or merge that client)"
        )


def mean_normalized(D):
    """Each ``[n, n]`` matrix of ``D`` (``[..., n, n]``, zero diagonal) divided by its mean
    off-diagonal entry, so that a grid of ``t`` means the same across data sets. Works on
    numpy and JAX arrays alike (computed in ``D``'s own dtype). A matrix without a positive
    off-diagonal entry (identical clients, or n = 1) has no scale and stays as it is (it
    was 0 / 0, all NaN)."""
    n = D.shape[-1]
    mean = D.sum(axis=(-2, -1), keepdims=True) / max(n * (n - 1), 1)
    where = np.where if isinstance(D, np.ndarray) else jnp.where
    return D / where(mean > 0, mean, 1).astype(mean.dtype)


def member_dissimilarities(train: ClientData, key: jax.Array, **options) -> tuple[Any, Any]:
    """Karula's D of every member of a stacked data set, as one compiled program: the
    members in turn on the CPU backend, vmapped on accelerators.

    On the CPU backend (``jax.default_backend()``) the members run one after another
    (``lax.map``), each client batch of ``embed`` stopping at its own slowest solve;
    elsewhere (``vmap``) a client batch runs until the slowest solve of that batch over
    all members stops. Either way each solve gives its own answer within its stopping
    threshold (float rounding in another compiled program can move a solve's stop to
    another threshold check).

    Args:
      train: members' data, leaves ``[B, n, N, ...]``.
      key: one key for every member (a typed key, or a raw ``uint32[2]`` one), or stacked
        keys (typed ``[B]``, or raw ``[B, 2]``), one per member.
      **options: keywords of :func:`karula_jax.embedding.dissimilarities`.

    Returns:
      ``(D [B, n, n], info)``, ``info`` with a leading member axis. With several devices
      in one process the members are split over :func:`~karula_jax.training.batch_mesh`
      (each device embeds its own; the same values).
    """
    num_members = int(jax.tree.leaves(train)[0].shape[0])
    counts = np.asarray(train.counts) if is_concrete(train.counts) else None
    if counts is not None and (counts < 1).any():
        b, i = (int(v) for v in np.argwhere(counts < 1)[0])
        raise ValueError(
            f"train.counts must be >= 1 for every member and client (the embedding needs a "
            f"row per client), member {b}'s client {i} has none"
        )
    keys = _member_keys(key, num_members)

    def one(d, k):
        return dissimilarities(d, key=k, **options)

    def in_turn(d, k):
        return jax.lax.map(lambda member: one(*member), (d, k))

    members = in_turn if _platform.members_in_turn() else jax.vmap(one)
    members = split_members(members, default_batch_mesh(num_members), (0, 0))
    # Sinkhorn loops: compiled like a run's rounds (LLVM level 2 on the CPU)
    return compile_loops(jax.jit(members), train, keys)(train, keys)


def _member_keys(key, num_members: int):
    """``key`` as one key per member: a single typed key (``[]``) or raw key (``[2]``)
    repeated, stacked keys (``[B]`` typed, ``[B, 2]`` raw) as they are."""
    if getattr(key, "dtype", None) is None:
        check_key("key", key)  # raises: not an array
    single = jnp.ndim(key) == (0 if is_key(key) else 1)
    if not single:
        return key
    return jnp.broadcast_to(key, (num_members, *jnp.shape(key)))


def cluster_labels(D: Any, choices: Sequence[int]) -> np.ndarray:
    """Spectral clusters of every member's D for each number of clusters in ``choices``.

    Args:
      D: dissimilarities ``[B, n, n]``.
      choices: numbers of clusters (:func:`karula_jax.algorithms.cluster_clients`).

    Returns:
      Labels ``[B, len(choices), n]`` int32 (the clustered FedAvg's ``labels``).
    """
    return np.asarray([[A.cluster_clients(d, k) for k in choices] for d in np.asarray(D)], np.int32)
