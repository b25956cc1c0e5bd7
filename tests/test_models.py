"""Models and losses against numpy closed forms and finite differences."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
    np.testing.assert_allclose(
        np.asarray(model.apply(params, x)), _np_mlp(params["params"], x), rtol=1e-4, atol=1e-4
    )


def test_cross_entropy_matches_numpy_and_ignores_padding(small_mlp):
    model, params, x, y, mask = small_mlp
    loss = models.cross_entropy_loss(model.apply)
    ref = _np_cross_entropy(params["params"], x, y, mask)
    np.testing.assert_allclose(float(loss(params, x, y, mask)), ref, rtol=1e-5)
    # Garbage in padded rows (huge inputs, labels of other classes) changes nothing.
    x2, y2 = x.copy(), y.copy()
    x2[~mask] = 1e3
    y2[~mask] = (y2[~mask] + 1) % 4
    np.testing.assert_allclose(float(loss(params, x2, y2, mask)), ref, rtol=1e-5)
    grad = jax.jit(jax.grad(loss))
    g1 = grad(params, x, y, mask)
    g2 = grad(params, x2, y2, mask)
    g_real = grad(params, x[mask], y[mask], np.ones(mask.sum(), bool))
    for a, b, c in zip(
        jax.tree.leaves(g1), jax.tree.leaves(g2), jax.tree.leaves(g_real), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-7)


def test_cross_entropy_gradient_finite_differences(small_mlp):
    model, params, x, y, mask = small_mlp
    grads = jax.grad(models.cross_entropy_loss(model.apply))(params, x, y, mask)
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
            np.testing.assert_allclose(got, fd, rtol=1e-3, atol=1e-5)


def test_accuracy_matches_numpy(small_mlp):
    model, params, x, y, mask = small_mlp
    acc = models.accuracy(model.apply)
    pred = _np_mlp(params["params"], x).argmax(-1)
    # Make the answer non-trivial: set half the real labels to the prediction.
    y = y.copy()
    y[::2] = pred[::2]
    expected = (pred == y)[mask].mean()
    np.testing.assert_allclose(float(acc(params, x, y, mask)), expected, rtol=1e-6)
    assert float(acc(params, x, y, np.zeros_like(mask))) == 0.0
    assert float(models.cross_entropy_loss(model.apply)(params, x, y, np.zeros_like(mask))) == 0.0


def test_losses_vmap_over_clients(small_mlp):
    model, params, x, y, mask = small_mlp
    loss = jax.jit(jax.vmap(models.cross_entropy_loss(model.apply), in_axes=(None, 0, 0, 0)))
    xs, ys, ms = np.stack([x, x[::-1]]), np.stack([y, y[::-1]]), np.stack([mask, mask[::-1]])
    out = np.asarray(loss(params, xs, ys, ms))
    for i in range(2):
        np.testing.assert_allclose(
            out[i], _np_cross_entropy(params["params"], xs[i], ys[i], ms[i]), rtol=1e-5
        )


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
    got = float(loss(f32(theta), f32(x), f32(y), mask))
    np.testing.assert_allclose(got, _np_ridge(theta, x, y, mask, lam), rtol=1e-5)
    xm, ym = x[mask], y[mask]
    grad_ref = xm.T @ (xm @ theta - ym) / mask.sum() + lam * theta
    grad = np.asarray(jax.grad(loss)(f32(theta), f32(x), f32(y), mask))
    np.testing.assert_allclose(grad, grad_ref, rtol=1e-4, atol=1e-5)
    # The closed-form minimizer has zero gradient; padding junk does not move it.
    theta_star = np.linalg.solve(xm.T @ xm / mask.sum() + lam * np.eye(d), xm.T @ ym / mask.sum())
    x2 = x.copy()
    x2[~mask] = 50.0
    g_star = np.asarray(jax.grad(loss)(f32(theta_star), f32(x2), f32(y), mask))
    np.testing.assert_allclose(g_star, 0.0, atol=1e-5)
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
    np.testing.assert_allclose(got, x @ w, rtol=1e-6, atol=1e-6)
    # and under vmap over a grid of w sharing x, each grid point's own product
    ws = jnp.stack([w, 2 * w, -w])
    grid = jax.vmap(models._linear, (0, None))(ws, x)
    np.testing.assert_allclose(grid[1], x @ (2 * w), rtol=1e-6, atol=1e-6)


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
    np.testing.assert_allclose(float(loss(params, f32(x), f32(y), mask)), ref, rtol=1e-5)
    s = 1 / (1 + np.exp(-z))
    g = jax.grad(loss)(params, f32(x), f32(y), mask)
    np.testing.assert_allclose(
        np.asarray(g["w"]), x[mask].T @ (s - y)[mask] / mask.sum() + lam * w, rtol=1e-4, atol=1e-6
    )
    np.testing.assert_allclose(float(g["b"]), (s - y)[mask].mean(), rtol=1e-4, atol=1e-6)
    # Integer labels work too, and the accuracy is the masked mean of sign agreement.
    y_int = y.astype(np.int32)
    np.testing.assert_allclose(float(loss(params, f32(x), y_int, mask)), ref, rtol=1e-5)
    acc = float(models.logistic_accuracy(params, f32(x), y_int, mask))
    np.testing.assert_allclose(acc, ((z > 0) == (y > 0.5))[mask].mean(), rtol=1e-6)
    zero = models.linear_params(d)
    np.testing.assert_allclose(float(loss(zero, f32(x), f32(y), mask)), np.log(2.0), rtol=1e-6)


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
