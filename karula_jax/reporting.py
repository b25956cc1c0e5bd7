"""What a study reads from its command line and writes: tables, JSON summaries, figures.

* :func:`cli` reads a config dataclass from the command line (``--field-name VALUE``).
* A table is written twice (:func:`write_table`): a CSV with one number per cell (a
  measured column ``k`` has its mean in ``k`` and its half-width in ``k_2se``) and
  Markdown with ``mean ± half-width``. :func:`mean_se_columns`, :func:`paired_columns` and
  :func:`comparison_rows` fill such rows from per-seed values ``[S]`` with the decision
  rule of :mod:`karula_jax.stats`: the half-width of a 95% Student-t interval (headers
  say ``± 95% t``, :func:`banded`), the paired t-test's p-value, Holm's correction over
  the table's comparisons, "decided" when the adjusted p-value is below 0.05
  (:func:`verdict_columns` are their headers).
* :func:`plot_heatmaps`, :func:`plot_curves`, :func:`plot_lines`,
  :func:`plot_client_triplet` write PNGs; :func:`markdown_table` formats rows written as
  text. (A benchmark's page: :mod:`karula_jax.benchmarking`.)

Every writer creates the missing folders of its path.

Host-side numpy; statistics come from :mod:`karula_jax.stats`. matplotlib (the
``experiments`` extra) is imported only when a figure is drawn.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import inspect
import json
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from karula_jax.stats import ALPHA, decide, format_mean_se, mean_and_se, paired_test, t_interval

__all__ = [
    "T_BAND",
    "banded",
    "choice_counts",
    "cli",
    "client_triplet",
    "comparison_rows",
    "grid_option",
    "keyword_option",
    "markdown_table",
    "mean_se_columns",
    "paired_columns",
    "plot_client_triplet",
    "plot_curves",
    "plot_heatmaps",
    "plot_lines",
    "verdict_columns",
    "write_json",
    "write_table",
]


# An empty tuple default is read by its annotation.
_TUPLE_TYPES = {"tuple[float,...]": float, "tuple[int,...]": int, "tuple[str,...]": str}


def _option_type(field: dataclasses.Field, default: Any):
    """How a config field is read from the command line, or None if it is not offered."""
    if isinstance(default, tuple) and default and isinstance(default[0], int | float | str):
        kind = type(default[0])
        return lambda text: tuple(kind(v) for v in text.split(","))
    if default == () and (kind := _TUPLE_TYPES.get(str(field.type).replace(" ", ""))):
        return lambda text: tuple(kind(v) for v in text.split(","))
    if isinstance(default, int | float | str) and not isinstance(default, bool):
        return type(default)
    if default is None and "float" in str(field.type):
        return float
    return None


def grid_option(text: str) -> tuple[str, tuple]:
    """Parses ``"NAME=V1,V2,..."`` (a method's CV grid on the command line) into ``(NAME,
    values)``: a value with neither ``.`` nor an exponent is an int, others floats
    (``inf`` too); ``NAME=`` alone is the empty grid (a study's "from the data")."""
    name, sep, values = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=V1,V2,... (a method's grid), got {text!r}")

    def number(v: str):
        v = v.strip()
        try:
            return int(v) if v.lstrip("+-").isdigit() else float(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"grid of {name!r}: {v!r} is not a number") from None

    return name.strip(), tuple(number(v) for v in values.split(",") if v.strip())


def cli(config_type, argv, *, quick, description: str = "", out: pathlib.Path, **extra):
    """Reads a config dataclass from the command line: ``--field-name VALUE`` per field.

    Numbers and strings take one value, tuples of them comma-separated values, a bool
    field defaulting to False is a flag; a field named ``grids`` (``{method name:
    grid}``) takes ``--grid NAME=V1,V2,...`` once per method, each replacing that
    method's entry (:func:`grid_option`); ``--quick`` starts from ``quick(config_type())``
    and ``--out`` names the output. ``extra``: further options, ``name=argparse keywords``.

    Returns:
      ``(config, namespace)``; the namespace holds ``out``, ``quick`` and the extras.
    """
    p = argparse.ArgumentParser(description=description.splitlines()[0] if description else None)
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    p.add_argument("--out", type=pathlib.Path, default=out, help=f"output (default {out})")
    for name, options in extra.items():
        p.add_argument("--" + name.replace("_", "-"), **options)
    fields = {}
    for f in dataclasses.fields(config_type):
        default = f.default if f.default is not dataclasses.MISSING else None
        flag = "--" + f.name.replace("_", "-")
        if f.name == "grids":
            p.add_argument(
                "--grid",
                dest="grid_entries",
                type=grid_option,
                action="append",
                default=None,
                metavar="NAME=V1,V2",
                help="a method's CV grid (repeat per method), e.g. --grid Karula=1,10,inf",
            )
            continue
        if isinstance(default, bool) and not default:
            p.add_argument(flag, action="store_true", default=None)
        elif (kind := _option_type(f, default)) is not None:
            p.add_argument(flag, type=kind, default=None, metavar=f.name.upper())
        else:
            continue
        fields[f.name] = f
    args = p.parse_args(argv)
    cfg = quick(config_type()) if args.quick else config_type()
    changes = {k: getattr(args, k) for k in fields if getattr(args, k) is not None}
    if getattr(args, "grid_entries", None):
        changes["grids"] = dict(cfg.grids) | dict(args.grid_entries)
    cfg = dataclasses.replace(cfg, **changes)
    if getattr(cfg, "seeds", 2) < 2:
        p.error("--seeds must be >= 2 (standard errors need two seeds)")
    return cfg, args


T_BAND = "± 95% t"  # what the ± of a table's measured column is (:func:`banded`)


def banded(header: str) -> str:
    """``header`` marked as a mean ± the 95% Student-t half-width: ``"acc. (± 95% t)"``
    (unchanged if it says so already)."""
    return header if T_BAND in header else f"{header} ({T_BAND})"


def verdict_columns(key: str) -> list[tuple[str, str]]:
    """The ``(key, header)`` columns of the verdict on the paired column ``key``
    (:func:`comparison_rows`): decided, the paired t-test's p and Holm's adjusted p."""
    return [
        (key + "_decided", f"decided (Holm p < {ALPHA:g})"),
        (key + "_p", "p (paired t)"),
        (key + "_p_holm", "Holm p"),
    ]


def mean_se_columns(row: dict, *, test_train_ratio: float = 0.0, **values) -> dict:
    """Adds ``row[k]`` (mean over seeds) and ``row[k + "_2se"]``, the half-width of its
    95% Student-t interval (:func:`karula_jax.stats.t_interval`), for every ``k=[S]
    array``; ``test_train_ratio``: the corrected variance of overlapping splits."""
    for key, v in values.items():
        row[key], row[key + "_2se"] = t_interval(v, test_train_ratio=test_train_ratio)
    return row


def paired_columns(
    row: dict, key: str, reference, values, *, test_train_ratio: float = 0.0
) -> dict:
    """Adds the paired difference ``reference - values`` over seeds (``[S]`` each).

    ``row[key]`` ± ``row[key + "_2se"]`` is the difference and its 95% t half-width,
    ``row[key + "_p"]`` the paired t-test's two-sided p-value
    (:func:`karula_jax.stats.paired_test`, ``test_train_ratio`` as there), and
    ``row[key + "_decided"]`` "yes" when that p-value is below 0.05 (a family of one:
    :func:`comparison_rows` corrects for a table's several comparisons), "no" otherwise,
    "-" for the reference itself (identical values; its p-value "-")."""
    test = paired_test(reference, values, test_train_ratio=test_train_ratio)
    same = np.array_equal(np.asarray(reference), np.asarray(values))
    row[key], row[key + "_2se"] = test.diff, test.half_width
    row[key + "_p"] = "-" if same else float(test.p_value)
    row[key + "_decided"] = "-" if same else ("yes" if test.p_value < ALPHA else "no")
    return row


def choice_counts(labels: Sequence[str]) -> str:
    """How often each label was chosen, ``"t=1 x3, t=3 x2"`` (sorted; empty labels skipped)."""
    return ", ".join(f"{v} x{list(labels).count(v)}" for v in sorted(set(labels) - {""}))


def comparison_rows(
    values: Mapping[str, Mapping[str, Any]],
    *,
    reference: str,
    paired: str,
    test_train_ratio: float = 0.0,
) -> list[dict]:
    """One table row per method from its per-seed values, with the table's verdicts.

    Every column is a mean ± its 95% t half-width (:func:`mean_se_columns`); the paired
    difference ``reference - method`` of column ``paired`` goes into ``key =
    <reference>_minus`` (lower case; :func:`paired_columns`). The p-values of all rows
    but the reference's form one family: ``key + "_p_holm"`` holds Holm's adjusted
    p-value and ``key + "_decided"`` is "yes" where it is below 0.05
    (:func:`karula_jax.stats.decide`), "-" for the reference.

    Args:
      values: ``{method: {column: [S] values}}``, every method with the same columns.
      reference: the method the others are compared with.
      paired: the column compared.
      test_train_ratio: ``n_test / n_train`` where the seeds are overlapping random
        splits of one pool (the corrected variance, :func:`karula_jax.stats.t_interval`);
        0 for independent seeds.

    Returns:
      Rows ``{"method": name, column: mean, column + "_2se": half-width, key, key +
      "_2se", key + "_p", key + "_p_holm", key + "_decided", ...}`` in the order of
      ``values``.

    Raises:
      ValueError: ``reference`` is not a method of ``values``.
    """
    if reference not in values:
        raise ValueError(f"reference {reference!r} is not one of the methods {list(values)}")
    key, ref = reference.lower() + "_minus", values[reference][paired]
    rows, tested = [], []
    for name, v in values.items():
        row = mean_se_columns({"method": name}, test_train_ratio=test_train_ratio, **v)
        row = paired_columns(row, key, ref, v[paired], test_train_ratio=test_train_ratio)
        if name == reference:
            row[key + "_p"] = row[key + "_p_holm"] = row[key + "_decided"] = "-"
        else:  # a method identical to the reference is a comparison too: a tie, p = 1
            row[key + "_p"] = 1.0 if row[key + "_p"] == "-" else row[key + "_p"]
            tested.append(row)
        rows.append(row)
    verdict = decide([r[key + "_p"] for r in tested])
    for row, adjusted, decided in zip(tested, verdict.adjusted, verdict.decided, strict=True):
        row[key + "_p_holm"] = float(adjusted)
        row[key + "_decided"] = "yes" if decided else "no"
    return rows


def keyword_option(fn: Callable, exclude: Sequence[str] = ()) -> Callable[[str], tuple]:
    """An argparse ``type`` reading ``NAME=VALUE`` for a keyword of ``fn``.

    ``VALUE`` is a number or comma-separated numbers (a tuple), integers where the
    keyword's default is an integer. Keywords in ``exclude`` are refused.

    Returns:
      ``parse(text) -> (name, value)``.
    """
    params = inspect.signature(fn).parameters
    allowed = sorted(set(params) - set(exclude))

    def parse(text: str) -> tuple[str, Any]:
        name, sep, value = text.partition("=")
        if not sep or name not in allowed:
            raise argparse.ArgumentTypeError(f"expected NAME=VALUE with NAME in {allowed}")
        try:
            numbers = tuple(float(v) for v in value.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: expected numbers, got {value!r}") from None
        if isinstance(params[name].default, int):
            numbers = tuple(int(v) for v in numbers)
        return name, numbers if len(numbers) > 1 else numbers[0]

    return parse


def _writable(path) -> pathlib.Path:
    """``path`` as a Path whose parent folder exists (created with its parents if needed)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[tuple[str, str]],
    path: pathlib.Path,
    *,
    title: str = "",
    notes: Sequence[str] = (),
    digits: Mapping[str, int] | None = None,
) -> str:
    """Writes rows to ``<path>.csv`` and ``<path>.md``; returns the Markdown table alone.

    Args:
      rows: one mapping per row; a measured key ``k`` comes with ``k + "_2se"`` (shown
        as ``mean ± half-width``); a float under a key ending in ``_p`` or ``_p_holm``
        is a p-value, shown with 3 decimals (``< 0.001`` below).
      columns: ``(key, header)`` pairs in display order.
      path: the two files' path without suffix (``out / "table"``); missing folders
        are created.
      title: heading of the Markdown file.
      notes: lines under the Markdown table.
      digits: decimals per key (default 3).
    """
    digits = dict(digits or {})
    fields = []
    for key, _ in columns:
        fields += [key] + ([key + "_2se"] if any(key + "_2se" in r for r in rows) else [])
    with open(_writable(f"{path}.csv"), "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: r.get(k, "") for k in fields} for r in rows)

    def cell(r, key):
        v, d = r.get(key, ""), digits.get(key, 3)
        if key + "_2se" in r:
            return format_mean_se(v, r[key + "_2se"], digits=d)
        if key.endswith(("_p", "_p_holm")) and isinstance(v, float | np.floating):
            return "< 0.001" if v < 0.001 else f"{v:.3f}"
        return f"{v:.{d}f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r, k) for k, _ in columns) + " |" for r in rows]
    table = "\n".join(lines)
    parts = ([f"# {title}", ""] if title else []) + [table] + ([""] + list(notes) if notes else [])
    _writable(f"{path}.md").write_text("\n".join(parts) + "\n")
    return table


def markdown_table(head: str, rows: list[str]) -> str:
    """A markdown table from a header and rows written as ``a | b | c`` (no outer bars)."""
    rule = "|" + "---|" * (head.count("|") + 1)
    return "\n".join([f"| {head} |", rule, *(f"| {row} |" for row in rows)])


def write_json(obj: Any, path: pathlib.Path) -> None:
    """Writes ``obj`` as indented JSON (numpy scalars and arrays become lists); missing
    folders of ``path`` are created."""

    def default(o):
        if isinstance(o, np.ndarray | np.generic):
            return o.tolist()
        raise TypeError(f"not JSON serializable: {type(o).__name__}")

    _writable(path).write_text(json.dumps(obj, indent=2, default=default) + "\n")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_heatmaps(matrices, titles, path, *, suptitle: str = "") -> None:
    """Side-by-side heatmaps of square matrices (one colour scale per panel) as a PNG."""
    plt = _pyplot()
    k = len(matrices)
    fig, axes = plt.subplots(1, k, figsize=(4.6 * k, 4.2), constrained_layout=True)
    for ax, mat, title in zip(np.atleast_1d(axes), matrices, titles, strict=True):
        im = ax.imshow(np.asarray(mat), cmap="viridis", interpolation="nearest")
        ax.set(title=title, xlabel="client j", ylabel="client i")
        ax.title.set_fontsize(10)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    if suptitle:
        fig.suptitle(suptitle, fontsize=11)
    fig.savefig(_writable(path), dpi=120)
    plt.close(fig)


def plot_curves(rounds, curves, path, *, panels, title: str | None = None) -> None:
    """Per-method curves: mean over seeds with a ±2 SE band.

    Args:
      rounds: x values ``[T]``.
      curves: ``curves[method][metric]`` of shape ``[S, T]`` (``S >= 2`` seeds).
      path: PNG to write.
      panels: ``(metric, axis label)`` per subplot.
      title: figure title.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False)
    for ax, (metric, label) in zip(axes[0], panels, strict=True):
        for method, c in curves.items():
            m, half = mean_and_se(c[metric])
            (line,) = ax.plot(rounds, m, label=method, lw=1.6)
            ax.fill_between(rounds, m - half, m + half, color=line.get_color(), alpha=0.2)
        ax.set(xlabel="round", ylabel=label)
        ax.grid(alpha=0.3)
    axes[0][0].legend(frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(_writable(path), dpi=130)
    plt.close(fig)


def plot_lines(x, panels, path, *, xlabel: str, ylabel: str, log: bool = True, title=None):
    """One subplot per panel, one line per label, no bands (deterministic curves).

    Args:
      x: x values ``[T]``.
      panels: ``{panel title: {label: y of shape [T]}}``.
      path: PNG to write (folders are created).
      xlabel, ylabel: axis labels; log: log-log axes.
      title: figure title.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False)
    for ax, (name, lines) in zip(axes[0], panels.items(), strict=True):
        for label, y in lines.items():
            ax.plot(x, y, label=label, lw=1.6)
        if log:
            ax.set(xscale="log", yscale="log")
        ax.set(xlabel=xlabel, ylabel=ylabel, title=name)
        ax.grid(alpha=0.3)
        ax.legend(frameon=False, fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(_writable(path), dpi=130)
    plt.close(fig)


def client_triplet(D, rng: np.random.Generator) -> list[int]:
    """``[random, nearest, farthest]``: a client drawn by ``rng`` among the ``n`` of ``D``
    ``[n, n]`` (``n >= 3``), and the other clients nearest and farthest from it by ``D``."""
    a = int(rng.integers(D.shape[0]))
    others = np.delete(np.arange(D.shape[0]), a)
    return [a, int(others[np.argmin(D[a, others])]), int(others[np.argmax(D[a, others])])]


def plot_client_triplet(data, names, D, path, *, seed=7, invert=False, roles=None, title=None):
    """A random client, its nearest and its farthest client by ``D``, with samples of each.

    Draws the three as a triangle with ``D`` on the edges (thicker: more similar), next to
    one sample per class all three hold (up to 8 classes).

    Args:
      data: :class:`~karula_jax.data.ClientData` of ``[n, N, 784]`` images (28 x 28) with
        class labels ``[n, N]``.
      names: per client a label.
      D: ``[n, n]`` dissimilarities.
      path: PNG to write.
      seed: numpy seed of the random client and of the samples shown.
      invert: show ``1 - x`` (images with ink 1 on background 0, drawn dark on white).
      roles: the three's roles shown with their names.
      title: figure title.

    Returns:
      The client indices ``[random, nearest, farthest]``.
    """
    D = np.asarray(D)
    counts, x, y = np.asarray(data.counts), np.asarray(data.x), np.asarray(data.y)
    rng = np.random.default_rng(seed)
    trio = client_triplet(D, rng)
    classes = sorted(set.intersection(*(set(y[i, : counts[i]].tolist()) for i in trio)))[:8]
    images = []
    for i in trio:
        rows = [rng.choice(np.flatnonzero(y[i, : counts[i]] == c)) for c in classes]
        ims = x[i, rows].reshape(-1, 28, 28)
        images.append(1.0 - ims if invert else ims)
    d = D[np.ix_(trio, trio)]
    roles = roles or ("random writer", "nearest by D", "farthest by D")
    plt = _pyplot()
    k = max(im.shape[0] for im in images)
    fig = plt.figure(figsize=(5.6 + 0.9 * k, 3.4))
    grid = fig.add_gridspec(3, k + 5)
    ax = fig.add_subplot(grid[:, :3])
    pos = np.array([[0.0, 1.0], [-0.9, -0.6], [0.9, -0.6]])
    d_min = min(d[0, 1], d[0, 2], d[1, 2])
    box = dict(boxstyle="round", fc="white", ec="0.7")
    txt = dict(ha="center", va="center")
    for i, j in ((0, 1), (0, 2), (1, 2)):  # thicker edge = more similar clients
        ax.plot(*pos[[i, j]].T, color="0.5", lw=1.0 + 3.0 * d_min / max(float(d[i, j]), 1e-12))
        ax.text(*pos[[i, j]].mean(0), f"D={d[i, j]:.2f}", fontsize=9, bbox=box, **txt)
    for i in range(3):
        ax.scatter(*pos[i], s=260, color=f"C{i}", zorder=3)
        ax.text(*pos[i], "ABC"[i], fontsize=10, color="white", weight="bold", zorder=4, **txt)
    ax.set(xlim=(-1.3, 1.3), ylim=(-1.0, 1.4))
    ax.set_axis_off()
    for r, (ims, i, role) in enumerate(zip(images, trio, roles, strict=True)):
        lab = fig.add_subplot(grid[r, 3:5])
        lab.set_axis_off()
        text = f"{'ABC'[r]}: {role}\n{names[i]}"
        lab.text(0.95, 0.5, text, ha="right", va="center", fontsize=8, color=f"C{r}")
        for c in range(k):
            a = fig.add_subplot(grid[r, 5 + c])
            if c < ims.shape[0]:
                a.imshow(ims[c], cmap="gray", vmin=0.0, vmax=1.0)
            a.set(xticks=[], yticks=[])
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(_writable(path), dpi=130, bbox_inches="tight")
    plt.close(fig)
    return trio
