"""protocol.binding_t_grid against the pair counts it promises: at its largest point no
pair of the given models binds, at its smallest the asked share does (hypothesis over n,
including n = 1 and 2, ties and zeros)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from karula_jax.evaluation import active_fraction
from karula_jax.protocol import binding_t_grid


def _symmetric(rng, n, zeros=0.0):
    a = rng.uniform(0.1, 10.0, (n, n))
    a[rng.uniform(size=(n, n)) < zeros] = 0.0
    a = np.triu(a, 1)
    return a + a.T


@settings(max_examples=30, deadline=None)
@given(n=st.integers(3, 12), share=st.floats(0.2, 1.0), seed=st.integers(0, 2**16))
def test_the_grid_spans_from_the_binding_share_to_no_pair_binding(n, share, seed):
    rng = np.random.default_rng(seed)
    D, sq = _symmetric(rng, n), _symmetric(rng, n)
    grid = binding_t_grid(D, sq, num=5, binding_share=share)
    assert list(grid) == sorted(grid) and len(grid) <= 5
    # the top is rounded up: a pair at exactly the top ratio is tight, none violated above it
    assert active_fraction(sq, D, grid[-1] * (1 + 1e-12), rtol=0.0) == 0.0
    pairs = n * (n - 1) // 2
    at_low = active_fraction(sq, D, grid[0], rtol=0.0)
    # a quantile of `pairs` ratios sits within one pair of the asked share
    assert at_low >= share - 1.0 / pairs - 1e-12


def test_degenerate_inputs_give_the_natural_limits():
    assert binding_t_grid(np.zeros((1, 1)), np.zeros((1, 1))) == (float("inf"),)
    same = np.zeros((4, 4))  # equal models never bind
    D = _symmetric(np.random.default_rng(0), 4)
    assert binding_t_grid(D, same, limits=True) == (0.0, float("inf"))
    # D = 0 pairs bind at every finite t and enter no ratio
    D0 = D.copy()
    D0[0, 1] = D0[1, 0] = 0.0
    sq = _symmetric(np.random.default_rng(1), 4)
    grid = binding_t_grid(D0, sq, binding_share=1.0, depth=1.0)
    iu = np.triu_indices(4, 1)
    ratios = (sq[iu] / np.where(D0[iu] > 0, D0[iu], np.nan))[1:]
    assert grid[0] <= ratios.min() <= grid[0] * 1.01 and grid[-1] / 1.01 <= ratios.max() <= grid[-1]
    D2, sq2 = np.array([[0, 2.0], [2.0, 0]]), np.array([[0, 6.0], [6.0, 0]])
    assert binding_t_grid(D2, sq2, depth=1.0) == (3.0,)
    # below the one ratio the pair keeps binding: depth 0.01 goes two decades down
    assert binding_t_grid(D2, sq2, num=3) == (0.03, 0.3, 3.0)


def test_bad_inputs_are_named():
    D = np.ones((3, 3)) - np.eye(3)
    with pytest.raises(ValueError, match=r"shape \[n, n\]"):
        binding_t_grid(D, np.ones((2, 2)))
    with pytest.raises(ValueError, match="D must be >= 0"):
        binding_t_grid(-D, D)
    with pytest.raises(ValueError, match="sq_distances must be >= 0"):
        binding_t_grid(D, np.full((3, 3), np.nan))
    with pytest.raises(ValueError, match="binding_share"):
        binding_t_grid(D, D, binding_share=0.0)
    with pytest.raises(ValueError, match="depth"):
        binding_t_grid(D, D, depth=1.5)
    with pytest.raises(TypeError, match="num"):
        binding_t_grid(D, D, num=2.5)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(2, 7), members=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_stacked_members_pool_their_pairs(n, members, seed):
    rng = np.random.default_rng(seed)
    D = np.stack([_symmetric(rng, n) for _ in range(members)])
    sq = np.stack([_symmetric(rng, n) for _ in range(members)])
    grid = binding_t_grid(D, sq, num=4, binding_share=0.9)
    # no pair of any member binds above the top; the pooled share binds at the bottom
    assert (
        max(
            active_fraction(s, d, grid[-1] * (1 + 1e-12), rtol=0.0)
            for s, d in zip(sq, D, strict=True)
        )
        == 0
    )
    pooled = np.mean([active_fraction(s, d, grid[0], rtol=0.0) for s, d in zip(sq, D, strict=True)])
    assert pooled >= 0.9 - 1.0 / (members * n * (n - 1) // 2) - 1e-12
    if members == 1:
        assert grid == binding_t_grid(D[0], sq[0], num=4, binding_share=0.9)


def test_member_grid_is_the_grid_of_the_exact_local_models():
    # ridge: each client's own model solves (X^T X / N + lam I) theta = X^T y / N exactly,
    # so the grid of those models is the reference; 500 steps at 1 / L_i reach it to
    # float32 accuracy here (condition numbers below 2.5), and the grid's 3 significant
    # digits round by at most one unit of the third digit (1% at a leading 1)
    from karula_jax.data import synthetic_ridge
    from karula_jax.models import ridge_loss, ridge_smoothness
    from karula_jax.protocol import member_t_grid, stack_datasets

    lam = 0.5
    problems = [
        synthetic_ridge(s, num_clients=5, dim=3, min_samples=20, max_samples=30) for s in (0, 1)
    ]
    train = stack_datasets([p.train for p in problems])
    rng = np.random.default_rng(3)
    D = np.stack([_symmetric(rng, 5) for _ in problems])
    L = np.stack([np.asarray(ridge_smoothness(p.train, lam)) for p in problems])
    grid = member_t_grid(ridge_loss(lam), np.zeros(3, np.float32), train, D, L, num=4)
    exact = []
    for p in problems:
        x, y, m = (np.asarray(a, np.float64) for a in (p.train.x, p.train.y, p.train.mask))
        thetas = []
        for i in range(len(x)):
            xi, yi = x[i][m[i] > 0], y[i][m[i] > 0]
            A = xi.T @ xi / len(xi) + lam * np.eye(3)
            thetas.append(np.linalg.solve(A, xi.T @ yi / len(xi)))
        v = np.stack(thetas)
        exact.append(((v[:, None] - v[None]) ** 2).sum(-1))
    want = binding_t_grid(D, np.stack(exact), num=4)
    assert len(grid) == len(want)
    np.testing.assert_allclose(grid, want, rtol=1e-2)
