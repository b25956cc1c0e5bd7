"""experiments.rerender on the committed results: the tables come back byte for byte."""

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


@pytest.mark.parametrize("name", FOLDERS)
def test_rerendering_a_committed_folder_changes_no_byte(name, tmp_path):
    # The committed tables are what their summaries' per-seed values give under the one
    # decision rule, and re-rendering keeps each summary as its writer laid it out.
    committed, folder = REPO / "results" / name, tmp_path / name
    shutil.copytree(committed, folder)
    rerender.main([str(folder)])
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in committed.iterdir())
    changed = []
    for path in sorted(p for p in committed.iterdir() if p.is_file()):
        old, new = path.read_bytes(), (folder / path.name).read_bytes()
        if path.suffix in (".md", ".csv", ".json"):
            old, new = (_located(b.decode(), folder, name) for b in (old, new))
        changed += [path.name] if old != new else []
    assert not changed, f"re-rendering results/{name} changed {changed}"
