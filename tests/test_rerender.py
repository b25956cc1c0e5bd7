"""experiments.rerender on the committed results: every table and summary comes back as it is."""

import csv
import io
import json
import math
import pathlib
import re
import shutil

import pytest

from experiments import rerender

REPO = pathlib.Path(__file__).resolve().parents[1]
# every results folder with per-seed summaries (bench and theory hold no verdict tables)
FOLDERS = [
    "femnist",
    "heart_disease",
    "synthetic",
    "synthetic_diagnostics",
    "synthetic_sensitivity",
]
# what depends on where the folder lies: a page's run header (the commit that added each
# run's files, looked up in git) and the merge command's --out folder
_RUN_HEADER = re.compile(r"<!-- run header.*?<!-- end of run header -->", re.S)


def _located(text: str, folder: pathlib.Path, name: str) -> str:
    return _RUN_HEADER.sub("<!-- run header -->", text.replace(str(folder), f"results/{name}"))


def _same(a, b) -> bool:
    """Equal structures; numbers to 1e-9 relative: the supported numpy and scipy versions
    differ in the last bits of a p-value or a mean (the tables print 3-4 digits)."""
    if isinstance(a, float | int) and isinstance(b, float | int) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-9) or (a != a and b != b)
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _cells(text: str) -> list:
    """A CSV file's cells, numbers as floats (the re-renderer's own cell parser)."""
    return [[rerender._value(c) for c in row] for row in csv.reader(io.StringIO(text))]


@pytest.mark.parametrize("name", FOLDERS)
def test_rerendering_a_committed_folder_changes_nothing(name, tmp_path):
    # The committed tables are what their summaries' per-seed values give under the one
    # decision rule, and re-rendering keeps each summary as its writer laid it out: the
    # Markdown tables byte for byte, the CSV and JSON files to their last bits.
    committed, folder = REPO / "results" / name, tmp_path / name
    shutil.copytree(committed, folder)
    rerender.main([str(folder)])
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in committed.iterdir())
    changed = []
    for path in sorted(p for p in committed.iterdir() if p.is_file()):
        old, new = path.read_bytes(), (folder / path.name).read_bytes()
        if path.suffix in (".md", ".csv", ".json"):
            old, new = (_located(b.decode(), folder, name) for b in (old, new))
        if path.suffix == ".json":
            same = _same(json.loads(old), json.loads(new))
        elif path.suffix == ".csv":
            same = _same(_cells(old), _cells(new))
        else:
            same = old == new
        changed += [] if same else [path.name]
    assert not changed, f"re-rendering results/{name} changed {changed}"
