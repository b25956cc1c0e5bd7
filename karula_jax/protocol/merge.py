"""Several runs of one protocol merged into one comparison: the per-seed values of every
method, checked to share their reference method's seeds."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

__all__ = ["MergedRuns", "merge_runs"]


class MergedRuns(NamedTuple):
    """Output of :func:`merge_runs`.

    Attributes:
      per_seed: ``{method: {column: float64 [S]}}``, every method once, in the order the
        runs first name them.
      chosen: ``{method: its CV choices}`` from the run it was taken from.
      source: ``{method: the run's name}``.
    """

    per_seed: dict[str, dict[str, np.ndarray]]
    chosen: dict[str, Any]
    source: dict[str, str]


def merge_runs(
    summaries: Mapping[str, Mapping[str, Any]],
    *,
    reference: str = "Karula",
    column: str = "test_acc",
    atol: float = 1e-6,
) -> MergedRuns:
    """Merges runs that share their seeds into one set of per-seed values.

    Runs of one protocol on the same seeds (data draws, keys) each train some methods and
    the ``reference``; paired comparisons across runs are valid only if the reference's
    per-seed ``column`` agrees in all of them, which is checked. A method in several runs
    is taken from the first.

    Args:
      summaries: ``{run name: summary}``, each with ``per_seed[method][column]`` (lists
        or arrays ``[S]``) and ``chosen[method]`` (the layout :func:`run_study` writes).
      reference: the method every run holds.
      column: the per-seed column the runs must agree on.
      atol: the largest difference of the reference's values between runs, in the
        column's units (a rerun of one seed reproduces it to float rounding).

    Returns:
      A :class:`MergedRuns`.

    Raises:
      ValueError: no runs; a run without ``reference`` or its ``column``; a run whose
        reference values differ from the first run's by more than ``atol`` or have
        another number of seeds (the run is named).
    """
    if not summaries:
        raise ValueError("summaries: no runs to merge")
    per_seed: dict[str, dict[str, np.ndarray]] = {}
    chosen: dict[str, Any] = {}
    source: dict[str, str] = {}
    first = next(iter(summaries))
    for run, summary in summaries.items():
        got = {
            m: {k: np.asarray(v, np.float64) for k, v in c.items()}
            for m, c in summary["per_seed"].items()
        }
        if column not in got.get(reference, {}):
            raise ValueError(f"run {run!r} has no per-seed {column!r} of {reference!r}")
        if per_seed:
            mine, theirs = got[reference][column], per_seed[reference][column]
            if mine.shape != theirs.shape or not np.allclose(mine, theirs, rtol=0, atol=atol):
                raise ValueError(
                    f"run {run!r}: {reference}'s per-seed {column} differ from run {first!r}'s "
                    "(runs merged into one comparison must share their seeds)"
                )
        new = [m for m in got if m not in per_seed]
        per_seed |= {m: got[m] for m in new}
        chosen |= {m: summary["chosen"][m] for m in new}
        source |= dict.fromkeys(new, run)
    return MergedRuns(per_seed, chosen, source)
