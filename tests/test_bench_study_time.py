"""experiments.bench_study_time: its substitution, its arithmetic and its quick run."""

import types

import jax
import numpy as np
import pytest

from experiments import bench_study_time as bst
from experiments import synthetic_ridge
from experiments.bench_projection import make_instance
from karula_jax.projection import project


def test_inside_the_block_a_projection_is_the_screens_shrink_and_after_it_the_projection():
    # A cold instance with violated pairs (the solver runs: iterations > 0). Inside the
    # block the answer is the mean plus beta times the deviations, beta = min over the
    # constrained pairs of r_ij / d_ij (numpy, float64), as the screen's shrink is: feasible
    # and no solver. The program was jitted before the block, so it is traced again
    # inside (caches cleared) and once more after it, where it projects as before.
    v, r2 = make_instance(9, 5)
    solve = jax.jit(lambda v: project(v, r2, method="laplacian", tol=1e-6))
    before, info = solve(v)
    with bst.projection_replaced_by_screen_shrink():
        inside, inside_info = solve(v)
    after, _ = solve(v)

    x = np.asarray(v, np.float64)
    mean = x.mean(axis=0)
    d = np.sqrt(np.sum((x[:, None] - x[None]) ** 2, axis=-1))
    r = np.sqrt(np.asarray(r2, np.float64))
    pairs = ~np.eye(len(x), dtype=bool) & np.isfinite(r)
    beta = min(1.0, float(np.min(r[pairs] / d[pairs])))
    assert beta < 1.0  # pairs were violated: the shrink moved the models
    # float32: the screen's beta carries a margin of a few eps of each radius and the
    # shrink rounds each coordinate by eps of its size
    scale = np.abs(x).max()
    np.testing.assert_allclose(np.asarray(inside), mean + beta * (x - mean), atol=1e-5 * scale)
    assert int(inside_info.iterations) == 0 and int(info.iterations) > 0
    np.testing.assert_array_equal(np.asarray(after), np.asarray(before))


def _runs():
    study = {
        "total": 250.0,
        "cpu": 460.0,
        "stages": {"Local": 3.0, "Karula": 60.0, "IFCA": 40.0, "Karula (theorem step)": 35.0},
        "projecting": ["Karula", "Karula (theorem step)"],
        "binding": {"Karula": 0.25, "Karula (theorem step)": 1.0},
    }
    alone = lambda karula, theorem: {
        "total": 0.0,
        "cpu": 0.0,
        "stages": {"Local": 2.0, "Karula": karula, "Karula (theorem step)": theorem},
        "projecting": ["Karula", "Karula (theorem step)"],
        "binding": {},
    }
    return study, alone(62.0, 36.0), alone(10.0, 12.0), alone(14.0, 13.0)


def test_the_projection_costs_karulas_rows_minus_the_bracketing_shrinks_and_targets_are_judged():
    # Karula: 62 - (10 + 14) / 2 = 50; the theorem step: 36 - 12.5 = 23.5; Local's row
    # is not the projection's. The rest of the study: 250 - 138 = 112.
    study, real, before, after = _runs()
    assert bst.row_cost(real, before, after, "Karula") == pytest.approx(50.0)
    rows = [[c.strip() for c in row.split("|")] for row in bst.study_rows(study)]
    assert rows[1] == ["Karula", "60.0"]
    assert rows[4] == ["the rest (data, D, writing)", "112.0"]
    assert rows[5] == ["**study (wall)**", "250.0"]
    assert rows[6] == ["study (CPU, all threads)", "460"]
    karula = bst.karula_rows(study, real, before, after)
    karula = [[c.strip() for c in row.split("|")] for row in karula]
    assert karula == [
        ["Karula", "60.0", "10.0", "62.0", "14.0", "50.0"],
        ["Karula (theorem step)", "35.0", "12.0", "36.0", "13.0", "23.5"],
    ]
    text = bst.findings(synthetic_ridge.SyntheticConfig(), study, real, before, after)
    assert "at most 240 s: 250.0 s, not met" in text and "at most 60 s: 35.0 s, met" in text
    assert "costs 73.5 s on Karula's rows" in text and "without its solver: 176.5 s" in text
    assert "Karula 25.0%, Karula (theorem step) 100.0%" in text
    other = bst.findings(synthetic_ridge.quick_config(), study, real, before, after)
    assert "no verdict on the targets" in other and "not met" not in other


def test_binding_share_counts_pairs_at_their_radius_at_the_chosen_t():
    # Three clients on a line at 0, 1 and 3, D = 1, the grid (1, 4) with t = 4 chosen:
    # squared distances 1, 9, 4 against r^2 = 4, so (0, 2) (beyond) and (1, 2) (at the
    # radius) bind: 2 of 3 pairs. A second seed at t = 1 with all models equal: none.
    theta = np.array([[[0.0], [1.0], [3.0]], [[2.0], [2.0], [2.0]]])
    D = np.ones((2, 3, 3))
    result = types.SimpleNamespace(
        outcomes={"Karula": types.SimpleNamespace(metrics={"theta": theta}, chosen=[1, 0])},
        data=types.SimpleNamespace(D=D, cv=types.SimpleNamespace(final=lambda a: a)),
    )
    cfg = types.SimpleNamespace(grids={"Karula": (1.0, 4.0)})
    assert bst.binding_share(result, cfg, "Karula") == pytest.approx(2 / 6)


def test_quick_run_prints_the_stages_of_both_runs_and_the_binding_share(capsys, tmp_path):
    out = tmp_path / "study_time.md"
    bst.main(["--quick", "--rounds", "6", "--out", str(out)])
    page = capsys.readouterr().out.split("# Where the synthetic study's time goes")[1]
    assert not out.exists()  # a quick run writes no file
    tables = page.split("Karula's rows: in the study above")
    assert len(tables) == 2
    cells = lambda text: [
        [c.strip() for c in line.strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith(("| stage", "| row"))
    ]
    stages = {row[0]: row[1:] for row in cells(tables[0])}
    assert {"Local", "Karula", "Karula (theorem step)", "**study (wall)**"} <= set(stages)
    karula = {row[0]: [float(c) for c in row[1:]] for row in cells(tables[1])}
    assert set(karula) == {"Karula", "Karula (theorem step)"}
    for study, before, real, after, cost in karula.values():
        assert min(study, before, real, after) > 0
        assert cost == pytest.approx(real - 0.5 * (before + after), abs=0.15)
    share = float(page.split("Pairs binding at Karula's final fits: Karula ")[1].split("%")[0])
    assert 0.0 <= share <= 100.0
    assert "no verdict on the targets" in page
