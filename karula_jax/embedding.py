r"""Client dissimilarities from a linear optimal-transport embedding.

Every client ``i`` holds samples ``z = concat(x, c * y_enc)`` in a joint feature-label
space. A reference set ``D0`` of ``N0`` points is shared by all clients. Each client solves
one entropic OT problem (ott-jax Sinkhorn, Euclidean ground cost, i.e. W1) between the
uniform measure on ``D0`` and the uniform measure on its own samples, and reports the
barycentric (Monge) image of the reference points,

.. math::

    M_i = N_0 \, P_i Z_i \in \mathbb{R}^{N_0 \times d_z}, \qquad \Phi_i = M_i - D_0.

The dissimilarity of two clients compares their images point by point:

.. math::

    D_{ij} = \frac{1}{N_0} \sum_{k=1}^{N_0} \lVert M_i[k] - M_j[k] \rVert_2
    \quad(\text{``row''}), \qquad
    D_{ij} = \frac{1}{\sqrt{N_0}} \lVert M_i - M_j \rVert_1 \quad(\text{``l1''}).

The row norm is a linearized W1 in the data's own units and a metric; the entrywise L1
variant is the paper's formula. All clients are padded to ``N_max`` rows with zero weight and
solved by one vmapped, jit-compiled Sinkhorn kernel.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax._checks import (
    check_finite,
    check_key,
    check_nonnegative,
    check_positive,
    check_positive_int,
    concrete,
    is_concrete,
)
from karula_jax.data.clients import ClientData

__all__ = [
    "EmbedOutput",
    "EmbeddingInfo",
    "dissimilarities",
    "embed",
    "gaussian_reference",
    "joint_samples",
    "pairwise_from_embeddings",
]

# Absolute entropic regularization, calibrated on FEMNIST digits (transport costs around 10;
# docs/implementation_notes.md). Absolute, so data on a very different scale may need another
# value.
DEFAULT_EPSILON = 0.05
DEFAULT_THRESHOLD = 1e-3
DEFAULT_MAX_ITERATIONS = 5000
# Lehmann's adaptive over-relaxation is set at this iteration from the observed error decay
# (why this iteration and not another: docs/implementation_notes.md).
DEFAULT_MOMENTUM_START = 50
# Clients solved at once (lax.map over vmapped batches): memory O(batch * N0 * N_max) in the
# solver, and a batch stops with its own slowest client instead of the slowest of all.
DEFAULT_BATCH_SIZE = 16
# The accelerated run stops at this fraction of ``threshold`` (cheap at its rate), so the
# answer barely depends on which error evaluation it stops at (e.g. under padding).
_FAST_TOL = 0.3
_NORMS = ("row", "l1")


class EmbedOutput(NamedTuple):
    """Per-client OT solutions returned by :func:`embed`.

    Attributes:
      maps: barycentric images ``M_i = N0 * P_i @ Z_i``, shape ``[n, N0, dz]``.
      plans: transport plans ``P_i``, shape ``[n, N0, N_max]`` (zero on padded columns), or
        None when not requested.
      converged: whether Sinkhorn met ``threshold`` within ``max_iterations``, ``[n]`` bool.
      iterations: Sinkhorn iterations run, ``[n]`` int32.
      marginal_error: ``||P_i^T 1 - b_i||_1 + ||P_i 1 - a||_1`` of the returned plan, ``[n]``.
    """

    maps: jnp.ndarray  # [n, N0, dz] float32
    plans: jnp.ndarray | None  # [n, N0, N_max] float32
    converged: jnp.ndarray  # [n] bool
    iterations: jnp.ndarray  # [n] int32
    marginal_error: jnp.ndarray  # [n] float32


class EmbeddingInfo(NamedTuple):
    """Diagnostics returned by :func:`dissimilarities`.

    Attributes:
      converged: per-client Sinkhorn convergence, ``[n]`` bool. Check ``converged.all()``:
        a non-converged solve gives an unreliable row of ``D``.
      iterations: Sinkhorn iterations per client, ``[n]`` int32.
      marginal_error: L1 marginal violation of each client's plan (both sides), ``[n]``.
      reference: the reference set ``D0``, ``[N0, dz]``.
      embeddings: ``Phi_i = M_i - D0``, ``[n, N0, dz]``; the only thing a client sends.
      epsilon: the entropic regularization used (absolute).
    """

    converged: jnp.ndarray  # [n] bool
    iterations: jnp.ndarray  # [n] int32
    marginal_error: jnp.ndarray  # [n] float32
    reference: jnp.ndarray  # [N0, dz] float32
    embeddings: jnp.ndarray  # [n, N0, dz] float32
    epsilon: float


def joint_samples(
    clients: ClientData, *, num_classes: int | None = None, label_scale: float = 1.0
) -> jnp.ndarray:
    """Stacks each client's samples into the joint space ``z = concat(x, c * y_enc)``.

    Args:
      clients: padded client data, ``x`` of shape ``[n, N_max, ...]``.
      num_classes: if given, ``y`` holds integer labels ``[n, N_max]`` that enter one-hot;
        otherwise ``y`` is a regression target, flattened per sample.
      label_scale: the factor ``c`` on the label block.

    Returns:
      Array of shape ``[n, N_max, dz]``, ``dz = prod(feature_shape) + label_dim``; padded
      rows are zero.
    """
    if not isinstance(clients, ClientData):
        raise TypeError(f"clients must be a ClientData, got {type(clients).__name__}")
    check_nonnegative("label_scale", label_scale)
    if clients.counts.ndim != 1:
        raise ValueError(
            f"clients must be one data set (counts of shape [n]), got counts of shape "
            f"{clients.counts.shape}; vmap over stacked data sets"
        )
    n, n_max = clients.x.shape[:2]
    x = jnp.reshape(clients.x, (n, n_max, -1)).astype(jnp.float32)
    if num_classes is not None:
        num_classes = check_positive_int("num_classes", num_classes)
        if clients.y.ndim != 2:
            raise ValueError(
                f"with num_classes, y must hold one integer label per sample ([n, N_max]), "
                f"got shape {clients.y.shape}"
            )
        if is_concrete(clients.y, clients.counts):
            y_np = np.asarray(clients.y)
            real = y_np[np.asarray(clients.mask)]
            if real.size and (
                not np.all(real == np.round(real)) or real.min() < 0 or real.max() >= num_classes
            ):
                raise ValueError(f"y must hold integer labels in [0, {num_classes})")
        y_enc = jax.nn.one_hot(clients.y.astype(jnp.int32), int(num_classes), dtype=jnp.float32)
    else:
        y_enc = jnp.reshape(clients.y, (n, n_max, -1)).astype(jnp.float32)
    z = jnp.concatenate([x, label_scale * y_enc], axis=-1)
    # Padding must be inert everywhere (a one-hot of label 0 is not).
    return jnp.where(clients.mask[..., None], z, 0.0)


def gaussian_reference(
    samples: ClientData | jnp.ndarray,
    counts: jnp.ndarray | None = None,
    *,
    num_reference: int = 100,
    key: jax.Array,
    num_classes: int | None = None,
    label_scale: float = 1.0,
) -> jnp.ndarray:
    r"""Draws the reference set from a Gaussian fitted by federated averaging.

    Each client computes its own mean :math:`\mu_i` and covariance :math:`\Sigma_i`
    (normalized by :math:`N_i`); the server averages them with weights
    :math:`w_i = N_i / \sum_j N_j`:

    .. math:: \mu = \sum_i w_i \mu_i, \qquad \Sigma = \sum_i w_i \Sigma_i,

    and draws ``num_reference`` points from :math:`\mathcal N(\mu, \Sigma)`. The reference
    depends on the data only through :math:`(\mu_i, \Sigma_i, N_i)`. To draw without
    forming or factorizing the ``dz x dz`` matrix :math:`\Sigma` (an eigendecomposition costs
    about a second at ``dz = 794`` on a CPU), each client's covariance is represented by its
    own square root :math:`C_i^\top / \sqrt{N_i}` (``C_i``: its centred rows), and

    .. math:: D_0[k] = \mu + \sum_i \sqrt{w_i}\, C_i^\top \xi_{ik} / \sqrt{N_i},
       \qquad \xi_{ik} \sim \mathcal N(0, I_{N_i}),

    which is exactly :math:`\mathcal N(\mu, \Sigma)` (singular :math:`\Sigma`, e.g. blank
    pixels, is fine). Cost ``O(N0 * sum_i N_i * dz)``.

    Args:
      samples: a :class:`ClientData`, or joint samples of shape ``[n, N_max, dz]``.
      counts: samples per client ``[n]``; taken from ``samples`` when it is a ClientData.
      num_reference: ``N0``, number of reference points.
      key: PRNG key for the draw.
      num_classes: one-hot label size when ``samples`` is a ClientData (classification).
      label_scale: label factor when ``samples`` is a ClientData.

    Returns:
      Reference set of shape ``[N0, dz]``, float32.

    Raises:
      ValueError: ``samples`` not ``[n, N_max, dz]`` or not finite, ``counts`` not ``[n]``
        or outside ``[1, N_max]`` (an empty client has no mean), bad ``num_reference``.
      TypeError: ``key`` is not one PRNG key, or non-integer ``counts``/``num_reference``.
    """
    if isinstance(samples, ClientData):
        counts = samples.counts
        samples = joint_samples(samples, num_classes=num_classes, label_scale=label_scale)
    if counts is None:
        raise ValueError("counts is required when samples is an array")
    num_reference = check_positive_int("num_reference", num_reference)
    check_key("key", key)
    samples = jnp.asarray(samples, jnp.float32)
    if samples.ndim != 3:
        raise ValueError(f"samples must have shape [n, N_max, dz], got {samples.shape}")
    counts = _check_counts(counts, samples.shape[0], samples.shape[1])
    check_finite("samples", samples)
    return _gaussian_reference(samples, counts, key, num_reference)


@functools.partial(jax.jit, static_argnums=(3,))
def _gaussian_reference(samples, counts, key, num_reference):
    mask = jnp.arange(samples.shape[1])[None, :] < counts[:, None]  # [n, N_max]
    cnt = counts.astype(jnp.float32)
    mu_i = jnp.sum(jnp.where(mask[..., None], samples, 0.0), axis=1) / cnt[:, None]  # [n, dz]
    mu = (cnt / jnp.sum(cnt)) @ mu_i  # [dz]
    centred = jnp.where(mask[..., None], samples - mu_i[:, None, :], 0.0)  # [n, N_max, dz]
    # sqrt(w_i / N_i) = 1 / sqrt(sum_j N_j) for every client.
    # One key per row index, so extra zero-weight padding rows leave the draw unchanged.
    row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(samples.shape[1]))
    noise = jax.vmap(lambda k: jax.random.normal(k, (num_reference, samples.shape[0])))(row_keys)
    return mu + jnp.einsum("skn,nsd->kd", noise, centred) / jnp.sqrt(jnp.sum(cnt))


def _solve_one(
    reference, z, b, epsilon, threshold, max_iterations, inner_iterations, momentum_start
):
    """Sinkhorn between uniform ``reference`` [N0, dz] and ``(z [N_max, dz], b [N_max])``."""
    # ott (with lineax and equinox) is imported here, when a D is first computed: it is
    # most of `import karula_jax`'s time, which every process pays, most never using it
    from ott.geometry import costs, geometry, pointcloud  # noqa: PLC0415
    from ott.problems.linear import linear_problem  # noqa: PLC0415
    from ott.solvers.linear import acceleration, sinkhorn  # noqa: PLC0415

    n0 = reference.shape[0]
    a = jnp.full((n0,), 1.0 / n0, dtype=jnp.float32)
    # The cost matrix is formed once; a PointCloud geometry recomputes it every iteration.
    cost = pointcloud.PointCloud(reference, z, cost_fn=costs.Euclidean()).cost_matrix
    prob = linear_problem.LinearProblem(
        geometry.Geometry(cost_matrix=cost, epsilon=epsilon), a=a, b=b
    )
    plain = functools.partial(
        sinkhorn.Sinkhorn,
        lse_mode=True,
        max_iterations=max_iterations,
        inner_iterations=inner_iterations,
    )
    if momentum_start is None:
        out = plain(threshold=threshold)(prob)
        plan, solved, iterations = out.matrix, out.converged, out.n_iters
    else:
        fast = plain(
            threshold=_FAST_TOL * threshold, momentum=acceleration.Momentum(start=momentum_start)
        )
        first = fast(prob)
        # Over-relaxed updates leave the reference-side marginal inexact; a plain Sinkhorn
        # run from the accelerated potentials restores it (and is ott's convergence check).
        # A client that used up max_iterations is not polished (threshold inf: one block).
        met = first.converged | (first.n_iters < max_iterations)
        init = tuple(jnp.where(jnp.isfinite(p), p, 0.0) for p in (first.f, first.g))
        out = plain(threshold=jnp.where(met, threshold, jnp.inf))(prob, init=init)
        plan = jnp.where(met, out.matrix, first.matrix)
        solved = met & out.converged
        iterations = first.n_iters + jnp.where(met, out.n_iters, 0)
    plan = jnp.where(b[None, :] > 0, plan, 0.0)  # [N0, N_max]; zero on padded columns
    maps = n0 * plan @ z
    err = jnp.sum(jnp.abs(plan.sum(0) - b)) + jnp.sum(jnp.abs(plan.sum(1) - a))
    # ott counts a solve that stopped on an infinite error (divergence) as converged.
    converged = solved & jnp.isfinite(err) & jnp.all(jnp.isfinite(maps))
    return EmbedOutput(maps, plan, converged, iterations.astype(jnp.int32), err)


def _embed_clients(
    reference,
    joint,
    weights,
    epsilon,
    threshold,
    max_iterations,
    inner_iterations,
    momentum_start,
    batch_size,
    return_plans,
):
    """Every client's OT solve (vmapped, or in batches); jitted as :data:`_embed_batched`."""

    def solve(zb):
        out = _solve_one(
            reference,
            *zb,
            epsilon=epsilon,
            threshold=threshold,
            max_iterations=max_iterations,
            inner_iterations=inner_iterations,
            momentum_start=momentum_start,
        )
        # Dropping plans here keeps memory at O(n * N0 * dz) when they are not wanted.
        return out if return_plans else out._replace(plans=None)

    if batch_size is None:
        return jax.vmap(solve)((joint, weights))
    # Batches of clients run one after another: bounds memory, and a batch stops as soon as
    # its own slowest client has converged.
    return jax.lax.map(solve, (joint, weights), batch_size=batch_size)


# Sizes and flags are static; tests wrap _embed_clients with chex.assert_max_traces and jit
# it with these to show that repeated calls with equal shapes compile once.
_EMBED_STATIC = (
    "max_iterations",
    "inner_iterations",
    "momentum_start",
    "batch_size",
    "return_plans",
)
_embed_batched = jax.jit(_embed_clients, static_argnames=_EMBED_STATIC)


def _check_counts(counts, n: int, n_max: int) -> jnp.ndarray:
    """``counts`` of shape ``[n]``, integer, each in ``[1, n_max]`` when concrete."""
    counts = jnp.asarray(counts)
    if counts.shape != (n,):
        raise ValueError(f"counts must have shape [{n}], got {counts.shape}")
    if not jnp.issubdtype(counts.dtype, jnp.integer):
        raise TypeError(f"counts must hold integers, got dtype {counts.dtype}")
    c = concrete(counts)
    if c is not None and (c.min() < 1 or c.max() > n_max):
        raise ValueError(f"counts must lie in [1, {n_max}], got {c.tolist()}")
    return counts


def _check_solver_args(
    epsilon, threshold, max_iterations, inner_iterations, momentum_start, batch_size
) -> None:
    check_positive("epsilon", epsilon)
    check_positive("threshold", threshold)
    check_positive_int("inner_iterations", inner_iterations)
    check_positive_int("max_iterations", max_iterations)
    if int(max_iterations) < int(inner_iterations):
        raise ValueError(
            f"max_iterations must be >= inner_iterations ({inner_iterations}), got {max_iterations}"
        )
    if batch_size is not None:
        check_positive_int("batch_size", batch_size)
    if momentum_start is not None:
        check_positive_int("momentum_start", momentum_start)
        if momentum_start < 2 * inner_iterations:
            # Lehmann's weight needs two error evaluations before the start.
            raise ValueError(
                f"momentum_start must be >= 2 * inner_iterations ({2 * inner_iterations}), "
                f"got {momentum_start}"
            )


def embed(
    joint: jnp.ndarray,
    counts: jnp.ndarray,
    reference: jnp.ndarray,
    *,
    epsilon: float = DEFAULT_EPSILON,
    threshold: float = DEFAULT_THRESHOLD,
    max_iterations: int = DEFAULT_MAX_ITERATIONS,
    inner_iterations: int = 10,
    momentum_start: int | None = DEFAULT_MOMENTUM_START,
    batch_size: int | None = DEFAULT_BATCH_SIZE,
    return_plans: bool = True,
) -> EmbedOutput:
    """Solves one entropic W1 problem per client and returns the barycentric maps.

    Client ``i`` transports the uniform measure on ``reference`` to the measure with weight
    ``1/N_i`` on each of its real rows and ``0`` on padding, with ott-jax Sinkhorn
    (log-sum-exp mode, ``costs.Euclidean`` ground cost, the ``[N0, N_max]`` cost matrix
    formed once per client). One jit-compiled program serves all clients; repeated calls
    with the same shapes reuse it.

    Defaults and why: the small absolute ``epsilon`` that ranks clients like exact W1 makes
    plain Sinkhorn slow (contraction close to 1), so from iteration ``momentum_start`` the
    updates are over-relaxed with Lehmann's adaptive weight (ott ``acceleration.Momentum``),
    set per client from its own error decay; a plain Sinkhorn run from those potentials then
    restores the reference-side marginal and decides ``converged``. Clients are solved
    ``batch_size`` at a time so that solver memory does not grow with ``n``.

    Args:
      joint: joint samples, shape ``[n, N_max, dz]`` (see :func:`joint_samples`).
      counts: real rows per client, shape ``[n]``.
      reference: reference set ``D0``, shape ``[N0, dz]``.
      epsilon: absolute entropic regularization.
      threshold: Sinkhorn stops when the L1 error of the client-side marginal is below it.
      max_iterations: cap on Sinkhorn iterations (on each of the accelerated run and the
        plain polish; a client that used up the cap is not polished).
      inner_iterations: iterations between two error evaluations.
      momentum_start: iteration at which the adaptive over-relaxation starts, at least
        ``2 * inner_iterations``; None for plain Sinkhorn only.
      batch_size: clients solved at a time (``lax.map`` over vmapped batches): solver memory
        ``O(batch_size * N0 * N_max)`` and each batch stops with its own slowest client.
        None solves all clients in one vmap. Results do not depend on it (up to rounding).
      return_plans: if False, ``plans`` is None (saves ``n * N0 * N_max`` floats).

    Returns:
      :class:`EmbedOutput` with maps ``[n, N0, dz]`` and per-client diagnostics;
      ``iterations`` counts both runs.

    Raises:
      ValueError: bad arguments, NaN/inf data or reference, or (concrete inputs) a solve
        that returned NaN/inf maps, or maps off the samples' range at costs beyond 1e3
        times ``epsilon``: ``epsilon`` too small for the data's cost scale (the message
        gives the scale and a value of ``epsilon`` that suits it).
    """
    _check_solver_args(
        epsilon, threshold, max_iterations, inner_iterations, momentum_start, batch_size
    )
    joint = jnp.asarray(joint, jnp.float32)
    reference = jnp.asarray(reference, jnp.float32)
    counts = jnp.asarray(counts)
    if joint.ndim != 3:
        raise ValueError(f"joint must have shape [n, N_max, dz], got {joint.shape}")
    if reference.ndim != 2 or reference.shape[1] != joint.shape[2]:
        raise ValueError(
            f"reference must have shape [N0, {joint.shape[2]}] (dz of the joint samples), "
            f"got {reference.shape}"
        )
    counts = _check_counts(counts, joint.shape[0], joint.shape[1])
    check_finite("reference", reference)
    check_finite("joint", joint)
    mask = jnp.arange(joint.shape[1])[None, :] < counts[:, None]
    weights = jnp.where(mask, 1.0 / counts[:, None].astype(jnp.float32), 0.0)
    out = _embed_batched(
        reference,
        joint,
        weights,
        jnp.asarray(epsilon, jnp.float32),
        jnp.asarray(threshold, jnp.float32),
        max_iterations=int(max_iterations),
        inner_iterations=int(inner_iterations),
        momentum_start=None if momentum_start is None else int(momentum_start),
        # A batch as large as the data is one vmap.
        batch_size=None if batch_size is None or batch_size >= joint.shape[0] else int(batch_size),
        return_plans=bool(return_plans),
    )
    _check_maps(out.maps, joint, counts, reference, epsilon)
    if not is_concrete(epsilon, joint, reference):
        # the checks above skip traced values: an epsilon that is not finite and > 0 or
        # non-finite samples give NaN maps and converged False, not a plausible D
        eps = jnp.asarray(epsilon, jnp.float32)
        ok = jnp.isfinite(eps) & (eps > 0) & jnp.all(jnp.isfinite(reference))
        ok = ok & jnp.all(jnp.isfinite(jnp.where(mask[..., None], joint, 0.0)), axis=(1, 2))
        maps = jnp.where(ok[:, None, None], out.maps, jnp.nan)
        out = out._replace(maps=maps, converged=out.converged & ok)
    return out


# Out-of-range maps are blamed on epsilon where the median cost exceeds it this many
# times (features at 1e4 with the default epsilon: 3e5); below, a solve stopped short of
# its tolerance can leave maps off the samples' box too, and ``converged`` reports it.
_COST_OVER_EPSILON = 1e3


def _check_maps(maps, joint, counts, reference, epsilon) -> None:
    """ValueError naming ``epsilon`` when a concrete solve returned NaN/inf maps, or maps
    outside the bounding box of the client's samples.

    The data and the reference are finite (checked before), so non-finite maps come from
    an ``epsilon`` too small for the transport costs: float32 Sinkhorn divides cost
    differences at rounding level by ``epsilon``. A map is a barycentric projection, a
    convex combination of the client's samples once the solve has converged, so one outside
    their box (beyond 1e-3 of its width) at a median cost beyond ``_COST_OVER_EPSILON``
    times ``epsilon`` is the same failure without the NaN (features at 1e4 with the default
    epsilon: maps near 1e10, a D 7e4 times too large). Skipped when traced.
    """
    m, cnt = concrete(maps), concrete(counts)
    if m is None or cnt is None:
        return
    z = np.asarray(joint, np.float64)
    outside = np.zeros(len(m), bool)
    for i in range(len(m)):
        real = z[i, : cnt[i]]
        lo, hi = real.min(axis=0), real.max(axis=0)
        slack = 1e-3 * (hi - lo) + 1e-6 * (np.abs(hi) + np.abs(lo) + 1.0)
        outside[i] = np.any(m[i] < lo - slack) | np.any(m[i] > hi + slack)
    finite = np.all(np.isfinite(m), axis=(1, 2))
    if finite.all() and not outside.any():
        return
    bad = np.flatnonzero(~finite | outside).tolist()
    ref = np.asarray(reference, np.float64)
    costs_ = [np.linalg.norm(ref[:, None] - z[i, : cnt[i]][None], axis=-1) for i in range(len(z))]
    flat = np.concatenate([c.ravel() for c in costs_])
    scale, top = float(np.median(flat)), float(flat.max())
    eps = concrete(epsilon)
    if finite.all() and scale <= _COST_OVER_EPSILON * float(eps):
        return  # a solve stopped short at a sane scale: reported in ``converged``
    shown = ", ".join(map(str, bad[:8])) + (", ..." if len(bad) > 8 else "")
    raise ValueError(
        f"epsilon={float(eps):.3g} is too small for the data's cost scale: the Sinkhorn "
        f"solve of clients [{shown}] returned NaN, infinite or out-of-range maps. The "
        f"transport costs "
        f"between the reference and the clients' samples have median {scale:.3g} (largest "
        f"{top:.3g}), {scale / float(eps):.3g} times epsilon, beyond what float32 Sinkhorn "
        f"resolves. Use epsilon of about 0.005 times the median cost (here "
        f"{0.005 * scale:.2g}; the default {DEFAULT_EPSILON} suits costs around 10), or "
        "standardize the features."
    )


@functools.partial(jax.jit, static_argnames=("norm",))
def _pairwise(maps, norm):
    n0 = maps.shape[1]

    def row(m_i):  # distances from one client to all: [n]
        diff = maps - m_i[None]  # [n, N0, dz]
        if norm == "row":
            return jnp.mean(jnp.sqrt(jnp.sum(diff**2, axis=-1)), axis=-1)
        return jnp.sum(jnp.abs(diff), axis=(1, 2)) / jnp.sqrt(n0)

    d = jax.lax.map(row, maps)  # memory O(n * N0 * dz), not O(n^2 * N0 * dz)
    d = 0.5 * (d + d.T)
    return jnp.where(jnp.eye(d.shape[0], dtype=bool), 0.0, d)


def pairwise_from_embeddings(maps: jnp.ndarray, *, norm: str = "row") -> jnp.ndarray:
    """Dissimilarity matrix from barycentric maps (or embeddings; the offset cancels).

    Args:
      maps: ``M_i`` or ``Phi_i``, shape ``[n, N0, dz]``.
      norm: ``"row"`` for ``(1/N0) sum_k ||M_i[k] - M_j[k]||_2`` (linearized W1, a metric),
        ``"l1"`` for the paper's ``||M_i - M_j||_1 / sqrt(N0)``.

    Returns:
      Symmetric ``[n, n]`` float32 array with zero diagonal.
    """
    if norm not in _NORMS:
        raise ValueError(f"norm must be one of {_NORMS}, got {norm!r}")
    maps = jnp.asarray(maps, jnp.float32)
    if maps.ndim != 3:
        raise ValueError(f"maps must have shape [n, N0, dz], got {maps.shape}")
    check_finite("maps", maps)
    return _pairwise(maps, norm)


def dissimilarities(
    clients: ClientData,
    *,
    key: jax.Array | None = None,
    num_reference: int = 100,
    epsilon: float = DEFAULT_EPSILON,
    reference: jnp.ndarray | None = None,
    num_classes: int | None = None,
    label_scale: float = 1.0,
    norm: str = "row",
    max_iterations: int = DEFAULT_MAX_ITERATIONS,
    threshold: float = DEFAULT_THRESHOLD,
    batch_size: int | None = DEFAULT_BATCH_SIZE,
    momentum_start: int | None = DEFAULT_MOMENTUM_START,
) -> tuple[jnp.ndarray, EmbeddingInfo]:
    """The client dissimilarity matrix ``D`` from the linear OT embedding.

    Args:
      clients: padded client data.
      key: PRNG key for the Gaussian reference set; required unless ``reference`` is given.
      num_reference: ``N0``, reference points drawn when ``reference`` is None.
      epsilon: absolute entropic regularization of each Sinkhorn solve.
      reference: a user-given reference set ``[N0, dz]`` in the joint space.
      num_classes: if given, ``y`` holds class labels that enter the joint space one-hot.
      label_scale: factor on the label block of the joint space.
      norm: ``"row"`` (default, linearized W1) or ``"l1"`` (the paper's entrywise norm).
      max_iterations: Sinkhorn iteration cap.
      threshold: Sinkhorn marginal-error tolerance (L1).
      batch_size: clients solved at a time (None: all at once); see :func:`embed`.
      momentum_start: start of the adaptive over-relaxation (None: plain Sinkhorn); see
        :func:`embed`.

    Returns:
      ``(D, info)``: ``D`` is a symmetric ``[n, n]`` float32 array with zero diagonal;
      ``info`` is an :class:`EmbeddingInfo` (check ``info.converged.all()``).

    Raises:
      ValueError: on a bad ``num_reference``, ``epsilon``, ``norm``, a reference of the
        wrong shape, NaN/infinite data or reference, a missing key, or an ``epsilon`` too
        small for the data's cost scale (see :func:`embed`).

    Examples:
      >>> import jax
      >>> import numpy as np
      >>> import karula_jax as kj
      >>> rng = np.random.default_rng(0)
      >>> xs = [rng.normal(m, 1.0, size=(20, 2)) for m in (0.0, 0.0, 3.0)]  # client 2 shifted
      >>> data = kj.data.from_client_arrays(xs, [x.sum(axis=1) for x in xs])
      >>> D, info = kj.embedding.dissimilarities(
      ...     data, key=jax.random.key(0), epsilon=0.5, num_reference=20
      ... )
      >>> D.shape, bool(info.converged.all())
      ((3, 3), True)
      >>> bool(D[0, 1] < D[0, 2]), bool(np.allclose(D, D.T)), np.diag(D).tolist()
      (True, True, [0.0, 0.0, 0.0])
    """
    if not isinstance(clients, ClientData):
        raise TypeError(f"clients must be a ClientData, got {type(clients).__name__}")
    if norm not in _NORMS:
        raise ValueError(f"norm must be one of {_NORMS}, got {norm!r}")
    _check_solver_args(epsilon, threshold, max_iterations, 10, momentum_start, batch_size)
    check_finite("clients.x", clients.x)
    check_finite("clients.y", clients.y)
    joint = joint_samples(clients, num_classes=num_classes, label_scale=label_scale)
    if reference is None:
        check_positive_int("num_reference", num_reference)
        if key is None:
            raise ValueError("key is required to draw the reference set (or pass reference=)")
        reference = gaussian_reference(joint, clients.counts, num_reference=num_reference, key=key)
    else:
        reference = jnp.asarray(reference, jnp.float32)
        if reference.ndim != 2 or reference.shape[1] != joint.shape[-1] or not reference.shape[0]:
            raise ValueError(
                f"reference must have shape [N0, {joint.shape[-1]}] with N0 >= 1 (joint space "
                f"dimension dz = {joint.shape[-1]}), got {reference.shape}"
            )
    out = embed(
        joint,
        clients.counts,
        reference,
        epsilon=epsilon,
        threshold=threshold,
        max_iterations=max_iterations,
        momentum_start=momentum_start,
        batch_size=batch_size,
        return_plans=False,
    )
    d = pairwise_from_embeddings(out.maps, norm=norm)
    info = EmbeddingInfo(
        converged=out.converged,
        iterations=out.iterations,
        marginal_error=out.marginal_error,
        reference=reference,
        embeddings=out.maps - reference[None],
        epsilon=float(epsilon) if is_concrete(epsilon) else epsilon,
    )
    return d, info
