"""What the benchmarks share: test problems, compiled steps and their timing, report pages.

* Problems: :func:`random_dissimilarities` (a symmetric D with entries uniform in an
  interval), :func:`mlp_problem` (random classification clients, an MLP, its loss and
  a random D; the defaults have FEMNIST's shapes), :func:`cvxpy_projection` (the
  projection onto K by a general conic solver: the reference of the solvers).
* Timing: :func:`compiled_round` (a step compiled with its state donated, as
  :func:`karula_jax.training.run` compiles a round, and the compile seconds),
  :func:`fastest` (the best seconds of several steps called in turn, so that a
  method and its reference share the machine's state), :func:`nbytes`.
* Statistics: :func:`iteration_distribution` (the projection solver's iterations per
  member-round, binned).
* Pages: :func:`run_header` (the command as run, the device, jax's version, the date,
  the config), :func:`bench_page` and :func:`publish`.

Host-side numpy around compiled JAX programs; cvxpy (the ``experiments`` extra) is
imported only by :func:`cvxpy_projection`.
"""

from __future__ import annotations

import os
import pathlib
import platform
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from karula_jax.data import random_classification
from karula_jax.models import cross_entropy_loss, init_params, mlp
from karula_jax.reporting import markdown_table
from karula_jax.training._compile import compile_loops

__all__ = [
    "ITERATION_BINS",
    "bench_page",
    "compiled_round",
    "cvxpy_projection",
    "fastest",
    "iteration_distribution",
    "machine",
    "mlp_problem",
    "nbytes",
    "publish",
    "random_dissimilarities",
    "run_header",
]

# Upper ends (inclusive) of the bins of iteration_distribution.
ITERATION_BINS = (0, 1, 2, 5, 10, 20, 50)


def random_dissimilarities(
    n: int, *, rng: np.random.Generator | None = None, seed: int = 0, low=0.5, high=1.5
) -> np.ndarray:
    """A symmetric ``[n, n]`` D with zero diagonal and entries ``D_ij = D_ji`` uniform in
    ``[low, high)``: the upper triangle of one ``[n, n]`` draw of ``rng`` (default
    ``np.random.default_rng(seed)``), mirrored."""
    rng = np.random.default_rng(seed) if rng is None else rng
    upper = np.triu(rng.uniform(low, high, size=(n, n)), 1)
    return upper + upper.T


def mlp_problem(
    n: int,
    *,
    seed: int = 0,
    hidden: int = 100,
    features: int = 784,
    num_classes: int = 10,
    rows: tuple[int, int] = (150, 210),
) -> tuple[Any, Any, Callable, np.ndarray]:
    """``(data, params, loss, D)``: ``n`` random classification clients
    (:func:`karula_jax.data.random_classification` with ``seed``), a one-hidden-layer
    MLP's initial parameters (key ``PRNGKey(seed)``), its cross-entropy loss and a
    random D (:func:`random_dissimilarities` with seed ``seed + 1``)."""
    model = mlp(hidden, num_classes)
    params = init_params(model, jax.random.PRNGKey(seed), (1, features))
    data = random_classification(
        n, seed=seed, rows=rows, features=features, num_classes=num_classes
    )
    loss = cross_entropy_loss(model.apply)
    return data, params, loss, random_dissimilarities(n, seed=seed + 1)


def cvxpy_projection(v, radii_sq, *, tol: float | None = None) -> tuple[np.ndarray, float, Any]:
    """``argmin 1/2 ||theta - v||^2`` s.t. ``||theta_i - theta_j||^2 <= radii_sq[i, j]`` by
    cvxpy with Clarabel.

    Zero radii are equalities, infinite ones no constraint. Clarabel's "may be
    inaccurate" warning is silenced: callers compare with tolerances.

    Args:
      v: ``[n, p]`` models.
      radii_sq: ``[n, n]`` squared radii.
      tol: Clarabel's gap and feasibility tolerances (None: its defaults).

    Returns:
      ``(theta [n, p], objective value, problem)``; ``problem.solver_stats.solve_time`` is
      the solver's time.

    Raises:
      AssertionError: the solver reports neither optimal nor optimal-inaccurate.
    """
    import cvxpy as cp

    n, p = np.shape(v)
    th = cp.Variable((n, p))
    cons = []
    for i in range(n):
        for j in range(i + 1, n):
            if radii_sq[i, j] == 0:
                cons.append(th[i] == th[j])
            elif np.isfinite(radii_sq[i, j]):
                cons.append(cp.norm(th[i] - th[j]) <= np.sqrt(radii_sq[i, j]))
    prob = cp.Problem(cp.Minimize(0.5 * cp.sum_squares(th - v)), cons)
    tols = {} if tol is None else dict(tol_gap_abs=tol, tol_gap_rel=tol, tol_feas=tol)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        prob.solve(solver=cp.CLARABEL, **tols)
    assert prob.status in ("optimal", "optimal_inaccurate"), prob.status
    return np.asarray(th.value), float(prob.value), prob


def compiled_round(step: Callable, state, *args) -> tuple[Callable, float]:
    """``(compiled step, compile seconds)`` of ``step(state, *args)``, jitted with the state
    donated (updated in place, not copied) and the other arguments as arguments (not
    constants folded into the program) and with the runner's compiler options
    (:func:`karula_jax.training._compile.loop_compiler_options`), as
    :func:`karula_jax.training.run` compiles a round."""
    t0 = time.perf_counter()
    fn = compile_loops(jax.jit(step, donate_argnums=0), state, *args)
    return fn, time.perf_counter() - t0


def fastest(steps: Sequence[Callable], state, reps: int) -> tuple[list[float], list]:
    """Best seconds of each ``state = step(state)`` over ``reps`` calls, the steps called
    in turn after one warm-up call each (every step starts from ``state``).

    Returns:
      ``(seconds per step, final state per step)``.
    """
    states = [jax.block_until_ready(step(state)) for step in steps]
    best = [np.inf] * len(steps)
    for _ in range(reps):
        for k, step in enumerate(steps):
            t0 = time.perf_counter()
            states[k] = jax.block_until_ready(step(states[k]))
            best[k] = min(best[k], time.perf_counter() - t0)
    return best, states


def nbytes(tree) -> int:
    """Bytes of a pytree's array leaves."""
    return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


def iteration_distribution(its, bins: Sequence[int] = ITERATION_BINS) -> str:
    """Share of the entries of ``its`` (e.g. iterations per member-round) per bin of
    ``bins`` (upper ends, inclusive) and above the last, e.g. ``"0:40% 1:30% 6-10:30%"``;
    empty bins are left out."""
    its, parts, lo = np.asarray(its), [], 0
    for hi in (*bins, np.inf):
        k = np.mean((its >= lo) & (its <= hi))
        if k > 0:
            label = f"{lo}" if lo == hi else f"{lo}-{hi:g}" if np.isfinite(hi) else f">{lo - 1}"
            parts.append(f"{label}:{100 * k:.0f}%")
        lo = hi + 1
    return " ".join(parts)


def machine() -> str:
    """The device a benchmark ran on, for its page's header."""
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        load = os.getloadavg()[0]
        return (
            f"{platform.machine()} CPU, {os.cpu_count()} cores shared with other jobs (load "
            f"average {load:.1f} at the end), no GPU"
        )
    return f"{dev.device_kind} ({dev.platform}), host with {os.cpu_count()} CPU cores"


def run_header(module: str, argv: Sequence[str] | None, cfg: Any) -> str:
    """A bench page's first line: the command as run (``argv``: its flags, ``None`` for
    ``sys.argv``), the device, jax's version, the date and the config."""
    flags = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m " + module, *flags])
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return f"`{command}`; {machine()}, jax {jax.__version__}, {stamp}; {cfg}.\n"


def bench_page(title: str, header: str, *parts: str | tuple[str, Sequence[str]]) -> str:
    """A bench's Markdown page: ``# title``, the header line (:func:`run_header`), then
    each part: a paragraph (a string) or a table (``(head, rows)`` of
    :func:`karula_jax.reporting.markdown_table`)."""
    body = [p if isinstance(p, str) else markdown_table(*p) for p in parts]
    return "\n".join([f"# {title}\n", header, *body])


def publish(text: str, out: pathlib.Path, *, quick: bool, echo: bool = True) -> None:
    """Prints a bench's page (unless ``echo`` is False) and writes it to ``out`` (missing
    folders are created) unless it was a quick run."""
    if echo:
        print(text)
    if not quick:
        out = pathlib.Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
