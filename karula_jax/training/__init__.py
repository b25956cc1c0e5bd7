"""The training driver: federated runs as a few compiled programs.

* :mod:`~karula_jax.training.loop`: :func:`run`, one run as a Python loop over compiled
  chunks of ``lax.scan`` (one compilation, progress bar, metrics every chunk,
  checkpoints and bit-identical resume, the round a NaN appeared in), and the pure
  :func:`scan_rounds`.
* :mod:`~karula_jax.training.batched`: :func:`run_many`, data sets x seeds x
  hyperparameter grids as one compiled program per chunk (:func:`vmap_algorithm`,
  :func:`product_grid`).
* :mod:`~karula_jax.training.checkpoint`: ``.npz`` checkpoints (no pickle, atomic) and
  the fingerprints that make a resume refuse another run.
* :mod:`~karula_jax.training.sharding`: the client or batch axis on a device mesh
  (one process or several: :func:`gather_to_host`); :func:`batch_mesh` and
  :func:`use_cpu_cores` split a batch over every core of a CPU.
* :mod:`~karula_jax.training.progress`: tqdm bars (:func:`progress_bar`).
* :mod:`~karula_jax.training.diagnostics`: what a run reports about itself: projection
  diagnostics (:func:`round_diagnostics`, :class:`ProjectionNotConvergedWarning`),
  non-finite rounds and their likely causes, failed checks of traced inputs.
"""

from karula_jax.training.batched import product_grid, run_many, vmap_algorithm
from karula_jax.training.checkpoint import (
    CHECKPOINT_NAME,
    algorithm_name,
    load_checkpoint,
    save_checkpoint,
)
from karula_jax.training.diagnostics import (
    ProjectionNotConvergedWarning,
    describe_diagnostics,
    round_diagnostics,
)
from karula_jax.training.loop import RunResult, run, scan_rounds
from karula_jax.training.progress import progress_bar
from karula_jax.training.sharding import (
    batch_mesh,
    client_mesh,
    default_batch_mesh,
    gather_to_host,
    shard_leading_axis,
    split_members,
    use_cpu_cores,
)

__all__ = [
    "CHECKPOINT_NAME",
    "ProjectionNotConvergedWarning",
    "RunResult",
    "algorithm_name",
    "batch_mesh",
    "client_mesh",
    "default_batch_mesh",
    "describe_diagnostics",
    "gather_to_host",
    "load_checkpoint",
    "product_grid",
    "progress_bar",
    "round_diagnostics",
    "run",
    "run_many",
    "save_checkpoint",
    "scan_rounds",
    "shard_leading_axis",
    "split_members",
    "use_cpu_cores",
    "vmap_algorithm",
]
