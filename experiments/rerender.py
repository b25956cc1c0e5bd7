"""Re-renders committed result tables from their per-seed values, without a rerun.

Command: ``python -m experiments.rerender results/heart_disease results/femnist
results/synthetic results/synthetic_diagnostics results/synthetic_sensitivity`` (seconds).

Every table of a folder is rebuilt from the JSON summary beside it
(``per_seed[method][metric]``) with the decision rule of :mod:`karula_jax.stats`
(:func:`karula_jax.reporting.comparison_rows`: means ± 95% Student-t half-widths, paired
t-tests, Holm's correction over the table's comparisons); what the per-seed values do not
give (CV choices, runtimes, the run a merged row comes from) is kept from the table's CSV,
and the notes' sentences on the bands are rewritten. Summaries in older layouts
(``config.json``; ``methods[m]`` or ``accuracy[m]`` per seed) are written back as
``summary.json`` with ``per_seed``, the one layout. Heart disease takes the corrected
variance of overlapping splits, ``n_test / n_train`` counted on its data
(:func:`experiments.heart_disease.test_train_ratio`). Running it again rewrites the same
tables.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import pathlib
import re
import sys
from collections.abc import Callable, Sequence

import numpy as np

from experiments import femnist, heart_disease, synthetic_ridge
from karula_jax import reporting
from karula_jax.data import load_heart_disease

__all__ = ["main", "per_seed_of", "rerender_folder", "rerender_table"]


def _read_markdown(path: pathlib.Path) -> tuple[str, list[str], list[list[str]], list[str]]:
    """``(title, headers, cells per row, notes)`` of a table page written by write_table."""
    lines = path.read_text().splitlines()
    title = lines[0][2:] if lines and lines[0].startswith("# ") else ""
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    split = lambda line: [c.strip() for c in line.strip()[1:-1].split(" | ")]
    headers = split(lines[start])
    cells = [split(line) for line in lines[start + 2 : end]]
    notes = [line for line in lines[end:] if line.strip()]
    return title, headers, cells, notes


def _digits(cell: str) -> int:
    """Decimals shown in a cell (``"91.3 ± 0.8"`` -> 1), 3 when it shows none."""
    m = re.match(r"^-?\d+\.(\d+)", cell)
    return len(m.group(1)) if m else (0 if re.match(r"^-?\d+( |$)", cell) else 3)


def _value(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def per_seed_of(summary: dict) -> dict[str, dict[str, np.ndarray]]:
    """``{method: {metric: [S]}}`` from a JSON summary, in any of the layouts written:
    ``per_seed`` (the one layout), ``methods[m][metric]`` (older synthetic runs) or
    ``accuracy[m]`` and ``active_fraction[m]`` (older FEMNIST sweeps)."""
    if "per_seed" in summary:
        return {
            m: {k: np.asarray(v, float) for k, v in c.items()}
            for m, c in summary["per_seed"].items()
        }
    if "methods" in summary:
        keys = ("estimation_error", "test_r2")
        return {
            m: {k: np.asarray(c[k], float) for k in keys} for m, c in summary["methods"].items()
        }
    if "accuracy" in summary:
        out = {m: {"test_acc": np.asarray(v, float)} for m, v in summary["accuracy"].items()}
        for m, v in summary.get("active_fraction", {}).items():
            out[m]["active"] = 100 * np.asarray(v, float)
        return out
    raise ValueError(f"no per-seed values in the summary (keys {sorted(summary)})")


def rerender_table(
    path: pathlib.Path,
    per_seed: dict[str, dict[str, np.ndarray]],
    *,
    paired: str,
    test_train_ratio: float = 0.0,
    notes: Callable[[list[str]], list[str]] = lambda lines: lines,
) -> list[dict]:
    """Rewrites ``<path>.md`` and ``<path>.csv`` from ``per_seed`` (every method of the
    table; the reference is the row the old table marks "-"), keeping the columns, the
    title, the decimals and the cells that are not per-seed values; ``notes`` rewrites the
    notes. Returns the new rows."""
    title, headers, cells, old_notes = _read_markdown(pathlib.Path(f"{path}.md"))
    with open(f"{path}.csv", newline="") as fh:
        reader = csv.DictReader(fh)
        old = list(reader)
        fields = list(reader.fieldnames or [])
    keys = [f for f in fields if not f.endswith("_2se")]
    if len(keys) != len(headers):
        raise ValueError(f"{path}: {len(keys)} CSV columns but {len(headers)} headers")
    digits = {k: _digits(c) for k, c in zip(keys, cells[0], strict=True)}
    key = next(k for k in keys if k.endswith("_minus"))
    reference = next(r["method"] for r in old if r["method"].lower() + "_minus" == key)
    methods = [r["method"] for r in old]
    rows = reporting.comparison_rows(
        {m: per_seed[m] for m in methods},
        reference=reference,
        paired=paired,
        test_train_ratio=test_train_ratio,
    )
    for row, before in zip(rows, old, strict=True):
        for k, v in before.items():
            if k not in row and not k.endswith(("_2se", "_p", "_p_holm")):
                row[k] = _value(v)
    columns = []
    for k, header in zip(keys, headers, strict=True):
        if k.endswith(("_p", "_p_holm")):  # rebuilt with the verdict
            continue
        if k.endswith("_decided"):
            columns += reporting.verdict_columns(k.removesuffix("_decided"))
        elif k + "_2se" in rows[0]:
            columns.append((k, reporting.banded(header)))
        else:
            columns.append((k, header))
    reporting.write_table(rows, columns, path, title=title, notes=notes(old_notes), digits=digits)
    return rows


def _rewrite(patterns: Sequence[tuple[str, str]]) -> Callable[[list[str]], list[str]]:
    """Notes rewritten by ``(regex, replacement)`` pairs, each applied to every line."""

    def apply(lines: list[str]) -> list[str]:
        for pattern, new in patterns:
            lines = [re.sub(pattern, new, line) for line in lines]
        return lines

    return apply


def _write_summary(folder: pathlib.Path, name: str, summary: dict, rows, per_seed, ratio):
    """The summary in the one layout: ``per_seed``, ``test_train_ratio``, the new rows
    (with what the old rows held beyond the table, e.g. ``finite``, in their key order)."""
    old = {r.get("method"): r for r in summary.get("rows", [])}
    rows = [{**old.get(r["method"], {}), **r} for r in rows]  # keeps the writer's key order
    summary = dict(summary) | {"per_seed": per_seed, "test_train_ratio": ratio, "rows": rows}
    reporting.write_json(summary, folder / name)


def _heart_disease(folder: pathlib.Path) -> None:
    summary = json.loads((folder / "summary.json").read_text())
    cfg = summary["config"]
    split = load_heart_disease(cfg["data_dir"], test_fraction=cfg["test_fraction"], seed=0)
    ratio = heart_disease.test_train_ratio(split.train, split.test)
    note = heart_disease.band_note(cfg["seeds"], ratio).replace("\\", "\\\\")
    old = (
        r"± is (2 standard errors over seeds|the 95% Student-t interval over the .*? below 0\.05)\."
    )
    per_seed = per_seed_of(summary)
    rows = rerender_table(
        folder / "table",
        per_seed,
        paired="test_acc",
        test_train_ratio=ratio,
        notes=_rewrite([(old, note)]),
    )
    _write_summary(folder, "summary.json", summary, rows, per_seed, ratio)


_FEMNIST_NOTES = [
    (
        r"± is 2 (standard errors|SE) over seeds; 'Karula minus method' is (the paired "
        r"difference of the seeds' mean accuracies|paired over the seeds), decided when it "
        r"exceeds its 2 SE\.",
        femnist.BAND_NOTE,
    ),
    (
        r"± is 2 SE over draws; paired differences against (.*?)\.",
        r"± is the 95% Student-t interval over draws; paired differences against \1, decided "
        r"when the paired t-test's p-value, Holm-adjusted over the table's comparisons, is "
        r"below 0.05.",
    ),
]


def _femnist(folder: pathlib.Path) -> None:
    for path in sorted(folder.glob("summary*.json")):
        tag = path.stem.removeprefix("summary").removeprefix("_")
        table = folder / ("table_" + tag if tag else "table")
        summary = json.loads(path.read_text())
        per_seed = per_seed_of(summary)
        rows = rerender_table(table, per_seed, paired="test_acc", notes=_rewrite(_FEMNIST_NOTES))
        _write_summary(folder, path.name, summary, rows, per_seed, 0.0)
    for page in sorted(folder.glob("table_*.md")):
        tag = page.stem.removeprefix("table_")
        if (folder / f"summary_{tag}.json").exists():
            continue
        merged = re.search(r"Merged from the runs (.*?) \(", page.read_text())
        if merged:  # a merged table: its runs' summaries give every row
            femnist.merge_runs(folder, merged.group(1).split(", "), tag)


_SYNTHETIC_LINES = (r"^\d+ seeds, mean", "Spearman correlation", "Diagnostics:", "Closed-form")


def _synthetic(folder: pathlib.Path) -> dict:
    """One synthetic study's table; its summary moves to ``summary.json``."""
    source = folder / "summary.json"
    source = source if source.exists() else folder / "config.json"
    summary = json.loads(source.read_text())
    fields = {f.name for f in dataclasses.fields(synthetic_ridge.SyntheticConfig)}
    config = {k: v for k, v in summary["config"].items() if k in fields}
    cfg = dataclasses.replace(synthetic_ridge.SyntheticConfig(), **config)
    per_seed = per_seed_of(summary)
    if "chosen" not in summary and "methods" in summary:
        summary["chosen"] = {m: c["chosen"] for m, c in summary["methods"].items()}

    def notes(lines: list[str]) -> list[str]:
        grids = re.search(r"from the grids (.*)\.$", lines[0]).group(1)
        new = synthetic_ridge.table_notes(cfg, grids, summary)
        by_start = {p: n for p in _SYNTHETIC_LINES for n in new if re.match(p, n)}
        kept = lambda line: next((n for p, n in by_start.items() if re.match(p, line)), line)
        return [kept(line) for line in lines]

    rows = rerender_table(folder / "table", per_seed, paired="estimation_error", notes=notes)
    summary.pop("methods", None)
    _write_summary(folder, "summary.json", summary, rows, per_seed, 0.0)
    if source.name == "config.json":
        source.unlink()
    return json.loads((folder / "summary.json").read_text())


def _sensitivity(folder: pathlib.Path) -> None:
    summaries = {name: _synthetic(folder / name) for name in synthetic_ridge.SETTINGS}
    old = (folder / "summary.md").read_text()
    command = re.search(r"Command: `python -m experiments\.synthetic_ridge (.*?)`", old).group(1)
    fields = {f.name for f in dataclasses.fields(synthetic_ridge.SyntheticConfig)}
    config = {k: v for k, v in summaries["default"]["config"].items() if k in fields}
    base = dataclasses.replace(synthetic_ridge.SyntheticConfig(), **config)
    synthetic_ridge.sensitivity_table(base, summaries, folder, command=command)


def rerender_folder(folder: pathlib.Path) -> None:
    """Re-renders every table of one results folder (its name says which study)."""
    folder = pathlib.Path(folder)
    name = folder.name
    if name == "heart_disease":
        _heart_disease(folder)
    elif name.startswith("femnist"):
        _femnist(folder)
    elif name.startswith("synthetic_sensitivity"):
        _sensitivity(folder)
    elif name.startswith("synthetic"):
        _synthetic(folder)
    else:
        raise ValueError(f"no re-renderer for {folder} (heart_disease, femnist*, synthetic*)")
    print(f"re-rendered {folder}")


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point: the results folders to re-render."""
    folders = list(sys.argv[1:] if argv is None else argv)
    if not folders:
        raise SystemExit("usage: python -m experiments.rerender results/<study> [...]")
    for folder in folders:
        rerender_folder(pathlib.Path(folder))


if __name__ == "__main__":
    main()
