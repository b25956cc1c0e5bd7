"""Helpers shared by the experiment scripts: summary statistics, tables, figures, JSON.

Nothing here knows about federated learning; the experiments pass plain arrays and
lists of rows. Tables are written twice: a CSV with one number per cell (mean and
the 2-standard-error half width in separate columns) for machines, and a Markdown
table with ``mean ± 2 SE`` cells for people.
"""

from __future__ import annotations

import csv
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "format_pm",
    "mean_2se",
    "plot_heatmaps",
    "spearman_offdiag",
    "write_json",
    "write_table",
]


def mean_2se(values, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Mean and two standard errors of the mean along ``axis``.

    The standard error uses the unbiased sample standard deviation (``ddof=1``);
    with a single value the half width is reported as NaN (unknown), not 0.

    Args:
      values: array of repeated measurements (e.g. one per seed) along ``axis``.
      axis: the axis of repetitions.

    Returns:
      ``(mean, 2 * SE)``, arrays with ``axis`` removed.
    """
    v = np.asarray(values, dtype=np.float64)
    m = v.shape[axis]
    mean = v.mean(axis=axis)
    if m < 2:
        return mean, np.full_like(mean, np.nan)
    return mean, 2.0 * v.std(axis=axis, ddof=1) / np.sqrt(m)


def format_pm(mean: float, half_width: float, digits: int = 3) -> str:
    """``"mean ± half_width"`` with ``digits`` decimals (half width omitted when NaN)."""
    if not np.isfinite(half_width):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {half_width:.{digits}f}"


def spearman_offdiag(a, b) -> float:
    """Spearman rank correlation between the strictly upper triangles of two square matrices.

    Args:
      a: array of shape ``[n, n]``.
      b: array of shape ``[n, n]``.

    Returns:
      The correlation as a Python float (NaN if one triangle is constant).
    """
    from scipy.stats import spearmanr

    a = np.asarray(a)
    b = np.asarray(b)
    if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape != b.shape:
        raise ValueError(f"expected two square matrices of one shape, got {a.shape} and {b.shape}")
    iu = np.triu_indices(a.shape[0], k=1)
    return float(spearmanr(a[iu], b[iu]).statistic)


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
    """Writes a results table as CSV and Markdown; returns the Markdown text.

    A column is either a plain value (key ``name`` in each row) or a measured
    quantity: then each row holds ``name`` (the mean) and ``name + "_2se"`` (the half
    width), the CSV keeps both, and the Markdown shows ``mean ± 2se``.

    Args:
      rows: one mapping per table row.
      columns: ``(key, header)`` pairs in display order.
      csv_path: where the CSV goes.
      md_path: where the Markdown goes.
      title: optional heading line of the Markdown file.
      notes: lines printed under the Markdown table.
      digits: decimals per measured key (default 3).

    Returns:
      The Markdown table (without title and notes), ready to print.
    """
    digits = dict(digits or {})
    csv_fields: list[str] = []
    for key, _ in columns:
        csv_fields.append(key)
        if any(key + "_2se" in r for r in rows):
            csv_fields.append(key + "_2se")
    with open(csv_path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=csv_fields, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k, "") for k in csv_fields})

    def cell(r, key):
        v = r.get(key, "")
        if key + "_2se" in r:
            return format_pm(float(v), float(r[key + "_2se"]), digits.get(key, 3))
        if isinstance(v, float):
            return f"{v:.{digits.get(key, 3)}f}"
        return str(v)

    lines = [
        "| " + " | ".join(h for _, h in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    lines += ["| " + " | ".join(cell(r, k) for k, _ in columns) + " |" for r in rows]
    table = "\n".join(lines)
    parts = ([f"# {title}", ""] if title else []) + [table]
    if notes:
        parts += [""] + list(notes)
    md_path.write_text("\n".join(parts) + "\n")
    return table


def plot_heatmaps(
    matrices: Sequence[np.ndarray],
    titles: Sequence[str],
    path: pathlib.Path,
    *,
    suptitle: str = "",
) -> None:
    """Saves side-by-side heatmaps (one colour scale per panel) as a PNG.

    Args:
      matrices: square arrays, one per panel.
      titles: one title per panel.
      path: output PNG path.
      suptitle: optional figure title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = len(matrices)
    fig, axes = plt.subplots(1, k, figsize=(4.6 * k, 4.2), constrained_layout=True)
    for ax, mat, title in zip(np.atleast_1d(axes), matrices, titles, strict=True):
        im = ax.imshow(np.asarray(mat), cmap="viridis", interpolation="nearest")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("client j")
        ax.set_ylabel("client i")
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    if suptitle:
        fig.suptitle(suptitle, fontsize=11)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(obj: Any, path: pathlib.Path) -> None:
    """Writes ``obj`` as indented JSON (numpy scalars and arrays converted to lists)."""

    def default(o):
        if isinstance(o, np.ndarray):
            return o.tolist()
        if isinstance(o, np.generic):
            return o.item()
        raise TypeError(f"not JSON serializable: {type(o).__name__}")

    path.write_text(json.dumps(obj, indent=2, default=default) + "\n")
