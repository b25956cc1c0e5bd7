"""experiments.bench_active_set: its KKT residual against closed forms, and its quick run."""

import numpy as np
import pytest

from experiments import bench_active_set as bas


@pytest.mark.parametrize(
    "lam, radius_sq, want",
    [
        # two clients 3 apart on a line, radius 1: the projection moves each by 1 with
        # lam = 1 ((I + L) theta = v gives theta = (1, 0), (2, 0)); at lam = 0.5 they are
        # 3 / (1 + 2 lam) = 1.5 apart (1.25 too far, relative); at lam = 0, 9 against 1
        (1.0, 1.0, 0.0),
        (0.5, 1.0, 1.25),
        (0.0, 1.0, 8.0),
        # a radius of 10 leaves the pair at 0 slack: nothing is violated
        (0.0, 100.0, 0.0),
        # ... but a positive multiplier there holds it at 3 / 2 = 1.5 apart: |2.25 - 100| / 100
        (0.5, 100.0, 0.9775),
    ],
)
def test_kkt_residual_of_two_clients_is_the_closed_form(lam, radius_sq, want):
    v = np.array([[0.0, 0.0], [3.0, 0.0]])
    r2 = np.array([[0.0, radius_sq], [radius_sq, 0.0]])
    multipliers = np.array([[0.0, lam], [lam, 0.0]])
    # float64 solve of a 2 x 2 system and squares of numbers near 3: rounding near 1e-15
    assert bas.kkt_residual(v, r2, multipliers) == pytest.approx(want, abs=1e-12)


def test_kkt_residual_ignores_pairs_without_a_finite_radius():
    v = np.array([[0.0], [3.0], [30.0]])
    r2 = np.array([[0.0, 1.0, np.inf], [1.0, 0.0, np.inf], [np.inf, np.inf, 0.0]])
    lam = np.zeros((3, 3))
    assert bas.kkt_residual(v, r2, lam) == pytest.approx(8.0, abs=1e-12)


def test_quick_run_prints_moves_path_and_tolerances(capsys, tmp_path):
    out = tmp_path / "active_set.md"
    bas.main(["--quick", "--out", str(out)])
    page = capsys.readouterr().out
    assert not out.exists()  # a quick run writes no file
    page = page.split("# Why a binding round")[1]
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in page.splitlines()
        if line.startswith("| 12 ")
    ]
    moves, path, tol = rows[0], rows[1:3], rows[3]
    assert len(rows) == 4  # one captured round, the path to iteration 1, one tolerance
    low = float(moves[2].split("-")[0])
    median_others, max_others = (float(c) for c in moves[3].split(", "))
    assert low >= max_others >= median_others > 0  # the n // 10 that moved most
    assert moves[5].endswith("%)")  # the new pairs' share (of a participant)
    warm, cold, answer, participants, others = (int(c) for c in moves[6].split(" / "))
    assert answer == 0 < min(warm, cold)  # the answer certifies at once; t binds
    assert path[0][1] == "0 (warm start)" and path[1][1] == "1"
    assert float(path[0][3]) > 0  # the warm start violates
    assert int(tol[1].split(", ")[0]) == warm  # the same solver, tolerance and start
