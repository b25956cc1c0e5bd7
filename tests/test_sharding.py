"""Client-axis and batch-axis sharding (DESIGN §8) on 4 simulated CPU devices.

The device count of a JAX process is fixed at start-up, so the checks run in a subprocess
with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``: this file as a script (the toy
algorithm of the driver tests), and ``_distributed_runs.py`` (Karula and FedAvg, both
shard modes) in one process (``tests/test_distributed.py`` runs it in two).
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax import training

HERE = pathlib.Path(__file__).resolve().parent


def _compare_sharded_and_unsharded() -> dict:
    """Runs in the 4-device subprocess; returns what the test asserts on."""
    sys.path.insert(0, str(HERE))
    from _training_helpers import eval_fn, make_data, toy  # the toy algorithm of the driver tests

    assert len(jax.devices()) == 4, jax.devices()
    mesh = training.client_mesh()
    data = make_data(seed=3, n=8)
    alg = toy(s=3)
    params = {"a": jnp.zeros(3), "b": jnp.zeros(())}
    kw = dict(key=jax.random.PRNGKey(0), num_rounds=5, chunk_size=2, progress=False)
    plain = training.run(alg, params, data, eval_fn=eval_fn, **kw)
    sharded = training.run(alg, params, data, eval_fn=eval_fn, mesh=mesh, **kw)

    a = sharded.state.params["a"]
    out = {
        "param_spec": list(a.sharding.spec),
        "param_devices": len(a.sharding.device_set),
        "shard_rows": sorted({s.data.shape[0] for s in a.addressable_shards}),
        "max_param_diff": float(
            np.max(np.abs(np.asarray(a) - np.asarray(plain.state.params["a"])))
        ),
        "max_metric_diff": float(np.max(np.abs(sharded.metrics["loss"] - plain.metrics["loss"]))),
        "same_participants": bool(
            np.array_equal(sharded.info.participants, plain.info.participants)
        ),
    }
    # shard="batch": 4 members (own data and step size) split along the member axis.
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    datas = jax.tree.map(lambda *xs: jnp.stack(xs), *[make_data(seed=s, n=8) for s in range(4)])
    members = dict(
        keys=keys,
        data_per_seed=True,
        batch_kwargs={"eta": jnp.array([0.1, 0.2, 0.3, 0.4])},
        eval_fn=eval_fn,
        num_rounds=3,
        chunk_size=3,
        progress=False,
    )
    make = lambda eta: toy(eta=eta, s=3)
    many_plain = training.run_many(make, params, datas, **members)
    many_sharded = training.run_many(make, params, datas, mesh=mesh, **members)
    b = many_sharded.state.params["a"]
    out["seed_spec"] = list(b.sharding.spec)
    out["max_seed_diff"] = _max_diff(b, many_plain.state.params["a"])
    out["max_seed_metric_diff"] = _max_diff(
        many_sharded.metrics["loss"], many_plain.metrics["loss"]
    )
    # shard="clients": 2 seeds x 2 grid points, each run's 8 clients split over 4 devices.
    grid = dict(keys=keys[:2], hyper={"t": jnp.array([0.0, 0.5])}, eval_fn=eval_fn)
    grid.update(num_rounds=3, chunk_size=3, progress=False)
    make = lambda t: toy(t=t, s=3)
    grid_plain = training.run_many(make, params, data, **grid)
    grid_sharded = training.run_many(make, params, data, mesh=mesh, shard="clients", **grid)
    c = grid_sharded.state.params["a"]
    out["client_spec"] = [str(x) for x in c.sharding.spec]
    out["max_client_diff"] = _max_diff(c, grid_plain.state.params["a"])
    out["max_client_metric_diff"] = _max_diff(
        grid_sharded.metrics["loss"], grid_plain.metrics["loss"]
    )
    out["same_grid_participants"] = bool(
        np.array_equal(grid_sharded.info.participants, grid_plain.info.participants)
    )
    # Axes the mesh does not divide are refused before anything is traced.
    errors = {}
    for name, call in {
        "batch": lambda: training.run_many(make, params, data, mesh=mesh, **grid),
        "clients": lambda: training.run_many(
            make, params, make_data(n=6), mesh=mesh, shard="clients", **grid
        ),
        "run": lambda: training.run(alg, params, make_data(n=6), mesh=mesh, **kw),
    }.items():
        try:
            call()
            errors[name] = None
        except ValueError as err:
            errors[name] = str(err)
    out["errors"] = errors
    return out


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


def test_sharded_run_equals_unsharded_on_4_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    # The repository itself, whether or not (or wherever) the package is installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=HERE.parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # Clients are split 2 per device along the leading axis.
    assert out["param_spec"] == ["clients"]
    assert out["param_devices"] == 4 and out["shard_rows"] == [2]
    assert out["same_participants"]
    assert out["max_param_diff"] < 1e-5 and out["max_metric_diff"] < 1e-4
    assert out["seed_spec"] == ["clients"]  # the member axis, on the mesh axis "clients"
    assert out["max_seed_diff"] < 1e-5 and out["max_seed_metric_diff"] < 1e-4
    assert out["client_spec"] == ["None", "None", "clients"]  # [S, G, n, ...]: n split
    assert out["max_client_diff"] < 1e-5 and out["max_client_metric_diff"] < 1e-4
    assert out["same_grid_participants"]
    errors = out["errors"]
    assert "cannot shard the batch axis [S] of length 2 over a mesh of 4" in errors["batch"]
    assert "cannot shard the client axis of length 6 over a mesh of 4" in errors["clients"]
    assert "cannot shard the client axis of length 6 over a mesh of 4" in errors["run"]


def test_karula_and_fedavg_on_4_devices_equal_one_device(tmp_path):
    from _distributed_runs import RUNS, collect, launch, reference

    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    procs = launch(tmp_path, num_processes=1, local_devices=None, env={"XLA_FLAGS": flags.strip()})
    ref = reference(RUNS)  # compiled here while the worker starts up
    (out,) = collect(procs, timeout=240)
    assert int(out["global_devices"]) == 4
    # Karula: one run, clients split; FedAvg: seeds split; FedAvg grid: clients split.
    assert set(RUNS) == {"karula", "fedavg", "fedavg_grid"}
    for name in RUNS:
        assert out[name].shape == ref[name].shape
        np.testing.assert_allclose(out[name], ref[name], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out[f"{name}_loss"], ref[f"{name}_loss"], rtol=1e-5)
        np.testing.assert_array_equal(out[f"{name}_participants"], ref[f"{name}_participants"])


def test_gather_to_host_in_one_process_is_device_get():
    mesh = training.client_mesh(jax.devices()[:1])
    tree = training.shard_leading_axis({"x": jnp.arange(6.0).reshape(3, 2)}, mesh)
    host = training.gather_to_host(tree)
    assert isinstance(host["x"], np.ndarray)
    np.testing.assert_array_equal(host["x"], np.arange(6.0).reshape(3, 2))


def test_shard_leading_axis_replicates_what_does_not_divide():
    mesh = training.client_mesh(jax.devices()[:1])
    tree = {"x": jnp.ones((3, 2)), "s": jnp.zeros(()), "k": jax.random.key(0)}
    placed = training.shard_leading_axis(tree, mesh)
    assert tuple(placed["x"].sharding.spec) == ("clients",)
    assert tuple(placed["s"].sharding.spec) == ()
    np.testing.assert_array_equal(placed["x"], tree["x"])


if __name__ == "__main__":
    print(json.dumps(_compare_sharded_and_unsharded()))
