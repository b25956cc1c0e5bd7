"""karula_jax: personalized federated learning with Wasserstein-constrained models.

Data flows one way: ``data`` -> ``embedding`` (dissimilarities D) -> ``projection`` /
``algorithms`` -> ``training`` (compiled runs) -> ``evaluation`` (CV, metrics) ->
``protocol`` (methods x grids x folds x seeds, selected by CV) -> ``stats`` (mean +- 2 SE).
"""

from karula_jax import (
    algorithms,
    data,
    embedding,
    evaluation,
    models,
    projection,
    protocol,
    stats,
    training,
)

__all__ = [
    "algorithms",
    "data",
    "embedding",
    "evaluation",
    "models",
    "projection",
    "protocol",
    "stats",
    "training",
]
__version__ = "0.1.0"
