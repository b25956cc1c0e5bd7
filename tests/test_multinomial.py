"""Multinomial logistic regression against independent references: the binary logistic
loss it reduces to with two classes, a numpy softmax, and its Hessian's largest eigenvalue
for the smoothness bound."""

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerances import EPS32, reordered_sum

from karula_jax import algorithms, data, models, training


def _rows(seed, rows=12, dim=3, classes=4):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, dim)).astype(np.float32)
    y = rng.integers(0, classes, rows).astype(np.int32)
    mask = np.arange(rows) < rows - 2  # two padding rows
    return jnp.asarray(x), jnp.asarray(y), jnp.asarray(mask)


@pytest.mark.parametrize("lam", [0.0, 0.3])
def test_two_classes_are_the_binary_logistic_loss(lam):
    """softmax(0, z) = (1 - sigma(z), sigma(z)): with class 0's weights and bias at 0 the
    multinomial loss is the binary logistic loss on class 1's."""
    x, y, mask = _rows(0, classes=2)
    rng = np.random.default_rng(1)
    w1, b1 = rng.normal(size=3).astype(np.float32), np.float32(rng.normal())
    multi = {"w": jnp.stack([jnp.zeros(3), w1], axis=1), "b": jnp.array([0.0, b1])}
    binary = {"w": jnp.asarray(w1), "b": jnp.asarray(b1)}
    got = models.multinomial_loss(lam)(multi, x, y, mask)
    want = models.logistic_loss(lam)(binary, x, y, mask)
    # two float32 evaluations of a mean of 10 rows' log-likelihoods (each a few ulps)
    np.testing.assert_allclose(got, want, rtol=reordered_sum(10), atol=reordered_sum(10))


def test_loss_and_accuracy_equal_a_numpy_softmax():
    x, y, mask = _rows(2)
    rng = np.random.default_rng(3)
    params = {"w": rng.normal(size=(3, 4)), "b": rng.normal(size=4)}
    z = np.asarray(x, np.float64) @ params["w"] + params["b"]
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    real = np.asarray(mask)
    nll = -logp[np.arange(len(z)), np.asarray(y)][real].mean()
    lam = 0.1
    want = nll + 0.5 * lam * np.sum(params["w"] ** 2)
    p32 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    got = models.multinomial_loss(lam)(p32, x, y, mask)
    # float32 against float64: logits of 3-term dots and a 4-term logsumexp per row, then a
    # 10-row mean: well under 20 * EPS32 relative
    np.testing.assert_allclose(got, want, rtol=20 * EPS32)
    acc = models.multinomial_accuracy(p32, x, y, mask)
    # a count of right rows over 10, rounded once to float32
    np.testing.assert_allclose(acc, np.mean(z.argmax(1)[real] == np.asarray(y)[real]), rtol=EPS32)


def _hessian_max(loss, params, x, y, mask) -> float:
    """The largest eigenvalue of ``loss``'s Hessian in all of ``params`` (flattened)."""
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    h = jax.hessian(lambda f: loss(unravel(f), x, y, mask))(flat)
    return float(np.linalg.eigvalsh(np.asarray(h, np.float64)).max())


def test_smoothness_bounds_the_hessian_and_is_attained_at_two_equal_classes():
    """lambda_max of the Hessian in (w, b) never exceeds L_i; with two classes at w = 0,
    b = 0 (p = 1/2, 1/2) it equals L_i."""
    x, y, mask = _rows(4, rows=20, classes=2)
    counts = jnp.array([int(mask.sum())])
    client = data.ClientData(x[None], y[None], counts)
    loss = models.multinomial_loss(0.0)  # the penalty is on w only, not on the bias

    L = float(loss.smoothness(client)[0])
    # eigenvalues of a float32 Hessian of a 18-row mean (4 + 4 parameters): a few ulps of L
    tol = reordered_sum(18) * L
    assert abs(_hessian_max(loss, models.multinomial_params(3, 2), x, y, mask) - L) <= tol
    rng = np.random.default_rng(5)
    for classes in (2, 3, 5):
        x5, y5, mask5 = _rows(6, rows=20, classes=classes)
        loss5 = models.multinomial_loss(0.05)
        p = {"w": jnp.asarray(rng.normal(size=(3, classes)), jnp.float32)}
        p["b"] = jnp.asarray(rng.normal(size=classes), jnp.float32)
        c = data.ClientData(x5[None], y5[None], jnp.array([int(mask5.sum())]))
        top = _hessian_max(loss5, p, x5, y5, mask5)
        assert top <= float(loss5.smoothness(c)[0]) * (1 + reordered_sum(18))


def test_bad_params_and_labels_are_named():
    x, y, mask = _rows(7)
    with pytest.raises(ValueError, match=r'params must be \{"w": \[d, C\]'):
        models.multinomial_loss(0.0)({"w": jnp.zeros(3), "b": jnp.zeros(())}, x, y, mask)
    with pytest.raises(ValueError, match="num_classes"):
        models.multinomial_params(3, 0)
    bad = y.at[0].set(7)  # a real row's label beyond the 4 classes: NaN, as documented
    assert np.isnan(
        float(models.multinomial_loss(0.0)(models.multinomial_params(3, 4), x, bad, mask))
    )


def test_karula_trains_it_from_its_own_smoothness():
    """The loss carries its smoothness, so Karula's default step needs no Hessian
    estimate; a few rounds lower the training loss on separable clients."""
    rng = np.random.default_rng(8)
    xs = [rng.normal(size=(16, 3)).astype(np.float32) for _ in range(4)]
    ys = [np.argmax(x @ rng.normal(size=(3, 3)), 1).astype(np.int32) for x in xs]
    clients = data.from_client_arrays(xs, ys, num_classes=3)
    loss = models.multinomial_loss(1e-3)
    D = jnp.ones((4, 4)) - jnp.eye(4)
    alg = algorithms.karula(loss, D, t=1.0, clients_per_round=4, batch_size=16)
    params = models.multinomial_params(3, 3)
    out = training.run(alg, params, clients, key=jax.random.key(0), num_rounds=40, progress=False)
    losses = np.asarray(out.info.loss)
    assert losses[-1] < 0.8 * losses[0]
