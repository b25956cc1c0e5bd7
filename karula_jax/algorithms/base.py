"""The interface every federated algorithm implements, and the state it carries.

An algorithm is a factory that closes over its hyperparameters and returns an
:class:`Algorithm` of pure functions (optax style). The training driver only ever
sees these three functions, so Karula and every baseline run on the same engine:

* ``init(params, data, *, key) -> FedState``: ``params`` is ONE model (a pytree,
  no client axis); every client starts from it.
* ``round(state, data) -> (state, RoundInfo)``: one communication round; pure and
  jit/scan/vmap friendly (no Python control flow on traced values).
* ``client_params(state, data) -> pytree``: the model each client would use for
  evaluation, leaves with a leading client axis ``[n, ...]``.

``data`` is a :class:`karula_jax.data.ClientData` passed as an argument (never
closed over) so that runs can be vmapped over data sets and sharded over clients.
A user loss has the signature ``loss(params, x, y, mask) -> scalar``: ``params`` is
one client's model, ``x`` ``[B, ...]``, ``y`` ``[B, ...]``, ``mask`` ``[B]`` bool; it
returns the mean loss over the rows where ``mask`` is True.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp

__all__ = ["Algorithm", "FedState", "LossFn", "RoundInfo"]

LossFn = Callable[[Any, jnp.ndarray, jnp.ndarray, jnp.ndarray], jnp.ndarray]


class FedState(NamedTuple):
    """State carried across rounds by ``lax.scan``.

    Attributes:
      params: per-client models, pytree with leaves ``[n, ...]``; a leaf common to
        every client (a global model's, a shared layer's) may be stored once as
        ``[1, ...]``. Read models through ``Algorithm.client_params``, which always
        gives leaves ``[n, ...]``.
      memory: per-client gradient memory, the tree structure of ``params`` with every
        leaf ``[n, ...]``; ``()`` when the algorithm keeps none.
      proj_state: projection warm start (dual state), ``()`` when unused.
      extra: algorithm-specific state (IFCA cluster models, pFedMe global model...),
        ``()`` when unused.
      key: PRNG key of the run; round ``k`` uses ``fold_in(key, k)``.
      round: round counter, int32 scalar.
    """

    params: Any  # pytree, leaves [n, ...] or [1, ...] (stored once)
    memory: Any  # pytree like params, or ()
    proj_state: Any  # pytree, or ()
    extra: Any  # pytree, or ()
    key: jnp.ndarray  # [2] uint32 (or typed key)
    round: jnp.ndarray  # [] int32


class RoundInfo(NamedTuple):
    """Diagnostics of one round (all scalars unless noted).

    Attributes:
      loss: mean training loss of the participants on their minibatches, weighted by
        alpha_i, before the update.
      participants: boolean mask ``[n]`` of the clients sampled this round.
      proj_delta: certified suboptimality of the projection (0 when there is none).
      proj_violation: max constraint violation after the projection (0 when none).
      proj_iterations: projection solver iterations (0 when none).
      proj_converged: whether the projection met its tolerance within its iteration cap
        (True when there is none). An unconverged projection is still exactly feasible
        but only ``proj_delta``-optimal; :func:`karula_jax.training.run` reports such
        rounds.
      finite: False if any loss, gradient or parameter became NaN/inf this round.
    """

    loss: jnp.ndarray  # [] float32
    participants: jnp.ndarray  # [n] bool
    proj_delta: jnp.ndarray  # [] float32
    proj_violation: jnp.ndarray  # [] float32
    proj_iterations: jnp.ndarray  # [] int32
    proj_converged: jnp.ndarray  # [] bool
    finite: jnp.ndarray  # [] bool


class Algorithm(NamedTuple):
    """A federated algorithm as pure functions (see module docstring)."""

    init: Callable[..., FedState]
    round: Callable[..., tuple[FedState, RoundInfo]]
    client_params: Callable[..., Any]
