"""What the benchmarks share (karula_jax.benchmarking): problems, timing, pages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerances import certified_distance

from karula_jax import benchmarking as B


def test_random_dissimilarities_are_symmetric_uniform_and_seeded():
    D = B.random_dissimilarities(6, seed=3)
    assert D.shape == (6, 6) and np.array_equal(D, D.T) and np.all(np.diag(D) == 0)
    off = D[~np.eye(6, dtype=bool)]
    assert off.min() >= 0.5 and off.max() < 1.5
    # the upper triangle of one draw of the generator, mirrored
    u = np.random.default_rng(3).uniform(0.5, 1.5, size=(6, 6))
    np.testing.assert_array_equal(np.triu(D, 1), np.triu(u, 1))
    rng = np.random.default_rng(0)
    a, b = B.random_dissimilarities(4, rng=rng), B.random_dissimilarities(4, rng=rng)
    assert not np.array_equal(a, b)  # one generator, successive draws
    np.testing.assert_array_equal(a, B.random_dissimilarities(4, seed=0))


def test_mlp_problem_has_the_asked_shapes():
    data, params, loss, D = B.mlp_problem(3, hidden=5, features=7, num_classes=4, rows=(2, 4))
    assert data.x.shape[0] == 3 and data.x.shape[2] == 7 and D.shape == (3, 3)
    assert params["params"]["output"]["kernel"].shape == (5, 4)
    value = loss(params, data.x[0], data.y[0], jnp.arange(data.x.shape[1]) < data.counts[0])
    assert np.isfinite(float(value))
    np.testing.assert_array_equal(D, B.random_dissimilarities(3, seed=1))


def test_cvxpy_projection_keeps_feasible_points_and_merges_zero_radii():
    v = np.array([[0.0, 0.0], [1.0, 0.0], [5.0, 0.0]])
    radii = np.array([[0, np.inf, 0.0], [np.inf, 0, np.inf], [0.0, np.inf, 0]])
    tol = 1e-10
    theta, value, prob = B.cvxpy_projection(v, radii, tol=tol)
    # Clarabel stops within tol (1 + |p|) of the optimal value and of feasibility: the
    # point is within certified_distance of that gap of the projection (1-strongly convex),
    # 3.8e-5, raised from 1e-6 (measured 4e-16); an equality (radius 0) holds within tol
    want = 0.5 * 2 * 2.5**2
    atol = certified_distance(tol * (1 + want))
    np.testing.assert_allclose(theta[0], theta[2], atol=atol)  # radius 0: equal
    np.testing.assert_allclose(theta[1], v[1], atol=atol)  # unconstrained
    np.testing.assert_allclose(theta[0], [2.5, 0.0], atol=atol)
    # the gap, and as much again for the multiplier (2.5) times the feasibility tolerance
    assert value == pytest.approx(want, abs=2 * tol * (1 + want))
    assert prob.solver_stats.solve_time >= 0


def test_compiled_round_donates_the_state_and_fastest_times_each_step():
    step = lambda state, x: state + x  # noqa: E731
    fn, seconds = B.compiled_round(step, jnp.zeros(3), jnp.ones(3))
    assert seconds > 0 and np.array_equal(np.asarray(fn(jnp.zeros(3), jnp.ones(3))), np.ones(3))
    calls = []

    def counted(k):
        def s(state):
            calls.append(k)
            return state + k

        return s

    best, states = B.fastest([counted(1), counted(2)], jnp.zeros(()), reps=3)
    assert calls == [1, 2] + [1, 2] * 3  # one warm-up each, then in turn
    assert [float(s) for s in states] == [4.0, 8.0] and all(b > 0 for b in best)
    assert B.nbytes({"a": jnp.zeros((2, 3), jnp.float32), "b": jnp.zeros(4, jnp.int8)}) == 28


def test_iteration_distribution_bins_and_labels():
    assert B.iteration_distribution(np.array([0, 1, 7])) == "0:33% 1:33% 6-10:33%"
    assert B.iteration_distribution(np.array([0, 0, 60, 60])) == "0:50% >50:50%"
    assert B.iteration_distribution(np.array([3]), bins=(2, 4)) == "3-4:100%"


def test_run_header_names_the_command_as_run_and_the_config(monkeypatch):
    line = B.run_header("experiments.bench_x", ["--out", "/tmp/x.md"], "Cfg(a=1)")
    assert line.startswith("`python -m experiments.bench_x --out /tmp/x.md`; ")
    assert line.endswith(" UTC; Cfg(a=1).\n") and "jax " in line and jax.__version__ in line
    monkeypatch.setattr("sys.argv", ["prog", "--quick"])
    assert B.run_header("m", None, "C").startswith("`python -m m --quick`; ")
    assert B.run_header("m", [], "C").startswith("`python -m m`; ")


def test_bench_page_and_publish(tmp_path, capsys):
    page = B.bench_page("T", "header\n", "a paragraph", ("x | y", ["1 | 2"]))
    assert page == "# T\n\nheader\n\na paragraph\n| x | y |\n|---|---|\n| 1 | 2 |"
    B.publish(page, tmp_path / "q.md", quick=True)
    assert not (tmp_path / "q.md").exists() and "# T" in capsys.readouterr().out
    B.publish(page, tmp_path / "a" / "p.md", quick=False)
    assert (tmp_path / "a" / "p.md").read_text() == page + "\n"
