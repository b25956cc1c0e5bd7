"""Shared test setup: float32 JAX on the CPU, data paths, compiled programs released."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import jax
import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# XLA:CPU compilation is most of the suite's time: the tests compile with LLVM's
# optimization level 0 instead of XLA's default (no fast math, but not bit-identical to the
# default level: no contraction of multiply-adds; the tests compare programs compiled alike;
# the test programs are small, so slower code costs less than the compile time saved:
# measured in alternating runs of three heavy test files, 100-104 s against 139-142 s at
# level 1, which had itself saved 10% against the default).
# The backend reads XLA_FLAGS when it starts, after this file runs; subprocesses (notebook
# kernels, distributed and sharding runs) inherit it.
# Each xdist worker (one per core) also runs XLA's Eigen operations on one thread rather
# than a pool the size of the machine: two workers with two threads each oversubscribe
# two cores (measured: 8% less wall time on four test files with -n 2). LLVM's expensive
# passes are skipped too (compile time; measured: the projection's and a Karula round's
# compilation 15-30% shorter, the same certified gaps to the bit on the cases compared).
# XLA:CPU's older loop emitters replace its fusion emitters, and each worker generates code
# on one thread (the two workers share two cores): four projection programs compiled in
# 4.6-5.1 s against 7.7-8.3 s, a Karula round in 1.5 s against 2.6-3.2 s; the whole suite
# (-n 2, 807 tests, all passing either way) in 456 s against 699 s, its summed test
# durations 870 s against 1,372 s (2026-11-29, run back to back).
_TEST_XLA_FLAGS = (
    ("--xla_backend_optimization_level", "0"),
    ("--xla_cpu_multi_thread_eigen", "false"),
    ("--xla_llvm_disable_expensive_passes", "true"),
    ("--xla_cpu_use_fusion_emitters", "false"),
    ("--xla_cpu_parallel_codegen_split_count", "1"),
)
# XLA aborts the process on a flag it does not know (jax 0.12's XLA dropped
# --xla_cpu_use_fusion_emitters), and pytest's capture hid its message: the flags are set
# only where this XLA accepts them, learnt once from a child process and inherited by the
# xdist workers; a flag the user set that XLA refuses stops the run with XLA's own words.
_PROBED_VAR = "KARULA_TEST_XLA_FLAGS_REFUSED"
_PROBE = "import jax; jax.numpy.zeros(()).block_until_ready()"


def _refused_flags(flags: str) -> tuple[list[str], str]:
    """The flags of ``flags`` that this XLA refuses, and XLA's message (empty if none)."""
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    child = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    if child.returncode == 0:
        return [], ""
    match = re.search(r"Unknown flags? in XLA_FLAGS: (.*)", child.stderr)
    if match is None:
        raise pytest.UsageError(f"JAX fails to start with XLA_FLAGS={flags!r}:\n{child.stderr}")
    return [f.split("=")[0] for f in match.group(1).split()], match.group(0)


def _set_test_xla_flags() -> None:
    if _PROBED_VAR in os.environ:  # an xdist worker: the controller has probed and set them
        return
    user = os.environ.get("XLA_FLAGS", "")
    ours = [f"{flag}={value}" for flag, value in _TEST_XLA_FLAGS if flag not in user]
    refused, message = _refused_flags(" ".join([user, *ours]).strip())
    if set(refused) - {flag for flag, _ in _TEST_XLA_FLAGS}:
        raise pytest.UsageError(f"XLA refuses a flag of your XLA_FLAGS ({message})")
    kept = [f for f in ours if f.split("=")[0] not in refused]
    os.environ["XLA_FLAGS"] = " ".join([user, *kept]).strip()
    os.environ[_PROBED_VAR] = " ".join(refused)


_set_test_xla_flags()


def pytest_terminal_summary(terminalreporter):
    """Says which XLA flags the tests ran with and which of the test flags this XLA refused."""
    refused = os.environ.get(_PROBED_VAR) or "none"
    terminalreporter.write_line(
        f"XLA_FLAGS: {os.environ['XLA_FLAGS']} (test flags this XLA refused: {refused})"
    )


# One on-disk compilation cache per test run, shared by the xdist workers (they inherit the
# environment of the process that loads this file first): many tests compile the same
# programs from new closures or after the per-module cache release below, and XLA:CPU's
# compile time dominates the suite. Set KARULA_TEST_COMPILATION_CACHE=off to disable.
_CACHE_VAR = "KARULA_TEST_COMPILATION_CACHE"
_OWN_CACHE = None
if os.environ.get(_CACHE_VAR) is None:
    _OWN_CACHE = tempfile.mkdtemp(prefix="karula-jax-test-cache-")
    os.environ[_CACHE_VAR] = _OWN_CACHE
if os.environ[_CACHE_VAR] != "off":
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_VAR])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    """The process that made the cache folder removes it at the end of the run."""
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


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


# Modules that run a study, a notebook or several processes end to end: the slow tier, which
# `pytest -m "not slow"` (the inner loop) leaves out and the full suite (CI) runs.
_SLOW_MODULES = {
    "test_distributed.py",
    "test_femnist_experiment.py",
    "test_heart_experiment.py",
    "test_notebooks.py",
    "test_sharding.py",
    "test_study_own_method.py",
    "test_synthetic_experiment.py",
}


def pytest_collection_modifyitems(items):
    """Marks every test of :data:`_SLOW_MODULES` ``slow``."""
    for item in items:
        if item.path.name in _SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
