"""The heart-disease experiment end to end (quick mode).

Its step sizes' smoothness constants: tests/test_protocol.py (smoothness_constants)."""

import csv

import numpy as np

from experiments import heart_disease as H


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
