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
  returns the per-seed outcome; :func:`compare` does so for every method of a study.
* :func:`method_suite` builds the :class:`Method` of every compared method (:data:`SUITE`)
  from a loss, step-size rules (e.g. :func:`smoothness_rates`) and grids;
  :func:`member_dissimilarities` and :func:`smoothness_constants` give every member its D
  and the constants behind its steps, :func:`cluster_labels` its clients' groups.
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

from karula_jax import algorithms as A
from karula_jax import evaluation as ev
from karula_jax.algorithms.base import Algorithm, LossFn
from karula_jax.data.clients import ClientData, client_weights
from karula_jax.embedding import dissimilarities
from karula_jax.training import (
    ProjectionNotConvergedWarning,
    describe_diagnostics,
    progress_bar,
    run_many,
)

__all__ = [
    "CVData",
    "CVOutcome",
    "Method",
    "SUITE",
    "choice_grid",
    "cluster_labels",
    "compare",
    "cross_validate",
    "cv_datasets",
    "member_default_rates",
    "mean_normalized",
    "member_dissimilarities",
    "default_rates",
    "method_suite",
    "smoothness_constants",
    "smoothness_rates",
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


def mean_normalized(D):
    """Each ``[n, n]`` matrix of ``D`` (``[..., n, n]``, zero diagonal) divided by its mean
    off-diagonal entry, so that a grid of ``t`` means the same across data sets. Works on
    numpy and JAX arrays alike (computed in ``D``'s own dtype)."""
    n = D.shape[-1]
    return D / (D.sum(axis=(-2, -1), keepdims=True) / (n * (n - 1)))


def member_dissimilarities(train: ClientData, key: jax.Array, **options) -> tuple[Any, Any]:
    """Karula's D of every member of a stacked data set, as one compiled vmapped program.

    Args:
      train: members' data, leaves ``[B, n, N, ...]``.
      key: one key for every member, or stacked keys ``[B]`` (one per member).
      **options: keywords of :func:`karula_jax.embedding.dissimilarities`.

    Returns:
      ``(D [B, n, n], info)``, ``info`` with a leading member axis.
    """
    if jnp.ndim(key) == 0:
        return jax.jit(jax.vmap(lambda d: dissimilarities(d, key=key, **options)))(train)
    return jax.jit(jax.vmap(lambda d, k: dissimilarities(d, key=k, **options)))(train, key)


def cluster_labels(D: Any, choices: Sequence[int]) -> np.ndarray:
    """Spectral clusters of every member's D for each number of clusters in ``choices``.

    Args:
      D: dissimilarities ``[B, n, n]``.
      choices: numbers of clusters (:func:`karula_jax.algorithms.cluster_clients`).

    Returns:
      Labels ``[B, len(choices), n]`` int32 (the clustered FedAvg's ``labels``).
    """
    return np.asarray([[A.cluster_clients(d, k) for k in choices] for d in np.asarray(D)], np.int32)


def smoothness_rates(
    *, karula: float, fedavg: float, ifca: float, personal: float, num_clients: int
) -> dict[str, Callable[..., Any]]:
    """:func:`method_suite` step sizes ``rate / L`` from the member arguments ``L_f`` and
    ``L_max`` (:func:`smoothness_constants`).

    Karula, Local and the penalty step ``karula / L_f``, FedSGD ``karula / (n L_f)``; the
    FedAvg family ``fedavg / L_max``, IFCA ``ifca / L_max``; pFedMe ``personal / L_env``
    with ``L_env = lam L_max / (lam + L_max)`` (its Moreau envelope's smoothness) and
    personal step ``1 / (L_max + lam)``; Ditto's personal step ``personal / L_max``; the
    penalty's ``mu`` is its grid value times ``L_f``.
    """
    return {
        "local": lambda L_f, **_: karula / L_f,
        "fedsgd": lambda L_f, **_: karula / (num_clients * L_f),
        "fedavg": lambda L_max, **_: fedavg / L_max,
        "ifca": lambda L_max, **_: ifca / L_max,
        "pfedme": lambda L_max, lam, **_: personal / (lam * L_max / (lam + L_max)),
        "pfedme_personal": lambda L_max, lam, **_: 1 / (L_max + lam),
        "karula": lambda L_f, **_: karula / L_f,
        "ditto_personal": lambda L_max, **_: personal / L_max,
        "penalty_mu": lambda L_f, mu, **_: mu * L_f,
    }


def default_rates(loss: LossFn, params, data: ClientData, clients_per_round: int, *, key):
    """Each method's own default step on one data set, from every client's ``L_i``.

    ``L_i`` as ``karula(learning_rate=None)`` resolves it
    (:func:`karula_jax.algorithms.client_smoothness`: the loss's own constants, else power
    iteration with Hessian-vector products at ``params``, times 2). With
    ``a_i = alpha_i L_i``:

    * ``karula``: :func:`karula_jax.algorithms.karula_learning_rate` without coupling,
      Karula's default at ``t = inf`` (``karula(learning_rate=None)`` adds the coupling
      of its ``t`` and ``D``, which this function does not know);
    * ``local``: ``n / max_i a_i``, half the limit of the steps ``eta a_i / n`` of
      :func:`karula_jax.algorithms.local` (as Karula's rule with ``s = n``);
    * ``fedavg``: ``1 / max_i L_i``, half the gradient-descent limit on the worst client's
      mean loss, for the FedAvg family's local steps.

    Returns:
      ``{"karula", "local", "fedavg": float}``.
    """
    L_i = A.client_smoothness(loss, params, data, key=key)
    alpha = client_weights(data.counts)
    a = np.asarray(alpha * L_i, np.float64)
    karula = A.karula_learning_rate(L_i, alpha, clients_per_round)
    n = data.num_clients
    return {"karula": float(karula), "local": n / a.max(), "fedavg": 1.0 / float(L_i.max())}


def _fits(loss: LossFn, params, data: ClientData) -> bool:
    """Whether ``loss(params, x, y, mask)`` can be evaluated on one client of ``data``."""
    x = jax.ShapeDtypeStruct(data.x.shape[1:], data.x.dtype)
    y = jax.ShapeDtypeStruct(data.y.shape[1:], data.y.dtype)
    mask = jax.ShapeDtypeStruct(data.x.shape[1:2], jnp.bool_)
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), params)
    try:
        jax.eval_shape(loss, spec, x, y, mask)
    except Exception:  # noqa: BLE001 - any failure means "does not fit"
        return False
    return True


def member_default_rates(loss: LossFn, params, data: ClientData, clients_per_round: int, keys):
    """:func:`default_rates` of every member.

    Args:
      loss: the loss of every member.
      params: one model for every member (no member axis), or one model per member,
        leaves ``[B, ...]``; one model is used for every member, as if stacked.
      data: members' data, leaves ``[B, n, N, ...]``.
      clients_per_round: ``s`` of every member.
      keys: stacked keys ``[B]``.

    Returns:
      ``{name: float64 array [B]}``.

    Raises:
      ValueError: ``params`` fit the data neither as one model nor as ``[B, ...]`` models.
    """
    num = len(keys)
    at = lambda tree, b: jax.tree.map(lambda a: a[b], tree)
    leaves = jax.tree.leaves(params)
    first = at(data, 0)
    stacked = all(jnp.ndim(a) >= 1 and jnp.shape(a)[0] == num for a in leaves)
    if stacked and _fits(loss, at(params, 0), first):
        member_params = lambda b: at(params, b)
    elif _fits(loss, params, first):  # one model: every member starts from it
        member_params = lambda b: params
    else:
        shapes = jax.tree.map(lambda a: tuple(jnp.shape(a)), params)
        raise ValueError(
            f"params do not fit the data, neither as one model nor as {num} stacked models "
            f"[B={num}, ...]: params of shapes {shapes}, one client's x of shape "
            f"{first.x.shape[1:]}"
        )
    rates = [
        default_rates(loss, member_params(b), at(data, b), clients_per_round, key=keys[b])
        for b in range(num)
    ]
    return {k: np.array([r[k] for r in rates]) for k in rates[0]}


def smoothness_constants(
    train: ClientData, lam: float, *, logistic: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Smoothness of every member's losses: ``L_f = max_i alpha_i L_i / n`` and ``max_i L_i``.

    Ridge (:func:`karula_jax.models.ridge_loss`): ``L_i = lambda_max(X_i^T X_i / N_i) + lam``
    (:func:`karula_jax.algorithms.lipschitz_ridge`). Logistic with a bias
    (:func:`karula_jax.models.logistic_loss`): ``sigma' <= 1/4`` bounds the Hessian by the
    ridge constant of ``[X_i, 1] / 2`` (float64).

    Args:
      train: members' data, leaves ``[B, n, N, ...]`` with ``x`` of shape ``[B, n, N, d]``.
      lam: the L2 penalty of the loss.
      logistic: the logistic loss instead of ridge.

    Returns:
      ``(L_f, L_max)``, float64 arrays ``[B]``.
    """
    out = []
    for b in range(train.counts.shape[0]):
        d = ClientData(*(np.asarray(a[b]) for a in train))
        if logistic:
            x, ones = np.asarray(d.x, np.float64), np.asarray(d.mask, np.float64)[..., None]
            d = ClientData(np.concatenate([x, ones], -1) / 2, d.y, d.counts)
        n = d.num_clients  # weights n turn max_i alpha_i L_i / n into max_i L_i
        out.append([A.lipschitz_ridge(d, lam), A.lipschitz_ridge(d, lam, np.full(n, float(n)))])
    return tuple(np.asarray(out).T)


class Method(NamedTuple):
    """A method to compare and the hyperparameters to choose from.

    Attributes:
      make: ``make(**member_kwargs, **hyper) -> Algorithm`` (traced values).
      grid: ``{name: [G] values}`` crossed in one compiled program (traced), or None.
      static_grid: entries ``{name: value}`` passed as Python values, one compilation
        each (e.g. a number of clusters that fixes shapes), or None.
      label: names a grid point for tables, ``label(point) -> str``.
      natural: whether a grid point is a natural limit of the method (no wider grid
        exists beyond it), ``natural(point) -> bool``; None: a point whose every value is
        0 or infinite (``t = 0``, ``t = inf``, ``mu = 0``). A CV choice on another edge of
        the grid is flagged (:func:`karula_jax.evaluation.grid_edge`).
    """

    make: Callable[..., Algorithm]
    grid: Mapping[str, Any] | None = None
    static_grid: Sequence[Mapping[str, Any]] | None = None
    label: Callable[[Mapping[str, Any]], str] | None = None
    natural: Callable[[Mapping[str, Any]], bool] | None = None

    @property
    def tuned(self) -> bool:
        return bool(self.grid) or bool(self.static_grid)

    def points(self) -> list[dict[str, Any]]:
        """Every grid point, static entries outermost (the order of the results)."""
        grid = self.grid or {}
        traced = [dict(zip(grid, v, strict=True)) for v in zip(*grid.values(), strict=True)]
        statics = self.static_grid or [{}]
        return [dict(s) | t for s, t in itertools.product(statics, traced or [{}])]

    def natural_points(self) -> list[int]:
        """Indices of the grid points that are natural limits (see ``natural``)."""
        rule = self.natural or (
            lambda p: all(np.all((np.asarray(v) == 0) | np.isinf(v)) for v in p.values())
        )
        return [i for i, p in enumerate(self.points()) if self.tuned and rule(p)]

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
        grid={name: np.arange(len(choices))},
        label=lambda p: f"{name}={choices[int(p[name])]}",
        natural=lambda p: choices[int(p[name])] == 1,  # one cluster: nothing below it
    )


SUITE = ("Local", "FedSGD", "FedAvg", "IFCA", "pFedMe", "Karula", "FedProx", "SCAFFOLD")
SUITE += ("Ditto", "Laplacian penalty on D", "Clustered FedAvg on D")


def method_suite(
    loss: LossFn,
    rates: Mapping[str, Callable[..., Any]],
    *,
    names: Sequence[str] = SUITE,
    grids: Mapping[str, Any],
    clients_per_round: int,
    batch_size: int,
    local_steps: int,
    pfedme_inner_steps: int = 5,
    personalized: Any = None,
    **karula_options,
) -> dict[str, Method]:
    """The :class:`Method` of every method in ``names`` (a subset of :data:`SUITE`).

    A method's factory receives the member arguments (``D``; ``labels [choices, n]``, the
    clients' groups for each choice of the clustered FedAvg; optional ``clusters``, IFCA's
    initial cluster models) and its grid point, and takes its step sizes from ``rates``:
    ``rates[name](**member_kwargs, **point)`` for the names ``local``, ``fedsgd``,
    ``fedavg`` (also FedProx, SCAFFOLD, the clustered FedAvg and Ditto's global model),
    ``ifca``, ``pfedme`` and ``pfedme_personal``, ``karula`` (``None``: Karula's own
    rule at its ``t`` and ``D``), ``penalty`` (the Laplacian penalty's step; ``karula``'s
    when absent), ``ditto_personal`` and ``penalty_mu`` (the penalty's ``mu``). Only the
    rates of the methods in ``names`` are needed.

    Args:
      loss: the loss of every method.
      rates: the step-size rules above.
      names: which methods to build, in this order.
      grids: the hyperparameter of each method that has one, a tuple (a grid chosen by
        CV) or a single value (fixed): ``IFCA`` clusters (static), ``pFedMe`` lambda,
        ``Karula`` t, ``FedProx`` mu, ``Ditto`` lambda, ``Laplacian penalty on D`` mu
        (passed to ``penalty_mu``, labelled ``mu/L_f``), ``Clustered FedAvg on D``
        numbers of clusters (the index into ``labels`` is traced).
      clients_per_round, batch_size: of every method.
      local_steps: of the FedAvg family (FedAvg, IFCA, pFedMe, FedProx, SCAFFOLD, Ditto,
        the clustered FedAvg).
      pfedme_inner_steps: pFedMe's inner steps.
      personalized: the personalized leaves of Karula and the penalty (None: all).
      **karula_options: further keywords of :func:`karula_jax.algorithms.karula`.

    Returns:
      ``{name: Method}``.
    """
    common = dict(clients_per_round=clients_per_round, batch_size=batch_size)
    local = dict(common, local_steps=local_steps)
    r = lambda name, m: rates[name](**m)
    build = {
        "Local": lambda m: A.local(loss, learning_rate=r("local", m), **common),
        "FedSGD": lambda m: A.fedsgd(loss, learning_rate=r("fedsgd", m), **common),
        "FedAvg": lambda m: A.fedavg(loss, learning_rate=r("fedavg", m), **local),
        "IFCA": lambda m: A.ifca(
            loss,
            num_clusters=m["k"],
            learning_rate=r("ifca", m),
            initial_clusters=m.get("clusters"),
            **local,
        ),
        "pFedMe": lambda m: A.pfedme(
            loss,
            learning_rate=r("pfedme", m),
            lam=m["lam"],
            personal_learning_rate=r("pfedme_personal", m),
            inner_steps=pfedme_inner_steps,
            **local,
        ),
        "Karula": lambda m: A.karula(
            loss,
            m["D"],
            t=m["t"],
            learning_rate=r("karula", m),
            personalized=personalized,
            **karula_options,
            **common,
        ),
        "FedProx": lambda m: A.fedprox(loss, mu=m["mu"], learning_rate=r("fedavg", m), **local),
        "SCAFFOLD": lambda m: A.scaffold(loss, learning_rate=r("fedavg", m), **local),
        "Ditto": lambda m: A.ditto(
            loss,
            lam=m["lam"],
            learning_rate=r("fedavg", m),
            personal_learning_rate=r("ditto_personal", m),
            **local,
        ),
        "Laplacian penalty on D": lambda m: A.laplacian_penalty(
            loss,
            m["D"],
            mu=r("penalty_mu", m),
            learning_rate=r("penalty" if "penalty" in rates else "karula", m),
            personalized=personalized,
            **common,
        ),
        "Clustered FedAvg on D": lambda m: A.clustered_fedavg(
            loss, m["labels"][m["k"]], learning_rate=r("fedavg", m), **local
        ),
    }
    keys = {"IFCA": "k", "pFedMe": "lam", "Karula": "t", "FedProx": "mu", "Ditto": "lam"}
    keys |= {"Laplacian penalty on D": "mu", "Clustered FedAvg on D": "k"}
    shown = {"pFedMe": "lambda", "Laplacian penalty on D": "mu/L_f"}
    methods = {}
    for name in names:
        make = functools.partial(lambda name, **m: build[name](m), name)
        key, values = keys.get(name), grids.get(name)
        if key is not None and not isinstance(values, tuple | list):  # a fixed value
            make = functools.partial(make, **{key: values})
        if key is None or not isinstance(values, tuple | list):
            methods[name] = Method(make)
        elif name == "IFCA":  # the number of clusters fixes shapes: one compilation each
            static = [{"k": int(k)} for k in values]
            label, natural = (lambda p: f"k={p['k']}"), (lambda p: p["k"] == 1)
            methods[name] = Method(make, static_grid=static, label=label, natural=natural)
        elif name == "Clustered FedAvg on D":
            methods[name] = Method(make, **choice_grid(key, values))
        else:
            methods[name] = Method(make, **scalar_grid(key, values, shown=shown.get(name)))
    return methods


class CVOutcome(NamedTuple):
    """Per-seed outcome of :func:`cross_validate` (host arrays).

    Attributes:
      metrics: every metric of the final fit at the chosen point, ``[S, ...]``.
      grid_metrics: the same at every grid point, ``[S, G, ...]``.
      chosen: chosen grid index per seed, ``[S]`` (0 without a grid).
      labels: the grid points' labels, ``[G]`` (``[""]`` without a grid).
      cv_score: cross-validated score ``[S, G]`` (None without a grid).
      finite: whether the chosen final fit stayed finite, ``[S]``.
      edge: whether the choice is an edge of the grid that is not a natural limit
        (:func:`karula_jax.evaluation.grid_edge`), ``[S]`` bool: the grid is too narrow.
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
    edge: np.ndarray
    seconds: float
    diagnostics: str

    @property
    def chosen_labels(self) -> list[str]:
        """The chosen point per seed; ``" [edge]"`` marks a choice on a grid edge."""
        return [
            self.labels[c] + (" [edge]" if e else "")
            for c, e in zip(self.chosen, self.edge, strict=True)
        ]


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
        edge=ev.grid_edge(chosen, len(method.labels()), natural=method.natural_points())
        if method.tuned
        else np.zeros(S, bool),
        seconds=time.perf_counter() - t0,
        diagnostics="; ".join(reports),
    )


def compare(
    methods: Mapping[str, Method],
    params: Any,
    data: CVData,
    *,
    describe: Callable[[CVOutcome], str] = lambda outcome: "",
    log: Callable[[str], None] = print,
    **options,
) -> dict[str, CVOutcome]:
    """Cross-validates every method in turn (:func:`cross_validate`), with a progress bar.

    Args:
      methods: ``{name: Method}``, run in this order.
      params: the initial model(s), as in :func:`cross_validate`.
      data: the :class:`CVData`.
      describe: a method's summary for the log, ``describe(outcome) -> str``.
      log: where a line per method goes (its projection report when inexact, its wall
        time, ``describe`` and the CV choice per seed).
      **options: the other arguments of :func:`cross_validate`.

    Returns:
      ``{name: CVOutcome}`` in the order of ``methods``.
    """
    outcomes = {}
    for name in progress_bar(list(methods), desc="methods", unit="method"):
        out = outcomes[name] = cross_validate(methods[name], params, data, **options)
        if out.diagnostics:
            log(f"    {out.diagnostics}")
        chosen = f"  chosen {out.chosen_labels}" if methods[name].tuned else ""
        log(f"{name:7s} {out.seconds:6.1f} s  {describe(out)}{chosen}")
        if out.edge.any():
            log(
                f"    {name}: CV chose an edge of its grid in {int(out.edge.sum())} of "
                f"{out.edge.size} seeds (not a natural limit): widen the grid"
            )
    return outcomes
