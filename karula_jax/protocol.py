"""The comparison protocol every experiment runs: CV folds x seeds, grids, final fits.

A study compares methods on ``S`` seeds, each with its own training and test data. For
a method with hyperparameters, every seed's training rows are split into ``K`` client-wise
folds (:func:`karula_jax.evaluation.kfold_split`), the method is trained on every fold and
on the full training rows at every grid point, the grid point with the best validation
score (:func:`karula_jax.evaluation.select_by_cv`) is chosen per seed, and the seed's
result is the final fit at that point, scored on its test rows.

* :func:`cv_datasets` stacks the ``S (K + 1)`` data sets on one member axis, seed-major:
  member ``s (K + 1) + f`` holds fold ``f``'s training rows (``evals``: its validation
  rows) for ``f < K`` and all training rows (``evals``: the test rows) for ``f = K``.
* :class:`Method` is a factory ``make(**member_kwargs, **hyper) -> Algorithm`` with a
  traced grid (vmapped) and/or a static grid (one compilation per entry).
* :func:`cross_validate` trains a method on every member and grid point with
  :func:`karula_jax.training.run_many` (members without a grid: final fits only) and
  returns the per-seed outcome.
"""

from __future__ import annotations

import functools
import itertools
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax import evaluation as ev
from karula_jax.algorithms.base import Algorithm
from karula_jax.data.clients import ClientData
from karula_jax.training import ProjectionNotConvergedWarning, describe_diagnostics, run_many

__all__ = [
    "CVData",
    "CVOutcome",
    "Method",
    "choice_grid",
    "cross_validate",
    "cv_datasets",
    "scalar_grid",
    "stack_datasets",
]


def _pad_rows(data: ClientData, rows: int) -> ClientData:
    """Pads the row axis (the one after ``counts``' axes) with zeros to ``rows``."""
    lead = data.counts.ndim
    if data.x.shape[lead] > rows:
        raise ValueError(f"rows must be >= the data's {data.x.shape[lead]} rows, got {rows}")
    pad = lambda a: jnp.pad(
        a, [(0, 0)] * lead + [(0, rows - a.shape[lead])] + [(0, 0)] * (a.ndim - lead - 1)
    )
    return ClientData(pad(data.x), pad(data.y), data.counts)


def stack_datasets(items: Sequence[ClientData], *, rows: int | None = None) -> ClientData:
    """Stacks data sets with the same clients on a new leading axis, padding their rows.

    Args:
      items: data sets with equal client counts and feature shapes.
      rows: rows per client after padding (default: the largest of ``items``).

    Returns:
      A :class:`ClientData` with leaves ``[len(items), n, rows, ...]``.
    """
    if not items:
        raise ValueError("items must hold at least one data set")
    rows = max(int(d.x.shape[1]) for d in items) if rows is None else rows
    shapes = {(d.x.shape[0], d.x.shape[2:], d.y.shape[2:]) for d in items}
    if len(shapes) != 1:
        raise ValueError(f"items must share clients and feature shapes, got {sorted(shapes)}")
    return jax.tree.map(lambda *a: jnp.stack(a), *(_pad_rows(d, rows) for d in items))


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
        return jax.tree.map(lambda a: jnp.repeat(a, self.num_folds + 1, axis=0), tree)


def cv_datasets(
    train: ClientData, test: ClientData, num_folds: int, *, key=None, folds=None
) -> CVData:
    """Splits each seed's training rows into ``K`` folds and stacks folds and final fits.

    Args:
      train: training data per seed, leaves ``[S, n, N, ...]``.
      test: test data per seed, leaves ``[S, n, N_test, ...]``.
      num_folds: ``K >= 2``.
      key: stacked keys ``[S]`` drawing each seed's folds (:func:`~karula_jax.evaluation.fold_ids`).
      folds: or explicit fold ids ``[S, n, N]`` (``-1`` on padding); exactly one of the two.

    Returns:
      A :class:`CVData`; validation and test rows are padded to a common row count.
    """
    if (key is None) == (folds is None):
        raise ValueError("pass exactly one of key and folds")
    if train.counts.ndim != 2 or test.counts.ndim != 2:
        raise ValueError("train and test must have leaves [S, n, N, ...] (a seed axis)")
    if train.counts.shape != test.counts.shape:
        raise ValueError(
            f"train and test must have the same seeds and clients, got counts "
            f"{train.counts.shape} and {test.counts.shape}"
        )
    K = num_folds
    if folds is None:
        fit, val = jax.vmap(lambda d, k: ev.kfold_split(d, K, key=k))(train, key)
    else:
        fit, val = jax.vmap(lambda d, f: ev.kfold_split(d, K, folds=f))(train, jnp.asarray(folds))
    rows = max(int(train.x.shape[2]), int(test.x.shape[2]))
    val, test = _pad_rows(val, rows), _pad_rows(test, rows)
    join = lambda a, b: jnp.concatenate([a, b[:, None]], 1).reshape((-1,) + a.shape[2:])
    S = int(train.counts.shape[0])
    return CVData(jax.tree.map(join, fit, train), jax.tree.map(join, val, test), S, K)


class Method(NamedTuple):
    """A method to compare and the hyperparameters to choose from.

    Attributes:
      make: ``make(**member_kwargs, **hyper) -> Algorithm`` (traced values).
      grid: ``{name: [G] values}`` crossed in one compiled program (traced), or None.
      static_grid: entries ``{name: value}`` passed as Python values, one compilation
        each (e.g. a number of clusters that fixes shapes), or None.
      label: names a grid point for tables, ``label(point) -> str``.
    """

    make: Callable[..., Algorithm]
    grid: Mapping[str, Any] | None = None
    static_grid: Sequence[Mapping[str, Any]] | None = None
    label: Callable[[Mapping[str, Any]], str] | None = None

    @property
    def tuned(self) -> bool:
        return bool(self.grid) or bool(self.static_grid)

    def points(self) -> list[dict[str, Any]]:
        """Every grid point, static entries outermost (the order of the results)."""
        grid = self.grid or {}
        traced = [dict(zip(grid, v, strict=True)) for v in zip(*grid.values(), strict=True)]
        statics = self.static_grid or [{}]
        return [dict(s) | t for s, t in itertools.product(statics, traced or [{}])]

    def labels(self) -> list[str]:
        if not self.tuned:
            return [""]
        name = self.label or (lambda p: ", ".join(f"{k}={v:.3g}" for k, v in p.items()))
        return [name(p) for p in self.points()]


def scalar_grid(name: str, values, *, shown: str | None = None) -> dict[str, Any]:
    """``Method`` keywords for a traced grid of one scalar argument ``name``; points are
    labelled ``shown=value`` (``shown`` defaults to ``name``)."""
    text = shown or name
    return dict(
        grid={name: np.asarray(values, np.float32)}, label=lambda p: f"{text}={p[name]:.3g}"
    )


def choice_grid(name: str, choices) -> dict[str, Any]:
    """``Method`` keywords for a traced grid over ``choices`` by index (e.g. a number of
    clusters whose labels the member arguments hold per choice): ``make`` receives the
    index as ``name``; labels show the choice."""
    choices = list(choices)
    return dict(
        grid={name: np.arange(len(choices))}, label=lambda p: f"{name}={choices[int(p[name])]}"
    )


class CVOutcome(NamedTuple):
    """Per-seed outcome of :func:`cross_validate` (host arrays).

    Attributes:
      metrics: every metric of the final fit at the chosen point, ``[S, ...]``.
      grid_metrics: the same at every grid point, ``[S, G, ...]``.
      chosen: chosen grid index per seed, ``[S]`` (0 without a grid).
      labels: the grid points' labels, ``[G]`` (``[""]`` without a grid).
      cv_score: cross-validated score ``[S, G]`` (None without a grid).
      finite: whether the chosen final fit stayed finite, ``[S]``.
      seconds: wall clock of the method's runs, compilation included.
      diagnostics: the projection's report (:func:`karula_jax.training.describe_diagnostics`)
        when a run had an inexact projection, else "".
    """

    metrics: dict[str, np.ndarray]
    grid_metrics: dict[str, np.ndarray]
    chosen: np.ndarray
    labels: list[str]
    cv_score: np.ndarray | None
    finite: np.ndarray
    seconds: float
    diagnostics: str

    @property
    def chosen_labels(self) -> list[str]:
        return [self.labels[c] for c in self.chosen]


def cross_validate(
    method: Method,
    params: Any,
    data: CVData,
    *,
    keys: jax.Array,
    num_rounds: int,
    eval_fn: Callable[[Any, Any], dict],
    score: Callable[[dict[str, np.ndarray]], np.ndarray] | None = None,
    member_kwargs: Mapping[str, Any] | None = None,
    eval_data: Any = None,
    fold_weights: Any = None,
    maximize: bool = False,
    params_per_seed: bool = False,
    warn_unconverged: bool = True,
    **run_kwargs,
) -> CVOutcome:
    """Trains ``method`` on every member and grid point, picks a point per seed by CV.

    Args:
      method: the :class:`Method`.
      params: one initial model, or ``[S]`` of them with ``params_per_seed``.
      data: the :class:`CVData`.
      keys: run keys ``[S]``; all members of a seed share its key (common random numbers).
      num_rounds: rounds of every run.
      eval_fn: ``eval_fn(client_params, eval_data_member) -> {name: [n] or []}``, at the end.
      score: maps validation metrics ``{name: [S, K, G, ...]}`` to scores ``[S, K, G]``
        (lower is better unless ``maximize``). Required when the method has a grid.
      member_kwargs: ``{name: [S (K + 1), ...]}`` factory arguments of each member (its D,
        its smoothness constant).
      eval_data: what ``eval_fn`` sees per member ``[S (K + 1), ...]`` (default ``data.evals``).
      fold_weights: optional ``[S, K]`` weights of the folds in the CV score.
      maximize: higher scores are better.
      params_per_seed: ``params`` has a seed axis.
      warn_unconverged: warn about rounds whose projection stopped at its iteration cap
        (a deliberately capped projection can turn this off; the report is still returned).
      **run_kwargs: further options of :func:`karula_jax.training.run_many`.

    Returns:
      A :class:`CVOutcome`.
    """
    S, K = data.num_seeds, data.num_folds
    if method.tuned and score is None:
        raise ValueError("score is required for a method with a grid")
    # Untuned methods need the final fits only.
    members = np.arange(S * (K + 1)) if method.tuned else np.arange(S) * (K + 1) + K
    take = lambda tree: jax.tree.map(lambda a: a[members], tree)
    per_member = lambda tree: jax.tree.map(lambda a: a[members // (K + 1)], tree)
    options = dict(eval_every_chunk=False, chunk_size=num_rounds, on_nonfinite="record")
    options |= dict(progress=False) | run_kwargs
    t0 = time.perf_counter()
    parts, reports = [], []
    for static in method.static_grid or [{}]:
        with warnings.catch_warnings():
            if not warn_unconverged:
                warnings.simplefilter("ignore", ProjectionNotConvergedWarning)
            res = run_many(
                functools.partial(method.make, **static),
                per_member(params) if params_per_seed else params,
                take(data.train),
                keys=per_member(keys),
                num_rounds=num_rounds,
                hyper=method.grid or None,
                data_per_seed=True,
                params_per_seed=params_per_seed,
                batch_kwargs=take(member_kwargs) if member_kwargs else None,
                eval_fn=eval_fn,
                eval_data=take(data.evals if eval_data is None else eval_data),
                eval_data_per_seed=True,
                **options,
            )
        d = res.diagnostics
        if d["unconverged_rounds"] or d["worst_proj_delta"] > 0:
            reports.append(describe_diagnostics(d))
        m = {k: np.asarray(v[-1], np.float64) for k, v in res.metrics.items()}
        m["finite"] = np.asarray(res.info.finite).all(axis=0)
        grid_axis = (lambda a: a) if method.grid else (lambda a: a[:, None])
        parts.append({k: grid_axis(v) for k, v in m.items()})  # [members, G, ...]
    m = {k: np.concatenate([p[k] for p in parts], axis=1) for k in parts[0]}
    m = {k: v.reshape((S, -1) + v.shape[1:]) for k, v in m.items()}  # [S, F, G, ...]
    chosen, cv_score = np.zeros(S, dtype=int), None
    if method.tuned:
        val = {k: v[:, :K] for k, v in m.items()}
        sel = ev.select_by_cv(
            score(val), fold_weights=fold_weights, valid=val["finite"], maximize=maximize
        )
        chosen, cv_score = sel.index, sel.score
    grid_metrics = {k: v[:, -1] for k, v in m.items() if k != "finite"}
    return CVOutcome(
        metrics={k: v[np.arange(S), chosen] for k, v in grid_metrics.items()},
        grid_metrics=grid_metrics,
        chosen=chosen,
        labels=method.labels(),
        cv_score=cv_score,
        finite=m["finite"][np.arange(S), -1, chosen],
        seconds=time.perf_counter() - t0,
        diagnostics="; ".join(reports),
    )
