"""Benchmark: compiled federated rounds against the same rounds as a Python loop over clients."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from experiments.paths import OUTPUT
from karula_jax import algorithms as A
from karula_jax import projection, training
from karula_jax.algorithms._sampling import client_batch, sample_participants
from karula_jax.algorithms.variance_reduction import variance_reduced_direction
from karula_jax.benchmarking import bench_page, fastest, mlp_problem, publish, run_header
from karula_jax.data import client_weights
from karula_jax.models import output_layer_mask
from karula_jax.reporting import cli


@dataclasses.dataclass(frozen=True)
class RoundsConfig:
    """FEMNIST-sized rounds: ``training.run`` against an eager loop and a loop+jit.

    Command: ``python -m experiments.bench_rounds`` writes ``runs/bench/rounds.md``
    (``--out results/bench/rounds.md`` refreshes the committed page; 3-6 min on 2 busy CPU
    cores, most of it the eager loop); ``--quick`` only prints (about 1 min).

    Expected: a compiled Karula round (t = 1e-4) 13-20x faster than the eager loop, FedAvg
    about 100x; eager and compiled parameters equal to 1e-7; the projection 40-55% of a
    compiled Karula round at t = 1e-4 (every constraint active), under 10% at t = 20.

    Attributes:
      rounds, chunk: compiled rounds, in chunks of ``chunk`` (the fastest one is timed).
      eager_rounds: timed eager rounds, after a warm-up round.
      num_clients, per_round, batch_size: n, s and B. Synthetic data of FEMNIST shapes
        (150-210 rows of 784 normal features, labels 0..9), the 784-100-10 MLP, Karula
        personalizing its output layer, D uniform in [0.5, 1.5].
      t_values: Karula's t; the first one (constraints active every round) also runs
        eagerly, the second is the paper's FEMNIST value.
      karula_lr, fedavg_lr, local_steps: step sizes and FedAvg's E.
    """

    rounds: int = 60
    chunk: int = 5
    eager_rounds: int = 3
    num_clients: int = 30
    per_round: int = 15
    batch_size: int = 64
    t_values: tuple[float, ...] = (1e-4, 20.0)
    karula_lr: float = 0.5
    fedavg_lr: float = 0.05
    local_steps: int = 5


QUICK = RoundsConfig(rounds=10, eager_rounds=1, t_values=(1e-4,))


def eager_round(state, *, data, cfg, grad_fn, project, radii):
    """One Karula round (FedAvg when ``project`` is None) as a loop over the participants.

    Same participants, minibatch rows and arithmetic as the compiled round.
    """
    alpha = client_weights(data.counts)
    key_part, key_batch = jax.random.split(jax.random.fold_in(state.key, state.round))
    idx = sample_participants(key_part, data.num_clients, cfg.per_round)[1]

    def grad(p, i, e):
        k = jax.random.fold_in(jax.random.fold_in(key_batch, i), e)
        batch = client_batch(k, data.x[i], data.y[i], data.counts[i], cfg.batch_size)
        return grad_fn(p, *batch)[1]

    rows = {i: jax.tree.map(lambda a, i=i: a[i], state.params) for i in idx.tolist()}
    if project is None:  # FedAvg: E local steps per participant, then the weighted mean
        for i, p in rows.items():
            for e in range(cfg.local_steps):
                p = jax.tree.map(lambda a, g: a - cfg.fedavg_lr * g, p, grad(p, i, e))
            rows[i] = p
        w = alpha[idx] / jnp.sum(alpha[idx])
        mean = jax.tree.map(lambda *a: jnp.tensordot(w, jnp.stack(a), axes=1), *rows.values())
        params = jax.tree.map(lambda a: jnp.broadcast_to(a, (len(alpha), *a.shape)), mean)
        return state._replace(params=params, round=state.round + 1)
    G = [jax.tree.map(lambda g, i=i: alpha[i] * g, grad(p, i, 0)) for i, p in rows.items()]
    G = jax.tree.map(lambda *g: jnp.stack(g), *G)
    nu, memory = variance_reduced_direction(state.memory, G, idx)
    v = jax.tree.map(lambda th, d: th - cfg.karula_lr * d, state.params, nu)
    theta, info = project(v, radii, warm_start=state.proj_state)
    return state._replace(params=theta, memory=memory, proj_state=info.state, round=state.round + 1)


def loop_columns(cfg, alg, problem, project, radii, rate) -> str:
    """Eager and loop+jit rounds of ``alg``, speed-ups, and their difference to ``alg``."""
    data, params, loss, _ = problem
    key, grad = jax.random.PRNGKey(0), jax.value_and_grad(loss)
    step = functools.partial(eager_round, data=data, cfg=cfg, radii=radii)
    eager = functools.partial(step, grad_fn=grad, project=project)
    jitted = functools.partial(step, grad_fn=jax.jit(grad), project=project and jax.jit(project))
    (eager_s,), (state,) = fastest([eager], alg.init(params, data, key=key), cfg.eager_rounds)
    (jit_s,), _ = fastest([jitted], alg.init(params, data, key=key), 5)
    # the eager loop must compute the same rounds as the compiled program
    same = training.run(alg, params, data, key=key, num_rounds=int(state.round), progress=False)
    diff = jax.tree.map(lambda a, b: jnp.abs(a - b).max(), state.params, same.state.params)
    return (
        f"{1e3 * eager_s:.1f} | **{eager_s * rate:.1f}x** | {1e3 * jit_s:.1f} | "
        f"{jit_s * rate:.1f}x | {max(jax.tree.leaves(diff)):.1e}"
    )


def share_columns(cfg, alg, bare_alg, data, res) -> str:
    """The same compiled chunk of rounds with (``alg``) and without (``bare_alg``, built
    with ``projection_method="none"``) the projection; its statistics."""
    chunk = functools.partial(training.scan_rounds, alg, data=data, num_rounds=cfg.chunk)
    full = jax.jit(chunk).lower(res.state).compile()
    bare_chunk = functools.partial(training.scan_rounds, bare_alg, data=data, num_rounds=cfg.chunk)
    bare = jax.jit(bare_chunk).lower(res.state).compile()
    times, _ = fastest([lambda st: full(st)[0], lambda st: bare(st)[0]], res.state, 10)
    full_ms, bare_ms = (1e3 * s / cfg.chunk for s in times)
    i = res.info
    return (
        f"{full_ms:.2f} | {bare_ms:.2f} | **{100 - 100 * bare_ms / full_ms:.0f}%** | "
        f"{np.mean(i.proj_iterations):.1f} | {np.max(i.proj_delta):.1e} | "
        f"{np.max(i.proj_violation):.1e}"
    )


def bench(cfg: RoundsConfig) -> tuple[list[str], list[str]]:
    """Rows of the speed-up table and of the projection-share table."""
    problem = data, params, loss, D = mlp_problem(cfg.num_clients)
    pers = output_layer_mask(params)
    proj = functools.partial(projection.project, personalized=pers, max_iter=1000)
    kw = dict(clients_per_round=cfg.per_round, batch_size=cfg.batch_size)
    make = functools.partial(A.karula, loss, D, learning_rate=cfg.karula_lr, personalized=pers)
    cases = [(t, make(t=t, **kw)) for t in cfg.t_values]
    bare = {t: make(t=t, projection_method="none", **kw) for t in cfg.t_values}
    fedavg = A.fedavg(loss, learning_rate=cfg.fedavg_lr, local_steps=cfg.local_steps, **kw)
    cases.insert(1, (None, fedavg))
    rows, proj_rows = [], []
    for k, (t, alg) in enumerate(training.progress_bar(cases, desc="methods")):
        name = "FedAvg" if t is None else f"Karula t={t:g}"
        key = jax.random.PRNGKey(0)
        res = training.run(alg, params, data, key=key, num_rounds=cfg.rounds, chunk_size=cfg.chunk)
        rate = res.timings["best_rounds_per_s"]
        rows.append(f"{name} | {res.timings['compile_s']:.2f} | {1e3 / rate:.2f} | {rate:.1f} | ")
        if k >= 2:  # only the first Karula and FedAvg also run as loops over the clients
            rows[-1] += "- | - | - | - | -"
        else:
            radii, project = (None, None) if t is None else (A.radii_squared(t, D), proj)
            rows[-1] += loop_columns(cfg, alg, problem, project, radii, rate)
        if t is not None:
            proj_rows.append(f"{name} | " + share_columns(cfg, alg, bare[t], data, res))
    return rows, proj_rows


HEAD = (
    "method | compile (s) | compiled round (ms) | rounds/s | eager round (ms) | speed-up vs eager"
    " | loop+jit round (ms) | speed-up vs loop+jit | max abs diff eager vs compiled"
)
PROJ_HEAD = (
    "setting | round with projection (ms) | round without (ms) | share"
    " | projection iterations per round | max certified gap | max violation"
)


def to_markdown(cfg, argv, rows, proj_rows) -> str:
    return bench_page(
        "Compiled rounds vs an eager per-client Python loop",
        run_header("experiments.bench_rounds", argv, cfg),
        "Times are the best of several calls. Eager: a Python loop over the participants "
        "with un-jitted `jax.value_and_grad` and `projection.project`; loop+jit: the same "
        "loop with both jitted; the last column compares the eager and compiled "
        "parameters after the same rounds.\n",
        (HEAD, rows),
        "\nProjection share of a compiled Karula round: the same compiled chunk of rounds "
        'with and without the projection (traced with `projection_method="none"`, '
        "the identity), timed alternately; share = 1 - without / with. Iterations, gap "
        "and violation: the compiled run.\n",
        (PROJ_HEAD, proj_rows),
    )


def main(argv=None) -> None:
    out = OUTPUT / "bench/rounds.md"
    cfg, args = cli(RoundsConfig, argv, quick=lambda _: QUICK, description=__doc__, out=out)
    publish(to_markdown(cfg, argv, *bench(cfg)), args.out, quick=args.quick)


if __name__ == "__main__":
    main()
