"""The benchmarks' own measuring tools."""

import collections
import contextlib
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerances import reordered_sum

from karula_jax import algorithms as A
from karula_jax.benchmarking import compiled_round
from karula_jax.data import random_classification
from karula_jax.models import cross_entropy_loss, init_params, mlp, output_layer_mask


def test_bare_round_runs_without_the_projection_even_after_the_full_round():
    # The benches time Karula's share of the projection as the same round built with
    # projection_method="none": that round must skip the projection, the full one not.
    n = 5
    data, model = (
        random_classification(n, seed=0, rows=(6, 9), features=12, num_classes=3),
        mlp(8, 3),
    )
    params = init_params(model, jax.random.PRNGKey(0), (1, 12))
    pers = output_layer_mask(params)
    D = np.ones((n, n)) - np.eye(n)
    make = lambda method: A.karula(  # noqa: E731
        cross_entropy_loss(model.apply),
        D,
        t=1e-3,
        learning_rate=0.5,
        personalized=pers,
        clients_per_round=n,
        batch_size=4,
        projection_method=method,
    )
    alg = make("auto")
    state = alg.init(params, data, key=jax.random.PRNGKey(0))
    copy = lambda: jax.tree.map(jnp.copy, state)  # noqa: E731 - the calls donate the state
    full, _ = compiled_round(alg.round, copy(), data)
    bare, _ = compiled_round(make("none").round, copy(), data)
    (s_full, i_full), (s_bare, i_bare) = full(copy(), data), bare(copy(), data)
    assert int(i_full.proj_iterations) > 0 and int(i_bare.proj_iterations) == 0
    radius = np.sqrt(np.asarray(A.radii_squared(1e-3, D)))
    for s, holds in ((s_full, True), (s_bare, False)):
        out = np.concatenate(
            [np.reshape(x, (n, -1)) for x in jax.tree.leaves(s.params["params"]["output"])], 1
        )
        dist = np.linalg.norm(out[:, None] - out[None], axis=-1)
        # feasible up to the float32 output's rounding: restore's distances, the rotation
        # back and v + move round a row by (p + 2) eps / 2 of its norm, at both ends
        p = out.shape[1]
        slack = reordered_sum(2 * p + 4) * np.linalg.norm(out, axis=1).max()
        assert bool(np.all(dist <= radius + slack)) is holds


def test_bench_study_times_a_binding_round_and_reports_the_solver():
    # A smoke run of experiments.bench_study on a tiny ridge batch: both windows and the
    # whole run carry the solver's statistics, and at t = 0.5 on the normalized D the
    # constraints bind.
    from experiments import bench_study as bs

    cfg = bs.StudyConfig(t_grid=(0.5,), warmup=3, rounds=1, run_rounds=7, dim=5)
    result = bs.bench_workload(cfg, bs.linear_workload(cfg, "ridge", 6, 2))
    assert result["members"] == 2 and result["total"] == 7
    assert result["transient"]["rounds"] == range(3, 4)
    assert result["settled"]["rounds"] == range(6, 7)
    assert result["run"]["its"].shape == (7, 2)
    for w in (result["transient"], result["settled"], result["run"]):
        assert w["cap_hits"] == 0 and w["unconverged"] == 0
        assert w["karula_ms"] > 0 and w["fedavg_ms"] > 0
    assert result["transient"]["its"].shape == (1, 2) and result["transient"]["active"] > 0
    lines = bs.rows(result)
    assert [line.split(" | ")[1] for line in lines] == ["4-4", "7-7"]
    assert bs.run_row(result).split(" | ")[1] == "1-7"
    assert bs.distribution(np.array([0, 1, 7])) == "0:33% 1:33% 6-10:33%"


def test_bench_projection_sweep_over_p_reports_quiet_and_loaded_calls():
    # The sweep of experiments.bench_projection: one row per p with the solver's
    # iterations, min <= median <= max of the quiet and the loaded calls and their ratio;
    # an unknown part is refused by name.
    from experiments import bench_projection as bp

    cfg = dataclasses.replace(bp.QUICK, sweep_p=(31,), sweep_calls=3)
    (row,) = bp.sweep(cfg)
    p, its, quiet, loaded, ratio = row.split(" | ")
    assert p == "31" and int(its) >= 0 and ratio.endswith("x")
    for spread in (quiet, loaded):
        lo, mid, hi = map(float, spread.split(" / "))
        assert 0 < lo <= mid <= hi
    with pytest.raises(ValueError, match="parts must be among"):
        bp.main(["--quick", "--parts", "cvxpy,timing"])


def test_bench_kernels_counts_loop_bodies_at_their_trips(monkeypatch):
    # experiments.bench_kernels: a program with a data-dependent outer loop (n = 4 trips)
    # and an inner loop of j + 1 trips in outer trip j (1 + 2 + 3 + 4 = 10). The launch
    # count must be every computation's operations times the times it ran, from trips
    # counted by the patched loops and matched to the optimized program's loops by source
    # line (neither trip count is known to XLA, so an unmatched loop counts 0).
    from experiments import bench_kernels as bk

    here = os.path.dirname(os.path.abspath(__file__)).replace(os.sep, "/") + "/"
    monkeypatch.setattr(bk, "_LIBRARY", here)

    def inner(c):
        i, v = c
        return i + 1, jnp.sin(v) * 2.0 + 1.0

    def outer(c):
        j, v = c  # the inner loop runs j + 1 times: no trip count XLA could know
        _, v = jax.lax.while_loop(lambda c: c[0] < j + 1, inner, (0, v))
        return j + 1, jnp.cos(v) + v * v

    def f(n, v):
        return jax.lax.while_loop(lambda c: c[0] < n, outer, (0, v))[1]

    args = (jnp.int32(4), jnp.ones((8,), jnp.float32))
    counter, compiled = bk._TripCounter(), []
    for patch in (contextlib.nullcontext(), counter):  # one line: the same source sites
        jax.clear_caches()
        with patch:
            compiled.append(jax.jit(f).lower(*args).compile())
    comps, entry = bk._parse_hlo(compiled[0].as_text())
    counted = compiled[1]
    for _ in range(2):
        jax.block_until_ready(counted(*args))
    trips = bk._collapse(counter.counts(), counter.traced, comps, rounds=2)
    assert sorted(trips.values()) == [4.0, 10.0]
    assert all(op.known_trips is None for ops_ in comps.values() for op in ops_)

    def ops(name):
        return sum(op.opcode not in bk._FREE for op in comps[name])

    # Runs of each computation, breadth first from the entry: a call runs its callee as
    # often as itself; the outer loop's body 4 times and condition 5, the inner's 10 and
    # 10 + 4.
    loops = [op for ops_ in comps.values() for op in ops_ if op.opcode == "while"]
    assert len(loops) == 2
    runs, todo = {entry: 1}, [entry]
    while todo:
        name = todo.pop()
        for op in comps[name]:
            if op.opcode == "call":
                runs[op.calls["to_apply"][0]] = runs[name]
                todo.append(op.calls["to_apply"][0])
            elif op.opcode == "while":
                body, cond = op.calls["body"][0], op.calls["condition"][0]
                inner_loop = runs[name] > 1
                runs[body] = 10 if inner_loop else 4
                runs[cond] = 10 + 4 if inner_loop else 5
                todo.append(body)
    expected = sum(ops(name) * r for name, r in runs.items())
    by_site, missing = collections.Counter(), set()
    total = bk._launches(comps, entry, (), 1.0, trips, by_site, missing)
    # operation counts times integer trip counts: integers, exact in float64
    assert not missing and total == expected
    assert sum(by_site.values()) == total


def test_bench_kernels_matches_a_traced_site_with_an_extra_caller_frame():
    # a counted trace can record one caller frame more than the optimized program's
    # metadata (a cached custom-batching rule): the kept site whose frames all appear in
    # order is the match; two such kept sites are ambiguous and match nothing
    from experiments import bench_kernels as bk

    loop, body, api_a, api_b, caller = (
        ("l.py", 5),
        ("l.py", 9),
        ("a.py", 1),
        ("a.py", 2),
        ("k.py", 3),
    )
    kept = {(loop, body, api_a, caller), (("l.py", 7), api_a)}
    assert bk._kept_site((loop, body, api_a, caller), kept) == (loop, body, api_a, caller)
    assert bk._kept_site((loop, body, api_a, api_b, caller), kept) == (loop, body, api_a, caller)
    assert bk._kept_site((loop, api_a, caller), kept) is None  # a frame missing, not extra
    assert bk._kept_site((("l.py", 6), body, api_a, caller), kept) is None
    kept.add((loop, body, api_b, caller))
    assert bk._kept_site((loop, body, api_a, api_b, caller), kept) is None


def test_bench_kernels_rows_without_the_cpu_program_show_dashes_there():
    # accelerator_only counts Karula with the accelerators' linear algebra only: its CPU
    # columns are "-", its ratio and sites come from the accelerator count
    from experiments import bench_kernels as bk

    def window(launches, iterations, sites):
        return dict(rounds=[10, 20], launches=launches, iterations=iterations, by_site=sites)

    fedavg = {w: window(500.0, 0.0, {}) for w in ("early", "late")}
    acc = {w: window(1500.0, 4.0, {"laplacian.py:1": 900.0}) for w in ("early", "late")}
    cpu = {w: window(5000.0, 4.0, {"_linalg.py:2": 4000.0}) for w in ("early", "late")}
    base = {"n": 7, "s": 2, "FedAvg": fedavg, "Karula, accelerator linalg": acc}
    cells = [c.strip() for c in bk._rows([base])[0].split("|")]
    assert cells[:6] == ["7", "early (11-20)", "500", "-", "-", "-"]
    assert cells[6:] == ["1,500", "4.00", "3.0x", "laplacian.py:1 900"]
    cells = [c.strip() for c in bk._rows([{**base, "Karula": cpu}])[1].split("|")]
    assert cells[1:6] == ["late (11-20)", "500", "5,000", "4.00", "10.0x"]
    assert cells[-1] == "_linalg.py:2 4,000"
