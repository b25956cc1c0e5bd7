"""The documented path for a user's own data, end to end on a tiny data set (notebook 04,
the README): a pool split into clients, CV members, D and default steps, build_methods
with one personalization mask and the default rate rules (every step a CV choice),
compare (with its flattening flag) and write_comparison (table and figure), whose
numbers are checked against numpy on the outcomes."""

import csv

import jax
import numpy as np
import pytest

from karula_jax import data, evaluation, models, protocol

pytestmark = pytest.mark.slow

S, N_CLIENTS, CLASSES, ROUNDS = 2, 4, 3, 12


def _pool(seed):
    """Three Gaussian classes in 4 features, 40 rows."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, 40)
    centres = np.eye(CLASSES, 4) * 2.0
    return (centres[y] + rng.normal(size=(40, 4))).astype(np.float32), y


@pytest.fixture(scope="module")
def path():
    splits = [
        data.train_test_split(
            data.split_dirichlet(*_pool(s), N_CLIENTS, alpha=1.0, key=jax.random.key(s)),
            0.25,
            key=jax.random.key(10 + s),
        )
        for s in range(S)
    ]
    train = protocol.stack_datasets([a for a, _ in splits])
    test = protocol.stack_datasets([b for _, b in splits])
    keys = jax.random.split(jax.random.key(1), S)
    cv = protocol.cv_datasets(train, test, 2, key=keys)
    member_keys = cv.per_member(keys)
    D, _ = protocol.member_dissimilarities(
        cv.train, member_keys, num_reference=8, num_classes=CLASSES
    )
    model = models.mlp(4, CLASSES)
    params = models.init_params(model, jax.random.key(2), (1, 4))
    loss = models.cross_entropy_loss(model.apply)
    steps = protocol.member_default_rates(loss, params, cv.train, 2, member_keys)
    methods = protocol.build_methods(
        ["FedPer", "Karula"],
        loss=loss,
        rates=protocol.default_rate_rules(multiples=(1.0, 3.0)),
        grids={"Karula": (1.0, 10.0)},
        personalized=models.output_layer_mask(params),
        clients_per_round=2,
        batch_size=int(cv.train.x.shape[2]),
        local_steps=2,
    )

    def metrics(theta, d):
        return {
            "acc": evaluation.accuracy(model.apply, theta, d),
            "nll": evaluation.log_loss(model.apply, theta, d),
        }

    lines = []
    outcomes = protocol.compare(
        methods,
        params,
        cv,
        keys=keys,
        num_rounds=ROUNDS,
        eval_fn=metrics,
        score=lambda m: m["nll"].mean(-1),
        member_kwargs={"D": protocol.mean_normalized(D), "steps": steps},
        eval_every_chunk=True,
        log=lines.append,
        progress=False,
    )
    return methods, outcomes, lines


def test_every_step_is_chosen_by_cv_and_every_run_checked_for_flattening(path):
    methods, outcomes, lines = path
    assert methods["FedPer"].labels() == ["rate x1", "rate x3"]
    assert len(methods["Karula"].labels()) == 4  # t x rate
    for name, o in outcomes.items():
        assert o.train_loss.shape == (S, ROUNDS) and o.flattened.shape == (S,)
        assert all("rate x" in label for label in o.chosen_labels), name
        flagged = [line for line in lines if line.startswith(f"    {name}: training loss")]
        assert len(flagged) == int(not o.flattened.all()), (name, lines)
        if flagged:
            assert "raise num_rounds" in flagged[0]


def test_write_comparison_writes_the_outcomes_numbers(path, tmp_path):
    _, outcomes, lines = path
    logged = []
    text = protocol.write_comparison(outcomes, tmp_path, metric="acc", log=logged.append)
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert (tmp_path / "table.md").read_text().count("\n| ") >= len(outcomes)
    assert "flattened (share of seeds)" in text and logged
    with open(tmp_path / "table.csv") as fh:
        rows = {r["method"]: r for r in csv.DictReader(fh)}
    assert list(rows) == list(outcomes)
    acc = {n: np.asarray(o.metrics["acc"], np.float64).mean(-1) for n, o in outcomes.items()}
    # float64 means of float32 accuracies, written by csv at full precision (repr)
    for name, o in outcomes.items():
        row = rows[name]
        np.testing.assert_allclose(float(row["acc"]), acc[name].mean(), rtol=1e-12)
        diff = (acc["Karula"] - acc[name]).mean()
        np.testing.assert_allclose(float(row["karula_minus"]), diff, rtol=1e-12, atol=1e-15)
        assert float(row["flattened"]) == o.flattened.mean()
        w = round(0.1 * ROUNDS)  # the last tenth of the rounds
        want = o.train_loss[:, -w:].mean(-1).mean()
        np.testing.assert_allclose(float(row["final_train_loss"]), want, rtol=1e-12)
        assert row["cv_choice"] == ", ".join(
            f"{v} x{o.chosen_labels.count(v)}" for v in sorted(set(o.chosen_labels))
        )
    with pytest.raises(ValueError, match="reference"):
        protocol.write_comparison(outcomes, tmp_path, reference="Local")
    with pytest.raises(ValueError, match="metric"):
        protocol.write_comparison(outcomes, tmp_path, metric="mse")
