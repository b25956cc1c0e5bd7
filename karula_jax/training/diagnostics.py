"""What a run reports: projection convergence, non-finite rounds and their likely causes,
and the checks of traced inputs that failed."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from karula_jax._checks import DeferredChecks
from karula_jax.algorithms.base import RoundInfo
from karula_jax.data.clients import ClientData

__all__ = ["ProjectionNotConvergedWarning", "describe_diagnostics", "round_diagnostics"]


class ProjectionNotConvergedWarning(RuntimeWarning):
    """Some rounds' projection stopped at its iteration cap before reaching its tolerance.

    Such a projection is still feasible (see :mod:`karula_jax.projection`) but only
    ``proj_delta``-optimal. Raise the algorithm's ``projection_max_iter`` (or its
    ``projection_tol``) if the reported gap matters.
    """


def round_diagnostics(info: RoundInfo | None) -> dict[str, Any]:
    """Summary of the projection diagnostics of a run's rounds.

    Args:
      info: a :class:`RoundInfo` whose leaves have a leading round axis
        ``[num_rounds, ...]`` (batch axes may follow, as in :func:`run_many`), e.g.
        :attr:`RunResult.info` or the ``info`` of :func:`scan_rounds`; ``None`` for none.

    Returns:
      dict with ``num_rounds``; ``worst_proj_delta``, the largest certified projection
      gap of any round and batch member (NaN ignored; 0.0 with no rounds);
      ``max_proj_violation``, likewise for the constraint violation; and
      ``unconverged_rounds``, the 0-based rounds (list of int) in which the projection of
      some batch member did not converge.
    """
    if info is None:
        return {
            "num_rounds": 0,
            "worst_proj_delta": 0.0,
            "max_proj_violation": 0.0,
            "unconverged_rounds": [],
        }
    num = int(np.shape(info.loss)[0])

    def worst(x) -> float:
        x = np.asarray(x, dtype=np.float64)
        finite = x[~np.isnan(x)]
        return float(finite.max()) if finite.size else (math.nan if x.size else 0.0)

    converged = np.asarray(info.proj_converged).reshape(num, -1).all(axis=1)
    return {
        "num_rounds": num,
        "worst_proj_delta": worst(info.proj_delta),
        "max_proj_violation": worst(info.proj_violation),
        "unconverged_rounds": np.flatnonzero(~converged).tolist(),
    }


def describe_diagnostics(diagnostics: Mapping[str, Any]) -> str:
    """One line for a log: the worst certified projection gap, the largest violation and
    the rounds whose projection did not converge (from :func:`round_diagnostics`)."""
    bad = diagnostics["unconverged_rounds"]
    shown = ", ".join(map(str, bad[:8])) + (", ..." if len(bad) > 8 else "")
    return (
        f"projection: worst certified gap {diagnostics['worst_proj_delta']:.3g}, "
        f"max violation {diagnostics['max_proj_violation']:.3g}, "
        f"{len(bad)} of {diagnostics['num_rounds']} rounds unconverged"
        + (f" (rounds {shown})" if bad else "")
    )


def warn_unconverged(diagnostics: Mapping[str, Any], *, stacklevel: int = 2) -> None:
    """A :class:`ProjectionNotConvergedWarning` if some round did not converge.

    ``stacklevel`` counts from the caller of this function (2: the caller's caller).
    """
    bad = diagnostics["unconverged_rounds"]
    if not bad:
        return
    shown = ", ".join(map(str, bad[:8])) + (", ..." if len(bad) > 8 else "")
    warnings.warn(
        f"the projection did not converge in {len(bad)} of {diagnostics['num_rounds']} "
        f"rounds (0-based: {shown}); worst certified gap proj_delta="
        f"{diagnostics['worst_proj_delta']:.3g}, max violation "
        f"{diagnostics['max_proj_violation']:.3g}. The models are feasible but only "
        "approximately projected: raise projection_max_iter (or projection_tol).",
        ProjectionNotConvergedWarning,
        stacklevel=stacklevel + 1,
    )


def first_nonfinite(finite: np.ndarray) -> int | None:
    """Index of the first round (leading axis) in which some batch member was not finite."""
    ok = np.asarray(finite).reshape(finite.shape[0], -1).all(axis=1)
    return None if ok.all() else int(np.argmin(ok))


def where_in_batch(bad: np.ndarray, members: bool = True, grid: bool = True) -> str:
    """Where ``bad`` (``[]``, ``[S]`` or ``[S, G]``) is True, as text ("in batch member
    3", "in grid points [1, 2]", "in (batch member, grid point) pairs [...]"); "" for a
    scalar. ``members``/``grid``: whether those axes really vary (a ``[1, G]`` array
    from a grid alone names grid points)."""
    bad = np.asarray(bad, bool)
    if bad.ndim == 0:
        return ""
    if bad.ndim == 1:
        bad, grid = bad[:, None], False
    rows, cols = np.flatnonzero(bad.any(axis=1)), np.flatnonzero(bad.any(axis=0))
    if members and (not grid or bad[rows].all()):  # whole members
        what, pts = "batch member", rows.tolist()
    elif not members or bad[:, cols].all():  # whole grid points
        what, pts = "grid point", cols.tolist()
    else:
        what = "(batch member, grid point) pair"
        pts = [tuple(map(int, p)) for p in np.argwhere(bad)]
    if len(pts) == 1:
        return f" in {what} {pts[0]}"
    more = f" and {len(pts) - 8} more" if len(pts) > 8 else ""
    return f" in {what}s {pts[:8]}{more}"


def raise_failed_checks(checks: DeferredChecks) -> None:
    """ValueError listing the deferred checks of ``init`` that failed (and where)."""
    failed = checks.failed()
    if failed:
        raise ValueError(
            "bad input found by init (checked inside the compiled program): "
            + "; ".join(m + where_in_batch(bad) for m, bad in failed)
            + ". Nothing was run."
        )


def nonfinite_data(data: Any) -> str:
    """Which clients' real rows hold NaN/inf features or targets, as text ("" if none).

    Looks at every :class:`ClientData` in ``data`` (concrete; batched ones with leading
    member axes ``[S, n, ...]`` too). Padding rows are ignored.
    """
    try:
        return _nonfinite_data(data)
    except (TypeError, ValueError, RuntimeError):  # e.g. arrays split over processes
        return ""


def _nonfinite_data(data: Any) -> str:
    found = []
    sets = [d for d in jax.tree.leaves(data, is_leaf=lambda d: isinstance(d, ClientData))
            if isinstance(d, ClientData)]  # fmt: skip
    for d in sets:
        counts = np.asarray(d.counts)
        real = np.arange(np.shape(d.x)[counts.ndim]) < counts[..., None]  # [..., n, N]
        for name, a in (("x", d.x), ("y", d.y)):
            a = np.asarray(a)
            if not np.issubdtype(a.dtype, np.inexact):
                continue
            rows = ~np.isfinite(a).reshape(a.shape[: counts.ndim + 1] + (-1,)).all(-1)
            clients = np.argwhere((rows & real).any(-1))  # [k, counts.ndim]
            if len(clients):
                shown = [tuple(map(int, c)) if len(c) > 1 else int(c[0]) for c in clients[:8]]
                more = f" and {len(clients) - 8} more" if len(clients) > 8 else ""
                what = "(batch member, client) pair" if counts.ndim > 1 else "client"
                what, shown = (what, shown[0]) if len(shown) == 1 else (what + "s", shown)
                found.append(f"data.{name} has NaN or inf in the real rows of {what} {shown}{more}")
    return "; ".join(found)


def nonfinite_error(
    round_index: int, finite_of_round: np.ndarray, last_checkpoint: str, data_report: str = ""
) -> FloatingPointError:
    """The error of ``on_nonfinite="raise"``, naming the round, the batch members and the
    likely causes in order: non-finite data, labels outside the model's classes, the step.

    Args:
      round_index: the 0-based round that was not finite.
      finite_of_round: that round's ``finite`` flags (a scalar for one run; the batch axes
        ``[S, G]`` of :func:`run_many`).
      last_checkpoint: what to say about the last good checkpoint.
      data_report: :func:`nonfinite_data` of the run's data ("" when it is finite).
    """
    finite_of_round = np.asarray(finite_of_round)
    which = ""
    if finite_of_round.ndim > 0:
        members = np.argwhere(~finite_of_round)
        shown = [tuple(int(i) for i in m) if len(m) > 1 else int(m[0]) for m in members[:8]]
        more = f" and {len(members) - 8} more" if len(members) > 8 else ""
        index = "(s, g) " if finite_of_round.ndim > 1 else "s "
        which = f" in batch members {index}{shown}{more}"
    data = (
        f"(1) non-finite data: {data_report}"
        if data_report
        else "(1) non-finite data: none found (every client's real rows of x and y are finite)"
    )
    return FloatingPointError(
        f"round {round_index} (0-based; {round_index + 1} rounds started) produced a "
        f"non-finite loss, gradient or parameter{which}. Run stopped; last good checkpoint: "
        f"{last_checkpoint}. Likely causes, in order: {data}; (2) labels outside the model's "
        "classes (more classes in y than the model has outputs; checked by init for the "
        "library's cross-entropy loss) or a loss that is not finite on the data; (3) a "
        "step size too large for the loss: lower learning_rate."
    )
