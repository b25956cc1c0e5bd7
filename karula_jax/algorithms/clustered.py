"""Clustered FedAvg on ``D``: the clustering use of Karula's dissimilarities.

:func:`cluster_clients` partitions the clients once, before training, from ``D`` alone
(spectral clustering or average-linkage agglomeration); :func:`clustered_fedavg` then
runs FedAvg inside each group. Both are ablations of Karula that use the same ``D``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax._checks import check_nonnegative, check_positive_int, concrete, defer
from karula_jax.algorithms._graph import check_dissimilarity, weights_numpy
from karula_jax.algorithms._local import local_train
from karula_jax.algorithms._personalized import check_personalized, personalized_flags
from karula_jax.algorithms._rounds import begin_round, own_params, round_info, start_state
from karula_jax.algorithms._sampling import run_key
from karula_jax.algorithms._trees import all_finite
from karula_jax.algorithms._validation import check_clients_per_round, check_params, check_weights
from karula_jax.algorithms.base import Algorithm, FedState, LossFn

__all__ = ["CLUSTER_METHODS", "cluster_clients", "clustered_fedavg"]

CLUSTER_METHODS = ("spectral", "agglomerative")


# --------------------------------------------------------------------------- clustering


def _canonical(labels: np.ndarray) -> np.ndarray:
    """Groups renumbered in order of first appearance (client 0 is in group 0)."""
    _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    order = np.argsort(np.argsort(first))
    return order[inverse].astype(np.int32)


def _average_linkage(d: np.ndarray, k: int) -> np.ndarray:
    """Average-linkage (UPGMA) agglomerative clustering of ``d`` cut at ``k`` groups.

    :func:`scipy.cluster.hierarchy.linkage` (``method="average"``: merge the two groups
    of smallest mean dissimilarity) and :func:`~scipy.cluster.hierarchy.cut_tree` at
    exactly ``k`` groups. Infinite entries merge last: they are replaced by a finite value
    above every average of finite entries (after dividing ``d`` by its largest finite
    entry), so groups at infinite distance join only when nothing else is left.

    Args:
      d: float64 dissimilarities ``[n, n]``, symmetric, ``>= 0``, no NaN, ``n >= 2``.
      k: number of groups, ``1 <= k <= n``.

    Returns:
      int32 labels of shape ``[n]`` in ``0..k-1``, numbered by first appearance.
    """
    n = d.shape[0]
    if not np.all(np.isfinite(d)):
        finite = d[np.isfinite(d)]
        top = finite.max() if finite.size and finite.max() > 0 else 1.0
        # a group pair with an infinite pair averages > (n^2 + 1) / (n^2 / 4) > 1 >= any
        # average of finite (scaled) entries
        d = np.where(np.isfinite(d), d / top, float(n * n + 1))
    # imported here: scipy.cluster (with scipy.spatial) is a second of `import karula_jax`
    from scipy.cluster.hierarchy import cut_tree, linkage  # noqa: PLC0415
    from scipy.spatial.distance import squareform  # noqa: PLC0415

    Z = linkage(squareform(d, checks=False), method="average")
    return _canonical(cut_tree(Z, n_clusters=k)[:, 0])


def _fill_empty(X: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    """``labels`` with every empty cluster given the row farthest from its cluster's
    mean, among clusters with two rows or more (k-means can empty a cluster)."""
    labels = labels.copy()
    for c in range(k):
        if np.any(labels == c):
            continue
        counts = np.bincount(labels, minlength=k)
        centers = np.stack([X[labels == j].mean(0) if counts[j] else X[0] for j in range(k)])
        own = ((X - centers[labels]) ** 2).sum(1)
        labels[int(np.argmax(np.where(counts[labels] > 1, own, -1.0)))] = c
    return labels


def _kmeans_pp(X: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding: the first center a uniformly drawn row, each next one a row
    drawn with probability proportional to its squared distance to the nearest center
    so far. Draws from ``rng`` as :func:`scipy.cluster.vq.kmeans2` (``minit="++"``) does:
    one integer, then one uniform per further center. ``[n, d] -> [k, d]``."""
    centers = np.empty((k, X.shape[1]))
    centers[0] = X[rng.integers(X.shape[0])]
    nearest = np.full(X.shape[0], np.inf)
    for i in range(1, k):
        nearest = np.minimum(nearest, ((X - centers[i - 1]) ** 2).sum(1))
        cumulative = np.cumsum(nearest / nearest.sum())
        centers[i] = X[int(np.searchsorted(cumulative, rng.uniform()))]
    return centers


def _lloyd(X: np.ndarray, centers: np.ndarray, max_iter: int) -> np.ndarray:
    """Lloyd iterations from ``centers`` ``[k, d]``: each row to its nearest center
    (the first on ties), each center to the mean of its rows (an empty cluster keeps its
    center), until the labels repeat (a fixed point: every later iteration would return
    the same) or ``max_iter`` iterations. Returns the labels ``[n]``."""
    k, labels = centers.shape[0], None
    for _ in range(max_iter):
        new = np.argmin(((X[:, None, :] - centers[None]) ** 2).sum(-1), axis=1)
        if labels is not None and np.array_equal(new, labels):
            break
        labels = new
        sums = np.zeros_like(centers)
        np.add.at(sums, labels, X)
        counts = np.bincount(labels, minlength=k)
        centers = np.where(counts[:, None] > 0, sums / np.maximum(counts, 1)[:, None], centers)
    return labels


def _spectral(D, k: int, seed: int, restarts: int, max_iter: int) -> np.ndarray:
    """Normalized spectral clustering (Ng, Jordan and Weiss 2002) of ``D``: k-means
    (:func:`_kmeans_pp` seeding, :func:`_lloyd`) on the rows of its spectral embedding,
    ``restarts`` times, the lowest inertia kept."""
    W = weights_numpy(D)
    deg = W.sum(1)
    inv_sqrt = np.where(deg > 0, 1.0 / np.sqrt(np.where(deg > 0, deg, 1.0)), 0.0)
    # isolated clients (degree 0) get a zero row and column: eigenvalue 0, their own group
    L = np.diag((deg > 0).astype(float)) - inv_sqrt[:, None] * W * inv_sqrt[None, :]
    _, vecs = np.linalg.eigh(L)
    X = vecs[:, :k]
    X = X / np.maximum(np.linalg.norm(X, axis=1, keepdims=True), 1e-12)
    rng = np.random.default_rng(seed)
    best, best_inertia = None, np.inf
    for _ in range(restarts):
        # rows that coincide leave k-means++ without a distinct row to seed from and can
        # empty a cluster: _fill_empty repairs
        with np.errstate(invalid="ignore", divide="ignore"):
            labels = _lloyd(X, _kmeans_pp(X, k, rng), max_iter)
        labels = _fill_empty(X, labels, k)
        centers = np.stack([X[labels == c].mean(0) for c in range(k)])
        inertia = float(((X - centers[labels]) ** 2).sum())
        if best is None or inertia < best_inertia * (1 - 1e-12):
            best, best_inertia = labels, inertia
    return _canonical(best)


def cluster_clients(
    D, k: int, *, method: str = "spectral", seed: int = 0, restarts: int = 10
) -> np.ndarray:
    """Partitions the clients into ``k`` groups from the dissimilarities ``D`` alone.

    * ``"spectral"`` (default): affinity ``W = graph_weights(D)`` (``exp(-D_ij /
      median D)``, 0 for ``D_ij = inf``), normalized Laplacian ``I - Deg^{-1/2} W
      Deg^{-1/2}``, its ``k`` eigenvectors of smallest eigenvalue as an ``[n, k]``
      embedding with rows scaled to unit norm, then k-means on the rows (k-means++
      seeding from ``numpy.random.default_rng(seed)`` and Lloyd iterations to a fixed
      point, as :func:`scipy.cluster.vq.kmeans2` with ``minit="++"`` but stopped once
      the labels repeat; ``restarts`` runs, the lowest inertia kept; an
      emptied cluster takes the row farthest from its center, so none is left empty).
      Deterministic for a given ``seed``.
    * ``"agglomerative"``: average linkage on ``D`` cut at ``k`` groups
      (:func:`scipy.cluster.hierarchy.linkage`, UPGMA: merge the two groups of smallest
      mean ``D_ij``; infinite entries merge last; deterministic).

    Runs once before training, in numpy and scipy (not under ``jit``).

    Args:
      D: dissimilarities, array ``[n, n]``: symmetric, ``>= 0``, no NaN, may contain
        ``inf``.
      k: number of groups (Python int), ``1 <= k <= n``.
      method: ``"spectral"`` or ``"agglomerative"``.
      seed: seed of the spectral method's k-means.
      restarts: number of k-means runs of the spectral method, ``>= 1``.

    Returns:
      int32 numpy array of shape ``[n]``: each client's group in ``0..k-1``, every group
      nonempty, groups numbered in order of first appearance (client 0 is in group 0).

    Raises:
      ValueError: ``D`` not square/symmetric, negative or NaN (or traced); ``k`` outside
        ``[1, n]``; unknown ``method``.
      TypeError: ``k`` or ``restarts`` not an int.
    """
    check_dissimilarity(D)
    d = concrete(D)
    if d is None:
        raise ValueError("D must be a concrete array (cluster_clients runs outside jit)")
    n = d.shape[0]
    k = check_positive_int("k", k)
    if k > n:
        raise ValueError(f"k={k} exceeds the number of clients n={n}")
    restarts = check_positive_int("restarts", restarts)
    if method not in CLUSTER_METHODS:
        raise ValueError(f"method must be one of {CLUSTER_METHODS}, got {method!r}")
    d = np.asarray(d, np.float64)
    if k == n:
        return np.arange(n, dtype=np.int32)
    if method == "agglomerative":
        return _average_linkage(d, k)
    return _spectral(d, k, seed, restarts, max_iter=300)


# --------------------------------------------------------------------------- training


def _check_labels(labels, n: int | None = None) -> None:
    dtype = jnp.result_type(labels)
    if dtype == jnp.bool_ or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"labels must be an integer array of shape [n], got dtype {dtype}")
    shape = jnp.shape(labels)
    if len(shape) != 1 or (n is not None and shape[0] != n):
        want = f"[{n}]" if n is not None else "[n]"
        raise ValueError(f"labels must have shape {want} (one group per client), got {shape}")
    lab = concrete(labels)
    if lab is None:
        defer("labels are negative (they must be >= 0)", jnp.all(jnp.asarray(labels) >= 0))
    elif lab.size and lab.min() < 0:
        raise ValueError(f"labels must be >= 0, found {lab.min()}")


def clustered_fedavg(
    loss: LossFn,
    labels,
    *,
    learning_rate,
    clients_per_round: int,
    batch_size: int,
    local_steps: int = 5,
    weights=None,
    personalized: Any = False,
) -> Algorithm:
    """FedAvg run separately inside fixed groups of clients (e.g. from :func:`cluster_clients`).

    One round: the ``s`` participants, drawn among all ``n`` clients as in every method,
    each run ``E = local_steps`` SGD steps on their own mean loss from their group's model
    (exactly :func:`fedavg`'s local training, same keys); each group's model becomes the
    ``alpha``-weighted average of the models returned by its participating members. A
    group with no participant this round keeps its model.

    * All labels equal (``k = 1``): equals :func:`fedavg` (same key, same numbers up to
      float rounding of the average).
    * All labels distinct (``k = n``): each client trains alone, ``E`` local steps each
      time it participates.

    Args:
      loss: ``loss(params, x, y, mask) -> scalar``.
      labels: integer array ``[n]``, client ``i``'s group; any nonnegative integers (only
        equality matters). May be traced, so a vmapped grid can pass stacked label
        arrays (e.g. one per number of groups) to one compiled program.
      learning_rate: local step size ``>= 0`` (as in :func:`fedavg`); may be traced.
      clients_per_round: ``s`` (static), ``1 <= s <= n``.
      batch_size: ``B`` (static).
      local_steps: ``E`` (static), default 5.
      weights: optional ``alpha`` of shape ``[n]``.
      personalized: True, False or a pytree of bools like ``params``
        (:mod:`~karula_jax.algorithms._personalized`): True leaves are kept by each client
        and never averaged (FedPer style). Default False: one model per group.

    Returns:
      An :class:`Algorithm`; ``state.params`` holds each client's model (its group's
      model, plus personalized leaves when requested).

    Raises:
      TypeError: ``labels`` not integer.
      ValueError: ``labels`` not of shape ``[n]`` or negative; ``learning_rate``
        negative/NaN/inf; ``clients_per_round``, ``batch_size`` or ``local_steps`` < 1
        (``s > n`` at ``init``/``round``); bad ``weights``.
    """
    _check_labels(labels)
    check_nonnegative("learning_rate", learning_rate)
    s = check_positive_int("clients_per_round", clients_per_round)
    B = check_positive_int("batch_size", batch_size)
    E = check_positive_int("local_steps", local_steps)
    check_weights(weights)
    check_personalized(personalized)
    labels = jnp.asarray(labels, jnp.int32)

    def _check_data(data) -> None:
        _check_labels(labels, data.num_clients)
        check_clients_per_round(s, data.num_clients)

    def init(params, data, *, key) -> FedState:
        check_params(loss, params, data)
        personalized_flags(personalized, params)  # its structure
        _check_data(data)
        return start_state(params, data.num_clients, run_key(key))

    def round_fn(state: FedState, data):
        _check_data(data)
        alpha, mask, idx, key_batch = begin_round(state, data, s, weights)
        rows, values = local_train(loss, state.params, data, idx, key_batch, E, learning_rate, B)
        a_s = alpha[idx]
        same = labels[:, None] == labels[idx][None, :]  # [n, s]: participant j in i's group
        Wt = jnp.where(same, a_s[None, :], 0.0)  # [n, s]
        total = jnp.sum(Wt, axis=1)  # [n]
        has = total > 0
        flags = personalized_flags(personalized, state.params)

        def leaf(flag, p, r):
            if flag:  # personalized: participants keep their own trained rows
                return p.at[idx].set(r.astype(p.dtype))
            avg = jnp.tensordot(Wt, r, axes=1) / jnp.where(has, total, 1.0).reshape(
                (-1,) + (1,) * (r.ndim - 1)
            )
            keep = has.reshape((-1,) + (1,) * (p.ndim - 1))
            return jnp.where(keep, avg.astype(p.dtype), p)

        params = jax.tree.map(leaf, flags, state.params, rows)
        info = round_info(values, a_s, mask, all_finite(values, rows))
        return state._replace(params=params, round=state.round + 1), info

    return Algorithm(init=init, round=round_fn, client_params=own_params)
