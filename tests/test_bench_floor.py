"""experiments.bench_floor: its call counting and its quick run."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench_floor as bf
from experiments.bench_projection import make_instance
from karula_jax.projection import laplacian, project


def test_counting_sees_every_solver_call_and_changes_nothing():
    # A cold projection with violated pairs: the counted run reports at least one
    # evaluation per Newton iteration and CG products, returns the same point as the
    # uncounted run, and the solver's own functions are back in place afterwards.
    v, r2 = (jnp.asarray(a, jnp.float32) for a in make_instance(9, 5))
    saved = (laplacian.hvp, laplacian.dual_eval, laplacian.restore_and_certify)

    def solve(v):
        return project(v, r2, method="laplacian", tol=1e-6)

    plain, info = jax.jit(solve)(v)
    counts = collections.Counter()
    with bf.counting(counts):
        counted, counted_info = jax.jit(solve)(v)
        jax.effects_barrier()
    assert (laplacian.hvp, laplacian.dual_eval, laplacian.restore_and_certify) == saved
    assert int(info.iterations) > 0
    assert counts["evaluations"] >= int(info.iterations) + 1
    assert counts["hessian_products"] >= int(info.iterations)
    assert counts["certificates"] >= int(info.iterations) + 1
    np.testing.assert_array_equal(np.asarray(counted), np.asarray(plain))
    assert int(counted_info.iterations) == int(info.iterations)


def test_quick_run_prints_both_tables_with_the_active_share(capsys, tmp_path):
    out = tmp_path / "floor.md"
    bf.main(["--quick", "--out", str(out)])
    page = capsys.readouterr().out
    assert not out.exists()  # a quick run writes no file
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in page.split("# What bounds")[1].splitlines()
        if line.startswith("| 20 ")
    ]
    assert len(rows) == 2
    round_row, anatomy = rows
    assert round_row[1].endswith("%") and 0 < float(round_row[1][:-1]) <= 100
    # evaluations and Hessian products were counted (the projection binds at t = 1e-3)
    assert int(anatomy[3]) > 0 and int(anatomy[4]) > 0
    worst = float(page.split("largest difference ")[1].split()[0])
    assert worst < 1e-4  # the captured problem is the round's (float32 rounding)


def test_one_target_per_size_is_required():
    with pytest.raises(ValueError, match="targets must give one ratio per size"):
        bf.main(["--sizes", "30,100", "--targets", "3"])
