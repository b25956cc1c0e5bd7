"""A method with a registry row runs in a study that names it, with no edit to
experiments/: a toy row registered here runs in the synthetic study's quick configuration
(`--methods`), and an unknown name is refused instead of being dropped."""

import csv

import pytest

from experiments import synthetic_ridge as sr
from karula_jax import algorithms, protocol


def _damped_fedavg(loss, *, damping, learning_rate, **settings):
    """FedAvg at ``damping`` times its step: a method of one's own, tuned by CV."""
    return algorithms.fedavg(loss, learning_rate=damping * learning_rate, **settings)


@pytest.fixture
def toy_row():
    row = protocol.MethodRow(
        "Damped FedAvg", _damped_fedavg, hyper="damping", grid=(0.5, 1.0), tags=("baseline",)
    )
    protocol.register(row)
    yield row
    protocol.REGISTRY.pop(row.name)


@pytest.mark.slow
def test_a_registered_row_runs_in_the_synthetic_quick_study(toy_row, tmp_path):
    # its grid from the command line: the study's one mapping of grids takes any name
    argv = ["--quick", "--methods", "FedAvg,Damped FedAvg", "--out", str(tmp_path)]
    sr.main(argv + ["--grid", "Damped FedAvg=0.25,0.75"])
    with open(tmp_path / "table.csv") as fh:
        rows = {r["method"]: r for r in csv.DictReader(fh)}
    assert list(rows) == ["Local", "FedAvg", "Karula", "Damped FedAvg"]
    chosen = rows["Damped FedAvg"]["cv_choice"]
    assert chosen.startswith(("damping=0.25", "damping=0.75")), chosen
    assert float(rows["Damped FedAvg"]["estimation_error"]) > 0


def test_selected_keeps_a_studys_order_then_the_other_registered_names(toy_row):
    order = ("Local", "FedAvg", "Karula")
    got = protocol.selected(("Damped FedAvg", "FedAvg"), order)
    assert got == ["FedAvg", "Karula", "Damped FedAvg"]
    with pytest.raises(ValueError, match=r"unknown method\(s\) \['Mine'\]"):
        protocol.selected(("FedAvg", "Mine"), order)
    with pytest.raises(TypeError, match="not the string|got the string"):
        protocol.selected("FedAvg", order)


def test_grid_options_replace_one_entry_each_and_bad_ones_are_named(capsys):
    from experiments import heart_disease as H
    from karula_jax import reporting

    argv = ["--grid", "Ditto=0.5,5", "--grid", "Clustered FedAvg on D=1,2", "--grid", "Karula="]
    cfg, _ = reporting.cli(H.Config, argv, quick=H.quick_config, out=None)
    default = H.Config().grids
    assert cfg.grids["Ditto"] == (0.5, 5) and cfg.grids["Clustered FedAvg on D"] == (1, 2)
    assert cfg.grids["Karula"] == () and cfg.grids["FedProx"] == default["FedProx"]
    assert reporting.grid_option("Karula=0,1e-2,inf") == ("Karula", (0, 0.01, float("inf")))
    for bad, says in (("Ditto", "NAME=V1,V2"), ("Ditto=a", "'a' is not a number")):
        with pytest.raises(SystemExit):
            reporting.cli(H.Config, ["--grid", bad], quick=H.quick_config, out=None)
        assert says in capsys.readouterr().err
