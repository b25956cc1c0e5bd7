"""Checks on training curves: where a curve's tail starts and whether it has flattened."""

from __future__ import annotations

import numpy as np

__all__ = ["flattened", "tail_start"]


def tail_start(rounds, last: float = 0.2) -> int:
    """Index of the evaluation where the last ``last`` share of the rounds begins: the last
    evaluation at or before round ``R_end - last (R_end - R_0)``, so that the tail holds two
    evaluations at least, however coarse the evaluation grid. ``rounds`` ``[T]``
    increasing, ``T >= 2``; ``last`` in ``(0, 1)``."""
    rounds = np.asarray(rounds, np.float64)
    if rounds.ndim != 1 or rounds.size < 2:
        raise ValueError(f"rounds: expected [T] with T >= 2, got shape {rounds.shape}")
    if not 0.0 < last < 1.0:
        raise ValueError(f"last: expected a share in (0, 1), got {last}")
    first = rounds[-1] - last * (rounds[-1] - rounds[0])
    return max(int(np.searchsorted(rounds, first, side="right")) - 1, 0)


def flattened(curve, rounds, *, last: float = 0.2, share: float = 0.02) -> np.ndarray:
    """Whether training-loss curves have flattened by their last round.

    The criterion: over the last ``last`` share of the rounds (from :func:`tail_start`),
    the loss stays within ``share`` of its total decrease (first evaluation minus last) of
    its final value. A
    curve still falling, oscillating or rising there fails it, as does one that never
    decreased or is not finite.

    Args:
      curve: losses ``[..., T]`` at the rounds ``rounds``.
      rounds: ``[T]`` increasing rounds of the evaluations (the first is the reference).
      last: the final share of the rounds examined, in ``(0, 1)`` (0.2: the last fifth).
      share: the largest change allowed there, a share of the total decrease, ``> 0``.

    Returns:
      bool ``[...]``.
    """
    curve, rounds = np.asarray(curve, np.float64), np.asarray(rounds, np.float64)
    if rounds.ndim != 1 or curve.shape[-1:] != rounds.shape or rounds.size < 2:
        raise ValueError(
            f"curve [..., T] and rounds [T] with T >= 2 expected, got {curve.shape} and "
            f"{rounds.shape}"
        )
    if not share > 0.0:
        raise ValueError(f"share: expected a positive share, got {share}")
    start = tail_start(rounds, last)
    final = curve[..., -1:]
    moved = np.max(np.abs(curve[..., start:] - final), axis=-1)
    total = curve[..., 0] - curve[..., -1]
    with np.errstate(invalid="ignore"):
        ok = np.all(np.isfinite(curve), axis=-1) & (total > 0) & (moved <= share * total)
    return np.asarray(ok, bool)
