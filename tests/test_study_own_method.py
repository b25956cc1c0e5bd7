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
    sr.main(["--quick", "--methods", "FedAvg,Damped FedAvg", "--out", str(tmp_path)])
    with open(tmp_path / "table.csv") as fh:
        rows = {r["method"]: r for r in csv.DictReader(fh)}
    assert list(rows) == ["Local", "FedAvg", "Karula", "Damped FedAvg"]
    assert rows["Damped FedAvg"]["cv_choice"].startswith("damping=")
    assert float(rows["Damped FedAvg"]["estimation_error"]) > 0


def test_selected_keeps_a_studys_order_then_the_other_registered_names(toy_row):
    order = ("Local", "FedAvg", "Karula")
    got = protocol.selected(("Damped FedAvg", "FedAvg"), order)
    assert got == ["FedAvg", "Karula", "Damped FedAvg"]
    with pytest.raises(ValueError, match=r"unknown method\(s\) \['Mine'\]"):
        protocol.selected(("FedAvg", "Mine"), order)
    with pytest.raises(TypeError, match="not the string|got the string"):
        protocol.selected("FedAvg", order)
