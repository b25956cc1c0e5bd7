"""Machinery shared by every algorithm: sampling, minibatches, gathered gradients, checks.

Conventions used throughout ``karula_jax.algorithms``:

* Objective. ``f(theta) = (1/n) sum_i alpha_i f_i(theta_i)`` where ``f_i`` is the mean
  loss over client ``i``'s real rows and ``alpha_i`` are the client weights
  (``client_weights(counts)``: proportional to ``N_i``, mean 1, unless overridden).
* Participation. Each round exactly ``s`` of the ``n`` clients are drawn uniformly
  without replacement from ``fold_in(state.key, state.round)``; gradients are computed
  only for them (gather ``s`` rows, vmap one client's kernel, scatter back).
* Minibatches. ``B`` rows drawn without replacement among a client's own ``N_i`` real
  rows; padding is never drawn. A client with ``N_i < B`` uses all its rows. When
  ``B >= N_max`` every client uses all its rows: the gradient is exact and deterministic.
* Checks. Factories validate their hyperparameters (``karula_jax._checks``); every
  ``init`` validates ``params`` against the data with :func:`check_params` (a model that
  does not fit the data is a ValueError naming ``params`` and both shapes) and its key;
  every round checks that the state and the data have the same number of clients.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from karula_jax._checks import (
    check_finite,
    check_key,
    check_nonnegative,
    check_positive,
    check_positive_int,
    concrete,
    defer,
)
from karula_jax.algorithms.base import FedState, RoundInfo
from karula_jax.data.clients import ClientData, client_weights
from karula_jax.projection.reduction import client_mean

__all__ = [
    "all_finite",
    "broadcast",
    "check_clients_per_round",
    "check_finite",
    "check_labels",
    "client_keys",
    "client_mean",
    "check_nonnegative",
    "check_params",
    "check_positive",
    "check_positive_int",
    "check_state_matches",
    "check_weights",
    "client_batch",
    "concrete",
    "defer",
    "gather",
    "init_and_run_keys",
    "participant_value_and_grads",
    "resolve_weights",
    "run_key",
    "sample_participants",
    "sample_rows",
    "scale_rows",
    "scatter",
    "stack_clients",
    "tree_sq_dist",
    "weighted_mean",
    "RoundStart",
    "begin_round",
    "round_info",
]


# --------------------------------------------------------------------------- checks


def check_clients_per_round(s: int, n: int) -> None:
    """``1 <= s <= n`` (``n`` is known only once data are seen)."""
    if s > n:
        raise ValueError(f"clients_per_round={s} exceeds the number of clients n={n}")


def check_weights(weights, n: int | None = None) -> None:
    """Client weights: shape ``[n]``, finite, >= 0, not all 0 (deferred when traced)."""
    if weights is None:
        return
    w = concrete(weights)
    if w is None:
        w = jnp.asarray(weights)
        defer("weights contain NaN or infinite values", jnp.all(jnp.isfinite(w)))
        defer("weights are negative (they must be >= 0)", jnp.all(~(w < 0)))
        defer("weights are all zero", jnp.any(w > 0))
        return
    if w.ndim != 1 or (n is not None and w.shape[0] != n):
        want = f"[{n}]" if n is not None else "[n]"
        raise ValueError(f"weights must have shape {want}, got {w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or not np.any(w > 0):
        raise ValueError("weights must be finite, >= 0 and not all zero")


def _spec(a) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))


def _shapes(tree) -> str:
    return str(jax.tree.map(lambda a: tuple(jnp.shape(a)), tree))


def check_params(loss, params, data, *, name: str = "params") -> None:
    """Checks that ``loss(params, x, y, mask)`` works on one client's data (abstractly).

    Evaluates the loss's shape with :func:`jax.eval_shape` on one client's padded rows,
    so a model that does not fit the data (a ridge vector of the wrong length, an MLP
    built for another input size) fails here, naming ``name`` and both shapes, instead
    of deep inside XLA during the first round. Works on traced data (only shapes are
    used) and costs one abstract trace of the loss.

    Raises:
      TypeError: ``data`` is not a ClientData, ``params`` has no leaf or a non-floating
        leaf, or the loss does not return a real scalar.
      ValueError: the loss cannot be evaluated on ``params`` and the data's shapes.
    """
    if not isinstance(data, ClientData):
        raise TypeError(f"data must be a ClientData, got {type(data).__name__}")
    if not callable(loss):
        raise TypeError(f"loss must be callable (params, x, y, mask) -> scalar, got {loss!r}")
    leaves = jax.tree.leaves(params)
    if not leaves:
        raise TypeError(f"{name} must be a pytree with at least one array leaf, got {params!r}")
    for leaf in leaves:
        try:
            dtype = jnp.result_type(leaf)
        except TypeError as e:
            raise TypeError(f"{name} leaves must be arrays, got {type(leaf).__name__}") from e
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"{name} leaves must be floating (they are differentiated), got dtype {dtype} "
                f"in {name} of shapes {_shapes(params)}"
            )
    p_spec = jax.tree.map(_spec, params)
    x = jax.ShapeDtypeStruct(data.x.shape[1:], data.x.dtype)
    y = jax.ShapeDtypeStruct(data.y.shape[1:], data.y.dtype)
    mask = jax.ShapeDtypeStruct(data.x.shape[1:2], jnp.bool_)
    try:
        out = jax.eval_shape(loss, p_spec, x, y, mask)
    except Exception as e:  # noqa: BLE001 - re-raised with both shapes
        raise ValueError(
            f"{name} do not fit the data: loss({name}, x, y, mask) fails for {name} of "
            f"shapes {_shapes(params)} and one client's x of shape {x.shape}, y of shape "
            f"{y.shape} ({type(e).__name__}: {e})"
        ) from e
    if not isinstance(out, jax.ShapeDtypeStruct) or out.shape != ():
        got = out.shape if isinstance(out, jax.ShapeDtypeStruct) else type(out).__name__
        raise TypeError(f"loss must return a scalar (mean over the masked rows), got {got}")
    if not jnp.issubdtype(out.dtype, jnp.floating):
        raise TypeError(f"loss must return a floating scalar, got dtype {out.dtype}")
    classes = getattr(loss, "num_classes", None)
    if callable(classes):  # a classifier: its labels must index its logits
        check_labels(data, classes(p_spec, x))


def check_labels(data: ClientData, num_classes: int) -> None:
    """The class labels ``data.y`` ``[n, N_max]`` of the real rows lie in ``[0, C)``.

    Concrete labels are checked now (a ValueError names the clients and labels); traced
    ones are deferred (:func:`karula_jax._checks.defer`: the driver reports them after
    ``init``). Padding rows are not checked.
    """
    C = int(num_classes)
    if data.y.ndim != 2:
        return
    y, counts = concrete(data.y), concrete(data.counts)
    if y is None or counts is None:
        real = jnp.arange(data.y.shape[1])[None, :] < data.counts[:, None]
        inside = (data.y >= 0) & (data.y < C)
        defer(
            f"labels data.y lie outside the model's {C} classes [0, {C}) (its output has "
            f"{C} logits; give it one output per class, or relabel y)",
            jnp.all(inside | ~real),
        )
        return
    real = np.arange(y.shape[1])[None, :] < counts[:, None]
    with np.errstate(invalid="ignore"):
        bad = real & ~((y >= 0) & (y < C))
    if bad.any():
        clients = np.flatnonzero(bad.any(axis=1))
        i = int(clients[0])
        found = np.unique(y[i][bad[i]])[:5].tolist()
        raise ValueError(
            f"labels data.y lie outside the model's {C} classes [0, {C}) (its output has {C} "
            f"logits): client {i} has label(s) {found}; clients with such labels: "
            f"{clients[:8].tolist()}{' ...' if len(clients) > 8 else ''}. Give the model one "
            "output per class, or relabel y."
        )


def check_state_matches(state, data: ClientData) -> None:
    """ValueError when ``state`` was built for another number of clients than ``data``."""
    if not isinstance(data, ClientData):
        raise TypeError(f"data must be a ClientData, got {type(data).__name__}")
    # Leaves with a leading axis of 1 may be stored once for every client (stack_clients).
    leaves = jax.tree.leaves((state.params, state.memory))
    sizes = {jnp.shape(a)[0] for a in leaves if jnp.ndim(a)} - {1}
    if sizes and sizes != {data.num_clients}:
        raise ValueError(
            f"data hold {data.num_clients} clients but state was initialized for {max(sizes)}"
        )


def resolve_weights(weights, data: ClientData) -> jnp.ndarray:
    """``alpha`` of shape ``[n]``: the override, else ``client_weights(data.counts)``."""
    if weights is None:
        return client_weights(data.counts)
    check_weights(weights, data.num_clients)
    return jnp.asarray(weights, dtype=jnp.float32)


# --------------------------------------------------------------------------- trees


def gather(tree: Any, idx: jnp.ndarray) -> Any:
    """Rows ``idx`` of every leaf (leading client axis).

    A leaf stored once for every client (leading axis 1, see :func:`stack_clients`) gives
    its one row to every index; for such a leaf this equals indexing, without the copy.
    """

    def rows(a):
        if jnp.shape(a)[0] == 1:
            return jnp.broadcast_to(a, (idx.shape[0], *jnp.shape(a)[1:]))
        return a[idx]

    return jax.tree.map(rows, tree)


def scatter(tree: Any, idx: jnp.ndarray, rows: Any, *, after: Any = None) -> Any:
    """``tree`` with rows ``idx`` of every leaf replaced by ``rows``.

    ``after``: values computed from reads of ``tree`` (e.g. a direction built from the
    memory). The write then depends on them, so it is ordered after every read and XLA
    updates a donated ``tree`` in place; with a read left unordered it copies the
    whole ``[n, ...]`` leaf, twice, to keep the read correct. ``rows`` are unchanged
    bit for bit.
    """
    if after is not None:
        total = sum(jnp.sum(a.astype(jnp.float32)) for a in jax.tree.leaves(after))
        always = (total == total) | (total != total)  # True, NaN included; not folded
        rows = jax.tree.map(lambda b: jnp.where(always, b, jnp.zeros_like(b)), rows)
    return jax.tree.map(lambda a, b: a.at[idx].set(b.astype(a.dtype)), tree, rows)


def all_finite(*trees: Any) -> jnp.ndarray:
    """True iff every floating leaf of every tree is free of NaN/inf."""
    leaves = [x for t in trees for x in jax.tree.leaves(t)]
    flags = [jnp.all(jnp.isfinite(x)) for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


def scale_rows(w: jnp.ndarray, a: jnp.ndarray) -> jnp.ndarray:
    """``w[i] * a[i]`` for every row ``i`` of ``a`` (``w`` of shape ``[rows]``)."""
    return (w.reshape((-1,) + (1,) * (a.ndim - 1)) * a).astype(a.dtype)


def weighted_mean(tree: Any, w: jnp.ndarray, *, otherwise: Any = None) -> Any:
    """``sum_i w_i tree[i] / sum_i w_i`` over the leading axis of every leaf.

    Where the weights sum to 0 (a round whose participants all weigh 0: ``weights`` with
    zeros, clients without rows), ``otherwise``: a tree shaped like one row, what the
    caller keeps then (its model as it was, a zero step); default the plain mean over the
    leading axis. Never ``0 / 0``.
    """
    total = jnp.sum(w)
    empty = ~(total > 0)
    safe = jnp.where(empty, 1.0, total)
    mean = jax.tree.map(lambda a: jnp.tensordot(w, a, axes=1) / safe, tree)
    if otherwise is None:
        otherwise = jax.tree.map(lambda a: jnp.mean(a, axis=0), tree)
    return jax.tree.map(
        lambda m, o, a: jnp.where(empty, o, m).astype(a.dtype), mean, otherwise, tree
    )


def first_row(tree: Any) -> Any:
    """Row 0 of every leaf: the model of a state whose shared leaves are stored once
    (``[1, ...]``); on a per-client leaf, client 0's (callers use it only where shared)."""
    return jax.tree.map(lambda a: a[0], tree)


def broadcast(tree: Any, n: int) -> Any:
    """Every leaf repeated along a new leading client axis of size ``n``."""
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *jnp.shape(a))), tree)


def stack_clients(params: Any, n: int, *, shared: Any = None) -> Any:
    """Every client's copy of one model ``params``, as ``FedState.params`` holds it.

    Leaves are repeated along a leading client axis ``[n, ...]``, except the leaves that
    ``shared`` (a pytree of bools like ``params``; ``None``: none) flags as common to all
    clients: those are stored once, as ``[1, ...]``, so that a global model costs one copy
    and not ``n``. :func:`gather` and :func:`own_params` broadcast them back.
    """
    if shared is None:
        return broadcast(params, n)
    return jax.tree.map(
        lambda flag, a: jnp.asarray(a)[None] if flag else broadcast(a, n), shared, params
    )


def start_state(
    params: Any, n: int, key_run, *, memory: Any = (), extra: Any = (), shared: Any = None
):
    """The state of round 0 when every client starts from one model ``params``
    (``shared``: leaves stored once, see :func:`stack_clients`)."""
    return FedState(
        params=stack_clients(params, n, shared=shared),
        memory=memory,
        proj_state=(),
        extra=extra,
        key=key_run,
        round=jnp.zeros((), jnp.int32),
    )


def client_keys(key: jnp.ndarray, idx: jnp.ndarray) -> jnp.ndarray:
    """``fold_in(key, i)`` for every ``i`` in ``idx``."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(idx)


# --------------------------------------------------------------------------- sampling


def init_and_run_keys(key: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Splits ``init``'s key into (key for init-time draws, ``state.key`` of the run).

    Every algorithm derives ``state.key`` the same way, so one key gives the same
    participants and minibatches in every method (paired comparisons).
    """
    check_key("key", key)
    key_init, key_run = jax.random.split(key)
    return key_init, key_run


def run_key(key: jnp.ndarray) -> jnp.ndarray:
    """``state.key`` of a run started with ``init(..., key=key)``."""
    return init_and_run_keys(key)[1]


def sample_participants(key: jnp.ndarray, n: int, s: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Draws ``s`` of ``n`` clients uniformly without replacement.

    Args:
      key: PRNG key of the round.
      n: number of clients (static).
      s: number of participants (static), ``1 <= s <= n``.

    Returns:
      ``(mask, idx)``: boolean array of shape ``[n]`` with exactly ``s`` True entries,
      and the int32 indices of the participants, shape ``[s]``.
    """
    if s == n:  # everyone: no randomness, and a fixed order keeps runs reproducible
        idx = jnp.arange(n, dtype=jnp.int32)
    else:
        idx = jax.random.permutation(key, n)[:s].astype(jnp.int32)
    mask = jnp.zeros((n,), bool).at[idx].set(True)
    return mask, idx


def sample_rows(key, count, max_count: int, batch_size: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Draws ``B`` rows without replacement among one client's ``count`` real rows.

    Padding rows get key ``+inf`` so that they come after every real row in the
    ordering; the first ``min(B, count)`` picks are therefore real and distinct.

    Args:
      key: PRNG key of this client and step.
      count: number of real rows ``N_i`` (int scalar, may be traced).
      max_count: padded size ``N_max`` (static).
      batch_size: ``B`` (static).

    Returns:
      ``(rows, mask)``: int32 indices of shape ``[min(B, N_max)]`` and a boolean mask of
      the same shape, True on the ``min(B, N_i)`` rows that enter the loss.
    """
    if batch_size >= max_count:  # full batch: all real rows, deterministic
        rows = jnp.arange(max_count, dtype=jnp.int32)
        return rows, rows < count
    u = jax.random.uniform(key, (max_count,))
    u = jnp.where(jnp.arange(max_count) < count, u, jnp.inf)
    _, rows = lax.top_k(-u, batch_size)
    mask = jnp.arange(batch_size) < jnp.minimum(batch_size, count)
    return rows.astype(jnp.int32), mask


def client_batch(key, x, y, count, batch_size):
    """One client's minibatch ``(x_b, y_b, mask_b)`` (see :func:`sample_rows`).

    Rows outside the mask are filled with a copy of the client's first real row, so
    padding values never reach the user's loss, even masked (a loss that multiplies
    by the mask would otherwise turn inf padding into NaN).

    Args:
      key: PRNG key of this client and step; in a round with minibatch key ``k``,
        client ``i``'s step ``e`` uses ``fold_in(fold_in(k, i), e)`` (Karula, FedSGD and
        the SAGA memory use step 0).
      x: the client's padded features ``[N_max, ...]``; y: its targets ``[N_max, ...]``.
      count: its number of real rows ``N_i``.
      batch_size: ``B`` (static).

    Returns:
      ``(x_b, y_b, mask_b)`` with ``min(B, N_max)`` rows and a boolean mask of the rows
      that enter the loss.
    """
    max_count = x.shape[0]
    if batch_size >= max_count:
        rows, mask = jnp.arange(max_count), jnp.arange(max_count) < count
    else:
        rows, mask = sample_rows(key, count, max_count, batch_size)
    rows = jnp.where(mask, rows, 0)
    return x[rows], y[rows], mask


# --------------------------------------------------------------------------- gradients


def _client_value_and_grad(loss, batch_size, params, x, y, count, key):
    xb, yb, mb = client_batch(key, x, y, count, batch_size)
    return jax.value_and_grad(loss)(params, xb, yb, mb)


def participant_value_and_grads(
    loss, params: Any, data: ClientData, idx: jnp.ndarray, key: jnp.ndarray, batch_size: int
) -> tuple[jnp.ndarray, Any]:
    """Minibatch loss and gradient of ``f_i`` at ``params[i]`` for the clients ``idx``.

    Args:
      loss: ``loss(params, x, y, mask) -> scalar``.
      params: client-stacked parameters, leaves ``[n, ...]``.
      data: the clients' padded data.
      idx: participants, int array of shape ``[s]``.
      key: PRNG key of the round's minibatches (client ``i``: ``fold_in(key, i)``).
      batch_size: ``B`` (static).

    Returns:
      ``(values, grads)``: losses of shape ``[s]`` and gradients with leaves ``[s, ...]``
      (unweighted: gradients of ``f_i`` itself).
    """
    # Client i's minibatch uses fold_in(fold_in(key, i), 0): the same rows as step 0 of
    # _local.local_sgd(key=fold_in(key, i)), so FedAvg with E = 1 reproduces FedSGD exactly.
    keys = jax.vmap(lambda k: jax.random.fold_in(k, 0))(client_keys(key, idx))
    kernel = jax.vmap(lambda p, x, y, c, k: _client_value_and_grad(loss, batch_size, p, x, y, c, k))
    return kernel(gather(params, idx), data.x[idx], data.y[idx], data.counts[idx], keys)


def tree_sq_dist(a: Any, b: Any) -> jnp.ndarray:
    """``||a - b||^2`` summed over all leaves of two pytrees of the same structure."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return sum(jnp.sum((x - y) ** 2) for x, y in zip(la, lb, strict=True))


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
