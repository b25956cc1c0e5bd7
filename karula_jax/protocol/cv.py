"""Cross-validated comparison: every method on every member and grid point, a choice per seed.

For a method with hyperparameters, every seed's training rows are split into ``K``
client-wise folds (:func:`karula_jax.protocol.cv_datasets`), the method is trained on
every fold and on the full training rows at every grid point, the grid point with the
best validation score (:func:`karula_jax.evaluation.select_by_cv`) is chosen per seed, and
the seed's result is the final fit at that point, scored on its test rows. A method
without hyperparameters is trained on the final fits only.

A method's runs draw a step ``"<method>: compiling"`` and then a progress bar of rounds
(updated ``PROGRESS_UPDATES`` times per run, one step and bar per entry of a static
grid). Every outcome records the training loss of each round of the chosen point's runs
and whether it flattened by the end (:func:`~karula_jax.evaluation.curves.round_loss_flattened`:
the last tenth of the rounds' mean loss within 5% of the run's whole decrease, plus
noise, of the tenth before it); :func:`compare` logs every method that did not, telling
to raise ``num_rounds``: a method still training at the end is compared under-trained.
Rounds whose projection stopped at its iteration cap are collected over all of a method's
runs and reported once, after its last run: one
:class:`~karula_jax.training.ProjectionNotConvergedWarning` per method, as
:func:`~karula_jax.training.run` warns once per run.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from karula_jax import evaluation as ev
from karula_jax.evaluation.curves import FLAT_TOL, FLAT_WINDOW, round_loss_flattened
from karula_jax.protocol.datasets import CVData
from karula_jax.protocol.methods import Method
from karula_jax.training import (
    ProjectionNotConvergedWarning,
    default_batch_mesh,
    describe_diagnostics,
    run_many,
    vmap_algorithm,
)
from karula_jax.training.progress import compile_step

__all__ = ["CVOutcome", "compare", "cross_validate"]

# How often a method's progress bar advances during one run (its chunks of rounds).
PROGRESS_UPDATES = 10


class CVOutcome(NamedTuple):
    """Per-seed outcome of :func:`cross_validate` (host arrays).

    Attributes:
      metrics: every metric of the final fit at the chosen point, ``[S, ...]``.
      grid_metrics: the same at every grid point, ``[S, G, ...]``.
      chosen: chosen grid index per seed, ``[S]`` (0 without a grid).
      labels: the grid points' labels, ``[G]`` (``[""]`` without a grid).
      cv_score: cross-validated score ``[S, G]`` (None without a grid).
      finite: whether the chosen final fit stayed finite and did not diverge
        (:func:`karula_jax.evaluation.diverged`: its training loss did not grow tenfold),
        ``[S]``; a grid point that diverged on a fold is never chosen.
      edge: whether the choice is an edge of the grid that is not a natural limit
        (:func:`karula_jax.evaluation.grid_edge`) nor a plateau, or neighbours a diverged
        point of a one-axis grid (:func:`karula_jax.evaluation.grid_next_to_diverged`: the
        edge of the method's stable region), ``[S]`` bool: the grid is too narrow or the
        step too large there.
      seconds: wall clock of the method's runs, compilation included.
      diagnostics: the projection's report (:func:`karula_jax.training.describe_diagnostics`)
        when a run had an inexact projection, else "".
      curves: every metric of the final fit at the chosen point at every evaluation,
        ``[S, T, ...]`` in the metric's own dtype (``T = 1`` unless the runs evaluate
        every chunk).
      rounds: rounds completed at each evaluation, ``[T]``.
      params: the client models of the final fit at the chosen point, leaves
        ``[S, n, ...]`` (with ``final_params``; else None).
      plateau: whether the choice is an end of a one-axis grid where the CV score has
        stopped moving (:func:`karula_jax.evaluation.grid_plateau`), ``[S]`` bool; None
        as False.
      train_loss: the training loss of every round (the participants' minibatch loss,
        :class:`~karula_jax.algorithms.RoundInfo`) of the final fit at the chosen point,
        ``[S, R]`` float64 (without final fits: the folds' mean at the chosen point).
      flattened: whether ``train_loss`` flattened by the last round, ``[S]`` bool
        (:func:`~karula_jax.evaluation.curves.round_loss_flattened` with its defaults:
        the mean over the last tenth of the rounds within 5% of the whole decrease, plus
        the rounds' noise, of the mean over the tenth before it); None with fewer than 3
        rounds. A method that did not flatten is under-trained: raise ``num_rounds``.
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
    curves: dict[str, np.ndarray]
    rounds: np.ndarray
    params: Any = None
    plateau: np.ndarray | None = None
    train_loss: np.ndarray | None = None
    flattened: np.ndarray | None = None

    @property
    def chosen_labels(self) -> list[str]:
        """The chosen point per seed; ``" [edge]"`` marks a choice on a grid edge,
        ``" [plateau]"`` one at an end where the score has stopped moving."""
        plateau = np.zeros_like(self.edge) if self.plateau is None else self.plateau
        return [
            self.labels[c] + (" [edge]" if e else " [plateau]" if p else "")
            for c, e, p in zip(self.chosen, self.edge, plateau, strict=True)
        ]


def _run_options(num_rounds: int, num_members: int, given: Mapping[str, Any]) -> dict[str, Any]:
    """The options :func:`cross_validate` gives :func:`~karula_jax.training.run_many`:
    ``given`` over these defaults: ``progress=True`` with ``chunk_size`` a
    ``PROGRESS_UPDATES``-th of ``num_rounds`` (the bar advances after every chunk; results
    do not depend on the chunk size), ``eval_every_chunk=False`` (True: curves),
    ``on_nonfinite="record"``, ``reuse_compiled=True`` and, unless ``given`` names a mesh
    or ``shard="clients"``, the ``num_members`` members split over
    ``default_batch_mesh`` (in a single-process job)."""
    chunk = max(1, -(-num_rounds // PROGRESS_UPDATES))
    options = dict(eval_every_chunk=False, chunk_size=chunk, on_nonfinite="record")
    # A registry method's factory reads only its arguments and the rates fixed when it was
    # built: a second cross-validation of it (another D, other data) reuses its programs.
    options |= dict(progress=True, reuse_compiled=True) | given
    if "mesh" not in given and options.get("shard", "batch") == "batch":
        options["mesh"] = default_batch_mesh(num_members)
    return options


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
    desc: str | None = None,
    final_params: bool = False,
    final_fits: bool = True,
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
      warn_unconverged: warn, once after the method's last run, about the rounds whose
        projection stopped at its iteration cap in some run (a deliberately capped
        projection can turn this off; the report is still returned in ``diagnostics``).
      desc: the method's name on its progress bars and in its warning.
      final_params: also return the final fits' client models (``CVOutcome.params``).
      final_fits: train the final fits; False (a tuned method only, e.g. CV on a separate
        tuning draw whose final fits nobody reads) trains the folds alone, a ``1 / (K +
        1)`` saving: ``metrics`` and ``grid_metrics`` then hold the validation metrics
        averaged over the folds, ``curves`` is empty and ``params`` None.
      **run_kwargs: further options of :func:`karula_jax.training.run_many`; defaults
        here: :func:`_run_options` (``reuse_compiled=True``: ``method.make`` and
        ``eval_fn`` must be pure, as the registry's factories are) and the member axis
        split over the devices, ``mesh=batch_mesh(members)`` (one device: unsplit).

    Returns:
      A :class:`CVOutcome`.
    """
    S, K = data.num_seeds, data.num_folds
    _check_tuning(method, score, K)
    members, final = _layout(method.tuned, S, K, final_fits)
    final_params = final_params and final_fits
    take = lambda tree: jax.tree.map(lambda a: a[members], tree)
    per_member = lambda tree: jax.tree.map(lambda a: a[members // (K + 1)], tree)
    options = _run_options(num_rounds, len(members), run_kwargs)
    batch_kwargs = take(member_kwargs) if member_kwargs else None
    grid_axis = (lambda a: a) if method.grid else (lambda a: a[:, None])
    t0, parts, curves, finals, reports, unconverged = time.perf_counter(), [], [], [], [], []
    losses = []
    for static in method.static_grid or [{}]:
        # the factory itself when there is no static point: the same object in every
        # call, so that run_many can reuse its compiled programs
        make = functools.partial(method.make, **static) if static else method.make
        point = ", ".join(f"{k}={v}" for k, v in static.items())
        label = " ".join(x for x in (desc, point) if x) or None
        with warnings.catch_warnings(), compile_step(label, enabled=options["progress"]):
            warnings.simplefilter("ignore", ProjectionNotConvergedWarning)  # reported below
            res = run_many(
                make,
                per_member(params) if params_per_seed else params,
                take(data.train),
                keys=per_member(keys),
                num_rounds=num_rounds,
                hyper=method.grid or None,
                data_per_seed=True,
                params_per_seed=params_per_seed,
                batch_kwargs=batch_kwargs,
                eval_fn=eval_fn,
                eval_data=take(data.evals if eval_data is None else eval_data),
                eval_data_per_seed=True,
                desc=label,
                **options,
            )
        unconverged.append(_report(res.diagnostics, point, reports, always=method.projects))
        m = {k: np.asarray(v[-1], np.float64) for k, v in res.metrics.items()}
        # a run is usable when it stayed finite and its training loss did not grow
        # tenfold (a step beyond the stable range can stay finite while it diverges)
        m["finite"] = np.asarray(res.info.finite).all(axis=0) & ~ev.diverged(res.info.loss)
        parts.append({k: grid_axis(v) for k, v in m.items()})  # [members, G, ...]
        losses.append(grid_axis(np.moveaxis(np.asarray(res.info.loss, np.float64), 0, -1)))
        if final_fits:
            curves.append({k: _final_curves(v, final, method.grid) for k, v in res.metrics.items()})
        if final_params:  # [S, G, n, ...]
            client = _client_models(
                make, method.grid, res.state, take(data.train), batch_kwargs, params_per_seed
            )
            finals.append(jax.tree.map(lambda a: grid_axis(a[final]), client))
    val, grid_metrics, finite = _split_metrics(parts, S, K, final_fits)
    chosen, cv_score, edge, plateau = _choose(method, val, score, fold_weights, maximize, S)
    if warn_unconverged and any(unconverged):
        _warn_capped(desc, reports)
    pick = lambda a: a[np.arange(S), chosen]  # [S, G, ...] -> the chosen point's [S, ...]
    train_loss = pick(_fit_losses(losses, S, K, final_fits))  # [S, R]
    return CVOutcome(
        metrics={k: pick(v) for k, v in grid_metrics.items()},
        grid_metrics=grid_metrics,
        chosen=chosen,
        labels=method.labels(),
        cv_score=cv_score,
        finite=pick(finite),
        edge=edge,
        seconds=time.perf_counter() - t0,
        diagnostics="; ".join(reports),
        curves={k: pick(np.concatenate([c[k] for c in curves], 1)) for k in (curves or [{}])[0]},
        rounds=np.asarray(res.metric_rounds),
        params=jax.tree.map(lambda *a: pick(np.concatenate(a, 1)), *finals) if finals else None,
        plateau=plateau,
        train_loss=train_loss,
        flattened=round_loss_flattened(train_loss) if train_loss.shape[-1] >= 3 else None,
    )


def _fit_losses(losses, S: int, K: int, final_fits: bool) -> np.ndarray:
    """The final fits' per-round losses ``[S, G, R]`` from the runs' ``[members, G, R]``
    per static entry (without final fits: the folds' mean)."""
    a = np.concatenate(losses, axis=1)
    a = a.reshape((S, -1) + a.shape[1:])  # [S, F, G, R]
    return a[:, -1] if final_fits else a[:, :K].mean(1)


def _next_to_diverged(method: Method, out: CVOutcome) -> np.ndarray:
    """``[S]``: the choice neighbours a diverged point of a one-axis grid."""
    if out.cv_score is None or method.edges is not None:
        return np.zeros(np.shape(out.chosen), bool)
    return ev.grid_next_to_diverged(out.chosen, out.cv_score)


def _report(diagnostics: dict, point: str, reports: list[str], *, always=False) -> bool:
    """Appends a run's projection report to ``reports`` when it was inexact, or
    ``always`` (a method that projects: its report also when the screen answered every
    round); returns whether some round stopped at the iteration cap."""
    if always or diagnostics["unconverged_rounds"] or diagnostics["worst_proj_delta"] > 0:
        reports.append((f"{point}: " if point else "") + describe_diagnostics(diagnostics))
    return bool(diagnostics["unconverged_rounds"])


def _layout(tuned: bool, S: int, K: int, final_fits: bool) -> tuple[np.ndarray, slice]:
    """``(members, final)``: the members to train (untuned methods: the final fits only;
    without ``final_fits``: the folds only) and where the final fits sit among them."""
    if not final_fits and not (tuned and K):
        raise ValueError("final_fits=False needs a method with a grid and folds (K >= 1)")
    members = np.arange(S * (K + 1)) if tuned else np.arange(S) * (K + 1) + K
    if not final_fits:
        members = members[members % (K + 1) < K]
    return members, slice(K, None, K + 1) if tuned else slice(None)


def _split_metrics(parts, S: int, K: int, final_fits: bool):
    """``(val {name: [S, K, G, ...]}, grid_metrics {name: [S, G, ...]}, finite [S, G])``
    from the runs' final metrics ``parts`` (``[members, G, ...]`` per static entry): the
    final fits', or without them the folds' means."""
    m = {k: np.concatenate([p[k] for p in parts], axis=1) for k in parts[0]}
    m = {k: v.reshape((S, -1) + v.shape[1:]) for k, v in m.items()}  # [S, F, G, ...]
    val = {k: v[:, :K] for k, v in m.items()}
    if final_fits:
        return val, {k: v[:, -1] for k, v in m.items() if k != "finite"}, m["finite"][:, -1]
    return val, {k: v.mean(1) for k, v in val.items() if k != "finite"}, val["finite"].all(1)


def _check_tuning(method: Method, score, num_folds: int) -> None:
    """A method with a grid needs a score and folds to choose on (before any training)."""
    if method.tuned and score is None:
        raise ValueError("score is required for a method with a grid")
    if method.tuned and num_folds == 0:
        raise ValueError(
            "a method with a grid needs folds to choose on, but data has num_folds=0 (the "
            "final fits only): build data with cv_datasets(..., num_folds >= 2) or fix the "
            "hyperparameter (a single value instead of a grid)"
        )


def _choose(method: Method, val, score, fold_weights, maximize: bool, S: int):
    """``(chosen [S], cv_score [S, G] or None, edge [S], plateau [S])`` from the
    validation metrics ``val`` ``{name: [S, K, G, ...]}`` (``finite`` among them). A
    plateau is looked for on one-axis grids only (the neighbour of a crossed grid's
    point is not its index's)."""
    none = np.zeros(S, bool)
    if not method.tuned:
        return np.zeros(S, dtype=int), None, none, none
    valid = val["finite"]
    scores = np.asarray(score(val))
    if scores.shape != valid.shape:  # [S, K, G]
        raise ValueError(
            f"score must map the validation metrics {{name: [S, K, G, ...]}} to scores "
            f"[S, K, G] = {valid.shape}, got shape {scores.shape} (average over clients, "
            f"e.g. m['mse'].mean(-1))"
        )
    sel = ev.select_by_cv(scores, fold_weights=fold_weights, valid=valid, maximize=maximize)
    edge = method.edge(sel.index)
    one_axis = method.edges is None
    plateau = edge & ev.grid_plateau(sel.index, sel.score) if one_axis else none
    # next to a diverged point: the edge of the method's stable region, wherever it is
    unstable = ev.grid_next_to_diverged(sel.index, sel.score) if one_axis else none
    return sel.index, sel.score, (edge & ~plateau) | unstable, plateau


def _warn_capped(desc: str | None, reports: list[str]) -> None:
    """The one :class:`ProjectionNotConvergedWarning` of a method's runs, at the caller of
    :func:`cross_validate`."""
    warnings.warn(
        f"{desc or 'cross_validate'}: the projection stopped at its iteration cap in some "
        f"runs ({'; '.join(reports)}). The models are feasible but only approximately "
        "projected: raise projection_max_iter (or projection_tol).",
        ProjectionNotConvergedWarning,
        stacklevel=3,
    )


def _client_models(make, grid, state, train, batch_kwargs, params_per_seed: bool) -> Any:
    """Client models of a :func:`run_many` batch's final ``state``, ``[members, (G), n, ...]``."""
    batched = vmap_algorithm(
        make,
        grid or None,
        data_per_seed=True,
        params_per_seed=params_per_seed,
        batch_kwargs=batch_kwargs,
    )
    return jax.device_get(batched.client_params(state, train))


def _final_curves(metric, final: slice, grid) -> np.ndarray:
    """A metric ``[T, members, (G), ...]`` of a run: its final fits, ``[S, G, T, ...]``."""
    a = np.asarray(metric)[:, final]
    return np.moveaxis(a if grid else a[:, :, None], 0, 2)


def compare(
    methods: Mapping[str, Method],
    params: Any,
    data: CVData,
    *,
    describe: Callable[[CVOutcome], str] = lambda outcome: "",
    log: Callable[[str], None] = print,
    **options,
) -> dict[str, CVOutcome]:
    """Cross-validates every method in turn (:func:`cross_validate`).

    Each method's runs draw a step ``"[i/m] name: compiling"`` and a progress bar of
    rounds labelled ``"[i/m] name"`` (pass ``progress=False`` for none); a method whose
    projection stopped at its iteration cap gets one
    :class:`~karula_jax.training.ProjectionNotConvergedWarning` after its runs (unless
    ``warn_unconverged=False``), and its log line reports the worst gap. A method whose
    training loss did not flatten by the last round in some seed
    (:attr:`CVOutcome.flattened`) gets a log line naming it and saying to raise
    ``num_rounds``; one whose CV choice is an edge of its grid, a line saying to widen it.

    Built by :func:`~karula_jax.protocol.build_methods` with
    :func:`~karula_jax.protocol.default_rate_rules`, every method's step is chosen by CV
    among multiples of its rule (``rate x1/3 ... x10``), jointly with its own grid.

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

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import karula_jax as kj
      >>> from karula_jax import protocol
      >>> draws = [kj.data.synthetic_ridge(s, num_clients=4, dim=2, num_test=20) for s in range(2)]
      >>> train = protocol.stack_datasets([d.train for d in draws])  # 2 seeds on a leading axis
      >>> test = protocol.stack_datasets([d.test for d in draws])
      >>> keys = jax.random.split(jax.random.key(0), 2)  # one per seed
      >>> cv = protocol.cv_datasets(train, test, 2, key=keys)  # 2 folds + the final fit per seed
      >>> loss, B = kj.models.ridge_loss(1e-6), int(train.x.shape[2])
      >>> def fedavg(learning_rate):
      ...     return kj.algorithms.fedavg(
      ...         loss, learning_rate=learning_rate, clients_per_round=2, batch_size=B
      ...     )
      >>> methods = {
      ...     "Local": protocol.Method(lambda: kj.algorithms.local(loss, learning_rate=1.0,
      ...                                                          batch_size=B)),
      ...     "FedAvg": protocol.Method(fedavg,
      ...                               grid={"learning_rate": jnp.array([1e-4, 0.01, 0.05])}),
      ... }
      >>> def mse(theta, data):  # {name: [n]} on a member's validation or test rows
      ...     return {"mse": kj.evaluation.mean_squared_error(lambda w, x: x @ w, theta, data)}
      >>> out = protocol.compare(
      ...     methods, jnp.zeros(2), cv, keys=keys, num_rounds=50, eval_fn=mse,
      ...     score=lambda m: m["mse"].mean(axis=-1), log=lambda line: None, progress=False,
      ... )
      >>> list(out), out["FedAvg"].metrics["mse"].shape  # test metrics [seeds, clients]
      (['Local', 'FedAvg'], (2, 4))
      >>> out["FedAvg"].labels
      ['learning_rate=0.0001', 'learning_rate=0.01', 'learning_rate=0.05']
      >>> bool((out["FedAvg"].chosen > 0).all())  # CV passes over the step too small to move
      True
      >>> mean, band = kj.stats.mean_and_se(out["Local"].metrics["mse"].mean(axis=1))  # over seeds
      >>> round(float(mean), 2)
      0.34
    """
    outcomes = {}
    for i, name in enumerate(methods):
        desc = f"[{i + 1}/{len(methods)}] {name}"
        out = outcomes[name] = cross_validate(methods[name], params, data, desc=desc, **options)
        if out.diagnostics:
            log(f"    {out.diagnostics}")
        chosen = f"  chosen {out.chosen_labels}" if methods[name].tuned else ""
        log(f"{name:7s} {out.seconds:6.1f} s  {describe(out)}{chosen}")
        if out.flattened is not None and not out.flattened.all():
            log(
                f"    {name}: training loss still falling at round {_rounds(out)} in "
                f"{int((~out.flattened).sum())} of {out.flattened.size} seeds (the last "
                f"{FLAT_WINDOW:.0%} of rounds moved it more than {FLAT_TOL:.0%} of its "
                f"decrease): raise num_rounds"
            )
        unstable = _next_to_diverged(methods[name], out)
        if unstable.any():
            log(
                f"    {name}: CV chose a point next to a diverged one in {int(unstable.sum())} "
                f"of {unstable.size} seeds (the edge of its stable region): lower its step "
                "or give it a step rule that is stable over its whole grid"
            )
        if (out.edge & ~unstable).any():
            log(
                f"    {name}: CV chose an edge of its grid in {int((out.edge & ~unstable).sum())}"
                f" of {out.edge.size} seeds (not a natural limit): widen the grid"
            )
    return outcomes


def _rounds(outcome: CVOutcome) -> int:
    """The rounds of an outcome's runs."""
    return int(outcome.train_loss.shape[-1]) if outcome.train_loss is not None else 0
