"""The run header a study writes on its results page (karula_jax.provenance)."""

import subprocess

import pytest

from karula_jax import provenance as pv

FACTS = dict(date="2026-12-02", commit="abc1234", dirty=False, cpu="Some CPU", cores=2,
             devices="2 x cpu", jax="0.12.0", python="3.13.0")  # fmt: skip


def test_header_states_run_and_machine_once():
    text = pv.provenance_header(FACTS)
    assert text.splitlines() == [
        "- **Run:** 2026-12-02, commit abc1234, jax 0.12.0, Python 3.13.0.",
        "- **Machine:** Some CPU, 2 cores; JAX devices: 2 x cpu.",
    ]
    dirty = pv.provenance_header(FACTS | {"dirty": True}, seconds=3.6)
    assert "commit abc1234 with uncommitted changes" in dirty and "; 4 s wall." in dirty


def test_stamp_inserts_after_the_title_then_replaces_only_its_block(tmp_path):
    page = tmp_path / "README.md"
    page.write_text("# Study\n\n**Finding.**\n\n| a |\n")
    assert pv.stamp_page(page, "- first")
    once = page.read_text()
    assert once.startswith(
        f"# Study\n\n{pv.HEADER_BEGIN}\n- first\n{pv.HEADER_END}\n\n**Finding.**"
    )
    assert pv.stamp_page(page, "- second\n- lines")
    twice = page.read_text()
    assert twice == once.replace("- first", "- second\n- lines")
    assert twice.count(pv.HEADER_BEGIN) == 1 and twice.endswith("| a |\n")


def test_stamp_leaves_a_missing_page_alone_and_refuses_a_broken_block(tmp_path):
    assert not pv.stamp_page(tmp_path / "README.md", "- x")
    assert not (tmp_path / "README.md").exists()
    page = tmp_path / "broken.md"
    page.write_text(f"# T\n{pv.HEADER_BEGIN}\n- x\n")  # no end marker
    with pytest.raises(ValueError, match="exactly one run header block"):
        pv.stamp_page(page, "- y")
    assert page.read_text() == f"# T\n{pv.HEADER_BEGIN}\n- x\n"


def _git(cwd, *args):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True)


def test_provenance_reads_the_commit_and_whether_the_tree_differs(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "f.txt").write_text("1")
    _git(tmp_path, "add", "f.txt")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD").stdout.strip()
    facts = pv.run_provenance(tmp_path)
    assert (facts["commit"], facts["dirty"]) == (head, False)
    (tmp_path / "f.txt").write_text("2")
    assert pv.run_provenance(tmp_path)["dirty"] is True
    assert set(facts) == set(FACTS) and facts["cores"] >= 1 and "cpu" in facts["devices"]


def test_provenance_outside_a_checkout_says_unknown(tmp_path):
    facts = pv.run_provenance(tmp_path)
    assert (facts["commit"], facts["dirty"]) == ("unknown", None)


def test_committed_names_the_commit_that_added_a_file_not_a_later_one(tmp_path):
    # A summary rewritten later (a re-render) still dates from the commit that added it.
    commit = lambda: _git(  # noqa: E731
        tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c"
    )
    _git(tmp_path, "init", "-q")
    (tmp_path / "s.json").write_text("1")
    _git(tmp_path, "add", "s.json")
    commit()
    first = _git(tmp_path, "rev-parse", "--short", "HEAD").stdout.strip()
    (tmp_path / "s.json").write_text("2")
    _git(tmp_path, "add", "s.json")
    commit()
    hash_, date = pv.committed(tmp_path / "s.json")
    assert hash_ == first and len(date) == 10 and date[4] == "-"
    assert pv.committed(tmp_path / "never_added.json") is None


def test_merged_femnist_header_takes_each_runs_own_facts(tmp_path):
    # One run recorded its provenance, one predates it (outside git: "not recorded").
    import json

    from experiments import femnist

    facts = FACTS | {"date": "2026-12-03", "commit": "abc1234"}
    summaries = {
        "a": {"provenance": facts, "total_seconds": 1234.0, "jax_version": "0.12.0"},
        "b": {"devices": ["cpu:0"], "total_seconds": 60.4, "jax_version": "0.10.2"},
    }
    for run, summary in summaries.items():
        (tmp_path / f"summary_{run}.json").write_text(json.dumps(summary))
    header = femnist.merged_runs_header(tmp_path, summaries)
    run, machine = header.splitlines()
    assert run.startswith("- **Runs:** the verdict table merged from 2 runs: ")
    assert "`a` (2026-12-03, commit abc1234; jax 0.12.0; 1,234 s wall)" in run
    assert "`b` (not recorded; jax 0.10.2; 60 s wall)" in run
    assert f"{FACTS['cpu']}, {FACTS['cores']} cores; JAX devices: {FACTS['devices']}" in machine
    assert "not recorded by the run; JAX devices: cpu:0" in machine
