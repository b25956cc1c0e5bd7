"""The comparison protocol every study runs: CV folds x seeds, grids, final fits.

A study compares methods on ``S`` seeds, each with its own training and test data; every
method with hyperparameters is cross-validated per seed. The path of a study:

0. Each seed's clients: a loader of :mod:`karula_jax.data`, or a pool of samples split by
   :func:`~karula_jax.data.split_label_skew`, :func:`~karula_jax.data.split_dirichlet` or
   :func:`~karula_jax.data.split_feature_shift`.
1. :mod:`~karula_jax.protocol.datasets`: :func:`stack_datasets` stacks the seeds' data,
   :func:`cv_datasets` lays out the ``S (K + 1)`` members (folds and final fits),
   :func:`member_dissimilarities` gives every member its D, :func:`cluster_labels` its
   clients' groups.
2. :mod:`~karula_jax.protocol.rates`: the step-size rules (:func:`smoothness_rates` from
   :func:`smoothness_constants`; :func:`member_default_rates`, each method's default;
   :func:`default_rate_rules`, every rule from those defaults, with the
   :data:`RATE_MULTIPLES` of each that CV chooses among).
3. :mod:`~karula_jax.protocol.methods`: the registry, one :class:`MethodRow` per method
   (factory, tuned hyperparameter and grid, rate rules, display name);
   :func:`build_methods` makes the study's :class:`Method` objects; :func:`register`
   adds a method.
4. :mod:`~karula_jax.protocol.cv`: :func:`cross_validate` trains a method on every member
   and grid point with :func:`karula_jax.training.run_many` and picks a point per seed;
   :func:`compare` does so for every method, and flags every method whose training
   loss did not flatten by the last round (raise ``num_rounds``).
   :mod:`~karula_jax.protocol.report`: :func:`write_comparison` writes its table and
   figure in one call.
5. :mod:`~karula_jax.protocol.study`: the study driver. :func:`draw_study` (data draws ->
   stacked CV layout -> D per member), :func:`compare`, :func:`study_rows` and
   :func:`write_study` (one table, JSON and figure writer); :func:`run_study` runs them on
   a :class:`Study` (:func:`logistic_study`: a whole study of logistic regression).

``notebooks/04_your_own_data_and_method.ipynb`` walks this path with a data set and a
method of one's own.
"""

from karula_jax.protocol.cv import CVOutcome, compare, cross_validate
from karula_jax.protocol.datasets import (
    CVData,
    cluster_labels,
    cv_datasets,
    mean_normalized,
    member_dissimilarities,
    stack_datasets,
)
from karula_jax.protocol.merge import MergedRuns, merge_runs
from karula_jax.protocol.methods import (
    GRID_KINDS,
    REGISTRY,
    STEP_KEYWORDS,
    SUITE,
    TAGS,
    Method,
    MethodRow,
    build_methods,
    choice_grid,
    cross_choice,
    grid_of,
    register,
    scalar_grid,
    tagged,
)
from karula_jax.protocol.rates import (
    RATE_MULTIPLES,
    RateRules,
    default_rate_rules,
    default_rates,
    member_default_rates,
    smoothness_constants,
    smoothness_rates,
    summed_loss_rate,
)
from karula_jax.protocol.report import comparison_values, write_comparison
from karula_jax.protocol.study import (
    Draw,
    Report,
    Study,
    StudyData,
    StudyResult,
    describe_grids,
    draw_study,
    fix_choices,
    logistic_study,
    logistic_t_grid,
    pooled_choice,
    run_study,
    selected,
    study_data,
    study_rows,
    write_study,
)
from karula_jax.protocol.t_grid import binding_t_grid, member_t_grid

__all__ = [
    "GRID_KINDS",
    "RATE_MULTIPLES",
    "REGISTRY",
    "STEP_KEYWORDS",
    "SUITE",
    "TAGS",
    "CVData",
    "CVOutcome",
    "Draw",
    "Method",
    "MergedRuns",
    "MethodRow",
    "RateRules",
    "Report",
    "Study",
    "StudyData",
    "StudyResult",
    "binding_t_grid",
    "build_methods",
    "choice_grid",
    "cross_choice",
    "cluster_labels",
    "compare",
    "comparison_values",
    "cross_validate",
    "cv_datasets",
    "default_rate_rules",
    "default_rates",
    "describe_grids",
    "draw_study",
    "fix_choices",
    "grid_of",
    "logistic_study",
    "logistic_t_grid",
    "mean_normalized",
    "member_default_rates",
    "member_dissimilarities",
    "member_t_grid",
    "merge_runs",
    "pooled_choice",
    "register",
    "run_study",
    "scalar_grid",
    "selected",
    "smoothness_constants",
    "smoothness_rates",
    "summed_loss_rate",
    "stack_datasets",
    "study_data",
    "study_rows",
    "tagged",
    "write_comparison",
    "write_study",
]
