r"""Certified Euclidean projection onto the pairwise-distance constraint set K.

Given client models ``v`` (leaves with a leading client axis ``n``) and squared radii
``radii_sq = t * D`` (``[n, n]``), :func:`project` solves

.. math::

   \min_\theta \tfrac12 \sum_i \|\theta_i - v_i\|^2
   \quad\text{s.t.}\quad \|\theta_i - \theta_j\|^2 \le r_{ij}^2 \ \ \forall i < j,

where the norm runs over the concatenation of all *personalized* leaves; shared leaves
are constrained to be equal across clients and are projected to their mean.

How it is solved (all inside one compiled program):

1. Zero radii are exact equalities, which no finite multiplier enforces. Clients
   joined by zero radii (connected components of the zero-radius graph) are merged
   into one slot with mass ``m_c`` = component size and value = component mean; the
   radius between two slots is the smallest radius between their members. The
   problem keeps its static size ``n``: empty slots have mass 1, value 0 and no
   constraints.
2. Coordinates are centred at the mean (the projection is translation equivariant
   and keeps the mean) and, when ``p > n``, rotated onto an orthonormal basis of the
   span of the centred models (the solution lies in that span), so every iteration
   costs ``O(n^2 min(n, p))``.
3. A solver (cyclic Dykstra, or dual ascent on the Laplacian multipliers) runs in a
   ``lax.while_loop``. Every few iterations the current multipliers ``lam`` give a
   certified lower bound on the optimal value through the Lagrangian dual

   .. math::

      g(\lambda) = \min_\theta \tfrac12 \sum_c m_c \|\theta_c - w_c\|^2
      + \tfrac12 \sum_{c<d} \lambda_{cd} (\|\theta_c - \theta_d\|^2 - R_{cd}^2),
      \qquad \theta(\lambda) = (M + L_\lambda)^{-1} M w,

   with ``L_lam`` the graph Laplacian of the weights ``lam`` (an ``n x n`` system).
4. The primal iterate is made exactly feasible by shrinking it toward the mean by
   ``beta = min(1, min R_cd / ||theta_c - theta_d||)`` (the Laplacian dual, where the
   models span few dimensions, first pulls violated pairs together and keeps the better
   of the two feasible points), and ``delta`` = primal value of
   the returned point minus ``g(lam)`` is a certified bound on its suboptimality
   (``1/2 ||theta - theta*||^2 <= delta`` as well, by strong convexity). The loop stops
   when ``delta <= tol * S`` with ``S = 1/2 sum_i ||v_i - mean(v)||^2`` (the value at
   ``t = 0``, an upper bound on the optimal value).

Screening: before any solver, one Gram product with a rigorous rounding margin checks
whether every constraint already holds; then ``v`` is returned as is with ``lam = 0`` and
``delta = 0`` (exact: a feasible ``v`` is its own projection). Else, when the largest
shrink toward the mean that provably meets every constraint, ``beta``, is within
``(1 - beta)^2 <= tol`` of 1, that shrink is returned with ``delta = (1 - beta)^2 S`` (the
dual bound at ``lam = 0`` is 0): the case of a round that moved the models a little from
the last projection, whose active pairs sit at their radius. The solvers rotate onto the
span of the models (Householder QR) when ``p >= 2n`` (Laplacian) or ``p > n`` (Dykstra).
Matrix products run at full float32 precision (not TF32, a GPU's default).

Solvers (one module each, one row in :data:`karula_jax.projection.solvers.SOLVERS`, the
contract in :mod:`karula_jax.projection.contract`): ``method="auto"`` (default) takes
Dykstra for one pair (``n = 2``, state at most ``2**20`` floats), else the Laplacian dual
(:func:`choose_method`). ``method="dykstra"`` is Dykstra's algorithm cycling over the
round-robin perfect matchings of the complete graph (``n - 1`` matchings, or ``n`` with
a bye when ``n`` is odd; the pair kernel vmapped over the disjoint pairs of a matching;
one vector of dual state per pair); ``"laplacian"`` is a projected Newton-CG ascent on
the ``n x n`` multipliers only (no per-pair vectors), for many clients;
``"laplacian_direct"`` is the same ascent with each Newton system on the free pairs
formed and factorized (one ``[q, q]`` solve, ``q <= min(8n, 2048)`` free pairs, instead
of CG's loop of Hessian products; CG beyond, and wherever the models span few dimensions,
``3k < 2n``), a few large kernels a step for accelerators (on the CPU its ``O(q^3)``
elimination is slower); ``"fista"`` is an
accelerated projected gradient ascent on the same multipliers whose iteration is a few
``n x n``-sized kernels with no inner loop, run in fixed-trip ``lax.scan`` blocks of 10
with the certificate once a block (on the CPU slower than ``"laplacian"``: 5-12x its
iterations; results/bench/README.md). All return the same certified output. (A parallel
Dykstra that averages per-pair copies of each client was dropped: on the same instances
it needed 10 to 100 times more iterations and could not certify ``tol = 1e-10`` within
300,000 iterations at ``n = 40``.)

Precision: the certificate is computed in the input dtype. In float32 it is exact only
up to a few ``1e-7 * S`` (rounding in ``g``), so ``delta`` may undershoot the true
suboptimality by that much and ``tol`` much below ``1e-6`` is out of reach; float64
(``with jax.enable_x64(True):`` and float64 inputs) certifies to ``~1e-13 * S``. The
returned point is feasible up to the rounding of the last additions (the restoration
keeps a margin of ``4 eps`` of every radius).
"""

from karula_jax.projection.api import (
    METHODS,
    ProjectionInfo,
    ProjectionState,
    choose_method,
    init_projection_state,
    project,
)
from karula_jax.projection.dykstra import pair_kernel

__all__ = [
    "METHODS",
    "ProjectionInfo",
    "ProjectionState",
    "choose_method",
    "init_projection_state",
    "pair_kernel",
    "project",
]
