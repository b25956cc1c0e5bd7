"""Federated MNIST on LEAF writers (paper section 5.2, DESIGN section 6).

Seed ``s`` draws which writers take part (``load_leaf(seed=s)`` among the eligible writers
of the files given), the initial models, participation and minibatches, so the bands cover
the choice of writers. The hyperparameters the paper does not fix (FedProx's mu, Ditto's
lambda, the penalty's mu, the clustered FedAvg's k) are chosen by 2-fold client-wise CV on
a separate tuning draw (:func:`karula_jax.protocol.cross_validate`); then every method's
seeds are one :func:`karula_jax.training.run_many` call. Findings: ``results/femnist/README.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.report import (
    DATA_DIR,
    RESULTS,
    cli,
    mean_se_columns,
    paired_columns,
    plot_client_triplet,
    plot_curves,
    write_json,
    write_table,
)
from karula_jax import algorithms as A
from karula_jax import evaluation as ev
from karula_jax import models
from karula_jax.data import ClientData, client_weights, load_leaf
from karula_jax.embedding import dissimilarities
from karula_jax.protocol import (
    Method,
    choice_grid,
    cross_validate,
    cv_datasets,
    scalar_grid,
    stack_datasets,
)
from karula_jax.stats import format_mean_se, mean_and_se
from karula_jax.training import progress_bar, run_many, vmap_algorithm

__all__ = ["Config", "library_rates", "main", "run_experiment", "three_client_figure"]

METHODS = ("Local", "FedAvg", "IFCA", "Karula")
METHODS += ("FedProx", "SCAFFOLD", "Ditto", "Laplacian penalty on D", "Clustered FedAvg on D")
TUNING_SEED = 10_000  # the writer draw on which the CV grids are decided


@dataclasses.dataclass(frozen=True)
class Config:
    """One FEMNIST run.

    Command: ``python -m experiments.femnist [--data-dir PATH] [--rounds R] [--seeds S]
    [--quick] [--rate-scale X] [--t T] [--invert] [--out DIR] [--tag NAME]``; the two
    configurations of ``results/femnist/`` are the defaults (the paper's rates on LEAF's
    pixels) and ``--invert --rate-scale 10 --tag invert_x10``.

    Expected and runtime: ``results/femnist/README.md`` (8 seeds: about 25 minutes per
    command on an idle 2-core machine).

    Attributes:
      data_dir: LEAF folder with ``train/`` and ``test/`` (FEMNIST digits are used).
      num_clients: writers ``n`` drawn per seed among those with ``min_samples`` digits.
      min_samples: smallest number of training digits of an eligible writer.
      clients_per_round, batch_size, hidden: ``s``, the minibatch, the MLP's hidden units.
      rounds: communication rounds; ``eval_every``: rounds between recorded metrics.
      seeds: seeds (writer draw, initial model, participation, minibatches), vmapped.
      paper_rates: the paper's step sizes (summed-loss units, see README); FedProx,
        SCAFFOLD, Ditto and the clustered FedAvg take FedAvg's, the penalty Karula's.
      rate_scale: multiplies every paper rate.
      local_steps: local SGD steps of the FedAvg family per round.
      ifca_clusters: IFCA's clusters, each initialized as an independent random model.
      t: Karula's radius scale.
      norm, num_reference, epsilon: the embedding (``norm="row"``: linearized W1).
      invert: ``1 - x`` (ink 1 on background 0) instead of LEAF's background 1.
      fedprox_grid, ditto_grid, penalty_grid, cluster_grid: CV grids (penalty: mu / L_f
        with ``L_f = 1 / karula rate``).
      methods: which of ``METHODS`` to run (Karula always runs: the paired reference).
    """

    data_dir: str = str(DATA_DIR / "femnist")
    num_clients: int = 30
    min_samples: int = 50
    clients_per_round: int = 15
    batch_size: int = 64
    hidden: int = 100
    rounds: int = 500
    eval_every: int = 25
    seeds: int = 8
    paper_rates: tuple[tuple[str, float], ...] = (
        ("local", 2e-4),
        ("fedavg", 1e-4),
        ("karula", 2e-4),
    )
    rate_scale: float = 1.0
    local_steps: int = 5
    ifca_clusters: int = 3
    t: float = 20.0
    norm: str = "row"
    num_reference: int = 100
    epsilon: float = 0.05
    invert: bool = False
    fedprox_grid: tuple[float, ...] = (0.01, 0.1, 1.0)
    ditto_grid: tuple[float, ...] = (0.01, 0.1, 1.0)
    penalty_grid: tuple[float, ...] = (0.01, 0.1, 1.0)
    cluster_grid: tuple[int, ...] = (2, 3, 5)
    methods: tuple[str, ...] = METHODS


def quick_config(cfg: Config) -> Config:
    """A tiny version of ``cfg`` for tests: 6 writers, 10 rounds, 2 seeds, six methods."""
    small = dict(num_clients=6, clients_per_round=3, rounds=10, eval_every=5, seeds=2)
    small |= dict(methods=("Local", "FedAvg", "IFCA", "Karula", "Ditto", "Clustered FedAvg on D"))
    grids = dict(fedprox_grid=(0.1,), ditto_grid=(0.01, 1.0), penalty_grid=(0.1,))
    return dataclasses.replace(cfg, num_reference=10, cluster_grid=(2,), **small, **grids)


def library_rates(cfg: Config, counts) -> dict[str, np.ndarray]:
    """Maps the paper's step sizes to the normalization of ``karula_jax``.

    The paper steps ``eta_paper * N_i * grad f_i`` (``f_i`` client i's mean loss).
    ``karula``/``local`` step ``eta * alpha_i / n * grad f_i = eta N_i / N * grad f_i``, so
    ``eta = eta_paper * N`` gives every client the paper's step; the FedAvg family steps
    ``eta * grad f_i``, so ``eta = eta_paper * mean_i N_i`` gives it to a client of average
    size.

    Args:
      cfg: the configuration (its ``paper_rates`` and ``rate_scale``).
      counts: training samples per client, ``[..., n]`` (leading axes: e.g. seeds).

    Returns:
      ``{"local" | "fedavg" | "karula": learning rate [...]}``.
    """
    counts = np.asarray(counts, dtype=np.float64)
    factor = {"karula": counts.sum(-1), "local": counts.sum(-1), "fedavg": counts.mean(-1)}
    return {m: r * cfg.rate_scale * factor[m] for m, r in cfg.paper_rates}


def make_methods(cfg: Config, loss, personal) -> dict[str, Method]:
    """``make(D, rates, clusters, labels, **hyper) -> Algorithm`` for every method."""
    common = dict(clients_per_round=cfg.clients_per_round, batch_size=cfg.batch_size)
    local = dict(common, local_steps=cfg.local_steps)

    def ifca(rates, clusters, **_):
        return A.ifca(
            loss,
            num_clusters=cfg.ifca_clusters,
            learning_rate=rates["fedavg"],
            initial_clusters=clusters,
            **local,
        )

    def ditto(rates, lam, **_):
        lr = rates["fedavg"]
        return A.ditto(loss, lam=lam, learning_rate=lr, personal_learning_rate=lr, **local)

    def penalty(D, rates, mu, **_):
        lr = rates["karula"]
        return A.laplacian_penalty(
            loss, D, mu=mu / lr, learning_rate=lr, personalized=personal, **common
        )

    def clustered(rates, labels, k, **_):
        lr = rates["fedavg"]
        return A.clustered_fedavg(loss, labels[k], learning_rate=lr, **local)

    return {
        "Local": Method(lambda rates, **_: A.local(loss, learning_rate=rates["local"], **common)),
        "FedAvg": Method(lambda rates, **_: A.fedavg(loss, learning_rate=rates["fedavg"], **local)),
        "IFCA": Method(ifca),
        "Karula": Method(
            lambda D, rates, **_: A.karula(
                loss, D, t=cfg.t, learning_rate=rates["karula"], personalized=personal, **common
            )
        ),
        "FedProx": Method(
            lambda rates, mu, **_: A.fedprox(loss, mu=mu, learning_rate=rates["fedavg"], **local),
            **scalar_grid("mu", cfg.fedprox_grid),
        ),
        "SCAFFOLD": Method(
            lambda rates, **_: A.scaffold(loss, learning_rate=rates["fedavg"], **local)
        ),
        "Ditto": Method(ditto, **scalar_grid("lam", cfg.ditto_grid)),
        "Laplacian penalty on D": Method(
            penalty, **scalar_grid("mu", cfg.penalty_grid, shown="mu/L_f")
        ),
        "Clustered FedAvg on D": Method(clustered, **choice_grid("k", cfg.cluster_grid)),
    }


def _draws(cfg: Config, seeds) -> tuple[ClientData, ClientData, list[list[str]]]:
    """Training and test data of each seed's writer draw, stacked ``[S, n, N, ...]``."""
    kw = dict(num_clients=cfg.num_clients, min_samples=cfg.min_samples, invert=cfg.invert)
    sets = [load_leaf(cfg.data_dir, seed=int(s), **kw) for s in seeds]
    return (
        stack_datasets([d.train for d in sets]),
        stack_datasets([d.test for d in sets]),
        [list(d.writers) for d in sets],
    )


def _member_kwargs(cfg: Config, model, train: ClientData, keys) -> dict:
    """Per data set: D, the library rates, IFCA's random clusters, spectral labels of D."""
    embed = jax.jit(
        jax.vmap(
            lambda d: dissimilarities(
                d,
                key=jax.random.key(0),
                num_reference=cfg.num_reference,
                epsilon=cfg.epsilon,
                num_classes=10,
                norm=cfg.norm,
            )
        )
    )
    D, info = embed(train)
    init = lambda k: models.init_params(model, k, (1, 784))
    clusters = jax.vmap(  # IFCA paper: k independent random initializations
        lambda k: jax.vmap(lambda c: init(jax.random.fold_in(k, 100 + c)))(
            jnp.arange(cfg.ifca_clusters)
        )
    )(keys)
    labels = [[A.cluster_clients(d, k) for k in cfg.cluster_grid] for d in np.asarray(D)]
    rates = {k: jnp.asarray(v, jnp.float32) for k, v in library_rates(cfg, train.counts).items()}
    kw = dict(D=D, rates=rates, clusters=clusters, labels=np.asarray(labels, np.int32))
    return kw, bool(np.all(info.converged))


def tune(cfg: Config, model, loss, methods) -> dict[str, dict]:
    """Picks each grid's point by 2-fold CV (validation log-loss) on the tuning draw."""
    train, test, _ = _draws(cfg, [TUNING_SEED])
    keys = jax.random.key(TUNING_SEED)[None]
    cv = cv_datasets(train, test, 2, key=keys)
    kw, _ = _member_kwargs(cfg, model, cv.train, cv.per_member(keys))
    chosen = {}
    for name, m in methods.items():
        if len(m.points()) == 1:  # nothing to choose (untuned methods: the empty point)
            chosen[name] = m.points()[0]
            continue
        out = cross_validate(
            m,
            models.init_params(model, keys[0], (1, 784)),
            cv,
            keys=keys,
            num_rounds=cfg.rounds,
            eval_fn=lambda p, d: {"nll": ev.log_loss(model.apply, p, d)},
            score=lambda v: v["nll"].mean(-1),
            member_kwargs=kw,
        )
        chosen[name] = m.points()[out.chosen[0]]
        print(f"CV on the tuning draw, {name}: {m.labels()} -> {out.chosen_labels[0]}")
    return {name: point for name, point in chosen.items() if point}


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


def main(argv=None) -> dict:
    """Command-line entry point (see :class:`Config`); returns the summary."""
    cfg, args = cli(
        Config,
        argv,
        quick=quick_config,
        description=__doc__,
        out=RESULTS / "femnist",
        tag=dict(default="", help="suffix of the output file names"),
    )
    if cfg.rounds % cfg.eval_every:
        cfg = dataclasses.replace(cfg, eval_every=cfg.rounds)
    return run_experiment(cfg, args.out, args.tag)


def run_experiment(cfg: Config, out: pathlib.Path, tag: str = "") -> dict:
    """Tunes the grids, trains every method on every seed; writes tables and figures."""
    out.mkdir(parents=True, exist_ok=True)
    sfx, t_start, S = f"_{tag}" if tag else "", time.perf_counter(), cfg.seeds
    model = models.mlp(cfg.hidden, 10)
    loss = models.cross_entropy_loss(model.apply)
    seed_keys = jax.vmap(jax.random.key)(jnp.arange(S))
    params0 = jax.vmap(lambda k: models.init_params(model, k, (1, 784)))(seed_keys)
    personal = models.output_layer_mask(jax.tree.map(lambda a: a[0], params0))
    names = [m for m in METHODS if m in cfg.methods or m == "Karula"]
    methods = {m: f for m, f in make_methods(cfg, loss, personal).items() if m in names}
    chosen = tune(cfg, model, loss, methods)

    train, test, writers = _draws(cfg, range(S))
    kw, converged = _member_kwargs(cfg, model, train, seed_keys)
    print(f"{S} draws of {cfg.num_clients} writers; D converged: {converged}")
    alpha = jnp.stack([client_weights(c) for c in train.counts])  # [S, n]

    def evaluate(params, data):
        (tr, te), a = data
        return {
            "train_loss": jnp.sum(a * ev.log_loss(model.apply, params, tr)) / a.shape[0],
            "test_acc": ev.accuracy(model.apply, params, te),
        }

    results, finals = {}, {}
    for name in progress_bar(names, desc="methods", unit="method"):
        make = functools.partial(methods[name].make, **chosen.get(name, {}))
        t0 = time.perf_counter()
        res = run_many(
            make,
            params0,
            train,
            keys=jax.vmap(lambda k: jax.random.fold_in(k, 1))(seed_keys),
            num_rounds=cfg.rounds,
            data_per_seed=True,
            params_per_seed=True,
            batch_kwargs=kw,
            eval_fn=evaluate,
            eval_data=((train, test), alpha),
            eval_data_per_seed=True,
            chunk_size=cfg.eval_every,
            on_nonfinite="record",
            progress=False,
        )
        batched = vmap_algorithm(make, data_per_seed=True, params_per_seed=True, batch_kwargs=kw)
        finals[name] = batched.client_params(res.state, train)
        results[name] = (res, time.perf_counter() - t0)
        acc = 100 * res.metrics["test_acc"][-1].mean(-1)
        print(f"{name}: {format_mean_se(*mean_and_se(acc), digits=1)} % ({results[name][1]:.0f} s)")

    # ---- table: mean per-writer test accuracy, paired differences with Karula
    test_counts = np.asarray(test.counts, np.float64)
    acc = {m: 100 * np.asarray(r.metrics["test_acc"][-1]) for m, (r, _) in results.items()}
    leaves = [np.asarray(a).reshape(a.shape[:2] + (-1,)) for a in jax.tree.leaves(finals["IFCA"])]
    ifca_used = [int(np.unique(v, axis=0).shape[0]) for v in np.concatenate(leaves, -1)]
    rows = []
    for name in names:
        res, seconds = results[name]
        a = acc[name]  # [S, n]
        row = mean_se_columns(
            {"method": name},
            test_acc=a.mean(1),
            pooled_acc=(a * test_counts).sum(1) / test_counts.sum(1),
            train_loss=np.asarray(res.metrics["train_loss"][-1]),
        )
        paired_columns(row, "karula_minus", acc["Karula"].mean(1), a.mean(1))
        row["chosen"] = methods[name].label(chosen[name]) if name in chosen else ""
        rows.append(row | {"runtime_s": seconds, "finite": bool(np.all(res.info.finite))})
    columns = [
        ("method", "method"),
        ("test_acc", "mean per-writer test acc. (%)"),
        ("pooled_acc", "pooled test acc. (%)"),
        ("karula_minus", "Karula minus method (paired)"),
        ("karula_minus_decided", "decided (> 2 SE)"),
        ("train_loss", "final training loss"),
        ("chosen", "CV choice (tuning draw)"),
        ("runtime_s", "runtime (s)"),
    ]
    rates = library_rates(cfg, train.counts)
    notes = [
        f"{S} seeds; seed s draws {cfg.num_clients} of the LEAF writers with >= "
        f"{cfg.min_samples} training digits, the initial model, participation and minibatches. "
        f"± is 2 standard errors over seeds; 'Karula minus method' is the paired difference of "
        f"the seeds' mean accuracies, decided when it exceeds its 2 SE.",
        f"{cfg.clients_per_round} writers per round, minibatch {cfg.batch_size}, 784-"
        f"{cfg.hidden}-10 ReLU MLP, {cfg.rounds} rounds, {'inverted' if cfg.invert else 'LEAF'} "
        f"pixels, paper rates x {cfg.rate_scale:g} (library rates, seed 0: "
        + ", ".join(f"{k} {v[0]:.4g}" for k, v in rates.items())
        + f"). Karula: t = {cfg.t:g} on D ({cfg.norm} norm), output layer personalized (also "
        f"in the penalty); the FedAvg family: {cfg.local_steps} local "
        f"steps; IFCA: {cfg.ifca_clusters} independently initialized clusters, in use at the "
        f"end per seed: {ifca_used}.",
        f"Grids decided by 2-fold CV on writer draw {TUNING_SEED}: "
        + "; ".join(f"{m}: {', '.join(methods[m].labels())}" for m in chosen)
        + ". Runtime: all seeds of a method, compilation included.",
        "Paper (final mean test accuracy): Karula 91.3 ± 0.75, Local 89.3 ± 0.78, "
        "FedAvg 84.4 ± 2.39, IFCA 83.9 ± 2.60.",
    ]
    digits = dict(test_acc=1, pooled_acc=1, karula_minus=1, runtime_s=1)
    title = f"Federated MNIST (LEAF FEMNIST digits){' - ' + tag if tag else ''}"
    paths = dict(csv_path=out / f"table{sfx}.csv", md_path=out / f"table{sfx}.md")
    table = write_table(rows, columns, title=title, notes=notes, digits=digits, **paths)

    curves = {
        m: {
            "train_loss": np.asarray(r.metrics["train_loss"]).T,
            "test_acc": 100 * np.asarray(r.metrics["test_acc"]).mean(-1).T,
        }
        for m, (r, _) in results.items()
    }
    plot_curves(
        results["Local"][0].metric_rounds,
        curves,
        out / f"curves{sfx}.png",
        panels=(("train_loss", "training loss"), ("test_acc", "mean per-writer test accuracy (%)")),
        title=f"FEMNIST, {cfg.num_clients} writers, ±2 SE over {S} seeds (writer draws)",
    )
    # Karula's constraints: the fraction active at the end, per seed
    sq = lambda p, s: ev.pairwise_sq_distances(jax.tree.map(lambda a: a[s], p), personal)
    D = np.asarray(kw["D"])
    active = [ev.active_fraction(sq(finals["Karula"], s), D[s], cfg.t) for s in range(S)]
    first = jax.tree.map(lambda a: a[0], train)
    trio = three_client_figure(
        first,
        writers[0],
        D[0],
        out / f"clients{sfx}.png",
        invert=cfg.invert,
        title=f"Dissimilarities D ({cfg.norm} norm) between three FEMNIST writers (seed 0)",
    )
    summary = {
        "config": dataclasses.asdict(cfg),
        "chosen": chosen,
        "ifca_clusters_in_use": ifca_used,
        "karula_active_fraction": active,
        "embedding_converged": converged,
        "writers": writers,
        "three_clients": {"indices": trio, "writers": [writers[0][i] for i in trio]},
        "rows": rows,
        "total_seconds": time.perf_counter() - t_start,
    }
    write_json(summary, out / f"summary{sfx}.json")
    print(table + "\n" + "\n".join(notes))
    print(f"wrote {out} in {summary['total_seconds']:.0f}s")
    return summary


if __name__ == "__main__":
    main()
