"""Where a result came from: the date, commit, machine and versions of a run (host side).

A results page states its run once, in a header that the run itself writes:
:func:`run_provenance` reads the facts, :func:`provenance_header` turns them into two
Markdown lines, and :func:`stamp_page` puts those lines into a page between two marker
comments, leaving everything else on the page (the findings, written by hand) as it is.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import platform
import subprocess
from typing import Any

import jax

__all__ = [
    "HEADER_BEGIN",
    "HEADER_END",
    "committed",
    "machine_text",
    "provenance_header",
    "run_provenance",
    "stamp_page",
]

HEADER_BEGIN = "<!-- run header: written by the command below; do not edit -->"
HEADER_END = "<!-- end of run header -->"


def _git(args: list[str], cwd: pathlib.Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def run_provenance(repo: str | os.PathLike | None = None) -> dict[str, Any]:
    """The facts a results page states about its run.

    Args:
      repo: a folder inside the git checkout whose commit is reported (default: this
        package's folder).

    Returns:
      ``{"date": "YYYY-MM-DD" (UTC), "commit": short hash or "unknown", "dirty": whether
      tracked files differ from the commit (None when unknown), "cpu": the processor's
      name, "cores": logical cores, "devices": e.g. "2 x cpu" or "1 x NVIDIA H200",
      "jax": version, "python": version}``.
    """
    where = pathlib.Path(repo) if repo is not None else pathlib.Path(__file__).parent
    commit = _git(["rev-parse", "--short", "HEAD"], where)
    status = _git(["status", "--porcelain", "--untracked-files=no"], where)
    devices = jax.devices()
    kinds = sorted({d.device_kind if d.platform != "cpu" else "cpu" for d in devices})
    return {
        "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
        "commit": commit or "unknown",
        "dirty": None if status is None else bool(status),
        "cpu": _cpu_name(),
        "cores": os.cpu_count() or 0,
        "devices": f"{len(devices)} x {', '.join(kinds)}",
        "jax": jax.__version__,
        "python": platform.python_version(),
    }


def committed(path: str | os.PathLike) -> tuple[str, str] | None:
    """``(short hash, "YYYY-MM-DD")`` of the commit that added ``path`` to git (its author
    date), or None where git or the file's history is unavailable: where a result written
    before runs recorded their provenance entered the repository."""
    path = pathlib.Path(path).resolve()
    out = _git(["log", "--diff-filter=A", "--format=%h %as", "--", path.name], path.parent)
    if not out:
        return None
    commit, date = out.splitlines()[-1].split()
    return commit, date


def provenance_header(provenance: dict[str, Any], *, seconds: float | None = None) -> str:
    """Two Markdown list lines, ``- **Run:** ...`` and ``- **Machine:** ...``.

    Args:
      provenance: from :func:`run_provenance`.
      seconds: the run's wall-clock time, or None.

    Examples:
      >>> from karula_jax.provenance import provenance_header
      >>> facts = dict(date="2026-12-02", commit="abc1234", dirty=False, cpu="AMD EPYC",
      ...              cores=2, devices="2 x cpu", jax="0.12.0", python="3.13.0")
      >>> print(provenance_header(facts, seconds=61.4))
      - **Run:** 2026-12-02, commit abc1234, jax 0.12.0, Python 3.13.0; 61 s wall.
      - **Machine:** AMD EPYC, 2 cores; JAX devices: 2 x cpu.
    """
    p = provenance
    commit = p["commit"] + (" with uncommitted changes" if p.get("dirty") else "")
    wall = f"; {seconds:.0f} s wall" if seconds is not None else ""
    run = f"- **Run:** {p['date']}, commit {commit}, jax {p['jax']}, Python {p['python']}{wall}."
    return f"{run}\n- **Machine:** {machine_text(p)}."


def machine_text(provenance: dict[str, Any]) -> str:
    """The machine of :func:`run_provenance`'s facts: ``"AMD EPYC, 2 cores; JAX devices:
    2 x cpu"``."""
    p = provenance
    return f"{p['cpu']}, {p['cores']} cores; JAX devices: {p['devices']}"


def stamp_page(page: str | os.PathLike, header: str) -> bool:
    """Writes ``header`` into ``page`` between :data:`HEADER_BEGIN` and :data:`HEADER_END`.

    The markers' block is replaced when the page has one; otherwise it goes right after
    the page's first line (its title). A page that does not exist is left alone: results
    pages are written by hand, the run only keeps their header current.

    Args:
      page: a Markdown file.
      header: the lines to put there (:func:`provenance_header`).

    Returns:
      Whether the page was written.

    Raises:
      ValueError: the page has one marker without the other, or more than one block.
    """
    page = pathlib.Path(page)
    if not page.is_file():
        return False
    text = page.read_text(encoding="utf-8")
    block = f"{HEADER_BEGIN}\n{header.strip()}\n{HEADER_END}"
    begins, ends = text.count(HEADER_BEGIN), text.count(HEADER_END)
    if (begins, ends) == (1, 1) and text.index(HEADER_BEGIN) < text.index(HEADER_END):
        start, stop = text.index(HEADER_BEGIN), text.index(HEADER_END) + len(HEADER_END)
        text = text[:start] + block + text[stop:]
    elif (begins, ends) == (0, 0):
        title, _, rest = text.partition("\n")
        text = f"{title}\n\n{block}\n\n{rest.lstrip(chr(10))}"
    else:
        raise ValueError(
            f"page {page} must hold exactly one run header block ({HEADER_BEGIN!r} then "
            f"{HEADER_END!r}), found {begins} and {ends}"
        )
    page.write_text(text, encoding="utf-8")
    return True
