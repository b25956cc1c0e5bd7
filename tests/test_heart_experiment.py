"""The heart-disease experiment end to end (quick mode) and its helpers."""

import csv

import numpy as np

from experiments import heart_disease as H
from karula_jax.data import from_client_arrays


def test_smoothness_matches_the_logistic_hessian_bound():
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(n, 3)) for n in (10, 30)]
    ys = [rng.integers(0, 2, size=len(x)) for x in xs]
    data = from_client_arrays(xs, ys, num_classes=2)
    L_f, L_max = H.smoothness(data, lam=0.1)
    L = []
    for x in xs:
        xb = np.concatenate([x, np.ones((len(x), 1))], axis=1)
        # sigma'(z) <= 1/4, so the Hessian is at most X^T X / (4 N) + lam
        L.append(np.max(np.linalg.eigvalsh(xb.T @ xb / len(x))) / 4 + 0.1)
    alpha = np.array([10, 30]) * 2 / 40
    np.testing.assert_allclose(L_max, max(L), rtol=1e-6)
    np.testing.assert_allclose(L_f, np.max(alpha * np.array(L)) / 2, rtol=1e-6)


def test_quick_run_writes_table(tmp_path, shared_data_dir):
    summary = H.main(
        ["--quick", "--out", str(tmp_path), "--data-dir", str(shared_data_dir / "heart_disease")]
    )
    for name in ("table.md", "table.csv", "summary.json"):
        assert (tmp_path / name).stat().st_size > 0
    with open(tmp_path / "table.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == list(H.quick_config(H.Config()).methods)
    for r in rows:
        for key in ("test_acc", "test_acc_2se", "pooled_acc", "acc_cleveland"):
            v = float(r[key])
            assert np.isfinite(v)
        assert 0.0 <= float(r["test_acc"]) <= 1.0
    assert summary["embedding_converged"]
    assert len(summary["chosen"]["Karula"]) == 2
    assert all(c.startswith("t=") for c in summary["chosen"]["Karula"])
