"""The study driver: data draws -> D per member -> CV of every method -> one writer.

A study compares methods on ``S`` seeds; it supplies its config, a function drawing one
seed's training and test data (:class:`Draw`) and its methods, and the driver does the
rest, in steps a study may also call one by one:

1. :func:`draw_study` draws every seed, stacks the draws
   (:func:`~karula_jax.protocol.stack_datasets`), lays out the CV folds and final fits
   (:func:`~karula_jax.protocol.cv_datasets`), and gives every member its D
   (:func:`~karula_jax.protocol.member_dissimilarities`) and its clients' spectral
   clusters (:func:`~karula_jax.protocol.cluster_labels`): a :class:`StudyData`.
2. :func:`~karula_jax.protocol.compare` cross-validates every method and scores the
   final fits at the chosen points (a method without a grid: the final fits alone;
   :func:`fix_choices` fixes the points chosen on another draw).
3. :func:`study_rows` turns per-seed values into table rows (mean ± 95% t-interval, the
   paired difference with the reference method, its p-value and Holm's adjusted p-value,
   decided below 0.05, the CV choices); :func:`write_study` writes
   the table (Markdown and CSV), the JSON summary and the figures, and logs the table.

:func:`run_study` runs the three steps on a :class:`Study`; :func:`logistic_study` is a
whole :class:`Study` of binary logistic regression, so that a new tabular data set
needs only its draw function and settings (``docs/studies.md``).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax import evaluation as ev
from karula_jax import provenance, reporting
from karula_jax._smoothness import linear_smoothness
from karula_jax.data.clients import ClientData
from karula_jax.models import linear_params, logistic_loss
from karula_jax.protocol.cv import CVOutcome, compare
from karula_jax.protocol.datasets import (
    CVData,
    cluster_labels,
    cv_datasets,
    mean_normalized,
    member_dissimilarities,
    stack_datasets,
)
from karula_jax.protocol.methods import REGISTRY, Method, build_methods
from karula_jax.protocol.rates import smoothness_constants, smoothness_rates
from karula_jax.protocol.t_grid import member_t_grid

__all__ = [
    "Draw",
    "Report",
    "Study",
    "StudyData",
    "StudyResult",
    "describe_grids",
    "draw_study",
    "fix_choices",
    "logistic_study",
    "logistic_t_grid",
    "pooled_choice",
    "run_study",
    "selected",
    "study_data",
    "study_rows",
    "write_study",
]

# Default key schemes of draw_study: fold keys fold_in(key(FOLD_SEED), seed), D keys
# fold_in(key(EMBED_SEED), member).
FOLD_SEED, EMBED_SEED = 1_000_003, 2_000_003


class Draw(NamedTuple):
    """One seed's data, as a study's draw function returns it.

    Attributes:
      train: training data, leaves ``[n, N, ...]``.
      test: test data of the same clients, leaves ``[n, N_test, ...]``.
      extras: whatever else the study keeps per seed (true models, client names), or None.
    """

    train: ClientData
    test: ClientData
    extras: Any = None


class StudyData(NamedTuple):
    """Every data set of a study and what its members need (:func:`draw_study`).

    ``B = S (K + 1)`` members, seed-major (layout: :mod:`karula_jax.protocol.datasets`).

    Attributes:
      cv: the :class:`~karula_jax.protocol.CVData`.
      D: ``[B, n, n]`` every member's dissimilarities.
      labels: ``[B, len(cluster_grid), n]`` int32 spectral clusters of D.
      converged: ``[B, n]`` bool, whether each client's transport problem converged.
      extras: the draws' extras, one per seed.
      embed_keys: the keys D was computed with, one or ``[B]``.
      seeds: the seeds drawn, ``S`` of them.
    """

    cv: CVData
    D: Any
    labels: np.ndarray
    converged: np.ndarray
    extras: tuple
    embed_keys: jax.Array
    seeds: tuple[int, ...] = ()

    def member_kwargs(self, **more) -> dict[str, Any]:
        """The methods' member arguments (:func:`~karula_jax.protocol.build_methods`):
        ``D``, ``labels`` (when a cluster grid was given) and ``more`` (``[B, ...]`` each)."""
        kw = {"D": self.D} | ({"labels": self.labels} if self.labels.shape[1] else {})
        return kw | more


def draw_study(
    draw: Callable[[int], Draw],
    seeds: int | Sequence[int],
    *,
    num_folds: int,
    embed: Mapping[str, Any],
    fold_keys: jax.Array | None = None,
    embed_keys: jax.Array | None = None,
    normalize_D: bool = False,
    cluster_grid: Sequence[int] = (),
    log: Callable[[str], None] = print,
) -> StudyData:
    """Draws every seed's data and gives every member of the CV layout its D.

    Args:
      draw: ``draw(seed) -> Draw``; every draw has the same clients and feature shapes.
      seeds: the seeds, or their number ``S`` (seeds ``0..S-1``).
      num_folds: ``K >= 2`` folds of each seed's training rows; 0: final fits only.
      embed: keywords of :func:`karula_jax.embedding.dissimilarities` (``num_reference``,
        ``epsilon``, ``num_classes``...).
      fold_keys: ``[S]`` keys of the seeds' folds (default ``fold_in(key(1_000_003), seed)``).
      embed_keys: one key for every member, or ``[B]`` keys (default: member ``b`` embeds
        with ``fold_in(key(2_000_003), b)``).
      normalize_D: divide every member's D by its mean off-diagonal entry
        (:func:`~karula_jax.protocol.mean_normalized`), before the clusters.
      cluster_grid: numbers of clusters of :attr:`StudyData.labels`.
      log: where the embedding's wall time goes.
    """
    seeds = list(range(seeds)) if isinstance(seeds, int) else [int(s) for s in seeds]
    draws = [draw(s) for s in seeds]
    train, test = (stack_datasets([getattr(d, k) for d in draws]) for k in ("train", "test"))
    if num_folds and fold_keys is None:
        key = jax.random.key(FOLD_SEED)
        fold_keys = jax.vmap(lambda s: jax.random.fold_in(key, s))(jnp.asarray(seeds))
    cv = cv_datasets(train, test, num_folds, key=fold_keys if num_folds else None)
    B = int(cv.train.counts.shape[0])
    if embed_keys is None:
        key = jax.random.key(EMBED_SEED)
        embed_keys = jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(B))
    t0 = time.perf_counter()
    D, info = jax.block_until_ready(member_dissimilarities(cv.train, embed_keys, **embed))
    log(f"dissimilarities of {B} data sets: {time.perf_counter() - t0:.1f} s")
    D = mean_normalized(D) if normalize_D else D
    extras = tuple(d.extras for d in draws)
    converged = np.asarray(info.converged)
    labels = cluster_labels(D, cluster_grid)
    return StudyData(cv, D, labels, converged, extras, embed_keys, tuple(seeds))


def selected(names: Sequence[str], order: Sequence[str] | None = None, reference="Karula") -> list:
    """The methods to run: those of ``order`` (default: every registered method, in the
    registry's order) that ``names`` holds, in that order, then the other registered
    methods of ``names`` in the order given (a method of one's own runs in any study that
    names it); ``reference`` always (the table's paired reference).

    Raises:
      TypeError: ``names`` is a string (one name is ``("Mine",)``).
      ValueError: a name that is not registered (:func:`~karula_jax.protocol.register`).
    """
    if isinstance(names, str):
        raise TypeError(f"names must be a sequence of method names, got the string {names!r}")
    unknown = [m for m in names if m not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; registered: {list(REGISTRY)}")
    order = tuple(REGISTRY) if order is None else tuple(order)
    chosen = [m for m in order if m in names or m == reference]
    return chosen + [m for m in dict.fromkeys(names) if m not in chosen]


def describe_grids(methods: Mapping[str, Method]) -> str:
    """The grids of the tuned methods, ``"Karula: t=1, t=3; IFCA: k=1, k=2"``."""
    return "; ".join(f"{n}: {', '.join(m.labels())}" for n, m in methods.items() if m.tuned)


def fix_choices(
    methods: Mapping[str, Method], outcomes: Mapping[str, CVOutcome], seed: int = 0
) -> tuple[dict[str, Method], dict[str, dict[str, Any]]]:
    """Every method at the grid point cross-validation chose for ``seed`` (e.g. on a
    separate tuning draw), to train without a grid.

    A method not in ``outcomes`` takes its first grid point (the only one of a one-point
    grid); a method without a grid stays as it is.

    Returns:
      ``(methods, points)``: the fixed methods and ``{name: point}`` of those with a point.
    """
    points = {
        name: m.points()[outcomes[name].chosen[seed] if name in outcomes else 0]
        for name, m in methods.items()
    }
    fixed = {
        name: Method(functools.partial(m.make, **points[name]), projects=m.projects)
        for name, m in methods.items()
    }
    return fixed, {name: p for name, p in points.items() if p}


def study_rows(
    values: Mapping[str, Mapping[str, Any]],
    outcomes: Mapping[str, CVOutcome],
    *,
    paired: str,
    reference: str = "Karula",
    choice: str = "cv_choice",
    choices: Mapping[str, str] | None = None,
    untuned: str = "",
    test_train_ratio: float = 0.0,
) -> list[dict]:
    """Table rows from per-seed values (:func:`karula_jax.reporting.comparison_rows`):
    means ± 95% t half-widths, the paired difference with ``reference``, its p-value,
    Holm's adjusted p-value over the table's methods and the verdict (decided below 0.05).

    Args:
      values: ``{method: {column: [S] values}}``, every method with the same columns.
      outcomes: ``{method: CVOutcome}`` of the same methods.
      paired: the column whose paired difference ``reference - method`` the rows hold.
      reference: the method the others are compared with.
      choice: the key of the CV choice per method (how often each point was chosen,
        ``untuned`` for a method without a grid), or ``choices[method]`` when given.
      choices, untuned: see ``choice``.
      test_train_ratio: ``n_test / n_train`` for seeds that are overlapping splits of one
        pool (the corrected variance), 0 for independent seeds.

    Returns:
      Rows with ``method``, the columns (mean and ``_2se``, the half-width), the paired
      columns (:func:`karula_jax.reporting.verdict_columns` name their headers), the
      choice, ``runtime_s`` (the outcome's wall clock) and ``finite`` (every seed's final
      fit stayed finite).
    """
    rows = reporting.comparison_rows(
        values, reference=reference, paired=paired, test_train_ratio=test_train_ratio
    )
    for row in rows:
        o = outcomes[row["method"]]
        shown = reporting.choice_counts(o.chosen_labels) or untuned
        row[choice] = shown if choices is None else choices.get(row["method"], untuned)
        row |= {"runtime_s": o.seconds, "finite": bool(np.all(o.finite))}
    return rows


def write_study(
    out: pathlib.Path,
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[tuple[str, str]],
    *,
    title: str,
    notes: Sequence[str] = (),
    digits: Mapping[str, int] | None = None,
    summary: Mapping[str, Any] | None = None,
    figures: Mapping[str, Callable[[pathlib.Path], Any]] | None = None,
    table: str = "table",
    json: str = "summary.json",
    log: Callable[[str], None] = print,
) -> str:
    """Writes a study's results to ``out`` and logs the table; returns the Markdown table.

    Args:
      out: the output folder (created if missing).
      rows, columns, title, notes, digits: the table
        (:func:`karula_jax.reporting.write_table`), written to ``out / table`` ``.md``
        and ``.csv``.
      summary: written as JSON to ``out / json`` (None: no JSON).
      figures: ``{file name: draw(path)}``, each called with ``out / name``.
      table, json: the file names.
      log: where the table and its notes go.
    """
    out = pathlib.Path(out)
    text = reporting.write_table(
        rows, columns, out / table, title=title, notes=notes, digits=digits
    )
    for name, plot in (figures or {}).items():
        plot(out / name)
    if summary is not None:
        reporting.write_json(dict(summary), out / json)
    log("\n" + text + "\n" + "\n".join(notes))
    return text


class Report(NamedTuple):
    """What a study adds to what :func:`run_study` writes (its ``report`` hook).

    Attributes:
      notes: lines under the table, before the ones :func:`run_study` adds.
      summary: entries added to the JSON summary.
      figures: ``{file name: draw(path)}``, each called with ``out / name``.
    """

    notes: Sequence[str] = ()
    summary: Mapping[str, Any] = {}
    figures: Mapping[str, Callable[[pathlib.Path], Any]] = {}


class StudyResult(NamedTuple):
    """What :func:`run_study` returns (and hands to a study's ``report``).

    Attributes:
      data: the :class:`StudyData`.
      methods: ``{name: Method}`` as run.
      outcomes: ``{name: CVOutcome}``.
      rows: the table rows (:func:`study_rows`); empty while the report is made.
      seconds: wall clock from the first draw to the end of the runs.
      summary: the JSON summary (empty while the report is made).
      member_kwargs: what the study's ``member_kwargs`` gave (``{name: [B, ...]}``).
      tuning: with ``Study.tuning_seeds``, the CV on the tuning draws: ``seeds``,
        ``grids`` (``{method: labels}``), ``chosen`` (labels), ``points``, ``cv_score``,
        ``projection`` (reports of the methods that project), ``embedding_converged``;
        else empty.
      values: every method's per-seed columns, ``{name: {column: [S]}}`` (the study's
        ``values``; the summary's ``"per_seed"``).
    """

    data: StudyData
    methods: dict[str, Method]
    outcomes: dict[str, CVOutcome]
    rows: list[dict]
    seconds: float
    summary: dict[str, Any]
    member_kwargs: dict[str, Any] = {}
    tuning: dict[str, Any] = {}
    values: dict[str, Any] = {}


class Study(NamedTuple):
    """A study for :func:`run_study`: everything that is particular to it.

    Attributes:
      title: the table's heading.
      config: the study's config (a dataclass; the JSON summary's ``"config"``).
      draw: ``draw(seed) -> Draw``.
      seeds, num_folds, num_rounds: ``S``, ``K >= 2`` (or 0: final fits only, every
        method with one grid point) and the rounds of every run.
      methods: ``methods(data) -> {name: Method}`` (:func:`build_methods`), in table order.
      params: the initial model of every run, or ``params(data) -> model``.
      eval_fn: ``eval_fn(client_params, evals) -> {metric: [n]}``: validation rows for the
        fold members, test rows for the final fits.
      score: validation metrics ``{metric: [S, K, G, n]}`` -> CV score ``[S, K, G]``,
        lower is better.
      values: ``values(name, outcome, data) -> {column: [S]}``, method ``name``'s
        measured columns.
      paired: the column of the paired difference with ``reference``.
      columns: ``(key, header)`` of the table (:func:`study_rows` names the keys).
      embed: keywords of :func:`karula_jax.embedding.dissimilarities`.
      member_kwargs: ``member_kwargs(data) -> {name: [B, ...]}``, member arguments
        besides ``D`` and ``labels`` (e.g. smoothness constants), or None.
      keys: the seeds' run keys ``[S]`` (default ``split(key(0), S)``), or
        ``keys(data) -> [S]`` (e.g. from ``data.seeds``).
      embed_keys, cluster_grid, normalize_D: of :func:`draw_study`; ``fold_keys``:
        ``fold_keys(seeds) -> [S]`` keys of :func:`draw_study`, or None (its default).
      tuning_seeds: if given, the grids are chosen on these separate draws instead (CV
        with ``num_folds`` folds; with several draws, the point of the lowest CV score
        averaged over them, :func:`pooled_choice`), and the
        ``seeds`` draws train final fits only, at the chosen points; the table's CV
        column then shows the choice and the summary's ``"tuning"`` holds the CV.
      report: ``report(result) -> Report``: the study's notes under the table, entries
        of the JSON summary and figures, from the :class:`StudyResult` (rows and summary
        still empty), or None.
      digits: decimals per column (default 3).
      options: further keywords of :func:`~karula_jax.protocol.compare` (``describe``,
        ``eval_data``, ``fold_weights``...; they override ``eval_fn`` and ``score``), or
        ``options(data) -> keywords`` where they depend on the data.
      json, table: the JSON summary's and the table's file names (without extension).
      command: the command line that ran the study, quoted in the last note with the
        runtime ("" for none).
      reference: the method the paired differences are taken against (its name in lower
        case then ``_minus`` names the paired columns, ``karula_minus`` by default).
      test_train_ratio: ``n_test / n_train`` where the seeds are overlapping random splits
        of one pool (Nadeau and Bengio's corrected variance in every interval and test,
        :func:`karula_jax.stats.t_interval`), or ``test_train_ratio(data) -> ratio``; 0 for
        independent seeds.
    """

    title: str
    config: Any
    draw: Callable[[int], Draw]
    seeds: int
    num_folds: int
    num_rounds: int
    methods: Callable[[StudyData], Mapping[str, Method]]
    params: Any
    eval_fn: Callable[[Any, Any], Mapping[str, Any]]
    score: Callable[[Mapping[str, np.ndarray]], np.ndarray]
    values: Callable[[str, CVOutcome, StudyData], Mapping[str, Any]]
    paired: str
    columns: Sequence[tuple[str, str]]
    embed: Mapping[str, Any]
    member_kwargs: Callable[[StudyData], Mapping[str, Any]] | None = None
    keys: jax.Array | None = None
    embed_keys: jax.Array | None = None
    cluster_grid: Sequence[int] = ()
    normalize_D: bool = False
    fold_keys: Callable[[Sequence[int]], jax.Array] | None = None
    tuning_seeds: Sequence[int] = ()
    report: Callable[[StudyResult], Report] | None = None
    digits: Mapping[str, int] | None = None
    options: Mapping[str, Any] | Callable[[StudyData], Mapping[str, Any]] | None = None
    json: str = "summary.json"
    table: str = "table"
    command: str = ""
    reference: str = "Karula"
    test_train_ratio: float | Callable[[StudyData], float] = 0.0


def study_data(
    study: Study,
    *,
    seeds: Sequence[int] | None = None,
    num_folds: int | None = None,
    log: Callable[[str], None] = print,
) -> StudyData:
    """The :class:`StudyData` of ``study`` (:func:`draw_study` with its settings) on
    ``seeds`` (default ``study.seeds``) with ``num_folds`` folds (default: the study's, 0
    with ``tuning_seeds``: final fits only)."""
    seeds = list(range(study.seeds)) if seeds is None else [int(s) for s in seeds]
    if num_folds is None:
        num_folds = 0 if study.tuning_seeds else study.num_folds
    return draw_study(
        study.draw,
        seeds,
        num_folds=num_folds,
        embed=study.embed,
        fold_keys=study.fold_keys(seeds) if study.fold_keys and num_folds else None,
        embed_keys=study.embed_keys,
        normalize_D=study.normalize_D,
        cluster_grid=study.cluster_grid,
        log=log,
    )


def _compare(study: Study, methods, data: StudyData, log, **extra) -> tuple[dict, dict]:
    """:func:`~karula_jax.protocol.compare` of ``methods`` on ``data`` with the study's
    keys, rounds, evaluation, member arguments and options (``extra`` last): ``({name:
    CVOutcome}, the study's member arguments)``."""
    keys = study.keys(data) if callable(study.keys) else study.keys
    more = dict(study.member_kwargs(data)) if study.member_kwargs else {}
    options = study.options(data) if callable(study.options) else study.options
    kw = dict(
        keys=jax.random.split(jax.random.key(0), len(data.seeds)) if keys is None else keys,
        num_rounds=study.num_rounds,
        eval_fn=study.eval_fn,
        score=study.score,
        member_kwargs=data.member_kwargs(**more),
        log=log,
    )
    params = study.params(data) if callable(study.params) else study.params
    return compare(methods, params, data.cv, **kw | dict(options or {}) | extra), more


def pooled_choice(method: Method, outcome: CVOutcome) -> CVOutcome:
    """``outcome`` with one choice for all its seeds: the grid point whose CV score,
    averaged over the seeds, is lowest (a non-finite score counts as ``inf``, so a point
    that diverged on one draw is not chosen while another is finite). Its edge and
    plateau marks are those of the pooled scores.

    Used on several tuning draws (:attr:`Study.tuning_seeds`): a step that is stable on
    one draw but diverges on another scores ``inf`` or near chance there, and drops out.
    """
    raw = np.asarray(outcome.cv_score, np.float64)  # [S, G]
    score = np.where(np.isfinite(raw), raw, np.inf).mean(axis=0)
    index = np.full(np.shape(outcome.chosen), int(np.argmin(score)))
    edge = np.asarray(method.edge(index), bool)
    plateau = np.zeros_like(edge)
    if method.edges is None:  # one-axis grid
        plateau = edge & ev.grid_plateau(index, np.broadcast_to(score, raw.shape))
    return outcome._replace(chosen=index, edge=edge & ~plateau, plateau=plateau)


def _tune(study: Study, methods: dict[str, Method], log) -> tuple[dict, dict, dict]:
    """The methods at the points CV chose on the study's tuning draws:
    ``(methods, {name: label}, tuning summary)``."""
    data = study_data(study, seeds=study.tuning_seeds, num_folds=study.num_folds, log=log)
    grids = {name: m for name, m in methods.items() if len(m.points()) > 1}
    outcomes, _ = _compare(study, grids, data, log, final_fits=False)
    if len(data.seeds) > 1:  # one choice from the scores pooled over the draws
        outcomes = {name: pooled_choice(grids[name], o) for name, o in outcomes.items()}
    fixed, points = fix_choices(methods, outcomes)
    labels = {name: methods[name].labels()[0] for name in points}  # one-point grids
    labels |= {name: o.chosen_labels[0] for name, o in outcomes.items()}
    summary = {
        "seeds": list(data.seeds),
        "grids": {m: g.labels() for m, g in grids.items()},
        "chosen": {m: o.chosen_labels for m, o in outcomes.items()},
        "points": points,
        "cv_score": {m: o.cv_score for m, o in outcomes.items()},
        "projection": {m: o.diagnostics for m, o in outcomes.items() if o.diagnostics},
        "embedding_converged": bool(data.converged.all()),
    }
    return fixed, labels, summary


def run_study(study: Study, out: pathlib.Path, *, log: Callable[[str], None] = print):
    """Runs ``study`` end to end and writes ``table.{md,csv}``, the JSON summary
    (``study.json``) and the figures of ``study.report`` to ``out``.

    The JSON summary holds the config, every method's grid labels, CV choice per seed and
    CV scores, its per-seed values (``"per_seed"``: ``{method: {column: [S]}}``), whether
    every embedding converged, the projection's report of every method that projects
    (worst certified gap, unconverged rounds; also a note under the table), the rows, the
    wall clock and CPU time (``total_seconds``, ``cpu_seconds``; also the last note, with
    ``study.command``), the devices, the jax version, the run's provenance
    (:func:`karula_jax.provenance.run_provenance`) and the report's entries. When ``out``
    holds a results page (``README.md``), its run header is rewritten
    (:func:`karula_jax.provenance.stamp_page`).

    Returns:
      The :class:`StudyResult`.
    """
    t0, cpu0 = time.perf_counter(), time.process_time()
    facts = provenance.run_provenance()  # the code that runs: read before it runs
    data = study_data(study, log=log)
    methods = dict(study.methods(data))
    log(f"every embedding converged: {bool(data.converged.all())}")
    log("CV grids: " + describe_grids(methods))
    labels, tuning = None, {}
    if study.tuning_seeds:
        methods, labels, tuning = _tune(study, methods, log)
    outcomes, more = _compare(study, methods, data, log)
    values = {name: study.values(name, o, data) for name, o in outcomes.items()}
    ratio = study.test_train_ratio
    ratio = float(ratio(data) if callable(ratio) else ratio)
    rows = study_rows(
        values,
        outcomes,
        paired=study.paired,
        reference=study.reference,
        choices=labels,
        test_train_ratio=ratio,
    )
    seconds = time.perf_counter() - t0
    result = StudyResult(data, methods, outcomes, [], seconds, {}, more, tuning, values)
    # Every method whose runs projected reports its worst certified gap and the rounds
    # that did not converge, next to the table (its runs here; with tuning draws, their
    # CV's report too).
    projection = {m: o.diagnostics for m, o in outcomes.items() if o.diagnostics}
    report = study.report(result) if study.report else Report()
    if not isinstance(report, Report):
        raise TypeError(f"a study's report must return a protocol.Report, got {type(report)}")
    notes = list(report.notes)
    runs = "all CV and final runs" if data.cv.num_folds else "the seeds' runs"
    notes += [f"{m}'s {report} ({runs})." for m, report in projection.items()]
    notes += [
        f"{m}'s {report} (CV on the tuning draws)."
        for m, report in tuning.get("projection", {}).items()
    ]
    cpu = time.process_time() - cpu0
    command = f" Command: `{study.command}`." if study.command else ""
    notes += [f"Runtime {result.seconds:.0f} s wall, {cpu:.0f} s CPU (all threads).{command}"]
    summary = {
        "config": dataclasses.asdict(study.config),
        "grid": {m: o.labels for m, o in outcomes.items()},
        "chosen": labels or {m: o.chosen_labels for m, o in outcomes.items()},
        "cv_score": {m: o.cv_score for m, o in outcomes.items() if o.cv_score is not None},
        "per_seed": values,
        "test_train_ratio": ratio,
        **({"tuning": tuning} if tuning else {}),
        "embedding_converged": bool(data.converged.all()),
        "projection": projection,
        "rows": rows,
        "total_seconds": result.seconds,
        "cpu_seconds": cpu,
        "devices": [str(d) for d in jax.devices()],
        "jax_version": jax.__version__,
        "provenance": facts,
    } | dict(report.summary)
    write_study(
        out,
        rows,
        study.columns,
        title=study.title,
        notes=notes,
        digits=study.digits,
        summary=summary,
        figures=report.figures,
        table=study.table,
        json=study.json,
        log=log,
    )
    header = provenance.provenance_header(summary["provenance"], seconds=result.seconds)
    if provenance.stamp_page(pathlib.Path(out) / "README.md", header):
        log(f"updated the run header of {pathlib.Path(out) / 'README.md'}")
    log(f"wrote {out} in {result.seconds:.0f}s")
    return result._replace(rows=rows, summary=summary)


def _logit(params, x):
    return x @ params["w"] + params["b"]


def _logistic_metrics(params, data):
    """Each client's accuracy and log-loss with its own model, ``[n]`` each."""
    return {"acc": ev.accuracy(_logit, params, data), "nll": ev.log_loss(_logit, params, data)}


def logistic_t_grid(data: StudyData, lam: float, *, num: int = 5) -> tuple[float, ...]:
    """Karula's ``t`` grid of a logistic study from its data: ``0``, ``num`` points of
    :func:`~karula_jax.protocol.member_t_grid` and ``inf``. Each member's clients train
    alone on its own training rows (500 steps at ``1 / L_i``); the points run from a
    hundredth of the ratio 90% of the pooled pairs exceed (those pairs pulled to within
    10% of their own distance) to the largest ratio (no pair binds)."""
    train = data.cv.train
    L = np.stack(
        [
            linear_smoothness(
                ClientData(*(np.asarray(a[b]) for a in train)),
                lam,
                intercept=True,
                curvature=0.25,
                float64=True,
            )
            for b in range(train.counts.shape[0])
        ]
    )
    params = linear_params(int(train.x.shape[-1]))
    return member_t_grid(logistic_loss(lam), params, train, data.D, L, num=num, limits=True)


def logistic_study(
    draw: Callable[[int], Draw],
    config: Any,
    *,
    title: str,
    seeds: int,
    num_folds: int,
    num_rounds: int,
    lam: float,
    methods: Sequence[str],
    clients_per_round: int,
    local_steps: int = 5,
    grids: Mapping[str, Any] | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    rates: Mapping[str, Callable[..., Any]] | None = None,
    embed: Mapping[str, Any] | None = None,
    client: str = "client",
    client_names: Sequence[str] = (),
    **fields,
) -> Study:
    """A :class:`Study` of binary logistic regression (labels 0/1) on any clients.

    Every method starts from zero weights, takes full gradients and its step from the
    smoothness of the logistic losses (:func:`~karula_jax.protocol.smoothness_rates`
    with factors 3/8, 1/10, 1/2, 1/2, from ``L_f`` and ``L_max`` of
    :func:`~karula_jax.protocol.smoothness_constants`); grids are chosen by K-fold CV on
    the mean validation log-loss over the clients. The table: mean per-client test
    accuracy (paired with Karula), pooled test accuracy, mean per-client test log-loss,
    each named client's accuracy, the CV choice and the runtime.

    Args:
      draw, config, title, seeds, num_folds, num_rounds: of the :class:`Study`.
      lam: the L2 penalty of the loss.
      methods: the registered methods to run (:func:`selected`: registry order, Karula
        always).
      clients_per_round, local_steps: of every method that takes them.
      grids, options: of :func:`~karula_jax.protocol.build_methods`; Karula's grid
        ``None`` (the default) is drawn from the data (:func:`logistic_t_grid`: the
        ``0``, ``inf`` limits and five points from where the pairs of the clients' own
        models all bind hard to where none binds).
      rates: the rate rules (default: the smoothness rules above).
      embed: keywords of the embedding (default ``num_classes=2``).
      client: what a client is, in the column headers ("hospital").
      client_names: a column of test accuracy for each (in the clients' order).
      **fields: further :class:`Study` fields (``report``, ``embed_keys``...).
    """
    names = selected(methods)

    def build(data: StudyData) -> dict[str, Method]:
        n = int(data.cv.train.counts.shape[1])
        factors = dict(karula=3 / 8, fedavg=1 / 10, ifca=1 / 2, personal=1 / 2)
        given = dict(grids or {})
        if "Karula" in names and given.get("Karula") is None:
            given["Karula"] = logistic_t_grid(data, lam)
        return build_methods(
            names,
            loss=logistic_loss(lam),
            rates=smoothness_rates(**factors, num_clients=n) if rates is None else rates,
            grids=given,
            options=options,
            clients_per_round=clients_per_round,
            batch_size=int(data.cv.train.x.shape[2]),  # full gradients
            local_steps=local_steps,
            num_clients=n,
        )

    def values(_: str, o: CVOutcome, data: StudyData) -> dict[str, np.ndarray]:
        acc, counts = o.metrics["acc"], np.asarray(data.cv.final(data.cv.evals).counts, float)
        v = {"test_acc": acc.mean(axis=1), "pooled_acc": (acc * counts).sum(1) / counts.sum(1)}
        v["test_logloss"] = o.metrics["nll"].mean(axis=1)
        return v | {f"acc_{c}": acc[:, j] for j, c in enumerate(client_names)}

    b = reporting.banded
    columns = [("method", "method"), ("test_acc", b(f"mean per-{client} test acc."))]
    columns += [
        ("pooled_acc", b("pooled test acc.")),
        ("karula_minus", b("Karula minus method (paired)")),
    ]
    columns += reporting.verdict_columns("karula_minus")
    columns += [("test_logloss", b(f"mean per-{client} test log-loss"))]
    columns += [(f"acc_{c}", b(c)) for c in client_names]
    columns += [("cv_choice", "CV choice"), ("runtime_s", "runtime (s)")]
    describe = lambda o: f"mean per-{client} test accuracy {o.metrics['acc'].mean():.3f}"
    smoothness = lambda data: dict(
        zip(("L_f", "L_max"), smoothness_constants(data.cv.train, lam, logistic=True), strict=True)
    )
    return Study(
        title=title,
        config=config,
        draw=draw,
        seeds=seeds,
        num_folds=num_folds,
        num_rounds=num_rounds,
        methods=build,
        params=lambda data: linear_params(int(data.cv.train.x.shape[-1])),
        eval_fn=_logistic_metrics,
        score=lambda m: m["nll"].mean(-1),
        values=values,
        paired="test_acc",
        columns=columns,
        embed={"num_classes": 2} | dict(embed or {}),
        member_kwargs=smoothness,
        digits={"runtime_s": 1},
        options={"describe": describe},
    )._replace(**fields)
