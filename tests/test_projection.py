"""Tests of karula_jax.projection against cvxpy (Clarabel) and closed forms."""

import jax.numpy as jnp
import numpy as np
import pytest

from karula_jax import projection as proj


def _instance(seed, n, p, t):
    rng = np.random.default_rng(seed)
    centres = 2.0 * rng.normal(size=(3, p))
    groups = rng.integers(0, 3, n)
    v = centres[groups] + rng.normal(size=(n, p))
    dist = np.linalg.norm(centres[groups][:, None] - centres[groups][None], axis=-1) + 0.5
    return v, t * dist


@pytest.mark.parametrize("method", proj.METHODS)
def test_t_zero_collapses_to_mean_and_inf_is_identity(method):
    v, radii_sq = _instance(0, 6, 4, 1.0)
    th, info = proj.project(jnp.asarray(v, jnp.float32), jnp.zeros((6, 6)), method=method)
    np.testing.assert_allclose(th, np.broadcast_to(v.mean(0), v.shape), atol=1e-5)
    assert float(info.max_violation) == 0.0
    th, info = proj.project(jnp.asarray(v, jnp.float32), jnp.full((6, 6), jnp.inf), method=method)
    np.testing.assert_allclose(th, v, atol=1e-5)
    assert int(info.iterations) == 0 and bool(info.converged)
