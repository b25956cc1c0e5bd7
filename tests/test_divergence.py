"""A grid point that diverges is excluded by cross-validation and a choice beside it is
flagged; the Laplacian penalty's own step is stable over its whole grid.

References: the closed-form growth of a scalar quadratic under gradient steps, and the
stability limit of :func:`karula_jax.algorithms.step_size.stability_factor` measured by
running the penalty at ``mu -> 0`` (uncoupled clients).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import karula_jax as kj
from karula_jax import evaluation as ev
from karula_jax import protocol
from karula_jax.algorithms.step_size import stability_factor


def test_diverged_flags_geometric_growth_not_noise():
    k = np.arange(200.0)
    rng = np.random.default_rng(0)
    stable = 1.0 + np.exp(-k / 30) + 0.3 * rng.standard_normal(200) ** 2  # noisy, decreasing
    # gradient descent on a / 2 x^2 at step 2.2 / a: |1 - 2.2| = 1.2 per step, the loss
    # (x^2) grows 1.44x a round: finite for 200 rounds (1.44^200 ~ 1e31), yet diverged
    unstable = 1.44**k
    slow = np.full(200, 5.0) - 1e-4 * k  # barely moving: not diverged
    nan = np.where(k > 150, np.nan, 1.0)
    out = ev.diverged(np.stack([stable, unstable, slow, nan], axis=1))
    assert out.tolist() == [False, True, False, True]


def test_diverged_threshold_is_the_growth_factor():
    # the last tenth's mean at 9.9x and 10.1x the first tenth's: on either side of 10
    below = np.r_[np.ones(10), np.full(80, 5.0), np.full(10, 9.9)]
    above = np.r_[np.ones(10), np.full(80, 5.0), np.full(10, 10.1)]
    assert ev.diverged(np.stack([below, above], 1)).tolist() == [False, True]
    assert ev.diverged(np.stack([below, above], 1), growth=9.0).tolist() == [True, True]


@pytest.mark.parametrize(
    "bad, match",
    [(dict(loss=np.zeros((0, 2))), "R >= 1"), (dict(loss=np.ones(5), growth=1.0), "growth")],
)
def test_diverged_refuses_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        ev.diverged(**bad)


def test_next_to_diverged_on_either_side_and_not_elsewhere():
    inf, nan = np.inf, np.nan
    score = np.array(
        [
            [inf, 3.0, 2.0, 4.0],  # chosen 2: its neighbours 3.0 and 4.0 are fine
            [inf, 3.0, 2.0, 4.0],  # chosen 1: beside the diverged point 0
            [1.0, 3.0, 2.0, nan],  # chosen 2: beside the NaN point 3
            [-inf, 1.0, 2.0, 3.0],  # chosen 3 (maximize): no neighbour diverged
        ]
    )
    out = ev.grid_next_to_diverged([2, 1, 2, 3], score)
    assert out.tolist() == [False, True, True, False]
    assert ev.grid_next_to_diverged([0], np.array([[1.0]])).tolist() == [False]  # one point
    with pytest.raises(ValueError, match="score"):
        ev.grid_next_to_diverged([0, 1], np.ones((3, 2)))


def _ridge_clients(n, seed=0):
    return kj.data.synthetic_ridge(seed, num_clients=n, dim=3, num_test=10).train


def test_penalty_rule_is_within_the_uncoupled_stability_limit():
    n, s = 30, 10
    rates = protocol.smoothness_rates(
        karula=3 / 8, fedavg=0.1, ifca=0.5, personal=0.5, num_clients=n, clients_per_round=s
    )
    p = s / n
    limit = p * float(stability_factor(p))  # eta a_i < s c(p), a_i <= n L_f
    L_f = 2.0
    assert rates["penalty"](L_f=L_f) * L_f == pytest.approx(limit / 2, rel=1e-6)
    assert rates["karula"](L_f=L_f) * L_f == pytest.approx(3 / 8)  # above the limit 0.26
    legacy = protocol.smoothness_rates(
        karula=3 / 8, fedavg=0.1, ifca=0.5, personal=0.5, num_clients=n
    )
    assert legacy["penalty"](L_f=L_f) == pytest.approx(3 / 8 / L_f)
    with pytest.raises(ValueError, match="clients_per_round"):
        protocol.smoothness_rates(
            karula=1, fedavg=1, ifca=1, personal=1, num_clients=3, clients_per_round=4
        )


def _final_loss(rate_factor, mu, *, n=6, s=2, rounds=150):
    """The penalty's last-tenth mean training loss over its first tenth's, on ridge
    clients, at step ``rate_factor / L_f`` and ``mu``."""
    data = _ridge_clients(n)
    lam = 1e-6
    L_f, _ = protocol.smoothness_constants(jax.tree.map(lambda a: a[None], data), lam)
    loss = kj.models.ridge_loss(lam)
    D = jnp.ones((n, n)) - jnp.eye(n)
    alg = kj.algorithms.laplacian_penalty(
        loss,
        D,
        mu=mu * float(L_f[0]),
        learning_rate=rate_factor / float(L_f[0]),
        clients_per_round=s,
        batch_size=int(data.x.shape[1]),
    )
    res = kj.training.run(
        alg,
        jnp.zeros(3),
        data,
        key=jax.random.key(0),
        num_rounds=rounds,
        progress=False,
        on_nonfinite="record",
    )
    return np.asarray(res.info.loss)


def test_penalty_own_rule_stable_at_mu_zero_where_karulas_step_diverges():
    n, s = 6, 2
    own = protocol.smoothness_rates(
        karula=3 / 8, fedavg=0.1, ifca=0.5, personal=0.5, num_clients=n, clients_per_round=s
    )["penalty"](L_f=1.0)
    # mu = 0: uncoupled clients. Karula's study step is above their limit 2 * own
    # (0.375 > 0.262 at s / n = 1/3); four times the rule is twice the limit.
    assert not ev.diverged(_final_loss(own, 0.0)).item()
    assert ev.diverged(_final_loss(4 * own, 0.0)).item()
