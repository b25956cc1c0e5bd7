"""Karula: variance-reduced projected gradient over the Wasserstein-constrained set K.

One round, with ``S`` the ``s`` participants and ``G_i`` the weighted stochastic
gradient ``alpha_i * grad f_i(theta_i)`` of participant ``i``::

    nu_i  = m_i / n + 1[i in S] (G_i - m_i) / s     (E_S[nu_i] = alpha_i grad f_i / n)
    m_i   = G_i                                       for i in S
    theta = P_K(theta - eta * nu)

with ``K = {theta : ||theta_i - theta_j||^2 <= t D_ij for all i, j}``. The default step
size (``learning_rate=None``) and its derivation: ``docs/karula.md``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax._checks import (
    check_nonnegative,
    check_positive,
    check_positive_int,
    concrete,
    is_concrete,
)
from karula_jax.algorithms._graph import check_dissimilarity
from karula_jax.algorithms._personalized import check_personalized, shared_leaves
from karula_jax.algorithms._rounds import begin_round, own_params
from karula_jax.algorithms._sampling import init_and_run_keys
from karula_jax.algorithms._trees import all_finite, stack_clients, weighted_mean
from karula_jax.algorithms._validation import (
    check_clients_per_round,
    check_params,
    check_weights,
    resolve_weights,
)
from karula_jax.algorithms.base import Algorithm, FedState, LossFn, RoundInfo
from karula_jax.algorithms.step_size import (
    check_smoothness,
    client_smoothness,
    coupling,
    karula_learning_rate,
    local_optima,
    theorem_learning_rate,
)
from karula_jax.algorithms.variance_reduction import init_memory, saga_round
from karula_jax.data.clients import ClientData

__all__ = ["KarulaExtra", "karula", "radii_squared"]


class KarulaExtra(NamedTuple):
    """Karula's ``FedState.extra``: the step size the run uses.

    Attributes:
      learning_rate: ``eta``, the given ``learning_rate`` or the default rule's value
        computed by ``init`` from the data; ``round`` reads it from the state.
    """

    learning_rate: jnp.ndarray  # [] floating, the dtype of params


def radii_squared(t, D) -> jnp.ndarray:
    """Squared radii ``t * D_ij`` of shape ``[n, n]``, with ``0 * inf = 0`` either way.

    ``t = 0`` gives radius 0 even where ``D = inf`` (one global model), and ``D_ij = 0``
    gives radius 0 even when ``t = inf`` (identical clients stay tied).

    Raises:
      ValueError: a concrete ``t`` negative or NaN, a concrete ``D`` that
        :func:`karula` would refuse (traced values are checked by the runner).
    """
    if is_concrete(t):
        check_nonnegative("t", t, allow_inf=True)
    if is_concrete(D):
        check_dissimilarity(D)
    return _radii(t, D)


def _radii(t, D) -> jnp.ndarray:
    """:func:`radii_squared` without its checks, for callers that checked ``t`` and ``D``."""
    D = jnp.asarray(D, dtype=jnp.float32)
    t = jnp.asarray(t, dtype=jnp.float32)
    return jnp.where((D == 0) | (t == 0), 0.0, t * D)


def karula(
    loss: LossFn,
    D,
    *,
    t,
    learning_rate=None,
    clients_per_round: int,
    batch_size: int,
    smoothness=None,
    personalized: Any = True,
    weights=None,
    projection_method: str = "auto",
    projection_tol: float = 1e-6,
    projection_max_iter: int = 1000,
) -> Algorithm:
    """The Karula algorithm as pure ``init`` / ``round`` / ``client_params`` functions.

    Solves ``min_theta (1/n) sum_i alpha_i f_i(theta_i)`` subject to
    ``||theta_i - theta_j||^2 <= t D_ij`` by the round described in the module
    docstring. The projection is :func:`karula_jax.projection.project`, warm-started
    from the previous round's dual state (``state.proj_state``).

    Step-size normalization: ``nu`` estimates the gradient of ``f`` on the product
    space, i.e. ``alpha_i grad f_i / n`` for client ``i``. Hence

    * at ``t = 0`` the projection is the mean over clients and one round equals
      :func:`fedsgd` with ``memory=True`` at learning rate ``learning_rate / n``;
    * at ``t = inf`` (or ``D = inf``) with ``s = n`` one round equals :func:`local`
      at the same ``learning_rate`` (step ``alpha_i grad f_i / n`` per client).

    Step size (``learning_rate=None``): with ``a_i = alpha_i L_i``, ``L_max = max_i a_i``,
    ``Lbar = mean_i a_i``, ``c = stability_factor(s / n)``, ``b =
    consensus_stability_factor(n, s)`` and ``kappa`` the coupling of the constraints at
    this ``t`` (:func:`karula_learning_rate`; rule, derivation and checks in
    ``docs/karula.md``)::

        free   = s c / (2 L_max)
        tied   = max(n b / (2 L_F(s)), free)
        L_F(s) = (n (s - 1) Lbar + (n - s) L_max) / (s (n - 1))      (Lbar if s = n)
        eta    = tied                                                every radius 0
        eta    = min(tied, free / (1 - kappa))  (tied if kappa >= 1) else

    ``L_i`` (``smoothness``): ``None`` takes ``loss.smoothness(data)`` when the loss has
    it (:func:`karula_jax.models.ridge_loss` and ``logistic_loss`` do, exactly from the
    data), else :func:`smoothness_estimate` at ``params`` (power iteration with
    Hessian-vector products on each client's full data, 20 steps, times 2). ``init``
    computes the step from the data (the pilot costs 20 full-batch gradients per client,
    one projection and one ``n x n`` eigendecomposition) and stores it in
    ``state.extra.learning_rate``, which ``round`` uses.

    Args:
      loss: ``loss(params, x, y, mask) -> scalar``, mean over the masked rows.
      D: dissimilarities, array ``[n, n]``, symmetric, ``>= 0``, may contain ``inf``.
      t: radius scale ``>= 0``, may be ``inf``; may be a traced value (vmap over t).
      learning_rate: ``eta >= 0``; may be traced. ``None``: the rule above.
        ``"theorem"``: Theorem 4.3's ``3 / (8 L_max)`` with ``L_max = max_i alpha_i L_i``
        (:func:`theorem_learning_rate`; ``docs/theory.md``), from the same ``L_i``.
      clients_per_round: ``s``, static, ``1 <= s <= n``.
      batch_size: ``B``, static; ``B >= N_max`` gives exact gradients.
      smoothness: the ``L_i`` of the rule (unused when ``learning_rate`` is given): a
        scalar or array ``[n]`` (may be traced), a callable ``smoothness(data) -> [n]``
        (e.g. ``functools.partial(ridge_smoothness, lam=lam)``), or ``None`` (see
        above).
      personalized: True, False or a pytree of bools like ``params``
        (:mod:`~karula_jax.algorithms._personalized`); True leaves are personalized
        (coupled by the constraints), False leaves are shared: one consensus model,
        stored once in ``state.params`` (``[1, ...]``) and stepped along the client mean
        of ``nu`` (their projection). Default True: every leaf personalized.
      weights: optional client weights ``alpha`` of shape ``[n]`` (default
        proportional to ``N_i`` with mean 1).
      projection_method: solver of the projection: ``"auto"`` (Dykstra for two clients,
        the Laplacian dual otherwise; see
        :func:`karula_jax.projection.choose_method`), ``"dykstra"``, ``"laplacian"``, or
        ``"none"``: no projection (an ablation for timing; the iterates leave ``K``).
      projection_tol: its tolerance.
      projection_max_iter: its iteration cap.

    Returns:
      An :class:`Algorithm`. ``init(params, data, *, key)`` starts every client from
      ``params``, fills the memory with one minibatch gradient per client and fixes the
      step (``state.extra`` is a :class:`KarulaExtra`).
      ``round`` reports in :class:`RoundInfo` the projection's certified gap
      (``proj_delta``), its max constraint violation, iterations and whether it met
      ``projection_tol`` within ``projection_max_iter`` (``proj_converged``); ``finite`` is
      False as soon as a loss, gradient or parameter is NaN/inf (the run is not
      stopped: the driver must check it).

    Raises:
      ValueError: ``D`` not square/symmetric, negative or NaN; ``t`` or
        ``learning_rate`` negative or NaN; ``smoothness`` values negative, not finite or
        not of shape ``[n]``; ``clients_per_round`` or ``batch_size``
        < 1 (``s > n`` is detected by ``init``/``round``); bad ``weights``; at
        ``init``, ``params`` that do not fit the data (see ``_validation.check_params``);
        ``projection_method`` not one of ``karula_jax.projection.METHODS``,
        ``projection_tol`` not finite and > 0, ``projection_max_iter`` < 1.
      TypeError: ``projection_tol`` not a real number or ``projection_max_iter`` not an
        int (among the argument types checked).

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import karula_jax as kj
      >>> ds = kj.data.synthetic_ridge(0, num_clients=6, dim=3)
      >>> # D from the true models here; from the clients' data: embedding.dissimilarities
      >>> D = kj.evaluation.pairwise_sq_distances(ds.theta_true)
      >>> loss = kj.models.ridge_loss(1e-6)
      >>> L = kj.algorithms.lipschitz_ridge(ds.train, 1e-6)
      >>> alg = kj.algorithms.karula(
      ...     loss, D, t=1.0, learning_rate=3 / (8 * L), clients_per_round=3,
      ...     batch_size=ds.train.max_count,  # full gradients
      ... )
      >>> res = kj.training.run(
      ...     alg, jnp.zeros(3), ds.train, key=jax.random.key(1), num_rounds=100, chunk_size=100,
      ...     progress=False,
      ... )
      >>> theta = alg.client_params(res.state, ds.train)  # one model per client
      >>> theta.shape, bool(res.info.proj_converged.all())
      ((6, 3), True)
      >>> bool((kj.evaluation.pairwise_sq_distances(theta) <= 1.0 * D + 1e-4).all())  # in K
      True
      >>> round(float(kj.evaluation.estimation_error(theta, ds.theta_true).mean()), 2)
      0.02
    """
    D, t, s, B = _check_arguments(
        D, t, learning_rate, clients_per_round, batch_size, weights, smoothness, personalized
    )
    _check_projection(projection_method, projection_tol, projection_max_iter)
    projection = {
        "method": projection_method,
        "tol": projection_tol,
        "max_iter": projection_max_iter,
    }
    setup = _Setup(
        loss, D, t, D.shape[0], s, B, learning_rate, smoothness, personalized, weights, projection
    )

    def init(params, data: ClientData, *, key) -> FedState:
        return _init(setup, params, data, key)

    def round_fn(state: FedState, data: ClientData) -> tuple[FedState, RoundInfo]:
        return _round(setup, state, data)

    return Algorithm(init=init, round=round_fn, client_params=own_params)


class _Setup(NamedTuple):
    """What the functions of a :func:`karula` algorithm close over."""

    loss: LossFn
    D: jnp.ndarray  # [n, n] float32
    t: jnp.ndarray  # [] float32
    n: int
    s: int  # clients per round
    B: int  # batch size
    learning_rate: Any  # a number, None or "theorem"
    smoothness: Any
    personalized: Any
    weights: Any
    projection: dict  # method, tol and max_iter of karula_jax.projection.project

    def radii(self) -> jnp.ndarray:
        return _radii(self.t, self.D)  # t and D checked by the factory


def _check_arguments(
    D, t, learning_rate, clients_per_round, batch_size, weights, smoothness, personalized
):
    """The checks of :func:`karula`'s arguments; returns ``(D, t, s, B)`` as it uses them."""
    check_dissimilarity(D)
    check_nonnegative("t", t, allow_inf=True)
    if isinstance(learning_rate, str):
        if learning_rate != "theorem":
            raise ValueError(
                "learning_rate must be a number >= 0, None (the derived rule) or "
                f"'theorem' (3 / (8 L_max)), got {learning_rate!r}"
            )
    elif learning_rate is not None:
        check_nonnegative("learning_rate", learning_rate)
    s = check_positive_int("clients_per_round", clients_per_round)
    B = check_positive_int("batch_size", batch_size)
    check_weights(weights)
    D = jnp.asarray(D, dtype=jnp.float32)
    t = jnp.asarray(t, jnp.float32)
    check_smoothness(smoothness, D.shape[0])
    check_personalized(personalized)
    return D, t, s, B


def _check_projection(method, tol, max_iter) -> None:
    """The projection options, checked when the factory is called (``project`` checks
    them again by its own names at the first round)."""
    from karula_jax.projection.api import registered_methods  # noqa: PLC0415 - import late

    methods = registered_methods()
    if not isinstance(method, str) or method not in methods:
        raise ValueError(f"projection_method must be one of {methods}, got {method!r}")
    check_positive("projection_tol", tol)
    check_positive_int("projection_max_iter", max_iter)


def _check_data(setup: _Setup, data: ClientData) -> None:
    if data.num_clients != setup.n:
        raise ValueError(f"D has shape {setup.D.shape} but data hold {data.num_clients} clients")
    check_clients_per_round(setup.s, setup.n)


# Leaves outside ``personalized`` are one consensus model: stored once ([1, ...]), stepped
# along the client mean of nu, which is their projection (the mean of v).


def _own(personalized, tree) -> list:
    """The personalized leaves of ``tree``, as a list (all of them if none shared)."""
    leaves, shared = jax.tree.leaves(tree), shared_leaves(personalized, tree)
    if shared is None:
        return leaves
    return [a for a, f in zip(leaves, jax.tree.leaves(shared), strict=True) if not f]


def _with_own(personalized, tree, own):
    """``tree`` with its personalized leaves replaced by the list ``own``."""
    leaves, treedef = jax.tree.flatten(tree)
    shared = shared_leaves(personalized, tree)
    flags = [False] * len(leaves) if shared is None else jax.tree.leaves(shared)
    own = iter(own)
    return treedef.unflatten([a if f else next(own) for a, f in zip(leaves, flags, strict=True)])


def _project(setup: _Setup, v, warm_start):
    """``v`` with its personalized leaves projected onto ``K``, and the projection's info."""
    from karula_jax import projection as P  # noqa: PLC0415 - sibling module, import late

    own = _own(setup.personalized, v)
    if not own:  # every leaf shared: v is the consensus already
        zero = jnp.zeros((), jnp.float32)
        return v, P.ProjectionInfo(0, zero, zero, zero, zero, True, warm_start)
    theta, info = P.project(own, setup.radii(), warm_start=warm_start, **setup.projection)
    return _with_own(setup.personalized, v, theta), info


def _coupling(setup: _Setup, params, data, L_i):
    """``kappa`` of the step rule: the projection of approximate local optima."""
    if not _own(setup.personalized, params):  # every leaf shared: FedSGD, the tied case
        return jnp.float32(jnp.inf)
    radii = concrete(setup.radii())
    if radii is not None:  # known radii all 0 (kappa unused) or all inf (kappa = 0)
        off = radii[~np.eye(setup.n, dtype=bool)]
        if np.all(off == 0) or np.all(np.isposinf(off)):
            return jnp.float32(0.0)
    _, info = _project(setup, local_optima(setup.loss, params, data, L_i), None)
    return coupling(info.state.lam, setup.radii())


def _step_size(setup: _Setup, params, data, alpha, key_init):
    """``eta``: the given ``learning_rate``, Theorem 4.3's step or the default rule."""
    learning_rate = setup.learning_rate
    if learning_rate is not None and not isinstance(learning_rate, str):
        return learning_rate
    L_i = client_smoothness(
        setup.loss, params, data, setup.smoothness, key=jax.random.fold_in(key_init, 1)
    )
    if isinstance(learning_rate, str):  # "theorem"
        return theorem_learning_rate(L_i, alpha)
    consensus = jnp.all(setup.radii() == 0)
    return karula_learning_rate(
        L_i, alpha, setup.s, consensus=consensus, coupling=_coupling(setup, params, data, L_i)
    )


def _init(setup: _Setup, params, data: ClientData, key) -> FedState:
    """``init`` of :func:`karula`."""
    from karula_jax import projection as P  # noqa: PLC0415 - sibling module, import late

    check_params(setup.loss, params, data)
    shared = shared_leaves(setup.personalized, params)  # checks its structure
    _check_data(setup, data)
    key_init, key_run = init_and_run_keys(key)
    n = setup.n
    theta = stack_clients(params, n, shared=shared)
    alpha = resolve_weights(setup.weights, data)
    memory = init_memory(setup.loss, theta, data, alpha, key_init, setup.B)
    dtype = jnp.result_type(*jax.tree.leaves(params))
    own = _own(setup.personalized, theta)
    if own:
        method = setup.projection["method"]
        proj_state = P.init_projection_state(own, setup.radii(), method=method)
    else:
        proj_state = P.ProjectionState(jnp.zeros((n, n), dtype), jnp.zeros((0, 0), dtype))
    eta = _step_size(setup, params, data, alpha, key_init)
    return FedState(
        params=theta,
        memory=memory,
        proj_state=proj_state,
        extra=KarulaExtra(learning_rate=jnp.asarray(eta, dtype)),
        key=key_run,
        round=jnp.zeros((), jnp.int32),
    )


def _round(setup: _Setup, state: FedState, data: ClientData) -> tuple[FedState, RoundInfo]:
    """``round`` of :func:`karula`."""
    _check_data(setup, data)
    alpha, mask, idx, key_batch = begin_round(state, data, setup.s, setup.weights)
    a_s = alpha[idx]
    values, G, nu, memory = saga_round(
        setup.loss,
        state.params,
        state.memory,
        data,
        idx,
        key_batch,
        a_s,
        setup.B,
        shared=shared_leaves(setup.personalized, state.params),
    )
    eta = state.extra.learning_rate
    v = jax.tree.map(lambda th, d: th - eta * d, state.params, nu)
    theta, pinfo = _project(setup, v, state.proj_state)
    info = RoundInfo(
        loss=weighted_mean(values, a_s),
        participants=mask,
        proj_delta=jnp.asarray(pinfo.delta, jnp.float32),
        proj_violation=jnp.asarray(pinfo.max_violation, jnp.float32),
        proj_iterations=jnp.asarray(pinfo.iterations, jnp.int32),
        proj_converged=jnp.asarray(pinfo.converged, bool),
        finite=all_finite(values, G, theta),
    )
    new_state = FedState(
        params=theta,
        memory=memory,
        proj_state=pinfo.state,
        extra=state.extra,
        key=state.key,
        round=state.round + 1,
    )
    return new_state, info
