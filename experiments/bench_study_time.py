"""Benchmark: where the synthetic study's time goes, and what Karula's projection costs there.

The synthetic study (README command 1, ``python -m experiments.synthetic_ridge``) runs
once as it is: its wall and CPU time and each method's stage (compilation included),
against issue 55's targets (the study at most 240 s, Karula's theorem step at most 60 s)
in the hour the bench ran; a shared machine's speed moves between hours, and within one
(two runs of the study minutes apart: 1.2-1.4x on the methods that do not project), so
one run says nothing of another hour. Then Karula's two rows alone (and Local, which the
study always runs) run three times in turn: with every projection replaced by its
screen's shrink toward the mean (``x - (1 - beta)(x - mean)``, ``beta`` the largest
factor that keeps every pair within its radius: feasible, one pass of exact distances,
no solver), as they are, and with the shrink again. The same programs otherwise; the
substituted runs' models are not the study's and are not kept. What the projection
costs: the rows as run minus the mean of the two substituted runs, which bracket them in
time; the study without its solver: the study's time minus that. Also the share of
pairs that bind at Karula's final fits (``||theta_i - theta_j||^2 >= (1 - 1e-3) t D_ij``
at the chosen ``t``).

Command: ``python -m experiments.bench_study_time [--FIELD VALUE ...] [--out FILE]``
writes ``runs/bench/study_time.md`` (``--out results/bench/study_time.md`` refreshes the
committed page); the fields are the study's (:class:`~experiments.synthetic_ridge.
SyntheticConfig`); ``--quick``: the study's quick configuration with Karula's two rows
only (a smoke run, about 1 min; the tests run it).
Runtime: about 8 min on 2 CPU cores at the defaults (the study, then Karula's rows three
times).
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import synthetic_ridge as study_module
from experiments.paths import OUTPUT
from karula_jax import protocol
from karula_jax.benchmarking import bench_page, publish, run_header
from karula_jax.evaluation import pairwise_sq_distances
from karula_jax.projection import api
from karula_jax.reporting import cli

# Issue 55's targets for README command 1 on 2 CPU cores: the study and Karula's
# theorem-step row, seconds of wall clock.
STUDY_TARGET_S = 240.0
THEOREM_STEP_TARGET_S = 60.0
THEOREM_STEP = "Karula (theorem step)"
# The rows run alone, as run and with the screen's shrink (Local runs with them).
KARULA_ROWS = ("Karula", THEOREM_STEP)
# A pair binds where its squared distance is within this share of its squared radius.
BINDING_RTOL = 1e-3


def quick(cfg: study_module.SyntheticConfig) -> study_module.SyntheticConfig:
    """The study's quick configuration, Karula's two rows only (Local always runs)."""
    return dataclasses.replace(study_module.quick_config(cfg), methods=KARULA_ROWS)


def _screen_shrink(x, radii_sq, state, tol, max_iter, *, method):
    """The screen's feasible shrink in place of ``projection.api._project_branches``:
    the same outputs, multipliers 0, no solver."""
    del tol, max_iter, method
    zero = jax.tree.map(lambda a: jnp.zeros(a.shape, x.dtype), state)
    screen = api._screen(x, radii_sq)
    info = api._exact_info(x.dtype, zero)._replace(max_violation=screen.violation)
    return x - (1.0 - screen.beta) * screen.xc, info


@contextlib.contextmanager
def projection_replaced_by_screen_shrink():
    """Programs traced inside project by the screen's shrink (:func:`_screen_shrink`).

    jax's caches and the study's cached methods are cleared on entry and on exit, so
    that no program compiled outside (the projection's jitted core, a method's rounds)
    is reused inside, and none compiled inside is reused after."""
    saved = api._project_branches

    def clear():
        jax.clear_caches()
        study_module._methods.cache_clear()

    clear()
    api._project_branches = _screen_shrink
    try:
        yield
    finally:
        api._project_branches = saved
        clear()


def run_study(cfg: study_module.SyntheticConfig, log=print) -> dict:
    """One run of the study (its outputs in a temporary folder): ``{"total": wall s,
    "cpu": CPU s, "stages": {method: wall s}, "projecting": [the methods whose rounds
    project], "binding": {projecting method: share}}``."""
    wall, cpu = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory() as out:
        result = protocol.run_study(study_module.study(cfg, command=""), out, log=log)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    stages = {m: float(o.seconds) for m, o in result.outcomes.items()}
    projecting = [m for m in result.outcomes if result.methods[m].projects]
    binding = {m: binding_share(result, cfg, m) for m in projecting}
    return {
        "total": wall,
        "cpu": cpu,
        "stages": stages,
        "projecting": projecting,
        "binding": binding,
    }


def binding_share(result: protocol.StudyResult, cfg, method: str) -> float:
    """Share of the constrained pairs (finite ``t D_ij``) of ``method``'s final
    fits, over every seed, whose squared distance is within :data:`BINDING_RTOL` of its
    squared radius at the seed's chosen ``t``; pairs at radius 0 (``t = 0``) bind."""
    outcome = result.outcomes[method]
    grid = np.asarray(protocol.grid_of(method, cfg.grids), np.float64)
    D = np.asarray(result.data.cv.final(result.data.D), np.float64)  # [S, n, n]
    off = ~np.eye(D.shape[-1], dtype=bool)
    bound, total = 0, 0
    for theta, chosen, d in zip(outcome.metrics["theta"], outcome.chosen, D, strict=True):
        r2 = grid[int(chosen)] * d
        d2 = np.asarray(pairwise_sq_distances(theta), np.float64)
        pairs = off & np.isfinite(r2)
        bound += int(np.sum(pairs & (d2 >= (1.0 - BINDING_RTOL) * r2)))
        total += int(np.sum(pairs))
    return bound / max(total, 1)


STUDY_HEAD = "stage | wall clock (s)"
KARULA_HEAD = (
    "row | in the study (s) | screen's shrink (s) | as run (s) | screen's shrink (s) | "
    "the projection's cost (s)"
)


def study_rows(study: dict) -> list[str]:
    """The study's table: each method's stage, the rest of the study and the study."""
    rows = [f"{m} | {s:.1f}" for m, s in study["stages"].items()]
    rest = study["total"] - sum(study["stages"].values())
    rows.append(f"the rest (data, D, writing) | {rest:.1f}")
    rows.append(f"**study (wall)** | {study['total']:.1f}")
    rows.append(f"study (CPU, all threads) | {study['cpu']:.0f}")
    return rows


def row_cost(real: dict, before: dict, after: dict, method: str) -> float:
    """What the projection costs on ``method``'s row: its time as run minus the mean of
    the substituted runs ``before`` and ``after`` it, compilation included."""
    shrink = 0.5 * (before["stages"][method] + after["stages"][method])
    return real["stages"][method] - shrink


def karula_rows(study: dict, real: dict, before: dict, after: dict) -> list[str]:
    """Karula's rows: in the study, and in the three runs of Karula's rows alone."""
    return [
        f"{m} | {study['stages'][m]:.1f} | {before['stages'][m]:.1f} | "
        f"{real['stages'][m]:.1f} | {after['stages'][m]:.1f} | "
        f"{row_cost(real, before, after, m):.1f}"
        for m in real["projecting"]
    ]


def findings(cfg, study: dict, real: dict, before: dict, after: dict) -> str:
    """The paragraph above the tables: the targets, the projection's cost, binding pairs."""
    cost = sum(row_cost(real, before, after, m) for m in real["projecting"])
    binding = ", ".join(f"{m} {100 * s:.1f}%" for m, s in study["binding"].items())
    if cfg == study_module.SyntheticConfig():
        step = study["stages"].get(THEOREM_STEP, float("nan"))
        met = lambda ok: "met" if ok else "not met"
        lines = [
            f"README command 1's configuration in this hour: the study at most "
            f"{STUDY_TARGET_S:.0f} s: {study['total']:.1f} s, "
            f"{met(study['total'] <= STUDY_TARGET_S)}; Karula's theorem step at most "
            f"{THEOREM_STEP_TARGET_S:.0f} s: {step:.1f} s, "
            f"{met(step <= THEOREM_STEP_TARGET_S)}."
        ]
    else:
        lines = ["Not README command 1's configuration: no verdict on the targets."]
    lines.append(
        f"The projection costs {cost:.1f} s on Karula's rows run alone (as run minus the "
        f"screen's shrink); the study without its solver: {study['total'] - cost:.1f} s. "
        f"Pairs binding at Karula's final fits: {binding}."
    )
    return " ".join(lines) + "\n"


def main(argv=None) -> None:
    out = OUTPUT / "bench/study_time.md"
    cfg, args = cli(study_module.SyntheticConfig, argv, quick=quick, description=__doc__, out=out)
    log = lambda *a: print(*a, flush=True)
    study = run_study(cfg, log=log)
    rows_alone = dataclasses.replace(cfg, methods=KARULA_ROWS)
    with projection_replaced_by_screen_shrink():
        before = run_study(rows_alone, log=log)
    real = run_study(rows_alone, log=log)
    with projection_replaced_by_screen_shrink():
        after = run_study(rows_alone, log=log)
    text = bench_page(
        "Where the synthetic study's time goes, and what Karula's projection costs there",
        run_header("experiments.bench_study_time", argv, cfg),
        findings(cfg, study, real, before, after),
        (STUDY_HEAD, study_rows(study)),
        "\nEach stage: a method's CV and final runs, compilation included (the study's "
        "own clock); the rest: drawing the data, the dissimilarities, the report (the "
        "first run also imports ott and compiles the embedding for the process).\n\n"
        "Karula's rows: in the study above, then alone, three runs in turn: every "
        "projection replaced by the screen's shrink toward the mean (feasible, no "
        "solver; results not the study's), as run, the shrink again. The projection's "
        "cost: as run minus the mean of the two shrink runs.\n",
        (KARULA_HEAD, karula_rows(study, real, before, after)),
    )
    publish(text, args.out, quick=args.quick)


if __name__ == "__main__":
    from karula_jax import training

    training.use_cpu_cores()  # as README command 1: one CPU device per core
    main()
