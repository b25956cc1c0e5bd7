"""The comparison protocol: stacked CV data sets, grids, cross-validated selection."""

import functools
import re
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _alg_problems import power_shortfall
from _tolerances import EPS32, EPS64, reordered_sum

from karula_jax import _platform
from karula_jax import algorithms as A
from karula_jax import evaluation as ev
from karula_jax.algorithms._sampling import init_and_run_keys
from karula_jax.data import from_client_arrays
from karula_jax.embedding import DEFAULT_THRESHOLD, dissimilarities
from karula_jax.models import ridge_loss
from karula_jax.protocol import (
    REGISTRY,
    SUITE,
    Method,
    MethodRow,
    build_methods,
    choice_grid,
    cluster_labels,
    compare,
    cross_choice,
    cross_validate,
    cv_datasets,
    default_rates,
    member_default_rates,
    member_dissimilarities,
    register,
    scalar_grid,
    smoothness_constants,
    smoothness_rates,
    stack_datasets,
)
from karula_jax.training import run_many


def _data(seed, sizes, dim=2):
    rng = np.random.default_rng(seed)
    theta = rng.normal(size=(len(sizes), dim))
    xs = [rng.normal(size=(m, dim)).astype(np.float32) for m in sizes]
    ys = [
        (x @ t + 0.1 * rng.normal(size=len(x))).astype(np.float32)
        for x, t in zip(xs, theta, strict=True)
    ]
    return from_client_arrays(xs, ys)


# Tolerances. Two programs running the same float32 rounds (cross_validate's batch of
# members against run_many's, compare's against cross_validate's, a registry row against
# the factory called by hand) sum in other orders.


def _rounds_rtol(rounds, *, batch, local_steps=1, clients=3, dim=2) -> float:
    """Relative rounding of the models after ``rounds`` such rounds: a round's local steps
    each sum a batch of rows of ``dim`` terms, the server averages the clients, and each
    round's error carries on through the next (stable steps do not grow it)."""
    return reordered_sum(local_steps * (batch + dim + 3) + clients + 4, rounds=rounds)


def _mse_rtol(models_rtol, evals, mse) -> float:
    """Relative rounding of a mean squared error whose models carry ``models_rtol``:
    ``d(r^2) = 2 r x d(theta)`` and ``|x theta| <= |r| + |y|``, so the error moves by at
    most ``2 (1 + rms(y) / rms(r))`` times the models' relative rounding; the mean over
    the validation rows adds its own."""
    y = np.asarray(evals.y, np.float64)
    y = y[np.arange(y.shape[-1]) < np.asarray(evals.counts)[..., None]]
    ratio = np.sqrt(np.mean(y**2) / np.min(mse))
    return 2 * (1 + ratio) * models_rtol + reordered_sum(np.asarray(evals.x).shape[-2] + 4)


def test_stack_datasets_pads_rows_and_keeps_values():
    a, b = _data(0, (3, 5)), _data(1, (7, 2))
    s = stack_datasets([a, b])
    assert s.x.shape == (2, 2, 7, 2) and s.y.shape == (2, 2, 7)
    np.testing.assert_array_equal(np.asarray(s.x[0, :, :5]), np.asarray(a.x))
    assert np.all(np.asarray(s.x[0, :, 5:]) == 0)
    np.testing.assert_array_equal(np.asarray(s.counts), [[3, 5], [7, 2]])
    with pytest.raises(ValueError, match="items"):
        stack_datasets([])
    with pytest.raises(ValueError, match="clients and feature shapes"):
        stack_datasets([a, _data(2, (3, 4, 5))])
    with pytest.raises(ValueError, match="rows"):
        stack_datasets([a, b], rows=3)


def test_cv_datasets_layout_is_seed_major_folds_then_final_fit():
    train = stack_datasets([_data(0, (6, 9)), _data(1, (8, 4))])
    test = stack_datasets([_data(2, (3, 3)), _data(3, (2, 5))])
    keys = jax.random.split(jax.random.key(0), 2)
    cv = cv_datasets(train, test, 3, key=keys)
    assert cv.train.x.shape[0] == 2 * 4 and (cv.num_seeds, cv.num_folds) == (2, 3)
    for s in range(2):
        seed_train = jax.tree.map(lambda a, s=s: a[s], train)
        fit, val = ev.kfold_split(seed_train, 3, key=keys[s])
        for f in range(3):
            b = s * 4 + f
            np.testing.assert_array_equal(np.asarray(cv.train.x[b]), np.asarray(fit.x[f]))
            nv = np.asarray(val.counts[f])
            np.testing.assert_array_equal(np.asarray(cv.evals.counts[b]), nv)
            np.testing.assert_array_equal(
                np.asarray(cv.evals.x[b, :, : val.x.shape[2]]), np.asarray(val.x[f])
            )
        np.testing.assert_array_equal(np.asarray(cv.train.x[s * 4 + 3]), np.asarray(train.x[s]))
        np.testing.assert_array_equal(np.asarray(cv.evals.counts[s * 4 + 3]), test.counts[s])
    np.testing.assert_array_equal(np.asarray(cv.final(cv.train.counts)), train.counts)
    assert cv.per_member(jnp.arange(2)).tolist() == [0] * 4 + [1] * 4
    with pytest.raises(ValueError, match="exactly one"):
        cv_datasets(train, test, 3)
    with pytest.raises(ValueError, match="seed axis"):
        cv_datasets(_data(0, (6, 9)), _data(1, (3, 3)), 2, key=keys)


def test_method_points_cross_static_and_traced_grids():
    m = Method(lambda **_: None, {"t": np.array([1.0, 2.0])}, [{"k": 1}, {"k": 3}])
    assert m.points() == [
        {"k": 1, "t": 1.0},
        {"k": 1, "t": 2.0},
        {"k": 3, "t": 1.0},
        {"k": 3, "t": 2.0},
    ]
    assert m.labels()[-1] == "k=3, t=2" and m.tuned
    assert Method(lambda **_: None).labels() == [""]
    m = Method(lambda **_: None, **scalar_grid("mu", [0.5, 2.0], shown="mu/L"))
    assert m.labels() == ["mu/L=0.5", "mu/L=2"] and m.points()[1] == {"mu": np.float32(2.0)}
    m = Method(lambda **_: None, **choice_grid("k", (2, 5)))
    assert m.labels() == ["k=2", "k=5"] and [p["k"] for p in m.points()] == [0, 1]


def test_grid_plateau_against_hand_cases():
    """An end choice is on a plateau exactly when its score is within rtol of its
    neighbour's: interior choices, moving scores, non-finite neighbours and one-point
    grids are not."""
    # pFedMe-like: the score falls toward lambda -> 0 by a factor 10 less per decade
    limit = 3.4335
    score = limit * (1 + 7e-5 * np.logspace(-2, 2, 5))  # [G] at lambda = 1e-6 ... 1e-2
    rows = np.stack([score, score, score[::-1], np.r_[1.0, 2.0, 3.0, 4.0, 5.0], score])
    rows[4, 1] = np.inf
    got = ev.grid_plateau([0, 2, 4, 0, 0], rows)
    np.testing.assert_array_equal(got, [True, False, True, False, False])
    # exactly rtol apart: a plateau; just over it: not
    edge = np.array([[1.0, 1.0 + 1e-4, 2.0]])
    assert ev.grid_plateau([0], edge, rtol=1e-4).all()
    assert not ev.grid_plateau([0], edge, rtol=0.9e-4).any()
    assert not ev.grid_plateau([0], np.array([[1.0]])).any()
    with pytest.raises(ValueError, match="score"):
        ev.grid_plateau([0, 1], np.ones((3, 4)))
    with pytest.raises(ValueError, match="rtol"):
        ev.grid_plateau([0], np.ones((1, 4)), rtol=-1.0)
    with pytest.raises(ValueError, match="rtol"):  # also where no plateau can exist
        ev.grid_plateau([0], np.ones((1, 1)), rtol=float("nan"))


def test_cv_reports_a_plateau_instead_of_an_edge():
    """``_choose``: a one-axis grid's end choice whose score has stopped moving is a
    plateau, not an edge; a crossed grid is never a plateau; the labels say which."""
    from karula_jax.protocol import cv as cv_module  # noqa: PLC0415

    method = Method(lambda **_: None, **scalar_grid("lam", [1e-6, 1e-5, 1e-4, 1.0]))
    finite = np.ones((2, 2, 4), bool)  # [S, K, G]
    val = {
        "finite": finite,
        "s": np.stack([[[1.0, 1.0 + 1e-6, 1.1, 2.0]] * 2, [[2.0, 1.5, 1.2, 1.0]] * 2]),
    }
    chosen, _, edge, plateau = cv_module._choose(method, val, lambda v: v["s"], None, False, 2)
    np.testing.assert_array_equal(chosen, [0, 3])
    np.testing.assert_array_equal(edge, [False, True])
    np.testing.assert_array_equal(plateau, [True, False])
    fields = dict(metrics={}, grid_metrics={}, chosen=chosen, labels=method.labels())
    fields |= dict(cv_score=None, finite=np.ones(2, bool), edge=edge, seconds=0.0)
    fields |= dict(diagnostics="", curves={}, rounds=np.zeros(1), plateau=plateau)
    labels = cv_module.CVOutcome(**fields).chosen_labels
    assert labels == ["lam=1e-06 [plateau]", "lam=1 [edge]"]
    crossed = cross_choice(method, "rate", ["x1", "x3"], ordered=2)
    val8 = {"finite": np.ones((2, 2, 8), bool), "s": np.tile(np.arange(8.0)[::-1], (2, 2, 1))}
    val8["s"][..., 6:] = 0.0  # the last two points tie: a plateau only along the index
    _, _, edge, plateau = cv_module._choose(crossed, val8, lambda v: v["s"], None, False, 2)
    assert not plateau.any()


def test_grid_edges_are_flagged_unless_natural_limits():
    """A CV choice at an end of its grid is flagged, except where the method has nothing
    beyond that end (t = 0 or inf, one cluster); one-point grids have no edge."""
    np.testing.assert_array_equal(ev.grid_edge([0, 1, 2, 4], 5), [True, False, False, True])
    np.testing.assert_array_equal(ev.grid_edge([0, 4], 5, natural=[0]), [False, True])
    np.testing.assert_array_equal(ev.grid_edge([0, 4], 5, natural=[-1]), [True, False])
    assert not ev.grid_edge([0], 1).any()
    t = Method(lambda **_: None, **scalar_grid("t", [0.0, 1.0, np.inf]))
    assert t.natural_points() == [0, 2]
    t = Method(lambda **_: None, **scalar_grid("t", [2.0, 4.0, 8.0]))
    assert t.natural_points() == []
    k = Method(lambda **_: None, **choice_grid("k", (1, 2, 3)))
    assert k.natural_points() == [0]
    suite = build_methods(
        ("IFCA", "Clustered FedAvg on D"),
        loss=ridge_loss(0.1),
        rates=smoothness_rates(karula=1.0, fedavg=1.0, ifca=1.0, personal=1.0, num_clients=4),
        grids={"IFCA": (1, 2, 3), "Clustered FedAvg on D": (2, 3)},
        clients_per_round=2,
        batch_size=2,
        local_steps=1,
    )
    assert suite["IFCA"].natural_points() == [0]
    assert suite["Clustered FedAvg on D"].natural_points() == []
    assert Method(lambda **_: None).natural_points() == []


def test_cross_choice_crosses_every_point_with_every_choice_and_flags_both_axes():
    """A rate choice crossed with a grid (FEMNIST's joint rate CV): every point at every
    choice, the choice innermost; an edge on either axis is flagged, natural limits and
    the unordered choice (a method's own default) are not."""
    mu = Method(lambda **_: None, **scalar_grid("mu", [0.0, 0.1, 1.0]))
    crossed = cross_choice(mu, "rate", ["x1", "x10", "x100", "default"], ordered=3)
    points = crossed.points()
    assert len(points) == 12 and crossed.tuned
    assert [(round(float(p["mu"]), 6), int(p["rate"])) for p in points[:5]] == [
        (0.0, 0),
        (0.0, 1),
        (0.0, 2),
        (0.0, 3),
        (0.1, 0),
    ]
    assert crossed.labels()[5] == "mu=0.1 + x10"
    # mu = 0 is natural, mu = 1 an edge; x1 and x100 are edges, x10 and default are not
    expected = [m == 2 or r in (0, 2) for m in range(3) for r in range(4)]
    np.testing.assert_array_equal(crossed.edge(np.arange(12)), expected)
    plain = cross_choice(Method(lambda **_: None), "rate", ["a", "b", "c"])
    assert plain.labels() == ["a", "b", "c"] and [p["rate"] for p in plain.points()] == [0, 1, 2]
    np.testing.assert_array_equal(plain.edge(np.arange(3)), [True, False, True])
    # make sees the choice index and the base point
    seen = {}
    m = cross_choice(Method(lambda **kw: seen.update(kw), **scalar_grid("mu", [2.0])), "r", "ab")
    m.make(**m.points()[1])
    assert float(seen["mu"]) == 2.0 and int(seen["r"]) == 1


def test_cross_validate_matches_a_hand_made_selection():
    """Local ridge training at three learning rates: the CV pick equals the manual one."""
    S, K, rounds = 2, 2, 20
    train = stack_datasets([_data(s, (8, 6, 10)) for s in range(S)])
    test = stack_datasets([_data(10 + s, (4, 4, 4)) for s in range(S)])
    cv = cv_datasets(train, test, K, key=jax.random.split(jax.random.key(1), S))
    loss, linear = ridge_loss(0.01), lambda th, x: x @ th
    rates = np.array([0.0, 0.5, 3.0], np.float32)
    make = lambda lr: A.local(loss, learning_rate=lr, batch_size=10)
    metrics = lambda th, d: {"mse": ev.mean_squared_error(linear, th, d)}
    keys = jax.random.split(jax.random.key(2), S)
    tuned = functools.partial(
        cross_validate,
        Method(make, {"lr": rates}),
        jnp.zeros(2),
        cv,
        keys=keys,
        num_rounds=rounds,
        eval_fn=metrics,
        score=lambda m: m["mse"].mean(-1),
    )
    out = tuned()
    # by hand: every member at every rate, then the mean validation MSE over folds
    res = run_many(
        make,
        jnp.zeros(2),
        cv.train,
        keys=jnp.repeat(keys, K + 1),
        num_rounds=rounds,
        hyper={"lr": rates},
        data_per_seed=True,
        eval_fn=metrics,
        eval_data=cv.evals,
        eval_data_per_seed=True,
        progress=False,
    )
    mse = np.asarray(res.metrics["mse"][-1]).reshape(S, K + 1, 3, -1)
    want = mse[:, :K].mean(-1).mean(1).argmin(-1)
    # 20 rounds of full-batch local steps; lr = 3 diverges (its error grows with it, but
    # relative to its own huge MSE the bound holds: rounding of its sums grows alike)
    rtol = _mse_rtol(_rounds_rtol(rounds, batch=10), cv.evals, mse[np.isfinite(mse)])
    np.testing.assert_array_equal(out.chosen, want)
    assert out.cv_score.shape == (S, 3) and out.chosen_labels[0].startswith("lr=")
    # lr = 0 is a natural limit (every value 0); lr = 3 is the open upper edge. lr = 3
    # also diverges (the gradient step's factor |1 - 3 L| > 1: its training loss ends at
    # 4e12, finite) on every member, so a choice beside it is on the edge of the stable
    # region. By hand: a point diverged where the mean loss of the last two rounds (a
    # tenth of 20) is over ten times the first two's on some member.
    round_loss = np.asarray(res.info.loss).reshape(rounds, S, K + 1, 3)
    grew = (round_loss[-2:].mean(0) > 10 * round_loss[:2].mean(0)).any(axis=1)  # [S, 3]
    assert grew[:, 2].all() and not grew[:, :2].any()
    beside = grew[np.arange(S), np.minimum(want + 1, 2)] & (want < 2)
    np.testing.assert_array_equal(out.edge, (want == 2) | beside)
    assert [lab.endswith(" [edge]") for lab in out.chosen_labels] == list((want == 2) | beside)
    np.testing.assert_allclose(out.metrics["mse"], mse[np.arange(S), K, want], rtol=rtol)
    assert out.grid_metrics["mse"].shape == (S, 3, 3) and out.finite.all()
    # the folds alone (a tuning draw): the same choice; metrics are the fold means
    folds_only = tuned(final_fits=False, progress=False)
    np.testing.assert_array_equal(folds_only.chosen, want)
    np.testing.assert_allclose(folds_only.cv_score, out.cv_score, rtol=rtol)
    np.testing.assert_allclose(folds_only.grid_metrics["mse"], mse[:, :K].mean(1), rtol=rtol)
    assert folds_only.curves == {} and folds_only.params is None
    # no grid: final fits only, one grid point
    fixed = cross_validate(
        Method(lambda: make(0.5)), jnp.zeros(2), cv, keys=keys, num_rounds=rounds, eval_fn=metrics
    )
    np.testing.assert_allclose(fixed.metrics["mse"], mse[:, K, 1], rtol=rtol)
    assert fixed.cv_score is None and fixed.labels == [""]
    with pytest.raises(ValueError, match="score"):
        cross_validate(
            Method(make, {"lr": rates}), jnp.zeros(2), cv, keys=keys, num_rounds=1, eval_fn=metrics
        )
    with pytest.raises(ValueError, match="final_fits=False"):
        cross_validate(
            Method(lambda: make(0.5)),
            jnp.zeros(2),
            cv,
            keys=keys,
            num_rounds=1,
            eval_fn=metrics,
            final_fits=False,
        )


def _two_rounds(algorithm, data, params):
    state = algorithm.init(params, data, key=jax.random.key(3))
    for _ in range(2):
        state, _ = algorithm.round(state, data)
    return np.asarray(algorithm.client_params(state, data))


def test_registry_builds_each_algorithm_with_its_rates_and_grid():
    data, loss = _data(0, (6, 9, 4, 7)), ridge_loss(0.1)
    D = np.abs(np.subtract.outer(np.arange(4.0), np.arange(4.0)))
    member = {"D": D, "labels": np.array([[0, 0, 1, 1], [0, 1, 2, 2]]), "L": 2.0}
    names = ("local", "fedsgd", "fedavg", "ifca", "karula", "ditto_personal", "penalty")
    rates = {k: (lambda L, i=i, **_: 0.05 * (i + 1) / L) for i, k in enumerate(names)}
    rates |= {"pfedme": lambda lam, **_: 0.1 / lam, "pfedme_personal": lambda L, **_: 0.2 / L}
    rates["penalty_mu"] = lambda L, mu, **_: mu * L
    rates["fedprox"] = lambda L, mu, **_: 0.7 / (L + mu)  # its own rule: mu's curvature
    grids = {"IFCA": (1, 2), "pFedMe": 15.0, "Karula": (0.5, 2.0), "FedProx": (0.1,)}
    grids |= {"Ditto": (1.0,), "Laplacian penalty on D": (3.0,), "Clustered FedAvg on D": (2, 3)}
    local = dict(clients_per_round=3, batch_size=9, local_steps=2)
    suite = build_methods(SUITE, loss=loss, rates=rates, grids=grids, **local)
    assert list(suite) == list(SUITE) == list(REGISTRY)[: len(SUITE)]
    common = dict(clients_per_round=3, batch_size=9)
    local = dict(common, local_steps=2)
    r = {k: f(**member) for k, f in rates.items() if k not in ("pfedme", "penalty_mu", "fedprox")}
    want = {
        "Local": A.local(loss, learning_rate=r["local"], **common),
        "FedSGD": A.fedsgd(loss, learning_rate=r["fedsgd"], **common),
        "FedAvg": A.fedavg(loss, learning_rate=r["fedavg"], **local),
        "IFCA": A.ifca(loss, num_clusters=2, learning_rate=r["ifca"], **local),
        "pFedMe": A.pfedme(
            loss,
            learning_rate=0.1 / 15.0,
            lam=15.0,
            personal_learning_rate=r["pfedme_personal"],
            inner_steps=5,
            **local,
        ),
        "Karula": A.karula(loss, D, t=2.0, learning_rate=r["karula"], **common),
        "FedProx": A.fedprox(loss, mu=0.1, learning_rate=0.7 / (2.0 + 0.1), **local),
        "SCAFFOLD": A.scaffold(loss, learning_rate=r["fedavg"], **local),
        "Ditto": A.ditto(
            loss,
            lam=1.0,
            learning_rate=r["fedavg"],
            personal_learning_rate=r["ditto_personal"],
            **local,
        ),
        "Laplacian penalty on D": A.laplacian_penalty(
            loss, D, mu=6.0, learning_rate=r["penalty"], **common
        ),
        "Clustered FedAvg on D": A.clustered_fedavg(
            loss, member["labels"][1], learning_rate=r["fedavg"], **local
        ),
    }
    params = jnp.zeros(2)
    # two rounds of 2 local steps on 9 rows, 3 clients, in two programs (pFedMe: 5 inner
    # steps each)
    rtol = _rounds_rtol(2, batch=9, local_steps=2 * 5)
    for name, method in suite.items():
        point = method.points()[-1]
        got = _two_rounds(method.make(**member, **point), data, params)
        ref = _two_rounds(want[name], data, params)
        np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol * np.abs(ref).max())
    # IFCA's k runs traced below the grid's largest value (one program for the grid); the
    # point k = 2 above equals the static k = 2, and k = 1 below the bound the static k = 1.
    got = _two_rounds(suite["IFCA"].make(**member, **suite["IFCA"].points()[0]), data, params)
    one = A.ifca(loss, num_clusters=1, learning_rate=r["ifca"], **local)
    ref = _two_rounds(one, data, params)
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol * np.abs(ref).max())
    assert suite["IFCA"].static_grid is None and suite["IFCA"].labels() == ["k=1", "k=2"]
    np.testing.assert_array_equal(suite["IFCA"].grid["num_clusters"], [1.0, 2.0])
    assert suite["pFedMe"].labels() == [""]  # a single value is fixed, not a grid
    assert suite["Karula"].labels() == ["t=0.5", "t=2"]
    assert suite["Laplacian penalty on D"].labels() == ["mu/L_f=3"]
    assert suite["Clustered FedAvg on D"].labels() == ["k=2", "k=3"]
    only = build_methods(("Karula",), loss=loss, rates=rates, grids={"Karula": 1.0}, **local)
    assert list(only) == ["Karula"] and not only["Karula"].tuned
    # a row's default grid when the study gives none
    assert build_methods(("Karula",), loss=loss, rates=rates, **local)["Karula"].labels() == [
        f"t={t:.3g}" for t in REGISTRY["Karula"].grid
    ]
    with pytest.raises(ValueError, match=r"unknown method\(s\) \['Nope'\]"):
        build_methods(("Nope",), loss=loss, rates=rates, **local)
    with pytest.raises(ValueError, match=r"unknown method\(s\) \['Karul'\]"):
        build_methods(("Karula",), loss=loss, rates=rates, grids={"Karul": (1.0,)}, **local)
    bare = MethodRow("Bare", _damped_local, hyper="damping", rates={"learning_rate": "local"})
    with pytest.raises(ValueError, match="Bare: no grid or value of damping"):
        build_methods(("Bare",), loss=loss, rates=rates, registry={"Bare": bare})
    with pytest.raises(ValueError, match=r"Ditto needs the rate rule\(s\) \['ditto_personal'\]"):
        build_methods(("Ditto",), loss=loss, rates={"fedavg": rates["fedavg"]}, **local)


def test_fedprox_rule_adds_mu_to_the_smoothness():
    # FedProx's local objective f_i + mu/2 ||w - w0||^2 is (L_i + mu)-smooth
    rates = smoothness_rates(karula=0.5, fedavg=0.1, ifca=0.5, personal=0.5, num_clients=3)
    # Python floats: the same quotient, a rounding apart at most
    assert rates["fedprox"](L_max=2.0, mu=3.0, L_f=1.0) == pytest.approx(0.1 / 5.0, rel=EPS64)
    fedavg = rates["fedavg"](L_max=2.0)
    assert rates["fedprox"](L_max=2.0, mu=0.0) == pytest.approx(fedavg, rel=EPS64)
    assert REGISTRY["FedProx"].rates == {"learning_rate": "fedprox"}


def test_variant_rows_fedper_and_karula_at_the_theorem_step():
    """FedPer is FedAvg on the study's mask (and refuses to run without one, where it would
    be FedAvg); "Karula (theorem step)" is Karula at ``learning_rate="theorem"``."""
    data = _data(1, (5, 8, 6))
    params = {"shared": jnp.zeros(2), "head": jnp.zeros(2)}

    def loss(p, x, y, mask):
        err = (x @ (p["shared"] + p["head"]) - y) ** 2
        return jnp.sum(jnp.where(mask, err, 0.0)) / jnp.maximum(jnp.sum(mask), 1)

    mask = {"shared": False, "head": True}
    local = dict(clients_per_round=2, batch_size=8, local_steps=2)
    rates = {"fedavg": lambda **_: 0.05}
    options = {"FedPer": {"personalized": mask}}
    fedper = build_methods(("FedPer",), loss=loss, rates=rates, options=options, **local)
    got = fedper["FedPer"].make()
    want = A.fedavg(loss, learning_rate=0.05, personalized=mask, **local)
    st_got = got.init(params, data, key=jax.random.key(3))
    st_want = want.init(params, data, key=jax.random.key(3))
    for _ in range(2):
        st_got, _ = got.round(st_got, data)
        st_want, _ = want.round(st_want, data)
    rtol = _rounds_rtol(2, batch=8, local_steps=2, clients=2)  # two programs, 2 rounds
    for a, b in zip(jax.tree.leaves(st_got.params), jax.tree.leaves(st_want.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max())
    assert np.ptp(np.asarray(st_got.params["head"]), axis=0).max() > 0  # heads stay apart
    # without a mask FedPer is refused when built, before anything runs
    with pytest.raises(ValueError, match=r"\['FedPer'\] need `personalized`"):
        build_methods(("FedPer",), loss=loss, rates=rates, **local)

    D = np.abs(np.subtract.outer(np.arange(3.0), np.arange(3.0)))
    common, ridge, key = dict(clients_per_round=2, batch_size=8), ridge_loss(0.1), jax.random.key(4)
    name = "Karula (theorem step)"
    row = build_methods((name,), loss=ridge, rates={}, grids={name: 1.0}, **common)[name]
    rate = row.make(D=D).init(jnp.zeros(2), data, key=key).extra.learning_rate
    ref = A.karula(ridge, D, t=1.0, learning_rate="theorem", **common)
    # 3 / (8 max_i alpha_i L_i), float32 L_i (Gram sums of 8 rows, d = 2): two evaluations
    want = ref.init(jnp.zeros(2), data, key=key).extra.learning_rate
    np.testing.assert_allclose(rate, want, rtol=reordered_sum(8 * 2 + 2 + 4))
    default = A.karula(ridge, D, t=1.0, **common).init(jnp.zeros(2), data, key=key)
    assert float(rate) < float(default.extra.learning_rate)


def _damped_local(loss, *, damping, learning_rate, clients_per_round, batch_size):
    """A toy method: :func:`~karula_jax.algorithms.local` at ``damping`` times its step."""
    return A.local(
        loss,
        learning_rate=damping * learning_rate,
        clients_per_round=clients_per_round,
        batch_size=batch_size,
    )


def test_a_new_method_is_one_registry_row():
    """One ``register`` call, and the toy method runs through ``compare`` beside a built-in
    one; its outcome is that of the same method written by hand."""
    row = MethodRow(
        "Damped local",
        _damped_local,
        hyper="damping",
        grid=(0.5, 1.0),
        rates={"learning_rate": "local"},
        settings=("clients_per_round", "batch_size"),
    )
    S, K = 2, 2
    train = stack_datasets([_data(s, (8, 6, 10)) for s in range(S)])
    test = stack_datasets([_data(10 + s, (4, 4, 4)) for s in range(S)])
    cv = cv_datasets(train, test, K, key=jax.random.split(jax.random.key(1), S))
    L_f, L_max = smoothness_constants(cv.train, 0.01)
    loss, linear = ridge_loss(0.01), lambda th, x: x @ th
    kw = dict(keys=jax.random.split(jax.random.key(2), S), num_rounds=5)
    kw |= dict(eval_fn=lambda th, d: {"mse": ev.mean_squared_error(linear, th, d)})
    kw |= dict(score=lambda m: m["mse"].mean(-1), member_kwargs=dict(L_f=L_f, L_max=L_max))
    rates = smoothness_rates(karula=0.5, fedavg=0.1, ifca=0.5, personal=0.5, num_clients=3)
    register(row)
    try:
        methods = build_methods(
            ["Damped local", "FedAvg"],
            loss=loss,
            rates=rates,
            clients_per_round=2,
            batch_size=10,
            local_steps=2,
        )
        with pytest.raises(ValueError, match="replace=True"):
            register(row)
    finally:
        REGISTRY.pop(row.name)
    out = compare(methods, jnp.zeros(2), cv, log=lambda line: None, **kw)
    assert list(out) == ["Damped local", "FedAvg"]
    assert out["Damped local"].labels == ["damping=0.5", "damping=1"]
    by_hand = Method(
        lambda L_f, damping, **_: A.local(
            loss, learning_rate=damping * 0.5 / L_f, clients_per_round=2, batch_size=10
        ),
        **scalar_grid("damping", (0.5, 1.0)),
    )
    want = cross_validate(by_hand, jnp.zeros(2), cv, **kw)
    np.testing.assert_array_equal(out["Damped local"].chosen, want.chosen)
    # 5 rounds of local steps on 10 rows in two programs
    rtol = _mse_rtol(_rounds_rtol(5, batch=10), cv.evals, want.metrics["mse"])
    np.testing.assert_allclose(out["Damped local"].metrics["mse"], want.metrics["mse"], rtol=rtol)


@pytest.mark.parametrize("in_turn", [True, False], ids=["in_turn", "vmapped"])
def test_member_dissimilarities_match_one_call_per_member(in_turn, monkeypatch):
    # members in turn (the CPU's rule) or vmapped (an accelerator's, forced here): each
    # member's D and iterations are those of its own call; one key, typed or raw, is
    # every member's key
    monkeypatch.setattr(_platform, "members_in_turn", lambda: in_turn)
    train = stack_datasets([_data(s, (6, 9, 4)) for s in range(3)])
    keys = jax.random.split(jax.random.key(0), 3)
    opts = dict(num_reference=8, epsilon=0.5)
    D, info = member_dissimilarities(train, keys, **opts)
    shared, _ = member_dissimilarities(train, keys[0], **opts)
    raw, _ = member_dissimilarities(train, jax.random.key_data(keys[0]), **opts)
    assert D.shape == (3, 3, 3) and info.converged.shape == (3, 3)
    np.testing.assert_array_equal(np.asarray(raw), np.asarray(shared))
    for b in range(3):
        member = jax.tree.map(lambda a, b=b: a[b], train)
        # each Sinkhorn solve stops once its marginal L1 error is below the threshold, and
        # another program's order stops at another iterate: the barycentric maps, and the
        # mean distances between them that make D, differ by up to that threshold of D
        want, want_info = dissimilarities(member, key=keys[b], **opts)
        atol = DEFAULT_THRESHOLD * np.abs(np.asarray(want)).max()
        np.testing.assert_allclose(np.asarray(D[b]), np.asarray(want), rtol=0, atol=atol)
        # a stop one threshold check later or earlier in each of the two Sinkhorn phases
        # (accelerated, then plain): a block of inner_iterations (10, the default) each
        diff = np.abs(np.asarray(info.iterations[b]) - np.asarray(want_info.iterations))
        assert diff.max() <= 2 * 10, diff
        want = np.asarray(dissimilarities(member, key=keys[0], **opts)[0])
        atol = DEFAULT_THRESHOLD * np.abs(want).max()
        np.testing.assert_allclose(np.asarray(shared[b]), want, rtol=0, atol=atol)


@pytest.mark.parametrize("logistic", [False, True])
def test_smoothness_constants_match_the_hessian_bound(logistic):
    rng = np.random.default_rng(0)
    sizes = [(10, 30, 1), (5, 7, 12)]
    members, L_want = [], []
    for seed_sizes in sizes:
        xs = [rng.normal(size=(m, 3)) for m in seed_sizes]
        ys = [rng.integers(0, 2, size=m) for m in seed_sizes]
        members.append(from_client_arrays(xs, ys, num_classes=2))
        # ridge: X^T X / N + lam; logistic with a bias: sigma' <= 1/4 on [X, 1]
        feats = [np.concatenate([x, np.ones((len(x), 1))], 1) if logistic else x for x in xs]
        L = [np.linalg.eigvalsh(f.T @ f / len(f)).max() * (0.25 if logistic else 1) for f in feats]
        L = np.array(L) + 0.1
        alpha = np.array(seed_sizes) * 3 / sum(seed_sizes)
        L_want.append((np.max(alpha * L) / 3, L.max()))
    L_f, L_max = smoothness_constants(stack_datasets(members), 0.1, logistic=logistic)
    # float64 on the data's float32 rounding (EPS32 / 2 of each entry): the Gram matrix
    # moves by EPS32 of |Z|^T |Z| / N, at most d + 1 times lambda_max (Cauchy-Schwarz)
    rtol = EPS32 * (3 + 1) + reordered_sum(30 * 4, eps=EPS64)
    np.testing.assert_allclose(np.stack([L_f, L_max], 1), L_want, rtol=rtol)


def test_compare_runs_cross_validate_per_method_and_logs_each():
    S, K = 2, 2
    train = stack_datasets([_data(s, (8, 6, 10)) for s in range(S)])
    test = stack_datasets([_data(10 + s, (4, 4, 4)) for s in range(S)])
    cv = cv_datasets(train, test, K, key=jax.random.split(jax.random.key(1), S))
    loss, linear = ridge_loss(0.01), lambda th, x: x @ th
    make = lambda lr: A.local(loss, learning_rate=lr, batch_size=10)
    methods = {"grid": Method(make, {"lr": np.array([0.1, 0.5], np.float32)})}
    methods["fixed"] = Method(lambda: make(0.3))
    kw = dict(keys=jax.random.split(jax.random.key(2), S), num_rounds=5)
    kw |= dict(eval_fn=lambda th, d: {"mse": ev.mean_squared_error(linear, th, d)})
    kw |= dict(score=lambda m: m["mse"].mean(-1))
    lines = []
    out = compare(methods, jnp.zeros(2), cv, describe=lambda o: "x", log=lines.append, **kw)
    # 5 rounds: a method whose loss is still falling gets a line naming it
    flat = [line for line in lines if "raise num_rounds" in line]
    lines = [line for line in lines if line not in flat]
    assert [line.split(":")[0].strip() for line in flat] == [
        name for name, o in out.items() if not o.flattened.all()
    ]
    # a two-point grid has only edges: the log says so after the method's line
    assert list(out) == ["grid", "fixed"] and len(lines) == 3
    assert "chosen" in lines[0] and "[edge]" in lines[0]
    assert "grid: CV chose an edge of its grid in 2 of 2 seeds" in lines[1]
    assert "chosen" not in lines[2] and lines[2].endswith("x")
    for name, m in methods.items():
        want = cross_validate(m, jnp.zeros(2), cv, **kw)
        np.testing.assert_array_equal(out[name].chosen, want.chosen)
        # 5 rounds of local steps on 10 rows in two programs
        rtol = _mse_rtol(_rounds_rtol(5, batch=10), cv.evals, want.metrics["mse"])
        np.testing.assert_allclose(out[name].metrics["mse"], want.metrics["mse"], rtol=rtol)


def test_compare_shows_each_methods_progress_and_warns_once_per_capped_method(capsys):
    """Every run draws a bar of rounds; a projection stopped at its cap in every round of
    two static grid points gives one warning for the method, after its bars and before
    its log line (not one per round or per run).

    The capped projection is simulated (local training whose rounds report an unconverged
    projection): a real one would spend the test's time compiling Karula."""
    S, K, R = 2, 2, 12
    train = stack_datasets([_data(s, (8, 6, 10)) for s in range(S)])
    test = stack_datasets([_data(10 + s, (4, 4, 4)) for s in range(S)])
    cv = cv_datasets(train, test, K, key=jax.random.split(jax.random.key(1), S))
    loss, linear = ridge_loss(0.01), lambda th, x: x @ th

    def capped(lr, max_iter):
        alg = A.local(loss, learning_rate=lr, batch_size=10)

        def round_(state, data):
            state, info = alg.round(state, data)
            gap = jnp.float32(1e-3 / max_iter)
            return state, info._replace(proj_converged=jnp.asarray(False), proj_delta=gap)

        return alg._replace(round=round_)

    lr = {"lr": np.array([0.1, 0.5], np.float32)}
    methods = {"capped": Method(capped, lr, static_grid=[{"max_iter": 1}, {"max_iter": 2}])}
    log = lambda line: sys.stderr.write(f"LOG {line}\n")
    kw = dict(keys=jax.random.split(jax.random.key(2), S), num_rounds=R, log=log)
    kw |= dict(eval_fn=lambda th, d: {"mse": ev.mean_squared_error(linear, th, d)})
    kw |= dict(score=lambda m: m["mse"].mean(-1))

    def show(message, category, *args, **kwargs):
        sys.stderr.write(f"\nWARNING {category.__name__}: {message}\n")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        out = compare(methods, jnp.zeros(2), cv, **kw)
    err = capsys.readouterr().err
    found = [line for line in err.splitlines() if line.startswith("WARNING")]
    assert len(found) == 1, found
    assert found[0].startswith("WARNING ProjectionNotConvergedWarning: [1/1] capped: ")
    assert "max_iter=1: projection: worst certified gap 0.001" in found[0]
    assert "max_iter=2: projection: worst certified gap 0.0005" in found[0]
    assert f"{R} of {R} rounds unconverged" in found[0]
    assert "unconverged" in out["capped"].diagnostics
    # every run's bar, to the last round, labelled by its method; then the warning
    bars = ["[1/1] capped max_iter=1: 6x2 runs", "[1/1] capped max_iter=2: 6x2 runs"]
    for bar in bars:
        # tqdm sizes the bar to the terminal's width: any number of blocks
        assert re.search(rf"{re.escape(bar)}: 100%\|█+\| {R}/{R}", err), bar
    assert err.rindex(bars[1]) < err.index(found[0]) < err.index("LOG capped")


def test_cluster_labels_stack_each_members_clusters():
    D = np.abs(np.subtract.outer([0.0, 0.1, 5.0, 5.2], [0.0, 0.1, 5.0, 5.2]))
    labels = cluster_labels(np.stack([D, D[::-1, ::-1]]), (1, 2))
    assert labels.shape == (2, 2, 4) and labels.dtype == np.int32
    np.testing.assert_array_equal(labels[:, 0], 0)
    for b in range(2):
        want = A.cluster_clients(np.stack([D, D[::-1, ::-1]])[b], 2)
        np.testing.assert_array_equal(labels[b, 1], want)
    assert labels[0, 1, 0] == labels[0, 1, 1] != labels[0, 1, 2] == labels[0, 1, 3]


@pytest.mark.parametrize("estimate", [False, True])
def test_default_rates_from_the_clients_hessians(estimate):
    """FedAvg's 1 / max L_i and Local's n / max alpha_i L_i against numpy eigenvalues of the
    ridge Hessians (exact constants, or power iteration times 2 when the loss has none);
    Karula's equals what ``karula(learning_rate=None)`` picks at init at ``t = inf``."""
    sizes = [9, 30, 4, 17, 12]
    data = _data(3, sizes, dim=3)
    loss = ridge_loss(0.1)
    if estimate:  # hide the closed form: the power iteration (times 2) is used
        loss = lambda p, x, y, m, f=loss: f(p, x, y, m)  # noqa: E731
    params, key = jnp.zeros(3), jax.random.key(0)
    rates = default_rates(loss, params, data, 2, key=key)
    xs = [np.asarray(data.x[i, :m], np.float64) for i, m in enumerate(sizes)]
    hessians = np.stack([x.T @ x / len(x) + 0.1 * np.eye(3) for x in xs])
    L = np.linalg.eigvalsh(hessians)[:, -1]
    L = 2 * L if estimate else L
    alpha = np.array(sizes) * len(sizes) / sum(sizes)
    # float32 L_i: the Gram sums of N_max rows of d terms move A_i by N_max d EPS32 / 2 of
    # |A_i| (Cauchy-Schwarz), eigvalsh by d EPS32 / 2 more; with the estimate, 20 power
    # steps also fall short (from default_rates' starts, and init's) and round each product
    rounding = reordered_sum(max(sizes) * 3 + 3 + 2)
    short = lambda k: power_shortfall(hessians, k).max() if estimate else 0.0  # noqa: E731
    if estimate:
        rounding += reordered_sum(max(sizes) + 3 + 4, rounds=20)
    rtol = short(key) + rounding
    np.testing.assert_allclose(rates["fedavg"], 1 / L.max(), rtol=rtol)
    np.testing.assert_allclose(rates["local"], len(sizes) / np.max(alpha * L), rtol=rtol)
    D = np.ones((5, 5)) - np.eye(5)
    alg = A.karula(loss, D, t=jnp.inf, clients_per_round=2, batch_size=64)  # no coupling
    eta = alg.init(params, data, key=key).extra.learning_rate
    # the estimate's random start differs from init's (fold_in(key_init, 1)); the rule's
    # float32 arithmetic (about 12 roundings) in two programs
    init_key = jax.random.fold_in(init_and_run_keys(key)[0], 1)
    rtol = short(key) + short(init_key) + 2 * rounding + reordered_sum(12)
    np.testing.assert_allclose(rates["karula"], float(eta), rtol=rtol)
    # per member: two members, the second with other data, each its own rates
    other = _data(4, sizes, dim=3)
    both = stack_datasets([data, other])
    stacked = member_default_rates(loss, jnp.zeros((2, 3)), both, 2, jax.random.split(key))
    second = default_rates(loss, params, other, 2, key=jax.random.split(key)[1])
    # the same key and start, the float32 L_i and the rule in two programs
    rtol = 2 * rounding + reordered_sum(12)
    for name in ("karula", "local", "fedavg"):
        np.testing.assert_allclose(stacked[name][1], second[name], rtol=rtol)


def test_a_number_of_groups_from_the_number_of_clients_on_is_a_natural_limit():
    """Rows with ``groups`` (IFCA, the clustered FedAvg): with ``num_clients`` given, a
    choice of k >= n is a natural limit like k = 1, a grid's end below n an edge; without
    it only k = 1 is; a row without ``groups`` is untouched; a bad count is refused."""
    loss = ridge_loss(1e-3)
    rates = {k: (lambda L=1.0, **_: 0.1 / L) for k in ("ifca", "fedavg", "fedprox")}
    local = dict(clients_per_round=2, batch_size=8, local_steps=2)
    grids = {"IFCA": (1, 2, 4, 6), "Clustered FedAvg on D": (1, 2, 3), "FedProx": (0.1, 1.0)}
    names = ("IFCA", "Clustered FedAvg on D", "FedProx")
    told = build_methods(names, loss=loss, rates=rates, grids=grids, num_clients=4, **local)
    blind = build_methods(names, loss=loss, rates=rates, grids=grids, **local)
    assert told["IFCA"].natural_points() == [0, 2, 3]
    assert blind["IFCA"].natural_points() == [0]
    assert list(told["IFCA"].edge(np.array([3, 1]))) == [False, False]
    assert list(blind["IFCA"].edge(np.array([3, 1]))) == [True, False]
    assert list(told["Clustered FedAvg on D"].edge(np.array([0, 2]))) == [False, True]
    assert list(told["FedProx"].edge(np.array([0, 1]))) == [True, True]
    with pytest.raises(ValueError, match="num_clients"):
        build_methods(names, loss=loss, rates=rates, grids=grids, num_clients=0, **local)


def test_build_methods_reads_array_grids_and_refuses_what_it_would_drop():
    """A 1-D numpy or JAX array or a range is a grid like a tuple (it was read as one fixed
    value, and the run failed later on a non-scalar t); an empty grid, a misspelt setting
    (silently dropped before), a string or repeated names are refused naming them."""
    loss = ridge_loss(1e-3)
    rates = {k: (lambda L=1.0, **_: 0.1 / L) for k in ("karula", "fedavg", "fedprox")}
    local = dict(clients_per_round=2, batch_size=8, local_steps=2)
    for grid in (np.array([0.5, 2.0]), jnp.array([0.5, 2.0]), (0.5, 2.0)):
        m = build_methods(("Karula",), loss=loss, rates=rates, grids={"Karula": grid}, **local)
        assert m["Karula"].labels() == ["t=0.5", "t=2"]
    m = build_methods(("FedProx",), loss=loss, rates=rates, grids={"FedProx": range(1, 3)}, **local)
    assert m["FedProx"].labels() == ["mu=1", "mu=2"]
    fixed = build_methods(("Karula",), loss=loss, rates=rates, grids={"Karula": np.float32(2)})
    assert not fixed["Karula"].tuned
    with pytest.raises(ValueError, match="grid of t is empty"):
        build_methods(("Karula",), loss=loss, rates=rates, grids={"Karula": ()}, **local)
    with pytest.raises(ValueError, match="must be 1-D"):
        build_methods(("Karula",), loss=loss, rates=rates, grids={"Karula": np.ones((2, 2))})
    with pytest.raises(TypeError, match=r"unknown setting\(s\) \['local_step'\]"):
        build_methods(("FedAvg",), loss=loss, rates=rates, clients_per_round=2, local_step=1)
    with pytest.raises(TypeError, match="the string 'FedAvg'"):
        build_methods("FedAvg", loss=loss, rates=rates)
    with pytest.raises(ValueError, match=r"\['FedAvg'\] more than once"):
        build_methods(("FedAvg", "Karula", "FedAvg"), loss=loss, rates=rates)


def test_register_checks_the_row_when_it_is_registered():
    with pytest.raises(TypeError, match="row must be a MethodRow, got tuple"):
        register(("Mine", A.fedavg))
    with pytest.raises(ValueError, match="kind must be one of"):
        register(MethodRow("Mine, bad kind", A.fedavg, kind="static-ish"))
    with pytest.raises(TypeError, match="row.name must be a string"):
        register(MethodRow(3, A.fedavg))
    assert "Mine, bad kind" not in REGISTRY and 3 not in REGISTRY


def test_cross_validate_names_a_bad_score_and_a_grid_without_folds():
    """A score that forgets to average over clients (or returns a scalar) is named with
    the shape it must return, not as another argument's error; a grid on data without
    folds (``num_folds=0``) is refused before any training."""
    S, K = 2, 2
    train = stack_datasets([_data(s, (8, 6, 10)) for s in range(S)])
    test = stack_datasets([_data(10 + s, (4, 4, 4)) for s in range(S)])
    keys = jax.random.split(jax.random.key(2), S)
    loss, linear = ridge_loss(0.01), lambda th, x: x @ th
    method = Method(lambda lr: A.local(loss, learning_rate=lr, batch_size=10), {"lr": [0.1, 0.5]})
    kw = dict(keys=keys, num_rounds=2, progress=False)
    kw["eval_fn"] = lambda th, d: {"mse": ev.mean_squared_error(linear, th, d)}
    cv = cv_datasets(train, test, K, key=jax.random.split(jax.random.key(1), S))
    for bad in (lambda m: m["mse"], lambda m: m["mse"].mean()):
        with pytest.raises(ValueError, match=r"score must map .* \[S, K, G\] = \(2, 2, 2\)"):
            cross_validate(method, jnp.zeros(2), cv, score=bad, **kw)
    no_folds = cv_datasets(train, test, 0)
    with pytest.raises(ValueError, match="needs folds to choose on"):
        cross_validate(method, jnp.zeros(2), no_folds, score=lambda m: m["mse"].mean(-1), **kw)
