"""Synthetic ridge regression: the paper's Table 1 and Figure 1 (section 5.1).

Every CV fold and final fit of every seed gets its own D and step sizes; each method is
cross-validated per seed (:func:`karula_jax.protocol.cross_validate`). Protocol and
findings: ``results/synthetic/README.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from experiments.paths import OUTPUT
from karula_jax import evaluation as ev
from karula_jax import protocol, reporting, training
from karula_jax.data import ClientData, synthetic_ridge
from karula_jax.models import ridge_loss
from karula_jax.stats import format_mean_se, paired_test, t_interval

__all__ = ["SyntheticConfig", "main", "run_experiment", "run_sensitivity", "study"]

# The paper's methods; baselines beyond it, the two other uses of Karula's D, and Karula
# at Theorem 4.3's step 3 / (8 L_max).
METHODS = protocol.tagged("paper")
EXTRA = protocol.tagged("baseline", "uses-D") + ("Karula (theorem step)",)
# Karula with dissimilarities no federated method has, and with the paper's own entrywise
# L1 formula for D (results/synthetic/README.md).
DIAGNOSTICS = (
    "Karula, true D (diagnostic)",
    "Karula, population D (diagnostic)",
    "Karula, paper's L1 D (diagnostic)",
)


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
    """One run of the synthetic study.

    Command: ``python -m experiments.synthetic_ridge`` (writes ``runs/synthetic/``;
    ``--out results/synthetic`` refreshes the committed page);
    ``--quick`` (smoke run, < 60 s), ``--diagnostics`` (also Karula on the true D, on a
    population D and on the paper's entrywise-L1 D; writes ``runs/synthetic_diagnostics/``),
    ``--seeds S``, ``--out DIR``,
    ``--generator NAME=VALUE`` (a keyword of :func:`karula_jax.data.synthetic_ridge`).

    Expected (10 seeds, estimation error / test R^2, mean over seeds): Local 22.6 / 0.800,
    FedSGD 9.2 / 0.876, FedAvg 9.2 / 0.876, IFCA 3.9 / 0.963 (k = 3..30), pFedMe 3.4 / 0.952,
    Karula 5.8 / 0.925 (t = 4..16), FedProx 9.2, SCAFFOLD 9.2, Ditto 2.4 / 0.966, Laplacian
    penalty on D 7.3, clustered FedAvg on D 2.9 / 0.969, Karula at the theorem's step 23.5 /
    0.845 (t = 0). Runtime: 3-5 minutes on a quiet 2-core machine (``--diagnostics`` adds
    three Karula runs).

    Attributes:
      seeds: seeds 0..seeds-1 (data draw and training randomness).
      num_clients, dim, lam: n, d and the ridge penalty.
      clients_per_round, num_folds, rounds: of every method but Local (all clients).
      local_steps, pfedme_inner_steps: of the FedAvg family; pFedMe's proximal steps.
      rate_karula, rate_fedavg, rate_ifca, rate_pfedme: step = rate / L
        (:func:`karula_jax.protocol.smoothness_rates`).
      projection_tol, projection_max_iter: stopping rule of Karula's projection per round
        (the cap is the library's default: every round's projection is meant to converge).
      grids: ``{method name: CV grid}`` (``--grid NAME=V1,V2``): Karula's t (``"Karula
        (theorem step)"``: at the theorem's step; the diagnostic rows take Karula's),
        IFCA's k, pFedMe's and Ditto's lambda, FedProx's mu, the penalty's mu / L_f and
        the clustered FedAvg's k (spectral clusters of D); a method without an entry takes
        its registry row's grid.
      num_reference, epsilon: reference points and Sinkhorn epsilon of the embedding.
      noise_std, generator: the generator's response noise (None: its default) and further
        keywords (:func:`karula_jax.data.synthetic_ridge`).
      normalize_D: divide every data set's D by its mean off-diagonal entry.
      diagnostics: also train Karula on the true D, on a population D and on the paper's
        entrywise-L1 D (``norm="l1"``).
      methods: which of ``METHODS + EXTRA`` to run (Karula, the paired reference, and Local,
        whose models' distances the notes compare with D, always run).
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
    projection_max_iter: int = 1000
    # {method: CV grid}. Karula at the theorem's step chose t = 2, the edge of Karula's
    # grid, in 10 of 10 seeds: its grid reaches down to the natural limit t = 0 (every
    # model equal). Widened where CV chose an edge in more than a third of the seeds:
    # pFedMe's lambda was 0.01 and FedProx's mu 10 in 10 of 10 seeds, the clustered
    # FedAvg's k = 5 in 4 of 10, IFCA's k = 5 in 2 of 10; then IFCA's k = 8 in 4 of 10.
    # pFedMe's lambda reaches down to where its CV score stops moving (its lambda -> 0
    # limit under the envelope step rule; a choice there is reported as a plateau, not an
    # edge). Then IFCA's k = 12 in 2 of 10 and the clustered FedAvg's k = 8 in 1 of 10:
    # IFCA's k reaches the number of clients (its natural limit: no more groups than
    # clients), the clustered FedAvg's k 12 (it chose at most 8 from a grid to 15).
    # Methods without an entry run their registry row's grid.
    grids: Mapping[str, tuple] = dataclasses.field(
        default_factory=lambda: {
            "Karula": (2.0, 4.0, 8.0, 16.0, 32.0),
            "Karula (theorem step)": (0.0, 0.5, 1.0, 2.0, 4.0, 8.0),
            "IFCA": (1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 30),
            "pFedMe": tuple(float(x) for x in np.geomspace(1e-6, 1.0, 7)),
            "Ditto": (0.01, 0.1, 1.0, 10.0),
            "FedProx": (0.01, 0.1, 1.0, 10.0, 100.0, 1000.0),
            "Laplacian penalty on D": (1e-3, 1e-2, 0.1, 1.0, 10.0),
            "Clustered FedAvg on D": (1, 2, 3, 4, 5, 6, 8, 10, 12),
        }
    )
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
        for k, v in self.grids.items():
            t = k.startswith("Karula")  # t = 0: a natural limit
            low = "nonnegative" if t else "positive"
            bad += [f"grids[{k!r}] must be a non-empty tuple of {low} values"] * (
                not v or min(v) < 0 or (min(v) == 0 and not t)
            )
        if bad:
            raise ValueError("; ".join(bad))


def quick_config(cfg: SyntheticConfig | None = None) -> SyntheticConfig:
    """A smoke-test version of ``cfg``: 2 seeds, few rounds and grid points (about 60 s)."""
    small = dict(num_folds=2, rounds=30, num_reference=20, population_rows=200)
    # IFCA runs in the heart study's quick run and its unit tests (a shorter smoke run)
    quick = tuple(m for m in METHODS if m != "IFCA")
    cfg = cfg or SyntheticConfig()
    grids = dict(cfg.grids) | {"Karula": (3.0, 30.0), "IFCA": (1, 2), "pFedMe": (0.3, 3.0)}
    return dataclasses.replace(cfg, seeds=2, grids=grids, methods=quick, **small)


# The diagnostics' member arguments: Karula's row reading each instead of D.
_DIAGNOSTIC_D = dict(zip(DIAGNOSTICS, ("D_true", "D_population", "D_l1"), strict=True))


def diagnostic_dissimilarities(cfg: SyntheticConfig, data: protocol.StudyData) -> dict:
    """The diagnostics' D per member, ``{"D_true", "D_population", "D_l1": [B, n, n]}``
    (mean-normalized with ``cfg.normalize_D``): the true ``||theta_i* - theta_j*||^2``, D
    from ``cfg.population_rows`` fresh rows per client (the generator draws training rows
    before test rows, so only the test rows grow: the same clients), and D with the paper's
    entrywise L1 norm of the scaled maps (``norm="l1"``)."""
    cv, embed = data.cv, dict(num_reference=cfg.num_reference, epsilon=cfg.epsilon)
    truth = np.stack([ev.pairwise_sq_distances(t) for t, _ in data.extras])
    pops = protocol.stack_datasets([pop for _, pop in data.extras])
    D_pop, info = protocol.member_dissimilarities(pops, cv.final(data.embed_keys), **embed)
    if not np.all(info.converged):
        warnings.warn("the population D's transport problems did not all converge", stacklevel=2)
    D_l1, _ = protocol.member_dissimilarities(cv.train, data.embed_keys, norm="l1", **embed)
    out = dict(
        D_true=cv.per_member(jnp.asarray(truth, jnp.float32)),
        D_population=cv.per_member(D_pop),
        D_l1=D_l1,
    )
    return {k: protocol.mean_normalized(v) if cfg.normalize_D else v for k, v in out.items()}


# The configuration fields that shape the methods (not the data draw, folds or rounds).
_METHOD_FIELDS = (
    "rate_karula", "rate_fedavg", "rate_ifca", "rate_pfedme", "num_clients", "lam",
    "clients_per_round", "local_steps", "pfedme_inner_steps", "projection_tol",
    "projection_max_iter", "grids", "methods", "diagnostics",
)  # fmt: skip


def methods(cfg: SyntheticConfig, n_max: int) -> dict[str, protocol.Method]:
    """The methods ``cfg`` runs (Local always: the notes compare its models' distances
    with D), with the step sizes of ``results/synthetic/README.md``: the same objects for
    configurations equal in :data:`_METHOD_FIELDS`, so that another run (a sensitivity
    setting) reuses their compiled programs."""
    fields = {k: getattr(cfg, k) for k in _METHOD_FIELDS}
    fields["grids"] = tuple((k, tuple(v)) for k, v in cfg.grids.items())  # hashable
    return dict(_methods(n_max, **fields))


@functools.lru_cache(maxsize=8)
def _methods(n_max: int, **fields) -> dict[str, protocol.Method]:
    cfg = types.SimpleNamespace(**fields)
    rates = dict(karula=cfg.rate_karula, fedavg=cfg.rate_fedavg, ifca=cfg.rate_ifca)
    rates = protocol.smoothness_rates(
        **rates,
        personal=cfg.rate_pfedme,
        num_clients=cfg.num_clients,
        clients_per_round=cfg.clients_per_round,  # the penalty's own rule
    )
    grids = dict(cfg.grids)
    projection = dict(
        projection_tol=cfg.projection_tol, projection_max_iter=cfg.projection_max_iter
    )
    options = {
        "Local": dict(clients_per_round=None),  # every client every round
        "pFedMe": dict(inner_steps=cfg.pfedme_inner_steps),
        "Karula": projection,
        "Karula (theorem step)": projection,
    }
    # Karula's row on another D, with its grid and projection
    karula = protocol.REGISTRY["Karula"]
    rows = {n: karula._replace(name=n, members={"D": k}) for n, k in _DIAGNOSTIC_D.items()}
    names = protocol.selected(cfg.methods, METHODS + EXTRA)
    names = (names if "Local" in names else ["Local", *names]) + list(rows) * cfg.diagnostics
    return protocol.build_methods(
        names,
        loss=ridge_loss(cfg.lam),
        rates=rates,
        grids=grids | dict.fromkeys(rows, protocol.grid_of("Karula", grids)),
        options=options | dict.fromkeys(rows, projection),
        registry=protocol.REGISTRY | rows,
        num_clients=cfg.num_clients,  # k >= n groups: a natural limit (IFCA, clustered)
        clients_per_round=cfg.clients_per_round,
        batch_size=n_max,
        local_steps=cfg.local_steps,
    )


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


def _options(cfg: SyntheticConfig, data: protocol.StudyData) -> dict[str, Any]:
    """CV on the pooled validation MSE (squared errors of all clients / their rows), the
    folds weighted by their rows; the truth beside every member's evaluation rows."""
    cv, K = data.cv, cfg.num_folds
    rows = np.asarray(cv.evals.counts, np.float64).reshape(cfg.seeds, K + 1, 1, -1)[:, :K]
    theta_true = np.stack([t for t, _ in data.extras])
    return dict(
        eval_data=(cv.evals, cv.per_member(theta_true)),
        score=lambda m: np.sum(m["mse"] * rows, -1) / rows.sum(-1),
        fold_weights=rows.sum(-1)[..., 0],
        describe=lambda o: (
            f"error {o.metrics['error'].mean():7.3f}  R2 {o.metrics['r2'].mean():6.3f}"
        ),
    )


def _exact_references(cfg: SyntheticConfig, data: protocol.StudyData) -> dict[str, np.ndarray]:
    """Estimation errors of the closed-form local and pooled ridge fits, per seed."""
    out, final = {"local_error": [], "global_error": []}, data.cv.final(data.cv.train)
    for s, (truth, _) in enumerate(data.extras):
        fits = ev.ridge_solutions(ClientData(*(a[s] for a in final)), cfg.lam)
        for key, theta in zip(out, fits, strict=True):
            out[key].append(np.mean(np.sum((theta - truth) ** 2, -1)))
    return {k: np.asarray(v) for k, v in out.items()}


def _pm(values, digits: int = 3) -> str:
    """``mean ± 95% t half-width`` of per-seed values."""
    return format_mean_se(*t_interval(np.asarray(values, float)), digits=digits)


def table_notes(cfg: SyntheticConfig, grids: str, summary) -> list[str]:
    """The notes of the study's table: ``grids`` (the CV grids, as
    :func:`~karula_jax.protocol.describe_grids` writes them) and the per-seed values of
    ``summary`` (``spearman_D``, ``spearman_local``, ``spearman_population_D``,
    ``exact_local_error``, ``exact_global_error``, as the JSON summary holds them)."""
    rho = {k: summary[k] for k in ("spearman_D", "spearman_local")}
    diff = paired_test(np.asarray(rho["spearman_D"]), np.asarray(rho["spearman_local"]))
    diagnostics = (
        [
            f"Diagnostics: Karula with D = the true ||theta_i* - theta_j*||^2, and with D from "
            f"{cfg.population_rows} fresh rows per client (Spearman with the truth "
            f"{_pm(summary['spearman_population_D'])}), and with the paper's own formula for D "
            f"(entrywise L1 norm of the scaled maps, norm='l1'); same t grid and CV."
        ]
        if cfg.diagnostics
        else []
    )
    return [
        f"{cfg.seeds} seeds, mean ± the 95% Student-t interval over seeds; 'decided': the "
        "paired t-test's p-value of Karula minus method, Holm-adjusted over the table's "
        f"comparisons, is below 0.05. {cfg.rounds} rounds, "
        f"{cfg.clients_per_round} of {cfg.num_clients} clients per round, full gradients; "
        f"hyperparameters chosen by {cfg.num_folds}-fold CV per seed (how often each was "
        f"chosen) from the grids {grids}.",
        f"Spearman correlation with the true ||theta_i* - theta_j*||^2: Karula's D "
        f"{_pm(rho['spearman_D'])}, Local-model distances {_pm(rho['spearman_local'])} "
        f"(paired difference {format_mean_se(diff.diff, diff.half_width, digits=3)}, "
        f"p = {float(diff.p_value):.2g}).",
        *diagnostics,
        f"Closed-form references: exact local ridge fits have estimation error "
        f"{_pm(summary['exact_local_error'], 2)}, the exact pooled global fit "
        f"{_pm(summary['exact_global_error'], 2)}.",
        f"Karula's projections stop within {cfg.projection_tol:g} of S (certified gap), "
        f"at most {cfg.projection_max_iter} iterations.",
    ]


class _Structure(NamedTuple):
    """Seed 0's matrices and every seed's Spearman correlations with the truth."""

    truth: list  # [S] true ||theta_i* - theta_j*||^2
    D: np.ndarray  # [S, n, n] the final fits' D
    local: list  # [S] distances between the Local models
    rho_D: np.ndarray  # [S]
    rho_local: np.ndarray  # [S]
    rho_population: np.ndarray | None  # [S], with the diagnostics


def _structure(result: protocol.StudyResult) -> _Structure:
    """Dissimilarity structure: truth vs Karula's D vs distances between Local models."""
    cv, extras = result.data.cv, result.data.extras
    truth = [ev.pairwise_sq_distances(t) for t, _ in extras]
    D = np.asarray(cv.final(result.data.D))
    local = [ev.pairwise_sq_distances(p) for p in result.outcomes["Local"].metrics["theta"]]
    rho = lambda Ds: np.asarray([ev.spearman_offdiag(t, d) for t, d in zip(truth, Ds, strict=True)])
    pop = result.member_kwargs.get("D_population")
    return _Structure(
        truth, D, local, rho(D), rho(local), None if pop is None else rho(np.asarray(cv.final(pop)))
    )


def study(cfg: SyntheticConfig, *, command: str) -> protocol.Study:
    """The study of ``cfg``; ``command`` is the command line quoted in the table's notes."""
    gen = dict(cfg.generator, num_clients=cfg.num_clients, dim=cfg.dim)
    gen |= {} if cfg.noise_std is None else {"noise_std": cfg.noise_std}

    def draw(seed: int) -> protocol.Draw:  # extras: the truth, the population's rows
        d, pop = synthetic_ridge(seed, **gen), None
        if cfg.diagnostics:
            pop = synthetic_ridge(seed, **gen, num_test=cfg.population_rows).test
        return protocol.Draw(d.train, d.test, (np.asarray(d.theta_true), pop))

    def member_kwargs(data):
        L = protocol.smoothness_constants(data.cv.train, cfg.lam)
        more = diagnostic_dissimilarities(cfg, data) if cfg.diagnostics else {}
        return dict(L_f=L[0], L_max=L[1]) | more

    def report(result) -> protocol.Report:
        st, refs = _structure(result), _exact_references(cfg, result.data)
        summary = {
            "spearman_D": st.rho_D,
            "spearman_local": st.rho_local,
            "spearman_population_D": st.rho_population,
            "exact_local_error": refs["local_error"],
            "exact_global_error": refs["global_error"],
        }
        heatmaps = functools.partial(
            reporting.plot_heatmaps,
            [st.truth[0], st.D[0], st.local[0]],
            [
                "true $\\|\\theta_i^* - \\theta_j^*\\|^2$",
                f"Karula's $D_{{ij}}$ (Spearman {st.rho_D[0]:.2f})",
                f"Local models $\\|\\theta_i - \\theta_j\\|^2$ (Spearman {st.rho_local[0]:.2f})",
            ],
            suptitle="Synthetic ridge, seed 0 (clients ordered by group)",
        )
        notes = table_notes(cfg, protocol.describe_grids(result.methods), summary)
        return protocol.Report(notes, summary, {"heatmaps.png": heatmaps})

    b = reporting.banded
    columns = [("method", "Method"), ("estimation_error", b("Estimation error"))]
    columns += [("test_r2", b("Test R^2"))]
    columns += [("karula_minus", b("Karula minus method (error, paired)"))]
    columns += reporting.verdict_columns("karula_minus") + [("cv_choice", "CV choice")]
    return protocol.Study(
        title="Synthetic ridge regression (paper Table 1)",
        config=cfg,
        draw=draw,
        seeds=cfg.seeds,
        num_folds=cfg.num_folds,
        num_rounds=cfg.rounds,
        methods=lambda data: methods(cfg, int(data.cv.train.x.shape[2])),
        params=jnp.zeros((cfg.dim,), jnp.float32),
        eval_fn=_metrics,
        score=None,  # _options
        values=lambda _, o, __: {
            "estimation_error": o.metrics["error"].mean(-1),
            "test_r2": o.metrics["r2"].mean(-1),
        },
        paired="estimation_error",
        columns=columns,
        embed=dict(num_reference=cfg.num_reference, epsilon=cfg.epsilon),
        member_kwargs=member_kwargs,
        keys=jax.vmap(jax.random.key)(jnp.arange(cfg.seeds)),
        cluster_grid=protocol.grid_of("Clustered FedAvg on D", cfg.grids),
        normalize_D=cfg.normalize_D,
        report=report,
        digits={"estimation_error": 2, "test_r2": 3, "karula_minus": 2},
        options=functools.partial(_options, cfg),
        command=command,
    )


def run_experiment(cfg: SyntheticConfig, out, *, command: str, log=print) -> dict[str, Any]:
    """Runs every method; writes ``table.{md,csv}``, ``heatmaps.png``, ``summary.json`` to ``out``.

    ``command`` is the command line quoted in the table's notes. Returns the summary dict.
    """
    log(f"config: {dataclasses.asdict(cfg)}")
    return protocol.run_study(study(cfg, command=command), out, log=log).summary


SETTINGS: dict[str, dict[str, Any]] = {  # results/synthetic_sensitivity/README.md
    "default": {},
    "iid_features": {"feature_mean_std": 0.0, "feature_scale_range": (1.0, 1.0)},
    "group_features_0.3": {"group_feature_std": 0.3},
    "group_features_1": {"group_feature_std": 1.0},
    "overlapping_groups": {"theta_std": 0.5},
}


def run_sensitivity(
    base: SyntheticConfig, out, settings=SETTINGS, *, command: str = "--sensitivity"
) -> list[dict[str, Any]]:
    """Runs the protocol once per generator setting; writes ``out/summary.{csv,md}``
    (:func:`sensitivity_table`); ``command``: the flags quoted in the notes."""
    summaries = {}
    for name, generator in settings.items():
        print(f"=== {name}: {generator}", flush=True)
        setting = f"python -m experiments.synthetic_ridge {command} ({name})"
        cfg = dataclasses.replace(base, generator=dict(generator), methods=METHODS)
        summaries[name] = run_experiment(cfg, out / name, command=setting)
    return sensitivity_table(base, summaries, out, settings=settings, command=command)


def sensitivity_table(
    base: SyntheticConfig, summaries, out, *, settings=SETTINGS, command: str = "--sensitivity"
) -> list[dict[str, Any]]:
    """The sensitivity table from each setting's JSON summary (``{name: summary}``, with
    ``per_seed`` and ``chosen``): per method the mean estimation error ± its 95% t
    half-width; writes ``out/summary.{csv,md}`` and returns the rows."""
    rows = []
    for name, summary in summaries.items():
        generator = settings[name]
        described = ", ".join(f"{k}={v}" for k, v in generator.items()) or "(defaults)"
        row = {m: summary["per_seed"][m]["estimation_error"] for m in METHODS}
        row |= {k: summary[k] for k in ("spearman_D", "spearman_local")}
        row = reporting.mean_se_columns({"setting": name, "generator": described}, **row)
        row["karula_t"] = ", ".join(sorted(set(summary["chosen"]["Karula"])))
        rows.append(row)
    b = reporting.banded
    columns = [("setting", "Setting"), ("generator", "Generator keywords")]
    columns += [(m, b(m)) for m in METHODS] + [("spearman_D", b("Spearman D"))]
    columns += [("spearman_local", b("Spearman local")), ("karula_t", "Karula's t")]
    note = (
        f"{base.seeds} seeds per setting, mean ± the 95% Student-t interval over seeds; "
        f"protocol of results/synthetic/README.md "
        f"({base.num_folds}-fold CV, {base.rounds} rounds). Spearman: rank correlation with "
        "the true ||theta_i* - theta_j*||^2 of Karula's D and of the distances between Local "
        f"models. Command: `python -m experiments.synthetic_ridge {command}`."
    )
    title = "Synthetic ridge: estimation error per generator setting"
    reporting.write_table(
        rows, columns, out / "summary", title=title, notes=[note], digits=dict.fromkeys(METHODS, 2)
    )
    return rows


def main(argv: Sequence[str] | None = None):
    """Command-line entry point (see :class:`SyntheticConfig`)."""
    flags = list(sys.argv[1:] if argv is None else argv)
    cfg, args = reporting.cli(
        SyntheticConfig,
        flags,
        quick=quick_config,
        description=__doc__,
        out=None,
        generator=dict(
            action="append",
            default=[],
            metavar="NAME=VALUE",
            type=reporting.keyword_option(synthetic_ridge, exclude=("seed", "num_clients", "dim")),
            help="a keyword of karula_jax.data.synthetic_ridge (repeatable)",
        ),
        sensitivity=dict(action="store_true", help="the five generator settings (5 seeds)"),
    )
    cfg = dataclasses.replace(cfg, generator=dict(args.generator) or cfg.generator)
    if args.sensitivity and "--seeds" not in flags:
        cfg = dataclasses.replace(cfg, seeds=5)
    mode = "sensitivity" if args.sensitivity else "diagnostics" if cfg.diagnostics else ""
    out = args.out or OUTPUT / "_".join(["synthetic", mode] if mode else ["synthetic"])
    if args.out is not None:  # the output folder is not part of what was run
        flags = [a for a in flags if a not in ("--out", str(args.out))]
    if args.sensitivity:
        return run_sensitivity(cfg, out, command=" ".join(flags))
    return run_experiment(
        cfg, out, command=" ".join(["python -m experiments.synthetic_ridge", *flags])
    )


if __name__ == "__main__":
    training.use_cpu_cores()  # one CPU device per core: the runs split over them
    main(sys.argv[1:])
