"""IFCA (Ghosh et al. 2020): k cluster models, each client joins the one that fits it best."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax._checks import check_finite, check_nonnegative, check_positive_int, concrete, defer
from karula_jax.algorithms._local import local_train
from karula_jax.algorithms._rounds import begin_round, round_info
from karula_jax.algorithms._sampling import client_batch, client_keys, init_and_run_keys
from karula_jax.algorithms._trees import all_finite, gather, scatter
from karula_jax.algorithms._validation import check_clients_per_round, check_params, check_weights
from karula_jax.algorithms.base import Algorithm, FedState, LossFn
from karula_jax.data.clients import ClientData

__all__ = ["IFCAState", "ifca", "ifca_assign"]


class IFCAState(NamedTuple):
    """``FedState.extra`` of :func:`ifca`.

    Attributes:
      clusters: the cluster models, pytree with leaves ``[k, ...]`` (``[max_clusters,
        ...]`` with a bound, of which the first ``k`` are in use).
      assignment: cluster each client chose when it last participated (at ``init``:
        the best cluster on its full training data), int32 ``[n]``.
    """

    clusters: Any  # pytree, leaves [k, ...]
    assignment: jnp.ndarray  # [n] int32


def _cluster_losses(loss, clusters, x, y, mask):
    """Loss of every cluster model on one client's rows: ``[k]``."""
    return jax.vmap(lambda c: loss(c, x, y, mask))(clusters)


def _masked(losses, active):
    """``losses`` ``[..., k]`` with the clusters outside ``active`` ``[k]`` (None: all in)
    at ``+inf``, so that no argmin picks them."""
    return losses if active is None else jnp.where(active, losses, jnp.inf)


def ifca_assign(loss: LossFn, clusters: Any, data: ClientData, active=None) -> jnp.ndarray:
    """Best cluster of every client on its full training data.

    Args:
      loss: the user loss.
      clusters: pytree with leaves ``[k, ...]``.
      data: the clients' data.
      active: optional bool ``[k]``, the clusters in use (None: all).

    Returns:
      int32 array of shape ``[n]``: ``argmin_c f_i(clusters[c])`` over the active ``c``
      (ties: lowest ``c``).
    """
    losses = jax.vmap(lambda x, y, m: _cluster_losses(loss, clusters, x, y, m))(
        data.x, data.y, data.mask
    )
    return jnp.argmin(_masked(losses, active), axis=1).astype(jnp.int32)


def _cluster_count(num_clusters, max_clusters):
    """``(capacity, active)``: the number of cluster models the state holds (static) and
    the bool ``[capacity]`` mask of those in use (None: all). Checks both arguments."""
    if max_clusters is None:
        return check_positive_int("num_clusters", num_clusters), None
    cap = check_positive_int("max_clusters", max_clusters)
    expected = f"an integer from 1 to max_clusters={cap}"
    k = concrete(num_clusters)
    if k is not None:
        if k.ndim != 0 or not np.issubdtype(k.dtype, np.number) or k.dtype == bool:
            raise TypeError(f"num_clusters must be {expected}, got {num_clusters!r}")
        if not (1 <= k <= cap and float(k) == round(float(k))):
            raise ValueError(f"num_clusters must be {expected}, got {num_clusters!r}")
    else:
        k = jnp.asarray(num_clusters)
        defer(f"num_clusters is not {expected}", (k >= 1) & (k <= cap) & (k == jnp.round(k)))
    return cap, jnp.arange(cap) < jnp.asarray(k)


def _check_initial_clusters(initial_clusters, k: int, name: str) -> None:
    if initial_clusters is None:
        return
    for leaf in jax.tree.leaves(initial_clusters):
        if jnp.ndim(leaf) < 1 or jnp.shape(leaf)[0] != k:
            raise ValueError(
                f"initial_clusters leaves must have leading axis {name}={k}, "
                f"got shape {jnp.shape(leaf)}"
            )
        check_finite("initial_clusters", leaf)


def _perturbed_clusters(params, key, k: int, init_scale):
    """``k`` clusters, leaves ``[k, ...]``: ``params``, then ``params`` plus noise."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    noisy = []
    for leaf, kk in zip(leaves, keys, strict=True):
        leaf = jnp.asarray(leaf)
        noise = init_scale * jax.random.normal(kk, (k, *leaf.shape), leaf.dtype)
        noisy.append(leaf[None] + noise.at[0].set(0))
    return jax.tree.unflatten(treedef, noisy)


def _average(W, old, rows):
    """Each cluster's ``W``-weighted average of the participants' returned ``rows``
    ``[s, ...]`` (``W`` ``[s, k]``); a cluster no participant chose keeps ``old``."""
    total = jnp.sum(W, axis=0)  # [k]
    shape = (W.shape[1],) + (1,) * (rows.ndim - 1)
    new = jnp.tensordot(W, rows, axes=(0, 0)) / jnp.maximum(total, 1e-30).reshape(shape)
    return jnp.where((total > 0).reshape(shape), new.astype(old.dtype), old)


def ifca(
    loss: LossFn,
    *,
    num_clusters: int,
    learning_rate,
    clients_per_round: int,
    batch_size: int,
    local_steps: int = 5,
    init_scale: float = 0.1,
    initial_clusters: Any = None,
    weights=None,
    max_clusters: int | None = None,
) -> Algorithm:
    """IFCA with model averaging.

    One round: each participant evaluates the ``k`` cluster models on the minibatch of
    its first local step, picks the lowest loss, and runs ``E = local_steps`` SGD steps
    from that model exactly as in :func:`fedavg`; the server replaces each cluster
    model by the ``alpha``-weighted average of the models returned by the participants
    that chose it. A cluster that no participant chose keeps its model. With ``k = 1``
    IFCA equals :func:`fedavg` (same keys, same steps).

    Initialization: cluster 0 is ``params``; cluster ``c >= 1`` is ``params`` plus
    independent ``N(0, init_scale^2)`` noise on every entry (seeded by ``init``'s key),
    unless ``initial_clusters`` is given.

    Evaluation (``client_params``): each client uses the cluster model with the lowest
    loss on its full training data (:func:`ifca_assign`). ``state.params`` holds, for
    each client, the current model of the cluster it chose when it last participated.

    With ``max_clusters``, ``k`` may be traced (a grid of ``k``, one program): the state
    holds ``max_clusters`` models, drawn as for that many, those from ``k`` on never
    chosen. Under jax's default ``jax_threefry_partitionable=True`` the first ``k`` draws
    equal a static ``k``'s, so the runs equal static-``k`` runs up to float rounding.

    Args:
      loss: ``loss(params, x, y, mask) -> scalar``.
      num_clusters: ``k >= 1``: a Python int (static), or with ``max_clusters`` an
        integer-valued scalar up to it (traced allowed).
      learning_rate: local step size ``>= 0``; may be traced.
      clients_per_round: ``s`` (static).
      batch_size: ``B`` (static).
      local_steps: ``E`` (static), default 5.
      init_scale: standard deviation of the perturbation of clusters ``1..k-1``.
      initial_clusters: optional pytree with leaves ``[k, ...]`` (``[max_clusters, ...]``
        with ``max_clusters``) replacing the default initialization.
      weights: optional ``alpha`` of shape ``[n]``.
      max_clusters: optional static bound on ``num_clusters`` (see above).

    Returns:
      An :class:`Algorithm` with ``state.extra`` an :class:`IFCAState`.
    """
    k, active = _cluster_count(num_clusters, max_clusters)
    check_nonnegative("learning_rate", learning_rate)
    s = check_positive_int("clients_per_round", clients_per_round)
    B = check_positive_int("batch_size", batch_size)
    E = check_positive_int("local_steps", local_steps)
    check_nonnegative("init_scale", init_scale)
    check_weights(weights)
    _check_initial_clusters(
        initial_clusters, k, "num_clusters" if max_clusters is None else "max_clusters"
    )

    def init(params, data: ClientData, *, key) -> FedState:
        check_params(loss, params, data)
        n = data.num_clients
        check_clients_per_round(s, n)
        key_init, key_run = init_and_run_keys(key)
        if initial_clusters is not None:
            clusters = jax.tree.map(jnp.asarray, initial_clusters)
            first = jax.tree.map(lambda c: c[0], clusters)
            check_params(loss, first, data, name="initial_clusters")
        else:
            clusters = _perturbed_clusters(params, key_init, k, init_scale)
        assignment = ifca_assign(loss, clusters, data, active)
        return FedState(
            params=gather(clusters, assignment),
            memory=(),
            proj_state=(),
            extra=IFCAState(clusters=clusters, assignment=assignment),
            key=key_run,
            round=jnp.zeros((), jnp.int32),
        )

    def round_fn(state: FedState, data: ClientData):
        alpha, mask, idx, key_batch = begin_round(state, data, s, weights)
        clusters = state.extra.clusters

        def choose(x, y, c, kk):
            # The rows of local step 0, so the choice costs k losses on one minibatch.
            xb, yb, mb = client_batch(jax.random.fold_in(kk, 0), x, y, c, B)
            losses = _masked(_cluster_losses(loss, clusters, xb, yb, mb), active)
            return jnp.argmin(losses).astype(jnp.int32)

        keys = client_keys(key_batch, idx)
        choice = jax.vmap(choose)(data.x[idx], data.y[idx], data.counts[idx], keys)
        start = gather(clusters, choice)
        start_full = scatter(state.params, idx, start)
        rows, values = local_train(loss, start_full, data, idx, key_batch, E, learning_rate, B)
        a_s = alpha[idx]
        W = jax.nn.one_hot(choice, k, dtype=jnp.float32) * a_s[:, None]  # [s, k]
        clusters = jax.tree.map(lambda c, r: _average(W, c, r), clusters, rows)
        assignment = state.extra.assignment.at[idx].set(choice)
        info = round_info(values, a_s, mask, all_finite(values, rows, clusters))
        new_state = state._replace(
            params=gather(clusters, assignment),
            extra=IFCAState(clusters=clusters, assignment=assignment),
            round=state.round + 1,
        )
        return new_state, info

    def client_params(state: FedState, data: ClientData):
        clusters = state.extra.clusters
        return gather(clusters, ifca_assign(loss, clusters, data, active))

    return Algorithm(init=init, round=round_fn, client_params=client_params)
