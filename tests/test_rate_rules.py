"""protocol.default_rate_rules: a rule for every rate the registry's methods read, each
the documented function of the member's default steps."""

import numpy as np

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
