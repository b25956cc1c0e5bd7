"""Where the experiments read data and write results (the writers: :mod:`karula_jax.reporting`)."""

from __future__ import annotations

import os
import pathlib

from karula_jax.reporting import markdown_table, publish

__all__ = ["DATA_DIR", "RESULTS", "markdown_table", "publish"]

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"
DATA_DIR = pathlib.Path(os.environ.get("KARULA_DATA_DIR", REPO.parent / "shared" / "data"))
