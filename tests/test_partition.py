"""The partitions of a user's pool of samples into clients (``karula_jax.data.partition``).

Rows are traced through a split by an id: the first feature (label splits) or the target
(feature shift) of row ``r`` is ``r``. Sizes are swept by hypothesis (n = 1 and 2, odd and
even, more clients than classes and fewer), with bounded example counts.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from _tolerances import EPS32, EPS64, reordered_sum
from hypothesis import example, given, settings
from hypothesis import strategies as st

from karula_jax.data import split_dirichlet, split_feature_shift, split_label_skew

SETTINGS = dict(max_examples=20, deadline=None)


def _pool(N: int, C: int, seed: int = 0, dim: int = 3):
    """``x [N, dim]`` whose first column is the row id, labels ``y [N]`` in ``[0, C)``."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, dim))
    x[:, 0] = np.arange(N)
    return x, rng.integers(0, C, size=N)


def _clients(data, column=None):
    """Each client's real rows: ids (first feature, or ``y`` when ``column`` is None) and
    labels, as numpy lists."""
    counts = np.asarray(data.counts)
    x, y = np.asarray(data.x), np.asarray(data.y)
    ids = [(x[i, :c, 0] if column == "x" else y[i, :c]).astype(int) for i, c in enumerate(counts)]
    return ids, [y[i, :c] for i, c in enumerate(counts)]


@settings(**SETTINGS)
@given(
    N=st.integers(1, 40),
    C=st.integers(1, 6),
    n_frac=st.floats(0, 1),
    k_frac=st.floats(0, 1),
    seed=st.integers(0, 2**16),
)
@example(N=1, C=1, n_frac=0, k_frac=0, seed=0)
@example(N=2, C=2, n_frac=1, k_frac=1, seed=0)
def test_label_skew_deals_every_owned_row_once_with_at_most_k_labels(N, C, n_frac, k_frac, seed):
    x, y = _pool(N, C, seed)
    present = np.unique(y)
    n = 1 + int(n_frac * (N - 1))
    k = 1 + int(k_frac * (present.size - 1))
    try:
        data = split_label_skew(x, y, n, classes_per_client=k, key=jax.random.key(seed))
    except ValueError as e:
        # only when a class has fewer rows than the clients that own it
        assert "received no row" in str(e)
        owners = -(-n * k // present.size)
        assert np.bincount(y)[present].min() < owners
        return
    ids, labels = _clients(data, "x")
    assert data.num_clients == n
    for i, (r, lab) in enumerate(zip(ids, labels, strict=True)):
        assert len(r) >= 1 and np.all(np.diff(r) > 0), f"client {i}: rows in pool order"
        np.testing.assert_array_equal(lab, y[r])
        assert np.unique(lab).size <= k
    dealt = np.concatenate(ids)
    assert np.unique(dealt).size == dealt.size, "a row went to two clients"
    if n * k >= present.size:  # every class has an owner: every row is dealt
        np.testing.assert_array_equal(np.sort(dealt), np.arange(N))
    else:  # the rows of the classes without owner, and only those, are left out
        left = np.setdiff1d(np.arange(N), dealt)
        assert np.intersect1d(y[left], y[dealt]).size == 0
        assert np.unique(y[dealt]).size == n * k


def test_label_skew_balances_owners_and_rows():
    x, y = _pool(1000, 10)
    data = split_label_skew(x, y, 5, classes_per_client=2, key=jax.random.key(1))
    ids, labels = _clients(data, "x")
    assert [np.unique(lab).size for lab in labels] == [2] * 5  # ten classes, one owner each
    data = split_label_skew(x, y, 10, classes_per_client=3, key=jax.random.key(1))
    ids, labels = _clients(data, "x")
    owners = np.bincount(np.concatenate([np.unique(lab) for lab in labels]), minlength=10)
    np.testing.assert_array_equal(owners, 3)  # 30 slots over 10 classes
    for c in range(10):  # a class's rows in pieces that differ by at most one row
        sizes = [np.sum(lab == c) for lab in labels if np.any(lab == c)]
        assert max(sizes) - min(sizes) <= 1


@settings(**SETTINGS)
@given(N=st.integers(1, 60), C=st.integers(1, 5), n_frac=st.floats(0, 1), seed=st.integers(0, 99))
@example(N=1, C=1, n_frac=0, seed=0)
@example(N=7, C=3, n_frac=1, seed=1)
def test_dirichlet_deals_every_row_once(N, C, n_frac, seed):
    x, y = _pool(N, C, seed)
    n = 1 + int(n_frac * (N - 1))
    try:
        data = split_dirichlet(x, y, n, alpha=1.0, key=jax.random.key(seed))
    except ValueError as e:
        assert "no Dirichlet" in str(e) and n > 1
        return
    ids, labels = _clients(data, "x")
    assert data.num_clients == n and min(len(r) for r in ids) >= 1
    np.testing.assert_array_equal(np.sort(np.concatenate(ids)), np.arange(N))
    for r, lab in zip(ids, labels, strict=True):
        assert np.all(np.diff(r) > 0)
        np.testing.assert_array_equal(lab, y[r])


def _shares(alpha, seed, n=5, C=10, N=2000):
    """Client shares of every class ``[C, n]`` in one split."""
    x, y = _pool(N, C, seed)
    data = split_dirichlet(x, y, n, alpha=alpha, key=jax.random.key(seed))
    _, labels = _clients(data, "x")
    rows = np.stack([np.bincount(lab, minlength=C) for lab in labels], 1)  # [C, n]
    return rows / rows.sum(1, keepdims=True)


@pytest.mark.parametrize("alpha", [0.3, 3.0])
def test_dirichlet_shares_have_the_dirichlet_variance(alpha):
    """A client's share of a class has mean 1/n and variance (1/n)(1 - 1/n)/(n alpha + 1)."""
    n = 5
    shares = np.concatenate([_shares(alpha, s, n=n) for s in range(12)])  # [12 C, n]
    want = (1 / n) * (1 - 1 / n) / (n * alpha + 1)
    # every class's shares sum to 1: exact but for float64's divisions and the mean's sum
    assert abs(shares.mean() - 1 / n) <= reordered_sum(shares.size + 2, eps=EPS64) / n
    # Monte Carlo, 4.5 standard errors: the variance is a mean over the 120 independent
    # classes (their Dirichlet draws) of each class's squared deviations (25% of want here)
    per_class = ((shares - 1 / n) ** 2).sum(1) / n
    se = per_class.std(ddof=1) / np.sqrt(len(per_class))
    assert abs(shares.var() - want) <= 4.5 * se, (shares.var(), want, se)


def test_dirichlet_skew_falls_as_alpha_grows():
    """Mean total-variation distance of a client's label mix from the pool's, over seeds."""

    def skew(alpha):
        tv = []
        for s in range(4):
            x, y = _pool(2000, 10, s)
            data = split_dirichlet(x, y, 10, alpha=alpha, key=jax.random.key(s))
            _, labels = _clients(data, "x")
            pool = np.bincount(y, minlength=10) / len(y)
            tv += [0.5 * np.abs(np.bincount(lab, minlength=10) / len(lab) - pool).sum()
                   for lab in labels]  # fmt: skip
        return np.mean(tv)

    small, one, large = skew(0.05), skew(1.0), skew(1000.0)
    # the effect, not a rounding: measured 0.79, 0.35 and 0.013 (counts of whole rows)
    assert small > 0.6 and large < 0.05 and small > one > large


@settings(**SETTINGS)
@given(N=st.integers(1, 40), n_frac=st.floats(0, 1), seed=st.integers(0, 99))
@example(N=1, n_frac=0, seed=0)
@example(N=9, n_frac=0.5, seed=0)
def test_feature_shift_deals_even_pieces_and_keeps_undistorted_features(N, n_frac, seed):
    x = np.random.default_rng(seed).normal(size=(N, 2, 2))
    y = np.arange(N, dtype=np.float32)  # the row ids
    n = 1 + int(n_frac * (N - 1))
    data = split_feature_shift(x, y, n, key=jax.random.key(seed))  # no distortion: IID
    ids, _ = _clients(data)
    sizes = [len(r) for r in ids]
    assert max(sizes) - min(sizes) <= 1 and data.max_count == -(-N // n)
    np.testing.assert_array_equal(np.sort(np.concatenate(ids)), np.arange(N))
    for i, r in enumerate(ids):
        # the float64 rows stored in float32: one rounding (EPS32 / 2), twice over
        np.testing.assert_allclose(np.asarray(data.x[i, : len(r)]), x[r], rtol=EPS32)


def test_feature_shift_distorts_each_client_as_documented():
    N, n, dim = 6000, 4, 3
    x = np.random.default_rng(0).normal(size=(N, dim))
    y = np.arange(N, dtype=np.float32)
    key = jax.random.key(3)

    def pieces(**amounts):
        data = split_feature_shift(x, y, n, key=key, **amounts)
        ids, _ = _clients(data)
        return [(np.asarray(data.x[i, : len(r)], np.float64), x[r]) for i, r in enumerate(ids)]

    # noise: client i's residual has standard deviation noise * i / (n - 1); Monte Carlo,
    # 4.5 standard errors of a normal sample's standard deviation (sigma / sqrt(2 m), m
    # the piece's entries; was 5%, 2.7 of them: the draws are fixed, the same on any
    # machine), and the float32 storage's rounding where sigma = 0
    for i, (xi, raw) in enumerate(pieces(noise=0.6)):
        sigma = 0.6 * i / (n - 1)
        se = sigma / np.sqrt(2 * xi.size)
        assert abs(np.std(xi - raw) - sigma) <= 4.5 * se + EPS32 * np.abs(raw).max()
    # offset: one vector per client, the same for all its rows, different across clients;
    # each row rounds twice in float32 (the sample, then the sum), of |x| + |offset|
    shifts = []
    for xi, raw in pieces(offset=2.0):
        d = xi - raw
        atol = 2 * EPS32 * (np.abs(raw).max() + np.abs(d).max())
        np.testing.assert_allclose(d, np.broadcast_to(d[0], d.shape), atol=atol)
        shifts.append(d[0])
    assert np.linalg.norm(shifts[0] - shifts[1]) > 0.1  # offsets of size 2 (measured 3.1)
    # scale: one positive contrast per client; a row and the median ratio each carry two
    # float32 roundings (the sample, the product): 4 of EPS32 / 2, and some room
    for xi, raw in pieces(scale=0.5):
        ratio = np.median(xi / raw)
        np.testing.assert_allclose(xi, ratio * raw, rtol=reordered_sum(3))
        assert ratio > 0
    # the per-client distributions differ: client means move apart with the offset
    means = [xi.mean(0) for xi, _ in pieces(offset=2.0)]
    assert np.ptp(np.stack(means), axis=0).max() > 0.5  # offsets of size 2 (measured 7.8)


@pytest.mark.parametrize(
    "split",
    [
        lambda x, y, key: split_label_skew(x, y, 4, classes_per_client=2, key=key),
        lambda x, y, key: split_dirichlet(x, y, 4, alpha=0.5, key=key),
        lambda x, y, key: split_feature_shift(x, y, 4, key=key, noise=1.0, offset=1.0),
    ],
    ids=["label_skew", "dirichlet", "feature_shift"],
)
def test_same_key_same_split_other_key_other_split(split):
    x, y = _pool(200, 5)
    a, b = split(x, y, jax.random.key(7)), split(x, y, jax.random.key(7))
    for u, v in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    c = split(x, y, jax.random.key(8))
    assert c.x.shape != a.x.shape or not np.array_equal(np.asarray(c.x), np.asarray(a.x))
    raw = split(x, y, jax.random.PRNGKey(7))  # a raw uint32[2] key works too
    assert raw.num_clients == 4


X, Y = _pool(10, 3)
KEY = jax.random.key(0)
DEFAULTS = {
    split_label_skew: dict(classes_per_client=1),
    split_dirichlet: dict(alpha=0.5),
    split_feature_shift: {},
}
LS, DIR, FS = split_label_skew, split_dirichlet, split_feature_shift
BAD = [
    (DIR, dict(alpha=0.0), ValueError, "alpha must be finite and > 0"),
    (DIR, dict(alpha=-1), ValueError, "alpha"),
    (DIR, dict(alpha=np.inf), ValueError, "alpha"),
    (DIR, dict(alpha=np.nan), ValueError, "alpha"),
    (DIR, dict(alpha="1"), TypeError, "alpha"),
    (DIR, dict(num_clients=4, min_count=3), ValueError, "min_count"),
    (DIR, dict(num_clients=10, alpha=0.01), ValueError, "no Dirichlet"),
    (LS, dict(num_clients=11), ValueError, "num_clients=11 is more than the 10 samples"),
    (LS, dict(num_clients=0), ValueError, "num_clients must be >= 1"),
    (LS, dict(num_clients=2.0), TypeError, "num_clients"),
    (LS, dict(classes_per_client=4), ValueError, "classes_per_client=4"),
    (LS, dict(classes_per_client=0), ValueError, "classes_per_client"),
    (LS, dict(x=X[:9]), ValueError, "same number of rows"),
    (LS, dict(y=Y[:, None]), ValueError, r"shape \[N\]"),
    (LS, dict(y=Y + 0.5), ValueError, "integer class labels"),
    (LS, dict(y=Y - 1), ValueError, ">= 0"),
    (LS, dict(num_classes=2), ValueError, "outside num_classes=2"),
    (LS, dict(x=np.where(X > 1, np.nan, X)), ValueError, "x contains NaN"),
    (LS, dict(x=X.astype(str)), TypeError, "x must be numeric"),
    (LS, dict(key=None), TypeError, "key must be a PRNG key"),
    (LS, dict(key=jax.random.split(KEY)), ValueError, "one PRNG key"),
    (LS, dict(y=np.array([0] * 9 + [1]), num_clients=4), ValueError, "received no row"),
    (FS, dict(noise=-1.0), ValueError, "noise must be finite and >= 0"),
    (FS, dict(scale=np.inf), ValueError, "scale"),
    (FS, dict(offset=[1.0, 2.0]), TypeError, "offset"),
    (FS, dict(y=1.0), ValueError, "y must have a leading sample axis"),
    (FS, dict(num_classes=2), ValueError, r"labels must lie in \[0, 2\)"),
]


@pytest.mark.parametrize(
    "split, changed, error, match", BAD, ids=[f"bad{i}" for i in range(len(BAD))]
)
def test_bad_input_names_the_argument(split, changed, error, match):
    args = dict(x=X, y=Y, num_clients=3, key=KEY) | DEFAULTS[split] | changed
    with pytest.raises(error, match=match):
        split(**args)
