"""Where the suite's time goes: JAX tracing, lowering and XLA compilation per test module.

``pytest --compile-report`` (tests/conftest.py registers :class:`Plugin`) listens to JAX's
own compile events in every process that runs tests (each xdist worker), attaches each
test's sums to its teardown report (``user_properties``, which xdist sends to the
controller) and prints one table at the end: per module, the test time (setup, call and
teardown), the seconds in XLA's backend compiler, in tracing and lowering to StableHLO,
and how many programs were compiled and how many read back from the on-disk compilation
cache. Programs compiled inside subprocesses (notebook kernels, sharding and distributed
runs) are not seen: their time counts as the test's and no compile's.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import jax.monitoring
import pytest

# JAX's event names (jax/_src/dispatch.py and jax/_src/compiler.py).
_COMPILE = "/jax/core/compile/backend_compile_duration"  # also on a cache hit (its read)
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_retrieval_time_sec"
PROPERTY = "jax_compile"  # the user_properties key of a test's sums

_current: collections.Counter = collections.Counter()
_listening = False


def _listen(event: str, duration: float, **_) -> None:
    if event == _COMPILE:
        _current["compile_s"] += duration
        _current["compiles"] += 1
    elif event in (_TRACE, _LOWER):
        _current["trace_s"] += duration
    elif event == _CACHE_HIT:
        _current["cache_hits"] += 1


def start() -> None:
    """Registers the listener in this process (once)."""
    global _listening
    if not _listening:
        jax.monitoring.register_event_duration_secs_listener(_listen)
        _listening = True


def reset() -> None:
    """Starts a test's sums."""
    _current.clear()


def snapshot() -> dict[str, float]:
    """This test's sums so far: compile_s, trace_s, compiles, cache_hits."""
    return {k: _current[k] for k in ("compile_s", "trace_s", "compiles", "cache_hits")}


class Totals:
    """Per-module sums of the reports the controller receives."""

    def __init__(self) -> None:
        self.modules: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def add(self, nodeid: str, duration: float, properties: Iterable[tuple[str, object]]):
        row = self.modules[nodeid.split("::")[0]]
        row["test_s"] += duration
        for name, value in properties:
            if name == PROPERTY:
                row.update(value)

    def lines(self, top: int = 20) -> list[str]:
        """The table, heaviest modules first, with a total row and its shares."""
        if not self.modules:
            return ["compile report: no test reports"]
        total = collections.Counter()
        for row in self.modules.values():
            total.update(row)
        columns = ("test s", 8), ("compile s", 9), ("trace s", 8), ("compiled", 8), ("cached", 7)
        head = " ".join(f"{name:>{width}}" for name, width in columns) + "  module"
        out = ["JAX compile report (seconds summed over tests and workers)", head]
        ranked = sorted(self.modules.items(), key=lambda kv: -kv[1]["test_s"])
        for name, row in [*ranked[:top], ("total", total)]:
            compiled = row["compiles"] - row["cache_hits"]
            out.append(
                f"{row['test_s']:8.1f} {row['compile_s']:9.1f} {row['trace_s']:8.1f} "
                f"{compiled:8.0f} {row['cache_hits']:7.0f}  {name}"
            )
        if total["test_s"] > 0:
            share = lambda k: 100.0 * total[k] / total["test_s"]  # noqa: E731
            out.append(
                f"of the test time: {share('compile_s'):.0f}% XLA compilation, "
                f"{share('trace_s'):.0f}% tracing and lowering (subprocesses not seen)"
            )
        return out


class Plugin:
    """The hooks: each test's sums reset at its setup and attached to its teardown report;
    the controller's totals printed at the end. Registered only with ``--compile-report``,
    so a plain run does no per-test work here."""

    def __init__(self) -> None:
        start()
        self.totals = Totals()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        reset()
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        yield
        item.user_properties.append((PROPERTY, snapshot()))

    def pytest_runtest_logreport(self, report):
        """Sums each test's phases (on the xdist controller, from the workers' reports)."""
        props = report.user_properties if report.when == "teardown" else ()
        self.totals.add(report.nodeid, report.duration, props)

    def pytest_terminal_summary(self, terminalreporter):
        for line in self.totals.lines():
            terminalreporter.write_line(line)
