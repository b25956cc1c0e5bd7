"""Models and losses against numpy closed forms and finite differences."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerances import EPS32, EPS64, reordered_sum

from karula_jax import models


def _np_logsoftmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _np_mlp(params, x):
    p = {k: {n: np.asarray(v, np.float64) for n, v in d.items()} for k, d in params.items()}
    h = np.maximum(x @ p["hidden"]["kernel"] + p["hidden"]["bias"], 0.0)
    return h @ p["output"]["kernel"] + p["output"]["bias"]


def _np_cross_entropy(params, x, y, mask):
    lp = _np_logsoftmax(_np_mlp(params, np.asarray(x, np.float64)))
    rows = -lp[np.arange(len(y)), y]
    return rows[mask].mean()


# Tolerances. A float32 evaluation differs from the float64 reference (exact to it) by at
# most ``_gamma(m) = m EPS32 / 2`` of the same computation taken in magnitude (Higham's
# gamma_m), m the roundings along its longest chain of sums; two float32 evaluations in
# different orders by twice that, ``reordered_sum(m)``.


def _gamma(m: int) -> float:
    """One float32 evaluation of ``m`` chained roundings against an exact reference."""
    return reordered_sum(m) / 2


def _assert_within(got, want, bound, **kw):
    """``|got - want| <= bound`` elementwise (``bound`` an array, which ``assert_allclose``'s
    report cannot print)."""
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    assert np.all(err <= bound), (kw, err.max(), np.max(err / np.maximum(bound, 1e-300)))


def _mlp_terms(params, x) -> int:
    """Roundings along the MLP's logits: a dot of d_in and one of hidden terms, two biases."""
    return x.shape[-1] + params["hidden"]["kernel"].shape[1] + 2


def _mlp_magnitude(params, x):
    """The MLP's logits taken in magnitude (``|x| |W| + |b|`` per layer, ReLU as identity),
    the scale their float32 rounding is relative to; ``[B, C]``."""
    p = {k: {n: np.abs(np.asarray(v, np.float64)) for n, v in d.items()} for k, d in params.items()}
    h = np.abs(np.asarray(x, np.float64)) @ p["hidden"]["kernel"] + p["hidden"]["bias"]
    return h @ p["output"]["kernel"] + p["output"]["bias"]


def _cross_entropy_bound(params, x, mask) -> float:
    """Float32 rounding of the masked mean cross-entropy: each row's ``logsumexp(z) - z_y``
    moves by at most twice its logits' rounding, plus the rounding of the logsumexp over C
    classes (its value at most ``2 max|z| + log C``) and of the mean over the rows."""
    mag = _mlp_magnitude(params, x)
    rows, classes = int(np.sum(mask)), mag.shape[-1]
    logits = _gamma(_mlp_terms(params, x)) * mag.max(-1)
    row_scale = 2 * mag.max(-1) + np.log(classes)
    return float(np.mean((2 * logits + _gamma(classes + rows + 3) * row_scale)[mask]))


def _cross_entropy_grad_bound(params, x, y, mask):
    """Float32 rounding of the cross-entropy's gradient, leaf by leaf: the backward pass in
    magnitude (``|softmax - onehot|`` replaced by ``softmax + onehot``, each product by the
    product of magnitudes), times ``reordered_sum`` of the forward and backward chains;
    the softmax moves with its logits' rounding, by up to ``2 max|z|`` of that relative
    rounding (the factor ``1 + 2 max|z|``)."""
    p = {k: {n: np.asarray(v, np.float64) for n, v in d.items()} for k, d in params.items()}
    x = np.asarray(x, np.float64)[mask]
    z = _np_mlp(params, x)
    q = np.exp(_np_logsoftmax(z)) + np.eye(z.shape[-1])[np.asarray(y)[mask]]
    rows = len(x)
    h = np.abs(x) @ np.abs(p["hidden"]["kernel"]) + np.abs(p["hidden"]["bias"])
    dh = q @ np.abs(p["output"]["kernel"]).T
    mag = {
        "hidden": {"kernel": np.abs(x).T @ dh / rows, "bias": dh.sum(0) / rows},
        "output": {"kernel": h.T @ q / rows, "bias": q.sum(0) / rows},
    }
    terms = 2 * _mlp_terms(params, x) + z.shape[-1] + rows
    factor = reordered_sum(terms) * (1 + 2 * _mlp_magnitude(params, x).max())
    return {"params": {k: {n: factor * a for n, a in d.items()} for k, d in mag.items()}}


def _fd_truncation(params, x, mask, layer, name, idx, eps) -> float:
    """Bound on a central difference's truncation, ``eps^2 / 6 max |f^(3)|``, for the mean
    cross-entropy along one coordinate: with the ReLU pattern fixed a row's logits move on a
    line ``z + t s``, and the third derivative of ``logsumexp(z + t s) - z_y - t s_y`` (the
    third cumulant of ``s`` under the softmax) is at most ``range(s)^3``."""
    p = {k: {n: np.asarray(v, np.float64) for n, v in d.items()} for k, d in params.items()}
    x = np.asarray(x, np.float64)[mask]
    w2 = p["output"]["kernel"]
    if layer == "output":
        rng_s = np.ones(len(x))
        if name == "kernel":
            h = np.maximum(x @ p["hidden"]["kernel"] + p["hidden"]["bias"], 0.0)
            rng_s = np.abs(h[:, idx[0]])
    else:
        k = idx[-1]
        rng_s = np.full(len(x), np.ptp(w2[k]))
        if name == "kernel":
            rng_s = rng_s * np.abs(x[:, idx[0]])
    return float(eps**2 / 6 * np.mean(rng_s**3))


@pytest.fixture(scope="module")
def small_mlp():
    model = models.mlp(hidden=7, num_classes=4)
    params = models.init_params(model, jax.random.key(0), (1, 6))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(9, 6)).astype(np.float32)
    y = rng.integers(0, 4, size=9).astype(np.int32)
    mask = np.array([1, 1, 0, 1, 1, 1, 0, 1, 0], bool)
    return model, params, x, y, mask


def test_mlp_shapes_and_forward():
    model = models.mlp()
    params = models.init_params(model, jax.random.key(1), (1, 784))
    shapes = jax.tree.map(jnp.shape, params)
    assert shapes == {
        "params": {
            "hidden": {"kernel": (784, 100), "bias": (100,)},
            "output": {"kernel": (100, 10), "bias": (10,)},
        }
    }
    x = np.random.default_rng(1).uniform(size=(3, 784)).astype(np.float32)
    # float32 logits of a 784- and a 100-term dot: relative to the logits in magnitude
    bound = _gamma(_mlp_terms(params["params"], x)) * _mlp_magnitude(params["params"], x)
    _assert_within(model.apply(params, x), _np_mlp(params["params"], x), bound)


def test_cross_entropy_matches_numpy_and_ignores_padding(small_mlp):
    model, params, x, y, mask = small_mlp
    loss = models.cross_entropy_loss(model.apply)
    ref = _np_cross_entropy(params["params"], x, y, mask)
    atol = _cross_entropy_bound(params["params"], x, mask)  # float32 rounding of the loss
    np.testing.assert_allclose(float(loss(params, x, y, mask)), ref, rtol=0, atol=atol)
    # Garbage in padded rows (huge inputs, labels of other classes) changes nothing.
    x2, y2 = x.copy(), y.copy()
    x2[~mask] = 1e3
    y2[~mask] = (y2[~mask] + 1) % 4
    np.testing.assert_allclose(float(loss(params, x2, y2, mask)), ref, rtol=0, atol=atol)
    grad = jax.jit(jax.grad(loss))
    g1 = grad(params, x, y, mask)
    g2 = grad(params, x2, y2, mask)
    g_real = grad(params, x[mask], y[mask], np.ones(mask.sum(), bool))
    # two float32 gradients of the real rows (another row count: another order)
    bound = _cross_entropy_grad_bound(params["params"], x, y, mask)
    for a, b, c, tol in zip(*(jax.tree.leaves(t) for t in (g1, g2, g_real, bound)), strict=True):
        _assert_within(a, b, tol)
        _assert_within(a, c, tol)


def test_cross_entropy_gradient_finite_differences(small_mlp):
    model, params, x, y, mask = small_mlp
    grads = jax.grad(models.cross_entropy_loss(model.apply))(params, x, y, mask)
    bound = _cross_entropy_grad_bound(params["params"], x, y, mask)
    rng = np.random.default_rng(3)
    eps = 1e-4
    base = {
        k: {n: np.asarray(v, np.float64) for n, v in d.items()} for k, d in params["params"].items()
    }
    for layer, name in [
        ("hidden", "kernel"),
        ("hidden", "bias"),
        ("output", "kernel"),
        ("output", "bias"),
    ]:
        arr = base[layer][name]
        for _ in range(3):
            idx = tuple(int(rng.integers(0, s)) for s in arr.shape)
            plus = {k: {n: v.copy() for n, v in d.items()} for k, d in base.items()}
            minus = {k: {n: v.copy() for n, v in d.items()} for k, d in base.items()}
            plus[layer][name][idx] += eps
            minus[layer][name][idx] -= eps
            fd = (_np_cross_entropy(plus, x, y, mask) - _np_cross_entropy(minus, x, y, mask)) / (
                2 * eps
            )
            got = float(grads["params"][layer][name][idx])
            # the float32 gradient's rounding, the central difference's truncation and the
            # float64 loss's rounding (30 roundings of values ~|f|, divided by 2 eps)
            atol = bound["params"][layer][name][idx] + _fd_truncation(
                base, x, mask, layer, name, idx, eps
            )
            atol += reordered_sum(30, eps=EPS64) * _np_cross_entropy(base, x, y, mask) / eps
            np.testing.assert_allclose(got, fd, rtol=0, atol=atol)


def test_accuracy_matches_numpy(small_mlp):
    model, params, x, y, mask = small_mlp
    acc = models.accuracy(model.apply)
    pred = _np_mlp(params["params"], x).argmax(-1)
    # Make the answer non-trivial: set half the real labels to the prediction.
    y = y.copy()
    y[::2] = pred[::2]
    expected = (pred == y)[mask].mean()
    # a count over a row count, rounded once in float32
    np.testing.assert_allclose(float(acc(params, x, y, mask)), expected, rtol=EPS32)
    assert float(acc(params, x, y, np.zeros_like(mask))) == 0.0
    assert float(models.cross_entropy_loss(model.apply)(params, x, y, np.zeros_like(mask))) == 0.0


def test_losses_vmap_over_clients(small_mlp):
    model, params, x, y, mask = small_mlp
    loss = jax.jit(jax.vmap(models.cross_entropy_loss(model.apply), in_axes=(None, 0, 0, 0)))
    xs, ys, ms = np.stack([x, x[::-1]]), np.stack([y, y[::-1]]), np.stack([mask, mask[::-1]])
    out = np.asarray(loss(params, xs, ys, ms))
    for i in range(2):
        ref = _np_cross_entropy(params["params"], xs[i], ys[i], ms[i])
        atol = _cross_entropy_bound(params["params"], xs[i], ms[i])  # float32 rounding
        np.testing.assert_allclose(out[i], ref, rtol=0, atol=atol)


def test_output_layer_mask_marks_last_dense_only(small_mlp):
    _, params, _, _, _ = small_mlp
    m = models.output_layer_mask(params)
    assert jax.tree.structure(m) == jax.tree.structure(params)
    assert m == {
        "params": {
            "hidden": {"kernel": False, "bias": False},
            "output": {"kernel": True, "bias": True},
        }
    }
    # Also on the bare params dict and on a linen model with auto-named layers.
    assert models.output_layer_mask(params["params"])["output"] == {"kernel": True, "bias": True}

    class Deep(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(3)(x))
            x = nn.relu(nn.Dense(3)(x))
            return nn.Dense(2)(x)

    deep = models.init_params(Deep(), jax.random.key(0), (1, 4))
    flags = jax.tree_util.tree_flatten_with_path(models.output_layer_mask(deep))[0]
    marked = {jax.tree_util.keystr(p) for p, v in flags if v}
    assert marked == {"['params']['Dense_2']['bias']", "['params']['Dense_2']['kernel']"}
    chosen = models.output_layer_mask(deep, layer="Dense_0")
    assert chosen["params"]["Dense_0"]["kernel"] and not chosen["params"]["Dense_2"]["kernel"]
    with pytest.raises(ValueError, match="layer='nope'"):
        models.output_layer_mask(deep, layer="nope")
    lin = models.output_layer_mask(models.linear_params(3))
    assert lin == {"w": True, "b": True}
    with pytest.raises(TypeError, match="params must be a dict"):
        models.output_layer_mask(jnp.zeros(3))


def _np_ridge(theta, x, y, mask, lam):
    r = x[mask] @ theta - y[mask]
    return 0.5 * np.mean(r**2) + 0.5 * lam * theta @ theta


def test_ridge_loss_closed_forms():
    rng = np.random.default_rng(4)
    n, d, lam = 12, 5, 0.3
    x = rng.normal(size=(n, d))
    y = rng.normal(size=n)
    mask = rng.uniform(size=n) < 0.7
    mask[0] = True
    theta = rng.normal(size=d)
    loss = models.ridge_loss(lam)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    xm, ym = x[mask], y[mask]
    # Float32 rounding (inputs rounded to float32 too, one EPS32 / 2 each): the residuals
    # are dots of d terms, the loss and the gradient means over the rows, all relative to
    # the same computation in magnitude.
    chain = _gamma(d + mask.sum() + 4)
    mag_r = lambda th: np.abs(xm) @ np.abs(th) + np.abs(ym)  # noqa: E731
    got = float(loss(f32(theta), f32(x), f32(y), mask))
    atol = chain * (0.5 * np.mean(mag_r(theta) ** 2) + 0.5 * lam * theta @ theta)
    np.testing.assert_allclose(got, _np_ridge(theta, x, y, mask, lam), rtol=0, atol=atol)
    grad_ref = xm.T @ (xm @ theta - ym) / mask.sum() + lam * theta
    grad_mag = lambda th: np.abs(xm).T @ mag_r(th) / mask.sum() + lam * np.abs(th)  # noqa: E731
    grad = np.asarray(jax.grad(loss)(f32(theta), f32(x), f32(y), mask))
    _assert_within(grad, grad_ref, chain * grad_mag(theta))
    # The closed-form minimizer has zero gradient; padding junk does not move it.
    theta_star = np.linalg.solve(xm.T @ xm / mask.sum() + lam * np.eye(d), xm.T @ ym / mask.sum())
    x2 = x.copy()
    x2[~mask] = 50.0
    g_star = np.asarray(jax.grad(loss)(f32(theta_star), f32(x2), f32(y), mask))
    _assert_within(g_star, 0.0, chain * grad_mag(theta_star))
    with pytest.raises(ValueError, match="lam"):
        models.ridge_loss(-1.0)
    with pytest.raises(TypeError, match="lam"):
        models.ridge_loss("a")


@pytest.mark.parametrize("shape", [(5,), (1, 5), (7, 5), (3, 4, 5)])
def test_linear_prediction_is_x_at_w_for_any_leading_axes(shape):
    # The losses' parameters-first product (a faster batched layout under a vmapped
    # grid) must equal x @ w for every x [..., d] a user may pass, one row included.
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=shape), jnp.float32)
    w = jnp.asarray(rng.normal(size=shape[-1]), jnp.float32)
    got = models._linear(w, x)
    assert got.shape == shape[:-1]
    # two float32 orders of a d-term dot, relative to the dot in magnitude
    bound = reordered_sum(shape[-1]) * (np.abs(np.asarray(x)) @ np.abs(np.asarray(w)))
    _assert_within(got, x @ w, bound)
    # and under vmap over a grid of w sharing x, each grid point's own product
    ws = jnp.stack([w, 2 * w, -w])
    grid = jax.vmap(models._linear, (0, None))(ws, x)
    _assert_within(grid[1], x @ (2 * w), 2 * bound)


def test_logistic_loss_and_accuracy_closed_forms():
    rng = np.random.default_rng(5)
    n, d, lam = 15, 4, 0.1
    x = rng.normal(size=(n, d))
    y = (rng.uniform(size=n) < 0.5).astype(np.float64)
    mask = rng.uniform(size=n) < 0.7
    mask[:2] = True
    w, b = rng.normal(size=d), 0.4
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    params = {"w": f32(w), "b": f32(b)}
    z = x @ w + b
    nll = np.log1p(np.exp(z)) - y * z
    ref = nll[mask].mean() + 0.5 * lam * w @ w
    loss = models.logistic_loss(lam)
    # Float32 rounding (inputs rounded too): z a dot of d terms plus b, softplus and the
    # masked mean, relative to the same in magnitude (|d nll / dz| <= 1, sigma' <= 1/4).
    rows = int(mask.sum())
    chain = _gamma(d + rows + 6)
    mag_z = (np.abs(x) @ np.abs(w) + abs(b))[mask]
    nll_mag = mag_z + np.log1p(np.exp(z[mask])) + np.abs(y * z)[mask]
    atol = chain * (nll_mag.mean() + 0.5 * lam * w @ w)
    np.testing.assert_allclose(float(loss(params, f32(x), f32(y), mask)), ref, rtol=0, atol=atol)
    s = 1 / (1 + np.exp(-z))
    g = jax.grad(loss)(params, f32(x), f32(y), mask)
    resid_mag = 1 + mag_z / 4  # |sigma - y| <= 1, plus sigma's move with z's rounding
    w_mag = np.abs(x[mask]).T @ resid_mag / rows + lam * np.abs(w)
    _assert_within(g["w"], x[mask].T @ (s - y)[mask] / rows + lam * w, chain * w_mag)
    np.testing.assert_allclose(
        float(g["b"]), (s - y)[mask].mean(), rtol=0, atol=chain * resid_mag.mean()
    )
    # Integer labels work too, and the accuracy is the masked mean of sign agreement.
    y_int = y.astype(np.int32)
    np.testing.assert_allclose(float(loss(params, f32(x), y_int, mask)), ref, rtol=0, atol=atol)
    acc = float(models.logistic_accuracy(params, f32(x), y_int, mask))
    # a count over a row count, rounded once in float32
    np.testing.assert_allclose(acc, ((z > 0) == (y > 0.5))[mask].mean(), rtol=EPS32)
    zero = models.linear_params(d)
    # the mean of `rows` float32 roundings of log 2: (rows + 1) EPS32 / 2 at most
    got = float(loss(zero, f32(x), f32(y), mask))
    np.testing.assert_allclose(got, np.log(2.0), rtol=_gamma(rows + 1))


def test_bad_arguments():
    with pytest.raises(ValueError, match="hidden"):
        models.mlp(hidden=0)
    with pytest.raises(TypeError, match="num_classes"):
        models.mlp(num_classes=2.5)
    with pytest.raises(TypeError, match="apply_fn"):
        models.cross_entropy_loss(None)
    with pytest.raises(TypeError, match="apply_fn"):
        models.accuracy(3)
    with pytest.raises(TypeError, match="model"):
        models.init_params(object(), jax.random.key(0), (1, 3))
    with pytest.raises(ValueError, match="input_shape"):
        models.init_params(models.mlp(), jax.random.key(0), (0, 3))
    with pytest.raises(ValueError, match="dim"):
        models.linear_params(0)


def test_inf_in_padded_rows_does_not_leak():
    import jax.numpy as jnp

    from karula_jax.models import ridge_loss

    loss = ridge_loss(0.0)
    theta = jnp.ones(2)
    x = jnp.array([[1.0, 2.0], [jnp.inf, jnp.inf]])
    y = jnp.array([1.0, 0.0])
    mask = jnp.array([True, False])
    assert float(loss(theta, x, y, mask)) == 0.5 * (3.0 - 1.0) ** 2
