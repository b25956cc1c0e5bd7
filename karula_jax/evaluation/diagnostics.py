"""Dissimilarities against models (host side, numpy): how well ``D`` matches the clients.

:func:`pairwise_sq_distances` between client models, :func:`spearman_offdiag` (rank
correlation of two dissimilarity matrices) and :func:`active_fraction` (Karula's binding
constraints).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from karula_jax._checks import personalized_flags

__all__ = ["active_fraction", "pairwise_sq_distances", "spearman_offdiag"]


def pairwise_sq_distances(params: Any, personalized: Any = True) -> np.ndarray:
    """``||theta_i - theta_j||^2`` between client models, ``[n, n]`` (numpy, float64).

    Args:
      params: client models, leaves ``[n, ...]``.
      personalized: True (every leaf counts) or a pytree of bools like ``params``: only
        the True leaves count (the meaning of ``personalized`` in every factory).

    Examples:
      >>> import numpy as np
      >>> from karula_jax.evaluation import pairwise_sq_distances
      >>> pairwise_sq_distances(np.array([[0.0, 0.0], [3.0, 4.0]])).tolist()
      [[0.0, 25.0], [25.0, 0.0]]
    """
    flags = jax.tree.leaves(personalized_flags(personalized, params))
    leaves = [a for a, f in zip(jax.tree.leaves(params), flags, strict=True) if f]
    if not leaves:
        raise ValueError("personalized: no leaf is True, so there is no distance to measure")
    v = np.concatenate([np.asarray(a, np.float64).reshape(len(a), -1) for a in leaves], axis=1)
    return np.stack([np.sum((v - v_i) ** 2, axis=1) for v_i in v])


def _square_pair(name_a: str, a: Any, name_b: str, b: Any) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape != b.shape or a.shape[0] < 2:
        raise ValueError(
            f"{name_a} and {name_b} must be square matrices of one shape [n, n] with n >= 2, "
            f"got {a.shape} and {b.shape}"
        )
    return a, b


def _ranks(v: np.ndarray) -> np.ndarray:
    """Ranks 1..m with ties given their average rank (as ``scipy.stats.rankdata``)."""
    order = np.argsort(v, kind="stable")
    sorted_v = v[order]
    starts = np.r_[True, sorted_v[1:] != sorted_v[:-1]]
    group = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)
    last = np.r_[first[1:], len(v)] - 1
    ranks = np.empty(len(v))
    ranks[order] = (first[group] + last[group]) / 2.0 + 1.0
    return ranks


def spearman_offdiag(a: Any, b: Any) -> float:
    """Spearman rank correlation of the pairs ``i < j`` of two dissimilarity matrices.

    Args:
      a: ``[n, n]`` (e.g. Karula's ``D``).
      b: ``[n, n]`` (e.g. the true ``||theta_i* - theta_j*||^2``).

    Returns:
      The Pearson correlation of the average ranks of the strictly upper triangles (NaN
      if one of them is constant).

    Examples:
      >>> import numpy as np
      >>> from karula_jax.evaluation import spearman_offdiag
      >>> a = np.array([[0, 1, 2], [1, 0, 3], [2, 3, 0]])
      >>> spearman_offdiag(a, a ** 2), spearman_offdiag(a, -a)  # ranks of the pairs i < j
      (1.0, -1.0)
    """
    a, b = _square_pair("a", a, "b", b)
    iu = np.triu_indices(a.shape[0], k=1)
    ra, rb = _ranks(a[iu]), _ranks(b[iu])
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = np.sqrt(np.sum(ra**2) * np.sum(rb**2))
    return float(np.sum(ra * rb) / den) if den > 0 else float("nan")


def active_fraction(sq_dists: Any, D: Any, t: float, *, rtol: float = 1e-3) -> float:
    """Fraction of pairs ``i < j`` whose constraint ``||theta_i - theta_j||^2 <= t D_ij`` binds.

    A pair counts when ``||theta_i - theta_j||^2 >= (1 - rtol) t D_ij``: the constraint is
    tight or violated (for Local models: a pair Karula's projection must pull together).

    Args:
      sq_dists: ``[n, n]`` squared distances between models (:func:`pairwise_sq_distances`).
      D: ``[n, n]`` dissimilarities.
      t: radius scale.
      rtol: relative tolerance of "tight".
    """
    sq, D = _square_pair("sq_dists", sq_dists, "D", D)
    iu = np.triu_indices(sq.shape[0], k=1)
    return float(np.mean(sq[iu] >= (1.0 - rtol) * t * D[iu]))
