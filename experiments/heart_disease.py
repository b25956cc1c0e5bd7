"""UCI Heart Disease: four hospitals as four clients, logistic regression.

Seed ``s`` is train/test split ``s``; every method is cross-validated per seed on its
training rows (:func:`karula_jax.protocol.logistic_study`, run by
:func:`~karula_jax.protocol.run_study`). Protocol and findings:
``results/heart_disease/README.md``.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from experiments.paths import DATA_DIR, OUTPUT
from karula_jax import protocol, reporting, training
from karula_jax.data import load_heart_disease
from karula_jax.data.heart_disease import HOSPITALS

__all__ = ["METHODS", "Config", "band_note", "main", "run_experiment", "test_train_ratio"]

# The eleven methods, and FedPer: FedAvg on Karula's mask, here the whole logistic model,
# so FedPer is each hospital's own model on FedAvg's schedule (Karula at t = inf).
METHODS = protocol.tagged("paper", "baseline", "uses-D") + ("FedPer",)


@dataclasses.dataclass(frozen=True)
class Config:
    """One heart-disease run.

    Command: ``python -m experiments.heart_disease [--data-dir PATH] [--seeds S] [--rounds R]
    [--quick] [--out DIR]`` writes ``runs/heart_disease/``
    (``--out results/heart_disease`` refreshes the committed page).

    Expected (10 splits, mean per-hospital test accuracy): FedPer 0.836, Local 0.835, Ditto
    0.822, Clustered FedAvg on D 0.819, Karula 0.818 (t = 0.131 chosen by CV in 7 splits,
    0.638 in 3), pFedMe 0.807, IFCA 0.806, FedSGD 0.798, FedAvg 0.797. Runtime: 45-80 s on
    2 cores.

    Attributes:
      data_dir: folder with the four ``processed.*.data`` files.
      seeds, rounds, clients_per_round: splits, rounds, hospitals per round (of 4).
      test_fraction: held-out fraction of each hospital (per class).
      lam, local_steps: the logistic loss's L2 penalty; local steps of the FedAvg family.
      ifca_clusters, pfedme_lam, pfedme_inner: IFCA's clusters, pFedMe's lambda and steps.
      folds: cross-validation folds.
      grids: ``{method name: CV grid}`` (``--grid NAME=V1,V2``): Karula's t (empty: from
        the data, see :func:`karula_jax.protocol.logistic_t_grid`), Ditto's lambda,
        FedProx's mu, the penalty's mu / L_f and the clustered FedAvg's k (spectral
        clusters of D); a method without an entry takes its registry row's grid.
      methods: which of ``METHODS`` to run (Karula always runs: the paired reference).
      num_reference, epsilon: reference points and Sinkhorn epsilon of the embedding.
    """

    data_dir: str = str(DATA_DIR / "heart_disease")
    seeds: int = 10
    rounds: int = 500
    clients_per_round: int = 2
    test_fraction: float = 0.25
    lam: float = 1e-3
    local_steps: int = 5
    ifca_clusters: int = 2
    pfedme_lam: float = 15.0
    pfedme_inner: int = 10
    folds: int = 3
    # {method: CV grid}; Karula's () is drawn from the data (protocol.logistic_t_grid: 0,
    # five points from where 90% of the pairs of the hospitals' own models bind to where
    # none does, inf). FedProx's mu widened (10 was chosen in 10 of 10 splits), then down
    # to its natural limit mu = 0 (FedAvg at FedProx's step); k up to 4: one per hospital
    # (a natural limit too). Methods without an entry run their registry row's grid.
    grids: Mapping[str, tuple] = dataclasses.field(
        default_factory=lambda: {
            "Karula": (),
            "Ditto": (0.01, 0.1, 1.0, 10.0),
            "FedProx": (0.0, 0.01, 0.1, 1.0, 10.0, 100.0, 1000.0),
            "Laplacian penalty on D": (1e-3, 1e-2, 0.1, 1.0, 10.0),
            "Clustered FedAvg on D": (1, 2, 3, 4),
        }
    )
    methods: tuple[str, ...] = METHODS
    num_reference: int = 100
    epsilon: float = 0.05


def quick_config(cfg: Config) -> Config:
    """A small version of ``cfg`` for tests."""
    grids = {"Karula": (), "Ditto": (0.1, 1.0), "FedProx": (0.1,)}  # Karula's: from the data
    grids |= {"Laplacian penalty on D": (0.1, 10.0), "Clustered FedAvg on D": (1, 2)}
    quick = tuple(m for m in METHODS[:6] if m != "FedSGD")  # FedSGD: unit tests
    small = dict(seeds=2, rounds=100, folds=2, num_reference=20, grids=dict(cfg.grids) | grids)
    return dataclasses.replace(cfg, methods=quick + ("FedProx", "Laplacian penalty on D"), **small)


def study(cfg: Config) -> protocol.Study:
    """The study: split ``s`` of the four hospitals per seed; steps as in the README."""

    def draw(seed: int) -> protocol.Draw:
        split = load_heart_disease(cfg.data_dir, test_fraction=cfg.test_fraction, seed=seed)
        return protocol.Draw(split.train, split.test)

    rates = protocol.smoothness_rates(
        karula=0.375, fedavg=0.1, ifca=0.5, personal=0.5, num_clients=4
    )
    rates["pfedme"] = lambda lam, **_: 0.5 / lam
    grids = {"IFCA": cfg.ifca_clusters, "pFedMe": cfg.pfedme_lam} | dict(cfg.grids)
    grids["Karula"] = grids.get("Karula") or None  # empty: from the data
    # D: fold f of seed s embeds with key fold_in(k_s, f + 1), the final fit with k_s
    K, seed_keys = cfg.folds, jax.random.split(jax.random.key(123), cfg.seeds)
    member = lambda k, f: jnp.where(f < K, jax.random.fold_in(k, f + 1), k)
    embed_keys = jax.vmap(lambda k: jax.vmap(lambda f: member(k, f))(jnp.arange(K + 1)))
    return protocol.logistic_study(
        draw,
        cfg,
        title="Heart disease (UCI, 4 hospitals)",
        seeds=cfg.seeds,
        num_folds=K,
        num_rounds=cfg.rounds,
        lam=cfg.lam,
        methods=cfg.methods,
        clients_per_round=cfg.clients_per_round,
        local_steps=cfg.local_steps,
        grids=grids,
        options={"pFedMe": dict(inner_steps=cfg.pfedme_inner), "FedPer": dict(personalized=True)},
        rates=rates,
        embed=dict(num_reference=cfg.num_reference, epsilon=cfg.epsilon),
        client="hospital",
        client_names=HOSPITALS,
        embed_keys=embed_keys(seed_keys).reshape(-1),
        cluster_grid=protocol.grid_of("Clustered FedAvg on D", cfg.grids),
        report=lambda result: protocol.Report(
            notes(cfg, result), {"D_seed0": np.asarray(result.data.D[0])}
        ),
        test_train_ratio=lambda data: test_train_ratio(
            data.cv.final(data.cv.train), data.cv.final(data.cv.evals)
        ),
    )


def test_train_ratio(train, test) -> float:
    """``n_test / n_train``: all test rows over all training rows (``ClientData`` of one
    split, or ``[S, n]`` stacked splits), the ratio of the corrected variance
    (:func:`karula_jax.stats.t_interval`). Every split holds the same counts (the test
    fraction is taken per hospital and class)."""
    return float(np.sum(np.asarray(test.counts)) / np.sum(np.asarray(train.counts)))


def band_note(seeds: int, ratio: float) -> str:
    """What ± and "decided" mean in the table, for ``seeds`` splits at ``n_test / n_train
    = ratio``."""
    return (
        f"± is the 95% Student-t interval over the {seeds} splits with Nadeau and Bengio's "
        f"corrected variance (factor 1/{seeds} + n_test/n_train = 1/{seeds} + {ratio:.3f} "
        "instead of 1/S: the splits reuse the same rows, so their results are correlated); "
        "'decided': the corrected paired t-test's p-value, Holm-adjusted over the table's "
        "comparisons with Karula, is below 0.05."
    )


def notes(cfg: Config, result: protocol.StudyResult) -> list[str]:
    cv = result.data.cv
    ratio = test_train_ratio(cv.final(cv.train), cv.final(cv.evals))
    return [
        f"{cfg.seeds} seeds, seed s = train/test split s (25% of each hospital per class held "
        f"out); {band_note(cfg.seeds, ratio)} Logistic regression, lam = {cfg.lam:g}, "
        f"{cfg.clients_per_round} of 4 hospitals per round, full gradients, {cfg.rounds} "
        f"rounds. Hyperparameters by {cfg.folds}-fold CV per seed on the mean validation "
        f"log-loss (how often each was chosen) from the grids "
        f"{protocol.describe_grids(result.methods)}.",
        "Runtime: wall clock of all seeds' runs of the method (CV folds and final fits), "
        "compilation included.",
        "Log-loss: mean over hospitals of the mean cross-entropy of the hospital's model on its "
        "test rows (the quantity Karula's CV minimizes on validation folds). Per-hospital "
        "columns: accuracy.",
        "Paper (commented-out table, test accuracy): Local 0.658, FedSGD 0.685, FedAvg 0.669, "
        "pFedMe 0.658, Karula 0.705.",
    ]


def run_experiment(cfg: Config, out: pathlib.Path) -> dict:
    """Cross-validates every method; writes table.{md,csv} and summary.json to ``out``."""
    return protocol.run_study(study(cfg), out).summary


def main(argv=None) -> dict:
    """Command-line entry point (see :class:`Config`); returns the summary."""
    cfg, args = reporting.cli(
        Config, argv, quick=quick_config, description=__doc__, out=OUTPUT / "heart_disease"
    )
    return run_experiment(cfg, args.out)


if __name__ == "__main__":
    training.use_cpu_cores()  # one CPU device per core: the runs split over them
    main()
