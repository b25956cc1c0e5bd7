"""One `personalized` for a comparison: build_methods passes it to every method that has
the notion, lets a method's own options win, and refuses a method that needs it and lacks
it before anything runs."""

import jax.numpy as jnp
import pytest

from karula_jax import models, protocol
from karula_jax.protocol.methods import MethodRow


def _recording_registry(calls):
    def factory(loss, **kw):
        calls.append(kw)
        return "an algorithm"

    rows = {
        "Optional": MethodRow("Optional", factory, rates={}, settings=(), personal="optional"),
        "Required": MethodRow("Required", factory, rates={}, settings=(), personal="required"),
        "Without": MethodRow("Without", factory, rates={}, settings=()),
    }
    return rows


def _built(names, calls, **kw):
    methods = protocol.build_methods(
        names, loss=models.ridge_loss(0.0), rates={}, registry=_recording_registry(calls), **kw
    )
    calls.clear()
    for method in methods.values():
        method.make()
    return dict(zip(methods, calls, strict=True))


def test_it_reaches_every_method_that_takes_it_and_no_other():
    mask = {"hidden": False, "output": True}
    seen = _built(["Optional", "Required", "Without"], [], personalized=mask)
    assert seen["Optional"] == {"personalized": mask}
    assert seen["Required"] == {"personalized": mask}
    assert seen["Without"] == {}


def test_a_methods_own_option_wins_and_none_keeps_each_default():
    seen = _built(
        ["Optional", "Required"],
        [],
        personalized=True,
        options={"Optional": {"personalized": False}},
    )
    assert seen == {"Optional": {"personalized": False}, "Required": {"personalized": True}}
    seen = _built(["Optional"], [])
    assert seen == {"Optional": {}}  # the factory's own default


def test_a_method_that_needs_it_is_refused_at_build_time_naming_it():
    calls = []
    with pytest.raises(ValueError, match=r"\['Required'\] need `personalized`"):
        _built(["Optional", "Required"], calls)
    assert calls == []  # nothing was built, let alone run
    with pytest.raises(ValueError, match=r"\['Required'\] need"):
        _built(["Required"], calls, options={"Required": {"personalized": False}})


def test_the_registry_marks_fedper_required_and_the_personal_methods_optional():
    registry = protocol.REGISTRY
    assert registry["FedPer"].personal == "required"
    for name in ("Karula", "FedAvg", "FedProx", "SCAFFOLD", "Ditto", "Laplacian penalty on D"):
        assert registry[name].personal == "optional", name
    for name in ("Local", "FedSGD", "IFCA", "pFedMe"):
        assert registry[name].personal == "no", name
    rates = {"fedavg": lambda **_: 0.1, "karula": lambda **_: 0.1}
    kw = dict(loss=models.ridge_loss(0.0), rates=rates, clients_per_round=2, batch_size=4)
    with pytest.raises(ValueError, match=r"\['FedPer'\] need `personalized`"):
        protocol.build_methods(["Karula", "FedPer"], **kw)
    built = protocol.build_methods(["Karula", "FedPer"], personalized=True, **kw)
    assert set(built) == {"Karula", "FedPer"}
    fedper = built["FedPer"].make()  # FedAvg keeping every leaf: each client on its own
    assert callable(fedper.round)
    D = jnp.zeros((3, 3))
    assert callable(built["Karula"].make(D=D, t=jnp.float32(1.0)).round)


def test_an_unknown_personal_kind_is_refused_when_registered():
    row = MethodRow("Mine-personal", lambda loss: None, personal="sometimes")
    with pytest.raises(ValueError, match="personal must be one of"):
        protocol.register(row)
