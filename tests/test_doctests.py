"""The ``Examples:`` blocks of the library's docstrings run and print what they show.

Every module of ``karula_jax`` is searched (``doctest.DocTestFinder`` keeps the objects a
module defines, not those it imports), so an example added anywhere runs here. The
examples are kept small (a few clients, a few rounds, rounded numbers and shapes) so that
their output is the same on every supported jax and CPU; their compilations are most of
this file's time.
"""

from __future__ import annotations

import doctest
import importlib
import io
import pkgutil

import pytest

import karula_jax

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
# Entry points a user calls first carry an example (STYLE 21); at least this many do.
MIN_DOCUMENTED = 15


def _modules() -> list[str]:
    names = [karula_jax.__name__]
    for info in pkgutil.walk_packages(karula_jax.__path__, prefix="karula_jax."):
        names.append(info.name)
    return sorted(names)


def _examples(name: str) -> list[doctest.DocTest]:
    """The docstrings of module ``name`` (and of what it defines) that have examples."""
    module = importlib.import_module(name)
    tests = doctest.DocTestFinder(exclude_empty=True).find(module)
    return sorted((t for t in tests if t.examples), key=lambda t: t.name)


EXAMPLES = {name: tests for name in _modules() if (tests := _examples(name))}


@pytest.mark.parametrize("module", sorted(EXAMPLES))
def test_examples_print_what_they_show(module):
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report = io.StringIO()
    for test in EXAMPLES[module]:
        runner.run(test, out=report.write)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, report.getvalue()


def test_enough_entry_points_have_examples():
    documented = [
        test.name for tests in EXAMPLES.values() for test in tests if test.name not in EXAMPLES
    ]
    assert len(documented) >= MIN_DOCUMENTED, documented
    for name in (
        "karula_jax.algorithms.karula.karula",
        "karula_jax.training.loop.run",
        "karula_jax.protocol.cv.compare",
        "karula_jax.stats.mean_and_se",
    ):
        assert name in documented, name
