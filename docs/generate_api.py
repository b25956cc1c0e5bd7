"""Writes ``docs/api.md``, the API reference, from every public subpackage's ``__all__``.

    python docs/generate_api.py          # rewrites docs/api.md
    python docs/generate_api.py --check  # exits 1 if docs/api.md is not what it would write

One section per public subpackage of ``karula_jax`` (those in ``karula_jax.__all__``), in
the order data flows through them; in each, one entry per name of its ``__all__``, in that
order: the signature (``inspect.signature``), the first paragraph of the docstring, its
``Args:`` (or ``Attributes:``) and ``Returns:``, its doctested ``Examples:`` and a link to
the file that defines it. A constant shows the line that assigns it and the comment above
that line. The output depends only on the source: no addresses, dates or paths of this
machine, and the same text under every supported Python, jax and flax
(``tests/test_docs.py`` checks that the committed page is current).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import pathlib
import re
import sys
import typing

REPO = pathlib.Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "api.md"
WIDTH = 96  # a signature longer than this gets one parameter per line

# The subpackages in the order data flows through them (the package docstring's order);
# one that is public but missing here is appended in alphabetical order.
ORDER = (
    "data",
    "models",
    "embedding",
    "projection",
    "algorithms",
    "training",
    "evaluation",
    "protocol",
    "stats",
    "reporting",
    "provenance",
    "theory",
    "benchmarking",
)
SECTION = re.compile(r"^(Args|Arguments|Attributes|Returns|Yields|Raises|Examples?):\s*$")
ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|obj|exc):`~?([^`]+)`")
ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


# --------------------------------------------------------------------------- docstrings


def _markdown(text: str) -> str:
    """reST inline markup as Markdown: ``x`` -> `x`, :func:`~a.b` -> `b`, :func:`a.b` -> `a.b`."""

    def role(m: re.Match) -> str:
        target = m.group(1)
        return f"`{target.rsplit('.', 1)[-1]}`" if m.group(0).count("~") else f"`{target}`"

    return ROLE.sub(role, text).replace("``", "`")


def _own_doc(obj) -> str:
    """The object's own docstring (a class's, not its base's), cleaned; "" if none."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def parse_docstring(doc: str) -> tuple[str, dict[str, list[str]]]:
    """``(first paragraph, {section: its lines, dedented})`` of a Google-style docstring."""
    lines = doc.splitlines()
    first = []
    for line in lines:
        if not line.strip() or SECTION.match(line):
            break
        first.append(line.strip())
    sections: dict[str, list[str]] = {}
    current = None
    for line in lines:
        match = SECTION.match(line)
        if match:
            current = sections.setdefault(match.group(1), [])
        elif current is not None:
            if line.strip() and not line.startswith(" "):
                current = None  # prose after a section ends it
            else:
                current.append(line)
    for name, body in sections.items():
        while body and not body[-1].strip():
            body.pop()
        indent = min((len(b) - len(b.lstrip()) for b in body if b.strip()), default=0)
        sections[name] = [b[indent:] for b in body]
    return " ".join(first), sections


def _entries(body: list[str]) -> list[tuple[str, str]]:
    """``(name, text)`` of an ``Args:`` section: an entry starts at the section's indent."""
    entries: list[tuple[str, str]] = []
    for line in body:
        if line.strip() and not line.startswith(" ") and ":" in line:
            name, text = line.split(":", 1)
            entries.append((name.strip(), text.strip()))
        elif line.strip() and entries:
            name, text = entries[-1]
            entries[-1] = (name, f"{text} {line.strip()}".strip())
    return entries


def _paragraph(body: list[str]) -> str:
    return " ".join(line.strip() for line in body if line.strip())


# --------------------------------------------------------------------------- signatures


class _Text:
    """Shows as the given text where ``inspect`` formats an annotation or a default."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _annotation(a) -> typing.Any:
    if a is inspect.Parameter.empty:
        return a
    if isinstance(a, str):
        return _Text(a)
    if isinstance(a, typing.ForwardRef):
        return _Text(a.__forward_arg__)
    return _Text(ADDRESS.sub("", inspect.formatannotation(a)))


def _default(v) -> typing.Any:
    if v is inspect.Parameter.empty:
        return v
    if inspect.isfunction(v) or inspect.isbuiltin(v) or inspect.isclass(v):
        name = getattr(v, "__qualname__", getattr(v, "__name__", repr(v)))
        module = getattr(v, "__module__", None)
        if name == "<lambda>":
            return _Text("lambda ...")
        return _Text(name if module in (None, "builtins") else f"{module}.{name}")
    return _Text(ADDRESS.sub("", repr(v)))


def _flax_module(obj) -> bool:
    try:
        import flax.linen as nn
    except ImportError:  # pragma: no cover - flax is a dependency
        return False
    return inspect.isclass(obj) and issubclass(obj, nn.Module)


def signature(name: str, obj) -> str | None:
    """``name(params) -> ret``, one parameter per line when long; None without one (an
    exception class shows its base)."""
    if inspect.isclass(obj) and issubclass(obj, BaseException):
        return f"class {name}({obj.__base__.__name__})"
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = [
        p.replace(annotation=_annotation(p.annotation), default=_default(p.default))
        for p in sig.parameters.values()
        if not (_flax_module(obj) and p.name in ("parent", "name"))  # flax's own fields
    ]
    sig = sig.replace(
        parameters=params,
        return_annotation=(
            inspect.Signature.empty if inspect.isclass(obj) else _annotation(sig.return_annotation)
        ),
    )
    text = str(sig)
    head = f"class {name}" if inspect.isclass(obj) else name
    if len(head) + len(text) <= WIDTH:
        return head + text
    ret = sig.return_annotation
    ret = "" if ret is inspect.Signature.empty else f" -> {ret!r}"
    params = list(sig.parameters.values())
    parts, star = [], False
    for i, p in enumerate(params):  # str(sig) marks keyword-only with a bare *, as here
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
        star = star or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
        parts.append(str(p))
        last_positional = i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY
        if p.kind is p.POSITIONAL_ONLY and last_positional:
            parts.append("/")
    body = "".join(f"    {part},\n" for part in parts)
    return f"{head}(\n{body}){ret}"


# --------------------------------------------------------------------------- constants


def _files(module) -> list[pathlib.Path]:
    path = pathlib.Path(module.__file__)
    return sorted(path.parent.rglob("*.py")) if path.name == "__init__.py" else [path]


def _assignment(module, name: str) -> tuple[pathlib.Path, str, str] | None:
    """``(file, source line, comment above it)`` of the top-level assignment of ``name``."""
    for path in _files(module):
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.parse(source).body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                segment = ast.get_source_segment(source, node) or name
                comment = []
                row = node.lineno - 2
                while row >= 0 and lines[row].lstrip().startswith("#"):
                    comment.insert(0, lines[row].lstrip()[1:].strip())
                    row -= 1
                return path, segment, " ".join(comment)
    return None


_PLAIN = (str, int, float, bool, type(None))


def _plain(value) -> bool:
    """A value whose ``repr`` is the same on every machine: literals and tuples of them."""
    if isinstance(value, tuple | list | frozenset):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _constant(module, name: str, obj) -> list[str]:
    """A constant: its value where it is plain (else the line assigning it), the comment
    above that line, where it is defined."""
    found = _assignment(module, name)
    if _plain(obj) and len(repr(obj)) <= 4 * WIDTH:
        shown = f"{name} = {obj!r}"
    elif isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
        shown = f"{name} = {{" + ", ".join(f"{k!r}: ..." for k in obj) + "}"
    elif found is not None and len(found[1]) <= WIDTH and "\n" not in found[1]:
        shown = found[1]
    else:
        shown = f"{name}: {type(obj).__name__}"
    out = ["```python", shown, "```", ""]
    if found is not None:
        if found[2]:
            out += [_markdown(found[2]), ""]
        out += [_defined_in(found[0]), ""]
    return out


# --------------------------------------------------------------------------- page


def _defined_in(path: pathlib.Path) -> str:
    rel = path.resolve().relative_to(REPO).as_posix()
    return f"Defined in [`{rel}`](../{rel})."


def _source_file(obj) -> pathlib.Path | None:
    try:
        file = inspect.getsourcefile(inspect.unwrap(obj))
    except TypeError:
        return None
    return pathlib.Path(file) if file else None


def entry(module, name: str) -> list[str]:
    obj = getattr(module, name)
    out = [f"### `{name}`", ""]
    if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
        return out + _constant(module, name, obj)
    sig = signature(name, obj)
    if sig:
        out += ["```python", sig, "```", ""]
    first, sections = parse_docstring(_own_doc(obj))
    if first:
        out += [_markdown(first), ""]
    for key in ("Args", "Arguments", "Attributes"):
        if key in sections:
            out += [f"{'Attributes' if key == 'Attributes' else 'Arguments'}:", ""]
            out += [f"- `{n}`: {_markdown(t)}" for n, t in _entries(sections[key])]
            out.append("")
    for key in ("Returns", "Yields"):
        if key in sections:
            out += [f"{key}: {_markdown(_paragraph(sections[key]))}", ""]
    example = sections.get("Examples") or sections.get("Example")
    if example:
        out += ["Examples:", "", "```python", *example, "```", ""]
    file = _source_file(obj)
    if file is not None and REPO in file.resolve().parents:
        out += [_defined_in(file), ""]
    return out


def _anchor(title: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation but ``-`` and ``_`` dropped."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def subpackages() -> list[str]:
    import karula_jax

    public = list(karula_jax.__all__)
    unknown = set(ORDER) - set(public)
    if unknown:
        raise SystemExit(f"generate_api.ORDER names no public subpackage: {sorted(unknown)}")
    return [n for n in ORDER if n in public] + sorted(set(public) - set(ORDER))


def render() -> str:
    names = subpackages()
    out = [
        "# API reference",
        "",
        "Generated by `python docs/generate_api.py` from each subpackage's `__all__` and the",
        "docstrings; do not edit by hand (`tests/test_docs.py` fails when this page is stale).",
        "The examples are doctests, run by `tests/test_doctests.py`. Overview: [index](index.md).",
        "",
        " · ".join(f"[{n}](#{_anchor('karula_jax.' + n)})" for n in names),
        "",
    ]
    for sub in names:
        module = importlib.import_module(f"karula_jax.{sub}")
        out += [f"## karula_jax.{sub}", ""]
        first, _ = parse_docstring(_own_doc(module))
        if first:
            out += [_markdown(first), ""]
        for name in module.__all__:
            out += entry(module, name)
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT.relative_to(REPO)} is stale: run python docs/generate_api.py")
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
