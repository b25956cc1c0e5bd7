"""The public projection: argument checks, flattening of pytrees, solver dispatch."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax import _platform
from karula_jax._checks import (
    check_positive,
    check_positive_int,
    is_concrete,
    personalized_flags,
)
from karula_jax.projection.contract import ProjectionState
from karula_jax.projection.reduction import client_mean, reduce_problem, sq_dists_exact
from karula_jax.projection.solvers import SOLVERS

__all__ = [
    "METHODS",
    "ProjectionInfo",
    "ProjectionState",
    "choose_method",
    "init_projection_state",
    "project",
    "registered_methods",
]

# "auto" picks a solver (choose_method); "none" skips the projection (an ablation). The
# registered solvers (karula_jax.projection.solvers.SOLVERS) are read at each call.
METHODS = ("auto", "none", *SOLVERS)


def registered_methods() -> tuple[str, ...]:
    """The ``method`` values :func:`project` accepts now: ``"auto"``, ``"none"`` and every
    solver of ``SOLVERS`` (read at call time, so a solver registered after import counts;
    :data:`METHODS` is the tuple at import)."""
    return ("auto", "none", *SOLVERS)


# "auto" takes the pair-copy Dykstra for a single pair only (n = 2, one pair kernel):
# from n = 3 the Laplacian dual is as fast on cold random problems and always converged,
# Dykstra not (results/bench/README.md, "Which solver auto picks").
_DYKSTRA_MAX_N = 2
_DYKSTRA_MAX_FLOATS = 1 << 20


def choose_method(n: int, p: int) -> str:
    """The solver ``method="auto"`` runs for ``n`` clients and ``p`` personalized numbers.

    ``"dykstra"`` when ``n <= 2`` (one pair) and its dual state ``n(n-1)/2 * p`` has at most
    ``2**20`` floats (4 MiB in float32), else ``"laplacian"``, whose state is ``n^2``
    scalars. The measurements behind these thresholds: ``results/bench/README.md``
    (section "Which solver auto picks").
    """
    small = n <= _DYKSTRA_MAX_N and n * (n - 1) // 2 * p <= _DYKSTRA_MAX_FLOATS
    return "dykstra" if small else "laplacian"


class ProjectionInfo(NamedTuple):
    """Diagnostics of one projection (scalars unless noted).

    Attributes:
      iterations: solver iterations used.
      max_violation: ``max_ij max(||theta_i - theta_j|| - r_ij, 0)`` on the returned
        point (absolute, computed from explicit differences; when the point is ``v``
        shrunk toward its mean, a bound on it from the rounding analysis instead).
      rel_violation: ``max_violation`` divided by the largest finite radius (by 1 when
        there is none or it is 0).
      delta: certified suboptimality ``1/2||theta - v||^2 - g(lam)`` (>= 0).
      rel_delta: ``delta / S`` with ``S = 1/2 sum_i ||v_i - mean(v)||^2``.
      converged: ``delta <= tol * S``.
      state: :class:`ProjectionState` to pass back as ``warm_start``.
    """

    iterations: jnp.ndarray  # [] int32
    max_violation: jnp.ndarray  # [] float
    rel_violation: jnp.ndarray  # [] float
    delta: jnp.ndarray  # [] float
    rel_delta: jnp.ndarray  # [] float
    converged: jnp.ndarray  # [] bool
    state: ProjectionState


def _relative(violation, radii_sq):
    """``violation`` over the largest finite radius (as is when no radius is positive)."""
    off = ~jnp.eye(radii_sq.shape[0], dtype=bool)
    r2 = jnp.max(jnp.where(off & jnp.isfinite(radii_sq), radii_sq, 0.0)).astype(violation.dtype)
    rmax = jnp.sqrt(jnp.maximum(r2, 0.0))
    return violation / jnp.where(rmax > 0, rmax, 1.0)


def _violation(out, radii_sq):
    """(max violation, relative violation) of ``out`` [n, p] against ``radii_sq``."""
    n = out.shape[0]
    r = jnp.sqrt(jnp.maximum(radii_sq.astype(out.dtype), 0.0))
    fin = jnp.isfinite(r) & ~jnp.eye(n, dtype=bool)
    viol = jnp.where(fin, jnp.sqrt(sq_dists_exact(out)) - jnp.where(fin, r, 0.0), 0.0)
    viol = jnp.maximum(jnp.max(viol), 0.0)
    return viol, _relative(viol, radii_sq)


class _Screen(NamedTuple):
    """What one Gram product tells before any solver runs (see :func:`_screen`)."""

    as_is: jnp.ndarray  # [] bool, every constraint provably holds at x
    beta: jnp.ndarray  # [] largest shrink toward the mean that provably holds, <= 1
    mean: jnp.ndarray  # [p] the client mean of x
    xc: jnp.ndarray  # [n, p] x minus its client mean
    violation: jnp.ndarray  # [] bound on the shrunk point's violation from rounding


def _screen(x, radii_sq) -> _Screen:
    """Screens ``x`` [n, p] against ``radii_sq`` by one Gram product (none when the
    triangle inequality on the centred rows' norms already settles every pair).

    The squared distances of the centred rows carry a rounding error below
    ``(p + 4) eps (|x_i|^2 + |x_j|^2)`` (dot products of length ``p``; the centring adds
    at most ``eps`` per coordinate), which is added, four times over, to give an upper
    bound ``U_ij``. Then

    * ``x`` is feasible as is when ``U_ij <= r_ij^2 (1 - 8 eps)`` for every pair (then
      ``x`` is its own projection, with multipliers 0; a pair too close to call sends
      the problem on);
    * the shrink ``mean + beta (x - mean)`` with ``beta^2 = min(1, min r_ij^2 (1 - 8 eps)
      / U_ij)`` is feasible, at objective ``(1 - beta)^2 S`` (``S = 1/2 sum_i ||x_i -
      mean||^2``) while the dual bound at ``lam = 0`` is 0: its certified gap is
      ``(1 - beta)^2 S``. Rounds that move models only a little leave the pairs that were
      active at their radius, too close for the first test but within tolerance here.
    """
    n, p = x.shape
    eps = jnp.finfo(x.dtype).eps
    margin = 4.0 * (p + 4) * eps
    mean = client_mean(x)
    xc = x - mean
    sq = jnp.sum(xc * xc, axis=1)
    r2 = radii_sq.astype(x.dtype) * (1.0 - 8.0 * eps)
    constrained = ~jnp.eye(n, dtype=bool) & ~jnp.isposinf(r2)
    # First the triangle inequality, O(n p): |x_i - x_j| <= |xc_i| + |xc_j|. When it
    # settles every pair (models far inside their radii) the Gram product is skipped.
    norms = jnp.sqrt(sq)
    triangle = (norms[:, None] + norms[None, :]) ** 2 * (1.0 + margin)

    def gram():
        both = sq[:, None] + sq[None, :]
        return both - 2.0 * (xc @ xc.T) + margin * both

    far = jnp.all((triangle <= r2) | ~constrained)
    upper = jax.lax.cond(far, lambda: triangle, gram)
    as_is = jnp.all((upper <= r2) | ~constrained)
    ratio = jnp.where(constrained & (upper > 0), r2 / jnp.where(upper > 0, upper, 1.0), 1.0)
    beta = jnp.sqrt(jnp.clip(jnp.min(ratio), 0.0, 1.0))
    # The shrunk rows x_i - (1 - beta) xc_i differ by beta (x_i - x_j) exactly, plus the
    # rounding of that sum: at most 2 eps (|x_i| + |x_j|) in norm.
    norm = jnp.sqrt(jnp.sum(x * x, axis=1))
    r = jnp.sqrt(jnp.maximum(radii_sq.astype(x.dtype), 0.0))
    excess = beta * jnp.sqrt(upper) + 2.0 * eps * (norm[:, None] + norm[None, :]) - r
    violation = jnp.maximum(jnp.max(jnp.where(constrained, excess, 0.0)), 0.0)
    return _Screen(as_is, beta, mean, xc, violation)


def _exact_info(dtype, state) -> ProjectionInfo:
    """The report of a projection that returned its input: exact, no iterations."""
    zero = jnp.zeros((), dtype)
    return ProjectionInfo(
        iterations=jnp.int32(0),
        max_violation=zero,
        rel_violation=zero,
        delta=zero,
        rel_delta=zero,
        converged=jnp.array(True),
        state=state,
    )


def _project_core(x, radii_sq, state, tol, max_iter, *, method):
    """Core on flattened personalized coordinates. x: [n, p] -> ([n, p], info).

    ``tol`` and ``max_iter`` are traced scalars so that changing them never recompiles.
    Before the solver, :func:`_screen` returns ``x`` itself when it is feasible, its
    shrink toward the mean when that is certified within ``tol``, or, when every radius
    is 0 (t = 0), the mean in every row, which is then the exact projection. In all three
    cases the multipliers are 0 and the solver, ``O(n^3 + n^2 p)`` per evaluation, is
    skipped.
    """
    # Full-precision float32 products: GPUs otherwise multiply float32 in TF32 (a 10-bit
    # mantissa), too coarse for the screen's rounding bound and the dual certificate.
    with jax.default_matmul_precision("highest"):
        return _project_branches(x, radii_sq, state, tol, max_iter, method=method)


def _project_branches(x, radii_sq, state, tol, max_iter, *, method):
    zero_state = jax.tree.map(lambda a: jnp.zeros(a.shape, x.dtype), state)
    screen = _screen(x, radii_sq)
    # Every pair at radius 0 (t = 0 in a CV grid): the feasible set is {all rows equal},
    # whose nearest point is the mean (the shrink at beta = 0), exactly: no gap, and
    # the mean itself in every row, so no violation either.
    consensus = jnp.all((radii_sq == 0) | jnp.eye(x.shape[0], dtype=bool))
    gap = jnp.where(consensus, 0.0, (1.0 - screen.beta) ** 2)  # relative to S

    def shrink():
        scale = 0.5 * jnp.sum(screen.xc * screen.xc)
        mean = jnp.broadcast_to(screen.mean, x.shape)
        out = jnp.where(consensus, mean, x - (1.0 - screen.beta) * screen.xc)
        violation = jnp.where(consensus, 0.0, screen.violation)
        info = _exact_info(x.dtype, zero_state)._replace(
            max_violation=violation,
            rel_violation=_relative(violation, radii_sq),
            delta=gap * scale,
            rel_delta=gap,
        )
        return out, info

    certified = (gap <= tol) & jnp.isfinite(screen.violation)  # NaN input: to the solver
    branch = jnp.where(screen.as_is, 0, jnp.where(certified, 1, 2))
    return jax.lax.switch(
        branch,
        [
            lambda: (x, _exact_info(x.dtype, zero_state)),
            shrink,
            # Under vmap every branch runs for every member: ``skip`` stops the
            # solver's loop at once for members that a screen has answered.
            lambda: _solve(x, radii_sq, state, tol, max_iter, method=method, skip=branch != 2),
        ],
    )


def _solve(x, radii_sq, state, tol, max_iter, *, method, skip=False):
    n, p = x.shape
    dtype = x.dtype
    solver = SOLVERS[method]
    red = reduce_problem(x, radii_sq, rotate=solver.rotate(n, p))
    # A warm start is a hint: non-finite entries (a traced state from a failed call) start
    # those pairs cold instead of spoiling the solve.
    finite = lambda a: jnp.where(jnp.isfinite(a), a, 0.0).astype(dtype)
    pair_dual = finite(state.pair_dual)
    if red.basis is not None:
        pair_dual = pair_dual @ red.basis
    warm = ProjectionState(lam=finite(state.lam), pair_dual=pair_dual)
    res = solver.solve(red, warm, tol=tol, max_iter=max_iter, skip=skip)
    th, lam, delta, it, done = res.theta, res.state.lam, res.gap, res.iterations, res.converged
    pair_dual = res.state.pair_dual
    if red.basis is not None:
        pair_dual = pair_dual @ red.basis.T
    # Add the (small) move to v itself, so that clients that do not move come back
    # bit for bit; merged clients take their component's mean plus the move.
    move = th - red.w
    move = move if red.basis is None else move @ red.basis.T
    alone = (red.count[red.labels] == 1)[:, None]
    out = jnp.where(alone, x, red.mu + red.wbar[red.labels]) + move[red.labels]
    viol, rel_viol = _violation(out, radii_sq)
    scale = red.scale
    info = ProjectionInfo(
        iterations=it.astype(jnp.int32),
        max_violation=viol,
        rel_violation=rel_viol,
        delta=delta,
        rel_delta=delta / jnp.where(scale > 0, scale, 1.0),
        converged=done,
        state=ProjectionState(lam=lam, pair_dual=pair_dual),
    )
    return out, info


@functools.cache
def _members_in_turn(method: str):
    """:func:`_project_core` for ``method``, which under ``vmap`` on the CPU solves the
    batch members one after another (``lax.map``) instead of in lockstep.

    A vmapped ``while_loop`` runs its body on every member until the slowest stops, so a
    batch of projections costs its largest iteration count times the batch; in turn, each
    member pays its own (``docs/implementation_notes.md``). On accelerators, where the
    lockstep batch runs in parallel, members stay vmapped. Nested ``vmap``: every level
    is taken in turn. Results equal the vmapped ones up to float rounding.
    """
    core = functools.partial(_project_core, method=method)

    @jax.custom_batching.custom_vmap
    def solve(x, radii_sq, state, tol, max_iter):
        return core(x, radii_sq, state, tol, max_iter)

    @solve.def_vmap
    def _rule(axis_size, in_batched, *args):
        del axis_size
        leaves, tree = jax.tree.flatten(args)
        flags = jax.tree.leaves(in_batched)
        if not _platform.members_in_turn():
            axes = jax.tree.unflatten(tree, [0 if b else None for b in flags])
            out = jax.vmap(core, in_axes=tuple(axes))(*args)
        else:

            def one(member):
                given = iter(member)
                full = [next(given) if b else a for a, b in zip(leaves, flags, strict=True)]
                return solve(*jax.tree.unflatten(tree, full))

            out = jax.lax.map(one, [a for a, b in zip(leaves, flags, strict=True) if b])
        return out, jax.tree.map(lambda _: True, out)

    return solve


def _project_members(x, radii_sq, state, tol, max_iter, *, method):
    return _members_in_turn(method)(x, radii_sq, state, tol, max_iter)


# One compiled program per shape and method (tests wrap _project_core with
# chex.assert_max_traces and jit it the same way to prove it).
_project_flat = jax.jit(_project_members, static_argnames=("method",))


# ------------------------------------------------------------------- public API


def _split(v, personalized):
    leaves, treedef = jax.tree.flatten(v)
    if not leaves:
        raise ValueError("v: expected a pytree with at least one array leaf, got none")
    _check_values(leaves)
    mask = jax.tree.leaves(personalized_flags(personalized, v))
    n = None
    for leaf in leaves:
        shape = jnp.shape(leaf)
        if len(shape) < 1:
            raise ValueError("v: every leaf needs a leading client axis, got a scalar leaf")
        if n is None:
            n = shape[0]
        elif shape[0] != n:
            raise ValueError(f"v: leaves disagree on the client axis: {n} and {shape[0]} clients")
    if n == 0:
        raise ValueError("v: expected at least one client on the leading axis, got 0")
    return leaves, treedef, mask, n


def _flat_dim(leaves, mask) -> int:
    return int(sum(int(np.prod(jnp.shape(x)[1:])) for x, m in zip(leaves, mask, strict=True) if m))


def _compute_dtype(dt):
    """The float type a leaf of dtype ``dt`` is projected in: at least float32 (LAPACK has
    no half precision), the default float for integers and bools."""
    if not jnp.issubdtype(dt, jnp.floating):
        return jnp.result_type(float)
    return jnp.promote_types(dt, jnp.float32)


def _flat_dtype(leaves, mask):
    dts = [_compute_dtype(jnp.result_type(x)) for x, m in zip(leaves, mask, strict=True) if m]
    return jnp.result_type(*dts) if dts else jnp.float32


def _out_dtype(x):
    """Floating leaves come back in their own dtype; integer leaves as floats (a projection
    of integers is not an integer)."""
    dt = jnp.result_type(x)
    return dt if jnp.issubdtype(dt, jnp.floating) else jnp.result_type(float)


def _check_values(leaves) -> None:
    for i, leaf in enumerate(leaves):
        try:
            dt = jnp.result_type(leaf)
        except TypeError as e:
            got = type(leaf).__name__
            raise TypeError(f"v: leaf {i} is a {got}, not an array of numbers ({e})") from e
        if jnp.issubdtype(dt, jnp.complexfloating) or not (
            jnp.issubdtype(dt, jnp.number) or jnp.issubdtype(dt, jnp.bool_)
        ):
            raise TypeError(f"v: leaf {i} has dtype {dt}; expected real (float or integer) arrays")
        if is_concrete(leaf) and jnp.issubdtype(dt, jnp.floating):
            a = np.asarray(leaf)
            if not np.isfinite(a).all():
                raise ValueError(
                    f"v: leaf {i} (shape {a.shape}) contains NaN or inf; expected finite models"
                )


def _check_radii(radii_sq, n: int) -> None:
    try:
        dt = jnp.result_type(radii_sq)
    except TypeError:
        dt = None
    if dt is None or not (jnp.issubdtype(dt, jnp.integer) or jnp.issubdtype(dt, jnp.floating)):
        got = type(radii_sq).__name__ if dt is None else dt
        raise TypeError(f"radii_sq: expected a real [{n}, {n}] array of squared radii, got {got}")
    shape = jnp.shape(radii_sq)
    if shape != (n, n):
        raise ValueError(f"radii_sq: expected shape ({n}, {n}) (clients of v), got {shape}")
    if not is_concrete(radii_sq):
        return
    r = np.asarray(radii_sq, dtype=np.float64)
    off = ~np.eye(n, dtype=bool)
    if np.isnan(r[off]).any():
        raise ValueError("radii_sq: contains NaN; expected values in [0, inf]")
    if (r[off] < 0).any():
        raise ValueError("radii_sq: contains negative entries; expected values in [0, inf]")
    fin = np.isfinite(r) & np.isfinite(r.T)
    mism = (np.isinf(r) != np.isinf(r.T)) & off
    rf = np.where(fin, r, 0.0)
    tol = 1e-6 * np.maximum(np.abs(rf), np.abs(rf.T))
    if mism.any() or (np.abs(rf - rf.T) > tol).any():
        raise ValueError("radii_sq: expected a symmetric matrix (radii_sq == radii_sq.T)")


def _radii_ok(radii_sq):
    """Traced twin of :func:`_check_radii`'s value checks that change the answer: a bool,
    True when no entry off the diagonal is NaN or negative and no infinite radius faces a
    finite one. (A finite asymmetry is not flagged: the solver takes the smaller of
    ``r_ij`` and ``r_ji``, and ``t * D`` of a ``D`` symmetric to ``karula``'s tolerance
    may differ in the last digits.)"""
    r = jnp.asarray(radii_sq)
    r = r.astype(jnp.promote_types(r.dtype, jnp.float32))
    off = ~jnp.eye(r.shape[0], dtype=bool)
    ok = ~jnp.isnan(r) & (r >= 0) & (jnp.isinf(r) == jnp.isinf(r.T))
    return jnp.all(~off | ok)


def _traced_inputs_ok(radii_sq, shared, tol):
    """None when ``radii_sq``, the ``shared`` leaves and ``tol`` are all concrete (their
    checks ran eagerly; ``max_iter`` must be), else a traced bool, False when one of the traced
    ones fails what the eager checks demand (the personalized leaves' NaN/inf the solver
    reports itself)."""
    ok = None

    def both(a, b):
        return b if a is None else a & b

    if not is_concrete(radii_sq):
        ok = both(ok, _radii_ok(radii_sq))
    for x in shared:
        if not is_concrete(x) and jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            ok = both(ok, jnp.all(jnp.isfinite(x)))
    if not is_concrete(tol):
        ok = both(ok, jnp.isfinite(tol) & (tol > 0))
    return ok


def _invalidated(out, info, ok):
    """``out`` (leaves) and ``info`` as they are where ``ok``, else every floating leaf NaN
    and the report unconverged with a NaN gap: an input that the eager checks would have
    refused, arriving traced, is never answered with a certified point."""
    if ok is None:
        return out, info
    nan = lambda a: jnp.where(ok, a, jnp.nan) if jnp.issubdtype(a.dtype, jnp.inexact) else a
    info = info._replace(
        delta=nan(info.delta),
        rel_delta=nan(info.rel_delta),
        max_violation=nan(info.max_violation),
        rel_violation=nan(info.rel_violation),
        converged=info.converged & ok,
    )
    return [nan(jnp.asarray(a)) for a in out], info


def _warm_state(warm_start, zero_state, method):
    """``warm_start`` checked against the state ``method`` carries (``zero_state``'s
    shapes, finite where concrete), or ``zero_state`` for None."""
    if warm_start is None:
        return zero_state
    want = jax.tree.map(jnp.shape, zero_state)
    got = jax.tree.map(jnp.shape, warm_start)
    if not isinstance(warm_start, ProjectionState) or want != got:
        raise ValueError(
            f"warm_start: expected a ProjectionState with shapes {want} "
            f"(method={method!r}), got {got}"
        )
    for name, a in zip(ProjectionState._fields, warm_start, strict=True):
        if is_concrete(a) and not np.isfinite(np.asarray(a)).all():
            raise ValueError(
                f"warm_start.{name} contains NaN or inf; expected the finite state of an "
                "earlier projection (info.state), or None for a cold start"
            )
    return warm_start


def _check_options(method, tol, max_iter) -> None:
    if method not in registered_methods():
        raise ValueError(f"method: expected one of {registered_methods()}, got {method!r}")
    check_positive("tol", tol)
    check_positive_int("max_iter", max_iter)


def init_projection_state(v, radii_sq=None, *, personalized=True, method="auto"):
    """Zero dual state of the fixed shape that :func:`project` carries.

    Args:
      v: pytree of client-stacked leaves ``[n, ...]`` (only shapes are used).
      radii_sq: unused except for a shape check (may be None).
      personalized: True, False or a pytree of bools like ``v`` (as in :func:`project`).
      method: one of :data:`METHODS` (``"auto"``: see :func:`choose_method`).

    Returns:
      :class:`ProjectionState` with ``lam`` ``[n, n]`` and ``pair_dual``
      ``[n(n-1)/2, p]`` for a solver with per-pair state (``"dykstra"``), else ``[0, p]``;
      ``p`` the flattened size of the personalized leaves.
    """
    _check_options(method, 1.0, 1)
    leaves, _, mask, n = _split(v, personalized)
    if radii_sq is not None and jnp.shape(radii_sq) != (n, n):
        raise ValueError(f"radii_sq: expected shape ({n}, {n}), got {jnp.shape(radii_sq)}")
    p = _flat_dim(leaves, mask)
    dtype = _flat_dtype(leaves, mask)
    if method == "auto":
        method = choose_method(n, p)
    pair_state = method in SOLVERS and SOLVERS[method].pair_state
    m = n * (n - 1) // 2 if pair_state else 0
    return ProjectionState(lam=jnp.zeros((n, n), dtype), pair_dual=jnp.zeros((m, p), dtype))


def project(
    v,
    radii_sq,
    *,
    personalized=True,
    method: str = "auto",
    tol: float = 1e-6,
    max_iter: int = 500,
    warm_start: ProjectionState | None = None,
):
    r"""Certified projection of client models onto the pairwise-distance set.

    Solves ``min_theta 1/2 sum_i ||theta_i - v_i||^2`` subject to
    ``||theta_i - theta_j||^2 <= radii_sq[i, j]`` for all ``i < j`` (norm over all
    personalized leaves jointly), with shared leaves set to their mean over clients.
    The result is always feasible (up to float rounding of the final sums), and
    ``info.delta`` certifies how far its objective is from the optimum.

    Works under ``jit``, ``vmap`` (on the CPU the members are solved in turn) and ``lax.scan``
    with traced ``v``, ``radii_sq`` and ``warm_start``; ``method`` and ``max_iter`` are
    static, ``tol`` is meant to be (a traced one is accepted). Value checks raise on
    concrete inputs. Under tracing, a NaN/inf in a personalized leaf of ``v`` ends the
    solver at once with ``info.converged = False`` and a NaN ``delta``; radii the checks
    would refuse (NaN or negative off the diagonal, an inf facing a finite radius; a
    finite asymmetry is solved with the smaller radius), a NaN/inf in a shared leaf or a
    traced ``tol`` that is not finite and positive make every floating leaf of the result
    NaN, with ``info.converged = False`` and a NaN ``delta``; non-finite entries of a
    traced ``warm_start`` are read as 0 (a cold start there).

    Dtypes: solved in the widest dtype of the personalized leaves, at least float32
    (float16/bfloat16 leaves are promoted, then rounded back, and ``info.max_violation``
    is that of the rounded result). Integer leaves come back as floats.

    Always check ``info.converged``: a solver that hits ``max_iter`` returns a feasible
    point whose suboptimality is ``info.delta``, larger than requested.

    Args:
      v: pytree of arrays with a leading client axis ``[n, ...]``.
      radii_sq: array ``[n, n]``, squared radii ``t * D``: symmetric, ``>= 0``, ``inf``
        for no constraint; the diagonal is ignored. Zero radii merge clients exactly.
      personalized: True (default: every leaf constrained), False (every leaf shared,
        set to the mean) or a pytree of Python bools like ``v`` (True: constrained, False:
        shared), the meaning it has in every algorithm factory. None is refused.
      method: a solver of ``karula_jax.projection.solvers.SOLVERS``: ``"dykstra"``
        (cyclic Dykstra over all pairs; state ``O(n^2 p)``), ``"laplacian"`` (Newton dual
        ascent on the ``n x n`` multipliers), ``"laplacian_direct"`` (the same, each Newton
        system on at most ``min(8n, 2048)`` free pairs factorized instead of solved by CG,
        where the models span at least ``2n / 3`` dimensions; else the CG solver) or
        ``"fista"`` (accelerated projected gradient
        on the same multipliers, fixed-trip blocks; slower on the CPU); ``"auto"``:
        :func:`choose_method` of the static ``n`` and ``p``; ``"none"``: no projection (an
        ablation: ``v`` is returned as is, with a report of zeros and ``warm_start``, of any
        solver, passed through).
      tol: stop when ``delta <= tol * S``, ``S = 1/2 sum_i ||v_i - mean(v)||^2`` over
        the personalized leaves (the objective of collapsing to the mean).
      max_iter: iteration cap (the loop checks the certificate every 10 iterations).
      warm_start: a previous :class:`ProjectionState` of the same method and shapes
        (e.g. ``info.state`` of the last call), or None for a cold start.

    Returns:
      ``(theta, info)``: ``theta`` has the structure and shapes of ``v``; ``info`` is a
      :class:`ProjectionInfo`.

    Raises:
      ValueError: bad shapes, no clients, NaN/inf in a concrete ``v``,
        negative/NaN/asymmetric radii, mask structure mismatch, unknown method, bad
        ``tol``/``max_iter`` or a ``warm_start`` of the wrong shape or with NaN/inf.
      TypeError: complex/non-numeric leaves in ``v`` or ``radii_sq``, non-bool mask leaves.

    Examples:
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> from karula_jax.projection import project
      >>> v = jnp.array([[0.0], [4.0], [8.0]])  # three clients, one parameter each
      >>> theta, info = project(v, jnp.full((3, 3), 4.0))  # every pair at most 2 apart
      >>> np.round(np.asarray(theta[:, 0]), 3).tolist()
      [3.0, 4.0, 5.0]
      >>> bool(info.converged), float(info.max_violation) <= 1e-6
      (True, True)
    """
    _check_options(method, tol, max_iter)
    leaves, treedef, mask, n = _split(v, personalized)
    _check_radii(radii_sq, n)
    pers = [x for x, m in zip(leaves, mask, strict=True) if m]
    out = [None] * len(leaves)
    for idx, (x, m) in enumerate(zip(leaves, mask, strict=True)):
        if not m:
            x = jnp.asarray(x)
            mean = client_mean(x.astype(_compute_dtype(x.dtype)))
            out[idx] = jnp.broadcast_to(mean[None], x.shape).astype(_out_dtype(x))
    dtype = _flat_dtype(leaves, mask)
    p = _flat_dim(leaves, mask)
    if method == "auto":
        method = choose_method(n, p)
    zero_state = init_projection_state(v, personalized=personalized, method=method)
    if method == "none":  # any state passes through (e.g. a solver's, for a timing twin)
        ok = warm_start is None or (
            isinstance(warm_start, ProjectionState) and jnp.shape(warm_start.lam) == (n, n)
        )
        if not ok:
            raise ValueError(f"warm_start: expected None or a ProjectionState with lam [{n}, {n}]")
        return v, _exact_info(dtype, zero_state if warm_start is None else warm_start)
    state = _warm_state(warm_start, zero_state, method)
    shared = [x for x, m in zip(leaves, mask, strict=True) if not m]
    ok = _traced_inputs_ok(radii_sq, shared, tol)
    if not pers or p == 0 or n == 1:
        for idx, (x, m) in enumerate(zip(leaves, mask, strict=True)):
            if m:
                out[idx] = jnp.asarray(x).astype(_out_dtype(x))
        out, info = _invalidated(out, _exact_info(dtype, state), ok)
        return jax.tree.unflatten(treedef, out), info
    flat = jnp.concatenate([jnp.reshape(x, (n, -1)).astype(dtype) for x in pers], axis=1)
    theta, info = _project_flat(
        flat,
        jnp.asarray(radii_sq),
        state,
        jnp.asarray(tol, dtype),
        jnp.asarray(max_iter, jnp.int32),
        method=method,
    )
    start = 0
    for idx, (x, m) in enumerate(zip(leaves, mask, strict=True)):
        if m:
            shape = jnp.shape(x)
            size = int(np.prod(shape[1:]))
            out[idx] = theta[:, start : start + size].reshape(shape).astype(_out_dtype(x))
            start += size
    if any(jnp.result_type(out[i]) != dtype for i, m in enumerate(mask) if m):
        # A narrower output dtype rounds the solution: report the violation it really has.
        narrow = jnp.concatenate(
            [jnp.reshape(out[i], (n, -1)).astype(dtype) for i, m in enumerate(mask) if m], axis=1
        )
        viol, rel_viol = jax.jit(_violation)(narrow, jnp.asarray(radii_sq))
        info = info._replace(max_violation=viol, rel_violation=rel_viol)
    out, info = _invalidated(out, info, ok)
    return jax.tree.unflatten(treedef, out), info
