"""The chunked training driver, checkpoints/resume and vmapped seeds and grids.

Everything runs on a tiny toy algorithm defined here (stochastic gradient descent on a
per-client quadratic with partial participation and averaging towards the mean), so these
tests do not depend on the real algorithms.
"""

import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from karula_jax import training
from karula_jax.algorithms.base import Algorithm, FedState, RoundInfo
from karula_jax.data import from_client_arrays
from karula_jax.training import checkpoint, loop, reports


@pytest.fixture(autouse=True)
def _fresh_trace_counters():
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


def test_single_trace_across_chunks_including_short_last_chunk(tmp_path):
    # Chunks of 3, 3, 3 and a masked final 1: one trace of the round (shared by the chunk
    # and the checkpoint fingerprint), one of the metrics.
    res = training.run(
        toy(traced=traced_at_most(1)),
        PARAMS,
        DATA,
        key=jax.random.PRNGKey(0),
        num_rounds=10,
        chunk_size=3,
        eval_fn=chex.assert_max_traces(eval_fn, n=1),
        checkpoint_dir=tmp_path,
        progress=False,
    )
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


def test_progress_bar_on_stderr(capsys):
    kw = dict(key=jax.random.PRNGKey(0), num_rounds=4, chunk_size=2, eval_fn=eval_fn)
    training.run(ALG, PARAMS, DATA, progress=True, **kw)
    err = capsys.readouterr().err
    assert "4/4" in err and "round/s" in err and "loss=" in err and "mean_b=" in err
    training.run(ALG, PARAMS, DATA, progress=False, **kw)
    assert capsys.readouterr().err == ""

    for _ in training.progress_bar(range(3), desc="CV folds", unit="fold"):
        pass
    with training.progress_bar(2, desc="embedding") as bar:
        bar.update(2)
    err = capsys.readouterr().err
    assert "CV folds" in err and "3/3" in err and "embedding" in err and "2/2" in err
    assert list(training.progress_bar([1, 2], enabled=False)) == [1, 2]
    assert capsys.readouterr().err == ""


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


def stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


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
            for x, y in zip(
                jax.tree.leaves(state.params), jax.tree.leaves(full.state.params), strict=True
            ):
                np.testing.assert_allclose(y[s, g], x, rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(info.participants, full.info.participants[:, s, g])
            np.testing.assert_allclose(info.loss, full.info.loss[:, s, g], rtol=1e-5)
            final = eval_fn(state.params, datas[s])["loss"]
            np.testing.assert_allclose(full.metrics["loss"][-1, s, g], final, rtol=1e-5)

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
        "worst_proj_delta": pytest.approx(1.25),
        "max_proj_violation": 0.0,
        "unconverged_rounds": [1, 4],
    }
    # Converged runs stay silent (warnings are errors here) and say so.
    ok = training.run(ALG, PARAMS, DATA, key=jax.random.PRNGKey(0), num_rounds=2, progress=False)
    assert ok.diagnostics["unconverged_rounds"] == []
    assert ok.diagnostics["worst_proj_delta"] == pytest.approx(1e-3)


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
    assert diag["worst_proj_delta"] == pytest.approx(0.5) and diag["num_rounds"] == 30
    with pytest.warns(
        training.ProjectionNotConvergedWarning, match=r"\(0-based: 3, 7, .*, 13, \.\.\.\)"
    ):
        reports.warn_unconverged(diag)
    assert training.round_diagnostics(None)["unconverged_rounds"] == []


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


# --------------------------------------------------------------------------- resume refuses


def _resume(alg, tmp_path, *, params=PARAMS, data=DATA, key=None, chunk_size=2, num_rounds=4):
    key = jax.random.PRNGKey(0) if key is None else key
    return training.run(
        alg,
        params,
        data,
        key=key,
        num_rounds=num_rounds,
        chunk_size=chunk_size,
        checkpoint_dir=tmp_path,
        resume=True,
        progress=False,
    )


def test_resume_refuses_another_run_and_names_what_differs(tmp_path):
    key = jax.random.PRNGKey(0)
    training.run(
        ALG,
        PARAMS,
        DATA,
        key=key,
        num_rounds=2,
        chunk_size=2,
        checkpoint_dir=tmp_path,
        progress=False,
    )
    path = str(tmp_path / training.CHECKPOINT_NAME)

    def refused(what, **kw):
        return pytest.raises(ValueError, match=rf"checkpoint {path} .*What differs: .*{what}")

    chunks = loop._jitted_chunk.cache_info().misses
    with refused(r"algorithm or hyperparameters"):
        _resume(toy(eta=0.31), tmp_path)  # a Python float: a literal of the program
    with refused(r"algorithm or hyperparameters"):
        _resume(toy(t=jnp.float32(0.6)), tmp_path)  # an array: a constant of the program
    with refused(r"algorithm or hyperparameters"):
        _resume(toy(s=3), tmp_path)
    assert loop._jitted_chunk.cache_info().misses == chunks  # refused before any chunk
    other = DATA._replace(x=DATA.x.at[0, 0, 0].add(1e-3))  # same shapes and counts
    with refused(r"data content"):
        _resume(ALG, tmp_path, data=other)
    with refused(r"initial params"):
        _resume(ALG, tmp_path, params={"a": jnp.ones(3), "b": jnp.zeros(())})
    with refused(r"chunk_size \(checkpoint: 2, this run: 3"):
        _resume(ALG, tmp_path, chunk_size=3)
    with refused(r"different key"):
        _resume(ALG, tmp_path, key=jax.random.PRNGKey(1))
    with refused(r"algorithm or hyperparameters.*; data content.*; chunk_size"):
        _resume(toy(eta=0.2), tmp_path, data=other, chunk_size=1)
    # The same run (a new but identical algorithm object) is accepted.
    res = _resume(toy(), tmp_path)
    assert res.info.loss.shape == (4,)


# --------------------------------------------------------------------------- bad checkpoint files


@pytest.fixture(scope="module")
def valid_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("valid")
    training.run(
        ALG,
        PARAMS,
        DATA,
        key=jax.random.PRNGKey(0),
        num_rounds=2,
        chunk_size=2,
        eval_fn=eval_fn,
        checkpoint_dir=directory,
        progress=False,
    )
    path = directory / training.CHECKPOINT_NAME
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return path.read_bytes(), arrays


def _npz_bytes(arrays, tmp_path):
    np.savez(tmp_path / "scratch.npz", **arrays)
    return (tmp_path / "scratch.npz").read_bytes()


def _with_meta(arrays, **changes):
    meta = json.loads(str(arrays["meta"]))
    meta.update(changes)
    return {**arrays, "meta": np.array(json.dumps(meta))}


BAD_FILES = {
    "empty": lambda good, arrays, tmp: b"",
    "truncated": lambda good, arrays, tmp: good[: len(good) // 2],
    "random bytes": lambda good, arrays, tmp: np.random.default_rng(0).bytes(5000),
    "npy, not npz": lambda good, arrays, tmp: (
        np.save(tmp / "x.npy", np.zeros(3)),
        (tmp / "x.npy").read_bytes(),
    )[1],
    "no meta": lambda good, arrays, tmp: _npz_bytes(
        {k: v for k, v in arrays.items() if k != "meta"}, tmp
    ),
    "malformed JSON": lambda good, arrays, tmp: _npz_bytes(
        {**arrays, "meta": np.array('{"format": ')}, tmp
    ),
    "meta not an object": lambda good, arrays, tmp: _npz_bytes(
        {**arrays, "meta": np.array("[1, 2]")}, tmp
    ),
    "meta missing fields": lambda good, arrays, tmp: _npz_bytes(
        {**arrays, "meta": np.array(json.dumps({"format": checkpoint._FORMAT}))}, tmp
    ),
    "missing state array": lambda good, arrays, tmp: _npz_bytes(
        {k: v for k, v in arrays.items() if k != "state_0001"}, tmp
    ),
    "missing info array": lambda good, arrays, tmp: _npz_bytes(
        {k: v for k, v in arrays.items() if k != "info_loss"}, tmp
    ),
    "state array of wrong shape": lambda good, arrays, tmp: _npz_bytes(
        {**arrays, "state_0000": np.zeros((2, 2), np.float32)}, tmp
    ),
    "pickled object array": lambda good, arrays, tmp: _npz_bytes(
        {**arrays, "info_loss": np.array([{"a": 1}], dtype=object)}, tmp
    ),
    "older format": lambda good, arrays, tmp: _npz_bytes(
        _with_meta(arrays, format="karula_jax.training.checkpoint/1"), tmp
    ),
}


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_bad_checkpoint_files_name_the_checkpoint(tmp_path, valid_checkpoint, kind):
    good, arrays = valid_checkpoint
    content = BAD_FILES[kind](good, arrays, tmp_path)
    directory = tmp_path / "ckpt"
    directory.mkdir()
    path = directory / training.CHECKPOINT_NAME
    path.write_bytes(content)
    key = jax.random.PRNGKey(0)
    template = jax.eval_shape(ALG.init, PARAMS, DATA, key=key)
    pattern = rf"checkpoint {path} is corrupt or not a karula_jax checkpoint"
    with pytest.raises(ValueError, match=pattern) as exc:
        training.load_checkpoint(path, template)
    assert "pickle" not in str(exc.value)
    with pytest.raises(ValueError, match=pattern) as exc:
        _resume(ALG, directory)
    assert "pickle" not in str(exc.value)


def test_checkpoint_with_other_round_info_fields_is_refused(tmp_path, valid_checkpoint):
    _, arrays = valid_checkpoint
    old = {k: v for k, v in arrays.items() if k != "info_proj_converged"}
    fields = [f for f in RoundInfo._fields if f != "proj_converged"]
    (tmp_path / training.CHECKPOINT_NAME).write_bytes(
        _npz_bytes(_with_meta(old, info_fields=fields), tmp_path)
    )
    template = jax.eval_shape(ALG.init, PARAMS, DATA, key=jax.random.PRNGKey(0))
    with pytest.raises(
        ValueError, match=r"holds round info with fields .* \(missing: \['proj_converged'\]"
    ):
        training.load_checkpoint(tmp_path / training.CHECKPOINT_NAME, template)


# --------------------------------------------------------------------------- checkpoint directory


def test_unwritable_checkpoint_dir_fails_before_compiling(tmp_path, monkeypatch):
    alg = toy(traced=traced_at_most(0))  # nothing may be traced, let alone compiled
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    for where in (blocker / "sub", blocker):
        with pytest.raises(OSError, match=rf"checkpoint_dir '{where}' cannot be created"):
            training.run(
                alg, PARAMS, DATA, key=jax.random.PRNGKey(0), num_rounds=2, checkpoint_dir=where
            )

    # Permission bits do not stop root, so a refused write is simulated.
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(checkpoint.tempfile, "mkstemp", refuse)
    with pytest.raises(PermissionError, match=r"checkpoint_dir .*read_only.* cannot be"):
        training.run(
            alg,
            PARAMS,
            DATA,
            key=jax.random.PRNGKey(0),
            num_rounds=2,
            checkpoint_dir=tmp_path / "read_only",
        )


def test_run_removes_temporary_files_left_by_a_kill(tmp_path):
    stale = tmp_path / f"{checkpoint._TMP_PREFIX}abc123.npz"
    stale.write_bytes(b"half a checkpoint")
    unrelated = [tmp_path / "notes.txt", tmp_path / ".tmp-someone-else.npz"]
    for f in unrelated:
        f.write_text("keep me")
    training.run(
        ALG,
        PARAMS,
        DATA,
        key=jax.random.PRNGKey(0),
        num_rounds=2,
        checkpoint_dir=tmp_path,
        progress=False,
    )
    assert not stale.exists()
    assert all(f.exists() for f in unrelated)
    assert (tmp_path / training.CHECKPOINT_NAME).exists()


KILLED_WRITER = """
import os, signal, sys
import numpy as np
from karula_jax import training

def savez_then_die(f, **arrays):
    f.write(b"PK\\x03\\x04 a torn archive")
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)

training.checkpoint.np.savez = savez_then_die
training.save_checkpoint(sys.argv[1], {"a": np.ones(3)}, rounds_done=2)
"""


def test_checkpoint_survives_a_kill_mid_write_and_run_cleans_up(tmp_path):
    import signal
    import subprocess
    import sys

    path = tmp_path / training.CHECKPOINT_NAME
    training.save_checkpoint(path, {"a": np.zeros(3)}, rounds_done=1)
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, str(path)],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    leftovers = [f for f in os.listdir(tmp_path) if f.startswith(checkpoint._TMP_PREFIX)]
    assert len(leftovers) == 1
    state, _, meta = training.load_checkpoint(path, {"a": np.zeros(3)})  # the old one, intact
    assert meta["rounds_done"] == 1 and not np.asarray(state["a"]).any()
    training.run(
        ALG,
        PARAMS,
        DATA,
        key=jax.random.PRNGKey(0),
        num_rounds=2,
        checkpoint_dir=tmp_path,
        progress=False,
    )
    assert sorted(os.listdir(tmp_path)) == [training.CHECKPOINT_NAME]


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
    assert res.diagnostics["worst_proj_delta"] == pytest.approx(float(res.info.proj_delta.max()))
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
