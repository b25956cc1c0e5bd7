"""Benchmark: Karula's two projection solvers in vmapped runs, for small n (``choose_method``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from experiments.paths import OUTPUT
from karula_jax import algorithms as A
from karula_jax.benchmarking import bench_page, publish, random_dissimilarities, run_header
from karula_jax.data import synthetic_ridge
from karula_jax.models import ridge_loss
from karula_jax.reporting import cli
from karula_jax.training import progress_bar, run_many


@dataclasses.dataclass(frozen=True)
class SolversConfig:
    """Ridge Karula runs, seeds x a t grid vmapped, once with each projection solver.

    Command: ``python -m experiments.bench_solvers [--FIELD VALUE ...]`` writes
    ``runs/bench/solvers.md`` (``--out results/bench/solvers.md`` refreshes the committed page);
    ``--quick`` prints one small case.

    Expected: 7 min on 2 CPU cores. At n = 4 Dykstra is 1.3x faster; from n = 6 the
    Laplacian dual is (2x at n = 6, 16x at n = 30); both miss their tolerance in a few
    rounds.

    Attributes:
      cases: ``(n, d, seeds, grid points)``; t is geometric in [``t_min``, 1] times the
        median squared distance between the true models (D uniform in [0.5, 1.5]).
      rounds, clients_per_round_frac, batch_size, lam: the runs (s = n * frac, at least 1).
      reps: timed repetitions per solver (the faster is reported), interleaved.
    """

    cases: tuple[tuple[int, int, int, int], ...] = (
        (4, 14, 5, 7),
        (6, 30, 5, 5),
        (8, 50, 5, 5),
        (16, 50, 5, 5),
        (30, 50, 2, 5),
    )
    t_min: float = 0.003
    rounds: int = 200
    clients_per_round_frac: float = 1 / 3
    batch_size: int = 20
    lam: float = 0.01
    reps: int = 2


QUICK = SolversConfig(cases=((4, 14, 2, 2),), rounds=20, reps=1)
SOLVERS = ("dykstra", "laplacian")


def bench_case(cfg: SolversConfig, n: int, d: int, seeds: int, points: int) -> list[str]:
    data = synthetic_ridge(0, num_clients=n, dim=d, min_samples=20, max_samples=60)
    theta = np.asarray(data.theta_true, np.float64)
    sq = np.sum((theta[:, None] - theta[None]) ** 2, axis=-1)
    rng = np.random.default_rng(0)
    D = random_dissimilarities(n, rng=rng) * np.median(sq[np.triu_indices(n, 1)])
    D = jnp.asarray(D, jnp.float32)
    grid = {"t": jnp.asarray(np.geomspace(cfg.t_min, 1.0, points), jnp.float32)}
    s = max(1, int(n * cfg.clients_per_round_frac))
    keys = jax.vmap(jax.random.key)(jnp.arange(seeds))
    best = {}
    for _ in range(cfg.reps):
        for method in SOLVERS:

            def make(t, method=method):
                return A.karula(
                    ridge_loss(cfg.lam),
                    D,
                    t=t,
                    clients_per_round=s,
                    batch_size=cfg.batch_size,
                    projection_method=method,
                )

            res = run_many(
                make,
                jnp.zeros((d,)),
                data.train,
                keys=keys,
                num_rounds=cfg.rounds,
                hyper=grid,
                progress=False,
            )
            run_s = res.timings["run_s"]
            if method not in best or run_s < best[method][0]:
                it = np.asarray(res.info.proj_iterations)
                missed = len(res.diagnostics["unconverged_rounds"])
                best[method] = (run_s, res.timings["compile_s"], it.mean(), it.max(), missed)
    ref = best["dykstra"][0]
    return [
        f"{n} | {d} | {seeds * points} | {m} | {r:.2f} | {r / ref:.2f}x | {c:.1f} | "
        f"{mean:.1f} | {mx} | {missed}"
        for m, (r, c, mean, mx, missed) in best.items()
    ]


HEAD = (
    "n | p | members | solver | run [s] | vs Dykstra | compile [s] | mean iterations"
    " | max iterations | rounds missing tol"
)


def main(argv=None) -> None:
    out = OUTPUT / "bench/solvers.md"
    cfg, args = cli(SolversConfig, argv, quick=lambda _: QUICK, description=__doc__, out=out)
    rows = []
    for case in progress_bar(cfg.cases, desc="cases"):
        rows += bench_case(cfg, *case)
    text = bench_page(
        "Projection solvers in vmapped Karula runs (small n)",
        run_header("experiments.bench_solvers", argv, cfg),
        "Ridge Karula, every seed and t of the grid in one vmapped run (`run_many`), "
        "warm-started projection, tol 1e-6, 1000 iterations at most. Run: the compiled "
        "rounds' time (faster of the repetitions); iterations are per member and round; "
        "rounds missing tol: rounds in which some member's projection stopped above "
        "its tolerance (still feasible).\n",
        (HEAD, rows),
    )
    publish(text, args.out, quick=args.quick)


if __name__ == "__main__":
    main()
