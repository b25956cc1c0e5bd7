"""Synthetic ridge regression: the paper's Table 1 and Figure 1 (section 5.1).

Each seed's data set is split into CV folds (:func:`karula_jax.evaluation.kfold_split`);
every fold and the final fit get their own D and step sizes; each method is one
:func:`karula_jax.training.run_many` call over (folds + final fit) x seeds x its grid, and
:func:`karula_jax.evaluation.select_by_cv` picks its hyperparameter per seed. The protocol
(step sizes, grids, every choice the paper leaves open) and the findings are in
``results/synthetic/README.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from experiments.report import (
    RESULTS,
    cli,
    mean_se_columns,
    paired_columns,
    plot_heatmaps,
    write_json,
    write_table,
)
from karula_jax import algorithms as A
from karula_jax import evaluation as ev
from karula_jax.data import ClientData, synthetic_ridge
from karula_jax.embedding import dissimilarities
from karula_jax.models import ridge_loss
from karula_jax.protocol import (
    CVData,
    Method,
    choice_grid,
    cross_validate,
    cv_datasets,
    scalar_grid,
    stack_datasets,
)
from karula_jax.stats import format_mean_se, mean_and_se, paired_difference
from karula_jax.training import progress_bar

__all__ = [
    "DIAGNOSTICS",
    "METHODS",
    "SETTINGS",
    "SyntheticConfig",
    "build_batch",
    "main",
    "run_experiment",
    "run_sensitivity",
]

METHODS = ("Local", "FedSGD", "FedAvg", "IFCA", "pFedMe", "Karula")
# Baselines beyond the paper, and the two other uses of Karula's D (penalty, clustering).
EXTRA = ("FedProx", "SCAFFOLD", "Ditto", "Laplacian penalty on D", "Clustered FedAvg on D")
# Karula with dissimilarities no federated method has (results/synthetic/README.md).
DIAGNOSTICS = ("Karula, true D (diagnostic)", "Karula, population D (diagnostic)")


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
    """One run of the synthetic study.

    Command: ``python -m experiments.synthetic_ridge`` (writes ``results/synthetic/``);
    ``--quick`` (smoke run, < 60 s), ``--diagnostics`` (also Karula on the true and on a
    population D, writes ``results/synthetic_diagnostics/``), ``--seeds S``, ``--out DIR``,
    ``--generator NAME=VALUE`` (a keyword of :func:`karula_jax.data.synthetic_ridge`).

    Expected (10 seeds, estimation error / test R^2, mean over seeds): Local 22.6 / 0.800,
    FedSGD 9.2 / 0.876, FedAvg 9.2 / 0.876, IFCA 4.4 / 0.955 (k = 3..5), pFedMe 3.4 / 0.952,
    Karula 5.8 / 0.925 (t = 4..16), FedProx 9.2, SCAFFOLD 9.2, Ditto 2.4 / 0.966, Laplacian
    penalty on D 7.3, clustered FedAvg on D 2.8 / 0.968. Runtime: 615 s wall on a shared
    2-core machine (the six paper methods: 363 s idle; ``--diagnostics`` adds two Karula runs).

    Attributes:
      seeds: seeds 0..seeds-1 (data draw and training randomness).
      num_clients, dim, lam: n, d and the ridge penalty.
      clients_per_round: participants per round (every method but Local).
      num_folds: folds of the cross-validation.
      rounds: communication rounds of every method.
      local_steps: local steps of FedAvg, IFCA and pFedMe.
      pfedme_inner_steps: pFedMe's inner steps approximating the proximal point.
      rate_karula, rate_fedavg, rate_ifca, rate_pfedme: step = rate / L (which L: README).
      projection_tol, projection_max_iter: stopping rule of Karula's projection per round.
      t_grid, k_grid, pfedme_grid: grids of Karula's t, IFCA's k, pFedMe's lambda.
      ditto_grid, fedprox_grid: Ditto's lambda and FedProx's mu.
      penalty_grid: mu / L_f of the Laplacian penalty (its step is Karula's).
      cluster_grid: k of the clustered FedAvg (spectral clustering of each data set's D).
      num_reference, epsilon: reference points and Sinkhorn epsilon of the embedding.
      noise_std: response noise of the generator (None: its default).
      generator: further keywords of :func:`karula_jax.data.synthetic_ridge`.
      normalize_D: divide every data set's D by its mean off-diagonal entry.
      diagnostics: also train Karula on the true and on a population D.
      methods: which of ``METHODS + EXTRA`` to run (Karula always runs: the paired reference).
      population_rows: rows per client behind the population D.
    """

    seeds: int = 10
    num_clients: int = 30
    dim: int = 50
    lam: float = 1e-6
    clients_per_round: int = 10
    num_folds: int = 5
    rounds: int = 600
    local_steps: int = 5
    pfedme_inner_steps: int = 5
    rate_karula: float = 3 / 8
    rate_fedavg: float = 1 / 10
    rate_ifca: float = 1 / 2
    rate_pfedme: float = 1 / 2
    projection_tol: float = 1e-4
    projection_max_iter: int = 10
    t_grid: tuple[float, ...] = (2.0, 4.0, 8.0, 16.0, 32.0)
    k_grid: tuple[int, ...] = (1, 2, 3, 4, 5)
    pfedme_grid: tuple[float, ...] = tuple(float(x) for x in np.geomspace(0.01, 1.0, 5))
    ditto_grid: tuple[float, ...] = (0.01, 0.1, 1.0, 10.0)
    fedprox_grid: tuple[float, ...] = (0.01, 0.1, 1.0, 10.0)
    penalty_grid: tuple[float, ...] = (1e-3, 1e-2, 0.1, 1.0, 10.0)
    cluster_grid: tuple[int, ...] = (1, 2, 3, 4, 5)
    num_reference: int = 100
    epsilon: float = 0.5
    noise_std: float | None = None
    generator: dict[str, Any] = dataclasses.field(default_factory=dict)
    normalize_D: bool = True
    diagnostics: bool = False
    methods: tuple[str, ...] = METHODS + EXTRA
    population_rows: int = 1000

    def __post_init__(self):
        ones = ("seeds", "num_clients", "dim", "clients_per_round", "rounds", "local_steps")
        bad = [f"{k} must be >= 1" for k in ones + ("population_rows",) if getattr(self, k) < 1]
        bad += ["num_folds must be >= 2"] * (self.num_folds < 2)
        too_many = self.clients_per_round > self.num_clients
        bad += ["clients_per_round exceeds num_clients"] * too_many
        for k in [f.name for f in dataclasses.fields(self) if f.name.endswith("_grid")]:
            v = getattr(self, k)
            bad += [f"{k} must be a non-empty tuple of positive values"] * (not v or min(v) <= 0)
        if bad:
            raise ValueError("; ".join(bad))


def quick_config(cfg: SyntheticConfig | None = None) -> SyntheticConfig:
    """A smoke-test version of ``cfg``: 2 seeds, few rounds and grid points (about 60 s)."""
    small = dict(num_folds=2, rounds=30, num_reference=20, population_rows=200)
    small |= dict(t_grid=(3.0, 30.0), k_grid=(1, 2), pfedme_grid=(0.3, 3.0))
    small |= dict(ditto_grid=(0.1, 1.0), fedprox_grid=(0.1, 1.0), penalty_grid=(0.1, 10.0))
    small |= dict(methods=METHODS + ("Ditto", "Clustered FedAvg on D"), cluster_grid=(1, 3))
    return dataclasses.replace(cfg or SyntheticConfig(), seeds=2, **small)


class Batch(NamedTuple):
    """Every data set of the study (:class:`karula_jax.protocol.CVData`) and what goes with it."""

    cv: CVData  # S (K + 1) members, seed-major
    D: jnp.ndarray  # [B, n, n] Karula's dissimilarities
    D_true: jnp.ndarray | None  # [B, n, n] true ||theta_i* - theta_j*||^2 (diagnostic)
    D_population: jnp.ndarray | None  # [B, n, n] D from many fresh rows (diagnostic)
    labels: np.ndarray  # [B, len(cluster_grid), n] spectral clusters of D
    L_f: np.ndarray  # [B] product-space constant max_i alpha_i L_i / n
    L_max: np.ndarray  # [B] max_i L_i
    theta_true: np.ndarray  # [S, n, d]
    embedding_converged: np.ndarray  # [B, n] bool
    spearman_population: np.ndarray | None  # [S] Spearman of D_population with the truth


def _normalize(D: jnp.ndarray) -> jnp.ndarray:
    """Divides each ``[n, n]`` matrix of ``[B, n, n]`` by its mean off-diagonal entry."""
    n = D.shape[-1]
    return D / (jnp.sum(D, axis=(-2, -1), keepdims=True) / (n * (n - 1)))


def build_batch(cfg: SyntheticConfig, *, log: Callable[[str], None] = print) -> Batch:
    """Draws the seeds' data, splits folds, computes D and the Lipschitz constants."""
    gen = dict(cfg.generator, num_clients=cfg.num_clients, dim=cfg.dim)
    if cfg.noise_std is not None:
        gen["noise_std"] = cfg.noise_std
    sets = [synthetic_ridge(seed, **gen) for seed in range(cfg.seeds)]
    fold_key = lambda s: jax.random.fold_in(jax.random.key(1_000_003), s)
    cv = cv_datasets(
        stack_datasets([s.train for s in sets]),
        stack_datasets([s.test for s in sets]),
        cfg.num_folds,
        key=jax.vmap(fold_key)(jnp.arange(cfg.seeds)),
    )
    B = cv.train.x.shape[0]
    t0 = time.perf_counter()
    emb_keys = jax.vmap(lambda b: jax.random.fold_in(jax.random.key(2_000_003), b))(jnp.arange(B))
    embed = jax.jit(
        jax.vmap(
            lambda d, k: dissimilarities(
                d, key=k, num_reference=cfg.num_reference, epsilon=cfg.epsilon
            )
        )
    )
    D, info = jax.block_until_ready(embed(cv.train, emb_keys))
    log(f"dissimilarities of {B} data sets: {time.perf_counter() - t0:.1f} s")
    converged = np.asarray(info.converged)
    theta_true = np.stack([np.asarray(s.theta_true) for s in sets])

    D_true = D_pop = rho_pop = None
    if cfg.diagnostics:
        # The truth, and D from many fresh rows of the same clients (the generator draws
        # training rows before test rows, so only the test rows grow).
        truth = np.stack([ev.pairwise_sq_distances(t) for t in theta_true])
        D_true = cv.per_member(jnp.asarray(truth, jnp.float32))
        pops = [
            synthetic_ridge(seed, **{**gen, "num_test": cfg.population_rows}).test
            for seed in range(cfg.seeds)
        ]
        D_pop, pop_info = embed(stack_datasets(pops), cv.final(emb_keys))
        converged = converged & np.asarray(cv.per_member(pop_info.converged))
        rho_pop = np.asarray([ev.spearman_offdiag(t, d) for t, d in zip(truth, D_pop, strict=True)])
        D_pop = cv.per_member(D_pop)
    if cfg.normalize_D:
        D, D_true, D_pop = (None if a is None else _normalize(a) for a in (D, D_true, D_pop))

    n = cfg.num_clients
    host = [ClientData(*(np.asarray(a[b]) for a in cv.train)) for b in range(B)]
    L_f = np.asarray([A.lipschitz_ridge(d, cfg.lam) for d in host])
    # weights n turn max_i alpha_i L_i / n into max_i L_i
    L_max = np.asarray([A.lipschitz_ridge(d, cfg.lam, weights=np.full(n, float(n))) for d in host])
    labels = np.asarray(
        [[A.cluster_clients(d, k) for k in cfg.cluster_grid] for d in np.asarray(D)], np.int32
    )
    return Batch(cv, D, D_true, D_pop, labels, L_f, L_max, theta_true, converged, rho_pop)


def methods(cfg: SyntheticConfig, n_max: int) -> dict[str, Method]:
    """The six methods with the step sizes of ``results/synthetic/README.md``."""
    loss, n = ridge_loss(cfg.lam), cfg.num_clients
    common = dict(clients_per_round=cfg.clients_per_round, batch_size=n_max)
    local_steps = dict(common, local_steps=cfg.local_steps)

    def local(L_f, **_):
        return A.local(loss, learning_rate=cfg.rate_karula / L_f, batch_size=n_max)

    def fedsgd(L_f, **_):
        return A.fedsgd(loss, learning_rate=cfg.rate_karula / (n * L_f), **common)

    def fedavg(L_max, **_):
        return A.fedavg(loss, learning_rate=cfg.rate_fedavg / L_max, **local_steps)

    def ifca(L_max, k, **_):
        return A.ifca(loss, num_clusters=k, learning_rate=cfg.rate_ifca / L_max, **local_steps)

    def pfedme(L_max, lam, **_):
        L_env = lam * L_max / (lam + L_max)  # the Moreau envelope's smoothness
        inner = dict(personal_learning_rate=1 / (L_max + lam), inner_steps=cfg.pfedme_inner_steps)
        return A.pfedme(
            loss, learning_rate=cfg.rate_pfedme / L_env, lam=lam, **inner, **local_steps
        )

    def karula(D, L_f, t, **_):
        tol = dict(projection_tol=cfg.projection_tol, projection_max_iter=cfg.projection_max_iter)
        return A.karula(loss, D, t=t, learning_rate=cfg.rate_karula / L_f, **tol, **common)

    def fedprox(L_max, mu, **_):
        return A.fedprox(loss, mu=mu, learning_rate=cfg.rate_fedavg / L_max, **local_steps)

    def scaffold(L_max, **_):
        return A.scaffold(loss, learning_rate=cfg.rate_fedavg / L_max, **local_steps)

    def ditto(L_max, lam, **_):
        personal = dict(personal_learning_rate=cfg.rate_pfedme / L_max)
        return A.ditto(
            loss, lam=lam, learning_rate=cfg.rate_fedavg / L_max, **personal, **local_steps
        )

    def penalty(D, L_f, mu, **_):  # Karula's step: the penalty and the constraint differ only
        lr = cfg.rate_karula / L_f
        return A.laplacian_penalty(loss, D, mu=mu * L_f, learning_rate=lr, **common)

    def clustered(labels, L_max, k, **_):
        lr = cfg.rate_fedavg / L_max
        return A.clustered_fedavg(loss, labels[k], learning_rate=lr, **local_steps)

    ks = [{"k": int(k)} for k in cfg.k_grid]
    lams, ts = {"lam": np.asarray(cfg.pfedme_grid)}, {"t": np.asarray(cfg.t_grid)}
    return {
        "Local": Method(local),
        "FedSGD": Method(fedsgd),
        "FedAvg": Method(fedavg),
        "IFCA": Method(ifca, static_grid=ks, label=lambda h: f"k={h['k']}"),
        "pFedMe": Method(pfedme, lams, label=lambda h: f"lambda={h['lam']:.3g}"),
        "Karula": Method(karula, ts, label=lambda h: f"t={h['t']:.3g}"),
        "FedProx": Method(fedprox, **scalar_grid("mu", cfg.fedprox_grid)),
        "SCAFFOLD": Method(scaffold),
        "Ditto": Method(ditto, **scalar_grid("lam", cfg.ditto_grid)),
        "Laplacian penalty on D": Method(
            penalty, **scalar_grid("mu", cfg.penalty_grid, shown="mu/L_f")
        ),
        "Clustered FedAvg on D": Method(clustered, **choice_grid("k", cfg.cluster_grid)),
    }


def _metrics(theta, evals):
    """Per-client metrics of one run (vmapped over data sets and grid points)."""
    data, theta_true = evals
    linear = lambda th, x: x @ th
    return {
        "theta": theta,
        "mse": ev.mean_squared_error(linear, theta, data),
        "r2": ev.r2_score(linear, theta, data),
        "error": ev.estimation_error(theta, theta_true),
    }


def run_method(name: str, method: Method, batch: Batch, cfg: SyntheticConfig, log=print):
    """Cross-validates ``method`` (pooled validation MSE) and scores its final fits."""
    cv, K = batch.cv, cfg.num_folds
    rows = np.asarray(cv.evals.counts, np.float64).reshape(cfg.seeds, K + 1, 1, -1)[:, :K]
    out = cross_validate(
        method,
        jnp.zeros((cfg.dim,), jnp.float32),
        cv,
        keys=jax.vmap(jax.random.key)(jnp.arange(cfg.seeds)),
        num_rounds=cfg.rounds,
        eval_fn=_metrics,
        eval_data=(cv.evals, cv.per_member(batch.theta_true)),
        member_kwargs={
            "D": batch.D,
            "labels": batch.labels,
            "L_f": batch.L_f,
            "L_max": batch.L_max,
        },
        # pooled validation MSE: squared errors of all clients / their rows
        score=lambda m: np.sum(m["mse"] * rows, -1) / rows.sum(-1),
        fold_weights=rows.sum(-1)[..., 0],
        warn_unconverged=False,  # the projection is capped on purpose (README)
    )
    if out.diagnostics:
        log(f"    {out.diagnostics}")
    error, r2 = out.metrics["error"].mean(-1), out.metrics["r2"].mean(-1)
    log(
        f"{name:7s} {out.seconds:6.1f} s  error {error.mean():7.3f}  R2 {r2.mean():6.3f}"
        + (f"  chosen {out.chosen_labels}" if method.tuned else "")
    )
    return out


def _exact_references(batch: Batch, cfg: SyntheticConfig) -> dict[str, np.ndarray]:
    """Closed-form ridge fits (float64) per seed: per-client local and pooled global."""
    out = {"local_error": [], "global_error": []}
    final = batch.cv.final(batch.cv.train)
    for s in range(cfg.seeds):
        x, y, c = (np.asarray(a[s], np.float64) for a in final)
        H = np.einsum("nki,nkj->nij", x, x) / c[:, None, None] + cfg.lam * np.eye(cfg.dim)
        g = np.einsum("nki,nk->ni", x, y) / c[:, None]
        loc = np.linalg.solve(H, g[..., None])[..., 0]
        alpha = c / c.mean()
        glob = np.linalg.solve(np.tensordot(alpha, H, 1), alpha @ g)
        truth = batch.theta_true[s]
        out["local_error"].append(np.mean(np.sum((loc - truth) ** 2, -1)))
        out["global_error"].append(np.mean(np.sum((glob - truth) ** 2, -1)))
    return {k: np.asarray(v) for k, v in out.items()}


def _pm(values, digits: int = 3) -> str:
    return format_mean_se(*mean_and_se(values), digits=digits)


def run_experiment(cfg: SyntheticConfig, out, *, command: str, log=print) -> dict[str, Any]:
    """Runs every method; writes ``table.{md,csv}``, ``heatmaps.png``, ``config.json`` to ``out``.

    ``command`` is the command line quoted in the table's notes. Returns the summary dict.
    """
    t_start, cpu_start = time.perf_counter(), time.process_time()
    out.mkdir(parents=True, exist_ok=True)
    log(f"config: {dataclasses.asdict(cfg)}")
    batch = build_batch(cfg, log=log)
    if not batch.embedding_converged.all():
        log(f"warning: {int((~batch.embedding_converged).sum())} Sinkhorn solves did not converge")
    specs = methods(cfg, int(batch.cv.train.x.shape[2]))
    names = [m for m in METHODS + EXTRA if m in cfg.methods or m == "Karula"]
    grids = [f"{name}: {', '.join(specs[name].labels())}" for name in names if specs[name].tuned]
    log("CV grids: " + "; ".join(grids))
    results = {
        name: run_method(name, specs[name], batch, cfg, log=log)
        for name in progress_bar(names, desc="methods", unit="method")
    }
    if cfg.diagnostics:
        for name, D in zip(DIAGNOSTICS, (batch.D_true, batch.D_population), strict=True):
            results[name] = run_method(name, specs["Karula"], batch._replace(D=D), cfg, log=log)
    refs = _exact_references(batch, cfg)

    # Dissimilarity structure: truth vs Karula's D vs distances between Local models.
    D_full = np.asarray(batch.cv.final(batch.D))
    truth = [ev.pairwise_sq_distances(t) for t in batch.theta_true]
    local = [ev.pairwise_sq_distances(p) for p in results["Local"].metrics["theta"]]
    rho_D = np.asarray([ev.spearman_offdiag(t, d) for t, d in zip(truth, D_full, strict=True)])
    rho_loc = np.asarray([ev.spearman_offdiag(t, d) for t, d in zip(truth, local, strict=True)])
    plot_heatmaps(
        [truth[0], D_full[0], local[0]],
        [
            "true $\\|\\theta_i^* - \\theta_j^*\\|^2$",
            f"Karula's $D_{{ij}}$ (Spearman {rho_D[0]:.2f})",
            f"Local models $\\|\\theta_i - \\theta_j\\|^2$ (Spearman {rho_loc[0]:.2f})",
        ],
        out / "heatmaps.png",
        suptitle="Synthetic ridge, seed 0 (clients ordered by group)",
    )

    rows = []
    for name, r in results.items():
        c = r.chosen_labels
        chosen = ", ".join(f"{v} x{c.count(v)}" for v in sorted(set(c) - {""}))
        row = {"method": name, "cv_choice": chosen or "-"}
        error, r2 = r.metrics["error"].mean(-1), r.metrics["r2"].mean(-1)
        karula = results["Karula"].metrics["error"].mean(-1)
        paired_columns(row, "karula_minus", karula, error)
        rows.append(mean_se_columns(row, estimation_error=error, test_r2=r2))
    runtime, cpu = time.perf_counter() - t_start, time.process_time() - cpu_start
    diagnostics = cfg.diagnostics and (
        f"Diagnostics: Karula with D = the true ||theta_i* - theta_j*||^2, and with D from "
        f"{cfg.population_rows} fresh rows per client (Spearman with the truth "
        f"{_pm(batch.spearman_population)}); same t grid and CV."
    )
    notes = [
        f"{cfg.seeds} seeds, mean ± 2 SE over seeds; {cfg.rounds} rounds, "
        f"{cfg.clients_per_round} of {cfg.num_clients} clients per round, full gradients; "
        f"hyperparameters chosen by {cfg.num_folds}-fold CV per seed (how often each was chosen) "
        f"from the grids {'; '.join(grids)}.",
        f"Spearman correlation with the true ||theta_i* - theta_j*||^2: Karula's D "
        f"{_pm(rho_D)}, Local-model distances {_pm(rho_loc)} (paired difference "
        f"{format_mean_se(*paired_difference(rho_D, rho_loc), digits=3)}).",
        *([diagnostics] if diagnostics else []),
        f"Closed-form references: exact local ridge fits have estimation error "
        f"{_pm(refs['local_error'], 2)}, the exact pooled global fit "
        f"{_pm(refs['global_error'], 2)}.",
        f"Runtime {runtime:.0f} s wall, {cpu:.0f} s CPU (all threads). Command: `{command}`.",
    ]
    columns = [("method", "Method"), ("estimation_error", "Estimation error")]
    columns += [("test_r2", "Test R^2"), ("karula_minus", "Karula minus method (error, paired)")]
    columns += [("karula_minus_decided", "decided (> 2 SE)"), ("cv_choice", "CV choice")]
    table = write_table(
        rows,
        columns,
        csv_path=out / "table.csv",
        md_path=out / "table.md",
        title="Synthetic ridge regression (paper Table 1)",
        notes=notes,
        digits={"estimation_error": 2, "test_r2": 3, "karula_minus": 2},
    )
    summary = {
        "config": dataclasses.asdict(cfg),
        "runtime_s": runtime,
        "cpu_s": cpu,
        "devices": [str(d) for d in jax.devices()],
        "jax_version": jax.__version__,
        "spearman_D": rho_D,
        "spearman_local": rho_loc,
        "exact_local_error": refs["local_error"],
        "exact_global_error": refs["global_error"],
        "embedding_converged": bool(batch.embedding_converged.all()),
        "spearman_population_D": batch.spearman_population,
        "methods": {
            name: {
                "estimation_error": r.metrics["error"].mean(-1),
                "test_r2": r.metrics["r2"].mean(-1),
                "chosen": r.chosen_labels,
                "cv_validation_mse": r.cv_score,
                "grid": r.labels,
                "final_fit_error_per_grid_point": r.grid_metrics["error"].mean(-1),
                "all_rounds_finite": bool(r.finite.all()),
            }
            for name, r in results.items()
        },
    }
    write_json(summary, out / "config.json")
    log("\n" + table + "\n" + "\n".join(notes))
    return summary


SETTINGS: dict[str, dict[str, Any]] = {  # results/synthetic_sensitivity/README.md
    "default": {},
    "iid_features": {"feature_mean_std": 0.0, "feature_scale_range": (1.0, 1.0)},
    "group_features_0.3": {"group_feature_std": 0.3},
    "group_features_1": {"group_feature_std": 1.0},
    "overlapping_groups": {"theta_std": 0.5},
}


def run_sensitivity(base: SyntheticConfig, out, settings=SETTINGS) -> list[dict[str, Any]]:
    """Runs the protocol once per generator setting; writes ``out/summary.{csv,md}``."""
    rows = []
    for name, generator in settings.items():
        print(f"=== {name}: {generator}", flush=True)
        command = f"python -m experiments.synthetic_ridge --sensitivity ({name})"
        summary = run_experiment(
            dataclasses.replace(base, generator=dict(generator), methods=METHODS),
            out / name,
            command=command,
        )
        described = ", ".join(f"{k}={v}" for k, v in generator.items()) or "(defaults)"
        errors = {m: summary["methods"][m]["estimation_error"] for m in METHODS}
        row = {"setting": name, "generator": described}
        mean_se_columns(row, **errors, spearman_D=summary["spearman_D"])
        mean_se_columns(row, spearman_local=summary["spearman_local"])
        row["karula_t"] = ", ".join(sorted(set(summary["methods"]["Karula"]["chosen"])))
        rows.append(row)
    columns = [("setting", "Setting"), ("generator", "Generator keywords")]
    columns += [(m, m) for m in METHODS] + [("spearman_D", "Spearman D")]
    columns += [("spearman_local", "Spearman local"), ("karula_t", "Karula's t")]
    note = (
        f"{base.seeds} seeds per setting, mean ± 2 SE; protocol of results/synthetic/README.md "
        f"({base.num_folds}-fold CV, {base.rounds} rounds). Spearman: rank correlation with "
        "the true ||theta_i* - theta_j*||^2 of Karula's D and of the distances between Local "
        "models. Command: `python -m experiments.synthetic_ridge --sensitivity`."
    )
    write_table(
        rows,
        columns,
        csv_path=out / "summary.csv",
        md_path=out / "summary.md",
        title="Synthetic ridge: estimation error per generator setting",
        digits={m: 2 for m in METHODS},
        notes=[note],
    )
    return rows


def _generator_option(text: str) -> tuple[str, Any]:
    """Parses ``NAME=VALUE`` (``VALUE`` a number or comma-separated numbers)."""
    name, sep, value = text.partition("=")
    allowed = set(inspect.signature(synthetic_ridge).parameters) - {"seed", "num_clients", "dim"}
    if not sep or name not in allowed:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE with NAME in {sorted(allowed)}")
    try:
        numbers = tuple(float(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name}: expected numbers, got {value!r}") from None
    if name in ("min_samples", "max_samples", "num_test"):
        numbers = tuple(int(v) for v in numbers)
    return name, numbers if len(numbers) > 1 else numbers[0]


def main(argv: Sequence[str] | None = None):
    """Command-line entry point (see :class:`SyntheticConfig`)."""
    flags = list(sys.argv[1:] if argv is None else argv)
    cfg, args = cli(
        SyntheticConfig,
        flags,
        quick=quick_config,
        description=__doc__,
        out=None,
        generator=dict(
            action="append",
            default=[],
            metavar="NAME=VALUE",
            type=_generator_option,
            help="a keyword of karula_jax.data.synthetic_ridge (repeatable)",
        ),
        sensitivity=dict(action="store_true", help="the five generator settings (5 seeds)"),
    )
    cfg = dataclasses.replace(cfg, generator=dict(args.generator) or cfg.generator)
    if args.sensitivity and "--seeds" not in flags:
        cfg = dataclasses.replace(cfg, seeds=5)
    mode = "sensitivity" if args.sensitivity else "diagnostics" if cfg.diagnostics else ""
    out = args.out or RESULTS / "_".join(["synthetic", mode] if mode else ["synthetic"])
    if args.sensitivity:
        return run_sensitivity(cfg, out)
    if args.out is not None:  # the output folder is not part of what was run
        flags = [a for a in flags if a not in ("--out", str(args.out))]
    return run_experiment(
        cfg, out, command=" ".join(["python -m experiments.synthetic_ridge", *flags])
    )


if __name__ == "__main__":
    main(sys.argv[1:])
