import numpy as np
import pytest
from _tolerances import reordered_sum

from karula_jax.data import client_weights, from_client_arrays, synthetic_ridge


def test_padding_and_mask():
    xs = [np.ones((2, 3)), 2 * np.ones((4, 3))]
    ys = [np.zeros(2), np.ones(4)]
    data = from_client_arrays(xs, ys)
    assert data.x.shape == (2, 4, 3) and data.y.shape == (2, 4)
    np.testing.assert_array_equal(data.counts, [2, 4])
    np.testing.assert_array_equal(data.mask, [[1, 1, 0, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(data.x[0, 2:], 0.0)


@pytest.mark.parametrize(
    "xs, ys, kwargs, err, match",
    [
        ([np.ones((2, 3)), np.ones((2, 4))], [np.ones(2)] * 2, {}, ValueError, "feature shapes"),
        (
            [np.ones((2, 3)), np.zeros((0, 3))],
            [np.ones(2), np.ones(0)],
            {},
            ValueError,
            "no samples",
        ),
        ([np.full((2, 3), np.nan)], [np.ones(2)], {}, ValueError, "NaN"),
        ([np.ones((2, 3))], [np.array([0.0, np.inf])], {}, ValueError, "NaN or infinite"),
        ([np.ones((2, 3))], [np.array([0.5, 1.0])], {"num_classes": 3}, ValueError, "integer"),
        ([np.ones((2, 3))], [np.array([0, 3])], {"num_classes": 3}, ValueError, r"\[0, 3\)"),
        ([np.ones((2, 3))], [np.ones(3)], {}, ValueError, "rows"),
        ([], [], {}, ValueError, "at least one client"),
        ([np.ones((2, 3))], [np.ones(2), np.ones(2)], {}, ValueError, "one entry per client"),
    ],
)
def test_bad_input_is_named(xs, ys, kwargs, err, match):
    with pytest.raises(err, match=match):
        from_client_arrays(xs, ys, **kwargs)


def test_client_weights_mean_one():
    w = client_weights(np.array([10, 30, 20]))
    # float32 weights: a few roundings of the counts' ratio (measured 8e-8)
    np.testing.assert_allclose(w, [0.5, 1.5, 1.0], rtol=reordered_sum(2))


def test_synthetic_ridge_matches_its_docstring():
    s = synthetic_ridge(0, noise_std=0.0)
    n, d = s.theta_true.shape
    assert (n, d) == (30, 50)
    counts = np.asarray(s.train.counts)
    assert counts.min() >= 10 and counts.max() <= 100
    np.testing.assert_array_equal(np.bincount(np.asarray(s.groups)), [10, 10, 10])
    # Noise-free responses are exactly linear in the features on real rows.
    pred = np.einsum("nkd,nd->nk", np.asarray(s.train.x), np.asarray(s.theta_true))
    mask = np.asarray(s.train.mask)
    # float32 dot products of d = 50 terms, ours and the generator's (and y's storage): of
    # the magnitudes |x| . |theta|
    size = np.einsum("nkd,nd->nk", np.abs(np.asarray(s.train.x)), np.abs(np.asarray(s.theta_true)))
    err = np.abs(pred - np.asarray(s.train.y))[mask]
    assert np.all(err <= reordered_sum(d + 1) * size[mask]), err.max()
    # Group centres are 1, 1.5, 2: Monte Carlo, 4.5 standard errors of a mean of a group's
    # 10 x 50 parameters, drawn with theta_std = 0.1 (was 0.05, 11 of them)
    groups = np.asarray(s.groups)
    centres = [np.asarray(s.theta_true)[groups == g].mean() for g in range(3)]
    se = 0.1 / np.sqrt(np.sum(groups == 0) * d)
    np.testing.assert_allclose(centres, [1.0, 1.5, 2.0], atol=4.5 * se)
    # Same seed, same data.
    np.testing.assert_array_equal(synthetic_ridge(0).train.x, synthetic_ridge(0).train.x)


def test_synthetic_group_feature_offsets_follow_the_groups():
    kw = dict(feature_mean_std=0.0, feature_scale_range=(1.0, 1.0), num_test=2000)
    base = synthetic_ridge(1, **kw)
    grouped = synthetic_ridge(1, group_feature_std=1.0, **kw)
    # The offsets are drawn after everything else of the default stream: sizes and models
    # do not move, and group_feature_std=0 is the default generator.
    np.testing.assert_array_equal(np.asarray(base.theta_true), np.asarray(grouped.theta_true))
    np.testing.assert_array_equal(np.asarray(base.train.counts), np.asarray(grouped.train.counts))
    means = np.asarray(grouped.test.x).mean(axis=1)  # [n, d], sampling error ~ 1/sqrt(2000)
    g = np.asarray(grouped.groups)
    same = np.linalg.norm(means[g == 0][0] - means[g == 0][1])
    other = np.linalg.norm(means[g == 0][0] - means[g == 1][0])
    # Same group: only sampling noise (~0.03 * sqrt(2 d) = 0.3); other group: ~sqrt(2 d) = 10.
    # Such norms concentrate (standard deviation 0.02 and 0.7): 0.6 is 14 of them above 0.3,
    # 5 is 7 below 10; fixed draws
    assert same < 0.6 < 5.0 < other
    base_means = np.asarray(base.test.x).mean(axis=1)
    assert np.linalg.norm(base_means[0] - base_means[10]) < 0.6  # no offsets by default


def test_synthetic_rejects_negative_spreads():
    for name in ("noise_std", "theta_std", "feature_mean_std", "group_feature_std"):
        with pytest.raises(ValueError, match=name):
            synthetic_ridge(0, **{name: -0.1})


def test_random_classification_shapes_and_bad_sizes():
    """FEMNIST shapes by default, counts within ``rows``, labels within the classes, the
    same clients for the same seed; bad sizes are refused by name."""
    from karula_jax.data import random_classification

    data = random_classification(7, seed=3)
    counts = np.asarray(data.counts)
    assert data.x.shape[0] == 7 and data.x.shape[2] == 784
    assert np.all((counts >= 150) & (counts <= 210)) and data.x.shape[1] == counts.max()
    y = np.asarray(data.y)[np.asarray(data.mask)]
    assert y.min() >= 0 and y.max() <= 9
    again = random_classification(7, seed=3)
    np.testing.assert_array_equal(np.asarray(again.x), np.asarray(data.x))
    one = random_classification(1, rows=(2, 2), features=3, num_classes=2)
    assert one.x.shape == (1, 2, 3) and int(one.counts[0]) == 2
    for kwargs, name in [
        (dict(num_clients=0), "num_clients"),
        (dict(num_clients=2, features=0), "features"),
        (dict(num_clients=2, num_classes=0), "num_classes"),
        (dict(num_clients=2, rows=(5, 3)), "rows"),
    ]:
        with pytest.raises(ValueError, match=name):
            random_classification(**kwargs)
