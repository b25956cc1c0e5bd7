"""Cross-validation splits and selection, per-client metrics, rank correlation of D."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerances import EPS32, EPS64, reordered_sum
from scipy import stats as sps

from karula_jax import evaluation as ev
from karula_jax.data import from_client_arrays


def _toy(seed=0, sizes=(7, 12, 5, 2), dim=3, classes=None):
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=(m, dim)).astype(np.float32) for m in sizes]
    if classes is None:
        ys = [rng.normal(size=m).astype(np.float32) for m in sizes]
    else:
        ys = [rng.integers(0, classes, size=m) for m in sizes]
    return from_client_arrays(xs, ys, num_classes=classes), xs, ys


@pytest.mark.parametrize("num_folds", [2, 3, 5])
def test_kfold_split_partitions_every_clients_rows(num_folds):
    data, xs, ys = _toy(sizes=(7, 12, 5, 2, 1))
    folds = np.asarray(ev.fold_ids(data.counts, data.max_count, num_folds, key=jax.random.key(0)))
    train, val = ev.kfold_split(data, num_folds, folds=folds)
    assert train.x.shape == (num_folds,) + data.x.shape
    for i, x in enumerate(xs):
        m = len(x)
        assert np.all(folds[i, m:] == -1)
        sizes = np.bincount(folds[i, :m], minlength=num_folds)
        assert sizes.max() - sizes.min() <= 1  # balanced
        seen = []
        for f in range(num_folds):
            nv, nt = int(val.counts[f, i]), int(train.counts[f, i])
            assert nv + nt == m
            # brute force: the fold's rows, in their original order
            np.testing.assert_array_equal(np.asarray(val.x[f, i, :nv]), x[folds[i, :m] == f])
            np.testing.assert_array_equal(np.asarray(train.x[f, i, :nt]), x[folds[i, :m] != f])
            np.testing.assert_array_equal(np.asarray(train.y[f, i, :nt]), ys[i][folds[i, :m] != f])
            assert np.all(np.asarray(val.x[f, i, nv:]) == 0)
            assert np.all(np.asarray(train.y[f, i, nt:]) == 0)
            seen.append(np.flatnonzero(folds[i, :m] == f))
        # every row is validated exactly once
        np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(m))


def test_kfold_split_from_key_is_jittable_and_vmappable():
    data, _, _ = _toy()
    keys = jax.random.split(jax.random.key(3), 2)
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), data)
    train, val = jax.jit(jax.vmap(lambda d, k: ev.kfold_split(d, 3, key=k)))(stacked, keys)
    assert train.x.shape == (2, 3) + data.x.shape
    np.testing.assert_array_equal(
        np.asarray(train.counts + val.counts), np.broadcast_to(data.counts, (2, 3, 4))
    )
    want = ev.kfold_split(data, 3, key=keys[1])
    np.testing.assert_array_equal(np.asarray(val.x[1]), np.asarray(want[1].x))


def test_kfold_split_rejects_bad_arguments():
    data, _, _ = _toy()
    with pytest.raises(ValueError, match="exactly one of key= and folds="):
        ev.kfold_split(data, 3)
    with pytest.raises(ValueError, match="num_folds"):
        ev.kfold_split(data, 1, key=jax.random.key(0))
    with pytest.raises(ValueError, match="folds must have shape"):
        ev.kfold_split(data, 2, folds=np.zeros((2, 2), np.int32))
    with pytest.raises(TypeError, match="data must be a ClientData"):
        ev.kfold_split(np.zeros(3), 2, key=jax.random.key(0))


def test_select_by_cv_on_hand_made_scores():
    # 2 seeds x 3 folds x 4 grid points
    scores = np.array(
        [
            [[3.0, 1.0, 2.0, 5.0], [3.0, 1.0, 2.0, 5.0], [3.0, 4.0, 2.0, 5.0]],
            [[1.0, 1.0, 0.5, np.nan], [1.0, 1.0, 0.5, 0.1], [1.0, 1.0, np.inf, 0.1]],
        ]
    )
    sel = ev.select_by_cv(scores)
    # seed 0: means 3, 2, 2, 5 -> tie between 1 and 2 goes to the first grid point
    # seed 1: points 2 and 3 diverged on some fold -> excluded; tie 0/1 -> 0
    np.testing.assert_array_equal(sel.index, [1, 0])
    np.testing.assert_array_equal(sel.score[0], [3, 2, 2, 5])  # integer sums over 3: exact
    assert np.isinf(sel.score[1, 2:]).all()
    # fold weights give the pooled score: seed 0 point 1 = (1*1 + 1*1 + 4*8) / 10
    w = np.array([[1.0, 1.0, 8.0], [1.0, 1.0, 1.0]])
    sel = ev.select_by_cv(scores, fold_weights=w)
    # integer sums, one division each: 34 / 10 rounds once, to the literal 3.4
    np.testing.assert_array_equal(sel.score[0], [3.0, 3.4, 2.0, 5.0])
    assert sel.index[0] == 2
    # valid=False excludes a point even with a finite score
    valid = np.ones(scores.shape, bool)
    valid[0, 0, 1] = False
    assert ev.select_by_cv(scores, valid=valid).index[0] == 2
    # maximize: the best accuracy wins, diverged points are excluded as -inf
    sel = ev.select_by_cv(scores, maximize=True)
    np.testing.assert_array_equal(sel.index, [3, 0])
    assert sel.score[1, 3] == -np.inf
    # no seed axis
    assert ev.select_by_cv(scores[0]).index == 1


def test_select_by_cv_errors():
    with pytest.raises(ValueError, match="every grid point diverged"):
        ev.select_by_cv(np.array([[np.nan, 1.0], [1.0, np.inf]]))
    with pytest.raises(ValueError, match=r"\[\.\.\., K, G\]"):
        ev.select_by_cv(np.ones(3))
    with pytest.raises(ValueError, match="fold_weights must have shape"):
        ev.select_by_cv(np.ones((3, 2)), fold_weights=np.ones(2))
    with pytest.raises(ValueError, match="valid must have shape"):
        ev.select_by_cv(np.ones((3, 2)), valid=np.ones(2, bool))


def _linear(theta, x):
    return x @ theta


def _brute(xs, ys, theta, fn):
    return np.array([fn(x @ theta[i], y) for i, (x, y) in enumerate(zip(xs, ys, strict=True))])


def _squares_bound(xs, ys, theta):
    """Float32 error bounds of per-client MSE and R^2 (both sides in float32): residuals
    ``y - x theta`` round to ``d + 1`` roundings of ``M = |x| |theta| + |y|``, a sum of
    ``m`` squares adds ``m``, so ``sse`` moves by ``(m + 2 d + 4) eps sum M^2`` at most (and
    ``sst`` likewise with ``M = |y| + |mean y|``); R^2 moves by ``sse``'s move over ``sst``
    plus ``sse / sst`` times ``sst``'s relative move. Returns ``(mse, r2)`` bounds."""
    mse, r2 = [], []
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        x, y, th = (np.asarray(a, np.float64) for a in (x, y, theta[i]))
        m, d = x.shape
        tol = reordered_sum(m + 2 * d + 4)
        sse = np.sum((y - x @ th) ** 2)
        sst = np.sum((y - y.mean()) ** 2)
        d_sse = tol * np.sum((np.abs(x) @ np.abs(th) + np.abs(y)) ** 2)
        d_sst = tol * np.sum((np.abs(y) + np.abs(y.mean())) ** 2)
        mse.append(d_sse / m)
        r2.append(d_sse / sst + sse / sst * d_sst / sst)
    return np.array(mse), np.array(r2)


def test_regression_metrics_match_numpy():
    data, xs, ys = _toy(1)
    rng = np.random.default_rng(2)
    theta = rng.normal(size=(4, 3)).astype(np.float32)
    truth = rng.normal(size=(4, 3)).astype(np.float32)
    r2 = np.asarray(jax.jit(ev.r2_score, static_argnums=0)(_linear, theta, data))
    want = _brute(
        xs, ys, theta, lambda p, y: 1 - np.sum((y - p) ** 2) / np.sum((y - y.mean()) ** 2)
    )
    mse_tol, r2_tol = _squares_bound(xs, ys, theta)
    assert np.all(np.abs(r2 - want) <= r2_tol), (r2, want, r2_tol)
    mse = np.asarray(ev.mean_squared_error(_linear, theta, data))
    want = _brute(xs, ys, theta, lambda p, y: np.mean((p - y) ** 2))
    assert np.all(np.abs(mse - want) <= mse_tol), (mse, want, mse_tol)
    err = np.asarray(ev.estimation_error(theta, truth))
    # float32 both sides: 3 differences squared and summed (nonnegative terms), 5 roundings
    np.testing.assert_allclose(err, np.sum((theta - truth) ** 2, axis=1), rtol=reordered_sum(5))
    tree = ev.estimation_error({"a": theta, "b": theta[:, :1]}, {"a": truth, "b": truth[:, :1]})
    # one more square and one more sum
    np.testing.assert_allclose(
        tree, err + (theta[:, 0] - truth[:, 0]) ** 2, rtol=reordered_sum(5 + 2)
    )


def _nll_bound(x, w, z, logp):
    """Float32 error bound of a mean log-loss (both sides in float32): the logits round to
    ``d + 1`` roundings of ``|x| |w|``, which move ``log p`` as much; the log-sum-exp adds
    ``C + 4`` roundings of ``|log p|`` and of the largest logit (exp's relative error is
    its argument's absolute one); the mean of ``m`` rows one more each."""
    m, d = x.shape
    c = w.shape[-1] + 1  # the binary case's two classes
    scale = np.abs(x) @ np.abs(w) + np.abs(z).max(1, keepdims=True) + np.abs(logp)
    return reordered_sum(d + c + 6) * float(scale.max(1).mean())


def test_classification_metrics_match_numpy():
    data, xs, ys = _toy(3, classes=4)
    rng = np.random.default_rng(4)
    w = rng.normal(size=(4, 3, 4)).astype(np.float32)  # per-client [d, C]
    acc = np.asarray(ev.accuracy(_linear, w, data))
    nll = np.asarray(ev.log_loss(_linear, w, data))
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        z = x @ w[i]
        # a count of exact 0/1 terms over m, one float32 division (no arg-max near a tie)
        assert acc[i] == pytest.approx(np.mean(np.argmax(z, 1) == y), rel=EPS32)
        logp = z - np.log(np.sum(np.exp(z), 1, keepdims=True))
        want = -np.mean(logp[np.arange(len(y)), y])
        assert nll[i] == pytest.approx(want, abs=_nll_bound(x, w[i], z, logp))
    # binary: one logit per row
    data, xs, ys = _toy(5, classes=2)
    v = rng.normal(size=(4, 3)).astype(np.float32)
    acc = np.asarray(ev.accuracy(_linear, v, data))
    nll = np.asarray(ev.log_loss(_linear, v, data))
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        z = x @ v[i]
        assert acc[i] == pytest.approx(np.mean((z > 0) == y), rel=EPS32)  # as above
        p = 1 / (1 + np.exp(-z))
        want = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
        logp = np.stack([np.log(1 - p), np.log(p)], axis=1)
        assert nll[i] == pytest.approx(want, abs=_nll_bound(x, v[i][:, None], z[:, None], logp))


def test_metrics_ignore_inf_in_padding():
    data, xs, ys = _toy(6)
    x = np.asarray(data.x).copy()
    x[0, len(xs[0]) :] = np.inf
    bad = data._replace(x=jnp.asarray(x))
    theta = np.ones((4, 3), np.float32)
    for fn in (ev.r2_score, ev.mean_squared_error):
        # the padding is masked out before any sum: the same operations on the same rows
        np.testing.assert_array_equal(fn(_linear, theta, bad), fn(_linear, theta, data))


def test_spearman_offdiag_matches_scipy():
    rng = np.random.default_rng(0)
    for n in (2, 3, 7, 12):
        a = rng.normal(size=(n, n))
        b = a + rng.normal(size=(n, n))
        b[0, -1] = a[0, -1] = 1.0  # ties
        iu = np.triu_indices(n, 1)
        want = sps.spearmanr(a[iu], b[iu]).statistic if n > 2 else np.nan
        got = ev.spearman_offdiag(a, b)
        if n == 2:
            assert np.isnan(got)  # one pair: constant
        else:
            # float64 sums over the pairs' ranks in scipy's order and ours, and the
            # normalization's square root and division
            assert got == pytest.approx(want, abs=reordered_sum(len(iu[0]) + 4, eps=EPS64))
    a = rng.integers(0, 3, size=(9, 9)).astype(float)  # many ties
    b = rng.integers(0, 3, size=(9, 9)).astype(float)
    iu = np.triu_indices(9, 1)
    want = sps.spearmanr(a[iu], b[iu]).statistic
    assert ev.spearman_offdiag(a, b) == pytest.approx(want, abs=reordered_sum(36 + 4, eps=EPS64))
    with pytest.raises(ValueError, match="a and b must be square"):
        ev.spearman_offdiag(np.ones((3, 3)), np.ones((3, 4)))


def test_pairwise_sq_distances_and_active_fraction():
    rng = np.random.default_rng(1)
    params = {"w": rng.normal(size=(5, 3)), "b": rng.normal(size=(5,))}
    sq = ev.pairwise_sq_distances(params)
    v = np.concatenate([params["b"][:, None], params["w"]], axis=1)
    want = ((v[:, None] - v[None]) ** 2).sum(-1)
    # float64, 4 nonnegative squares summed in another order, each difference rounded once
    np.testing.assert_allclose(sq, want, rtol=reordered_sum(4 + 2, eps=EPS64))
    only_w = ev.pairwise_sq_distances(params, {"w": True, "b": False})
    want_w = ((params["w"][:, None] - params["w"][None]) ** 2).sum(-1)
    np.testing.assert_allclose(only_w, want_w, rtol=reordered_sum(3 + 2, eps=EPS64))
    iu = np.triu_indices(5, 1)
    D = np.ones((5, 5))
    for t in (0.0, np.median(sq[iu]), 10 * sq.max()):
        # active_fraction's own rtol (1e-3, its default), not a tolerance of this test
        want = np.mean([sq[i, j] >= (1 - 1e-3) * t for i, j in zip(*iu, strict=True)])
        assert ev.active_fraction(sq, D, t) == want  # the same booleans, one division
    assert ev.active_fraction(sq, D, 0.0) == 1.0
    assert ev.active_fraction(sq, D, 1e9) == 0.0


def test_exact_pairwise_w1_is_a_metric_on_samples():
    pytest.importorskip("ot")
    data = from_client_arrays(
        [np.zeros((2, 1)), np.ones((3, 1)), 3 * np.ones((1, 1))], [np.zeros(2), np.zeros(3), [0.0]]
    )
    w = ev.exact_pairwise_w1(data)
    # point masses at 0, 1, 3 on the x axis (y = 0): W1 is the distance between them, up to
    # POT's float64 sum of at most 2 x 3 plan entries times costs up to 3
    want = [[0, 1, 3], [1, 0, 2], [3, 2, 0]]
    np.testing.assert_allclose(w, want, atol=reordered_sum(6, eps=EPS64) * 3)


def test_ridge_solutions_match_augmented_least_squares():
    data, xs, ys = _toy(sizes=(7, 12, 5, 4), dim=3)
    lam, n, d = 0.3, len(xs), 3
    local, pooled = ev.ridge_solutions(data, lam)

    def lstsq(x, y, scale, penalty):  # argmin ||x th - y||^2 / (2 scale) + penalty/2 ||th||^2
        a = np.vstack([x / np.sqrt(scale), np.sqrt(penalty) * np.eye(d)])
        return np.linalg.lstsq(a, np.concatenate([y / np.sqrt(scale), np.zeros(d)]), rcond=None)[0]

    def tol(x, scale, penalty, want):  # float64 normal equations: kappa(H) times their sums
        h = x.T @ x / scale + penalty * np.eye(d)
        return np.linalg.cond(h) * reordered_sum(len(x) + d, eps=EPS64) * np.abs(want).max()

    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        want = lstsq(x.astype(np.float64), y.astype(np.float64), len(x), lam)
        atol = tol(x.astype(np.float64), len(x), lam, want)
        np.testing.assert_allclose(local[i], want, rtol=0, atol=atol)
    # sum_i alpha_i f_i = ||X th - y||^2 / (2 mean N) + (n lam)/2 ||th||^2 (sum_i alpha_i = n)
    x_all, y_all = (np.concatenate(v).astype(np.float64) for v in (xs, ys))
    scale = np.mean([len(x) for x in xs])
    want = lstsq(x_all, y_all, scale, n * lam)
    np.testing.assert_allclose(pooled, want, rtol=0, atol=tol(x_all, scale, n * lam, want))


def test_flattened_accepts_a_plateau_and_refuses_slopes_swings_rises_and_nans():
    rounds = np.arange(0, 501, 25)
    r = rounds / 500.0
    curves = {
        "plateau": 0.1 + 2.2 * np.exp(-25 * r),  # flat long before the last fifth
        "still falling": 2.3 - 2.0 * r,  # a straight line: 20% of its decrease at the end
        "slow tail": 0.1 + 2.2 * np.exp(-3 * r),  # 4.3% of the decrease in the last fifth
        "oscillating": 0.1 + 2.2 * np.exp(-25 * r) + 0.2 * (r > 0.8) * np.cos(40 * r),
        "rising": 2.3 - 2.0 * np.minimum(r, 0.5) + 0.5 * np.maximum(r - 0.5, 0),
        "nan": np.where(r > 0.9, np.nan, 2.3 - 2.0 * r),
        "never fell": np.full(r.shape, 2.3),
    }
    got = ev.flattened(np.stack(list(curves.values())), rounds)
    assert got.tolist() == [True] + [False] * 6, dict(zip(curves, got, strict=True))
    # the share decides the slow tail: 4.3% of the decrease passes at 5%, not at 2%
    assert bool(ev.flattened(curves["slow tail"], rounds, share=0.05))
    # the window: the line moves 20% of its decrease over the last fifth, 5% over the last 20th
    assert not ev.flattened(curves["still falling"], rounds, last=0.05, share=0.04)
    assert ev.flattened(curves["still falling"], rounds, last=0.05, share=0.06)
    # coarse evaluation grids: the window still spans two evaluations at least
    assert not ev.flattened([2.3, 0.3], [0, 500])
    assert not ev.flattened([2.3, 1.3, 0.3], [0, 5, 10])
    assert not ev.flattened([2.3, 1.8, 1.3, 0.8, 0.3], [0, 100, 200, 300, 400])
    assert ev.flattened([2.3, 0.31, 0.3], [0, 5, 10], share=0.01)
    for bad in (dict(last=0.0), dict(last=1.0), dict(share=0.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ev.flattened(curves["plateau"], rounds, **bad)
    with pytest.raises(ValueError, match="rounds"):
        ev.flattened(curves["plateau"], rounds[:-1])
    # the tail both read: round 400 of 0..500 by 25; the middle of a grid of three
    assert ev.tail_start(rounds) == 16 and ev.tail_start([0, 5, 10]) == 1
