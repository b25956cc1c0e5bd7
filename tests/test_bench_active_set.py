"""experiments.bench_active_set: its KKT residual against closed forms, and its quick run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench_active_set as bas
from experiments.bench_projection import make_instance
from karula_jax.projection import project


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


def test_kkt_residual_vanishes_at_the_solvers_answer_and_not_before():
    # n = 7 binding clients: the certified answer's multipliers (tol 1e-6 of the objective's
    # scale, float32) leave theta(lam) within about 1e-3 of every active radius, relative;
    # half of them leave pairs far outside (the Laplacian assembled over many pairs)
    v, r2 = (jnp.asarray(a, jnp.float32) for a in make_instance(7, 4, seed=1))
    _, info = jax.jit(lambda v: project(v, r2, method="laplacian", tol=1e-6))(v)
    lam = np.asarray(info.state.lam)
    assert np.count_nonzero(np.triu(lam > 0, 1)) >= 3
    assert bas.kkt_residual(v, r2, lam) < 1e-2
    assert bas.kkt_residual(v, r2, 0.5 * lam) > 0.1


def test_the_path_ends_at_the_full_runs_multipliers():
    # what the path relies on: stopped after the full run's count of Newton iterations, the
    # deterministic solver returns the full run's multipliers, bit for bit
    v, r2 = (jnp.asarray(a, jnp.float32) for a in make_instance(9, 5, seed=2))
    full = project(v, r2, method="laplacian", tol=1e-6)[1]
    its = int(full.iterations)
    assert its >= 2
    stopped = project(v, r2, method="laplacian", tol=1e-6, max_iter=its)[1]
    np.testing.assert_array_equal(np.asarray(stopped.state.lam), np.asarray(full.state.lam))
    early = project(v, r2, method="laplacian", tol=1e-6, max_iter=its - 1)[1]
    assert not np.array_equal(np.asarray(early.state.lam), np.asarray(full.state.lam))


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
    # the round's sampled client steps along n / s times its gradient's change: it moves
    # more than the others' median, which step along their stored gradients alone
    assert low > median_others > 0 and max_others >= median_others
    assert moves[5].endswith("%)")  # the new pairs' share (of a participant)
    warm, cold, answer, participants, others = (int(c) for c in moves[6].split(" / "))
    assert answer == 0 < min(warm, cold)  # the answer certifies at once; t binds
    assert path[0][1] == "0 (warm start)" and path[1][1] == "1"
    assert float(path[0][3]) > 0  # the warm start violates
    assert int(tol[1].split(", ")[0]) == warm  # the same solver, tolerance and start
