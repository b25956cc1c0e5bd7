"""Graph helpers shared by the methods that read ``D`` (Karula, the Laplacian penalty,
clustered FedAvg): the check of a dissimilarity matrix, its similarity weights in numpy
and the graph Laplacian of weights.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from karula_jax._checks import concrete, defer

__all__ = ["check_dissimilarity", "graph_laplacian", "weights_numpy"]


def check_dissimilarity(D) -> None:
    """``D`` square, no NaN, ``>= 0``, symmetric (values deferred when traced)."""
    if D is None or isinstance(D, str | bytes | dict):
        raise TypeError(f"D must be an [n, n] array of dissimilarities, got {type(D).__name__}")
    d = concrete(D)
    if d is None:
        if len(jnp.shape(D)) != 2 or jnp.shape(D)[0] != jnp.shape(D)[1]:
            raise ValueError(f"D must be a square matrix of shape [n, n], got {jnp.shape(D)}")
        d = jnp.asarray(D)
        defer("dissimilarity D contains NaN", jnp.all(~jnp.isnan(d)))
        defer("dissimilarity D has negative entries (it must be >= 0)", jnp.all(~(d < 0)))
        # inf only against inf: an inf facing a finite entry is asymmetric, however
        # small that entry (inf against 0 would otherwise tie the two clients)
        inf = jnp.isinf(d) | jnp.isinf(d.T)
        finite = lambda a: jnp.where(inf, 0, a)
        close = jnp.abs(finite(d) - finite(d.T)) <= 1e-6 + 1e-5 * jnp.abs(finite(d.T))
        close = jnp.where(inf, d == d.T, close)
        nan = jnp.isnan(d) | jnp.isnan(d.T)  # reported as NaN above
        defer("dissimilarity D is not symmetric", jnp.all(close | nan))
        return
    if d.ndim != 2 or d.shape[0] != d.shape[1]:
        raise ValueError(f"D must be a square matrix of shape [n, n], got shape {d.shape}")
    if np.any(np.isnan(d)):
        raise ValueError("D must not contain NaN")
    if np.any(d < 0):
        raise ValueError(f"D must be >= 0 (inf allowed), found minimum {d.min()}")
    inf = np.isinf(d) | np.isinf(d.T)
    if np.any(inf & (d != d.T)):
        i, j = np.argwhere(inf & (d != d.T))[0]
        raise ValueError(
            f"D must be symmetric: D[{i}, {j}] = {d[i, j]} but D[{j}, {i}] = {d[j, i]}"
        )
    if not np.allclose(np.where(inf, 0, d), np.where(inf, 0, d.T), rtol=1e-5, atol=1e-6):
        raise ValueError("D must be symmetric")


def weights_numpy(d: np.ndarray, scale=None) -> np.ndarray:
    """:func:`graph_weights` of a concrete ``D`` in float64 numpy."""
    d = np.asarray(d, np.float64)
    n = d.shape[0]
    off = ~np.eye(n, dtype=bool)
    if scale is None:
        vals = d[off & np.isfinite(d)]
        pos = vals[vals > 0]
        med = np.median(vals) if vals.size else 0.0
        med_pos = np.median(pos) if pos.size else 0.0
        scale = med if med > 0 else (med_pos if med_pos > 0 else 1.0)
    with np.errstate(over="ignore", under="ignore"):
        w = np.exp(-d / float(scale))
    return np.where(off, w, 0.0)


def graph_laplacian(W) -> jnp.ndarray:
    """``L = diag(W 1) - W`` of symmetric nonnegative weights ``W`` ``[n, n]`` (diagonal
    of ``W`` ignored).

    Examples:
      >>> import jax.numpy as jnp
      >>> from karula_jax.algorithms import graph_laplacian
      >>> W = jnp.array([[0.0, 1.0, 0.0], [1.0, 0.0, 2.0], [0.0, 2.0, 0.0]])
      >>> graph_laplacian(W).tolist()
      [[1.0, -1.0, 0.0], [-1.0, 3.0, -2.0], [0.0, -2.0, 2.0]]
    """
    W = jnp.asarray(W)
    W = jnp.where(jnp.eye(W.shape[0], dtype=bool), 0.0, W)
    return jnp.diag(jnp.sum(W, axis=1)) - W
