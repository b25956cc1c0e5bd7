"""Benchmark: compiled federated rounds against the same rounds as an eager Python loop.

Command: ``python -m experiments.bench_rounds [--rounds 40] [--eager-rounds 3] [--out FILE]``
(about 3-6 minutes on 2 busy CPU cores, most of it the eager loop).

Problem (FEMNIST-sized, synthetic data of FEMNIST shapes): n = 30 clients with 150-210
rows each of 784 standard-normal features and labels in 0..9, the 784-100-10 ReLU MLP, 15
clients per round, minibatch B = 64. Karula personalizes the output layer only (the hidden
layer is shared, i.e. projected to its mean); dissimilarities ``D`` are random in
[0.5, 1.5] and ``t`` is small enough that the constraints are active every round (the
projection's iteration count is reported). FedAvg runs E = 5 local steps on one global
model.

For each method it reports

* compiled: :func:`karula_jax.training.run` (chunks of ``lax.scan``); compile time and
  rounds per second after compilation;
* eager: the SAME rounds (same participants, minibatch rows and arithmetic, checked to
  agree with the compiled state after ``--eager-rounds`` rounds) written as a Python loop
  over participants with un-jitted ``jax.value_and_grad`` calls, and for Karula an
  eager call of :func:`karula_jax.projection.project`;
* loop+jit: the same Python loop with the per-client step and the projection jitted
  (the pattern of most federated libraries), as a second, stronger reference;
* the ratio compiled / eager (target >= 20x on the CPU).

It also times the projection alone (jitted, warm-started from the state of a running
Karula round, at the same shapes) and reports its share of a compiled Karula round
(target <= 1/2). All timings come from this process on this machine.
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax import projection, training
from karula_jax.algorithms import _common as C
from karula_jax.algorithms import fedavg, karula
from karula_jax.algorithms.karula import radii_squared
from karula_jax.data import from_client_arrays
from karula_jax.models import cross_entropy_loss, init_params, mlp, output_layer_mask

REPO = pathlib.Path(__file__).resolve().parents[1]

N_CLIENTS, PER_ROUND, BATCH, LOCAL_STEPS = 30, 15, 64, 5
KARULA_LR, FEDAVG_LR, T = 0.5, 0.05, 1e-4
CHUNK = 5  # rounds per compiled chunk; the fastest chunk gives the compiled time


def make_problem(seed: int = 0):
    """Synthetic FEMNIST-shaped clients, the MLP, its loss and random dissimilarities."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(150, 211, size=N_CLIENTS)
    xs = [rng.normal(size=(c, 784)).astype(np.float32) for c in counts]
    ys = [rng.integers(0, 10, size=c) for c in counts]
    data = from_client_arrays(xs, ys, num_classes=10)
    model = mlp(100, 10)
    params = init_params(model, jax.random.PRNGKey(seed), (1, 784))
    loss = cross_entropy_loss(model.apply)
    d = rng.uniform(0.5, 1.5, size=(N_CLIENTS, N_CLIENTS))
    D = np.triu(d, 1) + np.triu(d, 1).T
    return data, params, loss, D


def block(tree):
    return jax.tree.map(lambda a: a.block_until_ready(), tree)


# --------------------------------------------------------------------------- eager rounds


def _rows(tree, i):
    return jax.tree.map(lambda a: a[i], tree)


def karula_round_eager(state, data, loss, radii, personalized, alpha, grad_fn, proj_fn):
    """One Karula round, participant by participant (mirrors ``algorithms.karula``)."""
    n, s = data.num_clients, PER_ROUND
    key = jax.random.fold_in(state.key, state.round)
    key_part, key_batch = jax.random.split(key)
    _, idx = C.sample_participants(key_part, n, s)
    nu = jax.tree.map(lambda m: m / n, state.memory)
    memory = state.memory
    for i in np.asarray(idx).tolist():
        k = jax.random.fold_in(jax.random.fold_in(key_batch, i), 0)
        xb, yb, mb = C.client_batch(k, data.x[i], data.y[i], data.counts[i], BATCH)
        _, g = grad_fn(_rows(state.params, i), xb, yb, mb)
        G = jax.tree.map(lambda a, i=i: alpha[i] * a, g)
        nu = jax.tree.map(lambda v, gi, m, i=i: v.at[i].add((gi - m[i]) / s), nu, G, memory)
        memory = jax.tree.map(lambda m, gi, i=i: m.at[i].set(gi), memory, G)
    v = jax.tree.map(lambda th, d: th - KARULA_LR * d, state.params, nu)
    theta, pinfo = proj_fn(v, radii, state.proj_state)
    return state._replace(
        params=theta, memory=memory, proj_state=pinfo.state, round=state.round + 1
    )


def fedavg_round_eager(state, data, loss, alpha, grad_fn):
    """One FedAvg round, participant by participant and step by step."""
    n, s = data.num_clients, PER_ROUND
    key = jax.random.fold_in(state.key, state.round)
    key_part, key_batch = jax.random.split(key)
    _, idx = C.sample_participants(key_part, n, s)
    total = sum(float(alpha[i]) for i in np.asarray(idx).tolist())
    avg = None
    for i in np.asarray(idx).tolist():
        p = _rows(state.params, i)
        ki = jax.random.fold_in(key_batch, i)
        for e in range(LOCAL_STEPS):
            xb, yb, mb = C.client_batch(
                jax.random.fold_in(ki, e), data.x[i], data.y[i], data.counts[i], BATCH
            )
            _, g = grad_fn(p, xb, yb, mb)
            p = jax.tree.map(lambda a, b: a - FEDAVG_LR * b, p, g)
        w = alpha[i] / total
        contrib = jax.tree.map(lambda a, w=w: w * a, p)
        avg = contrib if avg is None else jax.tree.map(jnp.add, avg, contrib)
    params = jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), avg)
    return state._replace(params=params, round=state.round + 1)


def time_eager(step, state, rounds):
    """Fastest round of an eager round function, in seconds (after one warm-up round)."""
    state = block(step(state))
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        state = block(step(state))
        best = min(best, time.perf_counter() - t0)
    return best, state


def max_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


# --------------------------------------------------------------------------- main


def bench(rounds: int, eager_rounds: int) -> tuple[list[dict], dict]:
    data, params, loss, D = make_problem()
    personalized = output_layer_mask(params)
    alpha = C.resolve_weights(None, data)
    radii = radii_squared(T, jnp.asarray(D, jnp.float32))
    key = jax.random.PRNGKey(0)

    algs = {
        "Karula": karula(
            loss,
            D,
            t=T,
            learning_rate=KARULA_LR,
            clients_per_round=PER_ROUND,
            batch_size=BATCH,
            personalized=personalized,
        ),
        "FedAvg": fedavg(
            loss,
            learning_rate=FEDAVG_LR,
            clients_per_round=PER_ROUND,
            batch_size=BATCH,
            local_steps=LOCAL_STEPS,
        ),
    }

    def proj_eager(v, r, warm):
        return projection.project(v, r, personalized=personalized, warm_start=warm)

    proj_jit = jax.jit(proj_eager)
    grad_eager = jax.value_and_grad(loss)
    grad_jit = jax.jit(grad_eager)

    rows, extra = [], {}
    for name, alg in algs.items():
        res = training.run(
            alg, params, data, key=key, num_rounds=rounds, chunk_size=CHUNK, progress=False
        )
        compiled_s = 1.0 / res.timings["best_rounds_per_s"]
        state0 = alg.init(params, data, key=key)
        if name == "Karula":

            def make_step(grad_fn, proj_fn):
                return lambda state: karula_round_eager(
                    state, data, loss, radii, personalized, alpha, grad_fn, proj_fn
                )

            eager_step, jit_step = make_step(grad_eager, proj_eager), make_step(grad_jit, proj_jit)
            extra["proj_iterations"] = float(np.mean(res.info.proj_iterations))
            extra["proj_delta_max"] = float(np.max(res.info.proj_delta))
            extra["proj_violation_max"] = float(np.max(res.info.proj_violation))
        else:

            def make_step(grad_fn):
                return lambda state: fedavg_round_eager(state, data, loss, alpha, grad_fn)

            eager_step, jit_step = make_step(grad_eager), make_step(grad_jit)

        # The eager loop must compute the same rounds: compare with the compiled driver.
        eager_s, eager_state = time_eager(eager_step, state0, eager_rounds)
        check = training.run(
            alg,
            params,
            data,
            key=key,
            num_rounds=eager_rounds + 1,
            chunk_size=CHUNK,
            progress=False,
        )
        diff = max_diff(eager_state.params, check.state.params)
        loopjit_s, _ = time_eager(jit_step, state0, max(eager_rounds, 5))
        rows.append(
            {
                "method": name,
                "compile_s": res.timings["compile_s"],
                "compiled_ms": 1e3 * compiled_s,
                "rounds_per_s": res.timings["best_rounds_per_s"],
                "mean_rounds_per_s": res.timings["rounds_per_s"],
                "eager_ms": 1e3 * eager_s,
                "loopjit_ms": 1e3 * loopjit_s,
                "ratio_eager": eager_s / compiled_s,
                "ratio_loopjit": loopjit_s / compiled_s,
                "max_diff": diff,
            }
        )
        if name == "Karula":
            # The projection alone, warm-started from the running state, at these shapes.
            st = res.state
            nu = jax.tree.map(lambda m: m / N_CLIENTS, st.memory)
            v = jax.tree.map(lambda th, d: th - KARULA_LR * d, st.params, nu)
            block(proj_jit(v, radii, st.proj_state))
            best = float("inf")
            for _ in range(20):
                t0 = time.perf_counter()
                out = block(proj_jit(v, radii, st.proj_state))
                best = min(best, time.perf_counter() - t0)
            extra["proj_ms"] = 1e3 * best
            extra["proj_share"] = extra["proj_ms"] / (1e3 * compiled_s)
            extra["proj_alone_iterations"] = int(out[1].iterations)
    return rows, extra


def to_markdown(rows, extra, args) -> str:
    lines = [
        "# Compiled rounds vs an eager per-client Python loop",
        "",
        f"`python -m experiments.bench_rounds --rounds {args.rounds} "
        f"--eager-rounds {args.eager_rounds}`; {platform.processor() or platform.machine()}, "
        f"{jax.devices()[0].platform.upper()}, jax {jax.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Synthetic FEMNIST-shaped data: "
        f"n = {N_CLIENTS} clients (150-210 rows), {PER_ROUND} per round, B = {BATCH}, "
        f"784-100-10 MLP; Karula personalizes the output layer (t = {T}, lr = {KARULA_LR}); "
        f"FedAvg E = {LOCAL_STEPS}, lr = {FEDAVG_LR}.",
        "",
        "| method | compile (s) | compiled round (ms) | rounds/s | eager round (ms) "
        "| speed-up vs eager | loop+jit round (ms) | speed-up vs loop+jit "
        "| max abs diff eager vs compiled |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['compile_s']:.2f} | {r['compiled_ms']:.2f} | "
            f"{r['rounds_per_s']:.1f} | {r['eager_ms']:.1f} | **{r['ratio_eager']:.1f}x** | "
            f"{r['loopjit_ms']:.1f} | {r['ratio_loopjit']:.1f}x | {r['max_diff']:.1e} |"
        )
    lines += [
        "",
        f"Projection alone (jitted, warm start from the running state, "
        f"{extra['proj_alone_iterations']} iterations): {extra['proj_ms']:.2f} ms = "
        f"**{100 * extra['proj_share']:.0f}%** of a compiled Karula round (target <= 50%). "
        f"During the run the projection took {extra['proj_iterations']:.1f} iterations per round "
        f"on average (max certified gap {extra['proj_delta_max']:.1e}, max violation "
        f"{extra['proj_violation_max']:.1e}).",
        "",
        "Eager: a Python loop over the participants with un-jitted `jax.value_and_grad` "
        "(op-by-op dispatch) and an eager call of `projection.project`. Loop+jit: the same loop "
        "with the per-client gradient and the projection jitted. Both compute the same rounds "
        "as the compiled program (same participants and minibatch rows); the last column is "
        "the largest parameter difference after the timed eager rounds.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help=f"compiled rounds ({CHUNK}/chunk)")
    parser.add_argument("--eager-rounds", type=int, default=3, help="timed eager rounds")
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "results/bench/rounds.md")
    args = parser.parse_args(argv)
    if args.rounds < CHUNK or args.eager_rounds < 1:
        parser.error(f"--rounds must be >= {CHUNK} and --eager-rounds >= 1")
    rows, extra = bench(args.rounds, args.eager_rounds)
    text = to_markdown(rows, extra, args)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
