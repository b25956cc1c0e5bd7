"""Benchmark: OT-embedding dissimilarities against exact pairwise W1 (POT).

Command: ``python -m experiments.bench_embedding [--data-dir PATH] [--out FILE]``
(a few minutes on 2 CPU cores; most of it is the exact pairwise reference).

Cases: FEMNIST digit writers from the LEAF JSON (``<data-dir>/femnist``; joint space = 784
pixels + one-hot label, dz = 794) with n = 30 and n = 54 clients, and synthetic ridge clients
with n = 200 (dz = 51). For each case it prints the compile time (first call minus a warm
call), the warm run time of :func:`karula_jax.embedding.dissimilarities` (reference draw,
vmapped Sinkhorn, pairwise D; ``block_until_ready``), the time of exact W1 for all pairs
(``ot.emd2`` on ``ot.dist(..., metric="euclidean")``, single-threaded, float64), their ratio,
the Spearman correlation between D and exact W1 over all pairs, and whether every solve
converged. FEMNIST runs at the default epsilon (0.05); the synthetic case also at 1 and 2, where
its Sinkhorn needs far fewer iterations (its joint space is dominated by the response, a
nearly one-dimensional, highly degenerate W1 problem, slow for Sinkhorn at small epsilon). An
epsilon sweep on both follows. Both routes run in this
process on the same machine. Writes the tables to ``--out`` (Markdown).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import time

import jax
import numpy as np

from experiments.report import DATA_DIR, RESULTS
from karula_jax.data import load_leaf, synthetic_ridge
from karula_jax.embedding import dissimilarities
from karula_jax.evaluation import exact_pairwise_w1, spearman_offdiag


def time_embedding(clients, *, num_classes, epsilon, num_reference, key):
    """(compile seconds, warm run seconds, D, info) for one data set."""

    def run():
        d, info = dissimilarities(
            clients,
            key=key,
            num_reference=num_reference,
            epsilon=epsilon,
            num_classes=num_classes,
        )
        return jax.block_until_ready((d, info))

    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        d, info = run()
        runs.append(time.perf_counter() - t0)
    warm = min(runs)
    return max(first - warm, 0.0), warm, np.asarray(d), info


def exact_reference(clients, *, num_classes):
    """(seconds, W) for exact pairwise W1 of one data set."""
    t0 = time.perf_counter()
    w = exact_pairwise_w1(clients, num_classes=num_classes)
    return time.perf_counter() - t0, w


def bench_case(name, clients, exact, *, num_classes, epsilon, num_reference, key):
    compile_s, run_s, d, info = time_embedding(
        clients, num_classes=num_classes, epsilon=epsilon, num_reference=num_reference, key=key
    )
    exact_s, w = exact
    n = clients.num_clients
    return {
        "case": name,
        "n": n,
        "pairs": n * (n - 1) // 2,
        "dz": info.reference.shape[-1],
        "N_max": clients.max_count,
        "epsilon": epsilon,
        "compile_s": compile_s,
        "run_s": run_s,
        "exact_s": exact_s,
        "ratio": exact_s / run_s,
        "spearman": spearman_offdiag(d, w),
        "converged": bool(info.converged.all()),
        "max_iter": int(info.iterations.max()),
    }


def sweep_row(name, clients, w, num_classes, epsilon, num_reference, key):
    _, run_s, d, info = time_embedding(
        clients, num_classes=num_classes, epsilon=epsilon, num_reference=num_reference, key=key
    )
    return {
        "case": name,
        "epsilon": epsilon,
        "spearman": spearman_offdiag(d, w),
        "converged": f"{int(info.converged.sum())}/{len(info.converged)}",
        "max_iter": int(info.iterations.max()),
        "run_s": run_s,
    }


def markdown(rows, cols) -> str:
    head = "| " + " | ".join(c for c, _ in cols) + " |"
    sep = "|" + "|".join("---" for _ in cols) + "|"
    body = ["| " + " | ".join(fmt(r[c]) for c, fmt in cols) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=pathlib.Path, default=DATA_DIR)
    parser.add_argument("--epsilon", type=float, nargs="+", default=[0.05])
    parser.add_argument("--synthetic-epsilon", type=float, nargs="+", default=[0.05, 1.0, 2.0])
    parser.add_argument("--num-reference", type=int, default=100)
    parser.add_argument("--sweep", type=float, nargs="*", default=[0.5, 0.2, 0.1, 0.05, 0.02])
    parser.add_argument("--synthetic-sweep", type=float, nargs="*", default=[0.5, 0.2])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "bench/embedding.md")
    args = parser.parse_args(argv)

    key = jax.random.PRNGKey(0)
    femnist = {n: load_leaf(args.data_dir / "femnist", num_clients=n).train for n in (30, 54)}
    synth = synthetic_ridge(0, num_clients=200).train
    exact = {n: exact_reference(femnist[n], num_classes=10) for n in femnist}
    exact_synth = exact_reference(synth, num_classes=None)
    common = {"num_reference": args.num_reference, "key": key}
    rows = [
        bench_case("FEMNIST digits", femnist[n], exact[n], num_classes=10, epsilon=eps, **common)
        for n in femnist
        for eps in args.epsilon
    ] + [
        bench_case("synthetic ridge", synth, exact_synth, num_classes=None, epsilon=eps, **common)
        for eps in args.synthetic_epsilon
    ]
    f2, f3, f1 = "{:.2f}".format, "{:.3f}".format, "{:.1f}".format
    cols = [(c, str) for c in ("case", "n", "pairs", "dz", "N_max", "epsilon")]
    cols += [("compile_s", f2), ("run_s", f3), ("exact_s", f2), ("ratio", f1), ("spearman", f3)]
    cols += [("converged", str), ("max_iter", str)]
    main_table = markdown(rows, cols)
    print(main_table)

    sweep_cols = [("case", str), ("epsilon", str), ("spearman", f3)]
    sweep_cols += [("converged", str), ("max_iter", str), ("run_s", f3)]
    sweep = [
        sweep_row("FEMNIST n=30", femnist[30], exact[30][1], 10, eps, args.num_reference, key)
        for eps in args.sweep
    ] + [
        sweep_row("synthetic n=200", synth, exact_synth[1], None, eps, args.num_reference, key)
        for eps in args.synthetic_sweep
    ]
    sweep_table = markdown(sweep, sweep_cols)
    print()
    print(sweep_table)

    device = jax.devices()[0]
    header = (
        "# Embedding benchmark\n\n"
        f"Command: `python -m experiments.bench_embedding` (N0 = {args.num_reference}, "
        "Gaussian reference, row norm, threshold 1e-3; epsilon absolute, per row).\n"
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs visible, "
        f"JAX device {device.platform} ({device.device_kind}), load average at the end "
        f"{os.getloadavg()[0]:.1f} (the machine is shared; timings are noisy, ratios are "
        "measured in one process); POT exact OT is single-threaded "
        "float64. compile_s = first call minus warm call; run_s = best of 3 warm calls "
        "(reference draw + vmapped Sinkhorn + pairwise D, block_until_ready); exact_s = "
        "`ot.emd2` for all pairs; ratio = exact_s / run_s; spearman = rank correlation of D "
        "with exact W1 over all pairs.\n\n"
    )
    text = (
        header
        + main_table
        + "\n\nEpsilon sweep (absolute epsilon; Spearman against the same exact W1 as above):\n\n"
        + sweep_table
        + "\n"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
