"""Benchmark: FedAvg and Karula rounds, compile time and state size as n grows."""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.paths import OUTPUT
from karula_jax import algorithms as A
from karula_jax.benchmarking import (
    bench_page,
    compiled_round,
    mlp_problem,
    nbytes,
    publish,
    run_header,
)
from karula_jax.models import output_layer_mask
from karula_jax.reporting import cli, markdown_table
from karula_jax.training import progress_bar


@dataclasses.dataclass(frozen=True)
class ScaleConfig:
    """FEMNIST-shaped rounds of FedAvg and Karula (default projection) for growing n.

    Command: ``python -m experiments.bench_scale [--FIELD VALUE ...] [--out FILE]`` writes
    ``runs/bench/scale.md`` (``--out results/bench/scale.md`` refreshes the committed page);
    ``--quick`` prints n = 30, 100 only (about 1 min).

    Expected: 3 min on 2 CPU cores or one H100. Karula 0.8-1.4x a FedAvg round at t = 20
    and at the stress t from n = 300 on (CPU; 3 timed rounds from n = 1000, so noisy); at
    the stress t and n <= 100 the projection solver makes it 1.8-1.9x (CPU), 8-15x (H100,
    older code). State 1.00x the minimum, compile under 6 s (CPU).

    Attributes:
      sizes: numbers of clients n; s = n / 10 participate in a round.
      t_values: Karula's t: the paper's FEMNIST value and a stress value at which
        constraints are active every round.
      rounds, rounds_large: timed rounds per method (median reported) for n below and
        from ``large`` on, after ``warmup`` untimed rounds; methods take turns round by
        round.
      batch_size, local_steps, karula_lr, fedavg_lr: B, FedAvg's E and the step sizes.
      karula_default_step: Karula at its derived default step instead of ``karula_lr``
        (with ``t_values=(0.001,)`` and ``warmup=5`` the constraints bind from n = 30 to
        300: the mode of issue 24, ``results/bench/scale_binding.md``).
      projection_method: Karula's ``projection_method``; several, comma-separated (e.g.
        ``laplacian,fista``), run as separate Karula rows in the same process, taking turns.
      rows: the range of each client's number of rows (FEMNIST's writers: 150-210).
      (data: ``karula_jax.data.random_classification``, D uniform in [0.5, 1.5].)
    """

    sizes: tuple[int, ...] = (30, 100, 300, 1000, 3000)
    t_values: tuple[float, ...] = (20.0, 0.01)
    rounds: int = 7
    rounds_large: int = 3
    large: int = 1000
    batch_size: int = 32
    local_steps: int = 5
    karula_lr: float = 0.5
    fedavg_lr: float = 0.05
    karula_default_step: bool = False
    warmup: int = 1
    projection_method: str = "auto"
    rows: tuple[int, ...] = (150, 210)


QUICK = ScaleConfig(sizes=(30, 100), rounds=3)


def minimum_bytes(params, pers, n: int, karula: bool) -> int:
    """What the method must hold: FedAvg one model; Karula the gradient memory n x p,
    the personalized leaves n x p_pers, the shared leaves once and n^2 dual scalars."""
    total = nbytes(params)
    if not karula:
        return total
    own = sum(
        x.nbytes for x, m in zip(jax.tree.leaves(params), jax.tree.leaves(pers), strict=True) if m
    )
    return n * total + n * own + (total - own) + 4 * n * n


def methods_of(cfg: ScaleConfig) -> list[str]:
    """The projection methods of ``cfg.projection_method`` (comma-separated)."""
    return [m.strip() for m in cfg.projection_method.split(",") if m.strip()]


def bench_n(cfg: ScaleConfig, n: int) -> list[str]:
    # FEMNIST's shapes, D uniform in [0.5, 1.5]
    data, params, loss, D = mlp_problem(n, rows=cfg.rows)
    pers = output_layer_mask(params)
    kw = dict(clients_per_round=max(1, n // 10), batch_size=cfg.batch_size)
    bare = {}
    algs = {
        "FedAvg": A.fedavg(loss, learning_rate=cfg.fedavg_lr, local_steps=cfg.local_steps, **kw)
    }
    for t in cfg.t_values:
        make = functools.partial(
            A.karula,
            loss,
            D,
            t=t,
            learning_rate=None if cfg.karula_default_step else cfg.karula_lr,
            personalized=pers,
            **kw,
        )
        methods = methods_of(cfg)
        for method in methods:
            name = f"Karula t={t:g}" + (f" {method}" if len(methods) > 1 else "")
            algs[name] = make(projection_method=method)
            # The same round with the projection skipped: its share of the round's time.
            bare[name] = make(projection_method="none")
    states, fns, compile_s = {}, {}, {}
    for name, alg in algs.items():
        states[name] = jax.block_until_ready(alg.init(params, data, key=jax.random.PRNGKey(0)))
        fns[name], compile_s[name] = compiled_round(alg.round, states[name], data)
        if name != "FedAvg":
            fns[name + " bare"], _ = compiled_round(bare[name].round, states[name], data)
    rounds = cfg.rounds if n < cfg.large else cfg.rounds_large
    times = {k: [] for k in fns}
    infos = {k: [] for k in algs}
    for r in range(cfg.warmup + rounds):  # methods take turns
        for name, fn in fns.items():
            base = name.removesuffix(" bare")
            if name != base:  # from a copy of the method's state (the call consumes it)
                states[name] = jax.block_until_ready(jax.tree.map(jnp.copy, states[base]))
            t0 = time.perf_counter()
            states[name], info = jax.block_until_ready(fn(states[name], data))
            if r >= cfg.warmup:
                times[name].append(time.perf_counter() - t0)
            if name in algs and r >= cfg.warmup:
                infos[name].append(info)
    ms = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    rows = []
    for name in algs:
        karula = name != "FedAvg"
        have, need = nbytes(states[name]), minimum_bytes(params, pers, n, karula)
        row = f"{n} | {name} | {ms[name]:.1f} | {ms[name] / ms['FedAvg']:.1f}x | "
        row += f"{compile_s[name]:.1f} | {have / 2**20:.1f} | {need / 2**20:.2f} | "
        row += f"{have / need:.2f}x | "
        if not karula:
            rows.append(row + "- | - | - | -")
            continue
        share = 1.0 - ms[name + " bare"] / ms[name]
        its = np.mean([int(i.proj_iterations) for i in infos[name]])
        lam = np.asarray(states[name].proj_state.lam)
        active = np.count_nonzero(np.triu(lam, 1)) / (n * (n - 1) / 2)
        gap = max(float(i.proj_delta) for i in infos[name])
        rows.append(row + f"{100 * share:.0f}% | {its:.1f} | {100 * active:.1f}% | {gap:.1e}")
    return rows


HEAD = (
    "n | method | ms / round | vs FedAvg | compile (s) | state MiB | minimum MiB | state / min"
    " | projection share | projection iterations | pairs with lam > 0 | max certified gap"
)


def to_markdown(cfg, argv, rows) -> str:
    return bench_page(
        "FedAvg and Karula rounds as the number of clients grows",
        run_header("experiments.bench_scale", argv, cfg),
        f"One process; after {cfg.warmup} warm-up round(s) the methods take turns round by round "
        "and the median round is reported. Compile: lowering and compiling one round. "
        "State: bytes of the `FedState` leaves; minimum: what the method must hold "
        "(FedAvg one model; Karula the gradient memory n x p, the personalized leaves "
        "n x p_pers, shared leaves once and n^2 dual scalars). Projection share: 1 - "
        "(the same round with the projection replaced by the identity) / (the round). "
        "Pairs with lam > 0: of the n(n-1)/2 multipliers after the last round.\n",
        (HEAD, rows),
    )


def main(argv=None) -> None:
    out = OUTPUT / "bench/scale.md"
    cfg, args = cli(ScaleConfig, argv, quick=lambda _: QUICK, description=__doc__, out=out)
    rows = []
    for n in progress_bar(cfg.sizes, desc="n"):
        rows += bench_n(cfg, n)
        print(
            markdown_table(HEAD, rows[-len(cfg.t_values) * len(methods_of(cfg)) - 1 :]), flush=True
        )
    publish(to_markdown(cfg, argv, rows), args.out, quick=args.quick)


if __name__ == "__main__":
    main()
