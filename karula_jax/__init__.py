"""karula_jax: personalized federated learning with Wasserstein-constrained models.

Data flows one way: ``data`` -> ``embedding`` (dissimilarities D) -> ``projection`` /
``algorithms`` -> ``training`` (compiled runs) -> metrics.
"""

from karula_jax import data, embedding, models

__all__ = ["data", "embedding", "models"]
__version__ = "0.1.0"
