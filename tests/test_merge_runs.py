"""protocol.merge_runs (runs of one protocol merged into one comparison) and
protocol.summed_loss_rate (a summed-loss step in the library's units), against
hand-made cases."""

import numpy as np
import pytest

from karula_jax import protocol


def _run(karula, **methods):
    per_seed = {"Karula": {"test_acc": karula}} | {m: {"test_acc": v} for m, v in methods.items()}
    return {"per_seed": per_seed, "chosen": dict.fromkeys(per_seed, "x")}


def test_first_run_wins_and_the_reference_must_agree():
    a = _run([90.0, 91.0], FedAvg=[89.0, 90.0])
    b = _run([90.0, 91.0 + 5e-7], FedAvg=[0.0, 0.0], Ditto=[92.0, 93.0])  # within atol
    merged = protocol.merge_runs({"a": a, "b": b})
    assert list(merged.per_seed) == ["Karula", "FedAvg", "Ditto"]
    assert merged.source == {"Karula": "a", "FedAvg": "a", "Ditto": "b"}
    np.testing.assert_array_equal(merged.per_seed["FedAvg"]["test_acc"], [89.0, 90.0])
    with pytest.raises(ValueError, match="run 'c': Karula's per-seed test_acc differ"):
        protocol.merge_runs({"a": a, "c": _run([90.0, 91.1])})
    with pytest.raises(ValueError, match="run 'c': Karula's per-seed test_acc differ"):
        protocol.merge_runs({"a": a, "c": _run([90.0, 91.0, 92.0])})  # another seed count
    with pytest.raises(ValueError, match="run 'd' has no per-seed 'test_acc' of 'Karula'"):
        protocol.merge_runs({"a": a, "d": {"per_seed": {"FedAvg": {}}, "chosen": {}}})
    with pytest.raises(ValueError, match="no runs"):
        protocol.merge_runs({})


def test_summed_loss_rate_gives_every_client_or_an_average_one_its_paper_step():
    counts = np.array([[10, 30, 20], [5, 5, 50]])
    product = protocol.summed_loss_rate(1e-3, counts, weighting="product")
    client = protocol.summed_loss_rate(1e-3, counts, weighting="client")
    # the product space moves client i by rate_lib * (N_i / N) grad f_i: the paper's
    # rate * N_i grad f_i for every client; FedAvg's rate_lib grad f_i matches the mean N_i
    N_i = counts.astype(float)
    np.testing.assert_allclose(product[:, None] * N_i / N_i.sum(1, keepdims=True), 1e-3 * N_i)
    np.testing.assert_allclose(client, 1e-3 * N_i.mean(1))
    with pytest.raises(ValueError, match="weighting must be one of"):
        protocol.summed_loss_rate(1e-3, counts, weighting="mean")
    with pytest.raises(ValueError, match=r"counts must be \[..., n\]"):
        protocol.summed_loss_rate(1e-3, 5, weighting="client")
    with pytest.raises(ValueError, match=r"counts must be \[..., n\]"):
        protocol.summed_loss_rate(1e-3, [3, -1], weighting="client")
