"""Federated MNIST on LEAF writers (paper section 5.2).

Seed ``s`` draws the writers (``load_leaf(seed=s)``), the initial models, participation and
minibatches. Grids the paper does not fix are chosen by K-fold CV on a separate tuning draw;
then every method is trained on every seed at its chosen point (the study driver,
:mod:`karula_jax.protocol.study`). Findings: ``results/femnist/README.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from experiments.paths import DATA_DIR, OUTPUT
from karula_jax import evaluation as ev
from karula_jax import models, protocol, provenance, reporting, training
from karula_jax.data import client_weights, load_leaf
from karula_jax.stats import format_mean_se, mean_and_se

__all__ = ["Config", "library_rates", "main", "merge_runs", "run_experiment", "study"]

METHODS = (
    ("Local", "FedAvg", "IFCA", "Karula") + protocol.tagged("baseline", "uses-D") + ("FedPer",)
)
TUNING_SEED = 10_000  # the writer draw on which the CV grids are decided


@dataclasses.dataclass(frozen=True)
class Config:
    """One FEMNIST run.

    Command: ``python -m experiments.femnist [--data-dir PATH] [--FIELD VALUE ...]
    [--quick] [--out DIR] [--tag NAME]`` writes ``runs/femnist/`` (``--out results/femnist``
    refreshes the committed pages; the tables without ``_full`` in their names ran
    with ``--rates-from member``); ``results/femnist/`` holds the defaults (the
    paper's rates on LEAF's pixels), ``--invert --tag invert_paper``, ``--invert
    --rate-scale 10 --tag invert_x10`` and ``--invert --rates default --tag
    invert_default``; ``--invert --rates cv`` (every method's rate chosen by CV; the
    runs ``*_full`` merged by ``--merge`` into ``table_verdict_full``), the t sweeps
    (``--t-sweep``: Karula over t at one step) and the CV over t (``--t-grid``) are the
    configurations the README's verdict rests on; ``--merge TAGS`` writes one table of
    the runs ``TAGS`` (:func:`merge_runs`) instead of running anything.

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
      rates: ``"paper"`` (``paper_rates`` times ``rate_scale``), ``"default"``: every
        method at its own default step from each draw's smoothness at the initial model
        (:func:`karula_jax.protocol.default_rates`; Karula's is its ``learning_rate=None``),
        or ``"cv"``: every method's rate chosen by CV on the tuning draw, jointly with its
        other hyperparameter, among the paper's rates times ``rate_multiples`` and the
        method's own default (Karula's without coupling, its ``t = inf`` rule).
      rate_multiples: the common log grid of ``rates="cv"`` (increasing; a choice of the
        first or last is flagged as a grid edge).
      rate_scale, local_steps: multiplies every paper rate; the FedAvg family's local steps.
      ifca_clusters, t: IFCA's clusters (independent random models); Karula's radius scale.
      t_grid: if given, Karula's t is chosen by CV on the tuning draw among these (at the
        step of ``rates``, jointly with the rate when ``rates="cv"``; 0 and ``inf`` are
        natural limits), instead of ``t``.
      norm, num_reference, epsilon: the embedding (``norm="row"``: linearized W1).
      invert: ``1 - x`` (ink 1 on background 0) instead of LEAF's background 1.
      grids: ``{method name: CV grid}`` (``--grid NAME=V1,V2``) of every method but
        Karula, whose t is ``t`` or ``t_grid`` (penalty: mu / L_f with ``L_f = 1 / karula
        rate``); 0 is each method's natural limit (FedProx: FedAvg; Ditto: local personal
        models; the penalty: no coupling), so a choice of 0 is not flagged as a grid edge.
        A method without an entry takes its registry row's grid.
      methods: which of ``METHODS`` to run (Karula always runs: the paired reference).
      t_sweep: if given, the t sweep instead of the comparison (:func:`run_t_sweep`):
        Karula at each of these t (``inf`` allowed) at one step for every t, and FedPer
        when ``methods`` holds it.
      rates_from: the counts the paper's rates are converted with (:func:`library_rates`,
        whose steps grow with a client's digits): ``"full"``, each member's seed's whole
        training set (CV validates the step the final fit takes), or ``"member"``, each
        data set's own (a CV fold's half of the digits: its step half the final fit's;
        the default before 2026-11-28: every table in ``results/femnist/`` without
        ``_full`` in its name ran with it).
      tuning_draws: writer draws the grids are chosen on (``TUNING_SEED`` and the next
        ones); with several, the point of the lowest CV score averaged over them
        (:func:`karula_jax.protocol.pooled_choice`).
      folds: ``K`` of the CV on the tuning draws: each fold trains on ``(K - 1) / K`` of
        every writer's training digits (2: half of them, fewer than a final fit sees).
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
    rate_multiples: tuple[float, ...] = (1.0, 3.0, 10.0, 30.0, 100.0)
    local_steps: int = 5
    ifca_clusters: int = 3
    t: float = 20.0
    t_grid: tuple[float, ...] = ()
    norm: str = "row"
    num_reference: int = 100
    epsilon: float = 0.05
    invert: bool = False
    # {method: CV grid} but Karula's (t, t_grid). The penalty's up to 1000: on LEAF's
    # pixels at the paper's rates CV chose 10, the old edge.
    grids: Mapping[str, tuple] = dataclasses.field(
        default_factory=lambda: {
            "FedProx": (0.0, 0.01, 0.1, 1.0, 10.0),
            "Ditto": (0.0, 0.01, 0.1, 1.0, 10.0),
            "Laplacian penalty on D": (0.0, 0.01, 0.1, 1.0, 10.0, 100.0, 1000.0),
            "Clustered FedAvg on D": (2, 3, 5, 8, 15),
        }
    )
    methods: tuple[str, ...] = METHODS
    t_sweep: tuple[float, ...] = ()
    tuning_draws: int = 1
    rates_from: str = "full"
    folds: int = 2


def quick_config(cfg: Config) -> Config:
    """A tiny version of ``cfg`` for tests: 6 writers, 10 rounds, 2 seeds, three methods."""
    small = dict(num_clients=6, clients_per_round=3, rounds=10, eval_every=5, seeds=2)
    small |= dict(methods=("FedAvg", "Karula", "Ditto"))
    grids = {"FedProx": (0.1,), "Ditto": (0.01, 1.0), "Laplacian penalty on D": (0.1,)}
    grids |= {"Clustered FedAvg on D": (2,)}
    return dataclasses.replace(cfg, num_reference=10, grids=dict(cfg.grids) | grids, **small)


def library_rates(cfg: Config, counts) -> dict[str, np.ndarray]:
    """The paper's step sizes (per summed loss, times ``rate_scale``) in ``karula_jax``'s
    units (:func:`karula_jax.protocol.summed_loss_rate`): ``karula``/``local`` with the
    product-space weighting (every client its paper step), the FedAvg family's for a
    client of average size. ``counts``: ``[..., n]``; returns ``{name: rate [...]}``.
    """
    weighting = {"karula": "product", "local": "product", "fedavg": "client"}
    return {
        m: protocol.summed_loss_rate(r * cfg.rate_scale, counts, weighting=weighting[m])
        for m, r in cfg.paper_rates
    }


def rate_choices(cfg: Config) -> list[str]:
    """The rate choices of ``rates="cv"``: the paper's rates times each multiple, then
    each method's own default."""
    return [f"rate x{m:g}" for m in cfg.rate_multiples] + ["default rate"]


def make_methods(cfg: Config, loss, personal, names=METHODS) -> dict[str, protocol.Method]:
    """Every method; steps from the member argument ``rates`` (:func:`library_rates`;
    with ``rates="cv"``, ``[C]`` choices per member, crossed with each method's grid);
    ``personal``: the leaves Karula, the penalty and FedPer personalize."""
    cv = cfg.rates == "cv"
    pick = lambda key: (
        (lambda rates, rate, **_: rates[key][rate]) if cv else (lambda rates, **_: rates[key])
    )
    steps = dict(local=pick("local"), fedavg=pick("fedavg"), ifca=pick("fedavg"))
    steps |= dict(karula=pick("karula"), penalty=pick("karula"), ditto_personal=pick("fedavg"))
    steps["penalty_mu"] = lambda mu, **kw: mu / steps["penalty"](**kw)
    steps["fedprox"] = functools.partial(_fedprox_step, steps["fedavg"], cfg)
    if cfg.rates == "default" and not cfg.t_sweep:  # Karula's rule, coupled to its t and D
        steps["karula"] = lambda **_: None
    grids = {"IFCA": cfg.ifca_clusters} | dict(cfg.grids) | {"Karula": cfg.t_grid or cfg.t}
    mask = dict(personalized=personal)
    methods = protocol.build_methods(
        names,
        loss=loss,
        rates=steps,
        grids=grids,
        options={"Karula": mask, "Laplacian penalty on D": mask, "FedPer": mask},
        clients_per_round=cfg.clients_per_round,
        batch_size=cfg.batch_size,
        local_steps=cfg.local_steps,
        num_clients=cfg.num_clients,
    )
    if not cv:
        return methods
    cross = lambda m: protocol.cross_choice(
        m, "rate", rate_choices(cfg), ordered=len(cfg.rate_multiples)
    )
    return {name: cross(m) for name, m in methods.items()}


def _fedprox_step(fedavg_step, cfg: Config, mu, **kw):
    """FedProx's step: FedAvg's, except that its own default (``rates="default"``, or the
    default choice of ``rates="cv"``) is ``1 / (max_i L_i + mu)``, which adds the proximal
    curvature to FedAvg's ``1 / max_i L_i``."""
    step = fedavg_step(**kw)
    own = step / (1 + mu * step)
    if cfg.rates == "default":
        return own
    if cfg.rates == "cv":  # the default is the last choice
        return jnp.where(kw["rate"] == len(cfg.rate_multiples), own, step)
    return step


def setup(cfg: Config):
    """``(model, loss, personal)``: the MLP, its loss and the mask of its output layer."""
    model = models.mlp(cfg.hidden, 10)
    loss = models.cross_entropy_loss(model.apply)
    return model, loss, models.output_layer_mask(_init(model, jax.random.key(0)))


def _init(model, key):
    """One initial model of ``model`` from ``key``."""
    return models.init_params(model, key, (1, 784))


def _seed_keys(data: protocol.StudyData) -> jax.Array:
    """``key(s)`` of every seed ``s`` drawn, ``[S]``: its initial model, IFCA's clusters."""
    return jax.vmap(jax.random.key)(jnp.asarray(data.seeds))


def _run_keys(data: protocol.StudyData) -> jax.Array:
    """The runs' keys ``[S]``: a tuning draw's own key; a seed's ``fold_in(key(s), 1)``."""
    keys = _seed_keys(data)
    return keys if data.cv.num_folds else jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys)


def active_pairs(params, D, t: float, personal) -> np.ndarray:
    """Fraction of pairs whose constraint at ``t`` binds at the end, per seed ``[S]``, from
    the client models ``params`` (leaves ``[S, n, ...]``) over the ``personal`` leaves."""
    D = np.asarray(D)
    at = lambda s: jax.tree.map(lambda a: a[s], params)
    return np.array(
        [
            ev.active_fraction(ev.pairwise_sq_distances(at(s), personal), D[s], t)
            for s in range(len(D))
        ]
    )


def _member_kwargs(cfg: Config, model, data: protocol.StudyData) -> dict:
    """Per member: the rates and IFCA's random clusters, from the member's seed (its key
    ``key(seed)`` and initial model)."""
    keys = data.cv.per_member(_seed_keys(data))
    # IFCA paper: k independent random initializations
    cs = jnp.arange(cfg.ifca_clusters)
    clusters = jax.vmap(
        lambda k: jax.vmap(lambda c: _init(model, jax.random.fold_in(k, 100 + c)))(cs)
    )(keys)
    train = data.cv.train
    counts = train.counts
    if cfg.rates_from == "full":  # every member converts with its seed's whole training set
        counts = data.cv.per_member(data.cv.final(counts))
    rates = library_rates(cfg, counts)
    if cfg.rates in ("default", "cv"):  # each data set's initial model
        loss = models.cross_entropy_loss(model.apply)
        params = jax.vmap(functools.partial(_init, model))(keys)
        own = protocol.member_default_rates(loss, params, train, cfg.clients_per_round, keys)
        if cfg.rates == "default":
            rates = own
        else:  # [B, C]: the paper's times each multiple, then the method's own default
            rates = {
                k: np.stack([v * m for m in cfg.rate_multiples] + [own[k]], -1)
                for k, v in rates.items()
            }
    rates = {k: jnp.asarray(v, jnp.float32) for k, v in rates.items()}
    return {"rates": rates, "clusters": clusters}


def _short(values) -> str:
    """A rate or a vector of rates to 4 significant digits (``0.5754``, ``[0.01, 0.1]``)."""
    flat = [f"{float(x):.4g}" for x in np.ravel(np.asarray(values))]
    return flat[0] if len(flat) == 1 else "[" + ", ".join(flat) + "]"


def rates_text(cfg: Config) -> str:
    """How the steps were set, for the notes."""
    if cfg.rates == "paper":
        return f"paper rates x {cfg.rate_scale:g}"
    if cfg.rates == "cv":
        return (
            f"rates chosen by CV among the paper's x {', '.join(map(str, cfg.rate_multiples))}"
            " and each method's default"
        )
    return "each method's default rate"


def main(argv=None) -> dict:
    """Command-line entry point (see :class:`Config`); returns the summary."""
    cfg, args = reporting.cli(
        Config,
        argv,
        quick=quick_config,
        description=__doc__,
        out=OUTPUT / "femnist",
        tag=dict(default="", help="suffix of the output file names"),
        merge=dict(default="", help="comma-separated tags of runs to merge (merge_runs)"),
    )
    if args.merge:
        return merge_runs(args.out, args.merge.split(","), args.tag or "merged")
    if cfg.rates_from not in ("member", "full"):
        raise ValueError(f"rates_from must be 'member' or 'full', got {cfg.rates_from!r}")
    if cfg.folds < 2:
        raise ValueError(f"folds must be >= 2 (CV on the tuning draws), got {cfg.folds}")
    if cfg.tuning_draws < 1:
        raise ValueError(f"tuning_draws must be >= 1, got {cfg.tuning_draws}")
    if cfg.rates not in ("paper", "default", "cv"):
        raise ValueError(f"rates must be 'paper', 'default' or 'cv', got {cfg.rates!r}")
    if cfg.rounds % cfg.eval_every:
        cfg = dataclasses.replace(cfg, eval_every=cfg.rounds)
    if "Karula" in cfg.grids:
        raise ValueError("Karula's t is --t (fixed) or --t-grid (chosen by CV), not --grid")
    if cfg.t_sweep:
        if cfg.rates == "cv":
            raise ValueError("t_sweep takes one step for every t: rates 'paper' or 'default'")
        if cfg.t_grid:
            raise ValueError("t_sweep and t_grid exclude each other: a sweep or a CV over t")
        from experiments import femnist_sweep  # it builds on this module's comparison

        return femnist_sweep.run_t_sweep(cfg, args.out, args.tag)
    if cfg.t_grid and len(cfg.t_grid) < 2:
        raise ValueError(
            f"t_grid must hold at least two values of t to choose from, got {cfg.t_grid}"
        )
    return run_experiment(cfg, args.out, args.tag)


def _options(cfg: Config, model, data: protocol.StudyData) -> dict:
    """The runs' options: on the tuning draw, CV on the mean validation log-loss from
    one initial model; on the seeds' draws, each seed's initial model, curves every
    ``eval_every`` rounds of the weighted training loss and the test accuracy."""
    if data.cv.num_folds:  # the tuning draws
        return dict(
            params_per_seed=len(data.seeds) > 1,
            eval_fn=lambda p, d: {"nll": ev.log_loss(model.apply, p, d)},
            score=lambda v: v["nll"].mean(-1),
            describe=lambda o: f"CV on the tuning draw: {o.labels}",
        )
    train, test = data.cv.train, data.cv.evals
    alpha = jnp.stack([client_weights(c) for c in train.counts])  # [S, n]

    def evaluate(params, evals):
        (tr, te), a = evals
        return {
            "train_loss": jnp.sum(a * ev.log_loss(model.apply, params, tr)) / a.shape[0],
            "test_acc": ev.accuracy(model.apply, params, te),
        }

    return dict(
        eval_fn=evaluate,
        eval_data=((train, test), alpha),
        params_per_seed=True,
        final_params=True,
        chunk_size=cfg.eval_every,
        eval_every_chunk=True,
        describe=lambda o: (
            f"{format_mean_se(*mean_and_se(100 * o.metrics['test_acc'].mean(-1)), digits=1)} %"
        ),
    )


# What ± and "decided" mean in a comparison table (its notes).
BAND_NOTE = (
    "± is the 95% Student-t interval over seeds; 'Karula minus method' is the paired "
    "difference of the seeds' mean accuracies, decided when its paired t-test's p-value, "
    "Holm-adjusted over the table's comparisons with Karula, is below 0.05."
)


def _initial_models(model, data: protocol.StudyData):
    """Seed ``s``'s initial model from ``key(s)``: ``[S]`` of them, or a single tuning
    draw's one (its folds start from it)."""
    if data.cv.num_folds and len(data.seeds) == 1:
        return _init(model, jax.random.key(data.seeds[0]))
    return jax.vmap(functools.partial(_init, model))(_seed_keys(data))


def seed_values(_: str, o: protocol.CVOutcome, data: protocol.StudyData) -> dict[str, np.ndarray]:
    """A method's columns per seed: test accuracies (%), the final training loss, its
    drop over the last fifth of the rounds and whether it flattened there."""
    acc, counts = 100 * o.curves["test_acc"][:, -1], np.asarray(data.cv.evals.counts, float)
    loss, late = o.curves["train_loss"], ev.tail_start(np.asarray(o.rounds))  # [S, T]
    return {
        "test_acc": acc.mean(1),
        "pooled_acc": (acc * counts).sum(1) / counts.sum(1),
        "train_loss": loss[:, -1],
        "loss_drop": loss[:, late] - loss[:, -1],
        "flattened": ev.flattened(loss, o.rounds).astype(float),
    }


def _ifca_in_use(outcomes) -> list[int] | None:
    """IFCA's clusters in use at the end: distinct client models per seed."""
    if "IFCA" not in outcomes:
        return None
    leaves = [a.reshape(a.shape[:2] + (-1,)) for a in jax.tree.leaves(outcomes["IFCA"].params)]
    return [int(np.unique(v, axis=0).shape[0]) for v in np.concatenate(leaves, -1)]


def study(cfg: Config, tag: str = "") -> protocol.Study:
    """The comparison: grids chosen on writer draw :data:`TUNING_SEED`, then every method
    trained on every seed's writers."""
    sfx, S = f"_{tag}" if tag else "", cfg.seeds
    model, loss, personal = setup(cfg)
    methods = make_methods(cfg, loss, personal, protocol.selected(cfg.methods, METHODS))
    kw = dict(num_clients=cfg.num_clients, min_samples=cfg.min_samples, invert=cfg.invert)

    def draw(seed: int) -> protocol.Draw:  # extras: the writers
        d = load_leaf(cfg.data_dir, seed=seed, **kw)
        return protocol.Draw(d.train, d.test, list(d.writers))

    def t_chosen(result) -> float:
        return float(result.tuning["points"]["Karula"]["t"]) if cfg.t_grid else cfg.t

    def notes(result) -> list[str]:
        rates, grids = result.member_kwargs["rates"], result.tuning["grids"]
        tuning = result.tuning["seeds"]
        return [
            f"{S} seeds; seed s draws {cfg.num_clients} of the LEAF writers with >= "
            f"{cfg.min_samples} training digits, the initial model, participation and "
            f"minibatches. {BAND_NOTE}",
            f"{cfg.clients_per_round} writers per round, minibatch {cfg.batch_size}, 784-"
            f"{cfg.hidden}-10 ReLU MLP, {cfg.rounds} rounds, "
            f"{'inverted' if cfg.invert else 'LEAF'} pixels, {rates_text(cfg)} (library "
            "rates, seed 0: "
            + ", ".join(f"{k} {_short(v[0])}" for k, v in rates.items())
            + f"). Karula: t = {t_chosen(result):g} on D ({cfg.norm} norm), output layer "
            f"personalized (also in the penalty and FedPer); the FedAvg family: "
            f"{cfg.local_steps} local steps; IFCA: {cfg.ifca_clusters} independently "
            f"initialized clusters, in use at the end per seed: {_ifca_in_use(result.outcomes)}.",
            f"Grids decided by {cfg.folds}-fold CV on writer draw {', '.join(map(str, tuning))}"
            + " (the lowest CV score averaged over them)" * (len(tuning) > 1)
            + ": "
            + "; ".join(f"{m}: {', '.join(labels)}" for m, labels in grids.items())
            + ". Runtime: all seeds of a method, compilation included.",
            "Paper (final mean test accuracy): Karula 91.3 ± 0.75, Local 89.3 ± 0.78, "
            "FedAvg 84.4 ± 2.39, IFCA 83.9 ± 2.60.",
            f"Flattened: over the last fifth of the rounds a seed's training loss stays within "
            f"2% of its total decrease of its final value (`karula_jax.evaluation.flattened`); "
            f"the 'loss drop' column is the seed mean's drop there; curves{sfx}.png shows "
            "every curve.",
        ]

    def summary(result) -> dict:
        data, writers = result.data, result.data.extras
        trio = reporting.client_triplet(np.asarray(data.D[0]), np.random.default_rng(7))
        params = result.outcomes["Karula"].params
        return {
            "ifca_clusters_in_use": _ifca_in_use(result.outcomes),
            "karula_active_fraction": active_pairs(
                params, data.D, t_chosen(result), personal
            ).tolist(),
            "writers": list(writers),
            "three_clients": {"indices": trio, "writers": [writers[0][i] for i in trio]},
        }

    def figures(result) -> dict:
        o, data = result.outcomes, result.data
        curves = {
            m: {
                "train_loss": c.curves["train_loss"],
                "test_acc": 100 * c.curves["test_acc"].mean(-1),
            }
            for m, c in o.items()
        }
        panels = (
            ("train_loss", "training loss"),
            ("test_acc", "mean per-writer test accuracy (%)"),
        )
        title = f"FEMNIST, {cfg.num_clients} writers, ±2 SE over {S} seeds (writer draws)"
        trio = functools.partial(
            reporting.plot_client_triplet,
            jax.tree.map(lambda a: a[0], data.cv.train),
            [f"writer {w} (client {i})" for i, w in enumerate(data.extras[0])],
            np.asarray(data.D[0]),
            invert=cfg.invert,
            title=f"Dissimilarities D ({cfg.norm} norm) between three FEMNIST writers (seed 0)",
        )
        return {
            f"curves{sfx}.png": functools.partial(
                reporting.plot_curves, o["Karula"].rounds, curves, panels=panels, title=title
            ),
            f"clients{sfx}.png": trio,
        }

    b = reporting.banded
    columns = [("method", "method"), ("test_acc", b("mean per-writer test acc. (%)"))]
    columns += [("pooled_acc", b("pooled test acc. (%)"))]
    columns += [("karula_minus", b("Karula minus method (paired)"))]
    columns += reporting.verdict_columns("karula_minus")
    columns += [("train_loss", b("final training loss"))]
    rounds = np.arange(1, cfg.rounds // cfg.eval_every + 1) * cfg.eval_every  # recorded
    late = f"rounds {int(rounds[ev.tail_start(rounds)])}-{cfg.rounds}" if len(rounds) > 1 else ""
    columns += [("loss_drop", b(f"training loss drop, {late or 'last fifth'}"))]
    columns += [("flattened", b("flattened (share of seeds)"))]
    columns += [("cv_choice", "CV choice (tuning draw)"), ("runtime_s", "runtime (s)")]
    return protocol.Study(
        title=f"Federated MNIST (LEAF FEMNIST digits){' - ' + tag if tag else ''}",
        config=cfg,
        draw=draw,
        seeds=S,
        num_folds=cfg.folds,
        num_rounds=cfg.rounds,
        methods=lambda _: methods,
        params=functools.partial(_initial_models, model),
        eval_fn=None,  # _options
        score=None,
        values=seed_values,
        paired="test_acc",
        columns=columns,
        embed=dict(num_reference=cfg.num_reference, epsilon=cfg.epsilon, norm=cfg.norm)
        | {"num_classes": 10},
        member_kwargs=functools.partial(_member_kwargs, cfg, model),
        keys=_run_keys,
        embed_keys=jax.random.key(0),
        cluster_grid=protocol.grid_of("Clustered FedAvg on D", cfg.grids),
        fold_keys=lambda seeds: jax.vmap(jax.random.key)(jnp.asarray(seeds)),
        tuning_seeds=tuple(TUNING_SEED + i for i in range(cfg.tuning_draws)),
        report=lambda result: protocol.Report(notes(result), summary(result), figures(result)),
        digits=dict(
            test_acc=1, pooled_acc=1, karula_minus=1, runtime_s=1, loss_drop=4, flattened=2
        ),
        options=functools.partial(_options, cfg, model),
        table=f"table{sfx}",
        json=f"summary{sfx}.json",
    )


def run_experiment(cfg: Config, out: pathlib.Path, tag: str = "") -> dict:
    """Tunes the grids, trains every method on every seed; writes tables and figures."""
    return protocol.run_study(study(cfg, tag), out).summary


def merge_runs(out: pathlib.Path, tags, tag: str) -> list[dict]:
    """One table of every method of the runs ``tags`` (their ``summary_<tag>.json`` in
    ``out``), paired against Karula (:func:`karula_jax.protocol.merge_runs`: the runs must
    share their writer draws and protocol, so their Karula rows agree per seed to 1e-6
    points; a method in several runs is taken from the first). Writes
    ``table_<tag>.{md,csv}``; returns the rows.
    """
    read = lambda run: json.loads((pathlib.Path(out) / f"summary_{run}.json").read_text())
    summaries = {run: read(run) for run in tags}
    per_seed, chosen, source = protocol.merge_runs(summaries)
    rows = reporting.comparison_rows(per_seed, reference="Karula", paired="test_acc")
    for row in rows:
        choice = chosen[row["method"]]
        row["cv_choice"] = choice if isinstance(choice, str) else reporting.choice_counts(choice)
        row["run"] = source[row["method"]]
    b = reporting.banded
    columns = [("method", "method"), ("test_acc", b("mean per-writer test acc. (%)"))]
    columns += [("karula_minus", b("Karula minus method (paired)"))]
    columns += reporting.verdict_columns("karula_minus")
    columns += [("train_loss", b("final training loss"))]
    columns += [
        ("flattened", b("flattened (share of seeds)")),
        ("cv_choice", "CV choice (tuning draw)"),
    ]
    columns += [("run", "run (table_<run>.md)")]
    notes = [
        f"Merged from the runs {', '.join(tags)} (same writer draws and protocol; Karula's "
        f"per-seed accuracies agree across them): their notes give the settings. {BAND_NOTE}"
        f" Command: `python -m experiments.femnist --merge {','.join(tags)} "
        f"--tag {tag} --out {out}`."
    ]
    title = f"Federated MNIST (LEAF FEMNIST digits) - {tag}"
    digits = dict(test_acc=1, karula_minus=1, flattened=2)
    text = reporting.write_table(
        rows, columns, pathlib.Path(out) / f"table_{tag}", title=title, notes=notes, digits=digits
    )
    print(text + "\n" + "\n".join(notes))
    page = pathlib.Path(out) / "README.md"
    if page.is_file():  # the results page, written by hand: only its header is the run's
        provenance.stamp_page(page, merged_runs_header(out, summaries))
    return rows


def merged_runs_header(out: pathlib.Path, summaries: Mapping[str, dict]) -> str:
    """The FEMNIST page's run header for a table merged from the runs ``summaries``
    (``{tag: its summary_<tag>.json in out}``): each run's date and commit (its summary's
    ``provenance``; for a run that predates it, the commit that added its summary), wall
    time, jax version and devices."""
    runs, machines = [], set()
    for run, summary in summaries.items():
        facts = summary.get("provenance")
        if facts:
            when = f"{facts['date']}, commit {facts['commit']}"
            machines.add(provenance.machine_text(facts))
        else:
            origin = provenance.committed(pathlib.Path(out) / f"summary_{run}.json")
            when = "not recorded"
            if origin:
                commit, date = origin
                when = f"added in commit {commit}, {date}"
            devices = ", ".join(summary.get("devices") or ["not recorded"])
            machines.add(f"not recorded by the run; JAX devices: {devices}")
        wall = summary.get("total_seconds")
        wall = "wall time not recorded" if wall is None else f"{wall:,.0f} s wall"
        jax_version = summary.get("jax_version", "not recorded")
        runs.append(f"`{run}` ({when}; jax {jax_version}; {wall})")
    lines = [f"- **Runs:** the verdict table merged from {len(runs)} runs: {'; '.join(runs)}."]
    lines.append(f"- **Machine:** {' | '.join(sorted(machines))}.")
    return "\n".join(lines)


if __name__ == "__main__":
    training.use_cpu_cores()  # one CPU device per core: the runs split over them
    main()
