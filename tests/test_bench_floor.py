"""experiments.bench_floor: its call counting, its arithmetic and its quick run."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench_floor as bf
from experiments.bench_projection import make_instance
from karula_jax.projection import certificate, pair_algebra, project, reduction


def _solver_functions():
    return tuple(getattr(module, name) for module, name in bf.COUNTED)


def test_counting_sees_every_solver_call_and_changes_nothing():
    # A cold projection with violated pairs (n = 9: every certificate by explicit
    # differences). Counted per execution, not per trace: one certificate at the start
    # of each phase and one a Newton step, so exactly iterations + 2; at least one
    # evaluation a step and CG products. The counted run returns the uncounted point, the
    # solver's functions are back afterwards, and a program traced after the block
    # reports nothing (the caches were cleared on exit).
    v, r2 = (jnp.asarray(a, jnp.float32) for a in make_instance(9, 5))
    saved = _solver_functions()

    def solve(v):
        return project(v, r2, method="laplacian", tol=1e-6)

    plain, info = jax.jit(solve)(v)  # compiled before the block: must be traced again
    counts = collections.Counter()
    with bf.counting(counts):
        counted, counted_info = jax.jit(solve)(v)
        jax.effects_barrier()
    iterations = int(info.iterations)
    assert _solver_functions() == saved
    assert iterations > 0 and int(counted_info.iterations) == iterations
    assert counts["certificates_exact"] == iterations + 2
    assert counts["certificates_gram"] == 0
    assert counts["evaluations"] >= iterations + 1
    assert counts["hessian_products"] >= iterations
    np.testing.assert_allclose(np.asarray(counted), np.asarray(plain), rtol=0, atol=1e-6)
    before = dict(counts)
    jax.block_until_ready(jax.jit(solve)(v))
    jax.effects_barrier()
    assert dict(counts) == before


def test_rows_state_the_budget_and_what_it_affords():
    # budget 3 x 10 - 4 = 26 ms; around the solver 0.5 + 1 + 0.5 = 2; fixed 2 + 2 x 1.5
    # + 3 x 1 + 1 x 2 = 10; affords (26 - 10) / 0.5 = 32 products; explained (10 + 8 x
    # 0.5) / 12.5 = 112%
    result = dict(
        n=7, target=3.0, fedavg_ms=10.0, karula_ms=20.0, bare_ms=4.0, projection_ms=12.5,
        active=0.25, components=2, largest_component=6, k=5, iterations=3, evaluations=2,
        hessian_products=8,
        certificates_gram=3, certificates_exact=1, screen=0.5, reduction=1.0,
        violation_check=0.5, evaluation=1.5, hessian_product=0.5, certificate_gram=1.0,
        certificate_exact=2.0, sparse_product=1.5, sparse_entries=2.0,
    )  # fmt: skip
    round_row, anatomy = ([c.strip() for c in row.split("|")] for row in bf.rows_of(result))
    assert round_row[2] == "2 (6)" and round_row[5] == "2.0x" and round_row[-1] == "26.0"
    assert anatomy[5] == "3 / 1" and anatomy[6] == "2.0 (0.5 / 1.0 / 0.5)"
    assert anatomy[-4:] == ["112%", "10.0", "32", "1.50 / 2.00 (3.0x)"]
    # a budget below the fixed costs affords nothing
    assert bf.rows_of({**result, "target": 1.0})[1].split("|")[-2].strip() == "0"


def test_components_of_the_active_pairs_graph():
    # pairs (0, 1), (1, 2) and (4, 5) active, (3, 4) at 0: {0, 1, 2}, {3}, {4, 5}; only the
    # upper triangle is read, a lower-triangle entry alone joins nothing
    lam = np.zeros((6, 6))
    for i, j in [(0, 1), (1, 2), (4, 5)]:
        lam[i, j] = lam[j, i] = 0.5
    lam[3, 0] = 1.0
    assert bf.active_components(lam) == (3, 3)
    assert bf.active_components(np.zeros((1, 1))) == (1, 1)
    assert bf.active_components(np.ones((4, 4)) - np.eye(4)) == (1, 4)


@pytest.mark.parametrize("n", [2, 7, 12])
def test_the_pair_sparse_products_are_the_dense_one_on_their_pairs(n):
    # A random evaluation and a direction on a random third of the pairs (n = 2: the
    # one pair), one of them unconstrained (radius inf, where the product is 0) from n =
    # 7 on: both pair-by-pair forms equal the solver's dense product there.
    rng = np.random.default_rng(n)
    w = jnp.asarray(rng.normal(size=(n, 4)), jnp.float32)
    lam = np.triu(rng.random((n, n)) * (rng.random((n, n)) < 0.5), 1)
    lam = jnp.asarray(lam + lam.T, jnp.float32)
    r2 = np.full((n, n), 0.5, np.float32)
    x = np.triu(rng.normal(size=(n, n)) * (rng.random((n, n)) < 0.35), 1)
    x[0, 1] = 1.0  # at least one pair
    if n > 2:
        r2[0, n - 1] = r2[n - 1, 0] = np.inf
        x[0, n - 1] = 2.0
    red = reduction.reduce_problem(w, jnp.asarray(r2), rotate=False)
    mask = certificate.dual_mask(red)
    ev = certificate.dual_eval(jnp.where(mask, lam, 0.0), red, gram=False)
    x = jnp.asarray(x + x.T, jnp.float32)
    (pi, pj), forms = bf.sparse_products(ev, mask, x)
    dense = np.asarray(pair_algebra.hvp(ev, mask, x))[pi, pj]
    assert len(dense) == int(np.count_nonzero(np.triu(np.asarray(x), 1)))
    # float32 rounding: sums of up to 2n terms, none above max|A^-1| max|G| sum|x|
    term = float(jnp.max(jnp.abs(ev.a_inv)) * jnp.max(jnp.abs(ev.gram)) * jnp.sum(jnp.abs(x)))
    atol = 4 * n * np.finfo(np.float32).eps * term
    for form in forms.values():
        got = np.asarray(form(ev, x[pi, pj]))
        np.testing.assert_allclose(got, dense, rtol=0, atol=atol)
        if n > 2:
            assert got[(np.asarray(pi) == 0) & (np.asarray(pj) == n - 1)] == 0.0


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
    count, largest = (float(c) for c in round_row[2].rstrip(")").split(" ("))
    assert 1 <= count <= 20 and 1 <= largest <= 20  # n = 20
    # evaluations, Hessian products and certificates were counted (t = 1e-3 binds)
    assert int(anatomy[3]) > 0 and int(anatomy[4]) > 0
    gram, exact = (int(c) for c in anatomy[5].split(" / "))
    assert gram == 0 and exact == int(anatomy[2]) + 2  # n = 20: all exact
    worst = float(page.split("largest difference ")[1].split()[0])
    assert worst < 1e-4  # the captured problem is the round's (float32 rounding)
    assert "The counted runs took the timed runs' iterations in 1 of them" in page


def test_one_target_per_size_is_required():
    with pytest.raises(ValueError, match="targets must give one ratio per size"):
        bf.main(["--sizes", "30,100", "--targets", "3"])
