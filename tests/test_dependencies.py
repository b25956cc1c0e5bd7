"""Every package the project imports is declared in pyproject.toml, in the right place.

A package preinstalled on a developer's or CI's machine hides a missing declaration: the
suite passes there and fails on a fresh machine (``hypothesis`` was imported by two test
modules and declared nowhere). This test reads the imports of every source file and every
notebook code cell (``ast``, nothing is imported) and checks each third-party one against
the extras that the code's users install:

==============================  =============================================
where the import is             what must declare it
==============================  =============================================
``karula_jax``, module level    ``[project] dependencies``
``karula_jax``, in a function   dependencies or the ``experiments`` extra (a
                                lazy import behind an ImportError message)
``experiments/``                dependencies or ``experiments``
``tests/``, ``notebooks/``      dependencies or ``dev`` (with the extras it
                                names, e.g. ``karula_jax[experiments]``)
==============================  =============================================

``.ci/run`` installs ``.[dev]`` into a virtual environment it creates, so the suite itself
also fails on an undeclared import; this test names it first, and for the narrower extras.
"""

from __future__ import annotations

import ast
import functools
import json
import pathlib
import re
import sys
import tomllib
from importlib import metadata

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PROJECT = "karula-jax"
LOCAL = {"karula_jax", "experiments", "tests", "conftest"}
# Import names whose distribution is named differently (also used when not installed).
DISTRIBUTION_OF = {
    "ot": "pot",
    "sklearn": "scikit-learn",
    "yaml": "pyyaml",
    "PIL": "pillow",
    "ott": "ott-jax",
}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement(spec: str) -> tuple[str, set[str]]:
    """``"karula_jax[experiments] >= 1; python_version < '3.11'"`` -> name and extras."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", spec)
    assert m, f"unreadable requirement {spec!r} in pyproject.toml"
    extras = {_normalize(e) for e in (m.group(2) or "").split(",") if e.strip()}
    return _normalize(m.group(1)), extras


def _declared() -> dict[str, set[str]]:
    """Distribution names per install target: ``"core"`` and each extra (extras expanded)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    raw = {"core": project["dependencies"], **project.get("optional-dependencies", {})}
    raw = {_normalize(k) if k != "core" else k: v for k, v in raw.items()}

    def expand(target: str, seen: frozenset = frozenset()) -> set[str]:
        names = set()
        for spec in raw[target]:
            name, extras = _requirement(spec)
            if name == PROJECT:  # a self-reference: karula_jax[experiments]
                for extra in extras - seen:
                    names |= expand(extra, seen | {extra})
            else:
                names.add(name)
        return names

    core = expand("core")
    return {k: core | expand(k) for k in raw}


@functools.cache
def _installed() -> dict[str, list[str]]:
    return metadata.packages_distributions()  # scans every installed package: once


def _distribution(module: str) -> str:
    if module in DISTRIBUTION_OF:
        return DISTRIBUTION_OF[module]
    installed = _installed().get(module)
    return _normalize(installed[0]) if installed else _normalize(module)


def _imports(source: str) -> list[tuple[str, bool]]:
    """Top-level module names imported by ``source``, each with whether the import sits
    at module level (not inside a function)."""
    tree = ast.parse(source)
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import):
                found.extend((a.name.split(".")[0], not in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.module.split(".")[0], not in_function))
            visit(child, nested)

    visit(tree, False)
    return found


def _notebook_sources(path: pathlib.Path) -> list[str]:
    cells = json.loads(path.read_text())["cells"]
    sources = ("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    # IPython magics and shell escapes are not Python
    return [
        "\n".join(ln for ln in s.splitlines() if not ln.lstrip().startswith(("%", "!")))
        for s in sources
    ]


def _third_party(module: str, local: set[str]) -> bool:
    return module not in sys.stdlib_module_names and module not in local and module != "__future__"


def _sources():
    """``(file, source, allowed targets for module-level, for function-level imports)``."""
    test_helpers = {p.stem for p in (REPO / "tests").glob("*.py")}
    for path in sorted((REPO / "karula_jax").rglob("*.py")):
        yield path, path.read_text(), ("core",), ("core", "experiments"), LOCAL
    for path in sorted((REPO / "experiments").glob("*.py")):
        yield path, path.read_text(), ("experiments",), ("experiments",), LOCAL
    for path in sorted((REPO / "tests").glob("*.py")):
        yield path, path.read_text(), ("dev",), ("dev",), LOCAL | test_helpers
    for path in sorted((REPO / "notebooks").glob("*.ipynb")):
        for source in _notebook_sources(path):
            yield path, source, ("dev",), ("dev",), LOCAL


def undeclared_imports() -> list[str]:
    """One line per import that the install target of its file does not declare."""
    declared = _declared()
    problems = []
    for path, source, top_level, in_function, local in _sources():
        for module, at_top in _imports(source):
            if not _third_party(module, local):
                continue
            targets = top_level if at_top else in_function
            dist = _distribution(module)
            if not any(dist in declared[t] for t in targets):
                where = "module level" if at_top else "inside a function"
                problems.append(
                    f"{path.relative_to(REPO)} imports {module} ({where}); distribution "
                    f"{dist!r} is declared in none of {', '.join(targets)}"
                )
    return sorted(set(problems))


def test_every_import_is_declared_where_its_users_install_it():
    problems = undeclared_imports()
    assert not problems, "\n".join(problems)


def test_the_check_sees_an_undeclared_import(monkeypatch):
    """Power check: the test above fails when a test module imports something undeclared,
    when the library imports an extra-only package at module level, and when an
    experiment imports a dev-only one."""
    real = _sources

    def planted():
        yield from real()
        yield REPO / "tests/planted.py", "import hypothesis_nope\n", ("dev",), ("dev",), LOCAL
        yield REPO / "karula_jax/planted.py", "import ot\n", ("core",), ("core",), LOCAL
        yield REPO / "experiments/planted.py", "import pytest\n", ("experiments",), (), LOCAL

    monkeypatch.setattr(sys.modules[__name__], "_sources", planted)
    problems = undeclared_imports()
    assert len(problems) == 3, problems
    assert any("hypothesis_nope" in p for p in problems)
    assert any("karula_jax/planted.py imports ot (module level)" in p for p in problems)
    assert any("experiments/planted.py imports pytest" in p for p in problems)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("jax>=0.10.2,<0.11", ("jax", set())),
        ("karula_jax[experiments]", ("karula-jax", {"experiments"})),
        ("tomli>=2; python_version < '3.11'", ("tomli", set())),
        ("POT>=0.9.4", ("pot", set())),
    ],
)
def test_requirement_names(spec, expected):
    assert _requirement(spec) == expected
