"""The comparison protocol: stacked CV data sets, grids, cross-validated selection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from karula_jax import algorithms as A
from karula_jax import evaluation as ev
from karula_jax.data import from_client_arrays
from karula_jax.models import ridge_loss
from karula_jax.protocol import (
    Method,
    choice_grid,
    cross_validate,
    cv_datasets,
    scalar_grid,
    stack_datasets,
)
from karula_jax.training import run_many


def _data(seed, sizes, dim=2):
    rng = np.random.default_rng(seed)
    theta = rng.normal(size=(len(sizes), dim))
    xs = [rng.normal(size=(m, dim)).astype(np.float32) for m in sizes]
    ys = [
        (x @ t + 0.1 * rng.normal(size=len(x))).astype(np.float32)
        for x, t in zip(xs, theta, strict=True)
    ]
    return from_client_arrays(xs, ys)


def test_stack_datasets_pads_rows_and_keeps_values():
    a, b = _data(0, (3, 5)), _data(1, (7, 2))
    s = stack_datasets([a, b])
    assert s.x.shape == (2, 2, 7, 2) and s.y.shape == (2, 2, 7)
    np.testing.assert_array_equal(np.asarray(s.x[0, :, :5]), np.asarray(a.x))
    assert np.all(np.asarray(s.x[0, :, 5:]) == 0)
    np.testing.assert_array_equal(np.asarray(s.counts), [[3, 5], [7, 2]])
    with pytest.raises(ValueError, match="items"):
        stack_datasets([])
    with pytest.raises(ValueError, match="clients and feature shapes"):
        stack_datasets([a, _data(2, (3, 4, 5))])
    with pytest.raises(ValueError, match="rows"):
        stack_datasets([a, b], rows=3)


def test_cv_datasets_layout_is_seed_major_folds_then_final_fit():
    train = stack_datasets([_data(0, (6, 9)), _data(1, (8, 4))])
    test = stack_datasets([_data(2, (3, 3)), _data(3, (2, 5))])
    keys = jax.random.split(jax.random.key(0), 2)
    cv = cv_datasets(train, test, 3, key=keys)
    assert cv.train.x.shape[0] == 2 * 4 and (cv.num_seeds, cv.num_folds) == (2, 3)
    for s in range(2):
        seed_train = jax.tree.map(lambda a, s=s: a[s], train)
        fit, val = ev.kfold_split(seed_train, 3, key=keys[s])
        for f in range(3):
            b = s * 4 + f
            np.testing.assert_array_equal(np.asarray(cv.train.x[b]), np.asarray(fit.x[f]))
            nv = np.asarray(val.counts[f])
            np.testing.assert_array_equal(np.asarray(cv.evals.counts[b]), nv)
            np.testing.assert_array_equal(
                np.asarray(cv.evals.x[b, :, : val.x.shape[2]]), np.asarray(val.x[f])
            )
        np.testing.assert_array_equal(np.asarray(cv.train.x[s * 4 + 3]), np.asarray(train.x[s]))
        np.testing.assert_array_equal(np.asarray(cv.evals.counts[s * 4 + 3]), test.counts[s])
    np.testing.assert_array_equal(np.asarray(cv.final(cv.train.counts)), train.counts)
    assert cv.per_member(jnp.arange(2)).tolist() == [0] * 4 + [1] * 4
    with pytest.raises(ValueError, match="exactly one"):
        cv_datasets(train, test, 3)
    with pytest.raises(ValueError, match="seed axis"):
        cv_datasets(_data(0, (6, 9)), _data(1, (3, 3)), 2, key=keys)


def test_method_points_cross_static_and_traced_grids():
    m = Method(lambda **_: None, {"t": np.array([1.0, 2.0])}, [{"k": 1}, {"k": 3}])
    assert m.points() == [
        {"k": 1, "t": 1.0},
        {"k": 1, "t": 2.0},
        {"k": 3, "t": 1.0},
        {"k": 3, "t": 2.0},
    ]
    assert m.labels()[-1] == "k=3, t=2" and m.tuned
    assert Method(lambda **_: None).labels() == [""]
    m = Method(lambda **_: None, **scalar_grid("mu", [0.5, 2.0], shown="mu/L"))
    assert m.labels() == ["mu/L=0.5", "mu/L=2"] and m.points()[1] == {"mu": np.float32(2.0)}
    m = Method(lambda **_: None, **choice_grid("k", (2, 5)))
    assert m.labels() == ["k=2", "k=5"] and [p["k"] for p in m.points()] == [0, 1]


def test_cross_validate_matches_a_hand_made_selection():
    """Local ridge training at three learning rates: the CV pick equals the manual one."""
    S, K, rounds = 2, 2, 20
    train = stack_datasets([_data(s, (8, 6, 10)) for s in range(S)])
    test = stack_datasets([_data(10 + s, (4, 4, 4)) for s in range(S)])
    cv = cv_datasets(train, test, K, key=jax.random.split(jax.random.key(1), S))
    loss, linear = ridge_loss(0.01), lambda th, x: x @ th
    rates = np.array([0.0, 0.5, 3.0], np.float32)
    make = lambda lr: A.local(loss, learning_rate=lr, batch_size=10)
    metrics = lambda th, d: {"mse": ev.mean_squared_error(linear, th, d)}
    keys = jax.random.split(jax.random.key(2), S)
    out = cross_validate(
        Method(make, {"lr": rates}),
        jnp.zeros(2),
        cv,
        keys=keys,
        num_rounds=rounds,
        eval_fn=metrics,
        score=lambda m: m["mse"].mean(-1),
    )
    # by hand: every member at every rate, then the mean validation MSE over folds
    res = run_many(
        make,
        jnp.zeros(2),
        cv.train,
        keys=jnp.repeat(keys, K + 1),
        num_rounds=rounds,
        hyper={"lr": rates},
        data_per_seed=True,
        eval_fn=metrics,
        eval_data=cv.evals,
        eval_data_per_seed=True,
        progress=False,
    )
    mse = np.asarray(res.metrics["mse"][-1]).reshape(S, K + 1, 3, -1)
    want = mse[:, :K].mean(-1).mean(1).argmin(-1)
    np.testing.assert_array_equal(out.chosen, want)
    assert out.cv_score.shape == (S, 3) and out.chosen_labels[0].startswith("lr=")
    np.testing.assert_allclose(out.metrics["mse"], mse[np.arange(S), K, want], rtol=1e-6)
    assert out.grid_metrics["mse"].shape == (S, 3, 3) and out.finite.all()
    # no grid: final fits only, one grid point
    fixed = cross_validate(
        Method(lambda: make(0.5)), jnp.zeros(2), cv, keys=keys, num_rounds=rounds, eval_fn=metrics
    )
    np.testing.assert_allclose(fixed.metrics["mse"], mse[:, K, 1], rtol=1e-6)
    assert fixed.cv_score is None and fixed.labels == [""]
    with pytest.raises(ValueError, match="score"):
        cross_validate(
            Method(make, {"lr": rates}), jnp.zeros(2), cv, keys=keys, num_rounds=1, eval_fn=metrics
        )
