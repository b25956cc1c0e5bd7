"""Host-side references computed exactly (float64): closed-form ridge fits and exact W1.

:func:`ridge_solutions` gives each client's own ridge fit and the pooled one;
:func:`exact_pairwise_w1` the exact W1 between clients with POT, a reference for the
embedding's ``D``.
"""

from __future__ import annotations

import numpy as np

from karula_jax.data.clients import ClientData

__all__ = ["exact_pairwise_w1", "ridge_solutions"]


def ridge_solutions(data: ClientData, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Closed-form ridge fits (host side, float64): each client's own and the pooled one.

    With ``f_i(theta) = mean_i (x . theta - y)^2 / 2 + lam/2 ||theta||^2``
    (:func:`karula_jax.models.ridge_loss`), client ``i``'s fit minimizes ``f_i`` and the
    pooled fit minimizes ``sum_i alpha_i f_i`` with ``alpha_i = N_i / mean_j N_j``.

    Args:
      data: clients with ``x`` of shape ``[n, N_max, d]``, zero on padded rows.
      lam: ridge penalty.

    Returns:
      ``(local [n, d], pooled [d])``.
    """
    x, y, c = (np.asarray(a, np.float64) for a in data)
    H = np.einsum("nki,nkj->nij", x, x) / c[:, None, None] + lam * np.eye(x.shape[-1])
    g = np.einsum("nki,nk->ni", x, y) / c[:, None]
    alpha = c / c.mean()
    local = np.linalg.solve(H, g[..., None])[..., 0]
    return local, np.linalg.solve(np.tensordot(alpha, H, 1), alpha @ g)


def exact_pairwise_w1(
    clients: ClientData, *, num_classes: int | None = None, label_scale: float = 1.0
) -> np.ndarray:
    """Exact W1 between every pair of clients' empirical joint distributions (host side).

    The reference the embedding's ``D`` approximates: POT's network simplex (``ot.emd2``,
    float64) with the Euclidean ground cost on the joint samples
    (:func:`karula_jax.embedding.joint_samples`), uniform weights on each client's rows.
    ``n (n - 1) / 2`` solves: seconds for tens of clients, minutes for hundreds.

    Args:
      clients: padded client data.
      num_classes: as in :func:`karula_jax.embedding.dissimilarities`.
      label_scale: as in :func:`karula_jax.embedding.dissimilarities`.

    Returns:
      Symmetric ``[n, n]`` float64 array with zero diagonal.

    Raises:
      ImportError: when POT (``pip install POT``, in the ``experiments`` extra) is missing.
    """
    try:
        import ot
    except ImportError as e:
        raise ImportError(
            "exact_pairwise_w1 needs POT: pip install POT (or the package's experiments extra)"
        ) from e
    from karula_jax.embedding import joint_samples

    z = np.asarray(joint_samples(clients, num_classes=num_classes, label_scale=label_scale))
    z = z.astype(np.float64)
    counts = np.asarray(clients.counts)
    n = len(counts)
    w = np.zeros((n, n))
    for i in range(n):
        zi = z[i, : counts[i]]
        for j in range(i + 1, n):
            zj = z[j, : counts[j]]
            a, b = np.full(len(zi), 1 / len(zi)), np.full(len(zj), 1 / len(zj))
            w[i, j] = w[j, i] = ot.emd2(a, b, ot.dist(zi, zj, metric="euclidean"))
    return w
