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
import numpy as np

from karula_jax._checks import check_bool_leaves

__all__ = ["check_personalized", "personalized_flags", "shared_leaves"]


def check_personalized(personalized: Any) -> None:
    """Factory-time check of ``personalized`` (its structure is checked at ``init``).

    Raises:
      ValueError: ``personalized`` is None.
      TypeError: a leaf is not a Python (or numpy) bool.
    """
    if personalized is None:
        raise ValueError(
            "personalized=None is not accepted (it meant every leaf in some methods and no "
            "leaf in others): pass True (every leaf per client), False (every leaf shared) "
            "or a pytree of bools shaped like params (True = per client)"
        )
    check_bool_leaves("personalized", personalized)


def personalized_flags(personalized: Any, params: Any) -> Any:
    """``personalized`` as a pytree of Python bools with the structure of ``params``.

    Args:
      personalized: a bool or a pytree of bools (see the module docstring).
      params: any pytree shaped like one client's model (leaves of any shape; a
        client-stacked tree has the same structure).

    Returns:
      A pytree with the structure of ``params`` whose leaves are Python bools, True on
      the per-client leaves.

    Raises:
      ValueError: ``personalized`` is None, or a pytree of another structure than
        ``params``.
      TypeError: a leaf of ``personalized`` is not a bool.
    """
    check_personalized(personalized)
    if isinstance(personalized, bool | np.bool_):
        return jax.tree.map(lambda _: bool(personalized), params)
    want, got = jax.tree.structure(params), jax.tree.structure(personalized)
    if want != got:
        raise ValueError(
            f"personalized must have the tree structure of params {want}, got {got} "
            "(or be True or False for every leaf)"
        )
    return jax.tree.map(bool, personalized)


def shared_leaves(personalized: Any, params: Any) -> Any:
    """The ``shared`` argument of :func:`karula_jax.algorithms._common.stack_clients`.

    Returns:
      None when no leaf is shared (every leaf per client), else a pytree of bools with
      the structure of ``params``, True on the shared leaves (the complement of
      :func:`personalized_flags`).
    """
    flags = personalized_flags(personalized, params)
    if all(jax.tree.leaves(flags)):
        return None
    return jax.tree.map(lambda flag: not flag, flags)
