"""Checkpoints: ``.npz`` files (no pickle), written atomically, and run fingerprints.

A checkpoint holds the state's leaves, the round-info and metric histories, and a JSON
header with the tree structure, shapes and dtypes. It is written to a temporary file and
moved into place with ``os.replace``, so a killed run never leaves a torn checkpoint (a
temporary file left by a kill is removed by the next run on that directory).

The header names the algorithm that wrote it (:func:`algorithm_name`, e.g. ``karula``), so
a resume with another algorithm is refused by name before the state's shapes are compared.
It also holds fingerprints of the run: a hash of the traced ``init`` and ``round``
programs together with the constants they close over (so another algorithm or other
hyperparameters, traced grid values included, change it), sha256 hashes of the data, the
initial model and (for :func:`~karula_jax.training.run_many`) the per-member factory
arguments, the key and ``chunk_size``. A resumed run refuses a checkpoint whose fingerprints
differ from its own and names what differs.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr

from karula_jax.algorithms.base import RoundInfo

__all__ = ["CHECKPOINT_NAME", "algorithm_name", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_NAME = "checkpoint.npz"
# /2: RoundInfo.proj_converged, run fingerprints (algorithm, data content, params).
_FORMAT = "karula_jax.training.checkpoint/2"
# Temporary files of :func:`save_checkpoint` (and the writability probe of the driver)
# start with this prefix; the driver deletes leftovers in its checkpoint directory.
_TMP_PREFIX = ".tmp-karula_jax-"


def is_key(x) -> bool:
    """Whether ``x`` is an array of typed PRNG keys (``jax.random.key``)."""
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _leaf_spec(x) -> dict:
    if is_key(x):
        return {
            "shape": list(x.shape),
            "dtype": str(x.dtype),
            "key_impl": str(jax.random.key_impl(x)),
        }
    return {"shape": list(np.shape(x)), "dtype": str(np.asarray(x).dtype), "key_impl": None}


def _spec_of_struct(s) -> dict:
    """Leaf spec of a ``ShapeDtypeStruct`` (from ``jax.eval_shape``)."""
    if is_key(s):
        return {"shape": list(s.shape), "dtype": str(s.dtype), "key_impl": "?"}
    return {"shape": list(s.shape), "dtype": str(np.dtype(s.dtype)), "key_impl": None}


def key_fingerprint(key) -> list:
    """The key's data as a JSON list (typed or raw keys, one or stacked)."""
    data = jax.random.key_data(key) if is_key(key) else key
    return np.asarray(jax.device_get(data)).ravel().tolist()


def _hash_array(h, x) -> None:
    if is_key(x):
        h.update(f"key:{jax.random.key_impl(x)}".encode())
        x = jax.random.key_data(x)
    a = np.ascontiguousarray(np.asarray(jax.device_get(x)))
    h.update(f"{a.shape}{a.dtype}".encode())
    h.update(a.tobytes())


def content_hash(tree) -> str:
    """sha256 of a pytree: its structure and every leaf's shape, dtype and bytes."""
    h = hashlib.sha256()
    leaves, treedef = jax.tree.flatten(tree)
    h.update(str(treedef).encode())
    for leaf in leaves:
        _hash_array(h, leaf)
    return h.hexdigest()


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


def algorithm_name(algorithm) -> str:
    """A readable identity of an :class:`~karula_jax.algorithms.Algorithm`: its factory.

    The name of the function that built ``algorithm.round`` (``karula``, ``fedavg``,
    ``laplacian_penalty``...; prefixed with its module outside
    ``karula_jax.algorithms``). Two algorithms of one factory share the name (their
    hyperparameters are told apart by :func:`algorithm_fingerprint`).
    """
    fn = algorithm.round
    while isinstance(fn, functools.partial):
        fn = fn.func
    module = getattr(fn, "__module__", None) or "?"
    factory = (getattr(fn, "__qualname__", None) or type(fn).__name__).split(".<locals>")[0]
    return factory if module.startswith("karula_jax.algorithms.") else f"{module}.{factory}"


def algorithm_fingerprint(init: Callable, round_: Callable, template, params, data, key) -> str:
    """sha256 of the traced ``init`` and ``round`` programs and their closed-over constants.

    Another algorithm, other hyperparameters (Python floats become literals of the program
    text; arrays, including the traced grid values of :func:`vmap_algorithm`, become its
    constants) or other static settings change it. ``init`` and ``round_`` are the jitted
    functions the driver runs (so their trace caches are shared and nothing is traced
    twice); ``template`` is the state's ``jax.eval_shape``, so a fresh and a resumed run
    trace the same abstract values. Every input is traced as its shape and dtype alone,
    so where the arrays are placed (one device, a mesh) does not change it.
    """
    h = hashlib.sha256()
    dtype = lambda x: x.dtype if hasattr(x, "dtype") else jnp.result_type(x)  # Python scalars
    bare = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), dtype(x)), tree)
    params, data, key, template = bare((params, data, key, template))
    programs = (
        jax.make_jaxpr(lambda p, d, k: init(p, d, key=k))(params, data, key),
        jax.make_jaxpr(round_)(template, data),
    )
    for closed in programs:
        h.update(_ADDRESS.sub("", str(closed)).encode())
        _hash_jaxpr_consts(h, closed)
    return h.hexdigest()


# Header fields the format writes itself (``extra_meta`` may not set them).
_RESERVED_META = (
    "format",
    "rounds_done",
    "treedef",
    "leaves",
    "has_info",
    "info_fields",
    "metric_names",
)


def _numeric(what: str, value) -> np.ndarray:
    """``value`` as a numeric numpy array; a TypeError naming ``what`` otherwise
    (``np.savez`` pickles an object array, which this format never holds)."""
    a = np.asarray(value)
    if a.dtype.kind not in "biufc":
        raise TypeError(f"checkpoint arrays must be numeric, {what} has dtype {a.dtype}")
    return a


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
      extra_meta: JSON-serializable values stored in the header (not the format's own
        fields: ``rounds_done``, ``format``...).

    Raises:
      TypeError: ``rounds_done`` not an int; a leaf, info field or metric that is not
        numeric (``np.savez`` would pickle an object array).
      ValueError: ``rounds_done < 0``; ``extra_meta`` setting one of the format's fields.
    """
    path = os.fspath(path)
    if isinstance(rounds_done, bool) or not isinstance(rounds_done, int | np.integer):
        raise TypeError(f"rounds_done must be an int, got {type(rounds_done).__name__}")
    if rounds_done < 0:
        raise ValueError(f"rounds_done must be >= 0, got {rounds_done}")
    leaves, treedef = jax.tree.flatten(state)
    leaves = jax.device_get(leaves)
    arrays: dict[str, np.ndarray] = {}
    specs = []
    for i, leaf in enumerate(leaves):
        specs.append(_leaf_spec(leaf))
        value = jax.random.key_data(leaf) if is_key(leaf) else leaf
        arrays[f"state_{i:04d}"] = _numeric(f"state leaf {i}", jax.device_get(value))
    if info is not None:
        for name, value in zip(info._fields, info, strict=True):
            arrays[f"info_{name}"] = _numeric(f"info field {name}", value)
    metrics = dict(metrics or {})
    names = sorted(metrics)
    for i, name in enumerate(names):
        arrays[f"metric_{i:04d}"] = _numeric(f"metric {name!r}", metrics[name])
    if metric_rounds is not None:
        arrays["metric_rounds"] = np.asarray(metric_rounds, dtype=np.int64)
    reserved = sorted(set(extra_meta or {}) & set(_RESERVED_META))
    if reserved:
        raise ValueError(f"extra_meta must not set the checkpoint's own fields {reserved}")
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


def _read_header(files: dict) -> dict:
    """The JSON header of a checkpoint, its fields checked; raises ``_Corrupt``."""
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
    _meta_field(meta, "treedef", str)
    specs = _meta_field(meta, "leaves", list)
    _meta_field(meta, "has_info", bool)
    _meta_field(meta, "metric_names", list)
    for spec in specs:
        if not (
            isinstance(spec, dict)
            and isinstance(spec.get("shape"), list)
            and isinstance(spec.get("dtype"), str)
            and "key_impl" in spec
        ):
            raise _Corrupt(f"malformed leaf entry {spec!r} in the header")
    return meta


def _read_leaf(files: dict, path: str, i: int, spec: dict, ref) -> jax.Array:
    """State leaf ``i`` as a jax array (or key array) of the shape and dtype of ``ref``.

    Raises ``_Corrupt`` for damaged contents and ValueError for a leaf of another shape or
    dtype than ``ref``.
    """
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
        return key
    value = _entry(files, f"state_{i:04d}", spec["shape"])
    if str(value.dtype) != spec["dtype"]:
        raise _Corrupt(f"array state_{i:04d} has dtype {value.dtype}")
    if jax.dtypes.canonicalize_dtype(value.dtype) != value.dtype:
        return value  # a 64-bit leaf without x64: JAX would narrow it (2**40 + 7 -> 7)
    return jnp.asarray(value)


def load_checkpoint(
    path: str | os.PathLike, like: Any, *, algorithm: str | None = None
) -> tuple[Any, dict, dict]:
    """Reads a checkpoint written by :func:`save_checkpoint` into the structure of ``like``.

    Args:
      path: the ``.npz`` file.
      like: a pytree with the expected structure: arrays or ``jax.ShapeDtypeStruct``
        (e.g. from ``jax.eval_shape(algorithm.init, ...)``).
      algorithm: the name of the algorithm expected to have written it
        (:func:`algorithm_name`, stored by the driver as ``algorithm_name`` in the header);
        a checkpoint naming another one is refused by name. ``None`` (or a checkpoint
        without a name): not checked.

    Returns:
      ``(state, histories, meta)``: ``state`` has the structure of ``like`` (leaves as jax
      arrays, but a 64-bit leaf stays a numpy array while JAX's x64 is off: JAX would
      narrow its values); ``histories`` holds ``info`` (a :class:`RoundInfo` of numpy arrays, or
      ``None``), ``metrics`` and ``metric_rounds``; ``meta`` is the JSON header.

    Raises:
      FileNotFoundError: if ``path`` does not exist.
      ValueError: naming ``path``, if the file is empty, truncated, corrupt or not such a
        checkpoint (another format version, round-info fields of another version), it
        was written by another algorithm than ``algorithm``, or its structure, shapes or
        dtypes differ from ``like``.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path} is not a file")
    like_leaves, treedef = jax.tree.flatten(like)
    try:
        files = _read_npz(path)
        meta = _read_header(files)
        rounds_done = meta["rounds_done"]
        stored_treedef, specs = meta["treedef"], meta["leaves"]
    except _Corrupt as err:
        raise ValueError(
            f"checkpoint {path} is corrupt or not a karula_jax checkpoint: {err}"
        ) from err.__cause__

    writer = meta.get("algorithm_name")
    if algorithm is not None and isinstance(writer, str) and writer != algorithm:
        raise ValueError(
            f"checkpoint {path} was written by {writer}, this run is {algorithm}: a "
            "checkpoint resumes only the run that wrote it (use another checkpoint_dir, "
            "or resume=False to start over)"
        )
    if stored_treedef != str(treedef) or len(specs) != len(like_leaves):
        raise ValueError(
            f"checkpoint {path} holds a state of a different structure:\n"
            f"  checkpoint: {stored_treedef}\n  expected:   {treedef}"
        )
    try:
        leaves = [
            _read_leaf(files, path, i, spec, ref)
            for i, (spec, ref) in enumerate(zip(specs, like_leaves, strict=True))
        ]
        info = None
        if meta["has_info"]:
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
        names = meta["metric_names"]
        metrics = {name: _entry(files, f"metric_{i:04d}") for i, name in enumerate(names)}
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


def prepare_checkpoint_dir(checkpoint_dir: str | os.PathLike) -> None:
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


# What each fingerprint stands for, in the order a refusal lists them.
_FINGERPRINTS = {
    "algorithm": "algorithm or hyperparameters (the traced init/round programs or the "
    "constants they close over differ)",
    "data": "data content (sha256 of the data arrays)",
    "batch_kwargs": "batch_kwargs (sha256 of the per-member factory arguments)",
    "params": "initial params (sha256 of the model every client starts from)",
    "chunk_size": "chunk_size (checkpoint: {old}, this run: {new}; resume needs the "
    "same chunk_size to be bit-identical)",
    "key": "key (it was written by a run with a different key; pass the key of the run "
    "being resumed)",
}


def check_same_run(path: str, meta: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Raises a ValueError naming every fingerprint of ``meta`` that differs from this run.

    ``expected`` maps names of ``_FINGERPRINTS`` to this run's values; a name the
    checkpoint lacks counts as ``None``.
    """
    diffs = [
        text.format(old=meta.get(name), new=expected[name])
        for name, text in _FINGERPRINTS.items()
        if name in expected and meta.get(name) != expected[name]
    ]
    if diffs:
        raise ValueError(
            f"checkpoint {path} was written by a different run; refusing to resume. "
            "What differs: " + "; ".join(diffs)
        )
