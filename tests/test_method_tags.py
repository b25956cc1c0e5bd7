"""Studies select methods by name or by tag, never by a row's position in the registry."""

import pytest

from karula_jax import protocol
from karula_jax.protocol import methods as M


def test_tags_name_the_studies_methods_in_registry_order():
    assert protocol.tagged("paper") == ("Local", "FedSGD", "FedAvg", "IFCA", "pFedMe", "Karula")
    assert protocol.tagged("uses-D") == ("Laplacian penalty on D", "Clustered FedAvg on D")
    assert protocol.SUITE == protocol.tagged("paper", "baseline", "uses-D")
    assert set(protocol.tagged("variant")) == {"Karula (theorem step)", "FedPer"}
    for row in protocol.REGISTRY.values():
        assert row.tags, f"{row.name} has no tag"


def test_a_registered_row_joins_its_tag_and_reordering_changes_no_selection():
    registry = dict(reversed(list(protocol.REGISTRY.items())))
    assert set(protocol.tagged("paper", registry=registry)) == set(protocol.tagged("paper"))
    mine = M.MethodRow("Mine", M.REGISTRY["FedAvg"].factory, tags=("baseline",))
    registry["Mine"] = mine
    assert "Mine" in protocol.tagged("baseline", registry=registry)


def test_bad_tags_are_refused_naming_them():
    with pytest.raises(ValueError, match="tags must be some of"):
        protocol.tagged("papers")
    with pytest.raises(ValueError, match="tags must be some of"):
        protocol.tagged()
    row = M.MethodRow("Mine-bad-tag", M.REGISTRY["FedAvg"].factory, tags="paper")
    with pytest.raises(ValueError, match="tags must be a tuple"):
        protocol.register(row)
    assert "Mine-bad-tag" not in protocol.REGISTRY
