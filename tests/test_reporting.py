"""A study's command line, tables and figures (karula_jax.reporting)."""

import argparse
import dataclasses

import numpy as np
import pytest
from _tolerances import EPS64, reordered_sum
from scipy import stats as sps

from karula_jax import reporting
from karula_jax.data import from_client_arrays
from karula_jax.reporting import choice_counts, cli, comparison_rows, keyword_option, paired_columns


@dataclasses.dataclass(frozen=True)
class _Config:
    seeds: int = 5
    rate: float = 0.1
    name: str = "a"
    grid: tuple[float, ...] = (1.0, 2.0)
    ks: tuple[int, ...] = (1,)
    flag: bool = False
    noise: float | None = None
    nested: tuple[tuple[str, float], ...] = (("x", 1.0),)


def test_cli_reads_every_simple_field_and_the_quick_config(tmp_path):
    quick = lambda c: dataclasses.replace(c, seeds=2, rate=9.0)
    argv = ["--rate", "0.5", "--grid", "3,4.5", "--ks", "2,3", "--flag", "--noise", "0.2"]
    cfg, args = cli(_Config, argv + ["--name", "b"], quick=quick, out=tmp_path)
    assert cfg == _Config(5, 0.5, "b", (3.0, 4.5), (2, 3), True, 0.2)
    assert args.out == tmp_path and not args.quick
    cfg, _ = cli(_Config, ["--quick", "--seeds", "3"], quick=quick, out=tmp_path)
    assert (cfg.seeds, cfg.rate) == (3, 9.0)  # flags apply on top of the quick config
    cfg, args = cli(_Config, ["--tag", "z"], quick=quick, out=tmp_path, tag=dict(default=""))
    assert args.tag == "z" and cfg == _Config()
    with pytest.raises(SystemExit):  # standard errors need two seeds
        cli(_Config, ["--seeds", "1"], quick=quick, out=tmp_path)
    with pytest.raises(SystemExit):  # tuples of tuples are not offered
        cli(_Config, ["--nested", "1"], quick=quick, out=tmp_path)


def test_paired_columns_decide_by_the_paired_t_test():
    ref = np.array([1.0, 2.0, 3.0, 4.0])
    diffs = np.array([1.0, 1.1, 0.9, 1.0])
    row = paired_columns({}, "d", ref, ref - diffs)
    # float64: the differences round by EPS64 of ref's size (4), a mean of 4 and a standard
    # error's 4 more steps
    tol = reordered_sum(4 + 4, eps=EPS64) * 4.0
    assert row["d"] == pytest.approx(1.0, abs=tol) and row["d_decided"] == "yes"
    want = sps.t.ppf(0.975, 3) * np.std(diffs, ddof=1) / 2  # the 95% t half-width
    assert row["d_2se"] == pytest.approx(want, abs=4 * tol)
    # the p-value's statistic is about 24; as tol, times 2 pdf(t) <= 0.8 per unit of t
    p_ref = sps.ttest_rel(ref, ref - diffs).pvalue
    assert row["d_p"] == pytest.approx(p_ref, abs=24 * tol)
    noisy = paired_columns({}, "d", ref, ref + np.array([1.0, -1.0, 1.0, -1.2]))
    assert noisy["d_decided"] == "no"
    same = paired_columns({}, "d", ref, ref)
    assert same["d_decided"] == "-" and same["d_p"] == "-"
    overlap = paired_columns({}, "d", ref, ref - diffs, test_train_ratio=1.0)
    assert overlap["d_2se"] == pytest.approx(want * np.sqrt(1 + 4 * 1.0), abs=8 * tol)


def _holm(p):
    """Holm written out (ascending p, step k multiplies by m - k, running maximum)."""
    order, out, running = np.argsort(p, kind="stable"), np.empty(len(p)), 0.0
    for k, i in enumerate(order):
        running = max(running, (len(p) - k) * p[i])
        out[i] = min(1.0, running)
    return out


def test_comparison_rows_match_numpy_scipy_and_holm():
    rng = np.random.default_rng(0)
    values = {m: {"err": rng.normal(size=5), "r2": rng.normal(size=5)} for m in "ABCD"}
    values["C"]["err"] = values["B"]["err"] + 1.5 + 0.1 * rng.normal(size=5)  # decided
    values["D"] = {k: v.copy() for k, v in values["B"].items()}  # a tie with the reference
    rows = comparison_rows(values, reference="B", paired="err")
    assert [r["method"] for r in rows] == ["A", "B", "C", "D"]
    for r in rows:
        v = values[r["method"]]
        for k in ("err", "r2"):
            # float64 sums of 5 values and a standard error's 4 steps, of their size
            tol = reordered_sum(5 + 4, eps=EPS64) * np.abs(v[k]).max()
            assert r[k] == pytest.approx(v[k].mean(), abs=tol)
            half = sps.t.ppf(0.975, 4) * v[k].std(ddof=1) / np.sqrt(5)
            assert r[k + "_2se"] == pytest.approx(half, abs=4 * tol)
        d = values["B"]["err"] - v["err"]
        # as above, of the two methods' values (each difference rounds once)
        size = np.abs(values["B"]["err"]).max() + np.abs(v["err"]).max()
        tol = reordered_sum(5 + 2, eps=EPS64) * size
        assert r["b_minus"] == pytest.approx(d.mean(), abs=tol)
    assert rows[1]["b_minus_decided"] == rows[1]["b_minus_p_holm"] == "-"
    others = [rows[0], rows[2], rows[3]]
    raw = [sps.ttest_rel(values["B"]["err"], values[r["method"]]["err"]).pvalue for r in others]
    raw[2] = 1.0  # scipy: NaN for a zero-variance tie; the rule: p = 1, never decided
    for r, p, adjusted in zip(others, raw, _holm(np.array(raw)), strict=True):
        # statistics below 100 (about 30 for C): 11 float64 roundings of each (a mean, a
        # standard deviation, a division), moving p by at most 2 pdf(t) <= 0.8 per unit
        # of t; Holm multiplies by at most 3
        tol = 100 * reordered_sum(5 + 6, eps=EPS64)
        assert r["b_minus_p"] == pytest.approx(p, abs=tol)
        assert r["b_minus_p_holm"] == pytest.approx(adjusted, abs=3 * tol)
        assert r["b_minus_decided"] == ("yes" if adjusted < 0.05 else "no")
    assert rows[2]["b_minus_decided"] == "yes" and rows[3]["b_minus_decided"] == "no"
    with pytest.raises(ValueError, match="reference 'Z' is not one of the methods"):
        comparison_rows(values, reference="Z", paired="err")


def test_write_table_shows_p_values_and_interval_headers(tmp_path):
    rows = [{"method": "A", "x": 1.0, "x_2se": 0.5, "x_p": 0.0004, "x_p_holm": 0.0321}]
    rows += [{"method": "B", "x": 2.0, "x_2se": 0.25, "x_p": "-", "x_p_holm": "-"}]
    columns = [("method", "m"), ("x", reporting.banded("x")), ("x_p", "p"), ("x_p_holm", "q")]
    text = reporting.write_table(rows, columns, tmp_path / "t")
    assert "| m | x (± 95% t) | p | q |" in text
    assert "| A | 1.000 ± 0.500 | < 0.001 | 0.032 |" in text
    assert "| B | 2.000 ± 0.250 | - | - |" in text
    assert reporting.banded(reporting.banded("x")) == "x (± 95% t)"
    keys = [k for k, _ in reporting.verdict_columns("k")]
    assert keys == ["k_decided", "k_p", "k_p_holm"]


def test_choice_counts_sorts_and_skips_empty_labels():
    assert choice_counts(["t=3", "t=1", "t=3"]) == "t=1 x1, t=3 x2"
    assert choice_counts(["", ""]) == ""


def test_keyword_option_reads_numbers_and_integers_by_default_type():
    def f(seed=0, *, count: int = 3, scale: float = 1.0, pair=(0.5, 1.0)):
        return seed, count, scale, pair

    parse = keyword_option(f, exclude=("seed",))
    assert parse("count=7") == ("count", 7) and isinstance(parse("count=7")[1], int)
    assert parse("scale=2") == ("scale", 2.0) and isinstance(parse("scale=2")[1], float)
    assert parse("pair=1,2.5") == ("pair", (1.0, 2.5))
    for bad in ("seed=1", "scale", "nope=1", "scale=x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)


def test_client_triplet_picks_nearest_and_farthest(tmp_path):
    rng = np.random.default_rng(0)
    n = 5
    xs = [rng.uniform(size=(12, 784)).astype(np.float32) for _ in range(n)]
    ys = [np.arange(12) % 10 for _ in range(n)]
    data = from_client_arrays(xs, ys, num_classes=10)
    pts = rng.normal(size=(n, 2))
    D = np.sqrt(((pts[:, None] - pts[None]) ** 2).sum(-1))
    a, near, far = reporting.plot_client_triplet(
        data, [f"w{i}" for i in range(n)], D, tmp_path / "c.png", seed=3
    )
    others = [i for i in range(n) if i != a]
    assert near == min(others, key=lambda j: D[a, j])
    assert far == max(others, key=lambda j: D[a, j])
    assert (tmp_path / "c.png").stat().st_size > 0
