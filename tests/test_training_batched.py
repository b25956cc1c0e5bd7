"""The batched runner (``karula_jax.training.batched``): ``run_many`` equals separate runs,
per-member arguments and resume, bad batch arguments, non-finite members, ``product_grid``,
the real Karula over a t grid.

They run on the toy algorithm of ``tests/_training_helpers.py``, so that they do not
depend on the real algorithms; the ``test_real_karula_*`` tests use the real ones.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerances import reordered_sum
from _training_helpers import (
    DATA,
    PARAMS,
    assert_within,
    eval_fn,
    fresh_trace_counters,  # noqa: F401 - the autouse fixture
    leaves_equal,
    make_data,
    scale,
    stack,
    toy,
    toy_loss_bound,
    toy_rounding,
    traced_at_most,
)

from karula_jax import training


def test_vmapped_seeds_and_grid_equal_separate_runs():
    keys = jax.random.split(jax.random.PRNGKey(5), 3)
    hyper = {"t": jnp.array([0.0, 0.5]), "eta": jnp.array([0.3, 0.1])}
    counted = traced_at_most(1)  # one program for the 3 x 2 runs
    many = training.run_many(
        lambda t, eta: toy(eta=eta, t=t, traced=counted),
        PARAMS,
        DATA,
        keys=keys,
        hyper=hyper,
        num_rounds=5,
        chunk_size=2,
        eval_fn=chex.assert_max_traces(eval_fn, n=1),
        progress=False,
    )
    assert many.state.params["a"].shape == (3, 2, DATA.num_clients, 3)
    assert many.info.loss.shape == (5, 3, 2)
    assert many.metrics["loss"].shape == (4, 3, 2, DATA.num_clients)
    for g in range(2):
        alg = toy(eta=float(hyper["eta"][g]), t=float(hyper["t"][g]))
        for s in range(3):
            one = training.run(
                alg,
                PARAMS,
                DATA,
                key=keys[s],
                num_rounds=5,
                chunk_size=2,
                eval_fn=eval_fn,
                progress=False,
            )
            # vmapped against alone: 5 rounds apart at most, 1.1e-5 of the models' scale
            # (measured 1e-7); the losses move with the models (toy_loss_bound)
            size = scale(one.state.params)
            for x, y in zip(
                jax.tree.leaves(one.state.params), jax.tree.leaves(many.state.params), strict=True
            ):
                np.testing.assert_allclose(y[s, g], x, rtol=0, atol=toy_rounding(5) * size)
            np.testing.assert_array_equal(one.info.participants, many.info.participants[:, s, g])
            loss = one.info.loss
            assert_within(many.info.loss[:, s, g], loss, toy_loss_bound(loss, 5, size))
            loss = one.metrics["loss"]
            assert_within(many.metrics["loss"][:, s, g], loss, toy_loss_bound(loss, 5, size))
    # Grid points of one seed share its draws (common random numbers).
    np.testing.assert_array_equal(many.info.participants[:, :, 0], many.info.participants[:, :, 1])


def test_run_many_members_with_own_kwargs_params_and_data_then_resume(tmp_path):
    """3 members (own data, initial model, step size) x a t grid of 2, as one program."""
    datas = [make_data(seed) for seed in (0, 1, 2)]
    params = {"a": jnp.arange(9.0).reshape(3, 3) / 9, "b": jnp.array([0.0, 1.0, -1.0])}
    etas, ts = jnp.array([0.3, 0.2, 0.1]), jnp.array([0.0, 0.5])
    keys = jax.random.split(jax.random.PRNGKey(2), 3)
    kw = dict(
        keys=keys,
        hyper={"t": ts},
        data_per_seed=True,
        params_per_seed=True,
        batch_kwargs={"eta": etas},
        chunk_size=2,
        progress=False,
    )
    counted = traced_at_most(1)
    full = training.run_many(
        lambda eta, t: toy(eta=eta, t=t, traced=counted),
        params,
        stack(datas),
        num_rounds=5,
        eval_fn=chex.assert_max_traces(eval_fn, n=1),  # the whole batch traces once
        **kw,
    )
    assert full.state.params["a"].shape == (3, 2, DATA.num_clients, 3)
    assert full.info.loss.shape == (5, 3, 2)
    assert full.metrics["loss"].shape == (4, 3, 2, DATA.num_clients)

    # Every member x grid point alone: one lax.scan with its own eta, t, params, data, key.
    @jax.jit
    def alone(eta, t, p, d, key):
        alg = toy(eta=eta, t=t)
        return training.scan_rounds(alg, alg.init(p, d, key=key), d, 5)

    for s in range(3):
        p_s = jax.tree.map(lambda x, s=s: x[s], params)
        for g in range(2):
            state, info = alone(etas[s], ts[g], p_s, datas[s], keys[s])
            size = scale(state.params)  # as above: 5 rounds apart at most
            for x, y in zip(
                jax.tree.leaves(state.params), jax.tree.leaves(full.state.params), strict=True
            ):
                np.testing.assert_allclose(y[s, g], x, rtol=0, atol=toy_rounding(5) * size)
            np.testing.assert_array_equal(info.participants, full.info.participants[:, s, g])
            assert_within(full.info.loss[:, s, g], info.loss, toy_loss_bound(info.loss, 5, size))
            final = eval_fn(state.params, datas[s])["loss"]
            bound = toy_loss_bound(final, 5, size)
            assert_within(full.metrics["loss"][-1, s, g], final, bound)

    # Checkpointed after 4 rounds, resumed to 5: bit-identical to the uninterrupted batch.
    make = lambda eta, t: toy(eta=eta, t=t)
    ck = dict(params=params, data=stack(datas), eval_fn=eval_fn, checkpoint_dir=tmp_path, **kw)
    training.run_many(make, num_rounds=4, **ck)
    other = {**kw, "batch_kwargs": {"eta": etas.at[2].set(0.11)}}
    with pytest.raises(ValueError, match=r"What differs: batch_kwargs \(sha256"):
        training.run_many(make, num_rounds=5, resume=True, **{**ck, **other})
    other = {**kw, "hyper": {"t": ts.at[1].set(0.4)}}  # traced grid values, same shapes
    with pytest.raises(ValueError, match=r"What differs: algorithm or hyperparameters \("):
        training.run_many(make, num_rounds=5, resume=True, **{**ck, **other})
    resumed = training.run_many(make, num_rounds=5, resume=True, **ck)
    leaves_equal(full.state, resumed.state)
    leaves_equal(full.info, resumed.info)
    for name in full.metrics:
        np.testing.assert_array_equal(full.metrics[name], resumed.metrics[name])


def test_a_second_batch_of_one_factory_and_grid_compiles_no_chunk():
    """With reuse_compiled, run_many keeps the batched algorithm of a factory (by identity)
    and grid (by value): a second batch on other data and member arguments (a study's
    second D) reuses the compiled chunk, and its results are its own arguments' (nothing
    is baked in). Without it, a factory is traced afresh: one that reads a changed value
    runs the new one."""
    compiled = []

    def listen(event, secs, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(secs)

    make = lambda eta, t: toy(eta=eta, t=t)
    keys = jax.random.split(jax.random.PRNGKey(3), 2)
    kw = dict(keys=keys, hyper={"t": jnp.array([0.0, 0.5])}, data_per_seed=True)
    kw |= dict(num_rounds=4, chunk_size=4, progress=False, reuse_compiled=True)
    first, second = stack([make_data(0), make_data(1)]), stack([make_data(2), make_data(3)])
    training.run_many(make, PARAMS, first, batch_kwargs={"eta": jnp.array([0.3, 0.2])}, **kw)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        again = training.run_many(
            make, PARAMS, second, batch_kwargs={"eta": jnp.array([0.1, 0.25])}, **kw
        )
        reused = len(compiled)
        fresh = training.run_many(  # a new factory object: compiled afresh
            lambda eta, t: toy(eta=eta, t=t),
            PARAMS,
            second,
            batch_kwargs={"eta": jnp.array([0.1, 0.25])},
            **kw,
        )
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert reused <= 1 < len(compiled)  # no chunk: only the factory checks program
    leaves_equal(again.state, fresh.state)
    leaves_equal(again.info, fresh.info)
    other_grid = training.run_many(
        make,
        PARAMS,
        second,
        batch_kwargs={"eta": jnp.array([0.1, 0.25])},
        **{**kw, "hyper": {"t": jnp.array([0.0, 0.4])}},
    )
    np.testing.assert_array_equal(other_grid.state.params["a"][:, 0], fresh.state.params["a"][:, 0])
    assert not np.array_equal(other_grid.state.params["a"][:, 1], fresh.state.params["a"][:, 1])

    # the default traces the factory afresh: it sees a value changed between calls
    scale = {"eta": 1.0}
    impure = lambda eta, t: toy(eta=eta * scale["eta"], t=t)
    kw["reuse_compiled"] = False
    args = (PARAMS, second)
    before = training.run_many(impure, *args, batch_kwargs={"eta": jnp.array([0.1, 0.2])}, **kw)
    scale["eta"] = 0.5
    after = training.run_many(impure, *args, batch_kwargs={"eta": jnp.array([0.1, 0.2])}, **kw)
    pure = lambda eta, t: toy(eta=eta, t=t)
    want = training.run_many(pure, *args, batch_kwargs={"eta": jnp.array([0.05, 0.1])}, **kw)
    assert not np.array_equal(before.state.params["a"], after.state.params["a"])
    leaves_equal(after.state, want.state)


def test_run_many_rejects_bad_batch_arguments():
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    kw = dict(keys=keys, num_rounds=1, progress=False)
    make = lambda eta=0.3, t=0.5: toy(eta=eta, t=t)
    with pytest.raises(ValueError, match=r"batch_kwargs\['eta'\] must have a leading axis of 2"):
        training.run_many(make, PARAMS, DATA, batch_kwargs={"eta": [0.1, 0.2, 0.3]}, **kw)
    with pytest.raises(ValueError, match="both in batch_kwargs and in hyper"):
        training.run_many(
            make, PARAMS, DATA, batch_kwargs={"t": [0.1, 0.2]}, hyper={"t": [0.0]}, **kw
        )
    with pytest.raises(ValueError, match="params_per_seed=True needs every leaf"):
        training.run_many(make, PARAMS, DATA, params_per_seed=True, **kw)
    with pytest.raises(ValueError, match="leading axis of 2 seeds"):
        training.run_many(make, PARAMS, stack([DATA] * 3), data_per_seed=True, **kw)
    with pytest.raises(ValueError, match="shard must be one of"):
        training.run_many(make, PARAMS, DATA, shard="seeds", **kw)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['key'\]"):
        training.run_many(make, PARAMS, DATA, key=keys[0], **kw)


def test_grid_shares_the_key_and_a_round_that_breaks_that_is_refused():
    """Grid points of a member draw with the member's key (the round's draws and data
    gathers are shared by the grid); a round whose key depends on a hyperparameter
    would silently run every grid point on the first one's draws, so it is refused."""
    keys = jax.random.split(jax.random.PRNGKey(1), 2)
    hyper = {"eta": jnp.array([0.3, 0.1, 0.2])}

    def keyed_by(eta):
        alg = toy(eta=eta)

        def round_(state, data):
            new, info = alg.round(state, data)
            return new._replace(key=jax.random.fold_in(new.key, (100 * eta).astype(int))), info

        return alg._replace(round=round_)

    def counted_by(eta):  # a round counter that depends on the grid point
        alg = toy(eta=eta)

        def round_(state, data):
            new, info = alg.round(state, data)
            return new._replace(round=new.round + (eta > 0.25).astype(jnp.int32)), info

        return alg._replace(round=round_)

    def started_by(eta):  # an init whose key depends on the grid point
        alg = toy(eta=eta)

        def init(params, data, *, key):
            return alg.init(params, data, key=jax.random.fold_in(key, (100 * eta).astype(int)))

        return alg._replace(init=init)

    kw = dict(keys=keys, num_rounds=2, hyper=hyper, progress=False)
    for bad, where in ((keyed_by, "round"), (counted_by, "round"), (started_by, "init")):
        with pytest.raises(
            ValueError, match=f"algorithm's {where} must give FedState.key and FedState.round"
        ):
            training.run_many(bad, PARAMS, DATA, **kw)
    # A round that leaves them alone runs, and a ValueError of its own passes through.
    many = training.run_many(lambda eta: toy(eta=eta), PARAMS, DATA, **kw)
    assert many.state.key.shape[:2] == (2, 3) and many.state.round.shape == (2, 3)
    np.testing.assert_array_equal(many.state.round, 2)

    def own_error(eta):
        alg = toy(eta=eta)

        def round_(state, data):
            raise ValueError("the round's own message")

        return alg._replace(round=round_)

    with pytest.raises(ValueError, match="the round's own message"):
        training.run_many(own_error, PARAMS, DATA, **kw)


def test_nonfinite_batch_member_is_named():
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    # eta = 30 makes member 1 overflow float32 within a few rounds, member 0 stays finite.
    with pytest.raises(FloatingPointError, match=r"in batch members s \[1\]") as exc:
        training.run_many(
            lambda eta: toy(eta=eta, t=0.0, noise=1e3),
            PARAMS,
            DATA,
            keys=keys,
            batch_kwargs={"eta": jnp.array([0.3, 3e3])},
            num_rounds=40,
            chunk_size=40,
            progress=False,
        )
    assert exc.value.result.info.finite[:, 0].all()


def test_product_grid():
    g = training.product_grid(t=[0.0, 1.0], eta=[0.1, 0.2, 0.3])
    np.testing.assert_array_equal(g["t"], [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(g["eta"], [0.1, 0.2, 0.3] * 2)  # the values, repeated
    with pytest.raises(ValueError, match="same length"):
        training.run_many(
            lambda t, eta: toy(t=t, eta=eta),
            PARAMS,
            DATA,
            keys=jax.random.split(jax.random.PRNGKey(0), 2),
            hyper={"t": [0.1, 0.2], "eta": [0.1]},
            num_rounds=1,
            progress=False,
        )


def test_real_karula_resume_and_t_grid(tmp_path):
    """The driver with the real Karula (projection warm start in the state)."""
    from karula_jax.algorithms import karula
    from karula_jax.data import synthetic_ridge
    from karula_jax.models import ridge_loss

    prob = synthetic_ridge(0, num_clients=6, dim=3, min_samples=5, max_samples=8, num_test=4)
    d = np.asarray(jnp.sum((prob.theta_true[:, None] - prob.theta_true[None]) ** 2, -1))
    loss = ridge_loss(1e-3)

    def make(t, learning_rate=0.5, D=d):
        return karula(
            loss,
            D,
            t=t,
            learning_rate=learning_rate,
            clients_per_round=2,
            batch_size=4,
            projection_max_iter=200,
        )

    params = jnp.zeros(3)
    key = jax.random.PRNGKey(0)
    alg = make(0.3)
    kw = dict(chunk_size=2, progress=False)
    full = training.run(alg, params, prob.train, key=key, num_rounds=4, **kw)
    training.run(alg, params, prob.train, key=key, num_rounds=2, checkpoint_dir=tmp_path, **kw)
    # Karula instances that differ only in t or in the step size cannot resume it.
    for other in (make(0.31), make(0.3, learning_rate=0.6)):
        with pytest.raises(ValueError, match="What differs: algorithm or hyperparameters"):
            training.run(
                other,
                params,
                prob.train,
                key=key,
                num_rounds=4,
                checkpoint_dir=tmp_path,
                resume=True,
                **kw,
            )
    resumed = training.run(
        make(0.3),  # the same settings in a new object are accepted
        params,
        prob.train,
        key=key,
        num_rounds=4,
        checkpoint_dir=tmp_path,
        resume=True,
        **kw,
    )
    leaves_equal(full.state, resumed.state)
    leaves_equal(full.info, resumed.info)
    assert (full.info.proj_iterations > 0).any()  # the constraints were active
    assert full.info.proj_converged.all() and full.diagnostics["unconverged_rounds"] == []

    keys = jax.random.split(key, 2)
    # Each member its own (traced) D: member 1's is d, the constant of ``alg``.
    many = training.run_many(
        make,
        params,
        prob.train,
        keys=keys,
        hyper={"t": [0.3, 0.0]},
        batch_kwargs={"D": np.stack([2 * d, d])},
        num_rounds=4,
        **kw,
    )
    one = training.run(alg, params, prob.train, key=keys[1], num_rounds=4, **kw)
    # 10 times the rounds' rounding (reordered_sum(4 * 3 + 6 + 4, 4), 1e-5 of the models: 2
    # clients' batches of 4, the mean over 6); each member's projection is solved in turn
    # by the single run's solver program, on inputs equal up to that rounding, so it stops
    # at the same iterations (measured: equal). Stopping one iteration apart could move a
    # model by the solve's certified distance, sqrt(2 delta) = 1e-3 here, which would show.
    np.testing.assert_allclose(many.state.params[1, 0], one.state.params, rtol=1e-4, atol=1e-5)
    # t = 0 ties every client to one model: the projection is the mean, given to every
    # client (measured: equal); at most an n-term mean's rounding if computed per client
    spread = np.ptp(np.asarray(many.state.params[:, 1]), axis=1)
    assert spread.max() <= reordered_sum(6) * np.abs(np.asarray(many.state.params[:, 1])).max()


def test_run_many_reports_rounds_unconverged_in_any_member():
    hyper = {"t": jnp.array([0.0, 0.5])}
    keys = jax.random.split(jax.random.PRNGKey(5), 2)
    with pytest.warns(training.ProjectionNotConvergedWarning, match=r"0-based: 2\)"):
        many = training.run_many(
            lambda t: toy(t=t, unconverged=(2,)),
            PARAMS,
            DATA,
            keys=keys,
            hyper=hyper,
            num_rounds=3,
            chunk_size=3,
            progress=False,
        )
    assert many.info.proj_converged.shape == (3, 2, 2)
    assert many.diagnostics["unconverged_rounds"] == [2]
