"""Figures of the real-data experiments: learning curves with SE bands, client triplets.

Plain NumPy/Matplotlib on concrete arrays (no JAX). Tables and statistics live in
:mod:`experiments._common`.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence

import numpy as np

from experiments._common import mean_2se

__all__ = ["plot_client_triplet", "plot_curves"]


def plot_curves(
    rounds: np.ndarray,
    curves: Mapping[str, Mapping[str, np.ndarray]],
    path: pathlib.Path,
    *,
    panels: Sequence[tuple[str, str]],
    title: str | None = None,
) -> pathlib.Path:
    """Plots per-method curves, mean over seeds with a +-2 SE band.

    Args:
      rounds: x values, shape ``[T]``.
      curves: ``curves[method][metric]`` of shape ``[S, T]`` (seeds, evaluation points).
      path: PNG to write.
      panels: ``(metric, axis label)`` per subplot, left to right.
      title: optional figure title.

    Returns:
      ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = np.asarray(rounds)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False)
    for ax, (metric, label) in zip(axes[0], panels, strict=True):
        for method, c in curves.items():
            m, half = mean_2se(c[metric], axis=0)
            half = np.nan_to_num(half)  # one seed: no band
            (line,) = ax.plot(rounds, m, label=method, lw=1.6)
            ax.fill_between(rounds, m - half, m + half, color=line.get_color(), alpha=0.2)
        ax.set_xlabel("round")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0][0].legend(frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_client_triplet(
    images: Sequence[np.ndarray],
    names: Sequence[str],
    d: np.ndarray,
    path: pathlib.Path,
    *,
    roles: Sequence[str] = ("random writer", "nearest by D", "farthest by D"),
    title: str | None = None,
) -> pathlib.Path:
    """Three clients' sample digits and the dissimilarities between them.

    Args:
      images: per client an array ``[k, 28, 28]`` of sample images (LEAF values: 1 is
        background, so ``gray`` shows dark ink on white).
      names: per client a label (writer id).
      d: ``[3, 3]`` dissimilarities between the three clients.
      path: PNG to write.
      roles: per client a short role shown with its name.
      title: optional figure title.

    Returns:
      ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if len(images) != 3 or len(names) != 3 or np.shape(d) != (3, 3):
        raise ValueError("plot_client_triplet expects three clients and a [3, 3] matrix d")
    k = max(im.shape[0] for im in images)
    fig = plt.figure(figsize=(5.6 + 0.9 * k, 3.4))
    grid = fig.add_gridspec(3, k + 5)
    # left: the three clients as a triangle with D on the edges
    ax = fig.add_subplot(grid[:, :3])
    pos = np.array([[0.0, 1.0], [-0.9, -0.6], [0.9, -0.6]])
    d_min = min(d[0, 1], d[0, 2], d[1, 2])
    for i, j in ((0, 1), (0, 2), (1, 2)):
        # thicker edge = more similar clients
        ax.plot(*pos[[i, j]].T, color="0.5", lw=1.0 + 3.0 * d_min / max(float(d[i, j]), 1e-12))
        mid = pos[[i, j]].mean(0)
        ax.text(
            *mid,
            f"D={d[i, j]:.2f}",
            ha="center",
            va="center",
            fontsize=9,
            bbox=dict(boxstyle="round", fc="white", ec="0.7"),
        )
    for i in range(3):
        ax.scatter(*pos[i], s=260, color=f"C{i}", zorder=3)
        ax.text(
            *pos[i],
            "ABC"[i],
            ha="center",
            va="center",
            fontsize=10,
            color="white",
            weight="bold",
            zorder=4,
        )
    ax.set_xlim(-1.3, 1.3)
    ax.set_ylim(-1.0, 1.4)
    ax.set_axis_off()
    # right: a label column, then sample digits, one row per client
    for r, (ims, name, role) in enumerate(zip(images, names, roles, strict=True)):
        lab = fig.add_subplot(grid[r, 3:5])
        lab.set_axis_off()
        lab.text(
            0.95,
            0.5,
            f"{'ABC'[r]}: {role}\n{name}",
            ha="right",
            va="center",
            fontsize=8,
            color=f"C{r}",
            transform=lab.transAxes,
        )
        for c in range(k):
            a = fig.add_subplot(grid[r, 5 + c])
            if c < ims.shape[0]:
                a.imshow(ims[c], cmap="gray", vmin=0.0, vmax=1.0)
            a.set_xticks([])
            a.set_yticks([])
    if title:
        fig.suptitle(title, fontsize=10)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return path
