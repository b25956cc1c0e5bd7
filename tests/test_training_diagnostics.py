"""What a run reports (``karula_jax.training.diagnostics``): non-finite rounds, unconverged
projections, their diagnostics.

They run on the toy algorithm of ``tests/_training_helpers.py``, so that they do not
depend on the real algorithms; the ``test_real_karula_*`` tests use the real ones.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerances import EPS32
from _training_helpers import (
    ALG,
    DATA,
    PARAMS,
    fresh_trace_counters,  # noqa: F401 - the autouse fixture
    toy,
)

from karula_jax import training
from karula_jax.algorithms.base import RoundInfo
from karula_jax.training import diagnostics


def test_nonfinite_round_raises_and_names_it(tmp_path):
    alg = toy(nan_at=4)
    with pytest.raises(FloatingPointError, match=r"round 4 \(0-based") as exc:
        training.run(
            alg,
            PARAMS,
            DATA,
            key=jax.random.PRNGKey(0),
            num_rounds=9,
            chunk_size=3,
            checkpoint_dir=tmp_path,
            progress=False,
        )
    partial = exc.value.result
    assert partial.info.loss.shape == (5,) and not partial.info.finite[-1]
    assert partial.info.finite[:4].all()
    # The last checkpoint is the one before the bad chunk.
    with np.load(tmp_path / training.CHECKPOINT_NAME, allow_pickle=False) as z:
        assert json.loads(str(z["meta"]))["rounds_done"] == 3

    rec = training.run(
        alg,
        PARAMS,
        DATA,
        key=jax.random.PRNGKey(0),
        num_rounds=9,
        chunk_size=3,
        on_nonfinite="record",
        progress=False,
    )
    assert rec.nonfinite_round == 4 and rec.info.loss.shape == (9,)


# --------------------------------------------------------------------------- projection reports


def test_unconverged_rounds_warn_and_are_summarized():
    alg = toy(unconverged=(1, 4))
    with pytest.warns(
        training.ProjectionNotConvergedWarning,
        match=r"did not converge in 2 of 6 rounds \(0-based: 1, 4\); worst certified gap "
        r"proj_delta=1\.25",
    ):
        res = training.run(
            alg, PARAMS, DATA, key=jax.random.PRNGKey(0), num_rounds=6, chunk_size=4, progress=False
        )
    np.testing.assert_array_equal(res.info.proj_converged, [1, 0, 1, 1, 0, 1])
    assert res.diagnostics == {
        "num_rounds": 6,
        "worst_proj_delta": 1.25,  # the toy's float32 0.25 * 5, exact
        "max_proj_violation": 0.0,
        "unconverged_rounds": [1, 4],
    }
    # Converged runs stay silent (warnings are errors here) and say so.
    ok = training.run(ALG, PARAMS, DATA, key=jax.random.PRNGKey(0), num_rounds=2, progress=False)
    assert ok.diagnostics["unconverged_rounds"] == []
    # the toy's gap 1e-3, stored in float32: one rounding
    assert ok.diagnostics["worst_proj_delta"] == pytest.approx(1e-3, rel=EPS32)


def test_round_diagnostics_of_batched_and_long_histories():
    n = DATA.num_clients
    conv = np.ones((30, 2, 3), bool)
    conv[[3, 7, 8, 9, 10, 11, 12, 13, 14, 20], 1, 2] = False
    delta = np.full((30, 2, 3), 1e-4, np.float32)
    delta[5, 0, 0], delta[6, 0, 0] = 0.5, np.nan  # NaN (a diverged run) is ignored
    info = RoundInfo(
        loss=np.zeros((30, 2, 3)),
        participants=np.zeros((30, 2, 3, n), bool),
        proj_delta=delta,
        proj_violation=np.zeros((30, 2, 3)),
        proj_iterations=np.zeros((30, 2, 3), np.int32),
        proj_converged=conv,
        finite=np.ones((30, 2, 3), bool),
    )
    diag = training.round_diagnostics(info)
    assert diag["unconverged_rounds"] == [3, 7, 8, 9, 10, 11, 12, 13, 14, 20]
    assert diag["worst_proj_delta"] == 0.5 and diag["num_rounds"] == 30  # the largest, exact
    with pytest.warns(
        training.ProjectionNotConvergedWarning, match=r"\(0-based: 3, 7, .*, 13, \.\.\.\)"
    ):
        diagnostics.warn_unconverged(diag)
    assert training.round_diagnostics(None)["unconverged_rounds"] == []


def test_real_karula_reports_unconverged_projection_and_fedavg_is_not_fedsgd(tmp_path):
    from karula_jax.algorithms import fedavg, fedsgd, karula
    from karula_jax.data import synthetic_ridge
    from karula_jax.models import ridge_loss

    prob = synthetic_ridge(1, num_clients=5, dim=2, min_samples=4, max_samples=6, num_test=2)
    d = np.asarray(jnp.sum((prob.theta_true[:, None] - prob.theta_true[None]) ** 2, -1))
    loss = ridge_loss(1e-3)
    params, key = jnp.zeros(2), jax.random.PRNGKey(0)
    kw = dict(num_rounds=2, chunk_size=2, progress=False)
    capped = karula(
        loss, d, t=0.1, learning_rate=0.5, clients_per_round=2, batch_size=4, projection_max_iter=1
    )
    with pytest.warns(training.ProjectionNotConvergedWarning, match=r"2 of 2 rounds") as rec:
        res = training.run(capped, params, prob.train, key=key, **kw)
    assert rec[0].filename == __file__  # points at the caller of run
    assert not res.info.proj_converged.any()
    assert res.diagnostics["unconverged_rounds"] == [0, 1]
    assert res.diagnostics["worst_proj_delta"] == float(res.info.proj_delta.max())  # selected
    assert res.diagnostics["worst_proj_delta"] > 0

    # Baselines have no projection: always "converged". Same state structure, other program.
    base = dict(learning_rate=0.1, clients_per_round=2, batch_size=4)
    sgd = training.run(
        fedsgd(loss, **base), params, prob.train, key=key, checkpoint_dir=tmp_path, **kw
    )
    assert sgd.info.proj_converged.all()
    # Another algorithm is refused by name, the same one with other hyperparameters by the
    # fingerprint of its programs.
    with pytest.raises(ValueError, match="was written by fedsgd, this run is fedavg"):
        training.run(
            fedavg(loss, **base),
            params,
            prob.train,
            key=key,
            checkpoint_dir=tmp_path,
            resume=True,
            **kw,
        )
    with pytest.raises(ValueError, match="What differs: algorithm or hyperparameters"):
        training.run(
            fedsgd(loss, **{**base, "learning_rate": 0.2}),
            params,
            prob.train,
            key=key,
            checkpoint_dir=tmp_path,
            resume=True,
            **kw,
        )


def test_describe_diagnostics_names_the_rounds():
    line = training.describe_diagnostics(
        {
            "num_rounds": 20,
            "worst_proj_delta": 2.5e-3,
            "max_proj_violation": 0.0,
            "unconverged_rounds": list(range(10)),
        }
    )
    assert "worst certified gap 0.0025" in line and "10 of 20 rounds unconverged" in line
    assert "rounds 0, 1, 2, 3, 4, 5, 6, 7, ..." in line
    clean = {"num_rounds": 5, "worst_proj_delta": 0.0, "max_proj_violation": 0.0}
    assert "0 of 5 rounds unconverged" in training.describe_diagnostics(
        clean | {"unconverged_rounds": []}
    )
