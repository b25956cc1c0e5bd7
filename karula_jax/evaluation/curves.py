"""Checks on training curves: where a curve's tail starts and whether it has flattened."""

from __future__ import annotations

import numpy as np

__all__ = ["FLAT_TOL", "FLAT_WINDOW", "flattened", "round_loss_flattened", "tail_start"]

# round_loss_flattened's defaults: windows of a tenth of the rounds; the last window's drop
# at most 5% of the run's whole decrease (plus its noise). At that pace, as many rounds
# again would lower the loss by less than half of what it fell so far.
FLAT_WINDOW, FLAT_TOL = 0.1, 0.05


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


def round_loss_flattened(loss, *, window: float = FLAT_WINDOW, tol: float = FLAT_TOL) -> np.ndarray:
    """Whether per-round training losses have flattened by the end of their run.

    For the loss a round records (:class:`~karula_jax.algorithms.RoundInfo`'s ``loss``:
    the participants' minibatch loss before the update, noisy under partial
    participation), so windows are averaged. With ``w = max(1, round(window R))`` rounds,
    ``first``, ``previous`` and ``last`` the mean losses of the first ``w`` rounds and of
    the two last windows of ``w``: the curve has flattened when ``|previous - last| <=
    tol (first - last) + 2 se``, ``se`` the standard error of that difference from the
    rounds' noise about their trend in the two windows (from their second differences,
    which a linear trend does not enter): a drop within the rounds' noise is not
    evidence of progress. With the defaults (a tenth of the rounds, 5%): at its final pace, as
    many rounds again would lower the loss by less than half of what it fell so far.
    A curve that never decreased (``first <= last``) or is not finite fails.

    Args:
      loss: ``[..., R]`` losses of rounds ``1..R`` (``R >= 3``).
      window: each window's share of the rounds, in ``(0, 1/3]``.
      tol: the largest drop over the last window, a share of the whole decrease, ``> 0``.

    Returns:
      bool ``[...]``.

    Examples:
      >>> import numpy as np
      >>> k = np.arange(1, 201)
      >>> round_loss_flattened(np.stack([1 + np.exp(-k / 10), 2.3 - 0.005 * k])).tolist()
      [True, False]
    """
    loss = np.asarray(loss, np.float64)
    if loss.ndim < 1 or loss.shape[-1] < 3:
        raise ValueError(f"loss: expected [..., R] with R >= 3 rounds, got shape {loss.shape}")
    if not 0.0 < float(window) <= 1 / 3:
        raise ValueError(f"window: expected a share in (0, 1/3], got {window}")
    if not float(tol) > 0.0:
        raise ValueError(f"tol: expected a positive share, got {tol}")
    R = loss.shape[-1]
    w = max(1, round(float(window) * R))
    first, prev, last = loss[..., :w], loss[..., R - 2 * w : R - w], loss[..., R - w :]
    drop = prev.mean(-1) - last.mean(-1)
    total = first.mean(-1) - last.mean(-1)
    # the rounds' noise about their trend: iid noise of variance v gives second
    # differences of variance 6 v, a linear trend none
    tail = loss[..., R - 2 * w :]
    v = np.mean(np.diff(tail, 2, axis=-1) ** 2, axis=-1) / 6 if 2 * w >= 3 else 0.0
    se = np.sqrt(2 * v / w)  # of the difference of two windows' means
    with np.errstate(invalid="ignore"):
        ok = np.all(np.isfinite(loss), -1) & (total > 0) & (np.abs(drop) <= tol * total + 2 * se)
    return np.asarray(ok, bool)
