"""Federated MNIST on real LEAF writers (paper section 5.2, DESIGN section 6).

Each method's seeds are one :func:`karula_jax.training.run_many` call (metrics every
``eval_every`` rounds with :mod:`karula_jax.evaluation`); the tables, curves, the
active-constraint diagnostic and the three-writer figure are written from its result.
Setup, learning-rate mapping and findings: ``results/femnist/README.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.report import (
    DATA_DIR,
    RESULTS,
    mean_se_columns,
    plot_client_triplet,
    plot_curves,
    write_json,
    write_table,
)
from karula_jax import algorithms, models
from karula_jax import evaluation as ev
from karula_jax.data import ClientData, client_weights, load_leaf
from karula_jax.embedding import dissimilarities
from karula_jax.stats import mean_and_se
from karula_jax.training import describe_diagnostics, run_many, vmap_algorithm

__all__ = ["Config", "library_rates", "main", "run_experiment", "three_client_figure"]

METHODS = ("local", "fedavg", "ifca", "karula")
LABELS = {"local": "Local", "fedavg": "FedAvg", "ifca": "IFCA", "karula": "Karula"}


@dataclasses.dataclass(frozen=True)
class Config:
    """One FEMNIST run.

    Command: ``python -m experiments.femnist [--data-dir PATH] [--rounds R] [--seeds S]
    [--quick] [--rate-scale X] [--t T] [--norm row|l1] [--invert] [--out DIR] [--tag NAME]``;
    the two configurations of ``results/femnist/`` are the defaults and
    ``--invert --rate-scale 10 --tag invert_x10``.

    Expected (3 seeds, 500 rounds, final mean per-writer test accuracy): paper rates on
    LEAF inputs: FedAvg = IFCA 87.6, Karula 71-74 (unstable across seeds and reruns), Local
    64.3; inverted inputs with x10 rates: Karula 93.8, IFCA 93.6, FedAvg 92.8, Local 88.4.
    Runtime: about 115 s per command on an idle 2-core machine (Karula about 24 s).

    Attributes:
      data_dir: LEAF folder with ``train/`` and ``test/`` (FEMNIST digits are used).
      num_clients: writers ``n`` (the first ones with ``min_samples`` digits).
      min_samples: smallest number of training digits of a selected writer.
      clients_per_round: ``s``.
      batch_size: minibatch size of every gradient.
      hidden: hidden units of the MLP.
      rounds: communication rounds.
      eval_every: rounds per compiled chunk; metrics are recorded after each chunk.
      seeds: number of seeds (initial model, participation, minibatches), vmapped.
      paper_rates: the paper's step sizes per method (summed-loss units, see README).
      rate_scale: multiplies every paper rate.
      fedavg_steps: local SGD steps of FedAvg and IFCA per round.
      ifca_clusters: IFCA's number of cluster models.
      t: Karula's radius scale.
      norm: ``"row"`` (linearized W1) or ``"l1"`` (the paper's entrywise formula).
      num_reference, epsilon: reference points and Sinkhorn epsilon of the embedding.
      t_grid: values of t for the active-constraint diagnostic (``active.csv``).
      invert: use ``1 - x`` (ink 1 on background 0) instead of LEAF's background 1; ``D``
        is unchanged (W1 is invariant under ``x -> 1 - x``).
    """

    data_dir: str = str(DATA_DIR / "femnist")
    num_clients: int = 30
    min_samples: int = 50
    clients_per_round: int = 15
    batch_size: int = 64
    hidden: int = 100
    rounds: int = 500
    eval_every: int = 25
    seeds: int = 3
    paper_rates: tuple[tuple[str, float], ...] = (
        ("local", 2e-4),
        ("fedavg", 1e-4),
        ("ifca", 1e-4),
        ("karula", 2e-4),
    )
    rate_scale: float = 1.0
    fedavg_steps: int = 5
    ifca_clusters: int = 3
    t: float = 20.0
    norm: str = "row"
    num_reference: int = 100
    epsilon: float = 0.05
    t_grid: tuple[float, ...] = (0.0, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 20.0)
    invert: bool = False


def quick_config(cfg: Config) -> Config:
    """A tiny version of ``cfg`` for tests: 6 writers, 10 rounds, 2 seeds."""
    return dataclasses.replace(
        cfg,
        num_clients=6,
        clients_per_round=3,
        rounds=10,
        eval_every=5,
        seeds=2,
        num_reference=10,
        t_grid=(0.0, 1.0, 20.0),
    )


def library_rates(cfg: Config, counts: np.ndarray) -> dict[str, float]:
    """Maps the paper's step sizes to the normalization of ``karula_jax``.

    The paper steps ``eta_paper * N_i * grad f_i`` (``f_i`` client i's mean loss).
    ``karula``/``local`` step ``eta * alpha_i / n * grad f_i = eta N_i / N * grad f_i``, so
    ``eta = eta_paper * N`` gives every client the paper's step; ``fedavg``/``ifca`` step
    ``eta * grad f_i``, so ``eta = eta_paper * mean_i N_i`` gives it to a client of average
    size.

    Args:
      cfg: the configuration (its ``paper_rates`` and ``rate_scale``).
      counts: training samples per client, ``[n]``.

    Returns:
      ``{method: learning_rate}`` for the library's factories.
    """
    counts = np.asarray(counts, dtype=np.float64)
    factor = {"karula": counts.sum(), "local": counts.sum()}
    factor |= {"fedavg": counts.mean(), "ifca": counts.mean()}
    return {m: float(r * cfg.rate_scale * factor[m]) for m, r in cfg.paper_rates}


def build_algorithms(cfg: Config, loss_fn, D, personal, rates: dict) -> dict:
    """The four methods of the paper's FEMNIST figure, keyed by name."""
    common = dict(clients_per_round=cfg.clients_per_round, batch_size=cfg.batch_size)
    local = dict(common, local_steps=cfg.fedavg_steps)
    return {
        "local": algorithms.local(loss_fn, learning_rate=rates["local"], **common),
        "fedavg": algorithms.fedavg(loss_fn, learning_rate=rates["fedavg"], **local),
        "ifca": algorithms.ifca(
            loss_fn, num_clusters=cfg.ifca_clusters, learning_rate=rates["ifca"], **local
        ),
        "karula": algorithms.karula(
            loss_fn, D, t=cfg.t, learning_rate=rates["karula"], personalized=personal, **common
        ),
    }


def three_client_figure(
    train: ClientData, writers, D, path, *, seed: int = 7, invert: bool = False, title=None
) -> list[int]:
    """Draws a random writer, its nearest and its farthest writer by ``D``, with digits.

    One column per digit class all three wrote (up to 8). Returns the client indices
    ``[random, nearest, farthest]``.
    """
    D = np.asarray(D)
    counts, x, y = np.asarray(train.counts), np.asarray(train.x), np.asarray(train.y)
    rng = np.random.default_rng(seed)
    a = int(rng.integers(D.shape[0]))
    others = np.delete(np.arange(D.shape[0]), a)
    trio = [a, int(others[np.argmin(D[a, others])]), int(others[np.argmax(D[a, others])])]
    classes = sorted(set.intersection(*(set(y[i, : counts[i]].tolist()) for i in trio)))[:8]
    images = []
    for i in trio:
        rows = [rng.choice(np.flatnonzero(y[i, : counts[i]] == c)) for c in classes]
        ims = x[i, rows].reshape(-1, 28, 28)
        images.append(1.0 - ims if invert else ims)
    names = [f"writer {writers[i]} (client {i})" for i in trio]
    plot_client_triplet(images, names, D[np.ix_(trio, trio)], path, title=title)
    return trio


def _parse(argv) -> tuple[Config, pathlib.Path, str]:
    p = argparse.ArgumentParser(prog="python -m experiments.femnist", description=__doc__)
    p.add_argument("--data-dir", default=None, help="LEAF folder (default ../shared/data/femnist)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--seeds", type=int, default=None)
    p.add_argument("--rate-scale", type=float, default=None, help="multiply the paper's rates")
    p.add_argument("--t", type=float, default=None, help="Karula's radius scale")
    p.add_argument("--norm", choices=("row", "l1"), default=None)
    p.add_argument("--invert", action="store_true", help="ink 1 on background 0 inputs")
    p.add_argument("--quick", action="store_true", help="tiny run for tests")
    p.add_argument("--out", default=str(RESULTS / "femnist"))
    p.add_argument("--tag", default="", help="suffix of the output file names")
    a = p.parse_args(argv)
    cfg = quick_config(Config()) if a.quick else Config()
    updates = dict(data_dir=a.data_dir, rounds=a.rounds, seeds=a.seeds, rate_scale=a.rate_scale)
    updates |= dict(t=a.t, norm=a.norm, invert=a.invert or None)
    cfg = dataclasses.replace(cfg, **{k: v for k, v in updates.items() if v is not None})
    if cfg.seeds < 2:
        p.error("--seeds must be >= 2 (standard errors need two seeds)")
    if cfg.rounds % cfg.eval_every:
        cfg = dataclasses.replace(cfg, eval_every=cfg.rounds)
    return cfg, pathlib.Path(a.out), a.tag


def main(argv=None) -> dict:
    """Command-line entry point (see :class:`Config`); returns the summary."""
    return run_experiment(*_parse(argv))


def run_experiment(cfg: Config, out: pathlib.Path, tag: str = "") -> dict:
    """Trains the four methods; writes tables, curves and figures to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    sfx = f"_{tag}" if tag else ""
    t_start = time.perf_counter()
    data = load_leaf(
        cfg.data_dir, num_clients=cfg.num_clients, min_samples=cfg.min_samples, invert=cfg.invert
    )
    train, test = data.train, data.test
    n, counts = train.num_clients, np.asarray(train.counts)
    print(f"{n} writers, {counts.sum()} training / {int(test.counts.sum())} test digits")

    t0 = time.perf_counter()
    D, info = dissimilarities(
        train,
        key=jax.random.key(0),
        num_reference=cfg.num_reference,
        epsilon=cfg.epsilon,
        num_classes=10,
        norm=cfg.norm,
    )
    D, d_time = np.asarray(D), time.perf_counter() - t0
    off = D[np.triu_indices(n, k=1)]
    d_range = f"[{off.min():.3g}, {off.max():.3g}]"
    print(
        f"D ({cfg.norm}) in {d_time:.1f}s, all converged: {bool(np.all(info.converged))}, "
        f"off-diagonal range {d_range}, median {np.median(off):.3g}"
    )

    model = models.mlp(cfg.hidden, 10)
    seed_keys = jax.random.split(jax.random.key(2024), cfg.seeds)
    init = lambda k: models.init_params(model, jax.random.fold_in(k, 0), (1, 784))
    params0 = jax.vmap(init)(seed_keys)
    run_keys = jax.vmap(lambda k: jax.random.fold_in(k, 1))(seed_keys)
    personal = models.output_layer_mask(jax.tree.map(lambda a: a[0], params0))
    rates = library_rates(cfg, counts)
    algs = build_algorithms(cfg, models.cross_entropy_loss(model.apply), D, personal, rates)
    alpha = client_weights(train.counts)

    def evaluate(params, data):
        train, test = data
        return {
            "train_loss": jnp.mean(alpha * ev.log_loss(model.apply, params, train)),
            "test_acc_clients": ev.accuracy(model.apply, params, test),
        }

    results, runtimes, finals = {}, {}, {}
    for name in METHODS:
        t0 = time.perf_counter()
        res = run_many(
            lambda _alg=algs[name]: _alg,
            params0,
            train,
            keys=run_keys,
            num_rounds=cfg.rounds,
            params_per_seed=True,
            eval_fn=evaluate,
            eval_data=(train, test),
            chunk_size=cfg.eval_every,
            on_nonfinite="record",
            progress=True,
        )
        finals[name] = vmap_algorithm(lambda _alg=algs[name]: _alg).client_params(res.state, train)
        runtimes[name], results[name] = time.perf_counter() - t0, res
        acc = res.metrics["test_acc_clients"][-1].mean(axis=-1)
        print(
            f"{LABELS[name]:>7}: lr {rates[name]:.4g}, final mean per-writer test accuracy "
            f"{100 * acc.mean():.1f}% (seeds {np.round(100 * acc, 1).tolist()}), "
            f"{runtimes[name]:.1f}s, finite {np.all(res.info.finite, axis=0).tolist()}"
        )
        if name == "karula":
            print(f"         {describe_diagnostics(res.diagnostics)}")

    # IFCA: how many distinct cluster models the writers use at the end (1 = collapsed)
    leaves = [np.asarray(a).reshape(a.shape[:2] + (-1,)) for a in jax.tree.leaves(finals["ifca"])]
    ifca_used = [int(np.unique(v, axis=0).shape[0]) for v in np.concatenate(leaves, -1)]
    print(f"IFCA: distinct cluster models in use at the end, per seed: {ifca_used}")

    # ---- tables
    test_counts = np.asarray(test.counts, dtype=np.float64)
    rows = []
    for name in METHODS:
        per_client = results[name].metrics["test_acc_clients"][-1]  # [S, n]
        row = mean_se_columns(
            {"method": LABELS[name]},
            test_acc=100 * per_client.mean(axis=1),
            pooled_acc=100 * (per_client * test_counts).sum(axis=1) / test_counts.sum(),
            train_loss=results[name].metrics["train_loss"][-1],
        )
        row["test_acc_2se_writers"] = mean_and_se(100 * per_client.mean(axis=0))[1]
        row |= dict(learning_rate=rates[name], rounds=cfg.rounds, seeds=cfg.seeds)
        row |= dict(paper_rate=f"{dict(cfg.paper_rates)[name] * cfg.rate_scale:.3g}")
        rows.append(row | {"runtime_s": runtimes[name]})
    columns = [
        ("method", "method"),
        ("test_acc", "mean per-writer test acc. (%)"),
        ("test_acc_2se_writers", "2 SE over writers"),
        ("pooled_acc", "pooled test acc. (%)"),
        ("train_loss", "final training loss"),
        ("paper_rate", "paper rate"),
        ("learning_rate", "library rate"),
        ("rounds", "rounds"),
        ("runtime_s", "runtime (s)"),
    ]
    notes = [
        f"{n} LEAF writers, {cfg.clients_per_round} per round, minibatch {cfg.batch_size}, "
        f"784-{cfg.hidden}-10 ReLU MLP, {cfg.seeds} seeds (vmapped), {cfg.rounds} rounds. "
        f"Karula: t = {cfg.t:g} on D ({cfg.norm} norm), output layer personalized; "
        f"FedAvg/IFCA: {cfg.fedavg_steps} local steps, IFCA {cfg.ifca_clusters} clusters.",
        "± is 2 standard errors over seeds; '2 SE over writers' is the spread of the "
        "seed-averaged per-writer accuracies. Runtime: wall clock of all seeds of the method "
        "(including compilation) on this machine.",
        f"IFCA: distinct cluster models in use at the end, per seed: {ifca_used} (1 means "
        "every writer picks the same cluster, i.e. IFCA ran as FedAvg).",
        "Paper (final mean test accuracy): Karula 91.3 ± 0.75, Local 89.3 ± 0.78, "
        "FedAvg 84.4 ± 2.39, IFCA 83.9 ± 2.60.",
    ]
    digits = dict(test_acc=1, pooled_acc=1, test_acc_2se_writers=1, learning_rate=4, runtime_s=1)
    title = f"Federated MNIST (LEAF FEMNIST digits){' - ' + tag if tag else ''}"
    paths = dict(csv_path=out / f"table{sfx}.csv", md_path=out / f"table{sfx}.md")
    write_table(rows, columns, title=title, notes=notes, digits=digits, **paths)

    # ---- curves
    curves = {
        LABELS[m]: {
            "train_loss": results[m].metrics["train_loss"].T,
            "test_acc": 100 * results[m].metrics["test_acc_clients"].mean(axis=-1).T,
        }
        for m in METHODS
    }
    plot_curves(
        results["local"].metric_rounds,
        curves,
        out / f"curves{sfx}.png",
        panels=(("train_loss", "training loss"), ("test_acc", "mean per-writer test accuracy (%)")),
        title=f"FEMNIST, {n} writers, ±2 SE over {cfg.seeds} seeds",
    )

    # ---- Karula's constraints: which are active, for the t used and a grid of t
    sq = lambda p, s: ev.pairwise_sq_distances(jax.tree.map(lambda a: a[s], p), personal)
    active = [ev.active_fraction(sq(finals["karula"], s), D, cfg.t) for s in range(cfg.seeds)]
    local_sq = [sq(finals["local"], s) for s in range(cfg.seeds)]
    frac = lambda t: np.mean([ev.active_fraction(q, D, t) for q in local_sq])
    grid_rows = [{"t": t, "active_fraction_local_heads": frac(t)} for t in cfg.t_grid]
    write_table(
        grid_rows,
        [("t", "t"), ("active_fraction_local_heads", "fraction of violated pairs (Local heads)")],
        csv_path=out / f"active{sfx}.csv",
        md_path=out / f"active{sfx}.md",
        title="Which constraints ||w_i - w_j||^2 <= t D_ij bind",
        notes=[
            f"Output-layer parameters of the final Local models vs t D_ij (D: {cfg.norm} norm, "
            f"off-diagonal range {d_range}). A pair Local violates "
            "is one that Karula's projection must pull together.",
            f"Karula at t = {cfg.t:g}: fraction of active pairs at the end, per seed: "
            f"{np.round(active, 3).tolist()}.",
        ],
        digits={"t": 3, "active_fraction_local_heads": 3},
    )

    # ---- three writers: a random one, its nearest and farthest by D
    trio = three_client_figure(
        train,
        data.writers,
        D,
        out / f"clients{sfx}.png",
        invert=cfg.invert,
        title=f"Dissimilarities D ({cfg.norm} norm) between three FEMNIST writers",
    )
    summary = {
        "config": dataclasses.asdict(cfg),
        "ifca_clusters_in_use": ifca_used,
        "library_rates": rates,
        "D_offdiag": {"min": off.min(), "median": np.median(off), "max": off.max()},
        "D_seconds": d_time,
        "embedding_converged": bool(np.all(info.converged)),
        "karula_active_fraction": active,
        "karula_proj_iterations_mean": float(np.mean(results["karula"].info.proj_iterations)),
        "three_clients": {"indices": trio, "writers": [data.writers[i] for i in trio]},
        "D": D,
        "rows": rows,
        "total_seconds": time.perf_counter() - t_start,
    }
    write_json(summary, out / f"summary{sfx}.json")
    print(f"wrote {out} in {summary['total_seconds']:.0f}s")
    return summary


if __name__ == "__main__":
    main()
