"""The training driver: a federated run as a few compiled programs.

A run of ``num_rounds`` rounds is a Python loop over *chunks* of ``chunk_size`` rounds.
Each chunk is one jitted ``lax.scan`` of ``algorithm.round``, compiled once (ahead of
time) and reused for every chunk, so between chunks the driver can draw a progress bar,
evaluate user metrics, check for NaN/inf and write a checkpoint without recompiling.

The last chunk may hold fewer than ``chunk_size`` rounds. Rather than compiling a
second, shorter scan, every chunk runs the same executable with a *number of active
rounds*: round ``i`` of the chunk is skipped (``lax.cond``, the state passes through
unchanged and the info slot is filled with zeros) when ``i >= num_active``. Skipped rounds
cost nothing but a branch, there is exactly one compilation per run, and a resumed run
executes the same program as an uninterrupted one, which is what makes resume
bit-identical.

Seeds and hyperparameter grids are one program as well: :func:`vmap_algorithm` turns an
algorithm factory into an :class:`~karula_jax.algorithms.base.Algorithm` over a batch of
runs (leading axes ``[S]`` seeds and optionally ``[G]`` grid points), which the same
driver runs (:func:`run_many`). For hand-written experiments :func:`scan_rounds` is the
pure building block to ``jax.vmap`` yourself.

Checkpoints are ``.npz`` files (no pickle): the state's leaves, the round-info and metric
histories, and a JSON header with the tree structure, shapes and dtypes, written to a
temporary file and moved into place with ``os.replace`` so a killed run never leaves a
torn checkpoint (a temporary file left by a kill is removed by the next :func:`run` on
that directory). The header also holds fingerprints of the run: a hash of the traced
``init`` and ``round`` programs together with the constants they close over (so another
algorithm or other hyperparameters, traced grid values included, change it), sha256
hashes of the data and the initial model, the key and ``chunk_size``. A resumed run
refuses a checkpoint whose fingerprints differ from its own and names what differs.

At the end of a run the driver summarizes the projection diagnostics of every round
(:attr:`RunResult.diagnostics`, :func:`round_diagnostics`) and warns
(:class:`ProjectionNotConvergedWarning`) when some round's projection stopped at its
iteration cap before reaching its tolerance.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import sys
import tempfile
import time
import warnings
import zipfile
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from karula_jax.algorithms.base import Algorithm, FedState, RoundInfo

__all__ = [
    "CHECKPOINT_NAME",
    "ProjectionNotConvergedWarning",
    "RunResult",
    "client_mesh",
    "load_checkpoint",
    "product_grid",
    "round_diagnostics",
    "run",
    "run_many",
    "save_checkpoint",
    "scan_rounds",
    "shard_leading_axis",
    "vmap_algorithm",
]

CHECKPOINT_NAME = "checkpoint.npz"
# /2: RoundInfo.proj_converged, run fingerprints (algorithm, data content, params).
_FORMAT = "karula_jax.training.checkpoint/2"
# Temporary files of :func:`save_checkpoint` (and the writability probe of :func:`run`)
# start with this prefix; :func:`run` deletes leftovers in its checkpoint directory.
_TMP_PREFIX = ".tmp-karula_jax-"


class ProjectionNotConvergedWarning(RuntimeWarning):
    """Some rounds' projection stopped at its iteration cap before reaching its tolerance.

    Such a projection is still feasible (see :mod:`karula_jax.projection`) but only
    ``proj_delta``-optimal. Raise the algorithm's ``projection_max_iter`` (or its
    ``projection_tol``) if the reported gap matters.
    """


EvalFn = Callable[[Any, Any], Mapping[str, Any]]


class RunResult(NamedTuple):
    """Outcome of :func:`run` (host-side numpy histories).

    Attributes:
      state: final :class:`FedState` (device arrays).
      info: :class:`RoundInfo` of every round run so far, each leaf stacked with a leading
        round axis ``[num_rounds, ...]`` (``participants`` is ``[num_rounds, n]``; for
        batched runs the batch axes follow the round axis).
      metrics: dict name -> array ``[num_evals, ...]``, the values returned by ``eval_fn``.
      metric_rounds: int array ``[num_evals]``: number of rounds completed when each
        evaluation was taken (0 = the initial models).
      timings: seconds spent compiling the chunk (``compile_s``; near 0 when an earlier
        ``run`` with the same algorithm object compiled it already), in compiled chunks
        (``run_s``), evaluating (``eval_s``), checkpointing (``checkpoint_s``), in total
        (``total_s``), ``rounds_per_s`` = rounds run / ``run_s``, and
        ``best_rounds_per_s``, the fastest chunk's rate (robust to a busy machine). Only this call's
        work is counted (a resumed run does not inherit the killed run's times).
      nonfinite_round: first round (0-based) whose info reported a non-finite value when
        ``on_nonfinite="record"``; ``None`` if every round was finite.
      diagnostics: :func:`round_diagnostics` of ``info``: the worst certified projection
        gap, the largest constraint violation and the rounds whose projection did not
        converge (of any batch member).
    """

    state: FedState
    info: RoundInfo  # leaves [num_rounds, ...]
    metrics: dict[str, np.ndarray]  # name -> [num_evals, ...]
    metric_rounds: np.ndarray  # [num_evals] int64
    timings: dict[str, float]
    nonfinite_round: int | None = None
    diagnostics: dict[str, Any] | None = None


# --------------------------------------------------------------------------- pure core


def scan_rounds(
    algorithm: Algorithm, state: FedState, data: Any, num_rounds: int
) -> tuple[FedState, RoundInfo]:
    """Runs ``num_rounds`` rounds as one ``lax.scan`` (pure; jit/vmap it yourself).

    Args:
      algorithm: the federated algorithm.
      state: its state, e.g. ``algorithm.init(params, data, key=key)``.
      data: the clients' data (a ``ClientData`` or whatever ``algorithm.round`` takes).
      num_rounds: static Python int >= 1.

    Returns:
      ``(state, info)`` where each leaf of ``info`` has a leading axis ``[num_rounds]``.

    Example (10 seeds as one program)::

        def one_seed(key):
            state = algorithm.init(params, data, key=key)
            return scan_rounds(algorithm, state, data, 100)

        states, infos = jax.jit(jax.vmap(one_seed))(jax.random.split(key, 10))
    """
    num_rounds = _check_positive_int("num_rounds", num_rounds)

    def body(st, _):
        return algorithm.round(st, data)

    return lax.scan(body, state, None, length=num_rounds)


def _masked_chunk(algorithm: Algorithm, chunk_size: int):
    """A chunk of ``chunk_size`` scan steps of which only the first ``num_active`` run."""
    round_fn = _jitted_round(algorithm)

    def chunk(state, data, num_active):
        # Shapes of the info come from the traced round; jit's trace cache makes the
        # scan below reuse that trace, so the round is traced exactly once.
        info_shape = jax.eval_shape(round_fn, state, data)[1]

        def skip(st):
            return st, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), info_shape)

        def body(st, i):
            return lax.cond(i < num_active, lambda s: round_fn(s, data), skip, st)

        return lax.scan(body, state, jnp.arange(chunk_size, dtype=jnp.int32))

    return chunk


# The jitted programs are cached per algorithm object (its functions are hashed by
# identity), so repeated ``run`` calls with the same algorithm, e.g. one per seed, reuse
# the traces and executables instead of compiling again.


@functools.lru_cache(maxsize=32)
def _jitted_init(algorithm: Algorithm):
    return jax.jit(algorithm.init)


@functools.lru_cache(maxsize=32)
def _jitted_round(algorithm: Algorithm):
    # Shared by the chunk and the checkpoint fingerprint, so that both use one trace.
    return jax.jit(algorithm.round)


@functools.lru_cache(maxsize=32)
def _jitted_chunk(algorithm: Algorithm, chunk_size: int):
    return jax.jit(_masked_chunk(algorithm, chunk_size), donate_argnums=0)


@functools.lru_cache(maxsize=32)
def _jitted_eval(algorithm: Algorithm, eval_fn: EvalFn):
    return jax.jit(lambda st, d, ed: eval_fn(algorithm.client_params(st, d), ed))


# --------------------------------------------------------------------------- validation


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be a positive Python int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


# --------------------------------------------------------------------------- checkpoints


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _leaf_spec(x) -> dict:
    if _is_key(x):
        return {
            "shape": list(x.shape),
            "dtype": str(x.dtype),
            "key_impl": str(jax.random.key_impl(x)),
        }
    return {"shape": list(np.shape(x)), "dtype": str(np.asarray(x).dtype), "key_impl": None}


def _spec_of_struct(s) -> dict:
    """Leaf spec of a ``ShapeDtypeStruct`` (from ``jax.eval_shape``)."""
    if _is_key(s):
        return {"shape": list(s.shape), "dtype": str(s.dtype), "key_impl": "?"}
    return {"shape": list(s.shape), "dtype": str(np.dtype(s.dtype)), "key_impl": None}


def _key_fingerprint(key) -> list:
    data = jax.random.key_data(key) if _is_key(key) else key
    return np.asarray(jax.device_get(data)).ravel().tolist()


def _hash_array(h, x) -> None:
    if _is_key(x):
        h.update(f"key:{jax.random.key_impl(x)}".encode())
        x = jax.random.key_data(x)
    a = np.ascontiguousarray(np.asarray(jax.device_get(x)))
    h.update(f"{a.shape}{a.dtype}".encode())
    h.update(a.tobytes())


def _content_hash(tree) -> str:
    """sha256 of a pytree: its structure and every leaf's shape, dtype and bytes."""
    h = hashlib.sha256()
    leaves, treedef = jax.tree.flatten(tree)
    h.update(str(treedef).encode())
    for leaf in leaves:
        _hash_array(h, leaf)
    return h.hexdigest()


def _data_fingerprint(data) -> str:
    """sha256 of the data's content (structure, shapes, dtypes and every byte)."""
    return _content_hash(data)


# Function reprs (``<function f at 0x7f...>``) may appear in some primitives' params.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _hash_jaxpr_consts(h, jaxpr) -> None:
    """Hashes the constants of a (closed) jaxpr and of every jaxpr nested in its eqns."""
    if isinstance(jaxpr, ClosedJaxpr):
        for c in jaxpr.consts:
            _hash_array(h, c)
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        stack = list(eqn.params.values())
        while stack:
            v = stack.pop()
            if isinstance(v, ClosedJaxpr | Jaxpr):
                _hash_jaxpr_consts(h, v)
            elif isinstance(v, tuple | list):
                stack.extend(reversed(v))


def _algorithm_fingerprint(algorithm: Algorithm, template, params, data, key) -> str:
    """sha256 of the traced ``init`` and ``round`` programs and their closed-over constants.

    Another algorithm, other hyperparameters (Python floats become literals of the program
    text; arrays, including the traced grid values of :func:`vmap_algorithm`, become its
    constants) or other static settings change it. ``template`` is the state's
    ``jax.eval_shape``, so a fresh and a resumed run trace the same abstract values. The
    traces are the jit caches' (``_jitted_init``/``_jitted_round``), which the chunk reuses.
    """
    init = _jitted_init(algorithm)
    h = hashlib.sha256()
    programs = (
        jax.make_jaxpr(lambda p, d, k: init(p, d, key=k))(params, data, key),
        jax.make_jaxpr(_jitted_round(algorithm))(template, data),
    )
    for closed in programs:
        h.update(_ADDRESS.sub("", str(closed)).encode())
        _hash_jaxpr_consts(h, closed)
    return h.hexdigest()


def save_checkpoint(
    path: str | os.PathLike,
    state: Any,
    *,
    rounds_done: int,
    info: RoundInfo | None = None,
    metrics: Mapping[str, np.ndarray] | None = None,
    metric_rounds: np.ndarray | None = None,
    extra_meta: Mapping[str, Any] | None = None,
) -> None:
    """Writes a state pytree and histories to ``path`` (``.npz``, no pickle), atomically.

    The file is written to a temporary file in the same directory (name starting with
    ``.tmp-karula_jax-``), flushed to disk and moved over ``path`` with ``os.replace``:
    ``path`` always holds either the previous checkpoint or the new one.

    Args:
      path: destination file.
      state: any pytree of arrays (typed PRNG keys are stored as their key data).
      rounds_done: rounds completed by ``state``.
      info: round-info history (leaves ``[rounds_done, ...]``) or ``None``.
      metrics: metric history, name -> ``[num_evals, ...]``.
      metric_rounds: ``[num_evals]`` rounds at which metrics were taken.
      extra_meta: JSON-serializable values stored in the header.
    """
    path = os.fspath(path)
    leaves, treedef = jax.tree.flatten(state)
    leaves = jax.device_get(leaves)
    arrays: dict[str, np.ndarray] = {}
    specs = []
    for i, leaf in enumerate(leaves):
        specs.append(_leaf_spec(leaf))
        value = jax.random.key_data(leaf) if _is_key(leaf) else leaf
        arrays[f"state_{i:04d}"] = np.asarray(jax.device_get(value))
    if info is not None:
        for name, value in zip(info._fields, info, strict=True):
            arrays[f"info_{name}"] = np.asarray(value)
    metrics = dict(metrics or {})
    names = sorted(metrics)
    for i, name in enumerate(names):
        arrays[f"metric_{i:04d}"] = np.asarray(metrics[name])
    if metric_rounds is not None:
        arrays["metric_rounds"] = np.asarray(metric_rounds, dtype=np.int64)
    meta = {
        "format": _FORMAT,
        "rounds_done": int(rounds_done),
        "treedef": str(treedef),
        "leaves": specs,
        "has_info": info is not None,
        "info_fields": list(info._fields) if info is not None else None,
        "metric_names": names,
        **dict(extra_meta or {}),
    }
    arrays["meta"] = np.array(json.dumps(meta))

    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=_TMP_PREFIX, suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


class _Corrupt(Exception):
    """Internal: what is wrong with a checkpoint file (turned into a ValueError)."""


def _read_npz(path: str) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` file, read without pickle; :class:`_Corrupt` otherwise."""
    # Checked first so that numpy never gets to interpret a non-zip file (its error for
    # those suggests unpickling it).
    if not zipfile.is_zipfile(path):
        size = os.path.getsize(path)
        raise _Corrupt("empty file" if size == 0 else f"not a zip/npz archive ({size} bytes)")
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, OSError, EOFError, KeyError, ValueError) as err:
        text = str(err)
        if "pickle" in text:  # an object array: not something this module writes
            text = "holds an array that is not plain numeric data"
        raise _Corrupt(f"unreadable archive ({type(err).__name__}: {text})") from err


def _meta_field(meta: dict, name: str, kind: type | tuple[type, ...]):
    if name not in meta:
        raise _Corrupt(f"header has no {name!r}")
    value = meta[name]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise _Corrupt(f"header field {name!r} is {value!r}")
    return value


def _entry(files: dict, name: str, shape: tuple | None = None) -> np.ndarray:
    if name not in files:
        raise _Corrupt(f"missing array {name!r}")
    value = files[name]
    if shape is not None and value.shape != tuple(shape):
        raise _Corrupt(f"array {name!r} has shape {value.shape}, its header says {tuple(shape)}")
    return value


def load_checkpoint(path: str | os.PathLike, like: Any) -> tuple[Any, dict, dict]:
    """Reads a checkpoint written by :func:`save_checkpoint` into the structure of ``like``.

    Args:
      path: the ``.npz`` file.
      like: a pytree with the expected structure: arrays or ``jax.ShapeDtypeStruct``
        (e.g. from ``jax.eval_shape(algorithm.init, ...)``).

    Returns:
      ``(state, histories, meta)``: ``state`` has the structure of ``like`` (leaves as jax
      arrays); ``histories`` holds ``info`` (a :class:`RoundInfo` of numpy arrays, or
      ``None``), ``metrics`` and ``metric_rounds``; ``meta`` is the JSON header.

    Raises:
      FileNotFoundError: if ``path`` does not exist.
      ValueError: naming ``path``, if the file is empty, truncated, corrupt or not such a
        checkpoint (another format version, round-info fields of another version), or
        its structure, shapes or dtypes differ from ``like``.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path} is not a file")
    like_leaves, treedef = jax.tree.flatten(like)
    try:
        files = _read_npz(path)
        try:
            meta = json.loads(str(_entry(files, "meta", ())))
        except json.JSONDecodeError as err:
            raise _Corrupt(f"malformed JSON header ({err})") from err
        if not isinstance(meta, dict):
            raise _Corrupt(f"header is a JSON {type(meta).__name__}, not an object")
        if meta.get("format") != _FORMAT:
            raise _Corrupt(f"format {meta.get('format')!r}, this version reads {_FORMAT!r}")
        rounds_done = _meta_field(meta, "rounds_done", int)
        if rounds_done < 0:
            raise _Corrupt(f"rounds_done={rounds_done}")
        stored_treedef = _meta_field(meta, "treedef", str)
        specs = _meta_field(meta, "leaves", list)
        has_info = _meta_field(meta, "has_info", bool)
        metric_names = _meta_field(meta, "metric_names", list)
        for spec in specs:
            if not (
                isinstance(spec, dict)
                and isinstance(spec.get("shape"), list)
                and isinstance(spec.get("dtype"), str)
                and "key_impl" in spec
            ):
                raise _Corrupt(f"malformed leaf entry {spec!r} in the header")
    except _Corrupt as err:
        raise ValueError(
            f"checkpoint {path} is corrupt or not a karula_jax checkpoint: {err}"
        ) from err.__cause__

    if stored_treedef != str(treedef) or len(specs) != len(like_leaves):
        raise ValueError(
            f"checkpoint {path} holds a state of a different structure:\n"
            f"  checkpoint: {stored_treedef}\n  expected:   {treedef}"
        )
    try:
        leaves = []
        for i, (spec, ref) in enumerate(zip(specs, like_leaves, strict=True)):
            want = _spec_of_struct(ref)
            if spec["shape"] != want["shape"] or spec["dtype"] != want["dtype"]:
                raise ValueError(
                    f"checkpoint {path}: state leaf {i} has shape {tuple(spec['shape'])} and "
                    f"dtype {spec['dtype']}, expected shape {tuple(want['shape'])} and dtype "
                    f"{want['dtype']}"
                )
            if spec["key_impl"] is not None:
                value = _entry(files, f"state_{i:04d}")
                try:
                    key = jax.random.wrap_key_data(jnp.asarray(value), impl=spec["key_impl"])
                except (TypeError, ValueError) as err:
                    raise _Corrupt(f"state leaf {i} is not key data of {spec['key_impl']}") from err
                if list(key.shape) != spec["shape"]:
                    raise _Corrupt(f"state leaf {i} has key shape {key.shape}")
                leaves.append(key)
            else:
                value = _entry(files, f"state_{i:04d}", spec["shape"])
                if str(value.dtype) != spec["dtype"]:
                    raise _Corrupt(f"array state_{i:04d} has dtype {value.dtype}")
                leaves.append(jnp.asarray(value))
        info = None
        if has_info:
            fields = meta.get("info_fields")
            if fields is None:
                fields = [k[len("info_") :] for k in files if k.startswith("info_")]
            if list(fields) != list(RoundInfo._fields):
                missing = [f for f in RoundInfo._fields if f not in fields]
                extra = [f for f in fields if f not in RoundInfo._fields]
                raise ValueError(
                    f"checkpoint {path} holds round info with fields {list(fields)}, this "
                    f"version of karula_jax has {list(RoundInfo._fields)} (missing: {missing}, "
                    f"unexpected: {extra}); it cannot be resumed"
                )
            info = RoundInfo(*(_entry(files, f"info_{name}") for name in RoundInfo._fields))
            if {a.shape[:1] for a in info} != {(rounds_done,)}:
                raise _Corrupt(f"round-info arrays do not all hold {rounds_done} rounds")
        metrics = {name: _entry(files, f"metric_{i:04d}") for i, name in enumerate(metric_names)}
        metric_rounds = files.get("metric_rounds", np.zeros((0,), np.int64))
        if any(m.shape[:1] != metric_rounds.shape for m in metrics.values()):
            raise _Corrupt("metric arrays and metric_rounds disagree in length")
    except _Corrupt as err:
        raise ValueError(
            f"checkpoint {path} is corrupt or not a karula_jax checkpoint: {err}"
        ) from err.__cause__
    state = jax.tree.unflatten(treedef, leaves)
    histories = {"info": info, "metrics": metrics, "metric_rounds": metric_rounds}
    return state, histories, meta


# --------------------------------------------------------------------------- sharding


def client_mesh(devices=None, *, axis_name: str = "clients") -> Mesh:
    """A 1-D device mesh for the client axis (DESIGN §8).

    Args:
      devices: devices to use; all of ``jax.devices()`` by default.
      axis_name: name of the mesh axis.

    Returns:
      A :class:`jax.sharding.Mesh` with one axis of length ``len(devices)``.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices must be a non-empty sequence of jax devices")
    return Mesh(np.array(devices), (axis_name,))


def shard_leading_axis(tree: Any, mesh: Mesh) -> Any:
    """Places every leaf of ``tree`` on ``mesh``, split along its leading axis.

    A leaf whose leading dimension is divisible by the mesh size is split in equal blocks
    (``NamedSharding(mesh, P(axis))``); scalars and other leaves are replicated. For a
    single run the leading axis of ``FedState.params``/``memory`` and of ``ClientData``
    is the client axis, so clients are spread over devices and XLA inserts the
    collectives that cross-client steps (averaging, projection) need. For batched runs
    (:func:`run_many`) the leading axis is the seed axis, which needs no communication.
    Sharding never changes what is computed, only where.

    Args:
      tree: pytree of arrays.
      mesh: 1-D mesh, e.g. from :func:`client_mesh`.

    Returns:
      The tree with leaves as sharded ``jax.Array``s.
    """
    if len(mesh.axis_names) != 1:
        raise ValueError(f"mesh must be 1-D, got axes {mesh.axis_names}")
    (axis,) = mesh.axis_names
    size = mesh.devices.size
    split = NamedSharding(mesh, PartitionSpec(axis))
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(x):
        shape = np.shape(x)
        target = split if len(shape) >= 1 and shape[0] % size == 0 else replicated
        return jax.device_put(x, target)

    return jax.tree.map(place, tree)


# --------------------------------------------------------------------------- progress


class _Progress:
    """tqdm when installed, otherwise one plain line on stderr per chunk."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.enabled = enabled
        self.total = total
        self.bar = None
        if not enabled:
            return
        try:
            from tqdm.auto import tqdm  # optional dependency
        except ImportError:
            tqdm = None
        if tqdm is not None:
            self.bar = tqdm(total=total, initial=initial, unit="round", file=sys.stderr)

    def update(self, done: int, step: int, rate: float, values: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        text = " ".join(f"{k}={v:.4g}" for k, v in values.items())
        if self.bar is not None:
            self.bar.update(step)
            self.bar.set_postfix_str(text)
        else:
            width = len(str(self.total))
            print(
                f"[karula_jax] round {done:>{width}}/{self.total} "
                f"({100.0 * done / self.total:5.1f}%) {rate:8.1f} rounds/s {text}",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _scalar_summary(info_last: RoundInfo, metrics: Mapping[str, np.ndarray]) -> dict:
    out = {"loss": float(np.mean(info_last.loss))}
    for name, value in metrics.items():
        out[name] = float(np.mean(value))  # per-client (and per-run) metrics: their mean
    return out


# --------------------------------------------------------------------------- driver


def _stack_infos(parts: list[RoundInfo]) -> RoundInfo:
    return RoundInfo(*(np.concatenate(f, axis=0) for f in zip(*parts, strict=True)))


def round_diagnostics(info: RoundInfo | None) -> dict[str, Any]:
    """Summary of the projection diagnostics of a run's rounds.

    Args:
      info: a :class:`RoundInfo` whose leaves have a leading round axis
        ``[num_rounds, ...]`` (batch axes may follow, as in :func:`run_many`), e.g.
        :attr:`RunResult.info` or the ``info`` of :func:`scan_rounds`; ``None`` for none.

    Returns:
      dict with ``num_rounds``; ``worst_proj_delta``, the largest certified projection
      gap of any round and batch member (NaN ignored; 0.0 with no rounds);
      ``max_proj_violation``, likewise for the constraint violation; and
      ``unconverged_rounds``, the 0-based rounds (list of int) in which the projection of
      some batch member did not converge.
    """
    if info is None:
        return {
            "num_rounds": 0,
            "worst_proj_delta": 0.0,
            "max_proj_violation": 0.0,
            "unconverged_rounds": [],
        }
    num = int(np.shape(info.loss)[0])

    def worst(x) -> float:
        x = np.asarray(x, dtype=np.float64)
        finite = x[~np.isnan(x)]
        return float(finite.max()) if finite.size else (math.nan if x.size else 0.0)

    converged = np.asarray(info.proj_converged).reshape(num, -1).all(axis=1)
    return {
        "num_rounds": num,
        "worst_proj_delta": worst(info.proj_delta),
        "max_proj_violation": worst(info.proj_violation),
        "unconverged_rounds": np.flatnonzero(~converged).tolist(),
    }


def _warn_unconverged(diagnostics: Mapping[str, Any]) -> None:
    bad = diagnostics["unconverged_rounds"]
    if not bad:
        return
    shown = ", ".join(map(str, bad[:8])) + (", ..." if len(bad) > 8 else "")
    warnings.warn(
        f"the projection did not converge in {len(bad)} of {diagnostics['num_rounds']} "
        f"rounds (0-based: {shown}); worst certified gap proj_delta="
        f"{diagnostics['worst_proj_delta']:.3g}, max violation "
        f"{diagnostics['max_proj_violation']:.3g}. The models are feasible but only "
        "approximately projected: raise projection_max_iter (or projection_tol).",
        ProjectionNotConvergedWarning,
        stacklevel=3,
    )


def _stack_metrics(history: list[dict]) -> dict[str, np.ndarray]:
    if not history:
        return {}
    return {k: np.stack([h[k] for h in history]) for k in history[0]}


def _check_metrics(out: Any) -> dict[str, np.ndarray]:
    if not isinstance(out, Mapping):
        raise TypeError(f"eval_fn must return a dict of arrays, got {type(out).__name__}")
    for k in out:
        if not isinstance(k, str):
            raise TypeError(f"eval_fn must return a dict with str keys, got key {k!r}")
    return {k: np.asarray(jax.device_get(v)) for k, v in out.items()}


def _prepare_checkpoint_dir(checkpoint_dir: str | os.PathLike) -> None:
    """Creates ``checkpoint_dir``, proves it writable and deletes stale temporary files.

    Raises:
      OSError (the subclass of the failure, e.g. NotADirectoryError, PermissionError)
      naming ``checkpoint_dir``.
    """
    directory = os.fspath(checkpoint_dir)
    try:
        os.makedirs(directory, exist_ok=True)
        # os.access is not enough (root ignores permission bits; read-only mounts): write.
        fd, probe = tempfile.mkstemp(dir=directory, prefix=_TMP_PREFIX, suffix=".probe")
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        raise OSError(
            err.errno, f"checkpoint_dir {directory!r} cannot be created or written to: {err}"
        ) from err
    # Left by a run killed between creating its temporary file and os.replace; only a
    # concurrent run on the same directory could still be writing one.
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith(_TMP_PREFIX) and entry.is_file(follow_symlinks=False):
                try:
                    os.remove(entry.path)
                except FileNotFoundError:
                    pass


def _check_same_run(path: str, meta: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Raises a ValueError naming every fingerprint of ``meta`` that differs from this run."""
    what = {
        "algorithm": "algorithm or hyperparameters (the traced init/round programs or the "
        "constants they close over differ)",
        "data": "data content (sha256 of the data arrays)",
        "params": "initial params (sha256 of the model every client starts from)",
        "chunk_size": "chunk_size (checkpoint: {old}, this run: {new}; resume needs the "
        "same chunk_size to be bit-identical)",
        "key": "key (it was written by a run with a different key; pass the key of the run "
        "being resumed)",
    }
    diffs = [
        text.format(old=meta.get(name), new=expected[name])
        for name, text in what.items()
        if meta.get(name) != expected[name]
    ]
    if diffs:
        raise ValueError(
            f"checkpoint {path} was written by a different run; refusing to resume. "
            "What differs: " + "; ".join(diffs)
        )


def run(
    algorithm: Algorithm,
    params: Any,
    data: Any,
    *,
    key: jax.Array,
    num_rounds: int,
    chunk_size: int = 50,
    eval_fn: EvalFn | None = None,
    eval_data: Any = None,
    eval_every_chunk: bool = True,
    checkpoint_dir: str | os.PathLike | None = None,
    resume: bool = False,
    on_nonfinite: str = "raise",
    mesh: Mesh | None = None,
    progress: bool = True,
) -> RunResult:
    """Runs ``num_rounds`` rounds of ``algorithm`` as a loop over compiled chunks.

    The chunk program (a ``lax.scan`` over ``chunk_size`` rounds, state buffers donated) is
    compiled once; the final chunk runs the same program with its trailing rounds masked
    (see the module docstring). After every chunk the driver checks the rounds' ``finite``
    flags, evaluates metrics, writes a checkpoint and updates the progress bar.

    Args:
      algorithm: an :class:`Algorithm` (``init``, ``round``, ``client_params``).
      params: one model (pytree) every client starts from.
      data: the clients' training data, passed to ``init``/``round``/``client_params``.
      key: PRNG key of the run (for :func:`run_many`, the stacked seed keys).
      num_rounds: total number of rounds (>= 1), counting rounds done before a resume.
      chunk_size: rounds per compiled chunk (>= 1).
      eval_fn: ``eval_fn(client_params, eval_data) -> dict[str, array]`` where
        ``client_params`` has leaves ``[n, ...]``; traced and jitted once. Evaluated on
        the initial models and after every chunk (or only at the end when
        ``eval_every_chunk`` is False).
      eval_data: second argument of ``eval_fn`` (e.g. ``(train, test)``); defaults to
        ``data``.
      eval_every_chunk: evaluate after every chunk (True) or only at start and end.
      checkpoint_dir: if given, ``<checkpoint_dir>/checkpoint.npz`` is rewritten
        atomically after every chunk. The directory is created if needed and checked
        to be writable before anything is compiled; temporary files a killed run left
        in it (``.tmp-karula_jax-*``) are deleted, so two runs must not share it.
      resume: continue from the checkpoint in ``checkpoint_dir`` instead of calling
        ``init``; the result is bit-identical to an uninterrupted run. The checkpoint
        must come from the same run: the same algorithm and hyperparameters (a hash of
        the traced ``init``/``round`` programs and the constants they close over), the
        same data content and initial ``params`` (sha256), ``chunk_size`` and key;
        otherwise a ValueError names what differs. If the checkpoint already holds
        ``num_rounds`` rounds it is returned as is.
      on_nonfinite: ``"raise"`` (default): after a chunk in which some round reported
        ``finite=False``, raise :class:`FloatingPointError` naming the first such round
        (no checkpoint is written for that chunk; the exception's ``result`` attribute
        holds the history up to and including it). ``"record"``: keep going and report the
        first such round in :attr:`RunResult.nonfinite_round` (for grids where some
        settings are expected to diverge).
      mesh: if given, state and data are placed with :func:`shard_leading_axis`.
      progress: show a progress bar (tqdm if installed, else lines on stderr).

    Returns:
      A :class:`RunResult`. If some round's projection did not converge (its
      ``RoundInfo.proj_converged`` is False), a :class:`ProjectionNotConvergedWarning`
      names those rounds and the worst certified gap (also in ``diagnostics``).

    Raises:
      ValueError: bad ``num_rounds``/``chunk_size``/``on_nonfinite``, ``resume`` without a
        checkpoint, a corrupt checkpoint, or one written by a different run (structure,
        algorithm or hyperparameters, data content, initial params, chunk size or key).
      OSError: ``checkpoint_dir`` cannot be created or written to (before any compiling).
      TypeError: non-integer sizes, or ``eval_fn`` not returning a dict.
      FloatingPointError: a round produced NaN/inf and ``on_nonfinite="raise"``.
    """
    t_start = time.perf_counter()
    num_rounds = _check_positive_int("num_rounds", num_rounds)
    chunk_size = _check_positive_int("chunk_size", chunk_size)
    if on_nonfinite not in ("raise", "record"):
        raise ValueError(f"on_nonfinite must be 'raise' or 'record', got {on_nonfinite!r}")
    if not isinstance(algorithm, Algorithm):
        raise TypeError(f"algorithm must be an Algorithm, got {type(algorithm).__name__}")
    if resume and checkpoint_dir is None:
        raise ValueError("resume=True needs checkpoint_dir (where the checkpoint lives)")
    ckpt_path = None if checkpoint_dir is None else os.path.join(checkpoint_dir, CHECKPOINT_NAME)
    if resume and not os.path.isfile(ckpt_path):
        raise ValueError(f"resume=True but there is no checkpoint at {ckpt_path}")
    if checkpoint_dir is not None:
        _prepare_checkpoint_dir(checkpoint_dir)
    if eval_data is None:
        eval_data = data
    if mesh is not None:
        data = shard_leading_axis(data, mesh)
        eval_data = shard_leading_axis(eval_data, mesh)

    init = _jitted_init(algorithm)
    ckpt_meta = {}
    if ckpt_path is not None:
        template = jax.eval_shape(init, params, data, key=key)
        if resume:  # first: a state of another structure cannot even be traced
            state, hist, meta = load_checkpoint(ckpt_path, template)
        ckpt_meta = {
            "key": _key_fingerprint(key),
            "algorithm": _algorithm_fingerprint(algorithm, template, params, data, key),
            "data": _data_fingerprint(data),
            "params": _content_hash(params),
            "chunk_size": chunk_size,
        }

    info_parts: list[RoundInfo] = []
    metric_history: list[dict] = []
    metric_rounds: list[int] = []
    if resume:
        _check_same_run(ckpt_path, meta, ckpt_meta)
        done = int(meta["rounds_done"])
        if done > num_rounds:
            raise ValueError(
                f"checkpoint {ckpt_path} already holds {done} rounds, more than "
                f"num_rounds={num_rounds}"
            )
        if hist["info"] is not None and done > 0:
            info_parts.append(hist["info"])
        for i, r in enumerate(hist["metric_rounds"]):
            metric_history.append({k: v[i] for k, v in hist["metrics"].items()})
            metric_rounds.append(int(r))
    else:
        state = init(params, data, key=key)
        done = 0
    inherited = sum(p.loss.shape[0] for p in info_parts)  # rounds from the checkpoint
    # Private copies: jit may forward input arrays (e.g. the key) into the state, and the
    # chunk donates the state's buffers.
    state = jax.tree.map(lambda x: x.copy(), state)
    if mesh is not None:
        state = shard_leading_axis(state, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, state)

    timings = {"compile_s": 0.0, "run_s": 0.0, "eval_s": 0.0, "checkpoint_s": 0.0}
    best_rate = 0.0

    eval_jit = None
    if eval_fn is not None:
        eval_jit = _jitted_eval(algorithm, eval_fn)

    def evaluate(st, rounds):
        t0 = time.perf_counter()
        out = _check_metrics(eval_jit(st, data, eval_data))
        if metric_history and set(out) != set(metric_history[0]):
            raise ValueError(
                f"eval_fn returned metrics {sorted(out)}, earlier evaluations (or the "
                f"checkpoint) have {sorted(metric_history[0])}"
            )
        metric_history.append(out)
        metric_rounds.append(rounds)
        timings["eval_s"] += time.perf_counter() - t0
        return out

    if eval_jit is not None and not metric_rounds:
        evaluate(state, done)

    def result(nonfinite=None):
        info = _stack_infos(info_parts) if info_parts else None
        timings["total_s"] = time.perf_counter() - t_start
        ran = sum(p.loss.shape[0] for p in info_parts) - inherited
        timings["rounds_per_s"] = ran / timings["run_s"] if timings["run_s"] > 0 else math.nan
        timings["best_rounds_per_s"] = best_rate if best_rate > 0 else math.nan
        return RunResult(
            state=state,
            info=info,
            metrics=_stack_metrics(metric_history),
            metric_rounds=np.asarray(metric_rounds, dtype=np.int64),
            timings=dict(timings),
            nonfinite_round=nonfinite,
            diagnostics=round_diagnostics(info),
        )

    if done == num_rounds:
        out = result()
        _warn_unconverged(out.diagnostics)
        return out

    t0 = time.perf_counter()
    compiled = (
        _jitted_chunk(algorithm, chunk_size).lower(state, data, jnp.int32(chunk_size)).compile()
    )
    timings["compile_s"] = time.perf_counter() - t0

    bar = _Progress(num_rounds, done, progress)
    first_bad: int | None = None
    try:
        while done < num_rounds:
            active = min(chunk_size, num_rounds - done)
            t0 = time.perf_counter()
            state, info = compiled(state, data, jnp.int32(active))
            info = RoundInfo(*(np.asarray(a)[:active] for a in jax.device_get(info)))
            dt = time.perf_counter() - t0
            timings["run_s"] += dt
            best_rate = max(best_rate, active / dt)
            state = jax.device_put(state, shardings)  # keep the compiled input placement
            ok = np.asarray(info.finite).reshape(active, -1).all(axis=1)
            if not ok.all():
                bad = int(np.argmin(ok))
                if first_bad is None:
                    first_bad = done + bad
                if on_nonfinite == "raise":
                    info_parts.append(RoundInfo(*(a[: bad + 1] for a in info)))
                    members = np.argwhere(~np.asarray(info.finite[bad]).reshape(-1)).ravel()
                    which = (
                        f" (batch members {members[:8].tolist()} in flattened order)"
                        if np.ndim(info.finite[bad]) > 0
                        else ""
                    )
                    saved = ckpt_path is not None and os.path.isfile(ckpt_path)
                    last = f"{done} rounds in {ckpt_path}" if saved else "none"
                    err = FloatingPointError(
                        f"round {done + bad} (0-based; {done + bad + 1} rounds started) "
                        f"produced a non-finite loss, gradient or parameter{which}. Run "
                        f"stopped; last good checkpoint: {last}. Lower the step size or "
                        "check the loss function."
                    )
                    err.result = result(first_bad)
                    raise err
            info_parts.append(info)
            done += active
            last_metrics = {}
            if eval_jit is not None and (eval_every_chunk or done == num_rounds):
                last_metrics = evaluate(state, done)
            if ckpt_path is not None:
                t1 = time.perf_counter()
                info_parts[:] = [_stack_infos(info_parts)]  # keep one array per field
                save_checkpoint(
                    ckpt_path,
                    state,
                    rounds_done=done,
                    info=info_parts[0],
                    metrics=_stack_metrics(metric_history),
                    metric_rounds=np.asarray(metric_rounds, dtype=np.int64),
                    extra_meta=ckpt_meta,
                )
                timings["checkpoint_s"] += time.perf_counter() - t1
            last_info = RoundInfo(*(a[-1] for a in info))
            bar.update(done, active, active / dt, _scalar_summary(last_info, last_metrics))
    finally:
        bar.close()
    out = result(first_bad)
    _warn_unconverged(out.diagnostics)
    return out


# --------------------------------------------------------------------------- batches of runs


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


def vmap_algorithm(
    make_algorithm: Callable[..., Algorithm],
    hyper: Mapping[str, Any] | None = None,
    *,
    data_per_seed: bool = False,
) -> Algorithm:
    """A batch of runs (seeds x grid points) as one :class:`Algorithm`.

    ``make_algorithm(**h)`` is called *inside* ``jax.vmap`` with ``h`` holding traced
    scalars, one value of every ``hyper`` array, so hyperparameters that enter only
    arithmetic (t, step sizes, penalties) can be gridded; structural ones (number of
    participants, batch size, local steps) must be closed over instead.

    The returned algorithm's state has leading axes ``[S, G, ...]`` (``[S, ...]`` without
    ``hyper``): ``init(params, data, key=keys)`` takes stacked keys ``[S]`` and every grid
    point of seed ``s`` starts from ``keys[s]`` (common random numbers, so grid points are
    compared on the same participation draws and minibatches). ``client_params`` returns
    leaves ``[S, G, n, ...]`` and RoundInfo leaves are ``[S, G, ...]``.

    Args:
      make_algorithm: factory ``make_algorithm(**hyper_values) -> Algorithm``.
      hyper: dict name -> array ``[G]`` of grid values (see :func:`product_grid`).
      data_per_seed: if True, ``data`` carries a leading seed axis ``[S, ...]`` (one data
        draw per seed); otherwise all runs share ``data``.

    Returns:
      The batched :class:`Algorithm`.
    """
    hyper, grid = _check_hyper(hyper)
    d_axis = 0 if data_per_seed else None

    def batched(method):
        """``method(alg, state, data)`` vmapped over the grid (inner) and seeds (outer)."""

        def per_seed(state_s, data_s):
            if grid is None:
                return method(make_algorithm(), state_s, data_s)
            return jax.vmap(lambda h, st: method(make_algorithm(**h), st, data_s))(hyper, state_s)

        return jax.vmap(per_seed, in_axes=(0, d_axis))

    def init(params, data, *, key):
        # The key is batched over seeds only: every grid point of a seed shares it.
        def per_seed(key_s, data_s):
            if grid is None:
                return make_algorithm().init(params, data_s, key=key_s)
            return jax.vmap(lambda h: make_algorithm(**h).init(params, data_s, key=key_s))(hyper)

        return jax.vmap(per_seed, in_axes=(0, d_axis))(key, data)

    round_ = batched(lambda alg, st, d: alg.round(st, d))
    client_params = batched(lambda alg, st, d: alg.client_params(st, d))
    return Algorithm(init=init, round=round_, client_params=client_params)


def run_many(
    make_algorithm: Callable[..., Algorithm],
    params: Any,
    data: Any,
    *,
    keys: jax.Array,
    num_rounds: int,
    hyper: Mapping[str, Any] | None = None,
    data_per_seed: bool = False,
    eval_fn: EvalFn | None = None,
    eval_data: Any = None,
    eval_data_per_seed: bool = False,
    **run_kwargs,
) -> RunResult:
    """Seeds x hyperparameter grid as one compiled program per chunk.

    Equivalent to running ``run(make_algorithm(**h_g), params, data_s, key=keys[s], ...)``
    for every seed ``s`` and grid point ``g``, but all of them are ``jax.vmap``-ed into
    the chunk program (up to float rounding from batched kernels).

    Args:
      make_algorithm: ``make_algorithm(**hyper_values) -> Algorithm`` (see
        :func:`vmap_algorithm` for which hyperparameters may be gridded).
      params: one model every client of every run starts from.
      data: shared ``ClientData``, or stacked ``[S, ...]`` if ``data_per_seed``.
      keys: stacked keys ``[S]`` (``jax.random.split(key, S)``).
      num_rounds: rounds per run.
      hyper: dict name -> ``[G]`` values, or None for seeds only.
      data_per_seed: ``data`` has a leading seed axis.
      eval_fn: per-run ``eval_fn(client_params, eval_data) -> dict``; it is vmapped, so
        metric arrays come back as ``[num_evals, S, G, ...]``.
      eval_data: per-run evaluation data (default ``data``).
      eval_data_per_seed: ``eval_data`` has a leading seed axis. Ignored when
        ``eval_data`` is None (then it follows ``data_per_seed``).
      **run_kwargs: passed to :func:`run` (``chunk_size``, ``checkpoint_dir``, ``resume``,
        ``on_nonfinite``, ``mesh``, ``progress``...).

    Returns:
      A :class:`RunResult` whose state leaves are ``[S, G, ...]``, info leaves
      ``[num_rounds, S, G, ...]`` and metrics ``[num_evals, S, G, ...]`` (no ``G`` axis
      without ``hyper``).
    """
    keys = jnp.asarray(keys) if not _is_key(keys) else keys
    key_batch_ndim = 1 if _is_key(keys) else 2
    if keys.ndim != key_batch_ndim:
        raise ValueError(
            f"keys must be stacked keys [S] (e.g. jax.random.split(key, S)), got shape {keys.shape}"
        )
    num_seeds = keys.shape[0]
    if data_per_seed:
        lead = {np.shape(x)[0] for x in jax.tree.leaves(data)}
        if lead != {num_seeds}:
            raise ValueError(
                f"data_per_seed=True needs every data leaf to have a leading axis of "
                f"{num_seeds} seeds, got leading sizes {sorted(lead)}"
            )
    hyper_arrays, grid = _check_hyper(hyper)
    algorithm = vmap_algorithm(make_algorithm, hyper, data_per_seed=data_per_seed)

    batched_eval = None
    if eval_fn is not None:
        if eval_data is None:
            eval_data = data
            eval_data_per_seed = data_per_seed
        e_axis = 0 if eval_data_per_seed else None
        per_grid = eval_fn if grid is None else jax.vmap(eval_fn, in_axes=(0, None))
        batched_eval = jax.vmap(per_grid, in_axes=(0, e_axis))
    return run(
        algorithm,
        params,
        data,
        key=keys,
        num_rounds=num_rounds,
        eval_fn=batched_eval,
        eval_data=eval_data,
        **run_kwargs,
    )
