"""Shared machinery: participation, minibatches, padding, single compilation, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _alg_problems import LOSS, N_CLIENTS, problem, scan_run, zeros
from _tolerances import EPS64

from karula_jax.algorithms import fedavg, fedsgd, ifca, local, pfedme
from karula_jax.algorithms._sampling import sample_participants, sample_rows

DRAWS = 4000
# Monte Carlo frequencies are checked to 4.5 standard errors of their mean: a correct
# sampler fails one such check with probability 7e-6 (normal tail), a biased one by
# more than 4.5 / sqrt(DRAWS) ~ 7% of the spread fails
SIGMAS = 4.5


def test_participants_exactly_s_uniform_without_replacement():
    n, s = N_CLIENTS, 2
    keys = jax.random.split(jax.random.key(0), DRAWS)
    masks, idx = jax.jit(jax.vmap(lambda k: sample_participants(k, n, s)))(keys)
    masks, idx = np.asarray(masks), np.asarray(idx)
    assert np.all(masks.sum(1) == s)
    assert np.all(idx[:, 0] != idx[:, 1])
    np.testing.assert_array_equal(masks, np.eye(n, dtype=bool)[idx].any(1))
    p = s / n
    se = np.sqrt(p * (1 - p) / DRAWS)
    assert np.all(np.abs(masks.mean(0) - p) < SIGMAS * se)
    # pairs are uniform too: each of the 15 pairs has probability 1/15
    pair = np.minimum(idx[:, 0], idx[:, 1]) * n + np.maximum(idx[:, 0], idx[:, 1])
    freq = np.unique(pair, return_counts=True)[1] / DRAWS
    q = 1 / 15
    assert len(freq) == 15 and np.all(np.abs(freq - q) < SIGMAS * np.sqrt(q * (1 - q) / DRAWS))


@pytest.mark.parametrize("count", [3, 7])
def test_rows_without_replacement_and_never_padding(count):
    max_count, B = 12, 4
    keys = jax.random.split(jax.random.key(1), DRAWS)
    rows, mask = jax.jit(jax.vmap(lambda k: sample_rows(k, count, max_count, B)))(keys)
    rows, mask = np.asarray(rows), np.asarray(mask)
    m = min(B, count)
    assert np.all(mask[:, :m]) and not np.any(mask[:, m:])
    real = rows[:, :m]
    assert np.all(real < count)
    assert all(len(set(r)) == m for r in real)
    freq = np.bincount(real.ravel(), minlength=max_count)[:count] / DRAWS
    p = m / count
    # (+ EPS64: where every row is drawn, p = 1 and no spread, two float64 quotients)
    assert np.all(np.abs(freq - p) < SIGMAS * np.sqrt(p * (1 - p) / DRAWS) + EPS64)
    full_rows, full_mask = sample_rows(keys[0], count, max_count, max_count)
    np.testing.assert_array_equal(full_rows, np.arange(max_count))
    np.testing.assert_array_equal(full_mask, np.arange(max_count) < count)


@pytest.mark.parametrize("batch_size", [4, 7, 64])
def test_padding_never_reaches_the_loss(batch_size):
    """Huge and NaN values in padded rows change nothing (minibatch and full batch)."""
    data = problem().train
    pad = ~np.asarray(data.mask)
    assert pad.any()
    x = np.where(pad[..., None], 1e30, np.asarray(data.x))
    y = np.where(pad, np.nan, np.asarray(data.y))
    dirty = data._replace(x=jnp.asarray(x, jnp.float32), y=jnp.asarray(y, jnp.float32))
    alg = fedavg(LOSS, learning_rate=0.1, clients_per_round=3, batch_size=batch_size,
                 local_steps=2)  # fmt: skip
    go = jax.jit(scan_run, static_argnums=(0, 4))
    key = jax.random.key(2)
    _, clean_info, clean = go(alg, zeros(), data, key, 10)
    _, dirty_info, dirty_traj = go(alg, zeros(), dirty, key, 10)
    assert bool(jnp.all(dirty_info.finite))
    np.testing.assert_array_equal(np.asarray(clean), np.asarray(dirty_traj))
    np.testing.assert_array_equal(np.asarray(clean_info.loss), np.asarray(dirty_info.loss))


def test_round_compiles_once():
    data = problem().train
    traces = []

    def counted_loss(p, x, y, m):
        traces.append(1)
        return LOSS(p, x, y, m)

    alg = fedsgd(counted_loss, learning_rate=0.1, clients_per_round=2, batch_size=4,
                 memory=True)  # fmt: skip
    state = alg.init(zeros(), data, key=jax.random.key(3))
    chunk = jax.jit(lambda st, d: jax.lax.scan(lambda s, _: alg.round(s, d), st, None, length=5))
    traces.clear()
    for _ in range(4):  # four chunks: one trace
        state, info = chunk(state, data)
    n_chunk = len(traces)
    assert n_chunk >= 1
    step = jax.jit(alg.round)
    for _ in range(3):
        state, info = step(state, data)
    assert len(traces) == 2 * n_chunk  # one more trace for the jitted round, not three
    assert int(state.round) == 23


def _nan_loss(p, x, y, m):
    return LOSS(p, x, y, m) + jnp.log(-1.0 + 0.0 * jnp.sum(p))


def _all_algorithms(loss):
    """Every baseline (Karula's NaN test reuses its compiled runner: test_alg_karula)."""
    kw = dict(learning_rate=0.1, clients_per_round=2, batch_size=4)
    return {
        "local": local(loss, learning_rate=0.1, batch_size=4, clients_per_round=2),
        "fedsgd": fedsgd(loss, **kw),
        "fedavg": fedavg(loss, **kw),
        "ifca": ifca(loss, num_clusters=2, **kw),
        "pfedme": pfedme(loss, **kw),
    }


def test_nan_loss_is_reported_and_keys_are_shared():
    data = problem().train
    participants = []
    for name, alg in _all_algorithms(_nan_loss).items():
        info = jax.jit(lambda k, a=alg: a.round(a.init(zeros(), data, key=k), data)[1])(
            jax.random.key(4)
        )
        assert not bool(info.finite), name
        assert int(info.participants.sum()) == 2, name
        participants.append(np.asarray(info.participants))
    # one key: the same participants in every method (paired comparisons)
    assert all(np.array_equal(p, participants[0]) for p in participants)


def test_bad_input_raises_for_every_baseline():
    data = problem().train
    kw = dict(learning_rate=0.1, clients_per_round=2, batch_size=4)
    factories = {
        "fedsgd": lambda **o: fedsgd(LOSS, **{**kw, **o}),
        "fedavg": lambda **o: fedavg(LOSS, **{**kw, **o}),
        "ifca": lambda **o: ifca(LOSS, num_clusters=2, **{**kw, **o}),
        "pfedme": lambda **o: pfedme(LOSS, **{**kw, **o}),
        "local": lambda **o: local(LOSS, **{**kw, **o}),
    }
    for name, make in factories.items():
        with pytest.raises(ValueError, match="learning_rate"):
            make(learning_rate=-1.0)
        with pytest.raises(ValueError, match="learning_rate"):
            make(learning_rate=float("nan"))
        with pytest.raises(ValueError, match="clients_per_round"):
            make(clients_per_round=0)
        with pytest.raises(ValueError, match="clients_per_round"):
            make(clients_per_round=N_CLIENTS + 1).init(zeros(), data, key=jax.random.key(0))
        with pytest.raises(ValueError, match="batch_size"):
            make(batch_size=-3)
        with pytest.raises(ValueError, match="weights"):
            make(weights=np.full(N_CLIENTS, np.nan))
        with pytest.raises(ValueError, match="weights"):
            make(weights=np.ones(N_CLIENTS - 1)).round(
                make().init(zeros(), data, key=jax.random.key(0)), data
            )
        assert name
    with pytest.raises(ValueError, match="local_steps"):
        fedavg(LOSS, local_steps=0, **kw)
    with pytest.raises(ValueError, match="num_clusters"):
        ifca(LOSS, num_clusters=0, **kw)
    with pytest.raises(ValueError, match="initial_clusters"):
        ifca(LOSS, num_clusters=2, initial_clusters=jnp.zeros((3, 3)), **kw)
    with pytest.raises(ValueError, match="lam"):
        pfedme(LOSS, lam=-1.0, **kw)
    with pytest.raises(ValueError, match="lam"):
        pfedme(LOSS, lam=0.0, **kw)
    with pytest.raises(ValueError, match="beta"):
        pfedme(LOSS, beta=0.0, **kw)
    with pytest.raises(ValueError, match="inner_steps"):
        pfedme(LOSS, inner_steps=0, **kw)


def _large_copies(alg, params, data, shape):
    """Shapes of the copies of ``shape``-sized f32 arrays in the compiled, donated round."""
    import re

    state = alg.init(params, data, key=jax.random.key(0))
    hlo = jax.jit(alg.round, donate_argnums=0).lower(state, data).compile().as_text()
    want = ",".join(map(str, shape))
    return re.findall(rf"= f32\[{want}\]\S* copy\(", hlo)


def test_memory_is_updated_in_place():
    """Karula's SAGA memory and SCAFFOLD's controls ([n, ...]) are written in place in a
    donated round: no copy of an [n, ...] leaf (two per round before the write waited
    for every read; SCAFFOLD also rewrote n copies of its global model)."""
    from karula_jax import models
    from karula_jax.algorithms import karula, scaffold
    from karula_jax.data import random_classification

    n = 12
    data = random_classification(n, seed=0, rows=(5, 9), features=40, num_classes=3)
    net = models.mlp(hidden=16, num_classes=3)
    params = models.init_params(net, jax.random.key(0), (1, 40))
    loss = models.cross_entropy_loss(net.apply)
    kw = dict(clients_per_round=3, batch_size=4)
    D = jnp.ones((n, n)) - jnp.eye(n)
    pers = models.output_layer_mask(params)
    for alg in (
        karula(loss, D, t=0.1, learning_rate=0.1, personalized=pers, **kw),
        scaffold(loss, learning_rate=0.1, local_steps=2, **kw),
    ):
        assert _large_copies(alg, params, data, (n, 40, 16)) == []


def test_a_round_of_zero_weight_participants_keeps_the_global_model():
    """``weights`` may hold zeros (clients without rows have weight 0 by default): a round
    whose participants all weigh 0 has nothing to average. Every method that averages keeps
    its global model there (FedSGD and SCAFFOLD take no step), with a finite loss in its
    report, instead of writing 0 / 0 into the model; rounds with weight move it as before."""
    from karula_jax.algorithms import ditto, fedprox, scaffold

    data = problem().train
    w = jnp.asarray([0.0] * (N_CLIENTS - 1) + [1.0])  # only the last client weighs
    kw = dict(learning_rate=0.1, clients_per_round=1, batch_size=4, weights=w)
    algs = {
        "fedsgd": fedsgd(LOSS, **kw),
        "fedavg": fedavg(LOSS, **kw),
        "fedprox": fedprox(LOSS, mu=0.1, **kw),
        "scaffold": scaffold(LOSS, **kw),
        "ditto": ditto(LOSS, lam=0.1, **kw),
        "pfedme": pfedme(LOSS, **kw),
    }
    start = jnp.asarray([0.3, -0.2, 0.1], jnp.float32)
    for name, alg in algs.items():
        state = alg.init(start, data, key=jax.random.key(1))
        step = jax.jit(alg.round)
        seen = set()
        for _ in range(12):
            new, info = step(state, data)
            drawn = int(np.argmax(np.asarray(info.participants)))
            old_w = state.extra if name in ("ditto", "pfedme") else state.params
            new_w = new.extra if name in ("ditto", "pfedme") else new.params
            old_w, new_w = jax.tree.leaves(old_w)[0], jax.tree.leaves(new_w)[0]
            assert bool(info.finite) and np.isfinite(float(info.loss)), (name, drawn)
            assert np.all(np.isfinite(np.asarray(new_w))), (name, drawn)
            if drawn < N_CLIENTS - 1:  # weight 0: the global model stays, exactly
                np.testing.assert_array_equal(new_w, old_w, err_msg=name)
                seen.add("zero")
            else:
                assert not np.array_equal(np.asarray(new_w), np.asarray(old_w)), name
                seen.add("weighted")
            state = new
        assert seen == {"zero", "weighted"}, (name, seen)
