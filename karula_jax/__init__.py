"""karula_jax: personalized federated learning with Wasserstein-constrained models.

Data flows one way: ``data`` -> ``embedding`` (dissimilarities D) -> ``projection`` /
``algorithms`` -> ``training`` (compiled runs) -> ``stats`` (mean +- 2 SE).
"""

from karula_jax import algorithms, data, embedding, models, projection, stats, training

__all__ = ["algorithms", "data", "embedding", "models", "projection", "stats", "training"]
__version__ = "0.1.0"
