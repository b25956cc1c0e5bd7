"""A comparison's table and figure in one call: :func:`write_comparison`.

:func:`~karula_jax.protocol.compare` returns ``{name: CVOutcome}``; this module turns it
into what the studies write: a table (CSV and Markdown, through
:func:`karula_jax.reporting.comparison_rows` and :func:`karula_jax.reporting.write_table`:
mean and interval over the seeds per method, the paired difference with a reference
method, the CV choices, the training loss at the end and the share of seeds whose loss
flattened) and a figure of the metric and the training loss over the rounds, one line
and band per method.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from karula_jax import reporting, stats
from karula_jax.evaluation.curves import FLAT_TOL, FLAT_WINDOW
from karula_jax.protocol.cv import CVOutcome

__all__ = ["comparison_values", "write_comparison"]

# The zoomed panel is drawn when the methods' final means span less than this share of
# the metric's axis: the full axis would show them as one line.
ZOOM_SHARE = 0.1


def _per_seed(values: np.ndarray) -> np.ndarray:
    """A metric ``[S]`` or ``[S, n]`` (per client) as ``[S]``: the mean over clients."""
    v = np.asarray(values, np.float64)
    return v.reshape(v.shape[0], -1).mean(-1)


def _final_loss(outcome: CVOutcome) -> np.ndarray:
    """The mean training loss over the last ``FLAT_WINDOW`` of the rounds, ``[S]``."""
    loss = np.asarray(outcome.train_loss, np.float64)
    w = max(1, round(FLAT_WINDOW * loss.shape[-1]))
    return loss[:, -w:].mean(-1)


def comparison_values(
    outcomes: Mapping[str, CVOutcome], metric: str
) -> dict[str, dict[str, np.ndarray]]:
    """``{method: {column: [S]}}``: ``metric`` averaged over the clients and, where the
    outcomes recorded it, ``final_train_loss`` (the mean training loss over the last
    tenth of the rounds).

    Raises:
      ValueError: an outcome without ``metric`` among its metrics.
    """
    values = {}
    for name, o in outcomes.items():
        if metric not in o.metrics:
            raise ValueError(f"metric: {name}'s outcome has {sorted(o.metrics)}, not {metric!r}")
        values[name] = {metric: _per_seed(o.metrics[metric])}
        if all(x.train_loss is not None for x in outcomes.values()):
            values[name]["final_train_loss"] = _final_loss(o)
    return values


def write_comparison(
    outcomes: Mapping[str, CVOutcome],
    out_dir,
    *,
    reference: str = "Karula",
    metric: str = "acc",
    label: str | None = None,
    title: str = "Comparison",
    notes: Sequence[str] = (),
    digits: int = 3,
    log: Callable[[str], None] = print,
) -> str:
    """Writes the table and figure of a :func:`~karula_jax.protocol.compare` result.

    Files in ``out_dir`` (created if missing): ``table.csv`` and ``table.md`` (one row per
    method: ``metric`` averaged over the clients, mean and interval over the seeds; the
    paired difference ``reference - method`` on the same seeds with its interval and
    verdict, as :func:`karula_jax.reporting.comparison_rows` computes them; the mean
    training loss over the last tenth of the rounds; ``flattened``, the share of seeds
    whose training loss flattened, :attr:`CVOutcome.flattened`; how often each grid
    point was chosen; the wall clock) and ``curves.png`` (per method, mean over seeds
    with its band: ``metric`` over the rounds when the outcomes carry curves, i.e.
    ``compare(..., eval_every_chunk=True)``, and the training loss of every round; a
    zoomed panel of the metric's last third of the rounds when the methods' final means
    span less than a tenth of its axis).

    Args:
      outcomes: ``{name: CVOutcome}`` of :func:`~karula_jax.protocol.compare` (at least 2
        seeds: the intervals need them).
      out_dir: the output folder.
      reference: the method the paired differences are taken against (one of
        ``outcomes``).
      metric: the metric of the table and figure, a key of every outcome's ``metrics``
        (``[S, n]`` per client or ``[S]``).
      label: the metric's name in headers (default ``metric``).
      title: the Markdown table's heading.
      notes: lines under the table, before the ones this function adds.
      digits: decimals of the metric's columns.
      log: where the table and the names of the methods that did not flatten go.

    Returns:
      The Markdown table.

    Raises:
      ValueError: ``reference`` not in ``outcomes``; fewer than 2 seeds; an outcome
        without ``metric``.
    """
    if reference not in outcomes:
        raise ValueError(f"reference: {reference!r} is not one of {list(outcomes)}")
    seeds = {int(np.shape(o.chosen)[0]) for o in outcomes.values()}
    if min(seeds) < 2:
        raise ValueError(f"write_comparison needs >= 2 seeds for its intervals, got {seeds}")
    out = pathlib.Path(out_dir)
    label = label or metric
    values = comparison_values(outcomes, metric)
    rows = reporting.comparison_rows(values, reference=reference, paired=metric)
    for row in rows:
        o = outcomes[row["method"]]
        row["cv_choice"] = reporting.choice_counts(o.chosen_labels)
        row["flattened"] = "-" if o.flattened is None else float(np.mean(o.flattened))
        row["runtime_s"] = float(o.seconds)
    paired = reference.lower() + "_minus"
    columns = [("method", "method"), (metric, f"{label} (mean over clients)")]
    columns += [(paired, f"{reference} minus method")]
    columns += _verdict_columns(rows, paired)
    if "final_train_loss" in rows[0]:
        columns += [("final_train_loss", "training loss, last tenth of rounds")]
    columns += [("flattened", "flattened (share of seeds)"), ("cv_choice", "CV choice")]
    columns += [("runtime_s", "runtime (s)")]
    S = min(seeds)
    rounds = max((o.train_loss.shape[-1] for o in outcomes.values() if o.train_loss is not None),
                 default=0)  # fmt: skip
    under = [r["method"] for r in rows if isinstance(r["flattened"], float) and r["flattened"] < 1]
    notes = [
        *notes,
        f"{S} seeds; mean and its interval over the seeds (`karula_jax.stats`); "
        f"`{paired}`: {reference} minus the method on the same seeds (same data, folds "
        "and draws). CV choice: how often each grid point was chosen.",
        f"flattened: the share of seeds whose training loss flattened by round {rounds} "
        f"(the mean over the last {FLAT_WINDOW:.0%} of the rounds within {FLAT_TOL:.0%} "
        "of the whole decrease, plus noise, of the mean over the tenth before it; "
        "`karula_jax.evaluation.curves.round_loss_flattened`).",
    ]
    if under:
        notes.append(
            f"Not flattened in every seed: {', '.join(under)}; compared under-trained: "
            "raise num_rounds."
        )
    digit_map = {metric: digits, paired: digits, "final_train_loss": 3, "flattened": 2}
    digit_map |= {"runtime_s": 0}
    text = reporting.write_table(
        rows, columns, out / "table", title=title, notes=notes, digits=digit_map
    )
    _figure(outcomes, metric, label, out / "curves.png", title)
    log("\n" + text + "\n" + "\n".join(notes))
    return text


def _verdict_columns(rows, paired: str) -> list[tuple[str, str]]:
    """The paired column's verdict columns the rows hold (decided, p-values), headed as
    :func:`karula_jax.reporting.verdict_columns` heads them where it exists."""
    named = getattr(reporting, "verdict_columns", None)
    if named is not None:
        return [(k, h) for k, h in named(paired) if k in rows[0]]
    skip = {paired, paired + "_2se"}
    keys = [k for k in rows[0] if k.startswith(paired + "_") and k not in skip]
    return [(k, k.removeprefix(paired + "_")) for k in keys]


def _band(values) -> tuple[np.ndarray, np.ndarray]:
    """Mean and interval half width over the seeds (axis 0) at every round."""
    v = np.asarray(values, np.float64)
    interval = getattr(stats, "t_interval", stats.mean_and_se)  # the table's intervals
    pairs = [interval(v[:, t]) for t in range(v.shape[1])]
    return np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])


def _figure(outcomes, metric: str, label: str, path: pathlib.Path, title: str) -> None:
    """``curves.png``: the metric over rounds (with curves), its zoom where the methods
    are close, and the training loss of every round."""
    from matplotlib.figure import Figure  # no pyplot: any backend, a notebook's too

    plots = []  # (title, y label, {method: (x [T], mean [T], half width [T])}, log scale)
    if all(np.shape(o.curves.get(metric, ()))[1:2] > (1,) for o in outcomes.values()):
        lines = {n: (np.asarray(o.rounds), *_band(_curve(o.curves[metric])))
                 for n, o in outcomes.items()}  # fmt: skip
        plots.append((f"{label} over rounds", label, lines, False))
        low = min(float(np.min(m - h)) for _, m, h in lines.values())
        high = max(float(np.max(m + h)) for _, m, h in lines.values())
        finals = [float(m[-1]) for _, m, _ in lines.values()]
        if max(finals) - min(finals) < ZOOM_SHARE * (high - low):
            tail = lambda x: x >= x[-1] - (x[-1] - x[0]) / 3
            zoom = {n: tuple(a[tail(x)] for a in (x, m, h)) for n, (x, m, h) in lines.items()}
            plots.append(("zoom: the last third of the rounds", label, zoom, False))
    if all(o.train_loss is not None for o in outcomes.values()):
        loss = {n: (np.arange(1, o.train_loss.shape[-1] + 1), *_band(o.train_loss))
                for n, o in outcomes.items()}  # fmt: skip
        plots.append(("training loss of every round", "training loss (participants)", loss, True))
    if not plots:
        return
    fig = Figure(figsize=(5.2 * len(plots), 3.8))
    axes = fig.subplots(1, len(plots), squeeze=False)[0]
    for ax, (heading, ylabel, lines, log) in zip(axes, plots, strict=True):
        for name, (x, m, h) in lines.items():
            (line,) = ax.plot(x, m, label=name, lw=1.4)
            ax.fill_between(x, m - h, m + h, color=line.get_color(), alpha=0.2)
        ax.set(xlabel="round", ylabel=ylabel, title=heading, yscale="log" if log else "linear")
        ax.grid(alpha=0.3)
    axes[0].legend(frameon=False, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def _curve(metric) -> np.ndarray:
    """A metric's curves ``[S, T, ...]`` as ``[S, T]``: the mean over the clients."""
    c = np.asarray(metric, np.float64)
    return c.reshape(c.shape[0], c.shape[1], -1).mean(-1)
