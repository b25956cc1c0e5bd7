"""The chunked training driver, checkpoints/resume and vmapped seeds and grids.

Everything runs on a tiny toy algorithm defined here (stochastic gradient descent on a
per-client quadratic with partial participation and averaging towards the mean), so these
tests do not depend on the real algorithms.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from karula_jax import training
from karula_jax.algorithms.base import Algorithm, FedState, RoundInfo
from karula_jax.data import from_client_arrays

TRACES = {"round": 0, "eval": 0}


def toy(eta=0.3, t=0.5, *, s=2, noise=0.1, nan_at=None):
    """Per-client quadratic ``f_i(w) = 0.5 mean_j ||w - x_ij||^2`` (masked).

    Each round, ``s`` clients sampled without replacement take a noisy gradient step, then
    every model moves a fraction ``t`` towards the mean model. ``nan_at`` injects a NaN into
    the parameters at that round. ``eta`` and ``t`` may be traced.
    """

    def loss_i(w, x, mask):
        sq = 0.5 * jnp.sum((x - w["a"] - w["b"]) ** 2, axis=-1)
        return jnp.sum(jnp.where(mask, sq, 0.0)) / jnp.sum(mask)

    def init(params, data, *, key):
        n = data.num_clients
        stacked = jax.tree.map(lambda p: jnp.broadcast_to(p, (n, *jnp.shape(p))), params)
        return FedState(stacked, (), (), (), key, jnp.zeros((), jnp.int32))

    def round_(state, data):
        TRACES["round"] += 1
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
        zero = jnp.zeros((), jnp.float32)
        info = RoundInfo(loss, part, zero, zero, jnp.zeros((), jnp.int32), finite)
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
    TRACES["eval"] += 1
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


def test_run_matches_one_scan_and_records_history():
    alg = ALG
    key = jax.random.PRNGKey(3)
    res = training.run(alg, PARAMS, DATA, key=key, num_rounds=7, chunk_size=3, progress=False)
    state0 = alg.init(PARAMS, DATA, key=key)
    ref_state, ref_info = jax.jit(lambda st: training.scan_rounds(alg, st, DATA, 7))(state0)
    for x, y in zip(
        jax.tree.leaves(res.state.params), jax.tree.leaves(ref_state.params), strict=True
    ):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)
    assert int(res.state.round) == 7
    assert res.info.loss.shape == (7,)
    assert res.info.participants.shape == (7, DATA.num_clients)
    np.testing.assert_array_equal(res.info.participants.sum(1), 2)
    np.testing.assert_array_equal(res.info.participants, np.asarray(ref_info.participants))
    np.testing.assert_allclose(res.info.loss, ref_info.loss, rtol=1e-6)
    assert res.info.finite.all()
    assert res.nonfinite_round is None
    assert res.timings["compile_s"] > 0 and res.timings["rounds_per_s"] > 0


def test_single_trace_across_chunks_including_short_last_chunk():
    alg = toy()
    TRACES.update(round=0, eval=0)
    res = training.run(
        alg,
        PARAMS,
        DATA,
        key=jax.random.PRNGKey(0),
        num_rounds=10,
        chunk_size=3,
        eval_fn=eval_fn,
        progress=False,
    )
    # Chunks of 3, 3, 3 and a masked final 1: one trace of the round, one of the metrics.
    assert TRACES == {"round": 1, "eval": 1}
    np.testing.assert_array_equal(res.metric_rounds, [0, 3, 6, 9, 10])


def test_metric_history_shapes_and_values():
    alg = ALG
    key = jax.random.PRNGKey(1)
    res = training.run(
        alg, PARAMS, DATA, key=key, num_rounds=7, chunk_size=3, eval_fn=eval_fn, progress=False
    )
    assert set(res.metrics) == {"loss", "mean_b"}
    assert res.metrics["loss"].shape == (4, DATA.num_clients)
    assert res.metrics["mean_b"].shape == (4,)
    # The last evaluation is of the final state, the first of the initial one.
    final = eval_fn(alg.client_params(res.state, DATA), DATA)
    np.testing.assert_allclose(res.metrics["loss"][-1], final["loss"], rtol=1e-6)
    init = eval_fn(alg.client_params(alg.init(PARAMS, DATA, key=key), DATA), DATA)
    np.testing.assert_allclose(res.metrics["loss"][0], init["loss"], rtol=1e-6)
    # Training lowers the loss of this contracting quadratic.
    assert res.metrics["loss"][-1].mean() < res.metrics["loss"][0].mean()

    only_end = training.run(
        alg,
        PARAMS,
        DATA,
        key=key,
        num_rounds=7,
        chunk_size=3,
        eval_fn=eval_fn,
        eval_every_chunk=False,
        progress=False,
    )
    np.testing.assert_array_equal(only_end.metric_rounds, [0, 7])
    assert only_end.metrics["loss"].shape == (2, DATA.num_clients)


def test_same_key_same_result_different_key_differs():
    alg = ALG
    kw = dict(num_rounds=5, chunk_size=2, progress=False)
    a = training.run(alg, PARAMS, DATA, key=jax.random.PRNGKey(7), **kw)
    b = training.run(alg, PARAMS, DATA, key=jax.random.PRNGKey(7), **kw)
    c = training.run(alg, PARAMS, DATA, key=jax.random.PRNGKey(8), **kw)
    leaves_equal(a.state, b.state)
    leaves_equal(a.info, b.info)
    assert not np.array_equal(np.asarray(a.state.params["a"]), np.asarray(c.state.params["a"]))


@pytest.mark.parametrize("typed_key", [False, True])
def test_resume_is_bit_identical(tmp_path, typed_key):
    alg = ALG
    key = jax.random.key(11) if typed_key else jax.random.PRNGKey(11)
    kw = dict(chunk_size=2, eval_fn=eval_fn, progress=False)
    full = training.run(
        alg, PARAMS, DATA, key=key, num_rounds=6, checkpoint_dir=tmp_path / "a", **kw
    )
    # A run killed after 4 rounds (its checkpoint is all that is left) ...
    training.run(alg, PARAMS, DATA, key=key, num_rounds=4, checkpoint_dir=tmp_path / "b", **kw)
    # ... resumed to 6 rounds in a fresh call.
    resumed = training.run(
        alg,
        PARAMS,
        DATA,
        key=key,
        num_rounds=6,
        checkpoint_dir=tmp_path / "b",
        resume=True,
        **kw,
    )
    leaves_equal(full.state, resumed.state)
    leaves_equal(full.info, resumed.info)
    assert resumed.info.loss.shape == (6,)
    np.testing.assert_array_equal(full.metric_rounds, resumed.metric_rounds)
    for name in full.metrics:
        np.testing.assert_array_equal(full.metrics[name], resumed.metrics[name])
    # Both checkpoints now hold the same thing.
    za = np.load(tmp_path / "a" / training.CHECKPOINT_NAME, allow_pickle=False)
    zb = np.load(tmp_path / "b" / training.CHECKPOINT_NAME, allow_pickle=False)
    assert za.files == zb.files
    for name in za.files:
        np.testing.assert_array_equal(za[name], zb[name])
    # Resuming a finished run returns it without running anything.
    again = training.run(
        alg,
        PARAMS,
        DATA,
        key=key,
        num_rounds=6,
        checkpoint_dir=tmp_path / "b",
        resume=True,
        **kw,
    )
    leaves_equal(full.state, again.state)
    assert again.timings["compile_s"] == 0.0


def test_checkpoint_is_plain_npz_and_roundtrips(tmp_path):
    alg = ALG
    key = jax.random.key(2)
    res = training.run(
        alg,
        PARAMS,
        DATA,
        key=key,
        num_rounds=3,
        chunk_size=2,
        eval_fn=eval_fn,
        checkpoint_dir=tmp_path,
        progress=False,
    )
    path = tmp_path / training.CHECKPOINT_NAME
    assert sorted(os.listdir(tmp_path)) == [training.CHECKPOINT_NAME]  # no temp files left
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}  # would raise if anything needed pickle
    assert all(a.dtype != object for a in arrays.values())
    meta = json.loads(str(arrays["meta"]))
    assert meta["rounds_done"] == 3 and meta["metric_names"] == ["loss", "mean_b"]
    template = jax.eval_shape(alg.init, PARAMS, DATA, key=key)
    state, hist, _ = training.load_checkpoint(path, template)
    leaves_equal(state, res.state)
    assert jax.dtypes.issubdtype(state.key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(hist["metric_rounds"], [0, 2, 3])
    np.testing.assert_array_equal(hist["info"].participants, res.info.participants)


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


def test_progress_lines_on_stderr(capsys):
    training.run(
        ALG,
        PARAMS,
        DATA,
        key=jax.random.PRNGKey(0),
        num_rounds=4,
        chunk_size=2,
        eval_fn=eval_fn,
        progress=True,
    )
    err = capsys.readouterr().err
    if "it/s" not in err and "round/s" not in err:  # plain fallback when tqdm is absent
        assert "round 2/4" in err and "round 4/4" in err and "loss=" in err


def test_bad_input_gives_clear_errors(tmp_path):
    alg = ALG
    key = jax.random.PRNGKey(0)
    kw = dict(progress=False)
    with pytest.raises(ValueError, match="num_rounds must be >= 1"):
        training.run(alg, PARAMS, DATA, key=key, num_rounds=0, **kw)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        training.run(alg, PARAMS, DATA, key=key, num_rounds=2, chunk_size=0, **kw)
    with pytest.raises(TypeError, match="num_rounds must be a positive Python int"):
        training.run(alg, PARAMS, DATA, key=key, num_rounds=2.5, **kw)
    with pytest.raises(ValueError, match="on_nonfinite"):
        training.run(alg, PARAMS, DATA, key=key, num_rounds=2, on_nonfinite="ignore", **kw)
    with pytest.raises(ValueError, match="needs checkpoint_dir"):
        training.run(alg, PARAMS, DATA, key=key, num_rounds=2, resume=True, **kw)
    with pytest.raises(ValueError, match="no checkpoint"):
        training.run(
            alg,
            PARAMS,
            DATA,
            key=key,
            num_rounds=2,
            resume=True,
            checkpoint_dir=tmp_path / "empty",
            **kw,
        )
    with pytest.raises(TypeError, match="eval_fn must return a dict"):
        training.run(alg, PARAMS, DATA, key=key, num_rounds=2, eval_fn=lambda p, d: p["b"], **kw)

    training.run(alg, PARAMS, DATA, key=key, num_rounds=2, checkpoint_dir=tmp_path, **kw)
    other_params = {"a": jnp.zeros(3), "b": jnp.zeros(()), "c": jnp.zeros(2)}
    with pytest.raises(ValueError, match="different structure"):
        training.run(
            alg,
            other_params,
            DATA,
            key=key,
            num_rounds=4,
            resume=True,
            checkpoint_dir=tmp_path,
            **kw,
        )
    with pytest.raises(ValueError, match="leaf 0 has shape"):
        training.run(
            alg,
            {"a": jnp.zeros(4), "b": jnp.zeros(())},
            DATA,
            key=key,
            num_rounds=4,
            resume=True,
            checkpoint_dir=tmp_path,
            **kw,
        )
    with pytest.raises(ValueError, match="different key"):
        training.run(
            alg,
            PARAMS,
            DATA,
            key=jax.random.PRNGKey(1),
            num_rounds=4,
            resume=True,
            checkpoint_dir=tmp_path,
            **kw,
        )
    with pytest.raises(ValueError, match="already holds 2 rounds"):
        training.run(
            alg, PARAMS, DATA, key=key, num_rounds=1, resume=True, checkpoint_dir=tmp_path, **kw
        )


def test_vmapped_seeds_and_grid_equal_separate_runs():
    keys = jax.random.split(jax.random.PRNGKey(5), 3)
    hyper = {"t": jnp.array([0.0, 0.5]), "eta": jnp.array([0.3, 0.1])}
    TRACES.update(round=0, eval=0)
    many = training.run_many(
        lambda t, eta: toy(eta=eta, t=t),
        PARAMS,
        DATA,
        keys=keys,
        hyper=hyper,
        num_rounds=5,
        chunk_size=2,
        eval_fn=eval_fn,
        progress=False,
    )
    assert TRACES == {"round": 1, "eval": 1}  # one program for the 3 x 2 runs
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
            for x, y in zip(
                jax.tree.leaves(one.state.params), jax.tree.leaves(many.state.params), strict=True
            ):
                np.testing.assert_allclose(y[s, g], x, rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(one.info.participants, many.info.participants[:, s, g])
            np.testing.assert_allclose(one.info.loss, many.info.loss[:, s, g], rtol=1e-5)
            np.testing.assert_allclose(
                one.metrics["loss"], many.metrics["loss"][:, s, g], rtol=1e-5, atol=1e-6
            )
    # Grid points of one seed share its draws (common random numbers).
    np.testing.assert_array_equal(many.info.participants[:, :, 0], many.info.participants[:, :, 1])


def test_vmapped_over_data_drawn_per_seed():
    datas = [make_data(seed) for seed in (0, 1)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *datas)
    keys = jax.random.split(jax.random.PRNGKey(9), 2)
    many = training.run_many(
        lambda: toy(),
        PARAMS,
        stacked,
        keys=keys,
        data_per_seed=True,
        num_rounds=3,
        chunk_size=3,
        eval_fn=eval_fn,
        progress=False,
    )
    assert many.state.params["a"].shape == (2, DATA.num_clients, 3)
    for s in range(2):
        one = training.run(
            ALG,
            PARAMS,
            datas[s],
            key=keys[s],
            num_rounds=3,
            chunk_size=3,
            eval_fn=eval_fn,
            progress=False,
        )
        np.testing.assert_allclose(many.state.params["a"][s], one.state.params["a"], rtol=1e-5)
        np.testing.assert_allclose(many.metrics["loss"][:, s], one.metrics["loss"], rtol=1e-5)
    with pytest.raises(ValueError, match="leading axis of 3 seeds"):
        training.run_many(
            lambda: toy(),
            PARAMS,
            stacked,
            keys=jax.random.split(keys[0], 3),
            data_per_seed=True,
            num_rounds=1,
            progress=False,
        )


def test_scan_rounds_vmaps_over_seeds_by_hand():
    alg = ALG
    keys = jax.random.split(jax.random.PRNGKey(4), 2)

    def one_seed(k):
        return training.scan_rounds(alg, alg.init(PARAMS, DATA, key=k), DATA, 3)

    states, infos = jax.jit(jax.vmap(one_seed))(keys)
    assert infos.loss.shape == (2, 3)
    single, _ = one_seed(keys[1])
    np.testing.assert_allclose(states.params["a"][1], single.params["a"], rtol=1e-5)


def test_product_grid():
    g = training.product_grid(t=[0.0, 1.0], eta=[0.1, 0.2, 0.3])
    np.testing.assert_array_equal(g["t"], [0, 0, 0, 1, 1, 1])
    np.testing.assert_allclose(g["eta"], [0.1, 0.2, 0.3] * 2)
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

    def make(t):
        return karula(
            loss,
            d,
            t=t,
            learning_rate=0.5,
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
    resumed = training.run(
        alg,
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

    keys = jax.random.split(key, 2)
    many = training.run_many(
        make, params, prob.train, keys=keys, hyper={"t": [0.3, 0.0]}, num_rounds=4, **kw
    )
    one = training.run(alg, params, prob.train, key=keys[1], num_rounds=4, **kw)
    np.testing.assert_allclose(many.state.params[1, 0], one.state.params, rtol=1e-4, atol=1e-5)
    # t = 0 ties every client to one model.
    spread = np.ptp(np.asarray(many.state.params[:, 1]), axis=1)
    assert spread.max() < 1e-5


def test_eval_data_can_hold_train_and_test():
    test = make_data(seed=5)

    def train_test(client_params, both):
        train, held_out = both
        return {
            "train": eval_fn(client_params, train)["loss"],
            "test": eval_fn(client_params, held_out)["loss"],
        }

    res = training.run(
        ALG,
        PARAMS,
        DATA,
        key=jax.random.PRNGKey(0),
        num_rounds=3,
        chunk_size=3,
        eval_fn=train_test,
        eval_data=(DATA, test),
        progress=False,
    )
    final = ALG.client_params(res.state, DATA)
    np.testing.assert_allclose(res.metrics["test"][-1], eval_fn(final, test)["loss"], rtol=1e-6)
    np.testing.assert_allclose(res.metrics["train"][-1], eval_fn(final, DATA)["loss"], rtol=1e-6)
