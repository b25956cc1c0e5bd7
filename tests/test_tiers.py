"""The fast tier (``pytest -m "not slow"``) leaves out what conftest names, and only that."""

import ast
import pathlib

import conftest

TESTS = pathlib.Path(__file__).parent


def _test_functions(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_slow_name_is_a_test_of_its_module():
    stale = [
        f"{module}::{name}"
        for module, names in conftest.SLOW_TESTS.items()
        for name in names
        if not (TESTS / module).is_file() or name not in _test_functions(TESTS / module)
    ]
    assert not stale, f"conftest.SLOW_TESTS names tests that do not exist: {stale}"


def test_the_fast_tier_keeps_a_test_of_every_module_it_thins():
    for module, names in conftest.SLOW_TESTS.items():
        tests = {n for n in _test_functions(TESTS / module) if n.startswith("test_")}
        if module != "test_doctests.py":  # one parametrized function: all or nothing
            assert tests - set(names), f"{module}: every test is slow; list it in _SLOW_MODULES"
