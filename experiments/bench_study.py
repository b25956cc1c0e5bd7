"""Benchmark: Karula rounds where its constraints bind, against FedAvg, in vmapped batches."""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from experiments.paths import OUTPUT
from karula_jax import algorithms as A
from karula_jax import evaluation as ev
from karula_jax import protocol
from karula_jax.benchmarking import (
    bench_page,
    compiled_round,
    publish,
    random_dissimilarities,
    run_header,
)
from karula_jax.benchmarking import iteration_distribution as distribution
from karula_jax.data import ClientData, random_classification, synthetic_ridge
from karula_jax.models import cross_entropy_loss, init_params, logistic_loss, mlp, ridge_loss
from karula_jax.reporting import cli, markdown_table
from karula_jax.training import progress_bar


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """Vmapped Karula and FedAvg rounds on the synthetic study's workloads, timed after
    the clients have trained apart, so that Karula's constraints bind.

    Command: ``python -m experiments.bench_study [--FIELD VALUE ...] [--out FILE]`` writes
    ``runs/bench/study.md`` (``--out results/bench/study.md`` refreshes the committed page);
    ``--quick`` prints a tiny setting (2 min on a loaded
    machine, nearly all compilation).

    Workloads (one row each): ``ridge n`` for every n in ``ridge_sizes`` (the synthetic
    study's clients: ``synthetic_ridge``, d = ``dim``, s = n / 3, full gradients, steps
    ``rate_karula / L_f`` and ``rate_fedavg / L_max`` as in
    ``experiments/synthetic_ridge.py``); ``logistic n`` (the same features, labels
    ``y > median``); ``mlp n`` (``random_classification`` with ``mlp_features`` inputs,
    a one-hidden-layer MLP, the whole model personalized, Karula at its default step).
    A batch holds ``members`` runs (per size, as ``ridge_members``); member ``b`` draws
    seed ``b // T`` and ``t = t_grid[b % T]`` (``T`` grid points), on the mean-normalized
    D: the distances between exact local ridge fits (``"local"``) or the study's OT
    embedding (``"embedding"``, ``karula_jax.protocol.member_dissimilarities``).

    Expected: see ``results/bench/README.md``. Runtime: about 4 min on 2 CPU cores.

    Attributes:
      ridge_sizes, ridge_members: n of the ridge rows and the batch size of each.
      logistic_sizes, logistic_members: the same for the logistic rows.
      mlp_sizes, mlp_members, mlp_hidden, mlp_features, mlp_t: the MLP rows and their t.
      dim, lam, t_grid: d, the L2 penalty and Karula's grid of t.
      rate_karula, rate_fedavg, local_steps: step rules and FedAvg's E.
      warmup, rounds: rounds before the first timed window, and the rounds of each window
        (median reported); the methods take turns round by round.
      run_rounds: the length of the whole run, whose last ``rounds`` rounds are the second
        window (the synthetic study's 600: by then the active set has settled).
      large, warmup_large, rounds_large, run_rounds_large: from ``large`` clients on, these
        counts instead.
      projection_tol, projection_max_iter: Karula's stopping rule (the experiments'
        tolerance; the library's default cap).
      dissimilarity: ``"local"`` or ``"embedding"``.
    """

    ridge_sizes: tuple[int, ...] = (10, 30, 100, 300)
    ridge_members: tuple[int, ...] = (25, 50, 8, 2)
    logistic_sizes: tuple[int, ...] = (30,)
    logistic_members: tuple[int, ...] = (50,)
    mlp_sizes: tuple[int, ...] = (15,)
    mlp_members: tuple[int, ...] = (4,)
    mlp_hidden: int = 32
    mlp_features: int = 64
    mlp_t: float = 0.01
    dim: int = 50
    lam: float = 1e-6
    t_grid: tuple[float, ...] = (2.0, 4.0, 8.0, 16.0, 32.0)
    rate_karula: float = 3 / 8
    rate_fedavg: float = 1 / 10
    local_steps: int = 5
    warmup: int = 60
    rounds: int = 10
    large: int = 100
    warmup_large: int = 10
    rounds_large: int = 10
    run_rounds: int = 600
    run_rounds_large: int = 300
    projection_tol: float = 1e-4
    projection_max_iter: int = 1000
    dissimilarity: str = "local"


QUICK = StudyConfig(
    ridge_sizes=(10,),
    ridge_members=(4,),
    logistic_sizes=(),
    logistic_members=(),
    mlp_sizes=(6,),
    mlp_members=(2,),
    mlp_hidden=8,
    mlp_features=8,
    warmup=4,
    rounds=2,
    run_rounds=10,
)


class Workload(NamedTuple):
    """One row's runs: ``members`` stacked data sets and what the factories take."""

    name: str
    n: int
    p: int
    params: object  # one initial model
    data: ClientData  # leaves [M, n, N, ...]
    D: jnp.ndarray  # [M, n, n] mean-normalized
    t: jnp.ndarray  # [M]
    rate_karula: jnp.ndarray | None  # [M], None: Karula's default step
    rate_fedavg: jnp.ndarray  # [M]
    loss: object
    s: int
    batch: int


def _member_grid(cfg: StudyConfig, members: int):
    T = min(len(cfg.t_grid), members)
    seeds = [b // T for b in range(members)]
    ts = np.asarray([cfg.t_grid[b % T] for b in range(members)], np.float32)
    return seeds, ts


def linear_workload(cfg: StudyConfig, kind: str, n: int, members: int) -> Workload:
    """Ridge or logistic clients of the synthetic study, ``members`` runs."""
    seeds, ts = _member_grid(cfg, members)
    sets = {s: synthetic_ridge(s, num_clients=n, dim=cfg.dim).train for s in set(seeds)}
    local = {s: ev.ridge_solutions(d, cfg.lam)[0] for s, d in sets.items()}
    if kind == "logistic":
        sets = {s: _binary(d) for s, d in sets.items()}
    data = protocol.stack_datasets([sets[s] for s in seeds])
    if cfg.dissimilarity == "embedding":
        keys = jax.vmap(jax.random.key)(jnp.asarray(seeds))
        D, _ = protocol.member_dissimilarities(data, keys, num_reference=100, epsilon=0.5)
        D = np.asarray(D, np.float64)
    else:
        D = np.stack([ev.pairwise_sq_distances(local[s]) for s in seeds])
    L_f, L_max = protocol.smoothness_constants(data, cfg.lam, logistic=kind == "logistic")
    loss = ridge_loss(cfg.lam) if kind == "ridge" else logistic_loss(cfg.lam)
    if kind == "ridge":
        params = jnp.zeros((cfg.dim,), jnp.float32)
    else:
        params = {"w": jnp.zeros((cfg.dim,), jnp.float32), "b": jnp.zeros((), jnp.float32)}
    p = cfg.dim + (kind == "logistic")
    return Workload(
        name=f"{kind} n={n}",
        n=n,
        p=p,
        params=params,
        data=data,
        D=jnp.asarray(protocol.mean_normalized(D), jnp.float32),
        t=jnp.asarray(ts),
        rate_karula=jnp.asarray(cfg.rate_karula / L_f, jnp.float32),
        rate_fedavg=jnp.asarray(cfg.rate_fedavg / L_max, jnp.float32),
        loss=loss,
        s=max(1, n // 3),
        batch=int(data.x.shape[2]),
    )


def _binary(d: ClientData) -> ClientData:
    """Labels ``y > median(y)`` over each client's real rows."""
    y = np.asarray(d.y, np.float64)
    mask = np.arange(y.shape[1])[None] < np.asarray(d.counts)[:, None]
    med = np.asarray([np.median(row[m]) for row, m in zip(y, mask, strict=True)])
    return d._replace(y=jnp.asarray((y > med[:, None]) & mask, jnp.float32))


def mlp_workload(cfg: StudyConfig, n: int, members: int) -> Workload:
    """A whole-model-personalized MLP on random classification clients."""
    model = mlp(cfg.mlp_hidden, 10)
    params = init_params(model, jax.random.PRNGKey(0), (1, cfg.mlp_features))
    sets = [
        random_classification(n, seed=b, rows=(30, 60), features=cfg.mlp_features)
        for b in range(members)
    ]
    data = protocol.stack_datasets(sets)
    rng = np.random.default_rng(1)
    D = [random_dissimilarities(n, rng=rng) for _ in range(members)]
    p = int(sum(x.size for x in jax.tree.leaves(params)))
    return Workload(
        name=f"mlp n={n} (whole model)",
        n=n,
        p=p,
        params=params,
        data=data,
        D=jnp.asarray(protocol.mean_normalized(np.stack(D)), jnp.float32),
        t=jnp.full((members,), cfg.mlp_t, jnp.float32),
        rate_karula=None,
        rate_fedavg=jnp.full((members,), 0.05, jnp.float32),
        loss=cross_entropy_loss(model.apply),
        s=max(1, n // 3),
        batch=32,
    )


def _algorithms(cfg: StudyConfig, w: Workload):
    common = dict(clients_per_round=w.s, batch_size=w.batch)

    def karula(D, t, rate, projection_method="auto"):
        return A.karula(
            w.loss,
            D,
            t=t,
            learning_rate=rate,
            projection_tol=cfg.projection_tol,
            projection_max_iter=cfg.projection_max_iter,
            projection_method=projection_method,
            **common,
        )

    def fedavg(rate):
        return A.fedavg(w.loss, learning_rate=rate, local_steps=cfg.local_steps, **common)

    return karula, fedavg


def bench_workload(cfg: StudyConfig, w: Workload) -> dict:
    """Times FedAvg, Karula and Karula without its projection on ``w``'s batch."""
    karula, fedavg = _algorithms(cfg, w)
    M = int(w.t.shape[0])
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(M))
    # Karula's step: the workload's rates, or its default rule (no argument).
    k_args = (w.data, w.D, w.t) + (() if w.rate_karula is None else (w.rate_karula,))

    def k_alg(D, t, *rate, projection_method="auto"):
        return karula(D, t, rate[0] if rate else None, projection_method)

    k_init = jax.jit(jax.vmap(lambda d, D, t, *r, key: k_alg(D, t, *r).init(w.params, d, key=key)))
    k_state = k_init(*k_args, key=keys)
    f_state = jax.jit(jax.vmap(lambda d, r, key: fedavg(r).init(w.params, d, key=key)))(
        w.data, w.rate_fedavg, key=keys
    )

    k_round = lambda st, d, D, t, *r: jax.vmap(  # noqa: E731
        lambda st, d, D, t, *r: k_alg(D, t, *r).round(st, d)
    )(st, d, D, t, *r)
    f_round = lambda st, d, r: jax.vmap(lambda st, d, r: fedavg(r).round(st, d))(  # noqa: E731
        st, d, r
    )
    fns = {"FedAvg": compiled_round(f_round, f_state, w.data, w.rate_fedavg)[0]}
    fns["Karula"] = compiled_round(k_round, k_state, *k_args)[0]
    bare = lambda st, d, D, t, *r: jax.vmap(  # noqa: E731 - the round, projection skipped
        lambda st, d, D, t, *r: k_alg(D, t, *r, projection_method="none").round(st, d)
    )(st, d, D, t, *r)
    fns["bare"] = compiled_round(bare, k_state, *k_args)[0]
    big = w.n >= cfg.large
    windows = _windows(cfg, big)
    total = windows["settled"].stop
    times = {k: np.zeros(total) for k in fns}  # seconds per batch round
    infos, active = [], {k: [] for k in windows}
    iu = np.triu_indices(w.n, 1)
    for r in range(total):  # the methods take turns round by round
        timed = [k for k, v in windows.items() if r in v]
        if timed:
            st = jax.block_until_ready(jax.tree.map(jnp.copy, k_state))
            t0 = time.perf_counter()
            jax.block_until_ready(fns["bare"](st, *k_args))
            times["bare"][r] = time.perf_counter() - t0
        t0 = time.perf_counter()
        f_state, _ = jax.block_until_ready(fns["FedAvg"](f_state, w.data, w.rate_fedavg))
        times["FedAvg"][r] = time.perf_counter() - t0
        t0 = time.perf_counter()
        k_state, info = jax.block_until_ready(fns["Karula"](k_state, *k_args))
        times["Karula"][r] = time.perf_counter() - t0
        infos.append(jax.device_get(info))
        for k in timed:
            lam = np.asarray(k_state.proj_state.lam)
            active[k].append(np.mean(lam[:, iu[0], iu[1]] > 0, axis=1))
    ms = {k: 1e3 * v / M for k, v in times.items()}
    stats = lambda rs: _solver_stats(cfg, [infos[r] for r in rs])  # noqa: E731
    out = dict(name=w.name, n=w.n, p=w.p, members=M, total=total)
    for k, rs in windows.items():
        sel = np.asarray(rs)
        karula_ms = float(np.median(ms["Karula"][sel]))
        out[k] = stats(rs) | dict(
            rounds=rs,
            fedavg_ms=float(np.median(ms["FedAvg"][sel])),
            karula_ms=karula_ms,
            ratios=ms["Karula"][sel] / ms["FedAvg"][sel],
            share=1.0 - float(np.median(ms["bare"][sel])) / karula_ms,
            active=float(np.mean(active[k])),
        )
    out["run"] = stats(range(total)) | dict(
        fedavg_ms=float(np.mean(ms["FedAvg"])), karula_ms=float(np.mean(ms["Karula"]))
    )
    return out


def _windows(cfg: StudyConfig, big: bool) -> dict[str, range]:
    """The timed rounds (0-based): ``transient`` right after the warm-up, ``settled``
    the last ``rounds`` of a run of ``run_rounds``."""
    warmup, rounds = (cfg.warmup_large, cfg.rounds_large) if big else (cfg.warmup, cfg.rounds)
    total = max(cfg.run_rounds_large if big else cfg.run_rounds, warmup + 2 * rounds)
    return {"transient": range(warmup, warmup + rounds), "settled": range(total - rounds, total)}


def _solver_stats(cfg: StudyConfig, infos) -> dict:
    its = np.stack([np.asarray(i.proj_iterations) for i in infos])  # [rounds, M]
    return dict(
        its=its,
        cap_hits=int(np.sum(its >= cfg.projection_max_iter)),
        unconverged=int(np.sum(~np.stack([np.asarray(i.proj_converged) for i in infos]))),
        gap=float(max(np.max(np.asarray(i.proj_delta)) for i in infos)),
        violation=float(max(np.max(np.asarray(i.proj_violation)) for i in infos)),
    )


HEAD = (
    "workload | rounds | p | members | FedAvg ms | Karula ms | ratio (median, min-max)"
    " | projection share | iterations mean / max | iteration distribution | cap hits"
    " | unconverged | worst gap | worst violation | pairs with lam > 0"
)
RUN_HEAD = (
    "workload | rounds | FedAvg ms | Karula ms | ratio | iterations mean / max"
    " | iteration distribution | cap hits | unconverged | worst gap | worst violation"
)


def rows(r: dict) -> list[str]:
    """One row per timed window of :func:`bench_workload`'s result ``r``."""
    out = []
    for k in ("transient", "settled"):
        w, ratio = r[k], r[k]["ratios"]
        rounds = f"{w['rounds'].start + 1}-{w['rounds'].stop}"
        out.append(
            f"{r['name']} | {rounds} | {r['p']} | {r['members']} | {w['fedavg_ms']:.3f} | "
            f"{w['karula_ms']:.3f} | {np.median(ratio):.1f}x ({ratio.min():.1f}-"
            f"{ratio.max():.1f}) | {100 * w['share']:.0f}% | {_solver_columns(w)} | "
            f"{100 * w['active']:.1f}%"
        )
    return out


def run_row(r: dict) -> str:
    """The whole run of ``r``: mean member-round times over every round."""
    w = r["run"]
    return (
        f"{r['name']} | 1-{r['total']} | {w['fedavg_ms']:.3f} | {w['karula_ms']:.3f} | "
        f"{w['karula_ms'] / w['fedavg_ms']:.1f}x | {_solver_columns(w)}"
    )


def _solver_columns(w: dict) -> str:
    its = w["its"]
    return (
        f"{its.mean():.1f} / {its.max()} | {distribution(its)} | {w['cap_hits']} | "
        f"{w['unconverged']} | {w['gap']:.1e} | {w['violation']:.1e}"
    )


def workloads(cfg: StudyConfig):
    for n, m in zip(cfg.ridge_sizes, cfg.ridge_members, strict=True):
        yield lambda n=n, m=m: linear_workload(cfg, "ridge", n, m)
    for n, m in zip(cfg.logistic_sizes, cfg.logistic_members, strict=True):
        yield lambda n=n, m=m: linear_workload(cfg, "logistic", n, m)
    for n, m in zip(cfg.mlp_sizes, cfg.mlp_members, strict=True):
        yield lambda n=n, m=m: mlp_workload(cfg, n, m)


def to_markdown(cfg, argv, results) -> str:
    return bench_page(
        "Karula where its constraints bind: vmapped member-rounds against FedAvg",
        run_header("experiments.bench_study", argv, cfg),
        "One process per table; the methods take turns round by round. Two windows of "
        "rounds are timed: right after the warm-up (the clients have trained apart, the "
        "multipliers still move) and the last rounds of a run as long as the synthetic "
        "study's (the active set has settled). Times are per member-round (a batch's "
        "round / its members), median over the window; the ratio's range is over its "
        "rounds. Projection "
        "share: 1 - (the same round with the projection replaced by the identity) / "
        "(the round). Iterations: the projection solver's, per member-round (on the CPU "
        "the members' projections run in turn, each its own count; on a GPU a vmapped "
        "batch waits for its slowest member). Worst gap: the largest certified "
        "gap (absolute); unconverged: member-rounds above tolerance. Pairs with lam > "
        "0: share of the n(n-1)/2 multipliers, mean over members and timed rounds.\n",
        (HEAD, [line for r in results for line in rows(r)]),
        "Whole runs: every round from the first (compiled beforehand), mean member-round "
        "time; the ratio is Karula's total time over FedAvg's.\n",
        (RUN_HEAD, [run_row(r) for r in results]),
    )


def main(argv=None) -> None:
    out = OUTPUT / "bench/study.md"
    cfg, args = cli(StudyConfig, argv, quick=lambda _: QUICK, description=__doc__, out=out)
    results = []
    for make in progress_bar(list(workloads(cfg)), desc="workload"):
        results.append(bench_workload(cfg, make()))
        print(markdown_table(HEAD, rows(results[-1])), flush=True)
        print(markdown_table(RUN_HEAD, [run_row(results[-1])]), flush=True)
    publish(to_markdown(cfg, argv, results), args.out, quick=args.quick)


if __name__ == "__main__":
    main()
