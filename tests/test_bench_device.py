"""experiments.bench_device, the prepared accelerator run: its quick mode on the CPU."""

import re

import pytest

from experiments import bench_device as bd


def _tables(page: str) -> dict[str, list[list[str]]]:
    """The rows of each part's table (under its ``###`` heading), cells split."""
    out, part = {}, None
    for line in page.splitlines():
        if line.startswith("### "):
            part = line[4:]
            out[part] = []
        elif part and line.startswith("| ") and not line.startswith("|---"):
            out[part].append([c.strip() for c in line.strip("|").split("|")])
    return out


def test_quick_run_writes_every_part_with_its_solver_and_active_share(capsys, tmp_path):
    # Every part runs, every solver named has a row in the binding table, every Karula
    # row prints its share of active pairs and a certified gap, and the page's header
    # names the device; a quick run writes no file.
    out = tmp_path / "device.md"
    bd.main(["--quick", "--out", str(out)])
    page = capsys.readouterr().out
    assert not out.exists()
    assert "experiments.bench_device --quick" in page and "jax " in page
    tables = _tables(page)
    binding = next(v for k, v in tables.items() if k.startswith("Binding"))
    many = next(v for k, v in tables.items() if k.startswith("Many"))
    study = next(v for k, v in tables.items() if k.startswith("Vmapped"))
    head = binding[0]
    methods = {row[1] for row in binding[1:]}
    assert methods == {
        "FedAvg",
        "Karula t=0.001 laplacian",
        "Karula t=0.001 laplacian_direct",
    }
    share = head.index("pairs with lam > 0")
    for row in binding[1:] + many[1:]:
        if row[1] != "FedAvg":
            assert re.fullmatch(r"\d+\.\d%", row[share]), row
            assert float(row[head.index("max certified gap")]) < 1e-3
    assert [row[0] for row in many[1:]] == ["6", "6"]
    assert "Device peak memory in use" in page
    assert study[0][0] == "workload" and study[1][0] == "ridge n=10"
    assert "pairs with lam > 0" in study[0]


def test_spent_budget_starts_no_part_and_says_so(capsys):
    bd.main(["--quick", "--budget-s", "0"])
    page = capsys.readouterr().out
    assert page.count("Not run (budget of 0 s spent)") == 3
    assert "| n |" not in page


def test_unknown_part_is_refused_by_name():
    with pytest.raises(ValueError, match="parts must be among binding, many, study"):
        bd.main(["--quick", "--parts", "binding,gpu"])


def test_card_is_a_file_name():
    assert re.fullmatch(r"[a-z0-9_]+", bd.card())
