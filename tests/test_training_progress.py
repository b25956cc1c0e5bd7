"""The progress bar (``karula_jax.training.progress``).

They run on the toy algorithm of ``tests/_training_helpers.py``, so that they do not
depend on the real algorithms.
"""

import jax
from _training_helpers import (
    ALG,
    DATA,
    PARAMS,
    eval_fn,
    fresh_trace_counters,  # noqa: F401 - the autouse fixture
)

from karula_jax import training


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
