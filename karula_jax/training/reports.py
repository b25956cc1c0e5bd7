"""What a run reports about its rounds: projection convergence and non-finite values."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from karula_jax.algorithms.base import RoundInfo

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


def nonfinite_error(
    round_index: int, finite_of_round: np.ndarray, last_checkpoint: str
) -> FloatingPointError:
    """The error of ``on_nonfinite="raise"``, naming the round and the batch members.

    Args:
      round_index: the 0-based round that was not finite.
      finite_of_round: that round's ``finite`` flags (a scalar for one run; the batch axes
        ``[S, G]`` of :func:`run_many`).
      last_checkpoint: what to say about the last good checkpoint.
    """
    finite_of_round = np.asarray(finite_of_round)
    which = ""
    if finite_of_round.ndim > 0:
        members = np.argwhere(~finite_of_round)
        shown = [tuple(int(i) for i in m) if len(m) > 1 else int(m[0]) for m in members[:8]]
        more = f" and {len(members) - 8} more" if len(members) > 8 else ""
        index = "(s, g) " if finite_of_round.ndim > 1 else "s "
        which = f" in batch members {index}{shown}{more}"
    return FloatingPointError(
        f"round {round_index} (0-based; {round_index + 1} rounds started) produced a "
        f"non-finite loss, gradient or parameter{which}. Run stopped; last good checkpoint: "
        f"{last_checkpoint}. Lower the step size or check the loss function."
    )
