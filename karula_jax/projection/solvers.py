"""The registry of projection solvers: one row each (contract: :mod:`.contract`)."""

from __future__ import annotations

import functools

from karula_jax.projection import dykstra, fista, laplacian
from karula_jax.projection.contract import Solver

__all__ = ["SOLVERS"]


def _from_twice_n(n: int, p: int) -> bool:
    """The multiplier solvers' rotation rule: onto the span from ``p >= 2n`` on."""
    return p >= 2 * n


SOLVERS: dict[str, Solver] = {
    # Its state is O(n^2 k): rotate onto the span whenever that shrinks k.
    "dykstra": Solver(dykstra.solve, pair_state=True, rotate=lambda n, p: p > n),
    # It multiplies [n, n] by [n, k] in every evaluation: rotating (O(n^2 p) once) pays
    # from p >= 2n on.
    "laplacian": Solver(laplacian.solve, pair_state=False, rotate=_from_twice_n),
    # The same Newton ascent with each Newton system on the free pairs formed and
    # factorized instead of solved by CG (few large kernels a step, for accelerators).
    "laplacian_direct": Solver(
        functools.partial(laplacian.solve, direct=True),
        pair_state=False,
        rotate=_from_twice_n,
    ),
    # Accelerated projected gradient on the same multipliers, fixed-trip blocks (few large
    # kernels an iteration, no inner loops); rotated where the Laplacian dual is.
    "fista": Solver(fista.solve, pair_state=False, rotate=_from_twice_n),
}
