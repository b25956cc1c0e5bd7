"""Projected Newton-CG ascent on the n x n Laplacian multipliers (state: n^2 scalars)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from karula_jax import _linalg
from karula_jax.projection.certificate import (
    certified,
    dual_eval,
    dual_mask,
    primal_value,
    restore_and_certify,
    should_stop,
)
from karula_jax.projection.contract import ProjectionState, SolverResult
from karula_jax.projection.pair_algebra import hvp, low_rank, pair_dot, symmetric
from karula_jax.projection.reduction import sq_dists_of_gram

__all__ = ["solve"]

# Conjugate-gradient steps per Newton step; fewer for many clients, where one
# Hessian-vector product costs O(n^3).
_CG_MAX_ITER = 10
_CG_MAX_ITER_LARGE = 5
# CG stops at this residual relative to the right-hand side (more exact steps measured
# slower and no shorter: results/bench/README.md).
_CG_RTOL = 0.1
# Above this many clients the dual solver measures distances through the Gram matrix
# (one BLAS product) instead of explicit differences.
_GRAM_ABOVE = 96
# See ``_direction``: the share of the largest violation at which a pair at 0 enters, and
# the largest relative violation below which every violated pair enters.
_ENTER = 0.25
_ENTER_ALL_BELOW = 0.05
# Step halvings of a line search along one direction.
_HALVINGS = 31
# Whether the line search passes over, unevaluated, the trials that concavity rules out
# (``_line_search``); False evaluates every trial (the tests compare the two).
_PASS_OVER_HOPELESS = True
# Sweeps of pull_violated before a certificate's shrink (see ``certify`` in ``solve``).
_SWEEPS = 4
# Times the step's face is refined (``_direction``): once cuts the Newton iterations at
# n >= 100 as much, for the time, as twice, which lengthens some runs at n = 30
# (results/bench/README.md).
_REFINE = 1
# ... and up to this many times in all while free pairs still cross 0 and clipping them
# leaves the full step a negative first-order gain: by concavity that step cannot increase
# g, and its line search halved many times or failed (MLP n = 1000, six captured rounds:
# the two such rounds took 21 and 22 Newton iterations and 28 and 29 evaluations against
# 25 and 47 / 45; the other four and every MLP n = 300 capture unchanged, bit for bit;
# 6 or 10 passes: the same as 3).
_REFINE_SPOILED = 3
# Levenberg-Marquardt damping of the Newton system (``_direction``): its weight grows by
# _DAMP_UP (to at least _DAMP_MIN, at most _DAMP_MAX) after a line search that needed
# more than _DAMP_TRIALS trials or failed, and shrinks by _DAMP_DOWN (to 0 below
# _DAMP_MIN) after a full step; phase 1 starts from phase 0's weight. Where the
# dual is degenerate (p = 1: many more active pairs than the Hessian's rank) undamped
# steps needed 3-12 halvings each and 49 of 630 hard cold starts missed tol 1e-6 in 500
# iterations; damped, all 630 converge (at most 73 iterations), and the training
# captures take the same Newton iterations (results/bench/README.md, robustness).
_DAMP_MIN = 0.01
_DAMP_MAX = 1e4
_DAMP_UP = 4.0
_DAMP_DOWN = 0.25
_DAMP_TRIALS = 2
# The direct Newton system (``direct=True``, ``_pair_newton_step``): at most this many free
# pairs a client (``cap = min(n (n - 1) / 2, _DIRECT_PAIRS_PER_CLIENT * n,
# _DIRECT_MAX_PAIRS)``; more free pairs fall back to CG), and its ridge in units of the
# dtype's eps times the largest Hessian diagonal (1e-6 in float32), which keeps the
# factorization finite where the pair Hessian is singular (more free pairs than its rank).
_DIRECT_PAIRS_PER_CLIENT = 8
_DIRECT_RIDGE = 8.0
# ... and at most this many pairs in all: a [cap, cap] system of 2048 is 16 MiB and one
# factorization of 2.9 GFLOP; beyond it CG's Hessian products are the cheaper solve.
_DIRECT_MAX_PAIRS = 2048


def solve(red, warm: ProjectionState, *, tol, max_iter, skip=False, direct=False) -> SolverResult:
    r"""Projected Newton (two-metric, Newton-CG) ascent on the n x n multipliers.

    The dual ``g(lam)`` is concave with gradient ``(||theta_i - theta_j||^2 - R_ij^2)/2``
    and Hessian ``-(B^T (M + L)^{-1} B) o (B^T theta)(B^T theta)^T`` (``B`` the pair
    incidence matrix, ``o`` the entrywise product). A Hessian-vector product costs one
    Laplacian product, one multiplication by ``(M + L)^{-1}`` and one Gram product,
    ``O(n^2 k)``, so no pair-by-pair or per-pair-vector storage is needed. Each step
    fixes some pairs at 0 and takes a (Levenberg-Marquardt damped) Newton step on the
    others (:func:`_direction`); an Armijo search along the projected path keeps the
    ascent monotone up to g's float resolution (``64 eps |g|``), the diagonally scaled
    gradient its fallback. ``warm.lam`` starts it (symmetrized, clipped at 0); the
    returned state has no per-pair part (``pair_dual`` ``[0, k]``).

    ``direct``: the Newton system on the free pairs is formed (``[cap, cap]``, ``cap`` of
    ``_DIRECT_PAIRS_PER_CLIENT`` and ``_DIRECT_MAX_PAIRS``) and solved by one factorization
    instead of CG's loop of Hessian products (:func:`_pair_newton_step`): a few large
    kernels a step where the free pairs are few; CG where they exceed ``cap``, the solve is
    not finite or its step does not ascend, and throughout where the models span few
    dimensions (:func:`~karula_jax.projection.pair_algebra.low_rank` of the reduced
    problem's ``n`` and ``k``), where exact steps overshoot.
    """
    n = red.w.shape[0]
    pairs = n * (n - 1) // 2
    is_low_rank = low_rank(*red.w.shape)
    # Where the models span few dimensions the pair Hessian's Gram factor has rank at most
    # k, and exact steps on many free pairs overshoot where CG's truncated ones do not: on
    # the synthetic study's ridge clients at n = 300 (k = 50) the direct steps took 13.0
    # Newton iterations a round against CG's 6.0 (a ridge of up to 1e5 eps: 8.3), and at
    # p = 1 the system is singular. There ``direct`` runs the CG solver.
    direct = direct and not is_low_rank
    direct_cap = min(pairs, _DIRECT_PAIRS_PER_CLIENT * n, _DIRECT_MAX_PAIRS) if direct else 0
    gram = red.w.shape[0] > _GRAM_ABOVE
    cg_iter = _CG_MAX_ITER_LARGE if gram else _CG_MAX_ITER
    mask = dual_mask(red)
    lam0 = jnp.where(mask, jnp.maximum(symmetric(warm.lam), 0.0), 0.0)

    def certify(ev, gram):
        """(feasible theta, certified gap) at an evaluation. The shrink of theta(lam)
        pays for the worst violated pair on every pair; where the Lagrangian part of the
        gap, ``primal(theta(lam)) - g(lam)``, is already within ``tol``, violated pairs
        are first pulled together (``_SWEEPS`` sweeps; at n = 100 half the iterations of a
        warm start). Only where the models span few dimensions (``low_rank``): a sweep
        costs ``O(n^2 k)``, more than it saves where ``k`` nears ``n`` (bench README).
        With ``gram`` the shrink takes its distances from the evaluation's Gram matrix
        (no second ``[n, k] x [k, n]`` product; its cost is in ``results/bench/floor.md``)."""
        sq = sq_dists_of_gram(ev.gram) if gram else None
        if not is_low_rank:
            return restore_and_certify(ev.th, ev.g, red, gram=gram, sq_dists=sq)
        lagrangian_gap = primal_value(ev.th, red) - ev.g
        sweeps = jnp.where(lagrangian_gap <= tol * red.scale, _SWEEPS, 0)
        return restore_and_certify(ev.th, ev.g, red, gram=gram, sweeps=sweeps, sq_dists=sq)

    def ascend(lam, ev, it, damping, stopped, evaluate, exact_distances, start=None):
        """Newton iterations from ``lam`` (``ev`` its evaluation, ``damping`` the
        Levenberg-Marquardt weight) until the certificate meets ``tol``, ``it`` reaches
        ``max_iter`` or a line search fails; returns ``(lam, ev, it, damping, (feasible
        theta, certified gap))``, the certificates measuring distances exactly with
        ``exact_distances`` (else through the Gram matrix above ``_GRAM_ABOVE`` clients).
        ``start``: the repaired theta of a certificate at the same ``lam`` (phase 0's
        last): the first certificate only restores it (exactly)."""
        by_gram = gram and not exact_distances

        def cond(c):
            return (~c[5]) & (c[3] < max_iter)

        def body(c):
            lam, ev, _, it, damping, done, _ = c
            # Under vmap the members that have stopped still run this body (results
            # dropped); ``running`` keeps them from holding the inner loops open.
            running = ~done
            s, s_diag = _direction(red, mask, lam, ev, running, cg_iter, damping, direct_cap)
            # (s_diag is the fallback where clipping spoilt the Newton step)
            new, ev_new, ok, trials = _line_search(red, mask, lam, ev, s, s_diag, running, evaluate)
            damping = _next_damping(damping, trials, ok)
            lam = jnp.where(ok, new, lam)
            ev = jax.tree.map(lambda a, b: jnp.where(ok, a, b), ev_new, ev)
            th, delta = certify(ev, by_gram)
            # A failed line search means float precision is exhausted: stop there.
            stop = should_stop(delta, red, tol) | ~ok
            return lam, ev, (th, delta), it + 1, damping, stop, ok

        cert = certify(ev, by_gram) if start is None else restore_and_certify(start, ev.g, red)
        stop = should_stop(cert[1], red, tol) | stopped
        init = (lam, ev, cert, it, damping, stop, jnp.array(True))
        lam, ev, cert, it, damping, _, _ = jax.lax.while_loop(cond, body, init)
        return lam, ev, it, damping, cert

    # Phase 0: distances inside the evaluations from the Gram matrix (one product).
    # Phase 1: certified evaluations (exact distances below ``_GRAM_ABOVE`` clients), from
    # phase 0's last evaluation recertified (no new inverse, its repaired theta reused); it
    # iterates only where that misses ``tol`` (rare, float32 near ``tol``), so under vmap it
    # usually takes no trip, and its last certificate (exact distances) is the answer.
    # Two loops written out, not a loop over phases: that put a ``lax.cond`` around every
    # evaluation, costly on the CPU (bench README).
    fast = functools.partial(dual_eval, red=red, gram=True)
    exact = functools.partial(dual_eval, red=red, gram=gram, certify=True)

    ev = fast(lam0)
    damping = jnp.zeros((), red.w.dtype)
    lam, ev, it, damping, (th0, _) = ascend(lam0, ev, jnp.int32(0), damping, skip, fast, False)
    ev = certified(lam, ev, red, exact=not gram)
    lam, ev, it, _, cert = ascend(lam, ev, it, damping, skip, exact, True, start=th0)
    th, delta = cert
    state = ProjectionState(lam=lam, pair_dual=jnp.zeros((0, red.w.shape[1]), red.w.dtype))
    return SolverResult(th, state, delta, it, delta <= tol * red.scale)


def _line_search(red, mask, lam, ev, s, s_diag, running, evaluate):
    """Armijo search along the projected path of the Newton step ``s`` (31 halvings
    from 1), then, where all fail, of the diagonally scaled gradient step ``s_diag``
    (31 more), one loop (one compiled trial), the trials that concavity rules out
    passed over first: (point, evaluation, accepted, trials). From ``lam`` [n, n] (``ev``
    its evaluation); ``evaluate`` evaluates a trial point; where ``running`` is False
    nothing is evaluated."""
    # The same for every trial: the KKT residual and g's float resolution here.
    kkt, res = _kkt(red, mask, lam, ev), 64.0 * jnp.finfo(red.w.dtype).eps * jnp.abs(ev.g)

    def moved(alpha, step):  # the point on the projected path and its first-order gain
        new = symmetric(jnp.maximum(lam + alpha * step, 0.0))
        return new, pair_dot(ev.grad, new - lam)

    def trial(alpha, step):
        new, gain = moved(alpha, step)
        ev_new = evaluate(new)
        ok = (ev_new.g >= ev.g + 1e-4 * gain) & (ev_new.g > ev.g)
        # Below g's float resolution a step keeping g within it is accepted on a
        # smaller KKT residual (not one losing more: degenerate duals stalled).
        flat = (jnp.abs(gain) <= res) & (ev_new.g >= ev.g - res)
        ok = ok | (flat & (_kkt(red, mask, new, ev_new) < kkt))
        return new, ev_new, ok

    def next_alpha(alpha, count):  # trial ``count``'s step length (the fallback restarts)
        return jnp.where(count == _HALVINGS, 1.0, 0.5 * alpha)

    def direction(count):
        return jnp.where(count < _HALVINGS, s, s_diag)

    def hopeless(c):
        # g is concave, so g(new) <= g + gain: a trial whose first-order gain along
        # the projected path is below -res cannot pass and is passed over without its
        # evaluation (O(n^2), not O(n^3)). Where clipping at 0 spoils a Newton step
        # the first halvings are such trials: on the binding MLP at n = 1000 its two
        # hardest of six rounds took 45 and 47 evaluations instead of 56 (before
        # _REFINE_SPOILED, which mends most such steps first: 28 and 29 since).
        count = c[1]
        _, gain = moved(next_alpha(*c), direction(count))
        ruled_out = (gain < -res) & _PASS_OVER_HOPELESS
        return ruled_out & (count < 2 * _HALVINGS) & running

    def cond(c):
        return (~c[3]) & (c[4] < 2 * _HALVINGS) & running

    def body(c):
        count = c[4]
        alpha = next_alpha(c[0], count)
        new, ev_new, ok = trial(alpha, direction(count))
        return alpha, new, ev_new, ok, count + 1

    # The first trial (alpha = 1) runs inside the loop too, so that a member that is
    # not ``running`` evaluates nothing (under vmap a call outside the loop would run
    # for every member, also where its result is dropped). The trials passed over
    # count as trials (the damping rule sees the same counts).
    alpha_prev, count = jax.lax.while_loop(
        hopeless,
        lambda c: (next_alpha(*c), c[1] + 1),
        (jnp.asarray(2.0, lam.dtype), jnp.int32(0)),
    )
    init = (alpha_prev, lam, ev, jnp.array(False), count)
    out = jax.lax.while_loop(cond, body, init)
    return out[1], out[2], out[3], out[4]


def _kkt(red, mask, lam, ev):
    """The relative KKT residual at ``lam``: the largest ``|d^2 - r^2| / r^2`` over pairs
    with a positive multiplier and ``(d^2 - r^2) / r^2`` over pairs at 0 (``ev.grad`` is
    ``(d^2 - r^2) / 2``); dimensionless, 0 at the solution."""
    rel = 2.0 * ev.grad / jnp.where(mask, red.radius, 1.0) ** 2
    return jnp.max(jnp.where(mask, jnp.where(lam > 0, jnp.abs(rel), rel), 0.0))


def _next_damping(damping, trials, ok):
    """The Levenberg-Marquardt weight after a line search that took ``trials`` trials
    (1: the full Newton step; ``ok`` False: it failed): up by ``_DAMP_UP`` (to at least
    ``_DAMP_MIN``, at most ``_DAMP_MAX``) after more than ``_DAMP_TRIALS`` or a failure,
    down by ``_DAMP_DOWN`` after a full step (to 0 below ``_DAMP_MIN``), else unchanged.
    Dimensionless: ``_direction`` scales it by the largest Hessian diagonal."""
    up = (trials > _DAMP_TRIALS) | ~ok
    grown = jnp.clip(_DAMP_UP * damping, _DAMP_MIN, _DAMP_MAX)
    shrunk = jnp.where(_DAMP_DOWN * damping < _DAMP_MIN, 0.0, _DAMP_DOWN * damping)
    return jnp.where(up, grown, jnp.where(trials == 1, shrunk, damping))


def _direction(red, mask, lam, ev, running, cg_iter, damping=0.0, direct_cap=0):
    """(Newton step, diagonally scaled gradient step) at ``lam``; both [n, n].

    A pair at 0 stays fixed there when its constraint has slack (negative gradient), or when
    it is violated by less than ``_ENTER`` times the largest relative violation of such
    pairs: letting every slightly violated pair in at once overshoots, and the active set
    oscillates. Once the largest such violation is below ``_ENTER_ALL_BELOW`` of the squared
    radius (``(d^2 - r^2) / (2 r^2)``), the Newton model is close enough that every violated
    pair enters: the cut alone admitted them a few at a time, and the last iterations halved
    the violation each (captured runs: 5-16% fewer Newton iterations from n = 30 to 300;
    results/bench/README.md). Every pair with a positive multiplier is free: fixing those
    that the diagonal step takes below 0 (the textbook two-metric rule) dropped a quarter of
    a warm start's active pairs in one step at n = 300, which then came back a few an
    iteration (14.2 Newton iterations a projection against 10.4; results/bench/README.md);
    the refinement below fixes the ones that the Newton step itself takes below 0.
    The free pairs solve ``(H_FF + mu I) s_F = -(grad_F + H_FA s_A)`` by preconditioned
    CG (at most ``cg_iter`` steps, relative residual 0.1; Jacobi preconditioner), ``mu``
    the largest Hessian diagonal times ``eps + damping min(1, KKT residual)``
    (Levenberg-Marquardt; ``damping`` is 0 until a line search needs more than one
    halving, :func:`_next_damping`). Then, up to
    ``_REFINE`` times (``_REFINE_SPOILED`` passes in all while clipping at 0 leaves the
    step a negative first-order gain), the free pairs that the step takes below 0 are
    fixed at 0 too and CG resumes from the step on the pairs left free: the step's face
    is settled with Hessian products only, before the line search pays for an evaluation
    (``O(n^3)``), which halves the Newton iterations where many pairs change sign
    (``results/bench/README.md``). With ``direct_cap`` > 0 each of these systems is solved
    exactly (:func:`_pair_newton_step`) where its free pairs number at most ``direct_cap``.
    """
    eps = jnp.finfo(red.w.dtype).eps
    a_inv = ev.a_inv
    grad = symmetric(ev.grad)  # a Gram product may round (i, j) and (j, i) apart
    da = jnp.diag(a_inv)
    d2 = 2.0 * grad + jnp.where(mask, red.radius, 0.0) ** 2  # ||theta_i-theta_j||^2
    hdiag = jnp.where(mask, (da[:, None] + da[None, :] - 2.0 * a_inv) * d2, 0.0)
    mu = eps * jnp.max(hdiag) + jnp.finfo(red.w.dtype).tiny
    diag_step = grad / (hdiag + mu)
    # Levenberg-Marquardt: the weight ``damping`` (``_next_damping``) times the KKT
    # residual, so that damped steps turn into Newton steps near the solution.
    # (0 where undamped, also should the residual be NaN)
    lm = jnp.where(damping > 0, damping * jnp.minimum(_kkt(red, mask, lam, ev), 1.0), 0.0)
    mu = mu + lm * jnp.max(hdiag)
    pre = hdiag + mu
    at_zero = mask & (lam <= 0)
    active = at_zero & (grad < 0)
    rel = grad / jnp.where(mask, red.radius, 1.0) ** 2
    waiting = at_zero & (grad > 0)
    worst = jnp.max(jnp.where(waiting, rel, 0.0))
    cut = jnp.where(worst < _ENTER_ALL_BELOW, 0.0, _ENTER * worst)
    active = active | (waiting & (rel < cut))

    def solve(free, b, start=None, residual=None, stop=None, run=running):
        """CG on the free pairs for ``H_FF s_F + mu s_F = b`` from ``start`` (None: 0),
        whose residual is ``residual``; with ``direct_cap`` the system solved exactly
        where it is small enough, CG's loop then taking no trip. CG iterates only where
        ``run``."""

        def by_cg(run):
            op = lambda x: jnp.where(free, hvp(ev, mask, x) + mu * x, 0.0)
            x = _pcg(
                op,
                b,
                jnp.where(free, pre, 1.0),
                pair_dot,
                rtol=_CG_RTOL,
                max_iter=cg_iter,
                running=run,
                start=start,
                residual=residual,
                stop=stop,
            )
            return symmetric(x)

        if not direct_cap:
            return by_cg(run)
        rhs = b if residual is None else residual
        step, ok = _pair_newton_step(ev, free, rhs, mu, direct_cap)
        if start is not None:
            step = start + step
        # CG's loop runs only where the direct step failed: no lax.cond, which under vmap
        # would run both branches for every member
        return jnp.where(ok, step, by_cg(run & ~ok))

    def crossing(active, s):  # free pairs that the step takes below 0
        return mask & ~active & (lam + s < 0)

    # The pairs fixed here are at 0 (s_A = -lam_A = 0): the right-hand side is the
    # gradient itself. A refinement fixes the crossing pairs at -lam and resumes CG from
    # the step on the pairs left free, its residual ``grad - H s - mu s_F`` (``s`` the
    # whole step) measured by one product; it stops at the first solve's absolute
    # residual, ``_CG_RTOL |grad_F|``.
    free = mask & ~active
    b = jnp.where(free, grad, 0.0)
    stop = (_CG_RTOL**2) * pair_dot(b, b)
    s = solve(free, b, stop=stop)

    def refine(c):
        # (under vmap the members that need no further pass, ``go`` False, run this body
        # too: their CG takes no trip, and the loop drops their result)
        k, active, s, go = c
        cross = crossing(active, s)
        active = active | cross
        free = mask & ~active
        s = jnp.where(cross, -lam, s)
        r = jnp.where(free, grad - hvp(ev, mask, s) - mu * s, 0.0)
        s_free = solve(free, None, jnp.where(free, s, 0.0), r, stop, run=go)
        s = jnp.where(free, s_free, s)
        return k + 1, active, s, more(k + 1, active, s)

    def spoiled(s):  # the full step's first-order gain along its projected path < 0
        return pair_dot(grad, jnp.maximum(lam + s, 0.0) - lam) < 0

    spoiled_passes = _REFINE_SPOILED if _REFINE else 0  # _REFINE = 0: no refinement

    def more(k, active, s):  # whether pass k + 1 runs (once per pass, carried)
        again = (k < _REFINE) | ((k < spoiled_passes) & spoiled(s))
        return running & again & jnp.any(crossing(active, s))

    _, _, s, _ = jax.lax.while_loop(lambda c: c[3], refine, (0, active, s, more(0, active, s)))
    return s, jnp.where(mask, diag_step, 0.0)


def pair_hessian(m, i, j):
    """``(B^T m B)`` on the pairs ``(i, j)`` (index arrays ``[q]``): entry ``(a, b)`` is
    ``(e_ia - e_ja)^T m (e_ib - e_jb)``, ``[q, q]``, for a symmetric ``[n, n]`` ``m``."""
    rows = m[i] - m[j]  # [q, n]
    return rows[:, i] - rows[:, j]


def _pair_newton_step(ev, free, rhs, mu, cap):
    """``(H_FF + mu I)^-1 rhs_F`` on the free pairs, formed and factorized; (step, ok).

    The dual Hessian's product (:func:`~karula_jax.projection.pair_algebra.hvp`) is, pair
    by pair, ``H = (B^T A^-1 B) o (B^T G B)`` with ``A = M + L_lam``, ``G`` the Gram matrix
    of ``theta`` and ``B`` the pair incidence matrix: on the at most ``cap`` free pairs both
    factors are gathers of ``[n, n]`` matrices, independent of the coordinates. The system
    gets ``mu`` (as CG's) plus ``_DIRECT_RIDGE eps`` times its largest diagonal, padding rows
    the identity. ``rhs`` ``[n, n]`` symmetric, zero off ``free``; the step is symmetric
    to the bit, zero off ``free``. ``ok`` is False where the free pairs exceed ``cap``
    (then nothing is formed: a ``lax.cond``, both branches only under ``vmap``), the
    solve is not finite (a Cholesky factor of a matrix that rounding left indefinite) or
    its step is not an ascent direction, ``x . rhs <= 0`` (the CPU's elimination returns
    finite values for an indefinite matrix); then the caller takes CG.
    """
    n = free.shape[0]
    iu, ju = jnp.triu_indices(n, 1)
    on = free[iu, ju]
    count = jnp.sum(on)

    def formed():
        (idx,) = jnp.nonzero(on, size=cap, fill_value=0)
        valid = jnp.arange(cap) < count
        i, j = iu[idx], ju[idx]
        h = pair_hessian(ev.a_inv, i, j) * pair_hessian(ev.gram, i, j)
        h = jnp.where(valid[:, None] & valid[None, :], h, 0.0)
        ridge = mu + _DIRECT_RIDGE * jnp.finfo(h.dtype).eps * jnp.max(jnp.diag(h))
        h = h + jnp.diag(jnp.where(valid, ridge, 1.0))
        b = jnp.where(valid, rhs[i, j], 0.0)
        x = jnp.where(valid, _linalg.solve_spd(h, b), 0.0)
        ascent = (jnp.sum(x * b) > 0) | (count == 0)
        # padding entries add 0 to pair (0, 1), so a free pair (0, 1) keeps its value
        step = jnp.zeros_like(rhs).at[i, j].add(x).at[j, i].add(x)
        return step, jnp.all(jnp.isfinite(x)) & ascent

    def skipped():
        return jnp.zeros_like(rhs), jnp.array(False)

    return jax.lax.cond(count <= cap, formed, skipped)


def _pcg(op, b, pre, dot, *, rtol, max_iter, running=True, start=None, residual=None, stop=None):
    """Preconditioned conjugate gradients for ``op(x) = b`` (``op`` SPD) from ``start``
    (None: 0) until the squared residual norm is at most ``stop`` (None: ``rtol^2
    |b|^2``); no iteration when ``running`` is False. ``residual``: ``b - op(start)``
    where the caller has it (saves one ``op``); then ``b`` may be None only when
    ``start`` and ``stop`` are given."""
    if stop is None:
        stop = (rtol**2) * dot(b, b)
    x = jnp.zeros_like(b) if start is None else start
    if residual is not None:
        r = residual
    else:
        r = b if start is None else b - op(start)
    z = r / pre

    def cond(c):
        _, r, _, _, k = c
        return (dot(r, r) > stop) & (k < max_iter) & running

    def body(c):
        x, r, p, rz, k = c
        ap = op(p)
        curvature = dot(p, ap)
        # Rounding can leave no positive curvature along p once r is at rounding level:
        # then stop where x is (k = max_iter), rather than divide by it.
        ok = curvature > 0
        alpha = jnp.where(ok, rz / jnp.where(ok, curvature, 1.0), 0.0)
        x = x + alpha * p
        r = r - alpha * ap
        z = r / pre
        rz_new = dot(r, z)
        p = z + (rz_new / jnp.maximum(rz, jnp.finfo(r.dtype).tiny)) * p
        return x, r, p, rz_new, jnp.where(ok, k + 1, max_iter)

    return jax.lax.while_loop(cond, body, (x, r, z, dot(r, z), 0))[0]
