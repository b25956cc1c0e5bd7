"""Client data: padded containers, synthetic generators, real-data loaders, and the
partitions that make a federated data set of a user's own pool of samples."""

from karula_jax.data.clients import ClientData, client_weights, from_client_arrays
from karula_jax.data.heart_disease import HeartDiseaseData, load_heart_disease
from karula_jax.data.leaf import LeafData, load_leaf
from karula_jax.data.partition import split_dirichlet, split_feature_shift, split_label_skew
from karula_jax.data.random_clients import random_classification
from karula_jax.data.splits import train_test_split
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
    "split_dirichlet",
    "split_feature_shift",
    "split_label_skew",
    "synthetic_ridge",
    "train_test_split",
]
