"""Where the experiments read data and write results (the writers: :mod:`karula_jax.reporting`
for the studies, :mod:`karula_jax.benchmarking` for the benchmarks).

Every experiment writes under :data:`OUTPUT` (``runs/``, ignored by git; the environment
variable ``KARULA_OUTPUT_DIR`` moves it), in the layout of the committed ``results/``: running
a study or a benchmark never changes the checkout. The committed pages are refreshed on
purpose, by naming them: ``--out results/synthetic`` (or ``KARULA_OUTPUT_DIR=results``).
"""

from __future__ import annotations

import os
import pathlib

__all__ = ["DATA_DIR", "OUTPUT"]

REPO = pathlib.Path(__file__).resolve().parents[1]
OUTPUT = pathlib.Path(os.environ.get("KARULA_OUTPUT_DIR", REPO / "runs"))
DATA_DIR = pathlib.Path(os.environ.get("KARULA_DATA_DIR", REPO.parent / "shared" / "data"))
