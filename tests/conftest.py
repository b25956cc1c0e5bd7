"""Shared test setup: float32 JAX on the CPU, data paths, compiled programs released."""

import os
import pathlib

import jax
import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = pathlib.Path(os.environ.get("KARULA_DATA_DIR", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data_dir() -> pathlib.Path:
    """The real data folder (``../shared/data``); it must exist, tests never skip on it."""
    assert SHARED_DATA.is_dir(), f"shared data folder not found at {SHARED_DATA}"
    return SHARED_DATA


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's compiled programs after each test module. Every XLA:CPU executable
    keeps memory mappings of its code; a session that keeps all of them crashed in XLA's
    compiler near the end of the suite (segmentation fault, twice in the same test, which
    passes alone), as the process approaches the kernel's limit on mappings
    (``vm.max_map_count``, 65530 by default)."""
    yield
    jax.clear_caches()
