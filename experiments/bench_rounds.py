"""Benchmark: compiled federated rounds against the same rounds as an eager Python loop.

Command: ``python -m experiments.bench_rounds [--rounds 40] [--eager-rounds 3] [--out FILE]``
(about 3-6 minutes on 2 busy CPU cores, most of it the eager loop).

Problem (FEMNIST-sized, synthetic data of FEMNIST shapes): n = 30 clients with 150-210
rows each of 784 standard-normal features and labels in 0..9, the 784-100-10 ReLU MLP, 15
clients per round, minibatch B = 64. Karula personalizes the output layer only (the hidden
layer is shared, i.e. projected to its mean); dissimilarities ``D`` are random in
[0.5, 1.5]. Two values of ``t``: 1e-4, small enough that the constraints are active every
round (a stress test of the projection), and the paper's 20, where they are mostly
inactive. FedAvg runs E = 5 local steps on one global model.

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

It also times the projection alone (jitted, on the exact input and warm start of the
round that follows the compiled run) and reports its share of a compiled Karula round
(target <= 1/2). All timings come from this process on this machine; each is the best of
several repetitions, since the machine may be shared.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import time
from unittest import mock

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
KARULA_LR, FEDAVG_LR = 0.5, 0.05
T, T_PAPER = 1e-4, 20.0  # constraints active / the paper's FEMNIST t
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


def karula_step_eager(state, data, alpha, grad_fn):
    """Gradient part of a Karula round, participant by participant: ``(v, memory)``.

    ``v = theta - eta * nu`` is exactly what the round hands to the projection.
    """
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
    return v, memory


def karula_round_eager(state, data, radii, alpha, grad_fn, proj_fn):
    """One Karula round, participant by participant (mirrors ``algorithms.karula``)."""
    v, memory = karula_step_eager(state, data, alpha, grad_fn)
    theta, pinfo = proj_fn(v, radii, state.proj_state)
    return state._replace(
        params=theta, memory=memory, proj_state=pinfo.state, round=state.round + 1
    )


def fedavg_round_eager(state, data, alpha, grad_fn):
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


def _best_of(fn, reps: int) -> tuple[float, object]:
    out = block(fn())  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        out = block(fn())
        best = min(best, time.perf_counter() - t0)
    return best, out


def _no_projection(v, radii_sq, *, warm_start=None, **kwargs):
    """Stand-in for ``projection.project`` that returns its input (for the ablation)."""
    del radii_sq, kwargs
    zero = jnp.zeros((), jnp.float32)
    info = projection.ProjectionInfo(
        iterations=jnp.zeros((), jnp.int32),
        max_violation=zero,
        rel_violation=zero,
        delta=zero,
        rel_delta=zero,
        converged=jnp.array(True),
        state=warm_start,
    )
    return v, info


def projection_ablation(alg, state, data, reps: int = 10) -> tuple[float, float]:
    """Best seconds per round of a compiled chunk with and without the projection.

    The second program is traced while ``projection.project`` is replaced by the identity,
    so it is the same round minus the projection; the two are timed alternately so that a
    change of load on the machine hits both alike.
    """

    def chunk(st):
        return training.scan_rounds(alg, st, data, CHUNK)

    full = jax.jit(chunk).lower(state).compile()
    with mock.patch.object(projection, "project", _no_projection):
        bare = jax.jit(lambda st: chunk(st)).lower(state).compile()
    best_full = best_bare = float("inf")
    block(full(state))
    block(bare(state))
    for _ in range(reps):
        t0 = time.perf_counter()
        block(full(state))
        best_full = min(best_full, time.perf_counter() - t0)
        t0 = time.perf_counter()
        block(bare(state))
        best_bare = min(best_bare, time.perf_counter() - t0)
    return best_full / CHUNK, best_bare / CHUNK


def bench(rounds: int, eager_rounds: int) -> tuple[list[dict], list[dict]]:
    """Returns the speed-up rows and the projection-share rows."""
    data, params, loss, D = make_problem()
    personalized = output_layer_mask(params)
    alpha = C.resolve_weights(None, data)
    key = jax.random.PRNGKey(0)
    grad_eager = jax.value_and_grad(loss)
    grad_jit = jax.jit(grad_eager)

    def proj_eager(v, r, warm):
        return projection.project(v, r, personalized=personalized, warm_start=warm)

    proj_jit = jax.jit(proj_eager)
    proj_pers_jit = jax.jit(lambda v, r, warm: projection.project(v, r, warm_start=warm))
    consensus_jit = jax.jit(
        lambda tree: jax.tree.map(
            lambda a: jnp.broadcast_to(jnp.mean(a, axis=0, keepdims=True), a.shape), tree
        )
    )

    def mean_matvec(a):
        # The same mean over clients as a matrix-vector product (a BLAS call on XLA:CPU).
        w = jnp.full((a.shape[0],), 1.0 / a.shape[0], a.dtype)
        m = (w @ a.reshape(a.shape[0], -1)).reshape((1, *a.shape[1:]))
        return jnp.broadcast_to(m, a.shape)

    consensus_matvec_jit = jax.jit(lambda tree: jax.tree.map(mean_matvec, tree))

    def make_karula(t):
        return karula(
            loss,
            D,
            t=t,
            learning_rate=KARULA_LR,
            clients_per_round=PER_ROUND,
            batch_size=BATCH,
            personalized=personalized,
        )

    # (label, algorithm, t or None for FedAvg, compare with the eager loop?)
    cases = [
        (f"Karula t={T:g}", make_karula(T), T, True),
        (
            "FedAvg",
            fedavg(
                loss,
                learning_rate=FEDAVG_LR,
                clients_per_round=PER_ROUND,
                batch_size=BATCH,
                local_steps=LOCAL_STEPS,
            ),
            None,
            True,
        ),
        (f"Karula t={T_PAPER:g}", make_karula(T_PAPER), T_PAPER, False),
    ]
    rows, proj_rows = [], []
    for name, alg, t, with_eager in cases:
        res = training.run(
            alg, params, data, key=key, num_rounds=rounds, chunk_size=CHUNK, progress=False
        )
        compiled_s = 1.0 / res.timings["best_rounds_per_s"]
        row = {
            "method": name,
            "compile_s": res.timings["compile_s"],
            "compiled_ms": 1e3 * compiled_s,
            "rounds_per_s": res.timings["best_rounds_per_s"],
            "mean_rounds_per_s": res.timings["rounds_per_s"],
        }
        radii = None if t is None else radii_squared(t, jnp.asarray(D, jnp.float32))
        if with_eager:
            state0 = alg.init(params, data, key=key)
            if t is not None:

                def make_step(grad_fn, proj_fn, radii=radii):
                    return lambda state: karula_round_eager(
                        state, data, radii, alpha, grad_fn, proj_fn
                    )

                eager_step, jit_step = (
                    make_step(grad_eager, proj_eager),
                    make_step(grad_jit, proj_jit),
                )
            else:

                def make_step(grad_fn):
                    return lambda state: fedavg_round_eager(state, data, alpha, grad_fn)

                eager_step, jit_step = make_step(grad_eager), make_step(grad_jit)
            eager_s, eager_state = time_eager(eager_step, state0, eager_rounds)
            # The eager loop must compute the same rounds as the compiled program.
            check = training.run(
                alg,
                params,
                data,
                key=key,
                num_rounds=eager_rounds + 1,
                chunk_size=CHUNK,
                progress=False,
            )
            loopjit_s, _ = time_eager(jit_step, state0, max(eager_rounds, 5))
            row.update(
                eager_ms=1e3 * eager_s,
                loopjit_ms=1e3 * loopjit_s,
                ratio_eager=eager_s / compiled_s,
                ratio_loopjit=loopjit_s / compiled_s,
                max_diff=max_diff(eager_state.params, check.state.params),
            )
        rows.append(row)
        if t is not None:
            # The projection alone on the exact input of the next round of the compiled
            # run (its point theta - eta * nu and its warm start).
            st = res.state
            v, _ = karula_step_eager(st, data, alpha, grad_jit)
            proj_s, out = _best_of(lambda v=v, st=st, r=radii: proj_jit(v, r, st.proj_state), 20)
            # Its two parts: the constrained (personalized) leaves alone, same warm start,
            # and the consensus (mean over clients) of the shared leaves.
            v_pers = {"params": {"output": v["params"]["output"]}}
            pers_s, _ = _best_of(
                lambda v=v_pers, st=st, r=radii: proj_pers_jit(v, r, st.proj_state), 20
            )
            v_shared = v["params"]["hidden"]
            shared_s, _ = _best_of(lambda v=v_shared: consensus_jit(v), 20)
            shared_mv_s, _ = _best_of(lambda v=v_shared: consensus_matvec_jit(v), 20)
            full_s, bare_s = projection_ablation(alg, st, data)
            proj_rows.append(
                {
                    "method": name,
                    "abl_full_ms": 1e3 * full_s,
                    "abl_bare_ms": 1e3 * bare_s,
                    "abl_share": 1.0 - bare_s / full_s,
                    "iters_run": float(np.mean(res.info.proj_iterations)),
                    "iters_alone": int(out[1].iterations),
                    "delta_max": float(np.max(res.info.proj_delta)),
                    "viol_max": float(np.max(res.info.proj_violation)),
                    "proj_ms": 1e3 * proj_s,
                    "pers_ms": 1e3 * pers_s,
                    "shared_ms": 1e3 * shared_s,
                    "shared_mv_ms": 1e3 * shared_mv_s,
                    "round_ms": 1e3 * compiled_s,
                    "share": proj_s / compiled_s,
                }
            )
    return rows, proj_rows


def to_markdown(rows, proj_rows, args) -> str:
    lines = [
        "# Compiled rounds vs an eager per-client Python loop",
        "",
        f"`python -m experiments.bench_rounds --rounds {args.rounds} "
        f"--eager-rounds {args.eager_rounds}`; {platform.machine()} CPU "
        f"({os.cpu_count()} cores, shared with other jobs), jax {jax.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Synthetic FEMNIST-shaped "
        f"data: n = {N_CLIENTS} clients (150-210 rows), {PER_ROUND} per round, B = {BATCH}, "
        f"784-100-10 MLP. Karula personalizes the output layer, lr = {KARULA_LR}, random D "
        f"in [0.5, 1.5]; FedAvg: one global model, E = {LOCAL_STEPS}, lr = {FEDAVG_LR}. "
        f"Times are the best of several repetitions (compiled: fastest of "
        f"{args.rounds // CHUNK} chunks of {CHUNK} rounds; eager: fastest of "
        f"{args.eager_rounds} rounds after a warm-up).",
        "",
        "| method | compile (s) | compiled round (ms) | rounds/s | eager round (ms) "
        "| speed-up vs eager | loop+jit round (ms) | speed-up vs loop+jit "
        "| max abs diff eager vs compiled |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "eager_ms" in r:
            tail = (
                f"{r['eager_ms']:.1f} | **{r['ratio_eager']:.1f}x** | {r['loopjit_ms']:.1f} | "
                f"{r['ratio_loopjit']:.1f}x | {r['max_diff']:.1e} |"
            )
        else:
            tail = "- | - | - | - | - |"
        lines.append(
            f"| {r['method']} | {r['compile_s']:.2f} | {r['compiled_ms']:.2f} | "
            f"{r['rounds_per_s']:.1f} | {tail}"
        )
    lines += [
        "",
        "Projection share of a compiled Karula round (target <= 50%), measured two ways. "
        "Ablation: the same compiled chunk of rounds with and without the projection (traced "
        "with `projection.project` replaced by the identity), timed alternately, share = 1 - "
        "without / with. Alone: the projection jitted on its own, on the exact input and warm "
        "start of the round after the compiled run, divided by the compiled round.",
        "",
        "| setting | round with projection (ms) | round without (ms) | share (ablation) |",
        "|---|---|---|---|",
    ]
    for r in proj_rows:
        lines.append(
            f"| {r['method']} | {r['abl_full_ms']:.2f} | {r['abl_bare_ms']:.2f} | "
            f"**{100 * r['abl_share']:.0f}%** |"
        )
    lines += [
        "",
        "| setting | projection iterations per round (run mean) | iterations (timed call) "
        "| projection (ms) | of which: output layer, constrained (ms) "
        "| of which: hidden layer, consensus mean (ms) | same mean as a matvec (ms) "
        "| Karula round (ms) | share (alone) | max certified gap | max violation |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in proj_rows:
        lines.append(
            f"| {r['method']} | {r['iters_run']:.1f} | {r['iters_alone']} | {r['proj_ms']:.2f} | "
            f"{r['pers_ms']:.2f} | {r['shared_ms']:.2f} | {r['shared_mv_ms']:.2f} | "
            f"{r['round_ms']:.2f} | **{100 * r['share']:.0f}%** | {r['delta_max']:.1e} | "
            f"{r['viol_max']:.1e} |"
        )
    lines += [
        "",
        "The two parts are timed separately (best of 20 each): the constrained part is the "
        "Dykstra solve on the personalized output layer (1010 numbers per client); the shared "
        "hidden layer (78,500 numbers per client, stored per client as `FedState` requires) "
        "is set to its mean over clients; the 'consensus mean' column times it as "
        "`jnp.mean(axis=0)`, a slow strided reduction on XLA:CPU, the next column as the "
        "matrix-vector product the projection now uses (one BLAS call).",
        "",
        f"t = {T:g} makes every constraint active with these random D (a stress test of the "
        f"projection); t = {T_PAPER:g} is the paper's FEMNIST value, for which the constraints "
        "are mostly inactive at this scale of D.",
        "",
        "Eager: a Python loop over the participants with un-jitted `jax.value_and_grad` "
        "(op-by-op dispatch) and a call of `projection.project` from Python. Loop+jit: the same "
        "loop with the per-client gradient and the projection jitted, the pattern of most "
        "federated libraries. Both compute the same rounds as the compiled program (same "
        "participants and minibatch rows); the last column is the largest parameter "
        "difference after the timed eager rounds.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60, help=f"compiled rounds ({CHUNK}/chunk)")
    parser.add_argument("--eager-rounds", type=int, default=3, help="timed eager rounds")
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "results/bench/rounds.md")
    args = parser.parse_args(argv)
    if args.rounds < CHUNK or args.eager_rounds < 1:
        parser.error(f"--rounds must be >= {CHUNK} and --eager-rounds >= 1")
    rows, proj_rows = bench(args.rounds, args.eager_rounds)
    text = to_markdown(rows, proj_rows, args)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
