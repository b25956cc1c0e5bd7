"""The progress bar (``karula_jax.training.progress``).

They run on the toy algorithm of ``tests/_training_helpers.py``, so that they do not
depend on the real algorithms.
"""

import types

import jax
import numpy as np
from _training_helpers import (
    ALG,
    DATA,
    PARAMS,
    eval_fn,
    fresh_trace_counters,  # noqa: F401 - the autouse fixture
)

from karula_jax import training
from karula_jax.training.progress import scalar_summary


def test_progress_bar_on_stderr(capsys):
    kw = dict(key=jax.random.PRNGKey(0), num_rounds=4, chunk_size=2, eval_fn=eval_fn)
    training.run(ALG, PARAMS, DATA, progress=True, **kw)
    err = capsys.readouterr().err
    assert "4/4" in err and "round/s" in err and "loss=" in err and "mean_b=" in err
    training.run(ALG, PARAMS, DATA, progress=False, **kw)
    assert capsys.readouterr().err == ""

    for _ in training.progress_bar(range(3), desc="CV folds", unit="fold"):
        pass
    with training.progress_bar(2, desc="embedding") as bar:
        bar.update(2)
    err = capsys.readouterr().err
    assert "CV folds" in err and "3/3" in err and "embedding" in err and "2/2" in err
    assert list(training.progress_bar([1, 2], enabled=False)) == [1, 2]
    assert capsys.readouterr().err == ""


def test_bar_summary_averages_finite_runs_and_counts_the_others():
    """A diverged grid point of a batch does not turn the bar's means into inf."""
    last = types.SimpleNamespace(loss=np.array([[1.0, np.inf], [3.0, np.nan]]))
    metrics = {"mse": np.array([[[1.0, 3.0], [np.inf, np.inf]], [[5.0, 7.0], [np.nan, 1.0]]])}
    got = scalar_summary(last, metrics)
    assert got == {"loss": 2.0, "mse": 3.4, "nonfinite_runs": 2}
    fine = scalar_summary(types.SimpleNamespace(loss=np.array([1.0, 2.0])), {})
    assert fine == {"loss": 1.5}  # no count when every run is finite
    none = scalar_summary(types.SimpleNamespace(loss=np.array([np.nan])), {})
    assert np.isnan(none["loss"]) and none["nonfinite_runs"] == 1


def test_compilation_is_a_step_before_the_runs_bar_of_rounds(capsys):
    """compile_step's bar completes when the run inside it opens its bar of rounds (its
    programs are compiled by then), and before any round is shown."""
    from karula_jax.training.progress import compile_step

    kw = dict(key=jax.random.PRNGKey(3), num_rounds=4, chunk_size=2, eval_fn=eval_fn)
    with compile_step("toy run") as step:
        training.run(ALG, PARAMS, DATA, progress=True, **kw)
        assert step.n == 1  # completed by the bar of rounds, not by the end of the block
    err = capsys.readouterr().err
    assert "toy run: compiling" in err and "1/1" in err
    assert err.index("toy run: compiling") < err.index("4/4")
    with compile_step("silent", enabled=False):
        pass
    assert capsys.readouterr().err == ""
