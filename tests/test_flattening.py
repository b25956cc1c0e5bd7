"""Whether a method's training loss flattened by its last round: the criterion
(``evaluation.curves.round_loss_flattened``) on curves whose windows are known in closed
form, and ``compare``'s flag and log line on runs that plainly did and did not converge."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from karula_jax import algorithms as A
from karula_jax import evaluation as ev
from karula_jax.data import from_client_arrays
from karula_jax.evaluation.curves import FLAT_TOL, round_loss_flattened
from karula_jax.models import ridge_loss
from karula_jax.protocol import Method, compare, cv_datasets, stack_datasets

R = 200  # rounds; windows of w = 20


def _windows(first, prev, last, *, rounds=R):
    """A curve whose first, previous-to-last and last windows (a tenth of the rounds
    each) are constant at these values, linear in between: the criterion's three means
    are exactly the values and its noise term is 0."""
    w = rounds // 10
    middle = np.linspace(first, prev, rounds - 3 * w)
    return np.concatenate([np.full(w, first), middle, np.full(w, prev), np.full(w, last)])


def test_the_threshold_is_a_share_of_the_whole_decrease():
    # whole decrease 1.0 - 0.1 = 0.9; the last window's drop 4% or 6% of it (tol = 5%)
    below = _windows(1.0, 0.1 + 0.04 * 0.9, 0.1)
    above = _windows(1.0, 0.1 + 0.06 * 0.9, 0.1)
    rising = _windows(1.0, 0.1 - 0.06 * 0.9, 0.1)  # up again at the end: not settled
    got = round_loss_flattened(np.stack([below, above, rising]))
    assert got.tolist() == [True, False, False]
    # a looser tolerance lets the 6% drop pass; the tolerance is a share, not absolute
    assert round_loss_flattened(above, tol=0.07)
    assert not round_loss_flattened(10 * above - 10 * 0.1 + 0.1)  # same shape, scaled


def test_closed_form_curves():
    k = np.arange(1, R + 1, dtype=np.float64)
    # exp(-k / 10): the last two windows' means differ by ~e^-16 of a decrease ~0.6
    converged = 1 + np.exp(-k / 10)
    # linear: drop 20 * 0.005 = 0.1 against a decrease of 180 * 0.005 = 0.9 (11% > 5%)
    linear = 2.3 - 0.005 * k
    # 1 / k decays slowly, but its last window drops (1/171.5 - 1/191.5) ~ 6e-4 of a
    # decrease ~0.67: at that pace another 200 rounds move it by ~1%: flattened
    slow = 1 / k
    never = np.full(R, 2.3)  # no decrease: nothing trained
    nan = converged.copy()
    nan[-1] = np.nan
    got = round_loss_flattened(np.stack([converged, linear, slow, never, nan]))
    assert got.tolist() == [True, False, True, False, False]


def test_noise_within_its_standard_error_is_not_progress():
    """A flat tail of iid noise after a small decrease: its windows' means differ by more
    than 5% of the decrease (the seed is chosen so), but within 2 standard errors
    (sqrt(2 / w) sigma): not evidence of progress. A real drop of 10 standard errors
    over the last window is."""
    rng = np.random.default_rng(1)
    sigma, w = 0.05, R // 10
    noisy = np.concatenate([np.full(w, 0.3), 0.2 + sigma * rng.normal(size=R - w)])
    total = 0.3 - noisy[-w:].mean()
    drop = noisy[-2 * w : -w].mean() - noisy[-w:].mean()
    se = np.sqrt(2 / w) * sigma
    assert FLAT_TOL * total < abs(drop) < FLAT_TOL * total + 2 * se  # the noise term decides
    assert round_loss_flattened(noisy)
    dropped = noisy.copy()
    dropped[-w:] -= 10 * se
    assert not round_loss_flattened(dropped)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="loss"):
        round_loss_flattened([1.0, 0.5])
    with pytest.raises(ValueError, match="window"):
        round_loss_flattened(np.ones(10), window=0.5)
    with pytest.raises(ValueError, match="tol"):
        round_loss_flattened(np.ones(10), tol=0.0)


def _cv():
    """Two seeds of 3 ridge clients (2 features), 2 folds each."""
    rng = np.random.default_rng(0)
    draws = []
    for _ in range(4):
        xs = [rng.normal(size=(12, 2)).astype(np.float32) for _ in range(3)]
        ys = [(x @ rng.normal(size=2)).astype(np.float32) for x in xs]
        draws.append(from_client_arrays(xs, ys))
    keys = jax.random.split(jax.random.key(0), 2)
    cv = cv_datasets(stack_datasets(draws[:2]), stack_datasets(draws[2:]), 2, key=keys)
    return cv, keys


def test_compare_flags_an_undertrained_method_and_not_a_converged_one():
    """Local gradient descent on ridge: a step of 1e-3 over 30 rounds moves the loss by
    about 3% of the way per 10 rounds (linear regime: plainly not flattened); a step of
    0.3 (full batch, every client) converges geometrically within those rounds."""
    cv, keys = _cv()
    loss, linear = ridge_loss(0.01), lambda th, x: x @ th

    def local(lr):
        return Method(lambda: A.local(loss, learning_rate=lr, batch_size=12))

    methods = {"slow": local(1e-3), "fast": local(0.3)}
    lines = []
    out = compare(
        methods,
        jnp.zeros(2),
        cv,
        keys=keys,
        num_rounds=30,
        eval_fn=lambda th, d: {"mse": ev.mean_squared_error(linear, th, d)},
        log=lines.append,
        progress=False,
    )
    assert out["slow"].train_loss.shape == (2, 30)
    assert out["slow"].flattened.tolist() == [False, False]
    assert out["fast"].flattened.tolist() == [True, True]
    flagged = [line for line in lines if "raise num_rounds" in line]
    assert len(flagged) == 1 and "slow:" in flagged[0] and "2 of 2 seeds" in flagged[0]
    # the recorded losses are the runs' own: every one falls from the initial model's
    assert np.all(out["slow"].train_loss[:, -1] < out["slow"].train_loss[:, 0])
