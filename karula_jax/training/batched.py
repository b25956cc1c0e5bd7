"""The batched runner: data sets x seeds x hyperparameter grids as one compiled program.

:func:`run_many` runs a whole batch of independent runs through the loop of
:func:`~karula_jax.training.run` (chunks of ``lax.scan``, progress bar, metrics,
checkpoints and bit-identical resume, non-finite reports): every run is ``jax.vmap``-ed
into the one chunk program. The batch has two kinds of axes:

* the **batch members** ``[S]``: whatever differs between runs as data (CV folds, data
  draws, client subsets, seeds), each member with its own key, optionally its own data
  (``data_per_seed``), initial model (``params_per_seed``) and factory arguments
  (``batch_kwargs``, e.g. its own dissimilarity matrix);
* the **grid** ``[G]`` (``hyper``): hyperparameter values crossed with every member,
  traced, so the grid costs no recompilation.

A factory cannot raise on a traced argument, so before anything runs the factory is
called once more on every member's and grid point's arguments inside a small compiled
program that collects its deferred value checks (:func:`karula_jax._checks.deferred_checks`:
a NaN or negative ``D``, a NaN, negative or infinite learning rate or ``t``...); a failed
check is a ValueError naming the argument, the batch members and grid points, and the
``batch_kwargs``/``hyper`` entries that hold NaN or inf there.

:func:`vmap_algorithm` is the same batch as an :class:`~karula_jax.algorithms.base.Algorithm`
(e.g. to call ``client_params`` on a batched final state); :func:`product_grid` builds
grids.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from karula_jax._checks import DeferredChecks, defer, deferred_checks
from karula_jax.algorithms.base import Algorithm, FedState
from karula_jax.training import checkpoint as ckpt
from karula_jax.training.diagnostics import warn_unconverged, where_in_batch
from karula_jax.training.loop import EvalFn, RunResult, run_chunks
from karula_jax.training.sharding import (
    Placement,
    check_divisible,
    leading_size,
    split_axis,
    split_members,
)

__all__ = ["product_grid", "run_many", "vmap_algorithm"]

SHARD_AXES = ("batch", "clients")

# Options of the chunk loop that run_many passes through, with run's defaults.
_RUN_OPTIONS = {
    "chunk_size": 50,
    "eval_every_chunk": True,
    "checkpoint_dir": None,
    "resume": False,
    "on_nonfinite": "raise",
    "progress": True,
}


def product_grid(**axes) -> dict[str, np.ndarray]:
    """Cartesian product of hyperparameter values, flattened to one grid axis ``[G]``.

    ``product_grid(t=[0, 1], eta=[0.1, 0.2, 0.3])`` gives ``t`` and ``eta`` of length 6,
    ``t`` varying slowest (``np.meshgrid(..., indexing="ij")`` order).
    """
    if not axes:
        raise ValueError("product_grid needs at least one hyperparameter")
    values = [np.asarray(v) for v in axes.values()]
    for name, v in zip(axes, values, strict=True):
        if v.ndim != 1 or v.size == 0:
            raise ValueError(f"{name} must be a non-empty 1-D sequence, got shape {v.shape}")
    mesh = np.meshgrid(*values, indexing="ij")
    return {name: m.reshape(-1) for name, m in zip(axes, mesh, strict=True)}


def _check_hyper(hyper: Mapping[str, Any] | None) -> tuple[dict[str, jnp.ndarray], int | None]:
    if hyper is None:
        return {}, None
    if not isinstance(hyper, Mapping) or not hyper:
        raise TypeError("hyper must be a non-empty dict name -> 1-D array of grid values")
    out, sizes = {}, set()
    for name, v in hyper.items():
        a = np.asarray(v)
        if a.ndim != 1 or a.size == 0:
            raise ValueError(f"hyper[{name!r}] must be a non-empty 1-D array, got shape {a.shape}")
        sizes.add(a.size)
        out[name] = jnp.asarray(a)
    if len(sizes) != 1:
        raise ValueError(f"all hyper arrays must have the same length, got lengths {sorted(sizes)}")
    return out, sizes.pop()


def _check_batch_kwargs(
    batch_kwargs: Mapping[str, Any] | None, hyper: Mapping[str, Any], num_members: int | None
) -> dict[str, Any]:
    """``batch_kwargs`` as jax arrays; every leaf must lead with ``num_members`` if given."""
    if batch_kwargs is None:
        return {}
    if not isinstance(batch_kwargs, Mapping):
        raise TypeError(
            f"batch_kwargs must be a dict name -> array [S, ...], got {type(batch_kwargs).__name__}"
        )
    out = {}
    for name, value in batch_kwargs.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise TypeError(f"batch_kwargs keys must be argument names, got {name!r}")
        if name in hyper:
            raise ValueError(f"{name!r} is both in batch_kwargs and in hyper; pass it once")
        value = jax.tree.map(jnp.asarray, value)
        leaves = jax.tree.leaves(value)
        if not leaves:
            raise ValueError(f"batch_kwargs[{name!r}] holds no arrays")
        for leaf in leaves:
            if leaf.ndim == 0 or (num_members is not None and leaf.shape[0] != num_members):
                raise ValueError(
                    f"batch_kwargs[{name!r}] must have a leading axis of {num_members} batch "
                    f"members (one value per member), got shape {leaf.shape}"
                )
        out[name] = value
    return out


def _over_grid(fn, hyper, state, *, size: int, is_round: bool):
    """``fn(h, state_g)`` vmapped over the grid ``hyper`` (``size`` points) and the grid
    axis of ``state``; ``fn`` is a round (returning ``(FedState, info)``) when ``is_round``.

    Every grid point of a member starts from the member's key (``init``) and counts the
    same rounds, so a :class:`FedState`'s ``key`` and ``round`` enter unbatched: the
    round's participants and minibatch indices are drawn once per member, and its
    clients' data are gathered once and shared by the whole grid (a matrix product over
    the grid instead of one matrix-vector product per grid point, which streams the
    data from memory once per point). A round that makes ``key`` or ``round`` depend on
    a hyperparameter breaks that contract and raises a ValueError.
    """
    if not isinstance(state, FedState):
        return jax.vmap(fn)(hyper, state)
    shared = state._replace(key=state.key[0], round=state.round[0])
    axes = FedState(params=0, memory=0, proj_state=0, extra=0, key=None, round=None)
    if not is_round:
        return jax.vmap(fn, in_axes=(0, axes))(hyper, shared)
    with _shared_key_contract("round"):
        new, info = jax.vmap(fn, in_axes=(0, axes), out_axes=(axes, 0))(hyper, shared)
    return new._replace(key=_grow(new.key, size), round=_grow(new.round, size)), info


def _grow(a, size: int):
    """``a`` repeated along a new leading grid axis of ``size``."""
    return jnp.broadcast_to(a, (size, *jnp.shape(a)))


@contextlib.contextmanager
def _shared_key_contract(where: str):
    """Turns jax's error for a FedState ``key``/``round`` that came out of the grid's
    vmap batched (against ``out_axes=None``) into one that names the contract."""
    try:
        yield
    except ValueError as err:
        # jax 0.10's wording for an output batched against out_axes=None, at the paths
        # of the key and round (FedState fields in a round, dict entries in an init)
        paths = (".key", ".round", "['key']", "['round']")
        if not any(f"{p}, got axis spec None" in str(err) for p in paths):
            raise
        raise ValueError(
            f"an algorithm's {where} must give FedState.key and FedState.round the same "
            "value on every grid point (the run key and the round counter; run_many and "
            "vmap_algorithm draw once per member for its whole grid), but they differ "
            "across grid points (through a hyperparameter or per-point state)"
        ) from err


def _factory_checks(
    make_algorithm: Callable[..., Algorithm],
    hyper: dict[str, jnp.ndarray],
    grid: int | None,
    kw: dict[str, Any],
) -> str:
    """Runs the factory's value checks on every member's traced arguments; its name.

    ``make_algorithm(**kw_s, **h)`` is traced once, vmapped over the members (``kw``'s
    leading axis) and the grid, inside a :func:`deferred_checks` block; the compiled
    program returns the flags ``[S, G, k]`` of its ``k`` checks (only the checks
    survive XLA's dead-code elimination, so it costs a small compilation).

    Returns:
      :func:`~karula_jax.training.checkpoint.algorithm_name` of the built algorithm.

    Raises:
      TypeError: ``make_algorithm`` does not return an Algorithm.
      ValueError: a check failed, naming the argument, where, and the inputs holding NaN.
    """
    names: list[str] = []
    messages: list[str] = []

    def one(kw_s, h):
        with deferred_checks() as found:
            alg = make_algorithm(**kw_s, **h)
        if not isinstance(alg, Algorithm):
            raise TypeError(f"make_algorithm must return an Algorithm, got {type(alg).__name__}")
        names.append(ckpt.algorithm_name(alg))
        messages[:] = [m for m, _ in found]
        return jnp.stack([ok for _, ok in found]) if found else jnp.ones((0,), bool)

    leaves = jax.tree.leaves(kw)
    if not leaves and grid is None:  # nothing traced: the factory checks its values itself
        one({}, {})
        return names[0]
    num_members = leaves[0].shape[0] if leaves else 1
    per_grid = (
        (lambda kw_s: one(kw_s, {}))
        if grid is None
        else (lambda kw_s: jax.vmap(lambda h: one(kw_s, h))(hyper))
    )
    flags = np.asarray(jax.jit(jax.vmap(per_grid, axis_size=num_members))(kw))
    if grid is None:
        flags = flags[:, None]  # [S, 1, k]
    failed = DeferredChecks(messages, [flags[..., j] for j in range(len(messages))]).failed()
    problems = [m + where_in_batch(bad, leaves != [], grid is not None) for m, bad in failed]
    bad_points = np.any([bad for _, bad in failed], axis=0) if failed else None
    if problems:
        raise ValueError(
            "make_algorithm got bad arguments through batch_kwargs or hyper (traced values, "
            "which a factory cannot check itself): "
            + "; ".join(problems)
            + _nonfinite_inputs(kw, hyper, bad_points)
            + ". Nothing was run."
        )
    return names[0]


def _nonfinite_inputs(kw: dict[str, Any], hyper: dict[str, Any], bad: np.ndarray) -> str:
    """Which failing members' ``batch_kwargs`` and grid points' ``hyper`` hold NaN."""
    found = []
    members, points = np.flatnonzero(bad.any(axis=1)), np.flatnonzero(bad.any(axis=0))
    for name, value in kw.items():
        for s in members[:8]:
            if _any_nan(leaf[s] for leaf in jax.tree.leaves(value)):
                found.append(f"batch_kwargs[{name!r}] of member {int(s)} holds NaN")
    for name, value in hyper.items():
        for g in points[:8]:
            if _any_nan([value[g]]):
                found.append(f"hyper[{name!r}][{int(g)}] is NaN")
    return " (" + "; ".join(found) + ")" if found else ""


def _any_nan(arrays) -> bool:
    arrays = [np.asarray(a) for a in arrays]
    return any(np.issubdtype(a.dtype, np.inexact) and bool(np.isnan(a).any()) for a in arrays)


def _members(
    make_algorithm: Callable[..., Algorithm],
    hyper: dict[str, jnp.ndarray],
    grid: int | None,
    *,
    data_per_seed: bool,
    params_per_seed: bool,
    mesh: Mesh | None = None,
) -> Algorithm:
    """The batch as an Algorithm whose data argument is ``(data, batch_kwargs)``.

    With ``mesh`` (the batch axis split over its devices) ``round`` and ``client_params``
    run under ``shard_map``: each device vmaps its own members, so what batches member by
    member on the CPU (the projection's ``lax.map``) stays on the device that holds the
    members instead of being gathered by the partitioner; ``init`` is left to it.
    """
    d_axis = 0 if data_per_seed else None
    p_axis = 0 if params_per_seed else None

    def batched(method, is_round=False):
        """``method(alg, state, data)`` vmapped over the grid (inner) and members (outer)."""

        def per_member(state_s, data_s, kw_s):
            if grid is None:
                return method(make_algorithm(**kw_s), state_s, data_s)
            return _over_grid(
                lambda h, st: method(make_algorithm(**kw_s, **h), st, data_s),
                hyper,
                state_s,
                size=grid,
                is_round=is_round,
            )

        members = jax.vmap(per_member, in_axes=(0, d_axis, 0))

        def apply(state, data_kw):
            return members(state, *data_kw)

        if mesh is None:
            return apply
        split = split_members(members, mesh, (0, d_axis, 0))

        def on_mesh(state, data_kw):
            return split(state, *data_kw)

        # What a checkpoint fingerprints (training.loop): the program without its mesh,
        # so that a run resumes on any number of devices.
        on_mesh.unsplit = apply
        return on_mesh

    def init(params, data_kw, *, key):
        # Value checks that a member's init defers (its traced data, e.g. a classifier's
        # labels) come back as flags [S] or [S, G] and are deferred again at this level,
        # for the driver (run_chunks) to report with the members they concern.
        messages: list[str] = []

        def checked(kw_s, h, params_s, data_s, key_s):
            algorithm = make_algorithm(**kw_s, **h)  # its own checks: _factory_checks
            with deferred_checks() as found:
                state = algorithm.init(params_s, data_s, key=key_s)
            messages[:] = [m for m, _ in found]
            return state, [jnp.all(ok) for _, ok in found]

        # The key is batched over members only: every grid point of a member shares it,
        # and so must the state's key and round (see _over_grid), which leave the grid's
        # vmap unbatched (an init that makes them depend on a grid point is refused).
        def per_member(key_s, params_s, data_s, kw_s):
            if grid is None:
                return checked(kw_s, {}, params_s, data_s, key_s)

            def point(h):
                state, flags = checked(kw_s, h, params_s, data_s, key_s)
                shared = {"key": state.key, "round": state.round}
                return state, (shared if isinstance(state, FedState) else {}), flags

            with _shared_key_contract("init"):
                state, shared, flags = jax.vmap(point, out_axes=(0, None, 0))(hyper)
            if shared:
                state = state._replace(
                    key=_grow(shared["key"], grid), round=_grow(shared["round"], grid)
                )
            return state, flags

        data, kw = data_kw
        state, flags = jax.vmap(per_member, in_axes=(0, p_axis, d_axis, 0))(key, params, data, kw)
        for message, ok in zip(messages, flags, strict=True):
            defer(message, ok)
        return state

    round_ = batched(lambda alg, st, d: alg.round(st, d), is_round=True)
    client_params = batched(lambda alg, st, d: alg.client_params(st, d))
    return Algorithm(init=init, round=round_, client_params=client_params)


def vmap_algorithm(
    make_algorithm: Callable[..., Algorithm],
    hyper: Mapping[str, Any] | None = None,
    *,
    data_per_seed: bool = False,
    params_per_seed: bool = False,
    batch_kwargs: Mapping[str, Any] | None = None,
) -> Algorithm:
    """A batch of runs (members x grid points) as one :class:`Algorithm`.

    ``make_algorithm(**kw, **h)`` is called *inside* ``jax.vmap`` with ``kw`` one member's
    slice of ``batch_kwargs`` and ``h`` one value of every ``hyper`` array, all traced, so
    arguments that enter only arithmetic (t, step sizes, penalties, a dissimilarity
    matrix, a smoothness constant) can vary; structural ones (number of participants,
    batch size, local steps, number of clusters) must be closed over instead.

    The returned algorithm's state has leading axes ``[S, G, ...]`` (``[S, ...]`` without
    ``hyper``): ``init(params, data, key=keys)`` takes stacked keys ``[S]`` and every grid
    point of member ``s`` starts from ``keys[s]`` (common random numbers, so grid points
    are compared on the same participation draws and minibatches). ``client_params``
    returns leaves ``[S, G, n, ...]`` and RoundInfo leaves are ``[S, G, ...]``. A round
    takes a :class:`FedState`'s ``key`` and ``round`` from the member, not per grid point
    (draws and data gathers once per member); an ``init`` or round that makes them vary
    over the grid raises a ValueError.

    Args:
      make_algorithm: factory ``make_algorithm(**batch_kwargs_s, **hyper_g) -> Algorithm``.
      hyper: dict name -> array ``[G]`` of grid values (see :func:`product_grid`).
      data_per_seed: if True, ``data`` carries a leading member axis ``[S, ...]``;
        otherwise all runs share ``data``.
      params_per_seed: if True, ``init``'s ``params`` carry a leading member axis.
      batch_kwargs: dict name -> array ``[S, ...]`` of per-member factory arguments
        (closed over by the returned functions; :func:`run_many` passes them as
        arguments of the compiled program instead).

    Returns:
      The batched :class:`Algorithm`.

    Raises:
      ValueError: a value check of the factory fails on some member's or grid point's
        traced arguments (see the module docstring).
    """
    hyper, grid = _check_hyper(hyper)
    kw = _check_batch_kwargs(batch_kwargs, hyper, None)
    _factory_checks(make_algorithm, hyper, grid, kw)
    inner = _members(
        make_algorithm, hyper, grid, data_per_seed=data_per_seed, params_per_seed=params_per_seed
    )

    def init(params, data, *, key):
        return inner.init(params, (data, kw), key=_check_keys(key, "key")[0])

    return Algorithm(
        init=init,
        round=lambda state, data: inner.round(state, (data, kw)),
        client_params=lambda state, data: inner.client_params(state, (data, kw)),
    )


def _check_members(what: str, tree: Any, num_members: int, *, asked: bool = True) -> None:
    """When ``asked``, every leaf of ``tree`` must have a leading axis ``[num_members]``."""
    if not asked:
        return
    lead = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(tree)}
    if lead != {num_members}:
        raise ValueError(
            f"{what}=True needs every leaf to have a leading axis of {num_members} seeds "
            f"(batch members), got leading sizes {sorted(lead, key=str)}"
        )


def _placement(
    mesh: Mesh | None,
    shard: str,
    *,
    num_members: int,
    grid: int | None,
    data: Any,
    data_per_seed: bool,
    eval_data_per_seed: bool,
) -> Placement | None:
    """Split the batch axis or every run's client axis over ``mesh`` (None: no mesh)."""
    if mesh is None:
        return None
    if shard == "batch":
        check_divisible("the batch axis [S]", num_members, mesh)
        axis = lambda per_member: 0 if per_member else None
        length = num_members
        data_axis, kw_axis, state_axis = axis(data_per_seed), 0, 0
        eval_axis = axis(eval_data_per_seed)
    else:
        data_axis = 1 if data_per_seed else 0
        length = leading_size(data, axis=data_axis, what="the client axis of the data")
        check_divisible("the client axis", length, mesh)
        kw_axis, state_axis = 1, 1 if grid is None else 2
        eval_axis = 1 if eval_data_per_seed else 0
    at = lambda axis: lambda tree: split_axis(tree, mesh, axis=axis, length=length)
    return Placement(
        data=lambda data_kw: (at(data_axis)(data_kw[0]), at(kw_axis)(data_kw[1])),
        eval_data=at(eval_axis),
        state=at(state_axis),
    )


def _check_run_options(run_kwargs: Mapping[str, Any], shard: str) -> dict[str, Any]:
    """The options :func:`run_many` passes to the chunk loop, with :func:`run`'s defaults."""
    unknown = sorted(set(run_kwargs) - set(_RUN_OPTIONS))
    if unknown:
        raise TypeError(
            f"run_many got unexpected keyword arguments {unknown}; the options it passes "
            f"to the chunk loop are {sorted(_RUN_OPTIONS)}"
        )
    if shard not in SHARD_AXES:
        raise ValueError(f"shard must be one of {SHARD_AXES}, got {shard!r}")
    return {**_RUN_OPTIONS, **run_kwargs}


def _check_keys(keys, name: str = "keys") -> tuple[jax.Array, int]:
    """``keys`` as stacked keys ``[S]`` (typed or raw ``[S, 2]``) and ``S``; ``name``: the
    argument's, in the error."""
    keys = keys if ckpt.is_key(keys) else jnp.asarray(keys)
    key_batch_ndim = 1 if ckpt.is_key(keys) else 2
    if keys.ndim != key_batch_ndim:
        raise ValueError(
            f"{name} must be stacked keys [S] (e.g. jax.random.split(key, S)), got shape "
            f"{keys.shape}"
        )
    return keys, keys.shape[0]


def _batched_eval(eval_fn: EvalFn, grid: int | None, eval_data_per_seed: bool) -> Callable:
    """``eval_fn`` vmapped over the grid (client params only) and the members."""
    e_axis = 0 if eval_data_per_seed else None
    per_grid = eval_fn if grid is None else jax.vmap(eval_fn, in_axes=(0, None))
    return jax.vmap(per_grid, in_axes=(0, e_axis))


_kept_eval = functools.lru_cache(maxsize=32)(_batched_eval)  # reuse_compiled


def _evaluation(eval_fn, eval_data, eval_per_seed, data, data_per_seed, num_members, grid, reuse):
    """(batched ``eval_fn`` or None, the evaluation data, whether it has a member axis):
    ``data`` itself when ``eval_data`` is None."""
    if eval_fn is None:
        return None, eval_data, eval_per_seed
    if eval_data is None:
        eval_data, eval_per_seed = data, data_per_seed
    elif eval_per_seed:
        _check_members("eval_data_per_seed", eval_data, num_members)
    kept = reuse and _hashable(eval_fn)
    batched = (_kept_eval if kept else _batched_eval)(eval_fn, grid, eval_per_seed)
    return batched, eval_data, eval_per_seed


def _fingerprints(data, batch_kwargs) -> dict[str, Any]:
    """Checkpoint fingerprints of the batch's data and factory arguments."""
    return {
        "data": ckpt.content_hash(data),
        "batch_kwargs": ckpt.content_hash(batch_kwargs) if batch_kwargs else None,
    }


def _batched_algorithm(
    make_algorithm,
    hyper,
    batch_kwargs,
    num_members,
    *,
    reuse,
    data_per_seed,
    params_per_seed,
    member_mesh=None,
):
    """The batch as one algorithm, after the factory's checks on every member and grid point
    (``member_mesh``: the mesh the member axis is split over, or None; see :func:`_members`).

    Returns:
      ``(algorithm, name, batch_kwargs, grid)``: the vmapped :class:`Algorithm`, the
      factory's name, the checked ``batch_kwargs`` and the grid size (None without ``hyper``).
    """
    hyper_arrays, grid = _check_hyper(hyper)
    kw = _check_batch_kwargs(batch_kwargs, hyper_arrays, num_members)
    name = _factory_checks(make_algorithm, hyper_arrays, grid, kw)
    per_seed = {"data_per_seed": data_per_seed, "params_per_seed": params_per_seed}
    if not (reuse and _hashable(make_algorithm)):
        members = _members(make_algorithm, hyper_arrays, grid, **per_seed, mesh=member_mesh)
        return members, name, kw, grid
    values = tuple(
        (k, np.dtype(v.dtype).str, np.shape(v), np.asarray(v).tobytes())
        for k, v in hyper_arrays.items()
    )
    kept = _kept_members(make_algorithm, grid, data_per_seed, params_per_seed, values, member_mesh)
    return kept, name, kw, grid


# ``reuse_compiled``: the batched algorithms of recent (factory, grid) pairs. The compiled
# chunks are cached per algorithm object (karula_jax.training.loop), so returning the same
# object for the same factory (by identity) and grid values lets a second batch of one
# method, e.g. on other data or another member argument such as a dissimilarity matrix
# (both arguments of the program, not constants), reuse the compiled programs.
@functools.lru_cache(maxsize=32)
def _kept_members(make_algorithm, grid, data_per_seed, params_per_seed, values, mesh) -> Algorithm:
    """:func:`_members` of the grid ``values`` (``(name, dtype, shape, bytes)`` per name)."""
    hyper = {k: jnp.asarray(np.frombuffer(b, dt).reshape(shape)) for k, dt, shape, b in values}
    flags = {"data_per_seed": data_per_seed, "params_per_seed": params_per_seed}
    return _members(make_algorithm, hyper, grid, **flags, mesh=mesh)


def _hashable(x) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def run_many(
    make_algorithm: Callable[..., Algorithm],
    params: Any,
    data: Any,
    *,
    keys: jax.Array,
    num_rounds: int,
    hyper: Mapping[str, Any] | None = None,
    data_per_seed: bool = False,
    params_per_seed: bool = False,
    batch_kwargs: Mapping[str, Any] | None = None,
    eval_fn: EvalFn | None = None,
    eval_data: Any = None,
    eval_data_per_seed: bool = False,
    mesh: Mesh | None = None,
    shard: str = "batch",
    desc: str | None = None,
    reuse_compiled: bool = False,
    **run_kwargs,
) -> RunResult:
    """Batch members x a hyperparameter grid as one compiled program per chunk.

    Equivalent to running, for every batch member ``s`` and grid point ``g``::

        run(make_algorithm(**batch_kwargs[s], **hyper[g]), params[s], data[s],
            key=keys[s], eval_data=eval_data[s], ...)

    (``[s]`` only where the member axis is asked for), but all of them are ``jax.vmap``-ed
    into the chunk program of :func:`run`, so the whole batch compiles once and shares
    its progress bar, metrics, checkpoints and bit-identical resume. Results equal the
    separate runs up to float rounding (a member's grid points draw once, with its key).

    **Batch layout.** Whatever differs between runs as data is the leading *member* axis
    ``[S]`` (e.g. CV folds x seeds), each member with its own key and, where the flags
    say so, data, initial model and factory arguments; the grid ``hyper`` (``[G]``
    values) is crossed on every member with the member's key. A worked example and the
    memory a batch needs (``S * G`` runs'): ``docs/batched_runs.md``.

    Args:
      make_algorithm: ``make_algorithm(**batch_kwargs_s, **hyper_g) -> Algorithm``,
        called inside ``jax.vmap`` with traced values (see :func:`vmap_algorithm` for
        which arguments may vary).
      params: one model every client of every run starts from, or stacked ``[S, ...]``
        if ``params_per_seed``.
      data: shared ``ClientData``, or stacked ``[S, ...]`` if ``data_per_seed`` (pad the
        members to common shapes: clients and rows with zero counts).
      keys: stacked keys ``[S]`` (e.g. ``jax.random.split(key, S)``); ``S`` is the
        number of batch members.
      num_rounds: rounds per run.
      hyper: dict name -> ``[G]`` values (see :func:`product_grid`), or None.
      data_per_seed: ``data`` has a leading member axis ``[S]``.
      params_per_seed: ``params`` has a leading member axis ``[S]`` (e.g. a different
        model initialization per seed).
      batch_kwargs: dict name -> array ``[S, ...]`` (or a pytree of such arrays): factory
        arguments that go with each member (its dissimilarity matrix, its smoothness
        constant...). They enter the compiled program as traced arguments and the
        checkpoint fingerprints, so a resume with other values is refused.
      eval_fn: per-run ``eval_fn(client_params, eval_data) -> dict``; it is vmapped, so
        metric arrays come back as ``[num_evals, S, G, ...]``.
      eval_data: per-run evaluation data (default ``data``).
      eval_data_per_seed: ``eval_data`` has a member axis (None ``eval_data``: as ``data``).
      mesh: a 1-D device mesh (:func:`client_mesh`, :func:`batch_mesh`) to spread over.
      shard: with ``mesh``, the axis split over its devices (a multiple of their number):
        ``"batch"`` the members ``[S]`` (each device vmaps its own under ``shard_map``)
        or ``"clients"`` every run's client axis (cross-client steps communicate).
      desc: a label in front of the progress bar's batch size (``"Karula: 6x5 runs"``).
      reuse_compiled: reuse the programs of an earlier call with the same
        ``make_algorithm`` and ``eval_fn`` objects and ``hyper`` values. Only for pure
        functions: one reading a value changed since would run its old program.
      **run_kwargs: options of :func:`run`: ``chunk_size``, ``eval_every_chunk``,
        ``checkpoint_dir``, ``resume``, ``on_nonfinite``, ``progress``.

    Returns:
      A :class:`RunResult` whose state leaves are ``[S, G, ...]``, info leaves
      ``[num_rounds, S, G, ...]`` and metrics ``[num_evals, S, G, ...]`` (no ``G`` axis
      without ``hyper``); ``nonfinite_round`` and ``diagnostics`` cover every member.

    Raises:
      ValueError: a member axis that is not ``S`` long, a name both in ``batch_kwargs``
        and ``hyper``, an unknown ``shard``, a sharded axis the mesh size does not
        divide, a factory argument failing its check on some member or grid point before
        anything runs, a FedState key or round varying over the grid, all :func:`run` raises.
      TypeError: unknown keyword arguments, a malformed ``hyper`` or ``batch_kwargs``.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import karula_jax as kj
      >>> ds = kj.data.synthetic_ridge(0, num_clients=6, dim=3)
      >>> loss = kj.models.ridge_loss(1e-6)
      >>> def make(learning_rate):  # called with traced grid values
      ...     return kj.algorithms.fedavg(
      ...         loss, learning_rate=learning_rate, clients_per_round=3,
      ...         batch_size=ds.train.max_count,
      ...     )
      >>> def metrics(theta, data):
      ...     return {"error": kj.evaluation.estimation_error(theta, ds.theta_true)}
      >>> res = kj.training.run_many(
      ...     make, jnp.zeros(3), ds.train, keys=jax.random.split(jax.random.key(0), 2),
      ...     num_rounds=50, hyper={"learning_rate": jnp.array([0.0, 0.01, 0.05])},
      ...     eval_fn=metrics, chunk_size=50, progress=False,
      ... )
      >>> res.metrics["error"].shape  # [evaluations, seeds, grid points, clients]
      (2, 2, 3, 6)
      >>> res.state.params.shape  # [seeds, grid points, 1 global model, d]
      (2, 3, 1, 3)
      >>> err = res.metrics["error"][-1].mean(axis=-1)  # [seeds, grid points]
      >>> bool((err[:, 0] > err[:, 2]).all())  # learning_rate 0 stays at the initial model
      True
    """
    options = _check_run_options(run_kwargs, shard)
    keys, num_members = _check_keys(keys)
    _check_members("data_per_seed", data, num_members, asked=data_per_seed)
    _check_members("params_per_seed", params, num_members, asked=params_per_seed)
    layout = dict(data_per_seed=data_per_seed, params_per_seed=params_per_seed)
    layout["member_mesh"] = mesh if shard == "batch" else None
    algorithm, name, kw, grid = _batched_algorithm(
        make_algorithm, hyper, batch_kwargs, num_members, reuse=reuse_compiled, **layout
    )
    given_eval = (eval_fn, eval_data, eval_data_per_seed)
    batched_eval, eval_data, eval_per_seed = _evaluation(
        *given_eval, data, data_per_seed, num_members, grid, reuse_compiled
    )
    where = dict(num_members=num_members, grid=grid, data=data, data_per_seed=data_per_seed)
    placement = _placement(mesh, shard, **where, eval_data_per_seed=eval_per_seed)
    out = run_chunks(
        algorithm,
        params,
        (data, kw),
        key=keys,
        num_rounds=num_rounds,
        eval_fn=batched_eval,
        eval_data=eval_data,
        placement=placement,
        desc=f"{desc + ': ' if desc else ''}{num_members}{'' if grid is None else f'x{grid}'} runs",
        fingerprints=functools.partial(_fingerprints, data, kw),
        name=f"{name} (batched by run_many)",
        **options,
    )
    warn_unconverged(out.diagnostics, stacklevel=2)
    return out
