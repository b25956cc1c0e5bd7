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
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerances import reordered_sum

from karula_jax import training
from karula_jax.embedding import DEFAULT_THRESHOLD

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
        "max_param_diff": _max_diff(a, plain.state.params["a"]),
        "max_metric_diff": _max_diff(sharded.metrics["loss"], plain.metrics["loss"]),
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
    out["odd_batch_diff"] = _odd_batch_beside_data_on_the_mesh(mesh, params)
    out |= _karula_members_on_the_mesh(mesh)
    out |= _protocol_on_every_device()
    # batch_mesh: the most devices that divide the member axis (None: 1)
    sizes = {m: training.batch_mesh(m) for m in (1, 6, 7, 8)}
    out["batch_mesh"] = {m: None if v is None else int(v.devices.size) for m, v in sizes.items()}
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


def _odd_batch_beside_data_on_the_mesh(mesh, params) -> float:
    """7 members (no device count divides them: the batch runs unsplit) whose data an
    earlier step left replicated on the mesh, over two chunks: XLA places the state on
    the mesh too, and every chunk must take it there (the second chunk refused a
    committed single-device state once: 5 CV folds on 2 devices). Returns the largest
    difference from the same batch with its data on one device."""
    from _training_helpers import make_data, toy

    data = make_data(seed=4, n=8)
    replicated = jax.device_put(
        data, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    )
    kw = dict(keys=jax.random.split(jax.random.key(7), 7), num_rounds=4, chunk_size=2)
    kw |= dict(batch_kwargs={"eta": jnp.linspace(0.1, 0.4, 7)}, progress=False)
    make = lambda eta: toy(eta=eta, s=3)  # noqa: E731
    on_mesh = training.run_many(make, params, replicated, **kw)
    alone = training.run_many(make, params, data, **kw)
    return _max_diff(jax.device_get(on_mesh.state.params), jax.device_get(alone.state.params))


def _karula_members_on_the_mesh(mesh) -> dict:
    """Karula, 4 members x 2 radii, members split over the mesh (shard="batch"): each
    device solves its members' projections (a ``lax.map`` on the CPU) under ``shard_map``,
    so the compiled round has no collective; results equal the unsplit batch."""
    from karula_jax.algorithms import karula, lipschitz_ridge
    from karula_jax.data import synthetic_ridge
    from karula_jax.models import ridge_loss
    from karula_jax.training import batched

    problem = synthetic_ridge(0, num_clients=8, dim=3, min_samples=5, max_samples=12)
    data, loss = problem.train, ridge_loss(0.1)
    theta = np.asarray(problem.theta_true, np.float64)
    D = jnp.asarray(((theta[:, None] - theta[None]) ** 2).sum(-1), jnp.float32)
    eta = 3.0 / (8.0 * float(lipschitz_ridge(data, 0.1)))

    def make(t):
        return karula(loss, D, t=t, learning_rate=eta, clients_per_round=4, batch_size=4)

    kw = dict(
        keys=jax.random.split(jax.random.key(5), 4),
        hyper={"t": jnp.array([0.2, 0.5])},
        num_rounds=3,
        chunk_size=3,
        progress=False,
    )
    params = jnp.zeros(3)
    plain = training.run_many(make, params, data, **kw)
    split = training.run_many(make, params, data, mesh=mesh, **kw)
    alg = batched._members(
        make, kw["hyper"], 2, data_per_seed=False, params_per_seed=False, mesh=mesh
    )
    state = training.shard_leading_axis(alg.init(params, (data, {}), key=kw["keys"]), mesh)
    hlo = jax.jit(alg.round).lower(state, (data, {})).compile().as_text()
    # a checkpoint of the split batch resumes on one device (its fingerprint has no mesh)
    with tempfile.TemporaryDirectory() as tmp:
        part = dict(kw, num_rounds=2, checkpoint_dir=tmp)
        training.run_many(make, params, data, mesh=mesh, **part)
        resumed = training.run_many(make, params, data, **dict(part, num_rounds=3), resume=True)
    collectives = ("all-gather", "all-reduce", "all-to-all", "collective-permute")
    return {
        "karula_spec": [str(x) for x in split.state.params.sharding.spec],
        "karula_diff": _max_diff(split.state.params, plain.state.params),
        "karula_iterations": int(np.asarray(plain.info.proj_iterations).sum()),
        "karula_collectives": [c for c in collectives if c in hlo],
        "karula_resumed_diff": _max_diff(resumed.state.params, plain.state.params),
    }


def _protocol_on_every_device() -> dict:
    """The study driver's defaults on 4 devices: cross-validation's 6 members (2 seeds x
    (2 folds + final fit)) split over 3 devices (``batch_mesh``), and the members'
    dissimilarities over 4 of 8 data sets; both equal the unsplit computation."""
    from karula_jax import algorithms as A
    from karula_jax import evaluation as ev
    from karula_jax import protocol
    from karula_jax.data import synthetic_ridge
    from karula_jax.embedding import dissimilarities
    from karula_jax.models import ridge_loss
    from karula_jax.protocol import cv as cv_module

    draw = lambda s: synthetic_ridge(s, num_clients=4, dim=2, min_samples=6, max_samples=9)
    train = protocol.stack_datasets([draw(s).train for s in range(2)])
    test = protocol.stack_datasets([draw(s).test for s in range(2)])
    cv = protocol.cv_datasets(train, test, 2, key=jax.random.split(jax.random.key(1), 2))
    loss, linear = ridge_loss(0.01), lambda th, x: x @ th
    method = protocol.Method(
        lambda lr: A.local(loss, learning_rate=lr, batch_size=9), {"lr": jnp.array([0.1, 0.5])}
    )
    meshes = []
    run_many = cv_module.run_many
    kw = dict(
        keys=jax.random.split(jax.random.key(2), 2),
        num_rounds=5,
        eval_fn=lambda th, d: {"mse": ev.mean_squared_error(linear, th, d)},
        score=lambda m: m["mse"].mean(-1),
        progress=False,
    )
    cv_module.run_many = lambda *a, **k: meshes.append(k.get("mesh")) or run_many(*a, **k)
    try:
        split = protocol.cross_validate(method, jnp.zeros(2), cv, **kw)
        whole = protocol.cross_validate(method, jnp.zeros(2), cv, mesh=None, **kw)
    finally:
        cv_module.run_many = run_many
    data = protocol.stack_datasets([draw(s).train for s in range(8)])
    keys = jax.random.split(jax.random.key(3), 8)
    D, _ = protocol.member_dissimilarities(data, keys, num_reference=6)
    want = jax.jit(jax.vmap(lambda d, k: dissimilarities(d, key=k, num_reference=6)[0]))
    return {
        "cv_mesh_sizes": [None if m is None else int(m.devices.size) for m in meshes],
        "cv_diff": _max_diff(split.grid_metrics["mse"], whole.grid_metrics["mse"]),
        "cv_same_choice": bool(np.array_equal(split.chosen, whole.chosen)),
        "D_diff": _max_diff(D, want(data, keys)),
    }


def _max_diff(a, b) -> float:
    """The largest difference of ``a`` from ``b`` relative to ``b``'s largest magnitude."""
    a, b = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(y)]) for y in (a, b))
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), np.finfo(np.float32).tiny))


# Tolerances: the sharded program sums clients' contributions in another order; the toy
# runs sum 8 clients a round over at most 5 rounds (each round's error feeds the next).
_REORDERED_SUMS = reordered_sum(8, rounds=5)
# D: each Sinkhorn solve stops once its marginal L1 error is below the embedding's threshold,
# and another reduction order stops at another iterate; the barycentric maps, and the mean
# distances between them that make D, differ by up to that threshold relative to D's scale.
_SINKHORN = DEFAULT_THRESHOLD


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
    assert out["max_param_diff"] <= _REORDERED_SUMS and out["max_metric_diff"] <= _REORDERED_SUMS
    assert out["seed_spec"] == ["clients"]  # the member axis, on the mesh axis "clients"
    assert out["max_seed_diff"] <= _REORDERED_SUMS
    assert out["max_seed_metric_diff"] <= _REORDERED_SUMS
    assert out["client_spec"] == ["None", "None", "clients"]  # [S, G, n, ...]: n split
    assert out["max_client_diff"] <= _REORDERED_SUMS
    assert out["max_client_metric_diff"] <= _REORDERED_SUMS
    assert out["same_grid_participants"]
    assert out["karula_spec"][0] == "clients" and out["karula_iterations"] > 0
    # members split whole over devices: no collective, so the same sums in the same order,
    # but another compilation (fusion) of them: a round's sums of 8 clients, 3 rounds
    assert out["karula_diff"] <= _REORDERED_SUMS and out["karula_collectives"] == []
    assert out["karula_resumed_diff"] <= _REORDERED_SUMS
    assert out["batch_mesh"] == {"1": None, "6": 3, "7": None, "8": 4}
    # the same sums, placed otherwise (replicated on 4 devices or on one)
    assert out["odd_batch_diff"] <= _REORDERED_SUMS
    assert out["cv_mesh_sizes"] == [3, None] and out["cv_same_choice"]
    assert out["cv_diff"] <= _REORDERED_SUMS and out["D_diff"] <= _SINKHORN
    errors = out["errors"]
    assert "cannot shard the batch axis [S] of length 2 over a mesh of 4" in errors["batch"]
    assert "cannot shard the client axis of length 6 over a mesh of 4" in errors["clients"]
    assert "cannot shard the client axis of length 6 over a mesh of 4" in errors["run"]


def test_karula_and_fedavg_on_4_devices_equal_one_device(tmp_path):
    from _distributed_runs import NUM_CLIENTS, RUNS, collect, launch, reference

    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    procs = launch(tmp_path, num_processes=1, local_devices=None, env={"XLA_FLAGS": flags.strip()})
    ref = reference(RUNS)  # compiled here while the worker starts up
    (out,) = collect(procs, timeout=240)
    assert int(out["global_devices"]) == 4
    # Karula: one run, clients split; FedAvg: seeds split; FedAvg grid: clients split.
    assert set(RUNS) == {"karula", "fedavg", "fedavg_grid"}
    # the split runs sum the NUM_CLIENTS clients in another order, over 3 rounds
    tol = reordered_sum(NUM_CLIENTS, rounds=3)
    for name in RUNS:
        assert out[name].shape == ref[name].shape
        scale = np.abs(ref[name]).max()
        np.testing.assert_allclose(out[name], ref[name], rtol=tol, atol=tol * scale)
        np.testing.assert_allclose(out[f"{name}_loss"], ref[f"{name}_loss"], rtol=tol)
        np.testing.assert_array_equal(out[f"{name}_participants"], ref[f"{name}_participants"])


def test_use_cpu_cores_sets_the_device_count_only_before_the_backend_starts():
    code = "\n".join(
        [
            "import jax, jax.numpy as jnp",
            "from karula_jax import training",
            "print(training.use_cpu_cores(3), jax.device_count())",
            "jnp.ones(1)",
            "print(training.use_cpu_cores(3))",  # already in effect: fine
            "try:",
            "    training.use_cpu_cores(2)",
            "except RuntimeError as err:",
            "    print(err)",
        ]
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[:2] == ["3 3", "3"]
    assert "use_cpu_cores(2) must run before any JAX operation" in lines[2]
    assert "started with 3 CPU devices" in lines[2]
    # the environment variable overrides the core count (1: the batch unsplit)
    env["JAX_NUM_CPU_DEVICES"] = "1"
    code = "import jax, karula_jax.training as t; t.use_cpu_cores(); print(jax.device_count())"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.split() == ["1"], proc.stderr[-3000:]


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


def test_split_members_splits_the_member_axis_and_shares_the_rest():
    fn = jax.vmap(lambda x, c: x * c["scale"], in_axes=(0, None))
    x, shared = jnp.arange(6.0).reshape(3, 2), {"scale": jnp.float32(2.0)}
    assert training.split_members(fn, None, (0, None)) is fn
    mesh = training.client_mesh(jax.devices()[:1])
    split = training.split_members(fn, mesh, (0, None))
    np.testing.assert_array_equal(jax.jit(split)(x, shared), 2.0 * x)
    with pytest.raises(ValueError, match="in_axes entries must be 0 or None"):
        training.split_members(fn, mesh, (1, None))


if __name__ == "__main__":
    print(json.dumps(_compare_sharded_and_unsharded()))
