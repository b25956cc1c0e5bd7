"""Checks that an algorithm's arguments fit its data: weights, params, labels, state.

Factories validate their hyperparameters (:mod:`karula_jax._checks`); every ``init``
validates ``params`` against the data with :func:`check_params` (a model that does not fit
the data is a ValueError naming ``params`` and both shapes) and its key; every round checks
that the state and the data have the same number of clients (:func:`check_state_matches`)
and that ``s <= n`` (:func:`check_clients_per_round`). Client weights ``alpha`` are
``client_weights(counts)`` (proportional to ``N_i``, mean 1) unless overridden
(:func:`resolve_weights`, checked by :func:`check_weights`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax._checks import concrete, defer
from karula_jax.data.clients import ClientData, client_weights

__all__ = [
    "check_clients_per_round",
    "check_labels",
    "check_params",
    "check_state_matches",
    "check_weights",
    "resolve_weights",
]


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
