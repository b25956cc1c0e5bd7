"""Client data: padded containers, synthetic generators and real-data loaders."""

from karula_jax.data.clients import ClientData, client_weights, from_client_arrays
from karula_jax.data.synthetic import SyntheticRidge, synthetic_ridge

__all__ = [
    "ClientData",
    "SyntheticRidge",
    "client_weights",
    "from_client_arrays",
    "synthetic_ridge",
]
