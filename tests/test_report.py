"""The experiments' shared command line and table helpers (experiments/report.py)."""

import dataclasses

import numpy as np
import pytest

from experiments.report import cli, paired_columns


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


def test_paired_columns_decide_only_beyond_two_standard_errors():
    ref = np.array([1.0, 2.0, 3.0, 4.0])
    row = paired_columns({}, "d", ref, ref - np.array([1.0, 1.1, 0.9, 1.0]))
    assert row["d"] == pytest.approx(1.0) and row["d_decided"] == "yes"
    assert row["d_2se"] == pytest.approx(2 * np.std([1.0, 1.1, 0.9, 1.0], ddof=1) / 2)
    noisy = paired_columns({}, "d", ref, ref + np.array([1.0, -1.0, 1.0, -1.2]))
    assert noisy["d_decided"] == "no"
    assert paired_columns({}, "d", ref, ref)["d_decided"] == "-"
