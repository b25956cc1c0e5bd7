"""Prints pip constraints that pin each runtime dependency at its declared lower bound.

``.ci/run`` installs the project under these for its "oldest" pass, so the lower bounds in
pyproject.toml are versions the suite has run on, not guesses. Only ``[project]
dependencies`` are pinned; the test tools resolve freely (their versions do not change what
the library computes).
"""

import pathlib
import re
import tomllib

project = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
for spec in project["project"]["dependencies"]:
    match = re.match(r"\s*([A-Za-z0-9._-]+)\s*.*?>=\s*([0-9][^,;\s]*)", spec)
    if match is None:
        raise SystemExit(f"dependency {spec!r} has no lower bound (>=) to test at")
    print(f"{match.group(1)}=={match.group(2)}")
