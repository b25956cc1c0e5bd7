"""Models and their loss / accuracy functions, used through plain params pytrees.

Every loss here follows the ``LossFn`` contract of :mod:`karula_jax.algorithms.base`:
``loss(params, x, y, mask) -> scalar`` is the mean over the rows where ``mask`` is
True (padding never contributes, to the value or to the gradient), for ONE client's
``params``. Algorithms vmap it over clients.

Neural networks are flax linen modules. :func:`init_params` returns the full variable
dict ``{"params": {...}}`` so that ``model.apply`` itself is the ``apply_fn(params, x)``
the loss factories take::

    model = mlp()
    params = init_params(model, jax.random.key(0), (1, 784))
    loss = cross_entropy_loss(model.apply)
    grads = jax.grad(loss)(params, x, y, mask)
    personal = output_layer_mask(params)  # True on params["params"]["output"] only

Linear models use a flat vector ``theta: [d]`` (ridge) or ``{"w": [d], "b": []}``
(logistic regression) and need no flax. Their losses carry ``loss.smoothness(data)``, each
client's Lipschitz constant of ``grad f_i`` read off its data (:func:`ridge_smoothness`,
:func:`logistic_smoothness`), which Karula's default step size uses.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from karula_jax._checks import (
    check_floating_dtype,
    check_nonnegative,
    check_positive_int,
    check_targets,
    is_concrete,
)
from karula_jax._smoothness import linear_smoothness

__all__ = [
    "MLP",
    "accuracy",
    "cross_entropy_loss",
    "init_params",
    "linear_params",
    "logistic_accuracy",
    "logistic_loss",
    "logistic_smoothness",
    "mlp",
    "multinomial_accuracy",
    "multinomial_logits",
    "multinomial_loss",
    "multinomial_params",
    "multinomial_smoothness",
    "output_layer_mask",
    "ridge_loss",
    "ridge_smoothness",
]

ApplyFn = Callable[[Any, jnp.ndarray], jnp.ndarray]


class MLP(nn.Module):
    """One hidden ReLU layer: ``x [..., d] -> Dense(hidden) -> ReLU -> Dense(num_classes)``.

    The layers are named ``"hidden"`` and ``"output"``; the output gives logits.
    """

    hidden: int = 100
    num_classes: int = 10

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        h = nn.relu(nn.Dense(self.hidden, name="hidden")(x))
        return nn.Dense(self.num_classes, name="output")(h)


def mlp(hidden: int = 100, num_classes: int = 10) -> MLP:
    """One hidden ReLU layer, ``d -> hidden -> num_classes``; the input size ``d`` is set
    by :func:`init_params`'s ``input_shape`` (the paper's FEMNIST network is 784-100-10).

    Args:
      hidden: width of the hidden layer.
      num_classes: number of output logits.

    Returns:
      An :class:`MLP` module; its ``apply(params, x)`` maps ``x [B, d]`` to logits
      ``[B, num_classes]``.
    """
    return MLP(check_positive_int("hidden", hidden), check_positive_int("num_classes", num_classes))


def init_params(model: nn.Module, key: jax.Array, input_shape) -> dict:
    """Initializes a linen module on a dummy input.

    Args:
      model: a flax linen module.
      key: PRNG key for the initializers.
      input_shape: shape of one input batch, e.g. ``(1, 784)``.

    Returns:
      The variable dict ``{"params": {...}}`` to pass to ``model.apply``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a flax.linen.Module, got {type(model).__name__}")
    try:
        shape = tuple(int(s) for s in input_shape)
    except (TypeError, ValueError) as e:
        raise TypeError(f"input_shape must be a sequence of ints, got {input_shape!r}") from e
    if any(s < 1 for s in shape):
        raise ValueError(f"input_shape must have positive sizes, got {shape}")
    return model.init(key, jnp.zeros(shape, jnp.float32))


def _masked_mean(values: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    # Empty masks give 0, not NaN: a client with no real row in a minibatch must not poison
    # the round.
    # ``where`` rather than a product: inf or NaN in a padded row must not leak (inf * 0).
    # The mask must be bool [B] like the rows: a [B, 1] mask broadcast into [B, B], a float
    # one weighted the rows (static checks: also when traced).
    if jnp.shape(mask) != jnp.shape(values):
        raise ValueError(f"mask must have shape {jnp.shape(values)}, got {jnp.shape(mask)}")
    if jnp.result_type(mask) != jnp.bool_:
        raise TypeError(f"mask must be boolean (real rows), got dtype {jnp.result_type(mask)}")
    total = jnp.sum(jnp.where(mask, values, 0.0))
    return total / jnp.maximum(jnp.sum(mask.astype(values.dtype)), 1.0)


def _logits_2d(logits):
    """``logits`` ``[B, C]``; a ValueError otherwise (labels per position ``[B, T]``
    were read at position 0 only): flatten such rows first."""
    if logits.ndim != 2:
        raise ValueError(
            f"apply_fn must return logits [B, C] (one row of class scores per example), got "
            f"shape {logits.shape}; flatten per-position outputs to rows first"
        )
    return logits


def _nan_if_nonfinite(score, outputs, mask):
    """``score``, or NaN where a real row's outputs hold NaN or inf: a diverged model has no
    accuracy (``argmax`` of NaN logits is class 0, which counted as right for label 0)."""
    real = mask.reshape(mask.shape + (1,) * (outputs.ndim - mask.ndim))
    bad = jnp.any(jnp.where(real, ~jnp.isfinite(outputs), False))
    return jnp.where(bad, jnp.nan, score)


def _check_apply(apply_fn) -> None:
    if not callable(apply_fn):
        raise TypeError(f"apply_fn must be callable (params, x) -> logits, got {apply_fn!r}")


def cross_entropy_loss(apply_fn: ApplyFn) -> Callable:
    """Softmax cross-entropy on integer labels, averaged over real rows.

    Args:
      apply_fn: ``apply_fn(params, x [B, ...]) -> logits [B, C]``, e.g. ``model.apply``.

    Returns:
      ``loss(params, x, y, mask) -> []`` with ``y`` int of shape ``[B]`` and ``mask`` bool
      ``[B]``: ``sum_b mask_b * (logsumexp(z_b) - z_b[y_b]) / max(sum_b mask_b, 1)``.
      ``y`` must lie in ``[0, C)`` for ``C`` logits: ``loss.num_classes(params, x)`` gives
      ``C`` from shapes, and every algorithm's ``init`` checks the data's labels with it
      (a real row's label outside the classes gives a NaN loss).
    """
    _check_apply(apply_fn)

    def loss(params, x, y, mask):
        logits = _logits_2d(apply_fn(params, x))
        check_targets(y, logits.shape[:-1], "the logits' rows")
        logz = jax.nn.logsumexp(logits, axis=-1)
        label = y.astype(jnp.int32)
        picked = jnp.take_along_axis(logits, label[:, None], axis=-1)[:, 0]
        inside = (label >= 0) & (label < logits.shape[-1])  # -1 would wrap to the last class
        return _masked_mean(jnp.where(inside, logz - picked, jnp.nan), mask)

    def num_classes(params, x) -> int:
        """``C``, the number of logits of the model on rows ``x`` (shapes only)."""
        return int(jax.eval_shape(apply_fn, params, x).shape[-1])

    loss.num_classes = num_classes
    return loss


def accuracy(apply_fn: ApplyFn) -> Callable:
    """Fraction of real rows whose arg-max logit is the label.

    Args:
      apply_fn: ``apply_fn(params, x [B, ...]) -> logits [B, C]``.

    Returns:
      ``acc(params, x, y, mask) -> []`` in ``[0, 1]`` (0 when ``mask`` is all False).
    """
    _check_apply(apply_fn)

    def acc(params, x, y, mask):
        logits = _logits_2d(apply_fn(params, x))
        pred = jnp.argmax(logits, axis=-1)
        check_targets(y, pred.shape, "the logits' rows")
        return _nan_if_nonfinite(_masked_mean((pred == y).astype(jnp.float32), mask), logits, mask)

    return acc


def _get_path(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def output_layer_mask(params, layer: str | None = None):
    """Boolean pytree (same structure as ``params``): True on the output layer only.

    This is the personalization mask of the FEMNIST experiment (only the last layer
    is personalized). The output layer is, in order of preference: the entry named
    ``layer``; the entry named ``"output"`` (as in :class:`MLP`); otherwise the last
    entry in creation order (linen names layers ``Dense_0, Dense_1, ...``; creation
    order is lost once a dict went through ``jax.tree.map``, which sorts keys, so
    pass ``layer`` for such models). A variable dict ``{"params": {...}}`` is looked
    into. Params whose top level holds arrays only (a linear model) are all True.

    Args:
      params: a nested dict of arrays (flax params or variables).
      layer: name of the output layer, optional.

    Returns:
      A pytree of Python bools with the structure of ``params``.
    """
    if not isinstance(params, dict):
        raise TypeError(f"params must be a dict pytree, got {type(params).__name__}")
    prefix: tuple = ()
    if set(params) == {"params"} and isinstance(params["params"], dict):
        prefix = ("params",)
    modules = _get_path(params, prefix)
    sub = [k for k, v in modules.items() if isinstance(v, dict)]
    if layer is not None:
        if layer not in modules:
            raise ValueError(f"layer={layer!r} is not a top-level entry; have {list(modules)}")
        target = prefix + (layer,)
    elif not sub:
        return jax.tree.map(lambda _: True, params)
    elif "output" in sub:
        target = prefix + ("output",)
    else:
        target = prefix + (sub[-1],)

    def mark(path, _):
        keys = tuple(getattr(p, "key", p) for p in path)
        return keys[: len(target)] == target

    return jax.tree_util.tree_map_with_path(mark, params)


def _check_lam(lam):
    """``lam`` as a float when concrete (it may be traced, e.g. vmapped over a grid)."""
    check_nonnegative("lam", lam)
    return float(lam) if is_concrete(lam) else lam


def _linear(w, x):
    """``x @ w`` for ``w [d]`` and ``x [..., d]``, written parameters-first.

    Under ``vmap`` over parameters that share the data (a grid of hyperparameters on one
    data set), the batch axis of ``w`` then lands before the rows, so the gradient's
    product ``x^T r`` contracts the minor axis of ``r``. Written ``x @ w``, XLA:CPU runs
    that product with the rows in the middle: pFedMe's and IFCA's CV batches of the
    synthetic study took 1.3x as long (results/bench/README.md, "Linear models").
    """
    return jnp.tensordot(w, x, axes=(0, -1))


def ridge_loss(lam: float) -> Callable:
    """Ridge regression on a flat parameter vector.

    Args:
      lam: L2 penalty ``>= 0``.

    Returns:
      ``loss(theta [d], x [B, d], y [B], mask [B]) -> []`` equal to
      ``sum_b mask_b (x_b . theta - y_b)^2 / (2 max(sum mask, 1)) + lam/2 ||theta||^2``,
      with the attribute ``loss.smoothness(data) = ridge_smoothness(data, lam)``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from karula_jax.models import ridge_loss
      >>> loss = ridge_loss(0.1)
      >>> x, y = jnp.array([[1.0], [2.0], [5.0]]), jnp.array([1.0, 2.0, 0.0])
      >>> mask = jnp.array([True, True, False])  # the third row is padding
      >>> float(loss(jnp.array([0.0]), x, y, mask))  # (1 + 4) / (2 * 2)
      1.25
      >>> round(float(loss(jnp.array([1.0]), x, y, mask)), 6)  # a perfect fit pays the penalty
      0.05
    """
    lam = _check_lam(lam)

    def loss(theta, x, y, mask):
        pred = _linear(theta, x)
        check_targets(y, pred.shape, "the predictions x . theta")
        resid = pred - y
        return 0.5 * _masked_mean(resid**2, mask) + 0.5 * lam * jnp.sum(theta**2)

    loss.smoothness = functools.partial(ridge_smoothness, lam=lam)
    return loss


def ridge_smoothness(data, lam) -> jnp.ndarray:
    """Each client's Lipschitz constant of ``grad f_i`` for :func:`ridge_loss`.

    ``f_i(theta) = mean_i (x . theta - y)^2 / 2 + lam/2 ||theta||^2`` has the constant
    Hessian ``X_i^T X_i / N_i + lam I``, so ``L_i = lambda_max(X_i^T X_i / N_i) + lam``
    exactly (``lam`` for a client without rows). Traceable (``data`` and ``lam`` may be
    traced, e.g. vmapped over folds); float64 with checks: ``lipschitz_ridge``.

    Args:
      data: a ``ClientData`` with ``x`` of shape ``[n, N_max, d]``.
      lam: the ridge penalty ``>= 0``.

    Returns:
      ``L_i``, array of shape ``[n]``.
    """
    return linear_smoothness(data, _check_lam(lam), intercept=False, curvature=1.0)


def logistic_smoothness(data, lam) -> jnp.ndarray:
    """Each client's Lipschitz constant of ``grad f_i`` for :func:`logistic_loss`.

    With ``z_i = [x_i, 1]`` (the bias is a parameter) the Hessian of ``f_i`` in ``(w, b)``
    is ``mean_i sigma'(z . (w, b)) z z^T + diag(lam I, 0)`` and ``sigma' <= 1/4``, so
    ``L_i = lambda_max(Z_i^T Z_i / (4 N_i)) + lam`` bounds it everywhere (equality up to
    the unpenalized bias at ``w = 0, b = 0``, where every ``sigma' = 1/4``). Traceable;
    float64 with checks: ``lipschitz_logistic``.

    Args:
      data: a ``ClientData`` with ``x`` of shape ``[n, N_max, d]``.
      lam: the L2 penalty ``>= 0``.

    Returns:
      ``L_i``, array of shape ``[n]``.
    """
    return linear_smoothness(data, _check_lam(lam), intercept=True, curvature=0.25)


def linear_params(dim: int, dtype=jnp.float32) -> dict:
    """Zero logistic-regression parameters ``{"w": [dim], "b": []}`` (floating ``dtype``)."""
    dim = check_positive_int("dim", dim)
    dtype = check_floating_dtype("dtype", dtype)
    return {"w": jnp.zeros((dim,), dtype), "b": jnp.zeros((), dtype)}


def logistic_loss(lam: float) -> Callable:
    """Binary logistic regression with an L2 penalty on the weights (not the bias).

    Args:
      lam: L2 penalty ``>= 0``.

    Returns:
      ``loss(params, x [B, d], y [B], mask [B]) -> []`` with ``params = {"w": [d], "b": []}``
      and labels ``y`` in ``{0, 1}``: the masked mean of
      ``log(1 + exp(z)) - y z`` with ``z = x . w + b``, plus ``lam/2 ||w||^2``; with the
      attribute ``loss.smoothness(data) = logistic_smoothness(data, lam)``.
    """
    lam = _check_lam(lam)

    def loss(params, x, y, mask):
        z = _linear(params["w"], x) + params["b"]
        check_targets(y, z.shape, "the logits x . w + b")
        nll = jax.nn.softplus(z) - y.astype(z.dtype) * z
        return _masked_mean(nll, mask) + 0.5 * lam * jnp.sum(params["w"] ** 2)

    loss.smoothness = functools.partial(logistic_smoothness, lam=lam)
    return loss


def logistic_accuracy(params, x, y, mask) -> jnp.ndarray:
    """Fraction of real rows with ``(x . w + b > 0) == y`` (a ``LossFn``-shaped metric)."""
    z = _linear(params["w"], x) + params["b"]
    check_targets(y, z.shape, "the logits x . w + b")
    return _nan_if_nonfinite(
        _masked_mean(((z > 0) == (y > 0.5)).astype(jnp.float32), mask), z, mask
    )


def multinomial_params(dim: int, num_classes: int, dtype=jnp.float32) -> dict:
    """Zero multinomial logistic-regression parameters ``{"w": [dim, num_classes], "b":
    [num_classes]}`` (floating ``dtype``)."""
    dim = check_positive_int("dim", dim)
    num_classes = check_positive_int("num_classes", num_classes)
    dtype = check_floating_dtype("dtype", dtype)
    return {"w": jnp.zeros((dim, num_classes), dtype), "b": jnp.zeros((num_classes,), dtype)}


def multinomial_logits(params, x) -> jnp.ndarray:
    """Class scores ``x @ w + b``, ``[B, C]``, of ``params = {"w": [d, C], "b": [C]}``
    for rows ``x [B, d]`` (an ``apply_fn`` for :func:`cross_entropy_loss`)."""
    w, b = params["w"], params["b"]
    if jnp.ndim(w) != 2 or jnp.shape(b) != jnp.shape(w)[1:]:
        raise ValueError(
            f'params must be {{"w": [d, C], "b": [C]}}, got w {jnp.shape(w)}, b {jnp.shape(b)}'
        )
    return jnp.tensordot(x, w, axes=(-1, 0)) + b


def multinomial_loss(lam: float) -> Callable:
    """Multinomial (softmax) logistic regression with an L2 penalty on the weights.

    Args:
      lam: L2 penalty ``>= 0`` on ``w`` (not the bias).

    Returns:
      ``loss(params, x [B, d], y [B], mask [B]) -> []`` with ``params = {"w": [d, C], "b":
      [C]}`` (:func:`multinomial_params`) and integer labels ``y`` in ``[0, C)``: the masked
      mean of ``logsumexp(z) - z[y]`` with ``z = x @ w + b``, plus ``lam/2 ||w||^2``; with
      the attributes ``loss.num_classes(params, x)`` (``C``; algorithms check the labels
      with it) and ``loss.smoothness(data) = multinomial_smoothness(data, lam)``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from karula_jax.models import multinomial_loss, multinomial_params
      >>> loss = multinomial_loss(0.0)
      >>> x, y = jnp.ones((4, 3)), jnp.array([0, 1, 2, 3])
      >>> params = multinomial_params(3, 4)  # every class equally likely: log 4 per row
      >>> round(float(loss(params, x, y, jnp.ones(4, bool))), 4)
      1.3863
    """
    lam = _check_lam(lam)
    cross_entropy = cross_entropy_loss(multinomial_logits)

    def loss(params, x, y, mask):
        return cross_entropy(params, x, y, mask) + 0.5 * lam * jnp.sum(params["w"] ** 2)

    loss.num_classes = cross_entropy.num_classes
    loss.smoothness = functools.partial(multinomial_smoothness, lam=lam)
    return loss


def multinomial_smoothness(data, lam) -> jnp.ndarray:
    """Each client's Lipschitz constant of ``grad f_i`` for :func:`multinomial_loss`.

    With ``z_i = [x_i, 1]`` the Hessian of ``f_i`` in ``(w, b)`` is ``mean_i (diag(p) - p
    p^T) (x) z z^T`` plus ``lam`` on ``w``, where ``p`` are the softmax probabilities; the
    largest eigenvalue of ``diag(p) - p p^T`` is at most ``1/2`` (attained with two
    classes at ``p = (1/2, 1/2)``), so ``L_i = lambda_max(Z_i^T Z_i / (2 N_i)) + lam``
    bounds it everywhere. At uniform probabilities over ``C`` classes the curvature is
    ``C / 2`` times smaller: a step from this bound is safe on the whole path, and small
    at the start. Traceable.

    Args:
      data: a ``ClientData`` with ``x`` of shape ``[n, N_max, d]``.
      lam: the L2 penalty ``>= 0``.

    Returns:
      ``L_i``, array of shape ``[n]``.
    """
    return linear_smoothness(data, _check_lam(lam), intercept=True, curvature=0.5)


def multinomial_accuracy(params, x, y, mask) -> jnp.ndarray:
    """Fraction of real rows whose arg-max class score of :func:`multinomial_logits` is the
    label (a ``LossFn``-shaped metric); NaN where a real row's scores are not finite."""
    return accuracy(multinomial_logits)(params, x, y, mask)
