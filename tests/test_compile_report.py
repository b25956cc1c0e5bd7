"""``pytest --compile-report``: JAX's compile events are seen and summed per module."""

import _compile_report
import jax
import jax.numpy as jnp


def test_a_fresh_program_is_counted_and_its_compile_timed():
    """The listener sees JAX's events under their current names (renamed events would
    leave the report at zero): a program of a shape not compiled before is one trace,
    one lowering and one backend compile at least."""
    _compile_report.start()
    _compile_report.start()  # registering twice would count every event twice
    _compile_report.reset()
    jax.jit(lambda x: jnp.sin(x) * 3.0 + x)(jnp.ones((7, 13)))
    sums = _compile_report.snapshot()
    assert sums["compiles"] >= 1 and sums["compile_s"] > 0 and sums["trace_s"] > 0, sums
    _compile_report.reset()
    assert _compile_report.snapshot() == dict(compile_s=0, trace_s=0, compiles=0, cache_hits=0)


def test_totals_sum_every_phase_per_module_and_rank_them():
    totals = _compile_report.Totals()
    prop = lambda **k: [(_compile_report.PROPERTY, k)]  # noqa: E731
    totals.add("tests/a.py::t1", 1.0, ())  # setup
    totals.add("tests/a.py::t1", 2.0, ())  # call
    totals.add("tests/a.py::t1", 0.5, prop(compile_s=1.5, trace_s=0.5, compiles=3, cache_hits=1))
    totals.add("tests/b.py::t2[x]", 6.0, prop(compile_s=4.0, trace_s=1.0, compiles=2, cache_hits=0))
    totals.add("tests/b.py::t2[x]", 0.0, [("other", 1)])
    lines = totals.lines()
    rows = [line.split() for line in lines[2:-1]]
    assert [row[-1] for row in rows] == ["tests/b.py", "tests/a.py", "total"]
    assert rows[1][:5] == ["3.5", "1.5", "0.5", "2", "1"]  # compiled = compiles - hits
    assert rows[2][:5] == ["9.5", "5.5", "1.5", "4", "1"]
    assert lines[-1].startswith("of the test time: 58% XLA compilation, 16% tracing")
    assert _compile_report.Totals().lines() == ["compile report: no test reports"]
