"""Benchmark: warm-started projections, the Newton-CG dual (``laplacian``) against the
accelerated projected gradient (``fista``), interleaved in one process.

Command: ``python -m experiments.bench_fista N P [ROUNDS]`` prints, per solver, the cold
start's iterations and certified gap, then ``ROUNDS`` warm-started projections of the
last answer moved by Gaussian noise (standard deviation 0.05, ten times that for about a
tenth of the clients, as a round's participants): median time (the first dropped when
there are more than one), iterations, and whether every one converged. Instance:
``experiments.bench_projection.make_instance(N, P)`` (about half the pairs violated at
the start), float32, tol 1e-6, cap 3000. Runtime: under a minute at N = 100, P = 1010 on
2 quiet CPU cores; several at N = 300.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_projection import make_instance
from karula_jax.projection import project

METHODS = ("laplacian", "fista")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    n, p = int(argv[0]), int(argv[1])
    reps = int(argv[2]) if len(argv) > 2 else 3
    v, r2 = make_instance(n, p)
    rng = np.random.default_rng(1)
    v, r2 = jnp.asarray(v, jnp.float32), jnp.asarray(r2, jnp.float32)
    res = {}
    for m in METHODS:
        th, info = project(v, r2, method=m, tol=1e-6, max_iter=3000)
        res[m] = dict(th=th, state=info.state, t=[], it=[], ok=[])
        active = float(jnp.mean(info.state.lam > 0))
        print(
            f"{m} cold: {int(info.iterations)} iterations, gap {float(info.rel_delta):.2e} S,"
            f" pairs with lam > 0 {100 * active:.1f}%",
            flush=True,
        )
    for _ in range(reps):
        noise = rng.normal(size=v.shape).astype(np.float32) * 0.05
        noise[rng.random(n) < 0.1] *= 10
        for m in METHODS:
            x = res[m]["th"] + noise
            t0 = time.perf_counter()
            th, info = project(x, r2, method=m, tol=1e-6, max_iter=3000, warm_start=res[m]["state"])
            jax.block_until_ready(th)
            res[m]["t"].append(time.perf_counter() - t0)
            res[m]["th"], res[m]["state"] = th, info.state
            res[m]["it"].append(int(info.iterations))
            res[m]["ok"].append(bool(info.converged))
    for m, r in res.items():
        ms = 1e3 * np.median(r["t"][1:] or r["t"])
        print(
            f"n = {n}, p = {p}, {m}: warm median {ms:.1f} ms, iterations {r['it']},"
            f" all converged {all(r['ok'])}",
            flush=True,
        )


if __name__ == "__main__":
    main()
