"""Client data: padded containers, synthetic generators and real-data loaders."""

from karula_jax.data.clients import ClientData, client_weights, from_client_arrays
from karula_jax.data.heart_disease import HeartDiseaseData, load_heart_disease
from karula_jax.data.leaf import LeafData, load_leaf
from karula_jax.data.random_clients import random_classification
from karula_jax.data.synthetic import SyntheticRidge, synthetic_ridge

__all__ = [
    "ClientData",
    "HeartDiseaseData",
    "LeafData",
    "SyntheticRidge",
    "client_weights",
    "from_client_arrays",
    "load_heart_disease",
    "load_leaf",
    "random_classification",
    "synthetic_ridge",
]
