"""Placing runs on a device mesh: the client axis or the batch axis.

Two axes can be split over the devices of a 1-D mesh:

* the **client axis** ``[n]`` of a run (the leading axis of ``FedState.params``/``memory``
  and of ``ClientData``): clients are spread over devices and XLA inserts the collectives
  that cross-client steps (averaging, the projection) need;
* the **batch axis** ``[S]`` of :func:`~karula_jax.training.run_many` (data sets x seeds):
  independent runs, so no communication at all.

Sharding never changes what is computed, only where (results equal the unsharded run up to
float rounding of reductions split across devices).

The mesh may span several processes (hosts): call ``jax.distributed.initialize`` in every
process, build the mesh from the global ``jax.devices()`` and make the same calls in every
process. The driver then fetches round info and metrics with :func:`gather_to_host`, so
every process gets the whole history; the final state stays a global ``jax.Array``
(gather it with :func:`gather_to_host`). ``tests/_distributed_runs.py`` is the worked
example (two CPU processes on the loopback address).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = [
    "batch_mesh",
    "client_mesh",
    "default_batch_mesh",
    "gather_to_host",
    "shard_leading_axis",
    "split_members",
    "use_cpu_cores",
]


def client_mesh(devices=None, *, axis_name: str = "clients") -> Mesh:
    """A 1-D device mesh for the client or batch axis.

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


def batch_mesh(num_members: int, devices=None) -> Mesh | None:
    """The mesh for ``run_many(..., mesh=..., shard="batch")`` of ``num_members`` runs.

    The first ``d`` of ``devices`` (all of ``jax.devices()`` by default), ``d`` the largest
    device count that divides ``num_members``; None where that is 1 (one device, or no
    count from 2 to the number of devices divides ``num_members``): the batch then runs
    unsplit.

    Args:
      num_members: length of the member axis ``[S]`` (>= 1).
      devices: the devices to choose from.

    Returns:
      A 1-D :class:`jax.sharding.Mesh` (:func:`client_mesh`), or None.
    """
    if isinstance(num_members, bool) or not isinstance(num_members, int | np.integer):
        raise TypeError(f"num_members must be an int, got {type(num_members).__name__}")
    if num_members < 1:
        raise ValueError(f"num_members must be >= 1, got {num_members}")
    devices = list(jax.devices() if devices is None else devices)
    d = max(k for k in range(1, len(devices) + 1) if num_members % k == 0)
    return client_mesh(devices[:d]) if d > 1 else None


def default_batch_mesh(num_members: int) -> Mesh | None:
    """The mesh the protocol splits ``num_members`` members over when not told: in a
    single-process job :func:`batch_mesh` of the local devices, with several processes
    None (a multi-host job places its batch itself)."""
    return batch_mesh(num_members) if jax.process_count() == 1 else None


def split_members(fn: Callable, mesh: Mesh | None, in_axes: tuple[int | None, ...]) -> Callable:
    """``fn``, a function vmapped over a leading member axis, with its members split over
    ``mesh``: under ``jax.shard_map`` each device applies ``fn`` to its own members, so
    what ``fn`` runs member by member (the projection's ``lax.map`` on the CPU) stays on
    the device that holds them. No collective: members are independent.

    Args:
      fn: positional arguments only; every output has the member axis first.
      mesh: a 1-D mesh whose size divides the member count (:func:`batch_mesh`); None
        returns ``fn`` itself.
      in_axes: one entry per positional argument (a pytree): ``0`` split along its
        leading member axis, ``None`` the same on every device.

    Returns:
      A function of the same arguments and outputs.
    """
    if any(a not in (0, None) for a in in_axes):
        raise ValueError(f"in_axes entries must be 0 or None, got {in_axes!r}")
    if mesh is None:
        return fn
    split, whole = PartitionSpec(mesh.axis_names[0]), PartitionSpec()
    specs = tuple(split if a == 0 else whole for a in in_axes)
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=split, check_vma=False)


def use_cpu_cores(count: int | None = None) -> int:
    """Gives the CPU backend one device per core, so that a batch split over the devices
    (:func:`batch_mesh`) runs on every core.

    XLA runs the many small operations of a federated round (the projection's loops, a
    round's per-client steps) one after another on one thread; with one CPU device per
    core, the members of a batch split over the devices run side by side. Call it right
    after ``import jax``, before any JAX operation (the experiments' entry points do);
    a no-op where the backend already has that many CPU devices, and without ``count``
    where ``XLA_FLAGS`` sets ``--xla_force_host_platform_device_count`` (that count
    stays). Results do not depend on it.

    Args:
      count: devices to create; default the cores this process may run on, or the
        environment variable ``JAX_NUM_CPU_DEVICES`` where it is set (``1``: one device,
        the batch unsplit).

    Returns:
      The number of CPU devices asked for.

    Raises:
      RuntimeError: the backend already started with another number of CPU devices.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    forced = re.search(
        r"xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", "")
    )
    if count is None and forced:
        return int(forced.group(1))
    if count is None:
        count = int(os.environ.get("JAX_NUM_CPU_DEVICES") or max(1, int(cores or 1)))
    count = int(count)
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if jax.config.jax_num_cpu_devices == count:
        return count
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError as err:
        if len(jax.devices("cpu")) == count:
            return count
        raise RuntimeError(
            f"use_cpu_cores({count}) must run before any JAX operation (the backend has "
            f"started with {len(jax.devices('cpu'))} CPU devices): call it right after "
            "`import jax`"
        ) from err
    return count


def gather_to_host(tree: Any) -> Any:
    """Every leaf of ``tree`` as a numpy array holding its global value, in every process.

    A ``jax.Array`` split over devices of other processes (a mesh spanning hosts) is
    gathered with ``multihost_utils.process_allgather``, a collective: every process must
    call this on the same tree. Other leaves are copied to the host as they are. In a
    single process this is ``jax.device_get``.

    Args:
      tree: pytree of arrays (not PRNG key arrays when they span processes).

    Returns:
      The tree with ``np.ndarray`` leaves.
    """

    def get(x):
        if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(get, tree)


def _put(x: Any, sharding: NamedSharding) -> Any:
    """``jax.device_put(x, sharding)``, also for process-local arrays on a multi-process mesh.

    With several processes, ``device_put`` refuses a committed array that lives on this
    process's devices only (e.g. the output of a program none of whose inputs spanned the
    mesh); such an array goes through the host, a PRNG key array through its key data.
    Every process must pass the same value.
    """
    if jax.process_count() > 1 and isinstance(x, jax.Array) and x.is_fully_addressable:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = _put(jax.random.key_data(x), sharding)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        x = np.asarray(x)
    return jax.device_put(x, sharding)


def _mesh_axis(mesh: Mesh) -> tuple[str, int]:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if len(mesh.axis_names) != 1:
        raise ValueError(f"mesh must be 1-D, got axes {mesh.axis_names}")
    return mesh.axis_names[0], int(mesh.devices.size)


def shard_leading_axis(tree: Any, mesh: Mesh) -> Any:
    """Places every leaf of ``tree`` on ``mesh``, split along its leading axis.

    A leaf whose leading dimension is divisible by the mesh size is split in equal blocks
    (``NamedSharding(mesh, P(axis))``); scalars and other leaves are replicated.

    Args:
      tree: pytree of arrays.
      mesh: 1-D mesh, e.g. from :func:`client_mesh`.

    Returns:
      The tree with leaves as sharded ``jax.Array``s.
    """
    axis, size = _mesh_axis(mesh)
    split = NamedSharding(mesh, PartitionSpec(axis))
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(x):
        shape = np.shape(x)
        target = split if len(shape) >= 1 and shape[0] % size == 0 else replicated
        return _put(x, target)

    return jax.tree.map(place, tree)


def split_axis(tree: Any, mesh: Mesh, *, axis: int | None, length: int) -> Any:
    """Splits the leaves whose dimension ``axis`` has size ``length``; replicates the rest.

    ``axis=None`` replicates every leaf.
    """
    name, _ = _mesh_axis(mesh)
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(x):
        shape = np.shape(x)
        if axis is not None and len(shape) > axis and shape[axis] == length:
            return _put(x, NamedSharding(mesh, PartitionSpec(*[None] * axis, name)))
        return _put(x, replicated)

    return jax.tree.map(place, tree)


def check_divisible(what: str, length: int, mesh: Mesh) -> None:
    """ValueError unless ``length`` (of the axis to shard) is a multiple of the mesh size."""
    _, size = _mesh_axis(mesh)
    if length % size:
        raise ValueError(
            f"cannot shard {what} of length {length} over a mesh of {size} devices: the "
            f"length must be a multiple of {size} (pad it, or use a mesh of "
            f"{[d for d in range(1, size + 1) if length % d == 0][-1]} devices)"
        )


def leading_size(tree: Any, *, axis: int, what: str) -> int:
    """The common size of dimension ``axis`` of every leaf (ValueError if they differ)."""
    sizes = {np.shape(x)[axis] for x in jax.tree.leaves(tree) if np.ndim(x) > axis}
    if len(sizes) != 1:
        raise ValueError(
            f"cannot tell the length of {what}: the leaves have sizes {sorted(sizes)} "
            f"along axis {axis}"
        )
    return sizes.pop()


class Placement(NamedTuple):
    """Where the driver puts a run's arrays on a mesh (private).

    Each field maps a pytree to the same pytree placed on the mesh: ``data`` the training
    data (as passed to the algorithm), ``eval_data`` the second argument of ``eval_fn``,
    ``state`` the algorithm's state (after ``init`` or a checkpoint load).
    """

    data: Callable[[Any], Any]
    eval_data: Callable[[Any], Any]
    state: Callable[[Any], Any]


def client_placement(mesh: Mesh, data: Any) -> Placement:
    """One run's clients split over ``mesh``: the leading axis of state and data."""
    n = leading_size(data, axis=0, what="the client axis (leading axis of the data)")
    check_divisible("the client axis", n, mesh)
    place = lambda tree: split_axis(tree, mesh, axis=0, length=n)
    return Placement(place, place, place)
