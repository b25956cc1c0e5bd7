"""Small federated runs on a device mesh, and a worker that runs them in one of N processes.

:func:`federated_runs` runs Karula (one run, its clients split over the mesh, so the
projection communicates) and FedAvg (seeds split: ``run_many(shard="batch")``; a grid with
every run's clients split: ``run_many(shard="clients")``) on 8 ridge clients and returns
their final parameters, last metrics and participants as numpy arrays. ``mesh=None`` is
the unsharded reference.

Run as a script, it is one process of a multi-process run (DESIGN §8)::

    PYTHONPATH=. python tests/_distributed_runs.py --process-id 0 --num-processes 2 \\
        --coordinator 127.0.0.1:12345 --local-devices 2 --out /tmp/p0.npz

(and the same with ``--process-id 1``). Every process calls ``jax.distributed.initialize``
(CPU collectives: gloo, jax's default), builds the mesh from the global ``jax.devices()``
and makes the same calls; every process then holds the whole result
(``training.gather_to_host``) and writes it to ``--out``. ``tests/test_distributed.py``
launches two such processes on the loopback address.
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import socket
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
NUM_CLIENTS = 8  # a multiple of 4 devices
DIM = 3
LAM = 0.1
RUNS = ("karula", "fedavg", "fedavg_grid")


def federated_runs(mesh=None, runs=RUNS) -> dict[str, np.ndarray]:
    """Final parameters, last metrics and participants of small runs placed on ``mesh``.

    ``karula``: one run (``run(mesh=...)``), clients split over the mesh, so the
    projection communicates. ``fedavg``: 4 seeds, each with its own step size, the seeds
    split over the mesh (``run_many(shard="batch")``). ``fedavg_grid``: 2 seeds x 2 step
    sizes with every run's clients split (``run_many(shard="clients")``). Each run is
    3 rounds in chunks of 2 (the second chunk runs masked), 4 of 8 clients per round on
    minibatches of 4 rows, so the keys matter.

    Args:
      mesh: a 1-D mesh (``training.client_mesh``) whose size divides 8 and 4, or None.
      runs: which of :data:`RUNS` to run.

    Returns:
      dict name -> numpy array: ``karula`` ``[8, 3]``, ``fedavg`` ``[4, 8, 3]`` (seeds),
      ``fedavg_grid`` ``[2, 2, 8, 3]`` (seeds x step sizes), and for each ``<name>_loss``
      (last evaluation, per client) and ``<name>_participants`` (``[rounds, ..., 8]``).
    """
    from karula_jax import training
    from karula_jax.algorithms import fedavg, karula, lipschitz_ridge
    from karula_jax.data import synthetic_ridge
    from karula_jax.models import ridge_loss

    problem = synthetic_ridge(
        0, num_clients=NUM_CLIENTS, dim=DIM, min_samples=5, max_samples=12, num_test=5
    )
    data, loss = problem.train, ridge_loss(LAM)
    theta = np.asarray(problem.theta_true, np.float64)
    D = ((theta[:, None] - theta[None]) ** 2).sum(-1)  # true dissimilarities [8, 8]
    eta = 3.0 / (8.0 * float(lipschitz_ridge(data, LAM)))
    params = jnp.zeros((DIM,), jnp.float32)

    def eval_fn(client_params, d):
        per_client = jax.vmap(loss)(client_params, d.x, d.y, d.mask)
        return {"loss": per_client, "mean_loss": jnp.mean(per_client)}

    kw = dict(num_rounds=3, chunk_size=2, eval_fn=eval_fn, progress=False, mesh=mesh)
    results = {}
    if "karula" in runs:
        # The Laplacian dual solver takes 5-10 iterations a round here (Dykstra 30-110),
        # and each iteration is a collective: milliseconds over CPU gloo.
        alg = karula(
            loss,
            D,
            t=0.5,
            learning_rate=eta,
            clients_per_round=4,
            batch_size=4,
            projection_method="laplacian",
        )
        results["karula"] = training.run(alg, params, data, key=jax.random.key(0), **kw)
    if "fedavg" in runs:
        results["fedavg"] = training.run_many(
            lambda lr: fedavg(loss, learning_rate=lr, clients_per_round=4, batch_size=4),
            params,
            data,
            keys=jax.random.split(jax.random.key(1), 4),
            batch_kwargs={"lr": jnp.array([0.05, 0.1, 0.2, 0.3])},
            shard="batch",
            **kw,
        )
    if "fedavg_grid" in runs:
        results["fedavg_grid"] = training.run_many(
            lambda lr: fedavg(loss, learning_rate=lr, clients_per_round=4, batch_size=4),
            params,
            data,
            keys=jax.random.split(jax.random.key(2), 2),
            hyper={"lr": jnp.array([0.1, 0.2])},
            shard="clients",
            **kw,
        )
    out = {}
    for name, res in results.items():
        out[name] = training.gather_to_host(res.state.params)
        out[f"{name}_loss"] = res.metrics["loss"][-1]
        out[f"{name}_participants"] = res.info.participants
    return out


def reference(runs=RUNS) -> dict[str, np.ndarray]:
    """:func:`federated_runs` without a mesh; each run once per process (the tests share it)."""
    return {k: v for name in runs for k, v in _reference(name).items()}


@functools.cache
def _reference(name: str) -> dict[str, np.ndarray]:
    return federated_runs(None, (name,))


def free_port() -> int:
    """A TCP port on the loopback address that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    folder: pathlib.Path,
    *,
    num_processes: int,
    local_devices: int | None,
    runs=RUNS,
    env: dict[str, str] | None = None,
) -> list[tuple[subprocess.Popen, pathlib.Path, pathlib.Path]]:
    """Starts ``num_processes`` workers; returns (process, output .npz, log) of each.

    ``local_devices=None`` leaves the device count to ``XLA_FLAGS`` in ``env``. Logs go to
    files (pipes could fill up and block a worker while the other waits for it).
    """
    env = {**os.environ, **(env or {})}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    coordinator = f"127.0.0.1:{free_port()}"
    procs = []
    for i in range(num_processes):
        out, log = folder / f"process{i}.npz", folder / f"process{i}.log"
        cmd = [sys.executable, "-W", "error", "-W", "ignore::DeprecationWarning", __file__]
        cmd += ["--process-id", str(i), "--num-processes", str(num_processes)]
        cmd += ["--coordinator", coordinator, "--runs", ",".join(runs), "--out", str(out)]
        if local_devices is not None:
            cmd += ["--local-devices", str(local_devices)]
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
        procs.append((proc, out, log))
    return procs


def collect(procs, *, timeout: float) -> list[dict[str, np.ndarray]]:
    """Waits for the workers of :func:`launch`; AssertionError with their logs if one fails.

    Workers still running at the deadline are killed (a worker whose peer died waits
    in a collective).
    """
    deadline = time.monotonic() + timeout
    failed = []
    for proc, _, _ in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            failed.append(f"process {proc.args[proc.args.index('--process-id') + 1]} timed out")
    for proc, _, _ in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if failed or any(proc.returncode for proc, _, _ in procs):
        logs = "\n".join(
            f"--- process {i} (exit {proc.returncode}):\n{log.read_text()[-3000:]}"
            for i, (proc, _, log) in enumerate(procs)
        )
        raise AssertionError(f"{'; '.join(failed) or 'a worker failed'}\n{logs}")
    return [dict(np.load(out)) for _, out, _ in procs]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--coordinator", required=True, help="host:port of process 0")
    parser.add_argument(
        "--local-devices", type=int, default=None, help="CPU devices per process (XLA_FLAGS)"
    )
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {RUNS}")
    parser.add_argument("--out", required=True, help="where to write the results (.npz)")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    jax.config.update("jax_platforms", "cpu")
    if args.local_devices is not None:
        jax.config.update("jax_num_cpu_devices", args.local_devices)
    if args.num_processes > 1:
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=60,
        )
    from karula_jax import training

    if jax.process_count() != args.num_processes:
        raise RuntimeError(f"expected {args.num_processes} processes, got {jax.process_count()}")
    mesh = training.client_mesh()  # every device of every process
    out = federated_runs(mesh, runs=tuple(args.runs.split(",")))
    out["process_index"] = np.int64(jax.process_index())
    out["global_devices"] = np.int64(len(jax.devices()))
    out["seconds"] = np.float64(time.perf_counter() - t0)
    np.savez(args.out, **out)
    if args.num_processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # at once: a clean exit would wait for the other processes
