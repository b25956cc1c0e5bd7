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
