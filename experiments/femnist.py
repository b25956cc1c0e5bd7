"""Federated MNIST on LEAF writers (paper section 5.2).

Seed ``s`` draws the writers (``load_leaf(seed=s)``), the initial models, participation and
minibatches. Grids the paper does not fix are chosen by 2-fold CV on a separate tuning draw;
every method's seeds are one :func:`karula_jax.training.run_many` call. Findings:
``results/femnist/README.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.report import DATA_DIR, OUTPUT
from karula_jax import evaluation as ev
from karula_jax import models, protocol, reporting
from karula_jax.data import ClientData, client_weights, load_leaf
from karula_jax.stats import format_mean_se, mean_and_se
from karula_jax.training import progress_bar, run_many, vmap_algorithm

__all__ = ["Config", "library_rates", "main", "run_experiment"]

METHODS = ("Local", "FedAvg", "IFCA", "Karula") + protocol.SUITE[6:]
TUNING_SEED = 10_000  # the writer draw on which the CV grids are decided


@dataclasses.dataclass(frozen=True)
class Config:
    """One FEMNIST run.

    Command: ``python -m experiments.femnist [--data-dir PATH] [--FIELD VALUE ...]
    [--quick] [--out DIR] [--tag NAME]`` writes ``runs/femnist/`` (``--out results/femnist``
    refreshes the committed pages); ``results/femnist/`` holds the defaults (the
    paper's rates on LEAF's pixels), ``--invert --tag invert_paper``, ``--invert
    --rate-scale 10 --tag invert_x10`` and ``--invert --rates default --tag
    invert_default``.

    Expected and runtime: ``results/femnist/README.md`` (8 seeds: about 25 minutes per
    command on an idle 2-core machine).

    Attributes:
      data_dir: LEAF folder with ``train/`` and ``test/`` (FEMNIST digits are used).
      num_clients: writers ``n`` drawn per seed among those with ``min_samples`` digits.
      min_samples: smallest number of training digits of an eligible writer.
      clients_per_round, batch_size, hidden: ``s``, the minibatch, the MLP's hidden units.
      rounds, eval_every: communication rounds; rounds between recorded metrics.
      seeds: seeds (writer draw, initial model, participation, minibatches), vmapped.
      paper_rates: the paper's step sizes (summed-loss units, see README); FedProx,
        SCAFFOLD, Ditto and the clustered FedAvg take FedAvg's, the penalty Karula's.
      rates: ``"paper"`` (``paper_rates`` times ``rate_scale``) or ``"default"``: every
        method at its own default step from each draw's smoothness at the initial model
        (:func:`karula_jax.protocol.default_rates`; Karula's is its ``learning_rate=None``).
      rate_scale, local_steps: multiplies every paper rate; the FedAvg family's local steps.
      ifca_clusters, t: IFCA's clusters (independent random models); Karula's radius scale.
      norm, num_reference, epsilon: the embedding (``norm="row"``: linearized W1).
      invert: ``1 - x`` (ink 1 on background 0) instead of LEAF's background 1.
      *_grid: CV grids (penalty: mu / L_f with ``L_f = 1 / karula rate``).
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
    rates: str = "paper"
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
    """The paper's step sizes ``eta_paper * N_i * grad f_i`` in ``karula_jax``'s units.

    ``karula``/``local`` step ``eta N_i / N * grad f_i``: ``eta = eta_paper * N`` (every
    client); the FedAvg family ``eta * grad f_i``: ``eta = eta_paper * mean_i N_i`` (a
    client of average size). ``counts``: ``[..., n]``; returns ``{name: rate [...]}``.
    """
    counts = np.asarray(counts, dtype=np.float64)
    factor = {"karula": counts.sum(-1), "local": counts.sum(-1), "fedavg": counts.mean(-1)}
    return {m: r * cfg.rate_scale * factor[m] for m, r in cfg.paper_rates}


def make_methods(cfg: Config, loss, personal, names=METHODS) -> dict[str, protocol.Method]:
    """Every method; steps from the member argument ``rates`` (:func:`library_rates`);
    ``personal``: the leaves Karula and the penalty personalize."""
    pick = lambda key: lambda rates, **_: rates[key]
    steps = dict(local=pick("local"), fedavg=pick("fedavg"), ifca=pick("fedavg"))
    steps |= dict(karula=pick("karula"), penalty=pick("karula"), ditto_personal=pick("fedavg"))
    steps["penalty_mu"] = lambda rates, mu, **_: mu / rates["karula"]
    if cfg.rates == "default":  # Karula's own rule, with the coupling of its t and D
        steps["karula"] = lambda **_: None
    grids = {"IFCA": cfg.ifca_clusters, "Karula": cfg.t, "FedProx": cfg.fedprox_grid}
    grids |= {"Ditto": cfg.ditto_grid, "Laplacian penalty on D": cfg.penalty_grid}
    grids |= {"Clustered FedAvg on D": cfg.cluster_grid}
    mask = dict(personalized=personal)
    return protocol.build_methods(
        names,
        loss=loss,
        rates=steps,
        grids=grids,
        options={"Karula": mask, "Laplacian penalty on D": mask},
        clients_per_round=cfg.clients_per_round,
        batch_size=cfg.batch_size,
        local_steps=cfg.local_steps,
    )


def _draws(cfg: Config, seeds) -> tuple[ClientData, ClientData, list[list[str]]]:
    """Training and test data of each seed's writer draw, stacked ``[S, n, N, ...]``."""
    kw = dict(num_clients=cfg.num_clients, min_samples=cfg.min_samples, invert=cfg.invert)
    sets = [load_leaf(cfg.data_dir, seed=int(s), **kw) for s in seeds]
    train, test = (
        protocol.stack_datasets([getattr(d, k) for d in sets]) for k in ("train", "test")
    )
    return train, test, [list(d.writers) for d in sets]


def _member_kwargs(cfg: Config, model, train: ClientData, keys, params) -> dict:
    """Per data set: D, the rates, IFCA's random clusters, spectral labels of D."""
    embed = dict(num_reference=cfg.num_reference, epsilon=cfg.epsilon, norm=cfg.norm)
    D, info = protocol.member_dissimilarities(train, jax.random.key(0), num_classes=10, **embed)
    # IFCA paper: k independent random initializations
    init = lambda k, c: models.init_params(model, jax.random.fold_in(k, 100 + c), (1, 784))
    cs = jnp.arange(cfg.ifca_clusters)
    clusters = jax.vmap(lambda k: jax.vmap(lambda c: init(k, c))(cs))(keys)
    labels = protocol.cluster_labels(D, cfg.cluster_grid)
    rates = library_rates(cfg, train.counts)
    if cfg.rates == "default":  # params [B, ...]: each data set's initial model
        loss = models.cross_entropy_loss(model.apply)
        rates = protocol.member_default_rates(loss, params, train, cfg.clients_per_round, keys)
    rates = {k: jnp.asarray(v, jnp.float32) for k, v in rates.items()}
    kw = dict(D=D, rates=rates, clusters=clusters, labels=labels)
    return kw, bool(np.all(info.converged))


def tune(cfg: Config, model, loss, methods) -> dict[str, dict]:
    """Picks each grid's point by 2-fold CV (validation log-loss) on the tuning draw."""
    train, test, _ = _draws(cfg, [TUNING_SEED])
    keys = jax.random.key(TUNING_SEED)[None]
    cv = protocol.cv_datasets(train, test, 2, key=keys)
    members, p0 = cv.per_member(keys), models.init_params(model, keys[0], (1, 784))
    stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (len(members), *a.shape)), p0)
    kw, _ = _member_kwargs(cfg, model, cv.train, members, stacked)
    outcomes = protocol.compare(
        {name: m for name, m in methods.items() if len(m.points()) > 1},  # something to choose
        p0,
        cv,
        keys=keys,
        num_rounds=cfg.rounds,
        eval_fn=lambda p, d: {"nll": ev.log_loss(model.apply, p, d)},
        score=lambda v: v["nll"].mean(-1),
        member_kwargs=kw,
        describe=lambda o: f"CV on the tuning draw: {o.labels}",
    )
    chosen = {
        name: m.points()[outcomes[name].chosen[0] if name in outcomes else 0]
        for name, m in methods.items()
    }
    return {name: point for name, point in chosen.items() if point}


def main(argv=None) -> dict:
    """Command-line entry point (see :class:`Config`); returns the summary."""
    cfg, args = reporting.cli(
        Config,
        argv,
        quick=quick_config,
        description=__doc__,
        out=OUTPUT / "femnist",
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
    methods = make_methods(cfg, loss, personal, names)
    chosen = tune(cfg, model, loss, methods)

    train, test, writers = _draws(cfg, range(S))
    kw, converged = _member_kwargs(cfg, model, train, seed_keys, params0)
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
    values = {
        name: {
            "test_acc": a.mean(1),
            "pooled_acc": (a * test_counts).sum(1) / test_counts.sum(1),
            "train_loss": np.asarray(results[name][0].metrics["train_loss"][-1]),
        }
        for name, a in acc.items()
    }
    rows = reporting.comparison_rows(values, reference="Karula", paired="test_acc")
    for row, (res, seconds) in zip(rows, results.values(), strict=True):
        name = row["method"]
        row["chosen"] = methods[name].label(chosen[name]) if name in chosen else ""
        row |= {"runtime_s": seconds, "finite": bool(np.all(res.info.finite))}
    columns = [("method", "method"), ("test_acc", "mean per-writer test acc. (%)")]
    columns += [("pooled_acc", "pooled test acc. (%)")]
    columns += [("karula_minus", "Karula minus method (paired)")]
    columns += [("karula_minus_decided", "decided (> 2 SE)"), ("train_loss", "final training loss")]
    columns += [("chosen", "CV choice (tuning draw)"), ("runtime_s", "runtime (s)")]
    rates = kw["rates"]
    notes = [
        f"{S} seeds; seed s draws {cfg.num_clients} of the LEAF writers with >= "
        f"{cfg.min_samples} training digits, the initial model, participation and minibatches. "
        f"± is 2 standard errors over seeds; 'Karula minus method' is the paired difference of "
        f"the seeds' mean accuracies, decided when it exceeds its 2 SE.",
        f"{cfg.clients_per_round} writers per round, minibatch {cfg.batch_size}, 784-"
        f"{cfg.hidden}-10 ReLU MLP, {cfg.rounds} rounds, {'inverted' if cfg.invert else 'LEAF'} "
        f"pixels, {f'paper rates x {cfg.rate_scale:g}' if cfg.rates == 'paper' else 'defaults'}"
        " (library rates, seed 0: "
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
    table = reporting.write_table(
        rows, columns, out / f"table{sfx}", title=title, notes=notes, digits=digits
    )

    curves = {
        m: {
            "train_loss": np.asarray(r.metrics["train_loss"]).T,
            "test_acc": 100 * np.asarray(r.metrics["test_acc"]).mean(-1).T,
        }
        for m, (r, _) in results.items()
    }
    reporting.plot_curves(
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
    trio = reporting.plot_client_triplet(
        jax.tree.map(lambda a: a[0], train),
        [f"writer {w} (client {i})" for i, w in enumerate(writers[0])],
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
    reporting.write_json(summary, out / f"summary{sfx}.json")
    print(table + "\n" + "\n".join(notes))
    print(f"wrote {out} in {summary['total_seconds']:.0f}s")
    return summary


if __name__ == "__main__":
    main()
