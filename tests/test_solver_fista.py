"""The accelerated projected-gradient solver's own contract: blocks, caps, warm starts.

Its accuracy against cvxpy runs in tests/test_projection*.py with every other solver.
"""

import jax.numpy as jnp
import numpy as np
from _projection_reference import cvxpy_projection

from karula_jax import projection as proj
from karula_jax.projection import fista


def _instance(seed, n, p):
    rng = np.random.default_rng(seed)
    v = 2.0 * rng.normal(size=(3, p))[rng.integers(0, 3, n)] + rng.normal(size=(n, p))
    d2 = np.sum((v[:, None] - v[None]) ** 2, axis=-1)
    radii_sq = 0.1 * np.median(d2[np.triu_indices(n, 1)]) * rng.uniform(0.5, 1.5, (n, n))
    radii_sq = np.minimum(radii_sq, radii_sq.T)
    np.fill_diagonal(radii_sq, 0.0)
    return v.astype(np.float32), radii_sq.astype(np.float32)


def test_iterations_never_exceed_max_iter():
    # 7 is not a multiple of the block: the last block's tail must not count (or run on)
    v, radii_sq = _instance(0, 12, 6)
    _, info = proj.project(jnp.asarray(v), jnp.asarray(radii_sq), method="fista", max_iter=7)
    assert int(info.iterations) == 7 and not bool(info.converged)
    # feasible all the same: the certificate's shrink ran on the last evaluation
    assert float(info.rel_violation) <= 1e-5


def test_warm_start_from_its_own_answer_certifies_in_one_block():
    v, radii_sq = _instance(1, 20, 8)
    args = (jnp.asarray(v), jnp.asarray(radii_sq))
    th, cold = proj.project(*args, method="fista", max_iter=5000)
    assert bool(cold.converged) and int(cold.iterations) > fista._BLOCK
    # the certified multipliers are returned: started there, the first certificate (or
    # the first block's) meets tol again
    _, warm = proj.project(*args, method="fista", max_iter=5000, warm_start=cold.state)
    assert bool(warm.converged) and int(warm.iterations) <= fista._BLOCK
    ref = cvxpy_projection(v.astype(np.float64), radii_sq.astype(np.float64))
    scale = 0.5 * np.sum((v - v.mean(0)) ** 2)
    # certified: 1/2 ||theta - theta*||^2 <= delta, where float32's delta may undershoot
    # by a few 1e-7 S (rounding in g: the package docstring), so 1e-6 S is added; the
    # output's own rounding is at most a few eps per coordinate of v's size
    eps = np.finfo(np.float32).eps
    slack = 4 * eps * np.linalg.norm(v)
    bound = np.sqrt(2.0 * (float(cold.delta) + 1e-6 * scale)) + ref.radius + slack
    assert np.linalg.norm(np.asarray(th, np.float64) - ref.theta) <= bound
