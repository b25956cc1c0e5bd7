"""The FEMNIST experiment end to end (quick mode) and its helpers."""

import csv

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerances import EPS32, EPS64, reordered_sum

from experiments import femnist

# The quick run's seeded results (summary["rows"]), to catch a wrong step (e.g. of the shared
# hidden layer, whose direction differs from the per-client one only when s < n, as here:
# 3 of 6 writers), weighting or CV choice that leaves the numbers finite and in range.
# Refresh after a deliberate change of the numerics: run the test's command and copy.
# method: (mean per-writer test accuracy in %, final training loss)
PINNED = {
    "FedAvg": (24.6914, 2.226037),
    "Karula": (11.0958, 2.280005),  # at t = 0, CV's choice of --t-grid 0,20,inf
    "Ditto": (15.2115, 2.217147),
}


def test_library_rates_reproduce_the_papers_per_client_steps():
    # The paper steps eta_p * N_i * grad(mean loss of i); the library steps
    # eta * alpha_i / n (karula, local) or eta (the FedAvg family, on a client's mean loss).
    counts = np.array([[50, 80, 120, 100], [60, 60, 70, 300]])
    cfg = femnist.Config()
    rates = femnist.library_rates(cfg, counts)
    n = counts.shape[1]
    alpha = counts * n / counts.sum(1, keepdims=True)
    paper = dict(cfg.paper_rates)
    # float64: sums over the n clients and a few products, each side
    rtol = reordered_sum(n + 4, eps=EPS64)
    for m in ("karula", "local"):
        np.testing.assert_allclose(rates[m][:, None] * alpha / n, paper[m] * counts, rtol=rtol)
    np.testing.assert_allclose(rates["fedavg"], paper["fedavg"] * counts.mean(1), rtol=rtol)
    doubled = femnist.library_rates(femnist.Config(rate_scale=2.0), counts)
    assert all(np.allclose(doubled[m], 2 * rates[m], rtol=rtol, atol=0) for m in rates)


def test_rates_from_full_gives_every_fold_its_final_fits_step():
    # The paper's rates are per summed loss: converted with a fold's own digits (half of
    # them) a fold's step is half its final fit's; with rates_from="full" every member of
    # a seed takes the step of the seed's whole training set, the one CV should validate.
    from karula_jax import protocol
    from karula_jax.data import from_client_arrays

    def draw(seed):
        rng = np.random.default_rng(seed)
        sets = []
        for rows in ([20, 40, 60, 80], [5] * 4):
            xs = [rng.random((r, 784), dtype=np.float32) for r in rows]
            ys = [rng.integers(0, 10, size=r) for r in rows]
            sets.append(from_client_arrays(xs, ys, num_classes=10))
        return protocol.Draw(*sets)

    embed = {"num_reference": 4, "epsilon": 0.5, "num_classes": 10}
    data = protocol.draw_study(draw, 2, num_folds=2, embed=embed, log=lambda _: None)
    counts = np.asarray(data.cv.train.counts, np.float64)  # [S (K + 1), n]
    final = np.repeat(counts[2::3], 3, axis=0)  # each member's seed's whole training set
    assert np.all(counts[0::3] < final[0::3])  # a fold holds part of the digits
    for rates_from, want in (("member", counts), ("full", final)):
        cfg = femnist.Config(rates_from=rates_from, hidden=4, ifca_clusters=1, seeds=2)
        model = femnist.setup(cfg)[0]
        got = femnist._member_kwargs(cfg, model, data)["rates"]
        for key, rate in femnist.library_rates(cfg, want).items():
            # the members' rates in float32: the same sums over 4 clients and products
            got_key = np.asarray(got[key])
            np.testing.assert_allclose(got_key, rate, rtol=reordered_sum(4 + 4), err_msg=key)
    with pytest.raises(ValueError, match="rates_from"):
        femnist.main(["--rates-from", "fold"])


def test_fedprox_own_default_step_adds_mu_to_the_smoothness():
    # FedProx's local objective f_i + mu/2 ||w - w0||^2 is (L_i + mu)-smooth: its own default
    # is 1 / (max L_i + mu), not FedAvg's 1 / max L_i (which diverges once step * mu > 2).
    own = 0.5  # FedAvg's default 1 / max L_i: max L_i = 2
    for mu in (0.0, 10.0):
        cfg = femnist.Config(rates="default")
        got = femnist._fedprox_step(lambda **_: own, cfg, mu)
        np.testing.assert_allclose(got, 1 / (2.0 + mu), rtol=reordered_sum(2, eps=EPS64))
        cv = femnist.Config(rates="cv", rate_multiples=(1.0, 10.0))
        steps = np.array([0.01, 0.1, own])  # the paper's x1, x10, then the default
        pick = lambda rates, rate, **_: rates[rate]
        for rate, want in ((0, 0.01), (1, 0.1), (2, 1 / (2.0 + mu))):
            got = femnist._fedprox_step(pick, cv, mu, rates=steps, rate=rate)
            # a float32 rounding of the picked step (measured 3e-8), twice over
            np.testing.assert_allclose(got, want, rtol=EPS32)
        paper = femnist._fedprox_step(pick, femnist.Config(), mu, rates=steps, rate=1)
        assert paper == 0.1  # the paper's rates are fixed numbers


@pytest.mark.parametrize("rates", ["paper", "default", "cv"])
def test_every_method_builds_at_every_grid_point_under_each_rate_mode(rates):
    # Each committed configuration builds every method at every grid point (the penalty's
    # mu / L_f once divided by Karula's step, which the "default" mode leaves to Karula's
    # own coupled rule: None). Building traces nothing, so this is cheap.
    cfg = femnist.Config(rates=rates, seeds=1)
    model, loss, personal = femnist.setup(cfg)
    params0 = femnist._init(model, jax.random.key(0))
    methods = femnist.make_methods(cfg, loss, personal)
    n = 4
    shape = (len(cfg.rate_multiples) + 1,) if rates == "cv" else ()
    kw = dict(
        D=jnp.ones((n, n)) - jnp.eye(n),
        rates={k: jnp.full(shape, 0.1) for k in ("local", "fedavg", "karula")},
        labels=jnp.zeros((len(cfg.grids["Clustered FedAvg on D"]), n), jnp.int32),
        clusters=jax.tree.map(lambda a: jnp.stack([a] * cfg.ifca_clusters), params0),
    )
    assert set(methods) == set(femnist.METHODS)
    for name, method in methods.items():
        for point in method.points():
            alg = method.make(**kw, **{k: jnp.asarray(v) for k, v in point.items()})
            assert callable(alg.round), (name, point)


def test_quick_run_writes_figures_and_tables(tmp_path, shared_data_dir):
    argv = ["--quick", "--out", str(tmp_path), "--data-dir", str(shared_data_dir / "femnist")]
    summary = femnist.main([*argv, "--t-grid", "0,20,inf"])
    for name in ("curves.png", "clients.png", "table.md", "table.csv", "summary.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    with open(tmp_path / "table.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == list(femnist.quick_config(femnist.Config()).methods)
    for r in rows:
        assert 0.0 <= float(r["test_acc"]) <= 100.0
        assert np.isfinite(float(r["test_acc_2se"]))
        assert np.isfinite(float(r["train_loss"])) and float(r["train_loss"]) > 0
        assert r["karula_minus_decided"] in ("yes", "no", "-")
    by_method = {r["method"]: r for r in rows}
    assert float(by_method["Karula"]["karula_minus"]) == 0.0
    assert by_method["Ditto"]["cv_choice"].startswith("lam=")  # decided by CV on the tuning draw
    # so is Karula's t (--t-grid), reported with the active pairs at that t
    assert by_method["Karula"]["cv_choice"] in ("t=0", "t=20", "t=inf")
    t = summary["tuning"]["points"]["Karula"]["t"]
    assert f"Karula: t = {t:g} on D" in (tmp_path / "table.md").read_text()
    # CV picks t = 0 on this tuning draw (the pinned values below are at that t): every
    # pair active at the end of both seeds
    assert t == 0.0 and summary["karula_active_fraction"] == [1.0, 1.0]
    # pinned to the seeded values: the training loss is continuous; float32 rounding moves
    # the models by up to reordered_sum(784 + 64 + 100, rounds=10), 1.1e-3 of their scale
    # (784-pixel, 64-row and 100-unit sums over the 10 rounds), which the loss near log 10
    # (small logits) follows at most: raised from 1e-4 (measured 2e-5 off the pins). The
    # loss moved 1% (Karula) to 3% (FedAvg) from log 10, so a step off by a factor 2 still
    # shows. An accuracy moves in steps of a test digit, so 0.5 points leave room for a
    # digit whose near-uniform logits flip (a regression pin, not a derived bound)
    rtol = reordered_sum(784 + 64 + 100, rounds=10)
    got = {r["method"]: (r["test_acc"], r["train_loss"]) for r in summary["rows"]}
    assert set(got) == set(PINNED)
    for m, (acc, loss) in PINNED.items():
        np.testing.assert_allclose(got[m][1], loss, rtol=rtol, err_msg=m)
        np.testing.assert_allclose(got[m][0], acc, atol=0.5, err_msg=m)
    md = (tmp_path / "table.md").read_text()
    assert "| Karula |" in md and "±" in md
    assert summary["embedding_converged"]
    # every seed draws its own writers among the eligible ones
    assert len(summary["writers"]) == 2 and summary["writers"][0] != summary["writers"][1]
    assert all(len(w) == 6 for w in summary["writers"])
    assert summary["ifca_clusters_in_use"] is None  # IFCA is not among the quick methods
    a, near, far = summary["three_clients"]["indices"]
    assert len({a, near, far}) == 3


def test_t_sweep_trains_karula_at_one_step_for_every_t(tmp_path, shared_data_dir):
    """The sweep over t: one step for every t (the paper rate here), t = 0
    with every pair active and t = inf with none; refused with rates chosen by CV."""
    argv = ["--quick", "--out", str(tmp_path), "--data-dir", str(shared_data_dir / "femnist")]
    argv += ["--rounds", "4", "--eval-every", "4", "--methods", "Karula"]
    summary = femnist.main([*argv, "--t-sweep", "0,inf", "--tag", "sweep"])
    assert (tmp_path / "sweep.png").stat().st_size > 0
    assert [r["method"] for r in summary["rows"]] == ["Karula t=0", "Karula t=inf"]
    seeds = summary["per_seed"]  # active pairs in %
    assert list(seeds["Karula t=0"]["active"]) == [100.0, 100.0]
    assert list(seeds["Karula t=inf"]["active"]) == [0.0, 0.0]
    acc = [*seeds["Karula t=0"]["test_acc"], *seeds["Karula t=inf"]["test_acc"]]
    assert all(0 <= a <= 100 for a in acc)
    assert "karula t=inf minus method" in (tmp_path / "table_sweep.md").read_text().lower()
    with pytest.raises(ValueError, match="one step for every t"):
        femnist.main([*argv, "--t-sweep", "0", "--rates", "cv"])
    with pytest.raises(ValueError, match="exclude each other"):
        femnist.main([*argv, "--t-sweep", "0", "--t-grid", "0,inf"])
    with pytest.raises(ValueError, match="at least two values"):
        femnist.main([*argv, "--t-grid", "3"])


def test_merge_runs_pairs_every_method_against_the_shared_karula(tmp_path):
    import json

    karula = {"test_acc": [90.0, 92.0, 94.0], "train_loss": [0.1] * 3, "flattened": [1.0] * 3}
    other = {"test_acc": [89.0, 90.0, 95.0], "train_loss": [0.2] * 3, "flattened": [1.0] * 3}
    ditto = other | {"test_acc": [91.0, 91.0, 94.5]}
    runs = {
        "a": {"per_seed": {"Karula": karula, "FedAvg": other}, "chosen": {"Karula": "rate x3"}},
        "b": {"per_seed": {"Karula": karula, "Ditto": ditto}, "chosen": {"Ditto": "lam=0"}},
    }
    runs["a"]["chosen"]["FedAvg"] = ["rate x1", "rate x1", "rate x3"]  # per seed
    runs["b"]["chosen"]["Karula"] = "rate x3"
    for tag, summary in runs.items():
        (tmp_path / f"summary_{tag}.json").write_text(json.dumps(summary))
    rows = {r["method"]: r for r in femnist.merge_runs(tmp_path, ["a", "b"], "m")}
    assert list(rows) == ["Karula", "FedAvg", "Ditto"]
    diff = np.array(karula["test_acc"]) - np.array(other["test_acc"])
    # float64 differences of numbers near 90 and a mean of 3: of their size
    tol = reordered_sum(3 + 2, eps=EPS64) * 100
    assert rows["FedAvg"]["karula_minus"] == pytest.approx(diff.mean(), abs=tol)
    assert rows["FedAvg"]["cv_choice"] == "rate x1 x2, rate x3 x1"
    assert rows["Ditto"]["run"] == "b" and rows["Ditto"]["karula_minus_decided"] == "no"
    assert "| Ditto |" in (tmp_path / "table_m.md").read_text()
    runs["b"]["per_seed"]["Karula"] = other  # another draw or protocol: refused
    (tmp_path / "summary_b.json").write_text(json.dumps(runs["b"]))
    with pytest.raises(ValueError, match="run 'b': Karula's per-seed test_acc differ from run 'a'"):
        femnist.merge_runs(tmp_path, ["a", "b"], "m")
