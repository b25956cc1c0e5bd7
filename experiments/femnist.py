"""Federated MNIST on LEAF writers (paper section 5.2).

Seed ``s`` draws the writers (``load_leaf(seed=s)``), the initial models, participation and
minibatches. Grids the paper does not fix are chosen by 2-fold CV on a separate tuning draw;
then every method is trained on every seed at its chosen point (the study driver,
:mod:`karula_jax.protocol.study`). Findings: ``results/femnist/README.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.paths import DATA_DIR, OUTPUT
from karula_jax import evaluation as ev
from karula_jax import models, protocol, reporting
from karula_jax.data import client_weights, load_leaf
from karula_jax.stats import format_mean_se, mean_and_se

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


def _study_data(cfg: Config, seeds, num_folds: int, fold_keys=None) -> protocol.StudyData:
    """Each seed's writer draw (extras: the writers), its CV layout, D and clusters."""
    kw = dict(num_clients=cfg.num_clients, min_samples=cfg.min_samples, invert=cfg.invert)

    def draw(seed: int) -> protocol.Draw:
        d = load_leaf(cfg.data_dir, seed=seed, **kw)
        return protocol.Draw(d.train, d.test, list(d.writers))

    embed = dict(num_reference=cfg.num_reference, epsilon=cfg.epsilon, norm=cfg.norm)
    return protocol.draw_study(
        draw,
        seeds,
        num_folds=num_folds,
        embed=embed | {"num_classes": 10},
        fold_keys=fold_keys,
        embed_keys=jax.random.key(0),
        cluster_grid=cfg.cluster_grid,
    )


def _member_kwargs(cfg: Config, model, data: protocol.StudyData, keys, params) -> dict:
    """Per member: D, spectral labels of D, the rates and IFCA's random clusters."""
    # IFCA paper: k independent random initializations
    init = lambda k, c: models.init_params(model, jax.random.fold_in(k, 100 + c), (1, 784))
    cs = jnp.arange(cfg.ifca_clusters)
    clusters = jax.vmap(lambda k: jax.vmap(lambda c: init(k, c))(cs))(keys)
    train = data.cv.train
    rates = library_rates(cfg, train.counts)
    if cfg.rates == "default":  # params [B, ...]: each data set's initial model
        loss = models.cross_entropy_loss(model.apply)
        rates = protocol.member_default_rates(loss, params, train, cfg.clients_per_round, keys)
    rates = {k: jnp.asarray(v, jnp.float32) for k, v in rates.items()}
    return data.member_kwargs(rates=rates, clusters=clusters)


def tune(cfg: Config, model, methods) -> tuple[dict, dict]:
    """Every method at the grid point 2-fold CV (validation log-loss) chose on the tuning
    draw (:func:`karula_jax.protocol.fix_choices`): ``(methods, {name: point})``."""
    keys = jax.random.key(TUNING_SEED)[None]
    data = _study_data(cfg, [TUNING_SEED], 2, fold_keys=keys)
    members, p0 = data.cv.per_member(keys), models.init_params(model, keys[0], (1, 784))
    stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (len(members), *a.shape)), p0)
    outcomes = protocol.compare(
        {name: m for name, m in methods.items() if len(m.points()) > 1},  # something to choose
        p0,
        data.cv,
        keys=keys,
        num_rounds=cfg.rounds,
        eval_fn=lambda p, d: {"nll": ev.log_loss(model.apply, p, d)},
        score=lambda v: v["nll"].mean(-1),
        member_kwargs=_member_kwargs(cfg, model, data, members, stacked),
        describe=lambda o: f"CV on the tuning draw: {o.labels}",
    )
    return protocol.fix_choices(methods, outcomes)


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
    sfx, t_start, S = f"_{tag}" if tag else "", time.perf_counter(), cfg.seeds
    model = models.mlp(cfg.hidden, 10)
    loss = models.cross_entropy_loss(model.apply)
    seed_keys = jax.vmap(jax.random.key)(jnp.arange(S))
    params0 = jax.vmap(lambda k: models.init_params(model, k, (1, 784)))(seed_keys)
    personal = models.output_layer_mask(jax.tree.map(lambda a: a[0], params0))
    methods = make_methods(cfg, loss, personal, protocol.selected(cfg.methods, METHODS))
    fixed, chosen = tune(cfg, model, methods)

    data = _study_data(cfg, S, 0)  # no folds: the grids are fixed
    train, test, writers = data.cv.train, data.cv.evals, data.extras
    kw = _member_kwargs(cfg, model, data, seed_keys, params0)
    converged = bool(np.all(data.converged))
    print(f"{S} draws of {cfg.num_clients} writers; D converged: {converged}")
    alpha = jnp.stack([client_weights(c) for c in train.counts])  # [S, n]

    def evaluate(params, data):
        (tr, te), a = data
        return {
            "train_loss": jnp.sum(a * ev.log_loss(model.apply, params, tr)) / a.shape[0],
            "test_acc": ev.accuracy(model.apply, params, te),
        }

    outcomes = protocol.compare(
        fixed,
        params0,
        data.cv,
        keys=jax.vmap(lambda k: jax.random.fold_in(k, 1))(seed_keys),
        num_rounds=cfg.rounds,
        eval_fn=evaluate,
        eval_data=((train, test), alpha),
        member_kwargs=kw,
        params_per_seed=True,
        final_params=True,
        chunk_size=cfg.eval_every,
        eval_every_chunk=True,
        describe=lambda o: (
            f"{format_mean_se(*mean_and_se(100 * o.metrics['test_acc'].mean(-1)), digits=1)} %"
        ),
    )

    # ---- table: mean per-writer test accuracy, paired differences with Karula
    test_counts = np.asarray(test.counts, np.float64)
    acc = {m: 100 * o.curves["test_acc"][:, -1] for m, o in outcomes.items()}  # [S, n]
    leaves = [a.reshape(a.shape[:2] + (-1,)) for a in jax.tree.leaves(outcomes["IFCA"].params)]
    ifca_used = [int(np.unique(v, axis=0).shape[0]) for v in np.concatenate(leaves, -1)]
    values = {
        name: {
            "test_acc": a.mean(1),
            "pooled_acc": (a * test_counts).sum(1) / test_counts.sum(1),
            "train_loss": outcomes[name].curves["train_loss"][:, -1],
        }
        for name, a in acc.items()
    }
    labels = {name: methods[name].label(point) for name, point in chosen.items()}
    rows = protocol.study_rows(values, outcomes, paired="test_acc", choice="chosen", choices=labels)
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
    curves = {
        m: {
            "train_loss": o.curves["train_loss"],
            "test_acc": 100 * o.curves["test_acc"].mean(-1),
        }
        for m, o in outcomes.items()
    }
    plot_curves = functools.partial(
        reporting.plot_curves,
        outcomes["Local"].rounds,
        curves,
        panels=(("train_loss", "training loss"), ("test_acc", "mean per-writer test accuracy (%)")),
        title=f"FEMNIST, {cfg.num_clients} writers, ±2 SE over {S} seeds (writer draws)",
    )
    # Karula's constraints: the fraction active at the end, per seed
    sq = lambda p, s: ev.pairwise_sq_distances(jax.tree.map(lambda a: a[s], p), personal)
    D = np.asarray(data.D)
    active = [ev.active_fraction(sq(outcomes["Karula"].params, s), D[s], cfg.t) for s in range(S)]
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
        "writers": list(writers),
        "three_clients": {"indices": trio, "writers": [writers[0][i] for i in trio]},
        "rows": rows,
        "total_seconds": time.perf_counter() - t_start,
    }
    protocol.write_study(
        out,
        rows,
        columns,
        title=f"Federated MNIST (LEAF FEMNIST digits){' - ' + tag if tag else ''}",
        notes=notes,
        digits=dict(test_acc=1, pooled_acc=1, karula_minus=1, runtime_s=1),
        summary=summary,
        figures={f"curves{sfx}.png": plot_curves},
        table=f"table{sfx}",
        json=f"summary{sfx}.json",
    )
    print(f"wrote {out} in {summary['total_seconds']:.0f}s")
    return summary


if __name__ == "__main__":
    main()
