"""What experiments measure: client-wise cross-validation, per-client metrics, D's quality.

* Cross-validation: :func:`fold_ids` / :func:`kfold_split` split every client's rows into
  ``K`` folds (so every client is in every fold's training and validation data) and
  return the ``K`` training and validation :class:`~karula_jax.data.ClientData` stacked on
  a leading fold axis, ready to be trained as a batch (:func:`karula_jax.training.run_many`).
  :func:`select_by_cv` picks one grid point per seed from the validation scores.
* Per-client metrics (jit/vmap friendly, padding masked by ``counts``, outputs ``[n]``):
  :func:`estimation_error`, :func:`mean_squared_error`, :func:`r2_score`,
  :func:`accuracy`, :func:`log_loss`. Models enter through ``apply_fn(params_i, x) ->
  outputs``, the convention of :mod:`karula_jax.models` (``model.apply`` for flax models,
  ``lambda theta, x: x @ theta`` for a linear model).
* Dissimilarities (host side, numpy): :func:`pairwise_sq_distances` between client models,
  :func:`spearman_offdiag` (rank correlation of two dissimilarity matrices),
  :func:`active_fraction` (Karula's binding constraints) and :func:`exact_pairwise_w1`
  (exact W1 between clients with POT, a reference for the embedding's ``D``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax._checks import check_targets, concrete, personalized_flags
from karula_jax.data.clients import ClientData

__all__ = [
    "CVSelection",
    "accuracy",
    "active_fraction",
    "estimation_error",
    "exact_pairwise_w1",
    "flattened",
    "fold_ids",
    "grid_edge",
    "grid_plateau",
    "kfold_split",
    "log_loss",
    "mean_squared_error",
    "pairwise_sq_distances",
    "r2_score",
    "ridge_solutions",
    "select_by_cv",
    "spearman_offdiag",
    "tail_start",
]

ApplyFn = Callable[[Any, jnp.ndarray], jnp.ndarray]


# --------------------------------------------------------------------------- folds


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


def tail_start(rounds, last: float = 0.2) -> int:
    """Index of the evaluation where the last ``last`` share of the rounds begins: the last
    evaluation at or before round ``R_end - last (R_end - R_0)``, so that the tail holds two
    evaluations at least, however coarse the evaluation grid. ``rounds`` ``[T]``
    increasing, ``T >= 2``; ``last`` in ``(0, 1)``."""
    rounds = np.asarray(rounds, np.float64)
    if rounds.ndim != 1 or rounds.size < 2:
        raise ValueError(f"rounds: expected [T] with T >= 2, got shape {rounds.shape}")
    if not 0.0 < last < 1.0:
        raise ValueError(f"last: expected a share in (0, 1), got {last}")
    first = rounds[-1] - last * (rounds[-1] - rounds[0])
    return max(int(np.searchsorted(rounds, first, side="right")) - 1, 0)


def flattened(curve, rounds, *, last: float = 0.2, share: float = 0.02) -> np.ndarray:
    """Whether training-loss curves have flattened by their last round.

    The criterion: over the last ``last`` share of the rounds (from :func:`tail_start`),
    the loss stays within ``share`` of its total decrease (first evaluation minus last) of
    its final value. A
    curve still falling, oscillating or rising there fails it, as does one that never
    decreased or is not finite.

    Args:
      curve: losses ``[..., T]`` at the rounds ``rounds``.
      rounds: ``[T]`` increasing rounds of the evaluations (the first is the reference).
      last: the final share of the rounds examined, in ``(0, 1)`` (0.2: the last fifth).
      share: the largest change allowed there, a share of the total decrease, ``> 0``.

    Returns:
      bool ``[...]``.
    """
    curve, rounds = np.asarray(curve, np.float64), np.asarray(rounds, np.float64)
    if rounds.ndim != 1 or curve.shape[-1:] != rounds.shape or rounds.size < 2:
        raise ValueError(
            f"curve [..., T] and rounds [T] with T >= 2 expected, got {curve.shape} and "
            f"{rounds.shape}"
        )
    if not share > 0.0:
        raise ValueError(f"share: expected a positive share, got {share}")
    start = tail_start(rounds, last)
    final = curve[..., -1:]
    moved = np.max(np.abs(curve[..., start:] - final), axis=-1)
    total = curve[..., 0] - curve[..., -1]
    with np.errstate(invalid="ignore"):
        ok = np.all(np.isfinite(curve), axis=-1) & (total > 0) & (moved <= share * total)
    return np.asarray(ok, bool)


# --------------------------------------------------------------------------- metrics


def _per_client(fn, apply_fn: ApplyFn, params, data: ClientData) -> jnp.ndarray:
    """``fn(outputs_i, y_i, mask_i)`` for every client, ``[n]``."""
    out = jax.vmap(apply_fn)(params, data.x)
    return jax.vmap(fn)(out, data.y, data.mask)


def _masked_mean(values: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    total = jnp.sum(jnp.where(mask, values, 0.0))
    return total / jnp.maximum(jnp.sum(mask.astype(values.dtype)), 1.0)


def estimation_error(params: Any, params_true: Any) -> jnp.ndarray:
    """``||theta_i - theta_i*||^2`` per client, summed over all leaves, ``[n]``.

    Args:
      params: client models, leaves ``[n, ...]``.
      params_true: the true models, same structure and shapes.

    Examples:
      >>> import jax.numpy as jnp
      >>> from karula_jax.evaluation import estimation_error
      >>> estimation_error(jnp.ones((2, 3)), jnp.array([[1.0, 1.0, 1.0], [0.0, 1.0, 3.0]])).tolist()
      [0.0, 5.0]
    """

    def one(a, b):
        return jnp.sum(((a - b) ** 2).reshape(a.shape[0], -1), axis=1)

    return sum(jax.tree.leaves(jax.tree.map(one, params, params_true)))


def mean_squared_error(apply_fn: ApplyFn, params: Any, data: ClientData) -> jnp.ndarray:
    """Each client's mean squared prediction error on its own real rows, ``[n]``.

    Args:
      apply_fn: ``apply_fn(params_i, x [N_max, ...]) -> predictions [N_max]``.
      params: client models, leaves ``[n, ...]``.
      data: ``x`` ``[n, N_max, ...]``, ``y`` ``[n, N_max]``.

    Returns:
      ``sum_k mask (pred - y)^2 / max(N_i, 1)`` per client (0 for a client with no rows).
    """

    def one(pred, y, mask):
        check_targets(y, pred.shape, "apply_fn's predictions")
        return _masked_mean((pred - y) ** 2, mask)

    return _per_client(one, apply_fn, params, data)


def r2_score(apply_fn: ApplyFn, params: Any, data: ClientData) -> jnp.ndarray:
    """Coefficient of determination of each client's model on its own rows, ``[n]``.

    ``R^2_i = 1 - sum (y - pred)^2 / sum (y - mean_i y)^2`` over client ``i``'s real rows
    (``-inf`` or NaN when its targets are constant).

    Args:
      apply_fn: ``apply_fn(params_i, x [N_max, ...]) -> predictions [N_max]``.
      params: client models, leaves ``[n, ...]``.
      data: ``x`` ``[n, N_max, ...]``, ``y`` ``[n, N_max]``.
    """

    def one(pred, y, mask):
        check_targets(y, pred.shape, "apply_fn's predictions")
        ybar = jnp.sum(jnp.where(mask, y, 0.0)) / jnp.maximum(jnp.sum(mask), 1)
        sse = jnp.sum(jnp.where(mask, (y - pred) ** 2, 0.0))
        return 1.0 - sse / jnp.sum(jnp.where(mask, (y - ybar) ** 2, 0.0))

    return _per_client(one, apply_fn, params, data)


def accuracy(apply_fn: ApplyFn, params: Any, data: ClientData) -> jnp.ndarray:
    """Fraction of each client's real rows classified correctly, ``[n]``.

    Args:
      apply_fn: ``apply_fn(params_i, x) -> logits``: ``[N_max, C]`` (class = arg-max) or
        ``[N_max]`` for a binary model (class 1 where the logit is positive).
      params: client models, leaves ``[n, ...]``.
      data: integer labels ``y`` ``[n, N_max]``.
    """

    def one(z, y, mask):
        pred = jnp.argmax(z, axis=-1) if z.ndim == 2 else (z > 0).astype(jnp.int32)
        check_targets(y, pred.shape, "apply_fn's rows")
        real = mask.reshape(mask.shape + (1,) * (z.ndim - 1))
        diverged = jnp.any(jnp.where(real, ~jnp.isfinite(z), False))  # argmax(NaN) = 0
        return jnp.where(diverged, jnp.nan, _masked_mean((pred == y).astype(jnp.float32), mask))

    return _per_client(one, apply_fn, params, data)


def log_loss(apply_fn: ApplyFn, params: Any, data: ClientData) -> jnp.ndarray:
    """Each client's mean cross-entropy on its own real rows, ``[n]``.

    Args:
      apply_fn: ``apply_fn(params_i, x) -> logits``: ``[N_max, C]`` (softmax) or
        ``[N_max]`` (binary: ``log(1 + e^z) - y z``).
      params: client models, leaves ``[n, ...]``.
      data: integer labels ``y`` ``[n, N_max]``.
    """

    def one(z, y, mask):
        if z.ndim == 2:
            picked = jnp.take_along_axis(z, y[:, None].astype(jnp.int32), axis=-1)[:, 0]
            nll = jax.nn.logsumexp(z, axis=-1) - picked
        else:
            nll = jax.nn.softplus(z) - y.astype(z.dtype) * z
        return _masked_mean(nll, mask)

    return _per_client(one, apply_fn, params, data)


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


# --------------------------------------------------------------------------- dissimilarities


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
