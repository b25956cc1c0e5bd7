"""Argument validators shared by the whole library (private).

Every public function checks its arguments with these and raises a ``ValueError`` or
``TypeError`` whose message names the argument and says what was expected. Values that
are traced (inside ``jit``/``vmap``/``grad``) cannot be inspected: the checks of shapes
and dtypes still run, and the checks of values are *deferred*: inside a
:func:`deferred_checks` block each becomes a traced flag ``(message, ok)`` that the code
which opened the block returns from its program and reports. The training driver opens
one around every ``init`` it compiles (a classifier's labels on traced data) and
``run_many`` one around the factory on every member's traced arguments (a NaN in ``D``, a
negative learning rate); outside a block, and inside a ``vmap``/``scan`` nested in the
block's code, they are skipped.

This module imports nothing from ``karula_jax`` so that every subpackage can use it.
The names below are stable:

* :func:`concrete`, :func:`is_concrete`: is a value known at trace time.
* :func:`check_nonnegative`, :func:`check_positive`: real scalars (may be traced).
* :func:`check_positive_int`: static sizes (Python or numpy ints, never traced).
* :func:`check_finite`: no NaN/inf in an array (deferred when traced).
* :func:`check_real_array`: numeric, not complex (and optionally floating).
* :func:`check_floating_dtype`: a dtype argument that must be floating.
* :func:`check_key`: one PRNG key.
* :func:`deferred_checks`, :func:`defer`, :class:`DeferredChecks`: value checks of
  traced arguments, as flags a program returns.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "DeferredChecks",
    "check_bool_leaves",
    "check_finite",
    "check_floating_dtype",
    "check_key",
    "check_nonnegative",
    "check_personalized",
    "check_positive",
    "check_positive_int",
    "check_real_array",
    "concrete",
    "defer",
    "deferred_checks",
    "is_concrete",
    "personalized_flags",
]

# The open deferred_checks blocks of this thread, innermost last: (trace, found).
_DEFERRED = threading.local()


@jax.tree_util.register_pytree_node_class
class DeferredChecks:
    """The deferred checks of a traced program: static messages, traced flags.

    A pytree whose leaves are the flags (bool arrays, True where the check passed) and
    whose static data are the messages, so a compiled program can return it and the
    caller reads ``messages`` and the flags' values (:meth:`failed`).
    """

    def __init__(self, messages=(), flags=()):
        self.messages = tuple(messages)
        self.flags = tuple(flags)

    def tree_flatten(self):
        return self.flags, self.messages

    @classmethod
    def tree_unflatten(cls, messages, flags):
        return cls(messages, flags)

    def failed(self) -> list[tuple[str, np.ndarray]]:
        """``(message, bad)`` of every check that failed somewhere, each message once;
        ``bad``: where it failed (a bool numpy array of the flag's shape)."""
        merged: dict[str, np.ndarray] = {}
        for message, ok in zip(self.messages, self.flags, strict=True):
            bad = ~np.asarray(ok, bool)
            merged[message] = merged[message] | bad if message in merged else bad
        return [(m, bad) for m, bad in merged.items() if bad.any()]


@contextlib.contextmanager
def deferred_checks() -> Iterator[list[tuple[str, jax.Array]]]:
    """Collects the value checks of traced arguments made inside the block.

    Yields a list that fills with ``(message, ok)`` pairs, one per check that a traced
    value made at the block's own trace level (``message``: what is wrong where ``ok``
    is False, naming the argument; ``ok``: a traced bool array). Checks made inside a
    nested transformation of the block's code (a ``vmap`` or ``scan`` body) are skipped:
    their flags belong to that inner trace. Open it around code that builds or
    initializes something from traced arguments and return the flags from the same
    trace (e.g. as a :class:`DeferredChecks`).
    """
    from jax._src import core  # noqa: PLC0415 - the current trace; no public API for it

    stack = _DEFERRED.__dict__.setdefault("stack", [])
    found: list[tuple[str, jax.Array]] = []
    stack.append((core.trace_ctx.trace, found))
    try:
        yield found
    finally:
        stack.pop()


def defer(message: str, ok) -> None:
    """Records a check of a traced value in the innermost :func:`deferred_checks` block.

    Args:
      message: what is wrong where the check fails, naming the argument (e.g.
        ``"dissimilarity D contains NaN"``).
      ok: bool array, True where the value passes (kept unreduced: a batched caller
        passes one flag per batch member).

    Outside a block, or inside a transformation nested in the block's code, nothing is
    recorded (the check is skipped, as without a block).
    """
    from jax._src import core  # noqa: PLC0415

    stack = getattr(_DEFERRED, "stack", None)
    if stack and stack[-1][0] is core.trace_ctx.trace:
        stack[-1][1].append((message, jnp.asarray(ok, bool)))


def _defer_range(name: str, value, *, positive: bool, allow_inf: bool) -> None:
    """The deferred form of the checks of :func:`check_nonnegative`/:func:`check_positive`."""
    x = jnp.asarray(value)
    if not jnp.issubdtype(x.dtype, jnp.number) or jnp.issubdtype(x.dtype, jnp.complexfloating):
        return  # a dtype error is raised by the concrete checks; nothing to defer
    defer(f"{name} is NaN", ~jnp.any(jnp.isnan(x)))
    if positive:
        defer(f"{name} is <= 0 (it must be > 0)", ~jnp.any(x <= 0))
    else:
        defer(f"{name} is negative (it must be >= 0)", ~jnp.any(x < 0))
    if not allow_inf:
        defer(f"{name} is infinite (it must be finite)", ~jnp.any(jnp.isinf(x)))


def concrete(x) -> np.ndarray | None:
    """``x`` as a numpy array when it is a concrete value, ``None`` when it is traced."""
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def is_concrete(*xs) -> bool:
    """True iff none of ``xs`` is a tracer."""
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _real_scalar(name: str, value) -> float | None:
    """``value`` as a float, ``None`` when traced; TypeError unless a real scalar."""
    v = concrete(value)
    if v is None:
        return None
    if v.dtype == bool or not np.issubdtype(v.dtype, np.number):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    if np.issubdtype(v.dtype, np.complexfloating):
        raise TypeError(f"{name} must be a real number, got complex {value!r}")
    if v.ndim != 0:
        raise TypeError(f"{name} must be a scalar, got an array of shape {v.shape}")
    return float(v)


def check_nonnegative(name: str, value, *, allow_inf: bool = False) -> None:
    """Checks that a real scalar is ``>= 0`` and not NaN (deferred when traced).

    Args:
      name: the argument's name, used in the message.
      value: a Python/numpy/JAX scalar, possibly traced.
      allow_inf: accept ``+inf``.

    Raises:
      TypeError: ``value`` is not a real scalar (a string, an array, complex...).
      ValueError: ``value`` is NaN, negative, or infinite when not allowed.
    """
    v = _real_scalar(name, value)
    if v is None:
        _defer_range(name, value, positive=False, allow_inf=allow_inf)
        return
    if np.isnan(v) or v < 0 or (np.isinf(v) and not allow_inf):
        expected = ">= 0 (may be inf)" if allow_inf else "finite and >= 0"
        raise ValueError(f"{name} must be {expected}, got {v}")


def check_positive(name: str, value) -> None:
    """Checks that a real scalar is finite and ``> 0`` (deferred when traced).

    Raises:
      TypeError: not a real scalar.
      ValueError: NaN, infinite or ``<= 0``.
    """
    v = _real_scalar(name, value)
    if v is None:
        _defer_range(name, value, positive=True, allow_inf=False)
        return
    if not (np.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be finite and > 0, got {v}")


def check_positive_int(name: str, value) -> int:
    """A static size ``>= 1`` as a Python int.

    Raises:
      TypeError: ``value`` is not a Python or numpy int (bools and floats included).
      ValueError: ``value < 1``.
    """
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        got = f"{type(value).__name__} {value!r}"
        raise TypeError(f"{name} must be a positive Python int, got {got}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def check_finite(name: str, array) -> None:
    """ValueError when a concrete numeric ``array`` holds NaN or inf (deferred when traced)."""
    a = concrete(array)
    if a is None:
        if jnp.issubdtype(jnp.result_type(array), jnp.inexact):
            defer(f"{name} contains NaN or infinite values", jnp.all(jnp.isfinite(array)))
        return
    if not np.issubdtype(a.dtype, np.number):
        return
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains NaN or infinite values")


def check_real_array(name: str, array, *, floating: bool = False) -> None:
    """TypeError unless ``array`` (anything with a ``dtype``) is real numeric.

    Args:
      name: the argument's name.
      array: an array, tracer or ``jax.ShapeDtypeStruct``.
      floating: require a floating dtype (bool and integers rejected).
    """
    dtype = array.dtype
    if jnp.issubdtype(dtype, jnp.complexfloating):
        raise TypeError(f"{name} must be real, got complex dtype {dtype}")
    if floating and not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must have a floating dtype, got {dtype}")
    if not (jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)):
        raise TypeError(f"{name} must be numeric, got dtype {dtype}")


def check_floating_dtype(name: str, dtype) -> np.dtype:
    """``dtype`` as a numpy dtype; TypeError unless it is a real floating dtype."""
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{name} must be a floating dtype, got {dtype!r}") from e
    if not np.issubdtype(dt, np.floating):
        raise TypeError(f"{name} must be a floating dtype (e.g. float32), got {dt}")
    return dt


def check_key(name: str, key) -> None:
    """Checks that ``key`` is ONE PRNG key: a typed key scalar or a raw ``uint32[2]``.

    Raises:
      TypeError: ``key`` is None, not an array, or of another dtype.
      ValueError: a key array of the wrong shape (e.g. several stacked keys).
    """
    dtype = getattr(key, "dtype", None)
    if dtype is None:
        raise TypeError(
            f"{name} must be a PRNG key (jax.random.key(seed)), got {type(key).__name__}"
        )
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if jnp.ndim(key) != 0:
            raise ValueError(f"{name} must be one PRNG key, got an array of keys {key.shape}")
        return
    if dtype != jnp.uint32:
        raise TypeError(f"{name} must be a PRNG key (jax.random.key(seed)), got dtype {dtype}")
    if jnp.shape(key) != (2,):
        raise ValueError(f"{name} must be one raw PRNG key of shape (2,), got {jnp.shape(key)}")


def check_bool_leaves(name: str, tree) -> list[bool]:
    """The leaves of a mask pytree, each a Python (or numpy) bool; else ``TypeError``."""
    flags = []
    for flag in jax.tree.leaves(tree):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name}: expected Python bools as leaves, got {type(flag).__name__}")
        flags.append(bool(flag))
    return flags


def check_personalized(personalized: Any) -> None:
    """Check of ``personalized``: a Python bool or a pytree of bools, True = a per-client
    leaf (the meaning of ``karula_jax.algorithms._personalized``). Its structure is checked
    against the model by :func:`personalized_flags` (at ``init`` in a factory).

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


def check_targets(y, rows: tuple[int, ...], what: str = "the model's outputs") -> None:
    """One target per row: a ``ValueError`` unless ``y``'s shape is ``rows`` (static
    shapes, so it also fires when traced). A column of targets ``[B, 1]`` against
    predictions ``[B]`` would otherwise broadcast into ``[B, B]`` and train silently on
    every pair of rows."""
    if tuple(jnp.shape(y)) != tuple(rows):
        raise ValueError(
            f"y must hold one target per row, shape {tuple(rows)} like {what}, got "
            f"{tuple(jnp.shape(y))} (targets given as a column [N_i, 1]? pass [N_i] per client)"
        )
