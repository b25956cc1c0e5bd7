"""The one platform rule the library's batched solvers share: members in turn on the CPU.

A vmapped ``while_loop`` runs its body on every member of the batch until the slowest
member stops. Accelerators run that lockstep batch in parallel; the CPU runs its members
no faster together than apart, so there each member should pay only its own iterations,
the members solved one after another (``lax.map``). The projection
(``projection.api``) and a study's embedding of its members
(``protocol.member_dissimilarities``) follow this rule (``docs/implementation_notes.md``).
"""

from __future__ import annotations

import jax

__all__ = ["members_in_turn"]


def members_in_turn() -> bool:
    """Whether vmapped members of an iterative solve run one after another (``lax.map``)
    rather than in lockstep (``vmap``): on the CPU backend (``jax.default_backend()``).
    Read when a program is traced; tests swap it to check the other mode."""
    return jax.default_backend() == "cpu"
