"""protocol.default_rate_rules: a rule for every rate the registry's methods read, each
the documented function of the member's default steps."""

import numpy as np
import pytest

from karula_jax import models, protocol

STEPS = {"karula": 0.5, "local": 2.0, "fedavg": 0.25}


def test_every_registered_rule_has_a_default():
    rules = protocol.default_rate_rules()
    needed = {rule for row in protocol.REGISTRY.values() for rule in row.rates.values()}
    assert needed <= set(rules), sorted(needed - set(rules))
    names = [*protocol.SUITE, "FedPer", "Karula (theorem step)"]
    kw = dict(loss=models.ridge_loss(0.0), rates=rules, personalized=True)
    built = protocol.build_methods(names, clients_per_round=2, batch_size=4, **kw)
    assert list(built) == names


def test_each_rule_is_its_documented_step():
    rules, L = protocol.default_rate_rules(), 1 / STEPS["fedavg"]
    for mu in (0.0, 3.0):
        # FedProx's local objective f_i + mu/2 ||w - w0||^2 is (L + mu)-smooth
        np.testing.assert_allclose(rules["fedprox"](steps=STEPS, mu=mu), 1 / (L + mu))
    lam = 4.0
    envelope = lam * L / (lam + L)  # the Moreau envelope's smoothness
    np.testing.assert_allclose(rules["pfedme"](steps=STEPS, lam=lam), 1 / envelope)
    np.testing.assert_allclose(rules["pfedme_personal"](steps=STEPS, lam=lam), 1 / (L + lam))
    np.testing.assert_allclose(rules["penalty_mu"](steps=STEPS, mu=0.1), 0.1 / STEPS["local"])
    for rule, key in [("karula", "karula"), ("local", "local"), ("fedavg", "fedavg")]:
        assert rules[rule](steps=STEPS) == STEPS[key]
    for rule in ("fedsgd", "ifca", "ditto_personal"):
        assert rules[rule](steps=STEPS) == STEPS["fedavg"]


def _recording(calls):
    """A registry whose factory records the keywords it is built with."""

    def factory(loss, **kw):
        calls.append(kw)
        return "an algorithm"

    rows = {
        "Stepped": protocol.MethodRow(
            "Stepped",
            factory,
            hyper="lam",
            grid=(0.5, 1.0, 2.0),
            rates={"learning_rate": "fedavg", "personal_learning_rate": "pfedme_personal"},
            settings=(),
        ),
        "Penalty": protocol.MethodRow(
            "Penalty",
            factory,
            hyper="mu",
            grid=(0.1,),
            rates={"learning_rate": "penalty", "mu": "penalty_mu"},
            settings=(),
        ),
        "Own step": protocol.MethodRow("Own step", factory, rates={}, settings=()),
    }
    return rows


def _points(method, calls):
    """The keywords ``method`` builds its algorithm with at every grid point."""
    calls.clear()
    for point in method.points():
        method.make(steps=STEPS, **point)
    return [{k: float(v) for k, v in kw.items()} for kw in calls]


def test_default_rules_make_every_step_a_cv_choice_of_multiples_of_its_rule():
    calls, multiples = [], protocol.RATE_MULTIPLES
    built = protocol.build_methods(
        ["Stepped", "Penalty", "Own step"],
        loss=models.ridge_loss(0.0),
        rates=protocol.default_rate_rules(),
        registry=_recording(calls),
    )
    stepped = built["Stepped"]
    assert stepped.labels() == [
        f"lam={lam:.3g} + rate x{m:.3g}" for lam in (0.5, 1.0, 2.0) for m in multiples
    ]
    # both step keywords scale with the chosen multiple; the rule itself still reads lam
    got = _points(stepped, calls)
    want = [
        {"lam": lam, "learning_rate": 0.25 * m, "personal_learning_rate": 0.25 / (1 + lam / 4) * m}
        for lam in (0.5, 1.0, 2.0)
        for m in multiples
    ]
    for g, w in zip(got, want, strict=True):  # float32 multiples: one rounding each
        assert g.keys() == w.keys()
        np.testing.assert_allclose(list(g.values()), list(w.values()), rtol=2**-23)
    # an end of the multiples is a grid edge, the interior is not (at lam's interior point;
    # at lam's ends every choice is an edge)
    edge = stepped.edge(np.arange(len(stepped.labels()))).reshape(3, len(multiples))
    assert edge.tolist() == [[True] * 4, [True, False, False, True], [True] * 4]
    # the penalty's mu is not a step: it stays its rule (mu / local), whatever the multiple
    penalty = _points(built["Penalty"], calls)
    assert [p["mu"] for p in penalty] == [np.float32(0.1) / 2.0] * len(multiples)
    np.testing.assert_allclose([p["learning_rate"] for p in penalty], [0.5 * m for m in multiples])
    assert not built["Own step"].tuned  # no rule, no rate choice


def test_rate_cv_is_opted_out_explicitly_and_a_fixed_step_is_kept():
    calls, loss = [], models.ridge_loss(0.0)
    kw = dict(loss=loss, registry=_recording(calls))
    rules = protocol.default_rate_rules()
    off = protocol.build_methods(["Stepped"], rates=rules, rate_multiples=(), **kw)
    assert off["Stepped"].labels() == ["lam=0.5", "lam=1", "lam=2"]
    off = protocol.build_methods(["Stepped"], rates=protocol.default_rate_rules(multiples=()), **kw)
    assert off["Stepped"].labels() == ["lam=0.5", "lam=1", "lam=2"]
    # a plain mapping of rules (the studies' own rates) carries no multiples
    plain = protocol.build_methods(["Stepped"], rates=dict(protocol.default_rate_rules()), **kw)
    assert plain["Stepped"].labels() == ["lam=0.5", "lam=1", "lam=2"]
    # a step in a method's options is fixed: neither its rule nor a multiple of it
    fixed = protocol.build_methods(
        ["Stepped"],
        rates=protocol.default_rate_rules(),
        options={"Stepped": {"learning_rate": 0.1, "personal_learning_rate": 0.2}},
        **kw,
    )
    assert fixed["Stepped"].labels() == ["lam=0.5", "lam=1", "lam=2"]
    got = _points(fixed["Stepped"], calls)
    assert got == [{"learning_rate": 0.1, "personal_learning_rate": 0.2, "lam": lam}
                   for lam in (0.5, 1.0, 2.0)]  # fmt: skip
    for bad in ((1.0, 1.0), (0.0, 1.0), (3.0, 1.0), (1.0, np.inf)):
        with pytest.raises(ValueError, match="rate multiples"):
            protocol.build_methods(["Stepped"], rates=protocol.default_rate_rules(),
                                   rate_multiples=bad, **kw)  # fmt: skip
    with pytest.raises(ValueError, match="rate multiples"):
        protocol.default_rate_rules(multiples=(2.0, 1.0))
