"""Client data: padded containers, synthetic generators and real-data loaders."""

from karula_jax.data.clients import ClientData, client_weights, from_client_arrays
from karula_jax.data.leaf import LeafData, load_leaf
from karula_jax.data.synthetic import SyntheticRidge, synthetic_ridge

__all__ = [
    "ClientData",
    "LeafData",
    "SyntheticRidge",
    "client_weights",
    "from_client_arrays",
    "load_leaf",
    "synthetic_ridge",
]
