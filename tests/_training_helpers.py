"""The toy algorithm, data and helpers of the training-driver tests (``test_training_*``).

A tiny toy algorithm (stochastic gradient descent on a per-client quadratic with partial
participation and averaging towards the mean), so that the driver tests do not depend on
the real algorithms. ``fresh_trace_counters`` is an autouse fixture: a test module that
imports it clears chex's trace counters before each of its tests.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerances import reordered_sum

from karula_jax.algorithms.base import Algorithm, FedState, RoundInfo
from karula_jax.data import from_client_arrays


@pytest.fixture(autouse=True)
def fresh_trace_counters():
    chex.clear_trace_counter()


def traced_at_most(n):
    """An identity function that fails once it has been traced more than ``n`` times.

    Pass it as ``toy(traced=...)``: every trace of any toy round built with it counts, by
    whatever path (``chex.assert_max_traces`` keys its counter on where it was created).
    """
    return chex.assert_max_traces(lambda x: x, n=n)


def toy(eta=0.3, t=0.5, *, s=2, noise=0.1, nan_at=None, unconverged=(), traced=None):
    """Per-client quadratic ``f_i(w) = 0.5 mean_j ||w - x_ij||^2`` (masked).

    Each round, ``s`` clients sampled without replacement take a noisy gradient step, then
    every model moves a fraction ``t`` towards the mean model. ``nan_at`` injects a NaN into
    the parameters at that round. The rounds in ``unconverged`` report an unconverged
    "projection" with gap ``proj_delta = 0.25 * (round + 1)``, the others a converged one
    with gap ``1e-3``. ``eta`` and ``t`` may be traced. ``traced`` (see
    :func:`traced_at_most`) is applied to the state at the start of every round.
    """

    def loss_i(w, x, mask):
        sq = 0.5 * jnp.sum((x - w["a"] - w["b"]) ** 2, axis=-1)
        return jnp.sum(jnp.where(mask, sq, 0.0)) / jnp.sum(mask)

    def init(params, data, *, key):
        n = data.num_clients
        stacked = jax.tree.map(lambda p: jnp.broadcast_to(p, (n, *jnp.shape(p))), params)
        return FedState(stacked, (), (), (), key, jnp.zeros((), jnp.int32))

    def round_(state, data):
        if traced is not None:
            state = traced(state)
        n = data.num_clients
        rkey = jax.random.fold_in(state.key, state.round)
        pkey, nkey = jax.random.split(rkey)
        chosen = jax.random.choice(pkey, n, (s,), replace=False)
        part = jnp.zeros((n,), bool).at[chosen].set(True)
        losses, grads = jax.vmap(jax.value_and_grad(loss_i))(state.params, data.x, data.mask)
        leaves, treedef = jax.tree.flatten(grads)
        keys = jax.random.split(nkey, len(leaves))
        grads = jax.tree.unflatten(
            treedef,
            [g + noise * jax.random.normal(k, g.shape) for g, k in zip(leaves, keys, strict=True)],
        )

        def step(w, g):
            m = part.reshape((n,) + (1,) * (w.ndim - 1))
            w = jnp.where(m, w - eta * g, w)
            w = (1 - t) * w + t * jnp.mean(w, axis=0, keepdims=True)
            if nan_at is not None:
                w = jnp.where(state.round == nan_at, jnp.nan, w)
            return w

        params = jax.tree.map(step, state.params, grads)
        loss = jnp.sum(jnp.where(part, losses, 0.0)) / s
        finite = jnp.isfinite(loss) & jnp.all(
            jnp.array([jnp.all(jnp.isfinite(w)) for w in jax.tree.leaves(params)])
        )
        bad = jnp.isin(state.round, jnp.asarray(unconverged, jnp.int32))
        info = RoundInfo(
            loss=loss,
            participants=part,
            proj_delta=jnp.where(bad, 0.25 * (state.round + 1), 1e-3).astype(jnp.float32),
            proj_violation=jnp.zeros((), jnp.float32),
            proj_iterations=jnp.zeros((), jnp.int32),
            proj_converged=~bad,
            finite=finite,
        )
        return state._replace(params=params, round=state.round + 1), info

    def client_params(state, data):
        return state.params

    return Algorithm(init, round_, client_params)


def make_data(seed=0, n=5, d=3):
    rng = np.random.default_rng(seed)
    counts = rng.integers(2, 7, size=n)
    xs = [rng.normal(loc=i, size=(c, d)) for i, c in enumerate(counts)]
    return from_client_arrays(xs, [np.zeros(c) for c in counts], max_count=6)


PARAMS = {"a": jnp.zeros(3), "b": jnp.zeros(())}
DATA = make_data()
ALG = toy()  # shared so that its compiled programs are reused across tests


def eval_fn(client_params, data):
    sq = 0.5 * jnp.sum(
        (data.x - client_params["a"][:, None] - client_params["b"][:, None, None]) ** 2, -1
    )
    per_client = jnp.sum(jnp.where(data.mask, sq, 0.0), 1) / data.counts
    return {"loss": per_client, "mean_b": jnp.mean(client_params["b"])}


def leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


# The float32 terms of one toy round on ``make_data``'s clients (at most 6 rows of 3
# coordinates): a client's gradient over its rows and coordinates, the mean over its 5
# clients, and 4 elementwise steps (noise, step, averaging).
TOY_TERMS = 6 + 3 + 5 + 4


def toy_rounding(rounds: int) -> float:
    """Relative difference of two programs (chunked, vmapped, one scan) for ``rounds`` toy
    rounds, of the models' scale: :func:`reordered_sum` of a round's terms, compounded
    round by round (the toy need not contract: its non-participants only average)."""
    return reordered_sum(TOY_TERMS, rounds=rounds)


def scale(tree) -> float:
    """The largest magnitude over the leaves of ``tree`` (the scale of a comparison)."""
    return max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(tree))


def toy_loss_bound(loss, rounds: int, params_scale: float) -> np.ndarray:
    """Bound on two programs' difference of toy losses ``L = 0.5 mean ||x - a - b||^2``
    after ``rounds`` rounds, elementwise: models apart by ``toy_rounding(rounds)`` of their
    scale ``S`` in ``a`` (3 coordinates) and ``b`` move ``L`` by ``sqrt(2 L)`` times that
    distance, at most ``2 sqrt(3)`` of it (Cauchy-Schwarz over the rows); the loss's own
    sums round by ``reordered_sum(TOY_TERMS)`` of it (nonnegative terms)."""
    loss = np.abs(np.asarray(loss, np.float64))
    moved = np.sqrt(2.0 * loss) * 2.0 * np.sqrt(3.0) * toy_rounding(rounds) * params_scale
    return moved + reordered_sum(TOY_TERMS) * loss


def assert_within(actual, desired, bound) -> None:
    """``|actual - desired| <= bound`` elementwise (``bound`` an array of the same shape)."""
    err = np.abs(np.asarray(actual, np.float64) - np.asarray(desired, np.float64))
    assert np.all(err <= bound), float(np.max(err - bound))
