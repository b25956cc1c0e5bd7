"""The numbers the README and the results pages cite are the committed tables' numbers.

A result quoted as ``mean ± half-width`` in the README's results rows must appear in a
table of the folder the row links; a table copied into a results page must have the rows
of the table file with the same header. Text against text: no tolerance.
"""

import json
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
PM = re.compile(r"-?\d+\.\d+ ± \d+\.\d+")


def _tables(folder: pathlib.Path) -> dict[pathlib.Path, list[str]]:
    """Every table file of a results folder: its lines that are table rows."""
    out = {}
    for path in sorted(folder.glob("*.md")):
        if path.name != "README.md":
            out[path] = [line for line in path.read_text().splitlines() if line.startswith("|")]
    return out


def _blocks(lines: list[str]) -> list[list[str]]:
    """Consecutive runs of table rows (``|`` lines)."""
    blocks, current = [], []
    for line in [*lines, ""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            blocks.append(current)
            current = []
    return blocks


def _result_rows() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Results", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and "](" in line]


def test_readme_result_numbers_are_in_the_linked_tables():
    checked = 0
    for row in _result_rows():
        links = re.findall(r"\]\((results/[^)]+)\)", row)
        assert links, row
        folders = {(REPO / link).parent for link in links}
        cells = [line for f in folders for rows in _tables(f).values() for line in rows]
        for number in PM.findall(row):
            assert any(number in cell for cell in cells), (number, sorted(map(str, folders)))
            checked += 1
    assert checked >= 3  # the synthetic, FEMNIST and heart-disease rows each quote one


def test_tables_copied_into_results_pages_equal_the_table_files():
    matched = 0
    for page in sorted((REPO / "results").glob("*/README.md")):
        tables = _tables(page.parent)
        for block in _blocks(page.read_text().splitlines()):
            sources = [rows for rows in tables.values() if rows[:2] == block[:2]]
            if not sources:  # a table written for the page (e.g. collected from several)
                continue
            assert any(set(block[2:]) <= set(rows[2:]) for rows in sources), (page, block[0])
            matched += 1
    assert matched >= 6  # synthetic, diagnostics, sensitivity, heart disease, FEMNIST x3


def test_hand_collected_femnist_table_quotes_the_fixed_rate_tables():
    # the page's table of four fixed-rate runs: each column's numbers are its table's
    page = (REPO / "results/femnist/README.md").read_text().splitlines()
    block = next(b for b in _blocks(page) if "paper rates, LEAF inputs" in b[0])
    files = ["table", "table_invert_paper", "table_invert_x10", "table_invert_default"]
    tables = [(REPO / f"results/femnist/{f}.md").read_text() for f in files]
    for row in block[2:]:
        cells = [c.strip() for c in row.strip()[1:-1].split(" | ")]
        method = cells[0].split(" (")[0]
        for cell, table in zip(cells[2:6], tables, strict=True):
            (number,) = re.findall(r"\d+\.\d ± \d+\.\d", cell)
            assert f"| {method} | {number} |" in table, (method, number)


def test_hand_collected_five_fold_table_quotes_its_runs():
    # the page's Karula-vs-FedPer table: each row's accuracies, flattened counts and paired
    # difference come from the run of its pixel convention
    page = (REPO / "results/femnist/README.md").read_text().splitlines()
    block = next(b for b in _blocks(page) if b[0].startswith("| pixels | Karula (%)"))
    runs = {"inverted": "cv5w_invert", "LEAF's": "cv5w_leaf"}
    assert len(block) == 2 + len(runs)
    for row in block[2:]:
        cells = [c.strip() for c in row.strip()[1:-1].split(" | ")]
        folder, tag = REPO / "results/femnist", runs[cells[0]]
        table = (folder / f"table_{tag}.md").read_text().splitlines()
        rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in table if "|" in line}
        column = {name.split(" (")[0]: i for i, name in enumerate(rows["method"])}
        acc_at, flat_at = column["mean per-writer test acc."], column["flattened"]
        seeds = json.loads((folder / f"summary_{tag}.json").read_text())["config"]["seeds"]
        for method, acc, share in (("Karula", *cells[1:4:2]), ("FedPer", *cells[4:7:2])):
            assert rows[method][acc_at] == acc, (tag, method, acc)
            flattened = round(float(rows[method][flat_at].split(" ±")[0]) * seeds)
            assert share == f"{flattened} / {seeds}", (tag, method, share)
        diff = re.findall(r"-?\d+\.\d ± \d+\.\d", cells[7])
        paired = rows["FedPer"][column["Karula minus method"]]
        assert diff == [] or diff[0] == paired, (tag, diff)
