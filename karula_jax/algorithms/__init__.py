"""Federated algorithms: Karula and its baselines, each a factory of pure functions.

Every factory returns an :class:`Algorithm` ``(init, round, client_params)`` (see
:mod:`karula_jax.algorithms.base`), so all methods run on the same compiled engine.
One ``init`` key gives the same participants and minibatches in every method.

How each ``learning_rate`` acts (``g_i = grad f_i`` with ``f_i`` a client's mean loss,
``alpha`` of mean 1, ``F(w) = (1/n) sum_i alpha_i f_i(w)``):

* ``karula(eta)``: ``theta <- P_K(theta - eta nu)`` with ``E[nu_i] = alpha_i g_i / n``.
  At ``t = 0`` it equals ``fedsgd(memory=True)`` at ``eta / n``; at ``t = inf`` with
  ``s = n`` it equals ``local`` at ``eta``. ``eta=None`` (the default) is the rule of
  :func:`karula_learning_rate`, derived in ``karula``'s docstring.
* ``local(lr)``: ``theta_i <- theta_i - lr alpha_i g_i / n``.
* ``fedsgd(lr)``: ``w <- w - lr sum_S alpha_i g_i / sum_S alpha_i`` (``memory=True``: the
  SAGA estimate of ``grad F``). Equals ``fedavg`` at ``lr`` with ``local_steps=1``.
* ``fedavg(lr)``: ``E`` client steps ``w_i <- w_i - lr g_i``, then the alpha-weighted
  average. Equals ``ifca`` with one cluster.
* ``ifca(lr)``: ``fedavg`` inside the cluster each participant picks.
* ``pfedme(lr)``: ``w_i <- w_i - lr lam (w_i - prox_i(w_i))``, a step on the client's
  Moreau envelope; the inner solve uses ``personal_learning_rate`` on ``f_i``.
* ``ditto(lr)``: the global model is ``fedavg(lr)``; personal models take steps
  ``v_i <- w + (v_i - plr g_i(v_i) - w) / (1 + plr lam)`` with ``plr =
  personal_learning_rate`` (default ``lr``).
* ``fedprox(lr)``: ``fedavg`` with local steps ``w_i <- w_i - lr (g_i + mu (w_i - w))``;
  equals ``fedavg`` at ``mu = 0``.
* ``scaffold(lr)``: ``E`` client steps ``y <- y - lr (g_i(y) - c_i + c)``, then
  ``x <- x + global_learning_rate * mean_S (y_i - x)`` (alpha-weighted).
* ``laplacian_penalty(eta)``: Karula's step with the projection replaced by the proximal
  step of the penalty ``(mu/2) sum_{i<j} w_ij ||theta_i - theta_j||^2``:
  ``theta <- (I + eta mu L)^{-1} (theta - eta nu)``. Equals ``karula`` at the same ``eta``
  with ``t = inf`` at ``mu = 0`` and with ``t = 0`` at ``mu = inf``.
* ``clustered_fedavg(lr)``: ``fedavg(lr)`` inside fixed groups of clients
  (:func:`cluster_clients` of ``D``); one group equals ``fedavg``.

Round ``k`` draws its participants with ``_sampling.sample_participants`` and each
participant's minibatches with ``_sampling.client_batch`` from
``split(fold_in(state.key, k))``; code outside the compiled rounds (e.g. an eager reference
loop) imports them from :mod:`karula_jax.algorithms._sampling` to draw the same ones.

``__all__`` holds what a user calls: the factories, their state and loss types, and the
constants and rules that choose their arguments (``lipschitz_*``, ``*_learning_rate``,
``client_smoothness``, ``smoothness_estimate``, ``radii_squared``, ``graph_weights``,
``graph_laplacian``, ``cluster_clients``, ``ifca_assign``). The building blocks of a round
(SAGA memory in :mod:`~karula_jax.algorithms.variance_reduction`, the step-size pilot in
:mod:`~karula_jax.algorithms.step_size`) are imported from their own modules.
"""

from karula_jax.algorithms.base import Algorithm, FedState, LossFn, RoundInfo
from karula_jax.algorithms.baselines import fedavg, fedsgd, local
from karula_jax.algorithms.clustered import cluster_clients, clustered_fedavg
from karula_jax.algorithms.ditto import ditto
from karula_jax.algorithms.fedprox import fedprox
from karula_jax.algorithms.ifca import IFCAState, ifca, ifca_assign
from karula_jax.algorithms.karula import KarulaExtra, karula, radii_squared
from karula_jax.algorithms.laplacian import (
    LaplacianExtra,
    graph_laplacian,
    graph_weights,
    laplacian_penalty,
)
from karula_jax.algorithms.pfedme import pfedme
from karula_jax.algorithms.ridge import lipschitz_logistic, lipschitz_ridge
from karula_jax.algorithms.scaffold import scaffold
from karula_jax.algorithms.step_size import (
    client_smoothness,
    karula_learning_rate,
    smoothness_estimate,
    theorem_learning_rate,
)

__all__ = [
    "Algorithm",
    "FedState",
    "IFCAState",
    "KarulaExtra",
    "LaplacianExtra",
    "LossFn",
    "RoundInfo",
    "client_smoothness",
    "cluster_clients",
    "clustered_fedavg",
    "ditto",
    "fedavg",
    "fedprox",
    "fedsgd",
    "graph_laplacian",
    "graph_weights",
    "ifca",
    "ifca_assign",
    "karula",
    "karula_learning_rate",
    "theorem_learning_rate",
    "laplacian_penalty",
    "lipschitz_logistic",
    "lipschitz_ridge",
    "local",
    "pfedme",
    "radii_squared",
    "scaffold",
    "smoothness_estimate",
]
