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

from karula_jax.algorithms import _common as C
from karula_jax.algorithms._graph import check_dissimilarity, weights_numpy
from karula_jax.algorithms._local import local_train
from karula_jax.algorithms._personalized import check_personalized, personalized_flags
from karula_jax.algorithms.base import Algorithm, FedState, LossFn

__all__ = ["CLUSTER_METHODS", "cluster_clients", "clustered_fedavg"]

CLUSTER_METHODS = ("spectral", "agglomerative")


# --------------------------------------------------------------------------- clustering


def _canonical(labels: np.ndarray) -> np.ndarray:
    """Groups renumbered in order of first appearance (client 0 is in group 0)."""
    _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    order = np.argsort(np.argsort(first))
    return order[inverse].astype(np.int32)


def _average_linkage(D, k: int) -> np.ndarray:
    """Average-linkage (UPGMA) agglomerative clustering of ``D`` cut at ``k`` groups.

    Starts from singletons and repeatedly merges the two groups with the smallest average
    dissimilarity ``d(A, B) = mean_{i in A, j in B} D_ij`` (Lance-Williams update
    ``d(A u B, C) = (|A| d(A, C) + |B| d(B, C)) / (|A| + |B|)``) until ``k`` remain.
    Ties go to the pair with the lowest indices. ``inf`` entries are allowed: groups at
    infinite distance merge last. O(n^3) time, O(n^2) memory, in numpy.

    Args:
      D: dissimilarities ``[n, n]``, symmetric, ``>= 0``, no NaN.
      k: number of groups, ``1 <= k <= n``.

    Returns:
      int32 labels of shape ``[n]`` in ``0..k-1``, numbered by first appearance.
    """
    d = np.array(D, dtype=np.float64)
    n = d.shape[0]
    np.fill_diagonal(d, np.inf)
    size = np.ones(n)
    alive = np.ones(n, bool)
    labels = np.arange(n)
    for _ in range(n - k):
        masked = np.where(alive[:, None] & alive[None, :], d, np.inf)
        np.fill_diagonal(masked, np.inf)
        flat = int(np.argmin(masked))
        a, b = divmod(flat, n)
        if not np.isfinite(masked[a, b]):  # only infinite distances left: merge any two
            live = np.flatnonzero(alive)
            a, b = int(live[0]), int(live[1])
        a, b = min(a, b), max(a, b)
        with np.errstate(invalid="ignore"):
            merged = (size[a] * d[a] + size[b] * d[b]) / (size[a] + size[b])
        merged = np.where(np.isnan(merged), np.inf, merged)
        d[a, :], d[:, a] = merged, merged
        d[a, a] = np.inf
        size[a] += size[b]
        alive[b] = False
        labels[labels == b] = a
    return _canonical(labels)


def _kmeans_pp(X: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding: indices of ``k`` distinct rows of ``X``."""
    n = X.shape[0]
    chosen = [int(rng.integers(n))]
    d2 = ((X - X[chosen[0]]) ** 2).sum(1)
    for _ in range(1, k):
        p = np.where(np.isin(np.arange(n), chosen), 0.0, d2)
        if p.sum() <= 0:  # every remaining row coincides with a center
            p = np.where(np.isin(np.arange(n), chosen), 0.0, 1.0)
        c = int(rng.choice(n, p=p / p.sum()))
        chosen.append(c)
        d2 = np.minimum(d2, ((X - X[c]) ** 2).sum(1))
    return np.asarray(chosen)


def _lloyd(X: np.ndarray, centers: np.ndarray, max_iter: int) -> tuple[np.ndarray, float]:
    """Lloyd iterations; an emptied cluster takes the row farthest from its center among
    clusters with two rows or more, so every cluster stays nonempty. Returns
    ``(labels, inertia)``."""
    k = centers.shape[0]
    labels = None
    for _ in range(max_iter):
        dist = ((X[:, None] - centers[None]) ** 2).sum(-1)
        new = np.argmin(dist, axis=1)
        for c in range(k):
            if not np.any(new == c):
                counts = np.bincount(new, minlength=k)
                own = dist[np.arange(len(X)), new]
                own = np.where(counts[new] > 1, own, -1.0)
                new[int(np.argmax(own))] = c
        if labels is not None and np.array_equal(new, labels):
            break
        labels = new
        centers = np.stack([X[labels == c].mean(0) for c in range(k)])
    inertia = float(((X - centers[labels]) ** 2).sum())
    return labels, inertia


def _spectral(D, k: int, seed: int, restarts: int, max_iter: int) -> np.ndarray:
    """Normalized spectral clustering (Ng, Jordan and Weiss 2002) of ``D``."""
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
        centers = X[_kmeans_pp(X, k, rng)]
        labels, inertia = _lloyd(X, centers, max_iter)
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
      embedding with rows scaled to unit norm, then k-means on the rows (k-means++ seeding
      from ``numpy.random.default_rng(seed)``, ``restarts`` runs, the lowest inertia kept;
      no cluster is left empty). Deterministic for a given ``seed``.
    * ``"agglomerative"``: average linkage on ``D`` cut at ``k`` groups
      (UPGMA: merge the two groups of smallest mean ``D_ij``; deterministic).

    Runs once before training, in numpy (not under ``jit``).

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
    d = C.concrete(D)
    if d is None:
        raise ValueError("D must be a concrete array (cluster_clients runs outside jit)")
    n = d.shape[0]
    k = C.check_positive_int("k", k)
    if k > n:
        raise ValueError(f"k={k} exceeds the number of clients n={n}")
    restarts = C.check_positive_int("restarts", restarts)
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
    lab = C.concrete(labels)
    if lab is None:
        C.defer("labels are negative (they must be >= 0)", jnp.all(jnp.asarray(labels) >= 0))
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
    C.check_nonnegative("learning_rate", learning_rate)
    s = C.check_positive_int("clients_per_round", clients_per_round)
    B = C.check_positive_int("batch_size", batch_size)
    E = C.check_positive_int("local_steps", local_steps)
    C.check_weights(weights)
    check_personalized(personalized)
    labels = jnp.asarray(labels, jnp.int32)

    def _check_data(data) -> None:
        _check_labels(labels, data.num_clients)
        C.check_clients_per_round(s, data.num_clients)

    def init(params, data, *, key) -> FedState:
        C.check_params(loss, params, data)
        personalized_flags(personalized, params)  # its structure
        _check_data(data)
        return C.start_state(params, data.num_clients, C.run_key(key))

    def round_fn(state: FedState, data):
        _check_data(data)
        alpha, mask, idx, key_batch = C.begin_round(state, data, s, weights)
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
        info = C.round_info(values, a_s, mask, C.all_finite(values, rows))
        return state._replace(params=params, round=state.round + 1), info

    return Algorithm(init=init, round=round_fn, client_params=C.own_params)
