"""What experiments measure: client-wise cross-validation, per-client metrics, D's quality.

One module per job, every name re-exported here:

* :mod:`~karula_jax.evaluation.cross_validation`: :func:`fold_ids` / :func:`kfold_split`
  split every client's rows into ``K`` folds (so every client is in every fold's training
  and validation data) and return the ``K`` training and validation
  :class:`~karula_jax.data.ClientData` stacked on a leading fold axis, ready to be trained
  as a batch (:func:`karula_jax.training.run_many`). :func:`select_by_cv` picks one grid
  point per seed from the validation scores; :func:`grid_edge` and :func:`grid_plateau`
  flag a choice at an end of its grid.
* :mod:`~karula_jax.evaluation.curves`: :func:`tail_start` and :func:`flattened`, whether
  a training-loss curve has stopped moving.
* :mod:`~karula_jax.evaluation.metrics`: per-client metrics (jit/vmap friendly, padding
  masked by ``counts``, outputs ``[n]``): :func:`estimation_error`,
  :func:`mean_squared_error`, :func:`r2_score`, :func:`accuracy`, :func:`log_loss`. Models
  enter through ``apply_fn(params_i, x) -> outputs``, the convention of
  :mod:`karula_jax.models` (``model.apply`` for flax models, ``lambda theta, x: x @ theta``
  for a linear model).
* :mod:`~karula_jax.evaluation.references`: exact host-side references,
  :func:`ridge_solutions` (closed-form ridge fits) and :func:`exact_pairwise_w1` (exact W1
  between clients with POT, a reference for the embedding's ``D``).
* :mod:`~karula_jax.evaluation.diagnostics`: dissimilarities against models (host side,
  numpy): :func:`pairwise_sq_distances` between client models, :func:`spearman_offdiag`
  (rank correlation of two dissimilarity matrices), :func:`active_fraction` (Karula's
  binding constraints).
"""

from karula_jax.evaluation.cross_validation import PLATEAU_RTOL as PLATEAU_RTOL
from karula_jax.evaluation.cross_validation import (
    CVSelection,
    diverged,
    fold_ids,
    grid_edge,
    grid_next_to_diverged,
    grid_plateau,
    kfold_split,
    select_by_cv,
)
from karula_jax.evaluation.cross_validation import check_fold_ids as check_fold_ids
from karula_jax.evaluation.curves import FLAT_TOL as FLAT_TOL
from karula_jax.evaluation.curves import FLAT_WINDOW as FLAT_WINDOW
from karula_jax.evaluation.curves import flattened, round_loss_flattened, tail_start
from karula_jax.evaluation.diagnostics import (
    active_fraction,
    pairwise_sq_distances,
    spearman_offdiag,
)
from karula_jax.evaluation.metrics import ApplyFn as ApplyFn
from karula_jax.evaluation.metrics import (
    accuracy,
    estimation_error,
    log_loss,
    mean_squared_error,
    r2_score,
)
from karula_jax.evaluation.references import exact_pairwise_w1, ridge_solutions

# PLATEAU_RTOL, FLAT_TOL, FLAT_WINDOW, check_fold_ids and ApplyFn are re-exported ("x as
# x") but not in __all__: importable from here, not part of what a user calls.
__all__ = [
    "CVSelection",
    "accuracy",
    "active_fraction",
    "diverged",
    "estimation_error",
    "exact_pairwise_w1",
    "flattened",
    "fold_ids",
    "grid_edge",
    "grid_next_to_diverged",
    "grid_plateau",
    "kfold_split",
    "log_loss",
    "mean_squared_error",
    "pairwise_sq_distances",
    "r2_score",
    "ridge_solutions",
    "round_loss_flattened",
    "select_by_cv",
    "spearman_offdiag",
    "tail_start",
]
