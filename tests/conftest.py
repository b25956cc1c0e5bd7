"""Shared test setup: float32 JAX on the CPU, data paths."""

import os
import pathlib

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = pathlib.Path(os.environ.get("KARULA_DATA_DIR", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data_dir() -> pathlib.Path:
    """The real data folder (``../shared/data``); it must exist, tests never skip on it."""
    assert SHARED_DATA.is_dir(), f"shared data folder not found at {SHARED_DATA}"
    return SHARED_DATA
