"""Progress bars (tqdm on stderr) for training runs and the other long steps of an experiment.

:func:`~karula_jax.training.run` and :func:`~karula_jax.training.run_many` draw one bar of
rounds (updated after every compiled chunk, with the last round's loss and the latest
metrics); :func:`progress_bar` is the same kind of bar for anything else an experiment
loops over (embedding one data set after another, CV folds, methods). :func:`compile_step`
shows a run's compilation as a step of its own ("<desc>: compiling"), from before the run
starts until its bar of rounds opens, which happens once its programs are compiled.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
from tqdm import tqdm

from karula_jax.algorithms.base import RoundInfo

__all__ = ["compile_step", "progress_bar"]

# compile_step's open bars, closed by the next RoundBar (or at the end of their block)
_COMPILING: list[tqdm] = []


def progress_bar(
    iterable_or_total: Iterable | int,
    *,
    desc: str | None = None,
    unit: str = "it",
    enabled: bool = True,
    initial: int = 0,
    leave: bool = True,
) -> tqdm:
    """A tqdm progress bar on stderr over an iterable or a number of steps.

    Args:
      iterable_or_total: what to iterate over (its ``len`` is the total when it has one),
        or an int number of steps to advance by hand with ``bar.update(k)``.
      desc: label in front of the bar (e.g. ``"embedding"``, ``"CV folds"``).
      unit: name of one step (``"round"``, ``"data set"``...).
      enabled: ``False`` returns a silent bar (iterating and ``update`` still work), so a
        ``progress=False`` flag can be passed straight through.
      initial: steps already done (e.g. the rounds of a resumed run).
      leave: keep the finished bar on screen.

    Returns:
      A ``tqdm`` object: iterate over it, or call ``update``/``set_postfix_str`` and
      ``close`` (it is also a context manager).

    Example::

        for name in progress_bar(datasets, desc="embedding", unit="data set"):
            D[name] = embedding.dissimilarities(datasets[name], key=key)

        with progress_bar(num_folds * num_seeds, desc="CV") as bar:
            for ...:
                ...
                bar.update(1)
    """
    if isinstance(iterable_or_total, bool):
        raise TypeError("iterable_or_total must be an iterable or an int, got a bool")
    if isinstance(iterable_or_total, int | np.integer):
        if iterable_or_total < 0:
            raise ValueError(f"the total must be >= 0, got {iterable_or_total}")
        iterable, total = None, int(iterable_or_total)
    else:
        iterable, total = iterable_or_total, None
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        initial=initial,
        disable=not enabled,
        leave=leave,
        file=sys.stderr,
        dynamic_ncols=True,
    )


@contextlib.contextmanager
def compile_step(desc: str | None = None, *, enabled: bool = True) -> Iterator[tqdm]:
    """A one-step bar ``"<desc>: compiling"`` while the runs inside the block compile.

    The step completes when the next run's bar of rounds opens (a run opens it once its
    programs are compiled: the step's time is the compilation, with the run's set-up) or
    when the block ends, whichever comes first; a run whose programs were compiled by an
    earlier call completes it at once.

    Args:
      desc: what is compiled (a method's label), or None.
      enabled: ``False``: a silent step (as :func:`progress_bar`).

    Example::

        with compile_step("[1/3] Karula", enabled=progress):
            result = training.run_many(...)  # its bar of rounds follows the step
    """
    label = f"{desc}: compiling" if desc else "compiling"
    bar = progress_bar(1, desc=label, unit="step", enabled=enabled)
    _COMPILING.append(bar)
    try:
        yield bar
    finally:
        _finish_compiling()


def _finish_compiling() -> None:
    """Completes and closes every open :func:`compile_step` bar."""
    while _COMPILING:
        bar = _COMPILING.pop()
        bar.update(1)
        bar.close()


class RoundBar:
    """The bar of a run: rounds done, updated after every chunk (private). Opening it
    completes the :func:`compile_step` before it: the run's programs are compiled."""

    def __init__(self, total: int, initial: int, enabled: bool, desc: str | None = None):
        _finish_compiling()
        self.bar = progress_bar(total, desc=desc, unit="round", enabled=enabled, initial=initial)

    def update(self, step: int, values: Mapping[str, float]) -> None:
        self.bar.set_postfix_str(" ".join(f"{k}={v:.4g}" for k, v in values.items()), False)
        self.bar.update(step)

    def close(self) -> None:
        self.bar.close()


def scalar_summary(info_last: RoundInfo, metrics: Mapping[str, np.ndarray]) -> dict:
    """What the bar shows: the last round's loss and every metric, each averaged over its
    finite entries (runs and clients), and ``nonfinite_runs``, the number of runs whose
    last loss is NaN or inf, when there are any: one diverged grid point of a batch (which
    CV rejects) would otherwise make every mean inf and hide the others' progress."""
    loss = np.asarray(info_last.loss, np.float64)
    out = {"loss": _finite_mean(loss)}
    for name, value in metrics.items():
        out[name] = _finite_mean(value)
    nonfinite = int(np.sum(~np.isfinite(loss)))
    if nonfinite:
        out["nonfinite_runs"] = nonfinite
    return out


def _finite_mean(values) -> float:
    """The mean of the finite entries of ``values`` (NaN when there are none)."""
    v = np.asarray(values, np.float64)
    finite = np.isfinite(v)
    return float(np.mean(v[finite])) if finite.any() else float("nan")
