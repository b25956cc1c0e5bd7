"""Padded, client-stacked data: the one container every other module consumes.

Clients hold different numbers of samples. To run all of them in one compiled
program we pad every client to the largest count ``N_max`` and carry the true
counts alongside; ``mask`` marks the real rows so padding never reaches a loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax._checks import (
    check_finite,
    check_floating_dtype,
    check_positive_int,
    check_real_array,
    concrete,
)

__all__ = ["ClientData", "client_weights", "from_client_arrays"]


class _Fields(NamedTuple):
    x: jnp.ndarray  # [n, N_max, ...] float32
    y: jnp.ndarray  # [n, N_max, ...] float32 or int32
    counts: jnp.ndarray  # [n] int32


class ClientData(_Fields):
    """Data of ``n`` clients padded to a common size.

    Attributes:
      x: features, array of shape ``[n, N_max, *feature_shape]``, floating; padded rows
        are 0.
      y: targets, array of shape ``[n, N_max, *target_shape]`` (integer labels for
        classification, floats for regression); padded rows are 0.
      counts: number of real samples per client, integer array of shape ``[n]``, each in
        ``[0, N_max]``.

    Stacks of data sets (``x [S, n, N_max, ...]``, ``counts [S, n]``) are allowed: the
    axes of ``counts`` lead ``x`` and ``y``, and the next axis is the padded one.

    Construction validates: when the three fields are arrays (or tracers, or
    ``jax.ShapeDtypeStruct``) their shapes must agree, ``x`` must be floating, ``y`` real
    and ``counts`` integer; when ``counts`` is concrete its values must lie in
    ``[0, N_max]``. Fields that are not arrays (``None``, vmap axes, partition specs) are
    not checked. JAX transformations rebuild the tuple without validating (it is
    registered as a pytree node), and values are never scanned for NaN here (the
    consumers do that: :func:`from_client_arrays`, the embedding, ``RoundInfo.finite``).

    Raises:
      TypeError: a non-floating ``x``, complex ``y``, non-integer ``counts``, or a mix of
        arrays and non-arrays.
      ValueError: shapes that do not match, or counts outside ``[0, N_max]``.
    """

    __slots__ = ()

    def __new__(cls, x, y, counts):
        _validate(x, y, counts)
        return super().__new__(cls, x, y, counts)

    @classmethod
    def _make(cls, iterable):  # used by ``_replace``: validate there too
        return cls(*iterable)

    @property
    def num_clients(self) -> int:
        return self.x.shape[0]

    @property
    def max_count(self) -> int:
        return self.x.shape[1]

    @property
    def mask(self) -> jnp.ndarray:
        """Boolean array of shape ``[n, N_max]``: True on real samples."""
        return jnp.arange(self.max_count)[None, :] < self.counts[:, None]

    def subset(self, clients) -> ClientData:
        """The data of the clients with the given indices (same padding).

        Args:
          clients: a 1-D sequence of client indices in ``[0, n)`` (repeats allowed,
            negative indices are not), or a boolean mask of shape ``[n]``.

        Raises:
          TypeError: indices that are not integers (or a boolean mask).
          ValueError: an index outside ``[0, n)``, a mask of the wrong shape, or no client.
        """
        n = self.num_clients
        idx = np.asarray(clients)
        if idx.dtype == bool:
            if idx.shape != (n,):
                raise ValueError(
                    f"clients as a boolean mask must have shape ({n},), got {idx.shape}"
                )
            idx = np.flatnonzero(idx)
        elif idx.size and not np.issubdtype(idx.dtype, np.integer):
            raise TypeError(f"clients must hold integer client indices, got dtype {idx.dtype}")
        if idx.ndim != 1:
            raise ValueError(f"clients must be a 1-D sequence of indices, got shape {idx.shape}")
        if idx.size == 0:
            raise ValueError("clients must select at least one client, got none")
        if idx.min() < 0 or idx.max() >= n:
            bad = idx[(idx < 0) | (idx >= n)][0]
            raise ValueError(f"clients must be indices in [0, {n}), got {bad}")
        return ClientData(self.x[idx], self.y[idx], self.counts[idx])


def _is_array(a) -> bool:
    return isinstance(a, np.ndarray | jax.Array)


def _has_shape(a) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype")


def _validate(x, y, counts) -> None:
    fields = {"x": x, "y": y, "counts": counts}
    for name, a in fields.items():
        # nested lists are data, never a placeholder: they would pass here and fail deep in
        # the first run (lists of per-client arrays are from_client_arrays' input)
        if isinstance(a, list):
            raise TypeError(
                f"ClientData: {name} must be an array, got a list (np.asarray it, or build "
                "per-client lists with karula_jax.data.from_client_arrays)"
            )
    if not all(_has_shape(a) for a in fields.values()):
        if any(_is_array(a) for a in fields.values()):
            name = next(k for k, a in fields.items() if not _has_shape(a))
            raise TypeError(
                f"ClientData: {name} must be an array (x, y and counts are arrays together), "
                f"got {type(fields[name]).__name__}"
            )
        return  # a pytree of placeholders (vmap axes, specs...): nothing to check
    if any(a.dtype == jax.dtypes.float0 for a in fields.values()):
        return  # tangents of integer fields
    if not jnp.issubdtype(counts.dtype, jnp.integer):
        raise TypeError(f"ClientData: counts must hold integers, got dtype {counts.dtype}")
    if len(counts.shape) < 1:
        raise ValueError(f"ClientData: counts must have shape [n], got shape {counts.shape}")
    lead = tuple(counts.shape)
    b = len(lead)
    for name, a in (("x", x), ("y", y)):
        if len(a.shape) < b + 1 or tuple(a.shape[:b]) != lead:
            want = ", ".join(str(s) for s in lead)
            raise ValueError(
                f"ClientData: {name} must have shape [{want}, N_max, ...] (leading axes "
                f"of counts, then the padded axis), got {tuple(a.shape)}"
            )
    if x.shape[b] != y.shape[b]:
        raise ValueError(
            f"ClientData: x and y must share the padded axis N_max, got x {tuple(x.shape)} "
            f"and y {tuple(y.shape)}"
        )
    check_real_array("ClientData: x", x, floating=True)
    check_real_array("ClientData: y", y)
    c = concrete(counts) if _is_array(counts) else None
    if c is not None and c.size and (c.min() < 0 or c.max() > x.shape[b]):
        raise ValueError(
            f"ClientData: counts must lie in [0, N_max={x.shape[b]}], got values from "
            f"{c.min()} to {c.max()}"
        )


def _flatten_with_keys(d):
    return tuple((jax.tree_util.GetAttrKey(k), v) for k, v in zip(d._fields, d, strict=True)), None


def _unflatten(_, children):
    # Transformations rebuild ClientData with tracers, None or other placeholders:
    # bypass the validating constructor.
    return tuple.__new__(ClientData, children)


jax.tree_util.register_pytree_with_keys(
    ClientData, _flatten_with_keys, _unflatten, flatten_func=lambda d: (tuple(d), None)
)


def _half_precision(dtype) -> bool:
    """Whether ``dtype`` is float16 or bfloat16 (False for what is not a dtype at all)."""
    try:
        return np.dtype(dtype).name in ("float16", "bfloat16")
    except TypeError:
        return False


def from_client_arrays(
    xs: Sequence[np.ndarray],
    ys: Sequence[np.ndarray],
    *,
    num_classes: int | None = None,
    max_count: int | None = None,
    dtype=jnp.float32,
) -> ClientData:
    """Builds :class:`ClientData` from per-client arrays, validating them.

    Args:
      xs: one array per client, shape ``[N_i, *feature_shape]``; all clients must share
        ``feature_shape``.
      ys: one array per client, shape ``[N_i, *target_shape]``.
      num_classes: if given, targets are class labels: they must be integers in
        ``[0, num_classes)`` and are stored as int32.
      max_count: pad to this many rows instead of ``max_i N_i`` (useful to keep shapes
        static across data sets); must be at least ``max_i N_i``.
      dtype: float32 or float64, for features (and regression targets); values are
        checked to be finite after the cast to it (as JAX stores it: float64 is float32
        unless x64 is enabled). Half precisions are refused: the step-size rules and
        solvers run LAPACK, which has no float16 or bfloat16.

    Returns:
      The padded :class:`ClientData`.

    Raises:
      ValueError: on empty input, mismatched lengths or shapes, empty clients,
        NaN/infinite values (also values that overflow ``dtype``), labels that are not
        integers in range, or a bad ``num_classes``/``max_count``.
      TypeError: when an element is not array-like, is complex or not numeric, or when
        ``dtype`` is not float32 or float64.

    Examples:
      >>> import numpy as np
      >>> from karula_jax.data import from_client_arrays
      >>> xs = [np.ones((3, 2)), np.zeros((1, 2))]  # client 0: 3 rows, client 1: 1 row
      >>> ys = [np.array([0, 1, 1]), np.array([2])]
      >>> data = from_client_arrays(xs, ys, num_classes=3)
      >>> data.x.shape, data.y.dtype, data.counts.tolist()
      ((2, 3, 2), dtype('int32'), [3, 1])
      >>> data.mask.tolist()  # padding never reaches a loss
      [[True, True, True], [True, False, False]]
    """
    if _half_precision(dtype):
        raise TypeError(
            f"dtype must be float32 or float64, got {np.dtype(dtype).name} (half precision "
            f"is not supported: the step-size rules and solvers run LAPACK, which has none)"
        )
    # What JAX will store (float64 becomes float32 unless x64 is enabled).
    dt = np.dtype(jax.dtypes.canonicalize_dtype(check_floating_dtype("dtype", dtype)))
    if num_classes is not None:
        num_classes = check_positive_int("num_classes", num_classes)
        if num_classes > np.iinfo(np.int32).max:
            raise ValueError(
                f"num_classes must be at most 2**31 - 1 (labels are stored as int32), "
                f"got {num_classes}"
            )
    if max_count is not None:
        max_count = check_positive_int("max_count", max_count)
    for name, seq in (("xs", xs), ("ys", ys)):
        if isinstance(seq, str | bytes) or not hasattr(seq, "__len__"):
            raise TypeError(f"{name} must be a sequence of per-client arrays, got {seq!r}")
    if len(xs) == 0:
        raise ValueError("xs must hold at least one client, got an empty sequence")
    if len(xs) != len(ys):
        raise ValueError(f"xs and ys must have one entry per client, got {len(xs)} and {len(ys)}")
    xs_np, ys_np = [], []
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        try:
            x = np.asarray(x)
            y = np.asarray(y)
        except Exception as e:  # noqa: BLE001 - re-raised with context
            raise TypeError(f"client {i}: xs and ys entries must be array-like ({e})") from e
        if x.ndim < 1 or x.shape[0] == 0:
            raise ValueError(f"client {i} has no samples (xs[{i}].shape = {x.shape})")
        if y.ndim < 1 or y.shape[0] != x.shape[0]:
            raise ValueError(
                f"client {i}: xs[{i}] has {x.shape[0]} rows but ys[{i}] has shape {y.shape}"
            )
        check_real_array(f"xs[{i}]", x)
        check_real_array(f"ys[{i}]", y)
        check_finite(f"xs[{i}]", x)
        check_finite(f"ys[{i}]", y)
        x = _cast(f"xs[{i}]", x, dt)
        if x.ndim == 1:
            x = x[:, None]
        if xs_np and x.shape[1:] != xs_np[0].shape[1:]:
            raise ValueError(
                f"feature shapes differ between clients: xs[0] has {xs_np[0].shape[1:]}, "
                f"xs[{i}] has {x.shape[1:]}"
            )
        if ys_np and y.shape[1:] != ys_np[0].shape[1:]:
            raise ValueError(
                f"target shapes differ between clients: ys[0] has {ys_np[0].shape[1:]}, "
                f"ys[{i}] has {y.shape[1:]}"
            )
        if num_classes is not None:
            if np.issubdtype(y.dtype, np.floating):
                if not np.all(y == np.round(y)):
                    raise ValueError(f"ys[{i}] must hold integer class labels, found non-integers")
            elif not np.issubdtype(y.dtype, np.integer):
                raise TypeError(f"ys[{i}] must hold integer class labels, got dtype {y.dtype}")
            if y.size and (y.min() < 0 or y.max() >= num_classes):
                raise ValueError(
                    f"ys[{i}] labels must lie in [0, {num_classes}), found range "
                    f"[{y.min()}, {y.max()}]"
                )
            y = y.astype(np.int32)
        else:
            y = _cast(f"ys[{i}]", y, dt)
        xs_np.append(x)
        ys_np.append(y)

    counts = np.array([x.shape[0] for x in xs_np], dtype=np.int32)
    n_max = int(counts.max())
    if max_count is not None:
        if max_count < n_max:
            raise ValueError(f"max_count={max_count} is smaller than the largest client ({n_max})")
        n_max = max_count
    x_pad = np.zeros((len(xs_np), n_max, *xs_np[0].shape[1:]), dtype=dt)
    y_pad = np.zeros((len(ys_np), n_max, *ys_np[0].shape[1:]), dtype=ys_np[0].dtype)
    for i, (x, y) in enumerate(zip(xs_np, ys_np, strict=True)):
        x_pad[i, : x.shape[0]] = x
        y_pad[i, : y.shape[0]] = y
    return ClientData(jnp.asarray(x_pad), jnp.asarray(y_pad), jnp.asarray(counts))


def _cast(name: str, a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``a`` in ``dtype``; ValueError when finite values overflow it (e.g. 1e39 in float32)."""
    with np.errstate(over="ignore"):
        out = a.astype(dtype)
    if not np.all(np.isfinite(out)):
        raise ValueError(
            f"{name} has values too large for {dtype} (largest magnitude "
            f"{np.max(np.abs(a.astype(np.float64)))}); rescale the data"
        )
    return out


def client_weights(counts) -> jnp.ndarray:
    """Client weights ``alpha_i`` proportional to ``N_i``, normalized so mean(alpha) = 1.

    Args:
      counts: array of shape ``[n]`` of sample counts ``>= 0``, not all zero (a client
        with no sample gets weight 0).

    Returns:
      Float32 array of shape ``[n]``.

    Raises:
      ValueError: (concrete counts) not of shape ``[n]``, negative, non-finite or all 0.

    Examples:
      >>> from karula_jax.data import client_weights
      >>> client_weights([10, 30]).tolist()
      [0.5, 1.5]
    """
    c = concrete(counts)
    if c is not None:
        if c.ndim != 1 or c.size == 0:
            raise ValueError(f"counts must have shape [n] with n >= 1, got shape {c.shape}")
        check_real_array("counts", c)
        check_finite("counts", c)
        if np.any(c < 0) or not np.any(c > 0):
            raise ValueError(f"counts must be >= 0 and not all zero, got {c.tolist()}")
    counts = jnp.asarray(counts, dtype=jnp.float32)
    return counts * counts.shape[0] / jnp.sum(counts)
