"""The study driver (karula_jax.protocol.study): a new data set is a config and a draw
function; the driver's steps keep their contracts."""

import csv
import dataclasses
import json

import jax
import numpy as np
import pytest
from _tolerances import EPS64, reordered_sum

from karula_jax import protocol
from karula_jax.data import from_client_arrays
from karula_jax.embedding import DEFAULT_THRESHOLD


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    """A toy study: three clients with their own logistic models."""

    seeds: int = 2
    num_folds: int = 2
    rounds: int = 10
    lam: float = 1e-3
    clients_per_round: int = 2
    methods: tuple[str, ...] = ("Local",)  # and Karula, the reference
    t_grid: tuple[float, ...] = (0.0, float("inf"))


def draw(seed: int) -> protocol.Draw:
    """Client i's labels follow its own direction w_i; 12 to 20 training rows, 8 test rows."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(3, 4))
    sets = []
    for rows in (rng.integers(12, 21, size=3), [8] * 3):
        xs = [rng.normal(size=(int(m), 4)) for m in rows]
        ys = [(x @ wi > 0).astype(np.int32) for x, wi in zip(xs, w, strict=True)]
        sets.append(from_client_arrays(xs, ys, num_classes=2))
    return protocol.Draw(*sets, extras=f"seed {seed}")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The toy study run end to end by the driver: ``(output folder, result, log lines)``."""
    out, lines = tmp_path_factory.mktemp("toy"), []
    study = toy_study(ToyConfig(), client_names=("a", "b", "c"), cluster_grid=(1, 2))
    return out, protocol.run_study(study, out, log=lines.append), lines


def toy_study(cfg: ToyConfig, **fields) -> protocol.Study:
    """The toy study of ``cfg`` (:func:`karula_jax.protocol.logistic_study`), titled "Toy"."""
    return protocol.logistic_study(
        draw,
        cfg,
        title="Toy",
        seeds=cfg.seeds,
        num_folds=cfg.num_folds,
        num_rounds=cfg.rounds,
        lam=cfg.lam,
        methods=cfg.methods,
        clients_per_round=cfg.clients_per_round,
        grids={"Karula": cfg.t_grid},
        embed={"num_reference": 8, "epsilon": 0.5},
        **fields,
    )


def test_a_new_data_set_is_a_config_and_a_draw_function(toy):
    out, result, lines = toy
    with open(out / "table.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["method"] for r in rows] == ["Local", "Karula"]
    for r in rows:
        assert 0 <= float(r["test_acc"]) <= 1 and np.isfinite(float(r["test_logloss"]))
        assert {"acc_a", "acc_b", "acc_c", "cv_choice", "runtime_s"} <= set(r)
    assert rows[1]["cv_choice"] in ("t=0 x2", "t=inf x2", "t=0 x1, t=inf x1")
    assert float(rows[1]["karula_minus"]) == 0.0 and rows[1]["karula_minus_decided"] == "-"
    md = (out / "table.md").read_text()
    assert md.startswith("# Toy") and "| Karula |" in md and "mean per-client test acc." in md
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"] == json.loads(json.dumps(dataclasses.asdict(ToyConfig())))
    assert len(summary["chosen"]["Karula"]) == 2 and np.shape(summary["cv_score"]["Karula"]) == (
        2,
        2,
    )
    assert summary["rows"] == result.rows and all(r["finite"] for r in result.rows)
    assert result.data.extras == ("seed 0", "seed 1")
    assert "CV grids: Karula: t=0, t=inf" in lines
    # A method that projects reports its projection (here exact: t = 0 merges, t = inf
    # never binds), one that does not, nothing.
    assert "worst certified gap" in result.outcomes["Karula"].diagnostics
    assert result.outcomes["Local"].diagnostics == ""
    assert "Karula's projection: worst certified gap" in md


def test_draw_study_lays_out_members_and_their_dissimilarities(toy):
    data, B, n = toy[1].data, 2 * 3, 3
    assert data.cv.train.x.shape[:2] == (B, n) and np.shape(data.D) == (B, n, n)
    assert data.labels.shape == (B, 2, n) and data.converged.shape == (B, n)
    assert set(data.member_kwargs(L_f=1.0)) == {"D", "labels", "L_f"}
    # the default keys: folds fold_in(key(1_000_003), seed), D fold_in(key(2_000_003), b)
    keys = jax.vmap(lambda s: jax.random.fold_in(jax.random.key(1_000_003), s))(np.arange(2))
    draws = [draw(s) for s in (0, 1)]
    train, test = (
        protocol.stack_datasets([getattr(d, k) for d in draws]) for k in ("train", "test")
    )
    ref = protocol.cv_datasets(train, test, 2, key=keys)
    np.testing.assert_array_equal(np.asarray(data.cv.train.x), np.asarray(ref.train.x))
    embed = {"num_reference": 8, "epsilon": 0.5, "num_classes": 2}
    b = 4  # seed 1, fold 1
    member = jax.tree.map(lambda a: a[b], data.cv.train)
    key = jax.random.fold_in(jax.random.key(2_000_003), b)
    D, _ = protocol.member_dissimilarities(jax.tree.map(lambda a: a[None], member), key, **embed)
    # each Sinkhorn solve stops once its marginal L1 error is below the threshold, and
    # another program's order stops at another iterate: D differs by up to that threshold
    # of its scale
    want = np.asarray(data.D[b])
    atol = DEFAULT_THRESHOLD * np.abs(want).max()
    np.testing.assert_allclose(np.asarray(D[0]), want, rtol=0, atol=atol)
    # no folds: the members are the seeds' final fits, test rows unpadded
    final = protocol.cv_datasets(train, test, 0)
    assert final.num_folds == 0 and final.train.x.shape[:2] == (2, n)
    np.testing.assert_array_equal(np.asarray(final.evals.x), np.asarray(test.x))
    with pytest.raises(ValueError, match="num_folds=0"):
        protocol.cv_datasets(train, test, 0, key=keys)


def test_fix_choices_rows_and_writer(tmp_path):
    methods = protocol.build_methods(
        ["FedAvg", "Karula", "FedProx"],
        loss=lambda *a: 0.0,
        rates=protocol.smoothness_rates(karula=1, fedavg=1, ifca=1, personal=1, num_clients=2),
        grids={"Karula": (1.0, 2.0, 4.0), "FedProx": (0.5,)},
        clients_per_round=1,
        batch_size=1,
    )
    chosen = np.array([2, 0])
    outcome = lambda labels, c: protocol.CVOutcome(  # noqa: E731
        {}, {}, c, labels, None, np.ones(2, bool), np.zeros(2, bool), 1.5, "", {}, np.arange(1)
    )
    outcomes = {"Karula": outcome(["t=1", "t=2", "t=4"], chosen)}
    fixed, points = protocol.fix_choices(methods, outcomes, seed=0)
    assert not any(m.tuned for m in fixed.values())
    assert points == {"Karula": {"t": np.float32(4.0)}, "FedProx": {"mu": np.float32(0.5)}}
    assert protocol.describe_grids(methods) == "Karula: t=1, t=2, t=4; FedProx: mu=0.5"
    outcomes |= {"FedAvg": outcome([""], np.zeros(2, int))}
    values = {"FedAvg": {"acc": [0.5, 0.7]}, "Karula": {"acc": [0.6, 0.9]}}
    rows = protocol.study_rows(values, outcomes, paired="acc", untuned="-")
    assert [r["cv_choice"] for r in rows] == ["-", "t=1 x1, t=4 x1"]
    # a float64 mean of two differences of values in [0, 1]: a few roundings
    assert rows[0]["karula_minus"] == pytest.approx(0.15, rel=reordered_sum(4, eps=EPS64))
    assert rows[0]["runtime_s"] == 1.5
    drawn = []
    text = protocol.write_study(
        tmp_path / "out",
        rows,
        [("method", "M"), ("acc", "A"), ("cv_choice", "CV")],
        title="T",
        notes=["a note"],
        summary={"x": np.arange(2)},
        figures={"f.png": drawn.append},
        json="s.json",
        log=lambda _: None,
    )
    # ± is the 95% t half-width: t(0.975, 1) = 12.706 times the SE 0.15 of two seeds
    assert "| Karula | 0.750 ± 1.906 | t=1 x1, t=4 x1 |" in text
    assert drawn == [tmp_path / "out" / "f.png"]
    assert json.loads((tmp_path / "out" / "s.json").read_text()) == {"x": [0, 1]}
    assert (tmp_path / "out" / "table.md").read_text().endswith("a note\n")
    assert protocol.selected(("FedProx", "Local")) == ["Local", "Karula", "FedProx"]


def test_tuning_draws_choose_the_grid_and_the_seeds_train_final_fits(tmp_path):
    # With tuning_seeds the grid is chosen by CV on those draws alone (the choice equals a
    # CV run by hand on them), the seeds' draws train final fits only at that point, and
    # the hooks that depend on the data see which draws they serve (data.seeds).
    cfg, seen = ToyConfig(), []
    base = toy_study(cfg)

    def keys(data):
        seen.append((data.seeds, data.cv.num_folds))
        return jax.vmap(jax.random.key)(np.asarray(data.seeds))

    def report(result):
        return protocol.Report(figures={"fig.png": lambda p: p.write_text(str(result.data.seeds))})

    study = base._replace(tuning_seeds=(100,), keys=keys, report=report, table="table_t")
    result = protocol.run_study(study, tmp_path, log=lambda _: None)
    assert seen == [((0, 1), 0), ((100,), 2)] or seen == [((100,), 2), ((0, 1), 0)]
    assert result.data.seeds == (0, 1) and result.data.cv.num_folds == 0
    assert not any(m.tuned for m in result.methods.values())
    tuning = result.summary["tuning"]
    assert tuning["seeds"] == [100] and tuning["grids"] == {"Karula": ["t=0", "t=inf"]}
    # the same CV by hand on the tuning draw
    data = protocol.study_data(study, seeds=(100,), num_folds=2, log=lambda _: None)
    grid = {"Karula": base.methods(data)["Karula"]}
    more = base.member_kwargs(data)
    by_hand = protocol.compare(
        grid,
        base.params(data),
        data.cv,
        keys=jax.random.key(100)[None],
        num_rounds=cfg.rounds,
        eval_fn=base.eval_fn,
        score=base.score,
        member_kwargs=data.member_kwargs(**more),
        final_fits=False,
        progress=False,
        log=lambda _: None,
    )
    label = by_hand["Karula"].chosen_labels[0]
    assert (
        result.summary["chosen"] == {"Karula": label} == {"Karula": tuning["chosen"]["Karula"][0]}
    )
    with open(tmp_path / "table_t.csv") as fh:
        rows = {r["method"]: r for r in csv.DictReader(fh)}
    assert rows["Karula"]["cv_choice"] == label and rows["Local"]["cv_choice"] == ""
    assert (tmp_path / "fig.png").read_text() == "(0, 1)"
    assert (tmp_path / "summary.json").is_file()
    assert result.summary["per_seed"]["Karula"]["test_acc"].shape == (2,)


def test_pooled_choice_takes_the_lowest_mean_score_and_drops_diverged_points():
    # Three draws of a four-point rate grid: draw 2 diverges at the largest rate (inf),
    # which draws 0 and 1 prefer; pooled, the third point wins (the lowest mean of the
    # points finite everywhere), the same for every draw, and it is not an edge.
    method = protocol.Method(lambda **_: None, **protocol.scalar_grid("lr", [0.1, 0.3, 1.0, 3.0]))
    score = np.array([[0.9, 0.5, 0.40, 0.30], [0.8, 0.6, 0.35, 0.31], [0.7, 0.5, 0.45, np.inf]])
    per_draw = np.argmin(score, axis=1)  # 3, 3, 2
    outcome = protocol.CVOutcome(
        {}, {}, per_draw, method.labels(), score, np.ones(3, bool), method.edge(per_draw),
        1.0, "", {}, np.arange(1),
    )  # fmt: skip
    pooled = protocol.pooled_choice(method, outcome)
    assert list(per_draw) == [3, 3, 2] and list(outcome.edge) == [True, True, False]
    assert list(pooled.chosen) == [2, 2, 2] and not pooled.edge.any()
    assert pooled.chosen_labels == ["lr=1"] * 3
    np.testing.assert_array_equal(pooled.cv_score, score)  # the draws' scores are kept
    # pooled scores that favour an end: an edge (or a plateau where the score stops moving)
    low = np.array([[0.2, 0.5, 0.6, 0.7], [0.3, 0.4, 0.6, 0.8]])
    edge = protocol.pooled_choice(method, outcome._replace(cv_score=low, chosen=np.zeros(2, int)))
    assert list(edge.chosen) == [0, 0] and edge.edge.all()
    flat = np.array([[0.5, 0.5, 0.6, 0.7], [0.5, 0.5, 0.6, 0.8]])
    plateau = protocol.pooled_choice(
        method, outcome._replace(cv_score=flat, chosen=np.zeros(2, int))
    )
    assert list(plateau.chosen) == [0, 0] and not plateau.edge.any() and plateau.plateau.all()


def test_a_report_that_is_not_a_report_is_refused(tmp_path):
    study = toy_study(ToyConfig())._replace(report=lambda result: {"notes": ["a note"]})
    with pytest.raises(TypeError, match=r"must return a protocol\.Report, got <class 'dict'>"):
        protocol.run_study(study, tmp_path, log=lambda _: None)
