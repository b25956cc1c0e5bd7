"""The ``personalized`` argument, with one meaning in every factory that takes it.

``personalized`` is a Python bool or a pytree of Python bools with the structure of
``params``. True marks a leaf as per-client: every client keeps (and trains) its own
copy. False marks it as shared: one value for all clients, stored once (``[1, ...]``)
where the method keeps a global model. A bool applies to every leaf, so ``True`` and a
mask of all True are the same argument, as are ``False`` and a mask of all False.

How a method treats the two kinds of leaves is in its own docstring (FedAvg averages the
shared leaves, Karula steps them along the client mean of its direction, Ditto copies the
global model into them). Each factory has an explicit default (``True`` for the
personalized methods, ``False`` for the model-averaging ones); ``None`` is refused.
"""

from __future__ import annotations

from typing import Any

import jax

from karula_jax._checks import check_personalized, personalized_flags

__all__ = ["check_personalized", "personalized_flags", "shared_leaves"]  # the first two: _checks


def shared_leaves(personalized: Any, params: Any) -> Any:
    """The ``shared`` argument of :func:`karula_jax.algorithms._trees.stack_clients`.

    Returns:
      None when no leaf is shared (every leaf per client), else a pytree of bools with
      the structure of ``params``, True on the shared leaves (the complement of
      :func:`personalized_flags`).
    """
    flags = personalized_flags(personalized, params)
    if all(jax.tree.leaves(flags)):
        return None
    return jax.tree.map(lambda flag: not flag, flags)
