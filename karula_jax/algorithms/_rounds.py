"""Round bookkeeping shared by every algorithm: its start state, its draws, its info.

The objective is ``f(theta) = (1/n) sum_i alpha_i f_i(theta_i)`` where ``f_i`` is the mean
loss over client ``i``'s real rows and ``alpha_i`` are the client weights
(``client_weights(counts)``: proportional to ``N_i``, mean 1, unless overridden). A round
starts with :func:`begin_round` (checks, weights, participants, minibatch key) and a method
without a projection reports :func:`round_info` (the alpha-weighted loss).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from karula_jax.algorithms._sampling import sample_participants
from karula_jax.algorithms._trees import stack_clients, weighted_mean
from karula_jax.algorithms._validation import (
    check_clients_per_round,
    check_state_matches,
    resolve_weights,
)
from karula_jax.algorithms.base import FedState, RoundInfo

__all__ = ["RoundStart", "begin_round", "own_params", "round_info", "start_state"]


def start_state(
    params: Any, n: int, key_run, *, memory: Any = (), extra: Any = (), shared: Any = None
):
    """The state of round 0 when every client starts from one model ``params``
    (``shared``: leaves stored once, see
    :func:`karula_jax.algorithms._trees.stack_clients`)."""
    return FedState(
        params=stack_clients(params, n, shared=shared),
        memory=memory,
        proj_state=(),
        extra=extra,
        key=key_run,
        round=jnp.zeros((), jnp.int32),
    )


class RoundStart(NamedTuple):
    """What every round draws before its method-specific work (see :func:`begin_round`)."""

    alpha: jnp.ndarray  # [n] float32, client weights
    mask: jnp.ndarray  # [n] bool, participants
    idx: jnp.ndarray  # [s] int32, participant indices
    key_batch: jnp.ndarray  # key for the participants' minibatches


def begin_round(state, data, s: int, weights) -> RoundStart:
    """Checks ``s``, resolves weights and draws this round's participants.

    Every method derives its round key as ``fold_in(state.key, state.round)`` and splits it
    into a participation key and a minibatch key, so one run key gives the same
    participants and minibatches in every method.
    """
    check_state_matches(state, data)
    n = data.num_clients
    check_clients_per_round(s, n)
    alpha = resolve_weights(weights, data)
    key_part, key_batch = jax.random.split(jax.random.fold_in(state.key, state.round))
    mask, idx = sample_participants(key_part, n, s)
    return RoundStart(alpha, mask, idx, key_batch)


def round_info(values, a_s, mask, finite):
    """RoundInfo of a method without a projection: alpha-weighted loss, zero projection stats.

    Args:
      values: participants' minibatch losses ``[s]``.
      a_s: participants' weights ``[s]``.
      mask: participants ``[n]`` bool.
      finite: scalar bool, False if anything of the round became NaN/inf.
    """
    return RoundInfo(
        loss=weighted_mean(values, a_s),
        participants=mask,
        proj_delta=jnp.zeros((), jnp.float32),
        proj_violation=jnp.zeros((), jnp.float32),
        proj_iterations=jnp.zeros((), jnp.int32),
        proj_converged=jnp.ones((), bool),
        finite=finite,
    )


def own_params(state, data):
    """``client_params`` of every method whose state holds each client's model: leaves
    ``[n, ...]`` (leaves stored once, ``[1, ...]``, broadcast to every client)."""
    n = data.num_clients
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *jnp.shape(a)[1:])), state.params)
