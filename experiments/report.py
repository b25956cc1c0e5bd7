"""What the experiments write: tables (CSV + Markdown), JSON summaries and figures.

Plain numpy/matplotlib on host arrays; statistics come from :mod:`karula_jax.stats`.
A table is written twice: a CSV with one number per cell (a measured column ``k`` has its
mean in ``k`` and its 2-SE half width in ``k_2se``) and Markdown with ``mean ± 2 SE``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from karula_jax.stats import format_mean_se, mean_and_se, paired_difference

__all__ = [
    "DATA_DIR",
    "cli",
    "RESULTS",
    "mean_se_columns",
    "paired_columns",
    "plot_client_triplet",
    "plot_curves",
    "plot_heatmaps",
    "write_json",
    "write_table",
]

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"
DATA_DIR = pathlib.Path(os.environ.get("KARULA_DATA_DIR", REPO.parent / "shared" / "data"))


def _option_type(field: dataclasses.Field, default: Any):
    """How a config field is read from the command line, or None if it is not offered."""
    if isinstance(default, tuple) and default and isinstance(default[0], int | float | str):
        kind = type(default[0])
        return lambda text: tuple(kind(v) for v in text.split(","))
    if isinstance(default, int | float | str) and not isinstance(default, bool):
        return type(default)
    if default is None and "float" in str(field.type):
        return float
    return None


def cli(config_type, argv, *, quick, description: str = "", out: pathlib.Path, **extra):
    """Reads a config dataclass from the command line: ``--field-name VALUE`` per field.

    Numbers and strings take one value, tuples of them comma-separated values, a bool
    field defaulting to False is a flag; ``--quick`` starts from ``quick(config_type())``
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
    cfg = dataclasses.replace(cfg, **changes)
    if getattr(cfg, "seeds", 2) < 2:
        p.error("--seeds must be >= 2 (standard errors need two seeds)")
    return cfg, args


def mean_se_columns(row: dict, **values) -> dict:
    """Adds ``row[k]`` (mean over seeds) and ``row[k + "_2se"]`` for every ``k=[S] array``."""
    for key, v in values.items():
        row[key], row[key + "_2se"] = mean_and_se(v)
    return row


def paired_columns(row: dict, key: str, reference, values) -> dict:
    """Adds the paired difference ``reference - values`` over seeds (``[S]`` each) as
    ``row[key]`` ± ``row[key + "_2se"]`` and ``row[key + "_decided"]``: "yes" when it
    exceeds its 2 SE, "no" otherwise, "-" for the reference itself."""
    diff, band = paired_difference(reference, values)
    same = np.array_equal(np.asarray(reference), np.asarray(values))
    row[key], row[key + "_2se"] = diff, band
    row[key + "_decided"] = "-" if same else ("yes" if abs(diff) > band else "no")
    return row


def write_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[tuple[str, str]],
    *,
    csv_path: pathlib.Path,
    md_path: pathlib.Path,
    title: str = "",
    notes: Sequence[str] = (),
    digits: Mapping[str, int] | None = None,
) -> str:
    """Writes rows as CSV and Markdown; returns the Markdown table (no title or notes).

    Args:
      rows: one mapping per row; a measured key ``k`` comes with ``k + "_2se"``.
      columns: ``(key, header)`` pairs in display order.
      csv_path: where the CSV goes.
      md_path: where the Markdown goes.
      title: heading of the Markdown file.
      notes: lines under the Markdown table.
      digits: decimals per key (default 3).
    """
    digits = dict(digits or {})
    fields = []
    for key, _ in columns:
        fields += [key] + ([key + "_2se"] if any(key + "_2se" in r for r in rows) else [])
    with open(csv_path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: r.get(k, "") for k in fields} for r in rows)

    def cell(r, key):
        v, d = r.get(key, ""), digits.get(key, 3)
        if key + "_2se" in r:
            return format_mean_se(v, r[key + "_2se"], digits=d)
        return f"{v:.{d}f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r, k) for k, _ in columns) + " |" for r in rows]
    table = "\n".join(lines)
    parts = ([f"# {title}", ""] if title else []) + [table] + ([""] + list(notes) if notes else [])
    pathlib.Path(md_path).write_text("\n".join(parts) + "\n")
    return table


def markdown_table(head: str, rows: list[str]) -> str:
    """A markdown table from a header and rows written as ``a | b | c`` (no outer bars)."""
    rule = "|" + "---|" * (head.count("|") + 1)
    return "\n".join([f"| {head} |", rule, *(f"| {row} |" for row in rows)])


def publish(text: str, out: pathlib.Path, *, quick: bool) -> None:
    """Prints a bench's report and writes it to ``out`` unless it was a quick run."""
    print(text)
    if not quick:
        out.write_text(text + "\n")


def write_json(obj: Any, path: pathlib.Path) -> None:
    """Writes ``obj`` as indented JSON (numpy scalars and arrays become lists)."""

    def default(o):
        if isinstance(o, np.ndarray | np.generic):
            return o.tolist()
        raise TypeError(f"not JSON serializable: {type(o).__name__}")

    pathlib.Path(path).write_text(json.dumps(obj, indent=2, default=default) + "\n")


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
    fig.savefig(path, dpi=120)
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
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_client_triplet(images, names, d, path, *, roles=None, title=None) -> None:
    """Three clients as a triangle with ``D`` on the edges, next to rows of their samples.

    Args:
      images: per client ``[k, 28, 28]`` images (dark ink on white).
      names: per client a label.
      d: ``[3, 3]`` dissimilarities between the three.
      path: PNG to write.
      roles: per client a role shown with its name.
      title: figure title.
    """
    if len(images) != 3 or len(names) != 3 or np.shape(d) != (3, 3):
        raise ValueError("plot_client_triplet expects three clients and a [3, 3] matrix d")
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
    for r, (ims, name, role) in enumerate(zip(images, names, roles, strict=True)):
        lab = fig.add_subplot(grid[r, 3:5])
        lab.set_axis_off()
        text = f"{'ABC'[r]}: {role}\n{name}"
        lab.text(0.95, 0.5, text, ha="right", va="center", fontsize=8, color=f"C{r}")
        for c in range(k):
            a = fig.add_subplot(grid[r, 5 + c])
            if c < ims.shape[0]:
                a.imshow(ims[c], cmap="gray", vmin=0.0, vmax=1.0)
            a.set(xticks=[], yticks=[])
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)
