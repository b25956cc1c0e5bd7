"""The README's first Python example runs and prints what the README says."""

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_commands_and_example():
    text = README.read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1).strip().splitlines()
    assert first_block[0].endswith("python -m experiments.synthetic_ridge")
    assert "python -m pytest" in first_block[1]
    ci = (README.parent / ".ci" / "run").read_text()
    assert first_block[1] in ci, ".ci/run must run the README's test command verbatim"

    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - our own documentation
    claimed = float(re.search(r"# ([0-9.]+) \(Local", code).group(1))
    assert abs(float(out.getvalue().strip()) - claimed) < 0.05


# What a run diary leaves in prose, and what finds it.
_DIARY = {
    "a date": r"\b20\d\d-\d\d-\d\d\b",
    "a commit hash": r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b",
    "an issue number": r"(?i)\bissues? #?\d+|#\d+\b",
    "a clock time": r"\b\d\d:\d\d\b",
}


def test_readme_is_a_front_door_not_a_diary():
    """The README is read in minutes: its line and word budget, and no run history in it
    (dates, commit hashes, issue numbers, clock times): those live in git and CHANGELOG.md."""
    text = README.read_text()
    assert len(text.splitlines()) <= 120, "README.md: at most 120 lines"
    assert len(text.split()) <= 1100, "README.md: at most 1,100 words"
    for what, pattern in _DIARY.items():
        found = re.findall(pattern, text)
        assert not found, f"README.md holds {what}: {found[:3]}"


def test_the_diary_check_sees_planted_history():
    planted = {
        "a date": ("rerun 2026-11-29 at a quiet hour", "2026-11-29"),
        "a commit hash": ("measured on 293b4f4, a quiet hour", "293b4f4"),
        "an issue number": ("issue 24's target of 5x", "issue 24"),
        "a clock time": ("rerun at 23:44", "23:44"),
    }
    for what, (sentence, hit) in planted.items():
        assert re.findall(_DIARY[what], sentence) == [hit], what
        assert not re.findall(_DIARY[what], "a 2-core CPU, 784-100-10 MLP, n = 1000, 1.6x")


def test_own_data_calls_exist_and_are_the_end_to_end_tests():
    """The README's own-data path names real functions, and every one of them is what
    tests/test_own_data_path.py runs end to end on a tiny data set."""
    import karula_jax

    text = README.read_text()
    section = text[text.index("## Your own data") :]
    block = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    calls = set(re.findall(r"\b(data|protocol)\.(\w+)\(", block))
    calls |= set(re.findall(r"\b(protocol)\.(stack_datasets)\b", block))
    assert len(calls) >= 8, calls
    path_test = (README.parent / "tests" / "test_own_data_path.py").read_text()
    for module, name in sorted(calls):
        assert callable(getattr(getattr(karula_jax, module), name)), f"{module}.{name}"
        assert f"{module}.{name}(" in path_test, f"{module}.{name} is not run end to end"


def test_results_pages_are_findings_first_and_short():
    """Every results page: at most 200 lines, its finding (a bold sentence) before its
    first table, and no "Superseded" section (git keeps superseded tables)."""
    pages = sorted((README.parent / "results").glob("*/README.md"))
    assert len(pages) >= 6
    for page in pages:
        text = page.read_text()
        assert len(text.splitlines()) <= 200, f"{page}: at most 200 lines"
        assert "superseded" not in text.lower().split("## tried")[0], page
        first_table = text.find("\n|")
        finding = re.search(r"\*\*[^*]{20,}\*\*", text)  # a bold sentence, not "**Run:**"
        assert finding and finding.start() < first_table, f"{page}: the finding comes first"
