"""karula_jax: personalized federated learning with Wasserstein-constrained models.

Data flows one way: ``data`` -> ``embedding`` (dissimilarities D) -> ``projection`` /
``algorithms`` -> ``training`` (compiled runs) -> ``evaluation`` (CV, metrics) ->
``protocol`` (methods x grids x folds x seeds, selected by CV) -> ``stats`` (mean +- 2 SE)
-> ``reporting`` (tables, JSON, figures), ``provenance`` (a run's date, commit and machine,
stamped on its results page); ``theory`` holds the quantities of the paper's
convergence theory, ``benchmarking`` what the benchmarks share. Every public submodule is
reachable as an attribute after ``import karula_jax``.
"""

from karula_jax import (
    algorithms,
    benchmarking,
    data,
    embedding,
    evaluation,
    models,
    projection,
    protocol,
    provenance,
    reporting,
    stats,
    theory,
    training,
)

__all__ = [
    "algorithms",
    "benchmarking",
    "data",
    "embedding",
    "evaluation",
    "models",
    "projection",
    "protocol",
    "provenance",
    "reporting",
    "stats",
    "theory",
    "training",
]
__version__ = "0.1.0"
