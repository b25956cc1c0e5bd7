"""The quantities of the paper's convergence theory, for checking it numerically.

Theorem 4.3 of the paper (restated, with units, in ``docs/theory.md``): under Assumption 4.1
(each weighted loss ``alpha_i f_i`` is ``L``-smooth, so ``L = L_max = max_i alpha_i L_i``)
and Assumption 4.2 (``E ||G_i(theta_i) - alpha_i grad f_i(theta_i)||^2 <= sigma^2``), from a
feasible start, with step ``eta = 3 / (8 L)`` and ``2 <= s <= n - 1``, Karula's iterates
satisfy::

    min_{k < K} E ||G_eta(theta^k)||^2 <= (8 L / 3) ((f(theta^0) - f*) / K + eps),
    eps = 4 sigma^2 (s + 1) / s + 2 delta,

with the gradient mapping ``G_eta(theta) = (theta - P_K(theta - eta grad f(theta))) / eta``
of ``f(theta) = (1/n) sum_i alpha_i f_i(theta_i)`` and ``delta`` the projection error in the
paper's units: ``1/(2 eta) ||theta - v||^2 <= delta + 1/(2 eta) min_{u in K} ||u - v||^2``,
i.e. ``delta = info.delta / eta`` for the certificate ``info.delta`` of
:func:`karula_jax.projection.project` (which bounds ``1/2 ||theta - v||^2 - 1/2 min ...``).

The statement's constant ``8 L / 3`` is not what the paper's proof yields. The proof ends
with ``(1/K) sum_{k<K} E ||G||^2 <= (gap / K + eps) / (eta / 2 - eta^2 L)``, and at
``eta = 3 / (8 L)`` the denominator is ``3 / (64 L)``: the constant is ``64 L / 3``, eight
times the stated one. The proof also drops a factor ``eta`` from the noise term (Young's
inequality gives ``eta E ||nu - grad f||^2``; without ``eta`` the term is not in the units of
``f``). :func:`theorem_4_3_proof_bound` is the bound the proof establishes, with both
corrected; ``docs/theory.md`` derives it and says what each test checks.

Functions here take flat models ``theta: [n, p]`` (every coordinate personalized).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax import projection
from karula_jax._checks import check_nonnegative, check_positive, check_positive_int, concrete

__all__ = [
    "gradient_mapping",
    "gradient_mapping_sq_norms",
    "minibatch_sigma_sq",
    "paper_delta",
    "theorem_step",
    "theorem_4_3_bound",
    "theorem_4_3_proof_bound",
    "weighted_gradient",
]


def theorem_step(smoothness_max) -> jnp.ndarray:
    """Theorem 4.3's step ``3 / (8 L_max)``, ``L_max = max_i alpha_i L_i`` (> 0).

    Examples:
      >>> from karula_jax.theory import theorem_step
      >>> float(theorem_step(2.0))  # 3 / (8 L_max)
      0.1875
    """
    check_positive("smoothness_max", smoothness_max)
    return 3.0 / (8.0 * jnp.asarray(smoothness_max))


def weighted_gradient(loss, theta, x, y, mask, alpha) -> jnp.ndarray:
    """``grad f(theta)`` on the product space: row ``i`` is ``alpha_i grad f_i(theta_i) / n``.

    Args:
      loss: ``loss(params, x, y, mask) -> scalar`` on one client's ``[p]`` model.
      theta: ``[n, p]``; x: ``[n, N_max, d]``; y: ``[n, N_max]``; mask: ``[n, N_max]`` bool
        (the real rows); alpha: ``[n]`` client weights.

    Returns:
      ``[n, p]``, the full-batch gradient (no sampling).
    """
    n = theta.shape[0]
    grads = jax.vmap(jax.grad(loss))(theta, x, y, mask)
    return alpha[:, None] * grads / n


def gradient_mapping(
    theta, grad, radii_sq, eta, *, tol: float = 1e-10, max_iter: int = 20000, method="auto"
):
    """``G_eta(theta) = (theta - P_K(theta - eta grad)) / eta`` with a tight projection.

    Args:
      theta: ``[n, p]`` models; grad: ``[n, p]``, ``grad f(theta)``
        (:func:`weighted_gradient`); radii_sq: ``[n, n]`` squared radii ``t D``;
        eta: step ``> 0``.
      tol, max_iter, method: of the projection (run in the dtype of ``theta``: use
        float64 for a reference value).

    Returns:
      ``(G, info)``: ``G`` of shape ``[n, p]`` and the projection's info (check
      ``info.converged``).
    """
    check_positive("eta", eta)
    target = theta - eta * grad
    proj, info = projection.project(target, radii_sq, tol=tol, max_iter=max_iter, method=method)
    return (theta - proj) / eta, info


def gradient_mapping_sq_norms(loss, theta, x, y, mask, alpha, radii_sq, eta):
    """``||G_eta(theta)||^2`` for a batch of iterates, e.g. a run's trajectory.

    Args:
      loss, x, y, mask, alpha: as in :func:`weighted_gradient`.
      theta: iterates ``[..., n, p]``; radii_sq: ``[n, n]``; eta: step ``> 0``.

    Returns:
      ``(sq, converged)``, both of shape ``[...]``: the squared norm of the gradient
      mapping at each iterate and whether its projection met the tolerance of
      :func:`gradient_mapping`.
    """

    def one(th):
        G, info = gradient_mapping(
            th, weighted_gradient(loss, th, x, y, mask, alpha), radii_sq, eta
        )
        return jnp.sum(G * G), info.converged

    flat = theta.reshape(-1, *theta.shape[-2:])
    sq, converged = jax.vmap(one)(flat)
    return sq.reshape(theta.shape[:-2]), converged.reshape(theta.shape[:-2])


def paper_delta(certificate, eta) -> jnp.ndarray:
    """The paper's ``delta`` from :func:`karula_jax.projection.project`'s ``info.delta``.

    The library certifies ``1/2 ||theta - v||^2 - 1/2 min_u ||u - v||^2 <= info.delta``;
    the paper measures the same gap divided by ``eta``.
    """
    check_positive("eta", eta)
    return jnp.asarray(certificate) / eta


def theorem_4_3_bound(smoothness_max, initial_gap, rounds, *, sigma_sq=0.0, s=None, delta=0.0):
    """The right-hand side of Theorem 4.3 for ``K = rounds``.

    Args:
      smoothness_max: ``L = max_i alpha_i L_i``.
      initial_gap: ``f(theta^0) - f*`` (>= 0).
      rounds: ``K``, scalar or array (broadcast).
      sigma_sq: Assumption 4.2's ``sigma^2`` (0 with full gradients).
      s: participants per round (needed when ``sigma_sq > 0``).
      delta: the projection error in the paper's units (:func:`paper_delta`).

    Returns:
      ``(8 L / 3) (initial_gap / K + 4 sigma^2 (s + 1) / s + 2 delta)``, the paper's
      statement (which its proof does not establish: see
      :func:`theorem_4_3_proof_bound`).

    Raises:
      ValueError: ``smoothness_max <= 0``; a negative ``initial_gap``, ``sigma_sq`` or
        ``delta``; ``rounds < 1``; ``sigma_sq`` that may be positive without ``s >= 1``.
    """
    check_positive("smoothness_max", smoothness_max)
    check_nonnegative("initial_gap", initial_gap)
    check_nonnegative("delta", delta)
    k = concrete(rounds)
    if k is not None and np.any(k < 1):
        raise ValueError(f"rounds must be >= 1, got {k.tolist()}")
    sigma = concrete(sigma_sq)
    if sigma is not None and np.any(sigma < 0):
        raise ValueError(f"sigma_sq must be >= 0, got {sigma.tolist()}")
    if sigma is not None and np.all(sigma == 0):
        noise = 0.0
    else:  # sigma_sq positive, or traced: s is needed
        if s is None:
            raise ValueError("s (participants per round) is required when sigma_sq > 0")
        s = check_positive_int("s", s)
        noise = 4.0 * jnp.asarray(sigma_sq) * (s + 1) / s
    eps = noise + 2.0 * delta
    return (8.0 * smoothness_max / 3.0) * (initial_gap / jnp.asarray(rounds) + eps)


def theorem_4_3_proof_bound(smoothness_max, decrease, rounds, *, sigma_sq=0.0, s=None, delta=0.0):
    """The bound the proof of Theorem 4.3 establishes, on the average over ``k < K``.

    The proof's last display, with its dropped ``eta`` restored in the noise term (the
    Young step bounds the inner product by ``eta E ||nu^k - grad f(theta^k)||^2``)::

        (1/K) sum_{k<K} E ||G_eta(theta^k)||^2
            <= (64 L / 3) (decrease / K + eta 4 sigma^2 (s + 1) / s + 2 delta)
             = (64 L / 3) (decrease / K + 2 delta) + 32 sigma^2 (s + 1) / s,

    ``eta = 3 / (8 L)``, ``64 L / 3 = 1 / (eta / 2 - eta^2 L)``. The proof telescopes to
    ``decrease = f(theta^0) - E f(theta^K)``; ``f(theta^0) - f*`` is larger, and the
    minimum over ``k < K`` is at most the average, so this implies the theorem's form with
    the constant ``64 L / 3``.

    Args:
      smoothness_max: ``L = max_i alpha_i L_i`` (> 0), in units of ``f`` per squared
        parameter.
      decrease: ``f(theta^0) - E f(theta^K)`` (>= 0), or ``f(theta^0) - f*``; scalar or
        array (one per ``K``, broadcast with ``rounds``).
      rounds: ``K >= 1``, scalar or array (broadcast with ``decrease``).
      sigma_sq: Assumption 4.2's ``sigma^2`` (squared gradient units; 0: full gradients).
      s: participants per round (needed when ``sigma_sq > 0``).
      delta: the projection error in the paper's units (:func:`paper_delta`).

    Returns:
      The right-hand side, in squared gradient units (those of ``||G||^2``).

    Raises:
      ValueError: as :func:`theorem_4_3_bound` (``decrease`` in place of ``initial_gap``).

    Examples:
      >>> from karula_jax.theory import theorem_4_3_bound, theorem_4_3_proof_bound
      >>> float(theorem_4_3_proof_bound(3.0, 1.0, 4) / theorem_4_3_bound(3.0, 1.0, 4))
      8.0
    """
    dec = concrete(decrease)
    if dec is not None and not np.all(dec >= 0):  # NaN fails too
        raise ValueError(f"decrease must be >= 0, got {np.asarray(dec).tolist()}")
    check_positive("smoothness_max", smoothness_max)
    sigma = concrete(sigma_sq)
    if sigma is not None and np.any(sigma < 0):  # named here, not as eta sigma_sq below
        raise ValueError(f"sigma_sq must be >= 0, got {sigma.tolist()}")
    eta = theorem_step(smoothness_max)
    # (8 L / 3) (eta 4 sigma^2 (s + 1) / s + 2 delta), with that function's checks of
    # rounds, s and delta
    eps = theorem_4_3_bound(
        smoothness_max, 0.0, rounds, sigma_sq=eta * jnp.asarray(sigma_sq), s=s, delta=delta
    )
    return 8.0 * eps + (64.0 * jnp.asarray(smoothness_max) / 3.0) * (
        jnp.asarray(decrease) / jnp.asarray(rounds)
    )


def minibatch_sigma_sq(loss, theta, x, y, counts, alpha, batch_size: int) -> jnp.ndarray:
    """Assumption 4.2's ``sigma^2`` at ``theta``: ``max_i E||G_i - alpha_i grad f_i||^2``.

    ``G_i`` is ``alpha_i`` times the gradient of the loss on ``B`` of client ``i``'s
    ``N_i`` rows drawn without replacement (how the algorithms sample), whose covariance
    is ``(N_i - B) / (B (N_i - 1))`` times the population covariance of the per-row
    gradients (exact, no sampling). Terms common to every row (a penalty) cancel.

    Args:
      loss: ``loss(params, x, y, mask) -> scalar``, a masked mean over rows plus terms
        that do not depend on the rows.
      theta: ``[n, p]``; x: ``[n, N_max, d]``; y: ``[n, N_max]``; counts: ``[n]`` ints;
        alpha: ``[n]``; batch_size: ``B >= 1`` (``B >= N_i``: no noise for client ``i``).

    Returns:
      Scalar, the largest client's mean squared error.
    """
    check_positive_int("batch_size", batch_size)
    n_max = x.shape[1]
    rows = jnp.arange(n_max)

    def client(th, xi, yi, count, a):
        per_row = jax.vmap(lambda k: jax.grad(loss)(th, xi, yi, rows == k))(rows)
        valid = (rows < count)[:, None]
        mean = jnp.sum(jnp.where(valid, per_row, 0.0), 0) / jnp.maximum(count, 1)
        var = jnp.sum(jnp.where(valid, (per_row - mean) ** 2, 0.0)) / jnp.maximum(count, 1)
        b = jnp.minimum(batch_size, count)
        factor = jnp.where(count > 1, (count - b) / (b * jnp.maximum(count - 1, 1)), 0.0)
        return a**2 * factor * var

    return jnp.max(jax.vmap(client)(theta, x, y, counts, alpha))
