"""Karula: variance-reduced projected gradient over the Wasserstein-constrained set K.

One round (DESIGN §4), with ``S`` the ``s`` participants and ``G_i`` the weighted
stochastic gradient ``alpha_i * grad f_i(theta_i)`` of participant ``i``::

    nu_i  = m_i / n + 1[i in S] (G_i - m_i) / s     (E_S[nu_i] = alpha_i grad f_i / n)
    m_i   = G_i                                       for i in S
    theta = P_K(theta - eta * nu)

with ``K = {theta : ||theta_i - theta_j||^2 <= t D_ij for all i, j}``. The default step
size (``learning_rate=None``) is derived in :func:`karula`'s docstring.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax.algorithms import _common as C
from karula_jax.algorithms._graph import check_dissimilarity
from karula_jax.algorithms._personalized import check_personalized, shared_leaves
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
    """
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

    Step size (``learning_rate=None``). Let ``L_i`` be the Lipschitz constant of
    ``grad f_i``, ``a_i = alpha_i L_i``, ``L_max = max_i a_i``, ``Lbar = mean_i a_i``,
    ``p = s / n``; the product-space constant is ``L = L_max / n``
    (:func:`lipschitz_ridge`). Theorem 4.3's step is ``3 / (8 L_max)`` (its ``L`` bounds
    the weighted losses ``alpha_i f_i``: ``learning_rate="theorem"``), ``n`` times smaller
    than ``3 / (8 L)`` with the product-space ``L``, which can diverge with ``s < n`` and
    weakly coupled clients. The rule (:func:`karula_learning_rate`)::

        c(p)   = 4 / ((2 - p) (1 + sqrt(1 + 8 (1 - p) / (2 - p))))   in [0.618, 2]
        free   = s c(p) / (2 L_max)
        tied   = max(n b(n, s) / (2 L_F(s)), free)
        L_F(s) = (n (s - 1) Lbar + (n - s) L_max) / (s (n - 1))      (Lbar if s = n)
        eta    = tied                                                every radius 0
        eta    = min(tied, free / (1 - kappa))  (tied if kappa >= 1) else

    with ``kappa`` the coupling of the constraints at this ``t`` (case 3). With
    ``s = n``: ``free = 1 / L`` and ``tied = n / Lbar``. For n = 30, s = 10, ``free`` is
    ``0.35 * 3/(8L)``.

    Derivation. Karula is minibatch SAGA on the product space, ``f = (1/n) sum_i F_i``
    with ``F_i(theta) = alpha_i f_i(theta_i)``, ``s`` of ``n`` components sampled
    without replacement, then a projection (nonexpansive). Its expected smoothness
    (Gazagnadou, Gower and Salmon, 2019: ``n(s-1)/(s(n-1)) L + (n-s)/(s(n-1)) L_max``)
    is ``L_max / s`` here, as the blocks are separate: a fresh gradient weighs ``1/s``,
    not ``1/n``, and the memory ``m_i / n`` acts every round.

    1. Uncoupled clients (``t = inf``). Along an eigenvector of a quadratic ``f_i``
       (curvature ``a = a_i``), with ``m_i = a phi`` (``phi``: where client ``i`` was
       last sampled), a round is ``theta <- theta - (eta a / n) phi`` with
       probability ``1 - p`` and ``theta <- (1 - eta a / s) theta +
       eta a (1/s - 1/n) phi``, ``phi <- theta`` with probability ``p``. The second
       moments of ``(theta, phi)`` follow a linear recursion whose spectral radius
       reaches 1 where
       ``(2 - p)(1 - p) c^2 + (2 - p) c - 2 = 0``, ``c = eta a / s``: mean-square stable
       iff ``eta a_i < s c(p)`` for every ``i``, i.e. ``eta < c(p) / (L_max / s)``.
       ``free`` takes half, like ``1 / L`` for gradient descent (``c(1) = 2``); at
       ``s = 1`` it is 0.31 to 0.35 over ``L_max``, near SAGA's ``1 / (3 L_max)``.
    2. Every radius 0 (``t = 0`` or ``D = 0``). The projection is the mean: Karula is
       FedSGD with SAGA memory at step ``eta / n`` on ``F(w) = (1/n) sum_i alpha_i
       f_i(w)``, minibatch SAGA with expected smoothness ``L_F(s)`` (``Lbar`` bounds
       the smoothness of ``F``). For ``n`` identical quadratic clients the same
       second-moment recursion (4 moments by symmetry) is stable iff
       ``(eta / n) a < b(n, s)`` (:func:`consensus_stability_factor`, from 1 at
       ``s = 1`` to 2 at ``s = n``); ``tied`` takes half. It is never below case 1.
    3. Between. The set ``K`` is invariant under moving every client by the same
       vector, so the projection keeps the client mean: the mean follows case 2 at
       every ``t`` (never a larger step than ``tied``), and the differences are
       bounded by the radii. Near a solution with multipliers ``Lambda`` (KKT:
       ``grad f(theta) + (L_Lambda x I) theta = 0``, ``L_Lambda`` the Laplacian of the
       pair multipliers) the projection of ``theta - eta grad f`` has multipliers
       ``eta Lambda`` and acts on a perturbation ``e`` as the implicit step
       ``(I + eta L_Lambda)^-1``: a round is ``e <- (I + eta L_Lambda)^-1 (I - eta H) e``.
       With ``H = h I``, along an eigenvector of ``L_Lambda`` with eigenvalue ``mu``
       the factor is ``|1 - eta h| / (1 + eta mu)``, below 1 iff ``eta (h - mu) < 2``.
       The least damped direction besides the mean has ``mu = mu_2``, the algebraic
       connectivity, so the limit ``2 / h`` of case 1 becomes ``2 / (h (1 - kappa))``
       with ``kappa = mu_2 / h``, and for ``kappa >= 1`` only the mean's limit (case 2)
       is left. The rule applies this factor to ``free`` and caps it at ``tied``.
       ``kappa`` comes from a pilot (:func:`~karula_jax.algorithms.step_size.coupling`): for
       ``F_i = (h / 2) ||theta_i - theta_i°||^2`` the solution is the Euclidean
       projection onto ``K`` of the local optima ``theta°``, whose multipliers are
       ``Lambda / h``; so ``kappa`` is the algebraic connectivity of the multipliers of
       projecting approximate local optima (:func:`~karula_jax.algorithms.step_size.local_optima`:
       20 full-batch gradient steps at ``1 / L_i`` from ``params``; fewer steps
       underestimate the clients' separation, hence ``kappa``). It assumes one
       curvature for every client and multipliers at the solution like the pilot's,
       and uses case 1's sampled limit for ``free``: a model, checked by the runs
       below, not a bound. Shared leaves (``personalized``) are tied as in case 2;
       with no personalized leaf the rule is ``tied``.

    The factor 1/2 leaves room for curvature that changes along the run, minibatch
    noise (``B < N_i`` adds a noise floor, not instability) and errors in ``L_i``.
    Measured on 6 ridge and logistic clients (``tests/test_step_size.py``, 300 rounds,
    s in {1, 2, 6}, t in {0, 0.05, 0.5, inf}, where 0.05 leaves most pair constraints
    active at the optimum and 0.5 about half): the default always converged (except
    s = 1 at t = inf, still converging after 300 rounds), and the largest constant
    step that converged was 1.4 to 2.8 times the default at every t (without case 3,
    up to 5.7 times at t = 0.5 and 16 times at t = 0.05).

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
      projection_method: solver of the projection: ``"auto"`` (Dykstra for a handful
        of clients, the Laplacian dual otherwise; see
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
        ``init``, ``params`` that do not fit the data (see ``_common.check_params``).
    """
    from karula_jax import projection as P  # noqa: PLC0415 - sibling module, import late

    check_dissimilarity(D)
    C.check_nonnegative("t", t, allow_inf=True)
    if isinstance(learning_rate, str):
        if learning_rate != "theorem":
            raise ValueError(
                "learning_rate must be a number >= 0, None (the derived rule) or "
                f"'theorem' (3 / (8 L_max)), got {learning_rate!r}"
            )
    elif learning_rate is not None:
        C.check_nonnegative("learning_rate", learning_rate)
    s = C.check_positive_int("clients_per_round", clients_per_round)
    B = C.check_positive_int("batch_size", batch_size)
    C.check_weights(weights)
    D = jnp.asarray(D, dtype=jnp.float32)
    n = D.shape[0]
    t = jnp.asarray(t, jnp.float32)
    check_smoothness(smoothness, n)

    def _check_data(data: ClientData) -> None:
        if data.num_clients != n:
            raise ValueError(f"D has shape {D.shape} but data hold {data.num_clients} clients")
        C.check_clients_per_round(s, n)

    # Leaves outside ``personalized`` are one consensus model: stored once ([1, ...]),
    # stepped along the client mean of nu, which is their projection (the mean of v).
    check_personalized(personalized)

    def _shared(tree):
        """None when every leaf of ``tree`` (shaped like params) is personalized, else
        True on its shared leaves."""
        return shared_leaves(personalized, tree)

    def _radii():
        return radii_squared(t, D)

    def _own(tree):
        """The personalized leaves of ``tree``, as a list (all of them if none shared)."""
        leaves, shared = jax.tree.leaves(tree), _shared(tree)
        if shared is None:
            return leaves
        return [a for a, f in zip(leaves, jax.tree.leaves(shared), strict=True) if not f]

    def _with_own(tree, own):
        """``tree`` with its personalized leaves replaced by the list ``own``."""
        leaves, treedef = jax.tree.flatten(tree)
        shared = _shared(tree)
        flags = [False] * len(leaves) if shared is None else jax.tree.leaves(shared)
        own = iter(own)
        return treedef.unflatten(
            [a if f else next(own) for a, f in zip(leaves, flags, strict=True)]
        )

    def _project(v, warm_start):
        own = _own(v)
        if not own:  # every leaf shared: v is the consensus already
            zero = jnp.zeros((), jnp.float32)
            return v, P.ProjectionInfo(0, zero, zero, zero, zero, True, warm_start)
        theta, info = P.project(
            own,
            _radii(),
            method=projection_method,
            tol=projection_tol,
            max_iter=projection_max_iter,
            warm_start=warm_start,
        )
        return _with_own(v, theta), info

    def _coupling(params, data, L_i):
        """``kappa`` of the step rule: the projection of approximate local optima."""
        if not _own(params):  # every leaf shared: Karula is FedSGD with memory, the tied case
            return jnp.float32(jnp.inf)
        radii = C.concrete(_radii())
        if radii is not None:  # known radii all 0 (kappa unused) or all inf (kappa = 0)
            off = radii[~np.eye(n, dtype=bool)]
            if np.all(off == 0) or np.all(np.isposinf(off)):
                return jnp.float32(0.0)
        _, info = _project(local_optima(loss, params, data, L_i), None)
        return coupling(info.state.lam, _radii())

    def init(params, data: ClientData, *, key) -> FedState:
        C.check_params(loss, params, data)
        shared = _shared(params)  # checks its structure
        _check_data(data)
        key_init, key_run = C.init_and_run_keys(key)
        theta = C.stack_clients(params, n, shared=shared)
        alpha = C.resolve_weights(weights, data)
        memory = init_memory(loss, theta, data, alpha, key_init, B)
        dtype = jnp.result_type(*jax.tree.leaves(params))
        own = _own(theta)
        if own:
            proj_state = P.init_projection_state(own, _radii(), method=projection_method)
        else:
            proj_state = P.ProjectionState(jnp.zeros((n, n), dtype), jnp.zeros((0, 0), dtype))
        if learning_rate is None or isinstance(learning_rate, str):
            L_i = client_smoothness(
                loss, params, data, smoothness, key=jax.random.fold_in(key_init, 1)
            )
        if isinstance(learning_rate, str):  # "theorem"
            eta = theorem_learning_rate(L_i, alpha)
        elif learning_rate is None:
            consensus = jnp.all(_radii() == 0)
            eta = karula_learning_rate(
                L_i, alpha, s, consensus=consensus, coupling=_coupling(params, data, L_i)
            )
        else:
            eta = learning_rate
        return FedState(
            params=theta,
            memory=memory,
            proj_state=proj_state,
            extra=KarulaExtra(learning_rate=jnp.asarray(eta, dtype)),
            key=key_run,
            round=jnp.zeros((), jnp.int32),
        )

    def round_fn(state: FedState, data: ClientData) -> tuple[FedState, RoundInfo]:
        _check_data(data)
        alpha, mask, idx, key_batch = C.begin_round(state, data, s, weights)
        a_s = alpha[idx]
        values, G, nu, memory = saga_round(
            loss,
            state.params,
            state.memory,
            data,
            idx,
            key_batch,
            a_s,
            B,
            shared=_shared(state.params),
        )
        eta = state.extra.learning_rate
        v = jax.tree.map(lambda th, d: th - eta * d, state.params, nu)
        theta, pinfo = _project(v, state.proj_state)
        info = RoundInfo(
            loss=C.weighted_mean(values, a_s),
            participants=mask,
            proj_delta=jnp.asarray(pinfo.delta, jnp.float32),
            proj_violation=jnp.asarray(pinfo.max_violation, jnp.float32),
            proj_iterations=jnp.asarray(pinfo.iterations, jnp.int32),
            proj_converged=jnp.asarray(pinfo.converged, bool),
            finite=C.all_finite(values, G, theta),
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

    return Algorithm(init=init, round=round_fn, client_params=C.own_params)
