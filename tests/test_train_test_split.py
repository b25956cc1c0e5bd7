"""data.train_test_split: every real row lands on exactly one side, both sides hold a row
wherever a client has two, over client sizes from 0 to many (hypothesis)."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from karula_jax import data


def _clients(sizes, dim=2, seed=0):
    rng = np.random.default_rng(seed)
    width = max(1, max(sizes))
    x = np.zeros((len(sizes), width, dim), np.float32)
    y = np.zeros((len(sizes), width), np.int32)
    for i, size in enumerate(sizes):
        # each row unique: its client, its index, then noise
        x[i, :size, 0] = i
        x[i, :size, 1] = np.arange(size) + rng.uniform(0, 0.5, size)
        y[i, :size] = rng.integers(0, 3, size)
    return data.ClientData(x, y, np.asarray(sizes, np.int32))


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=5),
    fraction=st.floats(0.05, 0.95),
    seed=st.integers(0, 2**16),
)
def test_every_row_lands_on_one_side(sizes, fraction, seed):
    whole = _clients(sizes)
    train, test = data.train_test_split(whole, fraction, key=jax.random.key(seed))
    for i, size in enumerate(sizes):
        rows = lambda d, i=i: {tuple(r) for r in np.asarray(d.x[i, : int(d.counts[i])])}
        kept, held = rows(train), rows(test)
        assert kept.isdisjoint(held)
        assert kept | held == rows(whole)
        if size >= 2:
            assert 1 <= len(held) <= size - 1
            assert len(held) == min(max(round(fraction * size), 1), size - 1)
        else:
            assert len(held) == 0
    for side in (train, test):  # padding is zeros
        pad = ~np.asarray(side.mask)
        assert not np.asarray(side.x)[pad].any() and not np.asarray(side.y)[pad].any()


def test_the_same_key_gives_the_same_split_and_another_key_another():
    whole = _clients([20, 20])
    a = data.train_test_split(whole, 0.3, key=jax.random.key(1))
    b = data.train_test_split(whole, 0.3, key=jax.random.key(1))
    c = data.train_test_split(whole, 0.3, key=jax.random.key(2))
    np.testing.assert_array_equal(a[1].x, b[1].x)
    assert not np.array_equal(np.asarray(a[1].x), np.asarray(c[1].x))
    old = data.train_test_split(whole, 0.3, key=jax.random.PRNGKey(1))  # raw uint32 keys too
    assert old[1].counts.tolist() == [6, 6]


def test_bad_arguments_are_named():
    whole = _clients([4, 4])
    with pytest.raises(ValueError, match="test_fraction must lie in"):
        data.train_test_split(whole, 1.0, key=jax.random.key(0))
    with pytest.raises(TypeError, match="test_fraction must be a number"):
        data.train_test_split(whole, "0.2", key=jax.random.key(0))
    with pytest.raises(TypeError, match="data must be a ClientData"):
        data.train_test_split((whole.x, whole.y), 0.2, key=jax.random.key(0))
    stacked = data.ClientData(whole.x[None], whole.y[None], whole.counts[None])
    with pytest.raises(ValueError, match="one data set"):
        data.train_test_split(stacked, 0.2, key=jax.random.key(0))
