"""Client-wise K-fold cross-validation: the folds, the split data and the choice of a grid point.

:func:`fold_ids` / :func:`kfold_split` split every client's rows into ``K`` folds (so every
client is in every fold's training and validation data) and return the ``K`` training and
validation :class:`~karula_jax.data.ClientData` stacked on a leading fold axis, ready to be
trained as a batch (:func:`karula_jax.training.run_many`). :func:`select_by_cv` picks one
grid point per seed from the validation scores; :func:`grid_edge` and :func:`grid_plateau`
say whether that choice sits on an edge of its grid.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax._checks import concrete
from karula_jax.data.clients import ClientData

__all__ = [
    "CVSelection",
    "PLATEAU_RTOL",
    "check_fold_ids",
    "diverged",
    "fold_ids",
    "grid_edge",
    "grid_next_to_diverged",
    "grid_plateau",
    "kfold_split",
    "select_by_cv",
]


def fold_ids(counts: jnp.ndarray, max_count: int, num_folds: int, *, key: jax.Array) -> jnp.ndarray:
    """A random, balanced fold for every real row of every client; ``-1`` on padding.

    Args:
      counts: real rows per client, int array ``[n]``.
      max_count: ``N_max``, the padded row count (static).
      num_folds: ``K >= 2`` (static).
      key: PRNG key.

    Returns:
      int32 array ``[n, N_max]``: the fold of a row is its rank in a random permutation of
      the client's real rows modulo ``K``, so a client's fold sizes differ by at most one.
    """
    if int(num_folds) < 2:
        raise ValueError(f"num_folds must be >= 2, got {num_folds}")
    real = jnp.arange(max_count)[None, :] < jnp.asarray(counts)[:, None]
    u = jnp.where(real, jax.random.uniform(key, real.shape), 2.0)  # padding sorts last
    rank = jnp.argsort(jnp.argsort(u, axis=1), axis=1)
    return jnp.where(real, rank % num_folds, -1).astype(jnp.int32)


def check_fold_ids(counts, num_folds: int, folds) -> None:
    """Explicit fold ids ``[..., n, N]`` for clients with ``counts`` rows ``[..., n]``:
    ids in ``[0, K)`` on real rows and ``-1`` on padding (another id on a real row left
    it never validated or dropped it; an id on padding trained on a padding row). Skipped
    when traced.

    Raises:
      ValueError: naming ``folds`` and what was found.
    """
    c, f = concrete(counts), concrete(folds)
    if c is None or f is None:
        return
    if f.shape[:-1] != c.shape:
        raise ValueError(f"folds must have shape {c.shape} + [N], got {f.shape}")
    real = np.arange(f.shape[-1]) < c[..., None]
    bad_real = real & ((f < 0) | (f >= num_folds))
    if bad_real.any():
        raise ValueError(
            f"folds must hold ids in [0, {num_folds}) on real rows, found "
            f"{sorted(set(f[bad_real].tolist()))[:5]}"
        )
    if (~real & (f != -1)).any():
        raise ValueError("folds must be -1 on padding rows (beyond each client's count)")


def _take_rows(data: ClientData, keep: jnp.ndarray) -> ClientData:
    """The rows where ``keep`` ``[n, N_max]`` is True, in order, packed at the front."""
    order = jnp.argsort(~keep, axis=1, stable=True)
    counts = jnp.sum(keep, axis=1).astype(jnp.int32)
    valid = jnp.arange(keep.shape[1])[None, :] < counts[:, None]

    def take(a):
        idx = order.reshape(order.shape + (1,) * (a.ndim - 2))
        rows = jnp.take_along_axis(a, idx, axis=1)
        return jnp.where(valid.reshape(valid.shape + (1,) * (a.ndim - 2)), rows, 0)

    return ClientData(take(data.x), take(data.y), counts)


def kfold_split(
    data: ClientData,
    num_folds: int,
    *,
    key: jax.Array | None = None,
    folds: jnp.ndarray | None = None,
) -> tuple[ClientData, ClientData]:
    """Client-wise K-fold cross-validation data, stacked on a leading fold axis.

    Fold ``f`` validates on every client's fold-``f`` rows and trains on the client's other
    rows. Rows keep their order and are packed at the front of each client (padding is 0),
    and every split keeps ``N_max``, so the ``K`` training sets can be trained as one batch.

    Args:
      data: one data set, leaves ``[n, N_max, ...]``.
      num_folds: ``K`` (static).
      key: PRNG key of the random folds (:func:`fold_ids`); or
      folds: a given fold per row, int ``[n, N_max]``: ids in ``[0, K)`` on real rows,
        ``-1`` on padding (checked when concrete, :func:`check_fold_ids`).

    Returns:
      ``(train, validation)``: :class:`ClientData` with leaves ``[K, n, N_max, ...]``. A
      client with fewer than ``K`` rows has empty folds here (the study-level
      :func:`karula_jax.protocol.cv_datasets` refuses it).

    Examples:
      >>> import jax
      >>> import numpy as np
      >>> import karula_jax as kj
      >>> xs, ys = [np.ones((4, 1)), np.ones((6, 1))], [np.ones(4), np.ones(6)]
      >>> data = kj.data.from_client_arrays(xs, ys)  # 4 and 6 rows
      >>> train, valid = kj.evaluation.kfold_split(data, 2, key=jax.random.key(0))
      >>> train.counts.tolist(), valid.counts.tolist()  # [folds, clients]
      ([[2, 3], [2, 3]], [[2, 3], [2, 3]])
      >>> train.x.shape  # every split keeps N_max
      (2, 2, 6, 1)
    """
    if (key is None) == (folds is None):
        raise ValueError("pass exactly one of key= and folds=")
    if not isinstance(data, ClientData):
        raise TypeError(f"data must be a ClientData, got {type(data).__name__}")
    if folds is None:
        folds = fold_ids(data.counts, data.max_count, num_folds, key=key)
    folds = jnp.asarray(folds)
    if folds.shape != data.x.shape[:2]:
        raise ValueError(f"folds must have shape {data.x.shape[:2]}, got {folds.shape}")
    check_fold_ids(data.counts, num_folds, folds)

    def one(f):
        return _take_rows(data, (folds >= 0) & (folds != f)), _take_rows(data, folds == f)

    return jax.vmap(one)(jnp.arange(num_folds))


class CVSelection(NamedTuple):
    """Outcome of :func:`select_by_cv` (numpy).

    Attributes:
      index: chosen grid index, int ``[...]`` (one per seed).
      score: cross-validated score of every grid point, float64 ``[..., G]``; ``inf``
        (``-inf`` when maximizing) marks excluded (diverged) points.
    """

    index: np.ndarray
    score: np.ndarray


def select_by_cv(
    scores: Any,
    *,
    fold_weights: Any = None,
    valid: Any = None,
    maximize: bool = False,
) -> CVSelection:
    """Picks the grid point with the best validation score averaged over folds.

    Rule: the score of grid point ``g`` is ``sum_f w_f s_fg / sum_f w_f`` (``w_f`` = 1 unless
    ``fold_weights`` are given; validation rows as weights turn per-fold mean errors into
    the pooled error). A point is excluded when any of its folds diverged: a NaN or
    infinite score, or ``valid`` False. Among the others the lowest score wins (highest with
    ``maximize``); ties go to the first grid point in grid order.

    Args:
      scores: validation scores ``[..., K, G]`` (leading axes, e.g. seeds, are kept).
      fold_weights: optional non-negative weights ``[..., K]``.
      valid: optional bool ``[..., K, G]``: False where the run diverged.
      maximize: higher scores are better (e.g. accuracy).

    Returns:
      A :class:`CVSelection` with ``index`` ``[...]`` and ``score`` ``[..., G]``.

    Raises:
      ValueError: on bad shapes, or when every grid point of some position is excluded.
    """
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim < 2:
        raise ValueError(f"scores must have shape [..., K, G], got {s.shape}")
    w = np.ones(s.shape[:-1]) if fold_weights is None else np.asarray(fold_weights, np.float64)
    if w.shape != s.shape[:-1]:
        raise ValueError(f"fold_weights must have shape {s.shape[:-1]}, got {w.shape}")
    if np.any(w < 0) or np.any(w.sum(-1) <= 0):
        raise ValueError("fold_weights must be non-negative with a positive sum over folds")
    bad = ~np.isfinite(s)
    if valid is not None:
        v = np.asarray(valid, dtype=bool)
        if v.shape != s.shape:
            raise ValueError(f"valid must have shape {s.shape}, got {v.shape}")
        bad |= ~v
    mean = np.sum(np.where(bad, 0.0, s) * w[..., None], axis=-2) / w.sum(-1)[..., None]
    worst = -np.inf if maximize else np.inf
    score = np.where(bad.any(axis=-2), worst, mean)
    excluded = np.all(score == worst, axis=-1)
    if excluded.any():
        where = np.argwhere(excluded).tolist() if excluded.ndim else []
        raise ValueError(f"every grid point diverged at positions {where} of scores[..., K, G]")
    index = np.argmax(score, axis=-1) if maximize else np.argmin(score, axis=-1)
    return CVSelection(index=index, score=score)


def grid_edge(index, grid_size: int, *, natural=()) -> np.ndarray:
    """Whether a CV choice sits on an edge of its grid that is not a natural limit.

    A method tuned at the first or last point of its grid may have wanted a point beyond
    it: the grid should be widened, unless that end is a natural limit of the method
    (``t = 0`` or ``inf`` for Karula, ``k = 1`` cluster), given in ``natural``. A grid of
    one point has no edge.

    Args:
      index: chosen grid indices, int ``[...]`` (e.g. :attr:`CVSelection.index`).
      grid_size: ``G``, the number of grid points.
      natural: grid indices (negative allowed) that are natural limits.

    Returns:
      bool ``[...]``, True where the choice is an edge that is not natural.
    """
    index = np.asarray(index)
    if grid_size < 2:
        return np.zeros(index.shape, bool)
    natural = {int(i) % grid_size for i in natural}
    edges = {0, grid_size - 1} - natural
    return np.isin(index, sorted(edges))


# A run whose training loss ends this many times above where it started has diverged
# (:func:`diverged`): an unstable step grows the loss geometrically (the synthetic study's
# penalty at a step beyond its stable range reached 1e31 in 600 rounds while staying
# finite), noise on a stable run does not multiply it tenfold.
DIVERGENCE_GROWTH = 10.0


def diverged(loss, *, growth: float = DIVERGENCE_GROWTH) -> np.ndarray:
    """Whether runs diverged: a non-finite loss, or a last tenth of the rounds whose mean
    training loss is more than ``growth`` times the first tenth's.

    The runs of a step beyond a method's stable range can stay finite for hundreds of
    rounds while their loss grows by orders of magnitude; their CV score is then finite
    but meaningless. Cross-validation treats such a point as diverged, like a non-finite
    one (:func:`grid_next_to_diverged` then says when the choice neighbours it).

    Args:
      loss: per-round training losses ``[R, ...]`` (rounds first, as
        :class:`~karula_jax.algorithms.RoundInfo` stacks them; ``R >= 1``).
      growth: the factor, ``> 1``.

    Returns:
      bool ``[...]``.

    Examples:
      >>> import numpy as np
      >>> from karula_jax.evaluation import diverged
      >>> k = np.arange(100.0)[:, None]
      >>> diverged(np.hstack([np.exp(-k / 20), 1.1**k, 1 + 0.05 * np.sin(k)])).tolist()
      [False, True, False]
    """
    loss = np.asarray(loss, np.float64)
    if loss.ndim < 1 or loss.shape[0] < 1:
        raise ValueError(f"loss: expected [R, ...] with R >= 1 rounds, got shape {loss.shape}")
    if not float(growth) > 1.0:
        raise ValueError(f"growth: expected a factor > 1, got {growth}")
    w = max(1, loss.shape[0] // 10)
    with np.errstate(invalid="ignore", over="ignore"):
        first, last = loss[:w].mean(0), loss[-w:].mean(0)
        grew = last > float(growth) * np.maximum(first, np.finfo(np.float64).tiny)
    return ~np.all(np.isfinite(loss), axis=0) | grew


def grid_next_to_diverged(index, score) -> np.ndarray:
    """Whether a CV choice on an ordered grid neighbours a grid point that diverged.

    A point whose runs diverged has a non-finite CV score (:func:`select_by_cv` gives it
    the worst). A choice next to one sits on the edge of the method's stable region,
    not inside its grid: the best point may lie between the two, and the method is
    likely run at a step that its neighbour's hyperparameter cannot sustain (lower the
    step, or give the method a step rule that is stable over its whole grid). Unlike
    :func:`grid_edge` this looks at the scores, so it also catches an interior index.

    Args:
      index: chosen grid indices ``[S]``.
      score: CV scores ``[S, G]`` of the ``G`` ordered grid points (``inf`` or NaN
        where a point diverged).

    Returns:
      bool ``[S]``.

    Examples:
      >>> import numpy as np
      >>> from karula_jax.evaluation import grid_next_to_diverged
      >>> score = np.array([[np.inf, 7.0, 8.0], [9.0, 7.0, np.nan], [9.0, 7.0, 8.0]])
      >>> grid_next_to_diverged([1, 0, 1], score).tolist()  # the 3rd row has no diverged point
      [True, False, False]
    """
    index, score = np.asarray(index), np.asarray(score, np.float64)
    if score.ndim != 2 or index.shape != score.shape[:1]:
        raise ValueError(f"score: expected [S, G] with S = {index.shape}, got {score.shape}")
    G = score.shape[1]
    rows = np.arange(index.shape[0])
    bad = ~np.isfinite(score)
    below = (index > 0) & bad[rows, np.maximum(index - 1, 0)]
    above = (index < G - 1) & bad[rows, np.minimum(index + 1, G - 1)]
    return below | above


# Relative change of the CV score between a grid's end and its neighbour below which a
# choice at that end is on a plateau (:func:`grid_plateau`).
PLATEAU_RTOL = 1e-4


def grid_plateau(index, score, *, rtol: float = PLATEAU_RTOL) -> np.ndarray:
    """Whether a CV choice at an end of an ordered grid sits on a plateau of the score.

    The choice is the first or last point, and its score differs from its neighbour's by
    at most ``rtol`` times its own magnitude: toward that end the score has stopped
    moving, so a wider grid cannot change the choice by more than that (a limit the
    method reaches numerically, such as pFedMe's ``lambda -> 0`` under its envelope step
    rule: ``results/synthetic/README.md``). A grid of one point has no plateau; a
    non-finite score never makes one.

    Args:
      index: chosen grid indices ``[S]``.
      score: CV scores ``[S, G]`` of the ``G`` ordered grid points.
      rtol: the relative change, ``>= 0``.

    Returns:
      bool ``[S]``.
    """
    index, score = np.asarray(index), np.asarray(score, np.float64)
    if score.ndim != 2 or score.shape[0] != index.shape[0]:
        raise ValueError(f"score: expected [S, G] with S = {index.shape[0]}, got {score.shape}")
    if not rtol >= 0:
        raise ValueError(f"rtol: expected a nonnegative number, got {rtol}")
    G = score.shape[1]
    if G < 2:
        return np.zeros(index.shape, bool)
    rows = np.arange(index.shape[0])
    neighbour = np.where(index == 0, 1, G - 2)
    own, other = score[rows, index], score[rows, neighbour]
    close = np.abs(own - other) <= rtol * np.abs(own)
    return ((index == 0) | (index == G - 1)) & np.isfinite(own) & np.isfinite(other) & close
