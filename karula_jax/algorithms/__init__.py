"""Federated algorithms: Karula and its baselines, each a factory of pure functions.

Every factory returns an :class:`Algorithm` ``(init, round, client_params)`` (see
:mod:`karula_jax.algorithms.base`), so all methods run on the same compiled engine.
"""

from karula_jax.algorithms.base import Algorithm, FedState, LossFn, RoundInfo
from karula_jax.algorithms.baselines import fedavg, fedsgd, local
from karula_jax.algorithms.ifca import IFCAState, ifca, ifca_assign
from karula_jax.algorithms.karula import karula, radii_squared, variance_reduced_direction
from karula_jax.algorithms.pfedme import pfedme
from karula_jax.algorithms.ridge import lipschitz_ridge

__all__ = [
    "Algorithm",
    "FedState",
    "IFCAState",
    "LossFn",
    "RoundInfo",
    "fedavg",
    "fedsgd",
    "ifca",
    "ifca_assign",
    "karula",
    "lipschitz_ridge",
    "local",
    "pfedme",
    "radii_squared",
    "variance_reduced_direction",
]
