"""Plants bugs in the core, one at a time, and reports which ones the test suite catches.

Usage (from anywhere). A script, not a test module: its name matches neither of pytest's
default ``python_files`` patterns (``test_*.py``, ``*_test.py``; pyproject sets none), so
``python -m pytest`` never imports it::

    python tests/mutation.py                        # every mutant
    python tests/mutation.py --only pair_kernel_second_end certificate_half_gap
    python tests/mutation.py --list                 # the mutants, nothing run
    python tests/mutation.py --write results/mutation.md

Each mutant is one row of :data:`MUTANTS`: a file of the library, an exact piece of its
text, the text that replaces it, and the test files that should catch the change. The
script copies the working tree (tracked files as edited, and untracked files that git does
not ignore) once into a temporary snapshot; for every mutant it copies that snapshot into a
fresh folder, makes the one replacement there, checks that ``import karula_jax`` in that
folder loads the copy and sees the change, and runs
``python -m pytest -q -x -p no:cacheprovider <test files>`` in it, one mutant at a time
(``KARULA_DATA_DIR`` points the copy's tests at ``../shared/data`` of this checkout).
The mutant is *killed* when a test fails, *survived* when every test passes. At the end
the tests that killed a mutant are rerun on an unmutated copy (``--no-baseline`` skips
this): a kill by a test that fails anyway counts as an error. Nothing in the repository is
written, except the page ``--write`` names.

A row whose text is not found exactly once in its file stops the script before anything
runs, so that the table cannot rot silently when the code changes: update the row.

Exit status: 0 when every mutant selected is killed, 1 when one survives or its run ends
in an error (pytest usage error, collection error, timeout), 2 on a stale row.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

REPO = pathlib.Path(__file__).resolve().parents[1]


class Mutant(NamedTuple):
    """One planted bug: replace ``old`` (found exactly once in ``path``) by ``new``."""

    name: str
    path: str  # relative to the repository root
    old: str
    new: str
    tests: tuple[str, ...]  # test files that should catch it
    bug: str  # what the mutant gets wrong, in words


VR = "karula_jax/algorithms/variance_reduction.py"
API = "karula_jax/projection/api.py"
EMB = "karula_jax/embedding.py"
KARULA_TESTS = ("tests/test_alg_karula.py",)
PROJ_TESTS = ("tests/test_projection.py", "tests/test_projection_property.py")

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "saga_leaf_divisor",
        VR,
        "return (m / n).at[idx].add((g - m[idx]) / s)",
        "return (m / n).at[idx].add((g - m[idx]) / n)",
        KARULA_TESTS,
        "SAGA direction, per-client leaf: correction divided by n instead of s",
    ),
    Mutant(
        "saga_shared_divisor",
        VR,
        "jnp.sum(g - m[idx], axis=0) / (s * n)",
        "jnp.sum(g - m[idx], axis=0) / (n * n)",
        KARULA_TESTS,
        "SAGA direction, shared leaf: correction divided by n * n instead of s * n",
    ),
    Mutant(
        "saga_memory_frozen",
        VR,
        "return nu, C.scatter(memory, idx, G, after=nu)",
        "return nu, memory",
        KARULA_TESTS + ("tests/test_alg_baselines.py",),
        "SAGA memory never updated with the participants' fresh gradients",
    ),
    Mutant(
        "saga_round_unweighted",
        VR,
        "G = jax.tree.map(lambda g: C.scale_rows(a_s, g), grads)",
        "G = grads",
        KARULA_TESTS,
        "Karula's round: fresh gradients enter the SAGA direction without the weights alpha_i",
    ),
    Mutant(
        "pair_kernel_second_end",
        "karula_jax/projection/dykstra.py",
        "return a - mass_b * step, b + mass_a * step",
        "return a - mass_b * step, b",
        PROJ_TESTS,
        "pair kernel: the second end of a violated pair never moves",
    ),
    Mutant(
        "certificate_half_gap",
        "karula_jax/projection/certificate.py",
        "gap = primal_value(shrunk, red) - g\n",
        "gap = 0.5 * (primal_value(shrunk, red) - g)\n",
        PROJ_TESTS,
        "certificate: reports half the true primal-dual gap of the shrunk point",
    ),
    Mutant(
        "certificate_pulled_point_swapped",
        "karula_jax/projection/certificate.py",
        "th = jnp.where(better, pulled, shrunk)",
        "th = jnp.where(better, shrunk, pulled)",
        PROJ_TESTS,
        "certificate: returns the other repaired point than the one whose gap it reports",
    ),
    Mutant(
        "certificate_residual_dropped",
        "karula_jax/projection/certificate.py",
        "    return 0.5 * jnp.sum(res * res)\n",
        "    return 0.0 * jnp.sum(res * res)\n",
        PROJ_TESTS,
        "certificate: the dual bound ignores that theta only approximately minimizes the "
        "Lagrangian (the residual term; phase 1 above 96 clients and every exact evaluation)",
    ),
    Mutant(
        "inverse_block_column_sign",
        "karula_jax/_linalg.py",
        "out = jax.lax.dynamic_update_slice(out, -(cols @ pivot_inv), (0, k0))",
        "out = jax.lax.dynamic_update_slice(out, cols @ pivot_inv, (0, k0))",
        ("tests/test_linalg.py",),
        "blocked Gauss-Jordan: the pivot block's column takes the wrong sign",
    ),
    Mutant(
        "certificate_half_gap_dykstra",
        "karula_jax/projection/dykstra.py",
        "th, delta = restore_and_certify(th, g, red)\n        return th, lam, delta\n",
        "th, delta = restore_and_certify(th, g, red)\n        return th, lam, 0.5 * delta\n",
        PROJ_TESTS,
        "certificate, Dykstra only: the solver reports half its gap",
    ),
    Mutant(
        "certificate_half_gap_laplacian",
        "karula_jax/projection/laplacian.py",
        "    th, delta = cert\n",
        "    th, delta = cert\n    delta = 0.5 * delta\n",
        PROJ_TESTS,
        "certificate, Laplacian dual only: the final report halves the gap",
    ),
    Mutant(
        "cg_restart_ignores_start",
        "karula_jax/projection/laplacian.py",
        "    r = b if start is None else b - op(start)\n",
        "    r = b\n",
        PROJ_TESTS,
        "Laplacian dual: CG resumed from a start takes the right-hand side as its residual",
    ),
    Mutant(
        "refine_keeps_crossing_pairs_free",
        "karula_jax/projection/laplacian.py",
        "        active = active | crossing(active, s)\n",
        "        active = active\n",
        PROJ_TESTS,
        "Laplacian dual: the refinement passes leave the pairs the step takes below 0 free",
    ),
    Mutant(
        "dykstra_multipliers_unclipped",
        "karula_jax/projection/dykstra.py",
        "jnp.where(jnp.isfinite(rp) & (d2 > 0), jnp.maximum(val, 0.0), 0.0)",
        "jnp.where(jnp.isfinite(rp) & (d2 > 0), val, 0.0)",
        PROJ_TESTS,
        "certificate, Dykstra: multipliers read off the increments not clipped at 0",
    ),
    Mutant(
        "screen_as_is_any_pair",
        API,
        "as_is = jnp.all((upper <= r2) | ~constrained)",
        "as_is = jnp.any((upper <= r2) | ~constrained)",
        PROJ_TESTS,
        "projection screen: input returned as is when any pair (not every pair) holds",
    ),
    Mutant(
        "screen_shrink_max_ratio",
        API,
        "beta = jnp.sqrt(jnp.clip(jnp.min(ratio), 0.0, 1.0))",
        "beta = jnp.sqrt(jnp.clip(jnp.max(ratio), 0.0, 1.0))",
        PROJ_TESTS,
        "projection screen: shrink factor from the loosest pair instead of the tightest",
    ),
    Mutant(
        "embedding_row_norm_rms",
        EMB,
        "return jnp.mean(jnp.sqrt(jnp.sum(diff**2, axis=-1)), axis=-1)",
        "return jnp.sqrt(jnp.mean(jnp.sum(diff**2, axis=-1), axis=-1))",
        ("tests/test_embedding.py",),
        "embedding distance: mean of row norms replaced by their RMS",
    ),
    Mutant(
        "embedding_l1_scale",
        EMB,
        "return jnp.sum(jnp.abs(diff), axis=(1, 2)) / jnp.sqrt(n0)",
        "return jnp.sum(jnp.abs(diff), axis=(1, 2)) / n0",
        ("tests/test_embedding.py",),
        "embedding distance (l1): divided by N0 instead of sqrt(N0)",
    ),
    Mutant(
        "fedavg_unweighted",
        "karula_jax/algorithms/baselines.py",
        "avg = weighted_mean(rows, a_s, otherwise=",
        "avg = weighted_mean(rows, jnp.ones_like(a_s), otherwise=",
        ("tests/test_alg_baselines.py",),
        "FedAvg aggregation: plain mean of the returned models, client weights ignored",
    ),
    Mutant(
        "ifca_argmax",
        "karula_jax/algorithms/ifca.py",
        "return jnp.argmin(losses).astype(jnp.int32)",
        "return jnp.argmax(losses).astype(jnp.int32)",
        ("tests/test_alg_baselines.py",),
        "IFCA: each participant joins its worst cluster (argmax of the losses)",
    ),
    Mutant(
        "ifca_bound_unmasked",
        "karula_jax/algorithms/ifca.py",
        "return losses if active is None else jnp.where(active, losses, jnp.inf)",
        "return losses",
        ("tests/test_alg_baselines.py",),
        "IFCA below max_clusters: the clusters from k on can be chosen",
    ),
    Mutant(
        "batch_shard_gathered",
        "karula_jax/training/batched.py",
        "            if mesh is None:\n                return members(state, data, kw)",
        "            if True:\n                return members(state, data, kw)",
        ("tests/test_sharding.py",),
        "run_many on a batch mesh: the partitioner gathers the members of a lax.map",
    ),
    Mutant(
        "ditto_prox_missing_step",
        "karula_jax/algorithms/ditto.py",
        "1.0 / (1.0 + plr * safe)",
        "1.0 / (1.0 + safe)",
        ("tests/test_alg_personalization.py",),
        "Ditto personal step: proximal shrink 1 / (1 + lam) without the step size",
    ),
    Mutant(
        "ditto_prox_anchor",
        "karula_jax/algorithms/ditto.py",
        "return jax.tree.map(leaf, flags, v, g, w), value",
        "return jax.tree.map(leaf, flags, v, g, w_i), value",
        ("tests/test_alg_personalization.py",),
        "Ditto personal step: pulled toward the client's local model, not the global one",
    ),
    Mutant(
        "stats_ddof0",
        "karula_jax/stats.py",
        "var = np.sum(dev**2, axis=0) / (count - 1)",
        "var = np.sum(dev**2, axis=0) / count",
        ("tests/test_stats.py",),
        "stats: standard deviation with ddof = 0 instead of 1",
    ),
    Mutant(
        "stats_se_over_count",
        "karula_jax/stats.py",
        "se = np.sqrt(var) / np.sqrt(count)",
        "se = np.sqrt(var) / count",
        ("tests/test_stats.py",),
        "stats: standard error s / S instead of s / sqrt(S)",
    ),
    Mutant(
        "participants_first_s",
        "karula_jax/algorithms/_sampling.py",
        "idx = jax.random.permutation(key, n)[:s].astype(jnp.int32)",
        "idx = jax.random.permutation(key, s).astype(jnp.int32)",
        ("tests/test_alg_common.py",),
        "participant sampling: only the first s clients are ever drawn",
    ),
    Mutant(
        "minibatch_padding_row",
        "karula_jax/algorithms/_sampling.py",
        "u = jnp.where(jnp.arange(max_count) < count, u, jnp.inf)",
        "u = jnp.where(jnp.arange(max_count) <= count, u, jnp.inf)",
        ("tests/test_alg_common.py",),
        "minibatch sampling: the first padding row can be drawn as a real row",
    ),
    Mutant(
        "cv_select_reversed",
        "karula_jax/evaluation/cross_validation.py",
        "index = np.argmax(score, axis=-1) if maximize else np.argmin(score, axis=-1)",
        "index = np.argmin(score, axis=-1) if maximize else np.argmax(score, axis=-1)",
        ("tests/test_evaluation.py",),
        "CV selection: picks the worst grid point (max error, min accuracy)",
    ),
    Mutant(
        "step_size_mean_curvature",
        "karula_jax/algorithms/step_size.py",
        "free = s * stability_factor(s / n) / (2.0 * l_max)",
        "free = s * stability_factor(s / n) / (2.0 * l_bar)",
        ("tests/test_step_size.py",),
        "step-size rule: uncoupled step from the mean curvature instead of the largest",
    ),
    Mutant(
        "karula_radius_squared_twice",
        "karula_jax/algorithms/karula.py",
        "return jnp.where((D == 0) | (t == 0), 0.0, t * D)",
        "return jnp.where((D == 0) | (t == 0), 0.0, (t * D) ** 2)",
        KARULA_TESTS,
        "Karula radii: squared radius (t D)^2 instead of t D",
    ),
)


class Outcome(NamedTuple):
    name: str
    status: str  # killed | survived | error | timeout
    seconds: float
    detail: str  # first failing test, or why the run is an error


def check_rows(mutants, root: pathlib.Path = REPO) -> None:
    """Stops the script when a row no longer matches the code (text not found exactly once)."""
    problems = []
    names = [m.name for m in mutants]
    if len(set(names)) != len(names):
        problems.append("duplicate mutant names")
    for m in mutants:
        source = (root / m.path).read_text()
        count = source.count(m.old)
        if count != 1:
            problems.append(f"{m.name}: {m.old!r} found {count} times in {m.path}, expected once")
        if m.old == m.new:
            problems.append(f"{m.name}: new text equals old text")
        problems += [f"{m.name}: no test file {t}" for t in m.tests if not (root / t).is_file()]
    if problems:
        print("stale mutation table, update MUTANTS:\n  " + "\n  ".join(problems), file=sys.stderr)
        sys.exit(2)


def tree_files() -> list[str]:
    """The working tree's files: tracked ones (as edited) plus untracked, not ignored ones."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.decode()
    return sorted({f for f in out.split("\0") if f and (REPO / f).is_file()})


def snapshot(dest: pathlib.Path) -> None:
    """Copies the working tree into ``dest``, once: every mutant and the baseline start
    from this copy, so edits made to the repository meanwhile do not mix into a run."""
    for f in tree_files():
        target = dest / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, target)


def environment(copy: pathlib.Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(copy)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.setdefault("JAX_PLATFORMS", "cpu")
    # conftest looks for the data next to the repository; the copy has no such neighbour.
    env.setdefault("KARULA_DATA_DIR", str(REPO.parent / "shared" / "data"))
    return env


def check_import(m: Mutant, copy: pathlib.Path, env: dict) -> str | None:
    """None when the copy's mutated module is the one Python imports, else the reason."""
    module = m.path.removesuffix(".py").replace("/", ".")
    probe = (
        "import importlib, inspect, karula_jax, sys\n"
        f"mod = importlib.import_module({module!r})\n"
        "print(karula_jax.__file__)\n"
        "print(mod.__file__)\n"
        f"print({m.new!r} in inspect.getsource(mod))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe], cwd=copy, env=env, capture_output=True, text=True
    )
    if run.returncode != 0:
        return "import failed: " + run.stderr.strip().splitlines()[-1]
    package, module_file, seen = run.stdout.split()
    root = str(copy.resolve())
    if not (package.startswith(root) and module_file.startswith(root)):
        return f"imported {package} and {module_file}, not the copy in {root}"
    if seen != "True":
        return "the imported module does not contain the mutation"
    return None


def first_failure(output: str) -> str:
    hits = re.findall(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.MULTILINE)
    return hits[0] if hits else ""


def run_mutant(m: Mutant, tree: pathlib.Path, *, timeout: float, keep: bool) -> Outcome:
    start = time.perf_counter()
    copy = pathlib.Path(tempfile.mkdtemp(prefix=f"karula-mutant-{m.name}-"))
    try:
        shutil.copytree(tree, copy, dirs_exist_ok=True)
        target = copy / m.path
        mutated = target.read_text().replace(m.old, m.new, 1)
        target.write_text(mutated)
        try:
            compile(mutated, str(target), "exec")
        except SyntaxError as e:
            return Outcome(m.name, "error", time.perf_counter() - start, f"syntax: {e}")
        env = environment(copy)
        problem = check_import(m, copy, env)
        if problem:
            return Outcome(m.name, "error", time.perf_counter() - start, problem)
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *m.tests]
        try:
            run = subprocess.run(
                cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return Outcome(m.name, "timeout", time.perf_counter() - start, f"over {timeout:.0f} s")
        output = run.stdout + run.stderr
        seconds = time.perf_counter() - start
        if run.returncode == 0:
            return Outcome(m.name, "survived", seconds, "")
        if run.returncode == 1:
            return Outcome(m.name, "killed", seconds, first_failure(output))
        tail = output.strip().splitlines()[-1] if output.strip() else ""
        return Outcome(m.name, "error", seconds, f"pytest exit {run.returncode}: {tail}")
    finally:
        if keep:
            print(f"  kept {copy}", flush=True)
        else:
            shutil.rmtree(copy, ignore_errors=True)


def baseline(outcomes, tree: pathlib.Path, *, timeout: float) -> list[Outcome]:
    """Reruns each killing test on an unmutated copy: a kill by a test that fails anyway
    (a broken test, or a file being edited) is turned into an error."""
    killers = sorted({o.detail for o in outcomes if o.status == "killed" and o.detail})
    if not killers:
        return outcomes
    print(f"baseline: {len(killers)} killing tests on the unmutated tree ...", flush=True)
    copy = pathlib.Path(tempfile.mkdtemp(prefix="karula-mutant-baseline-"))
    try:
        shutil.copytree(tree, copy, dirs_exist_ok=True)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *killers]
        try:
            run = subprocess.run(
                cmd,
                cwd=copy,
                env=environment(copy),
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            output = run.stdout + run.stderr
            broken = set(re.findall(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.MULTILINE))
            why = "fails without the mutant too"
            if run.returncode not in (0, 1):
                broken = set(killers)
                tail = output.strip().splitlines()[-1] if output.strip() else ""
                why = f"baseline run ended with pytest exit {run.returncode}: {tail}"
        except subprocess.TimeoutExpired:
            broken, why = set(killers), f"baseline run over {timeout:.0f} s"
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    print(f"  {len(broken)} of them fail without a mutant", flush=True)
    return [
        o._replace(status="error", detail=f"{o.detail}: {why}")
        if o.status == "killed" and o.detail in broken
        else o
        for o in outcomes
    ]


def table(mutants, outcomes) -> str:
    by_name = {o.name: o for o in outcomes}
    lines = [
        "| mutant | file | bug | tests run | result | time (s) | first failure |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in mutants:
        o = by_name[m.name]
        tests = ", ".join(pathlib.Path(t).name for t in m.tests)
        detail = o.detail.replace("|", "\\|")
        lines.append(
            f"| `{m.name}` | `{m.path}` | {m.bug} | {tests} | **{o.status}** "
            f"| {o.seconds:.0f} | {detail} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per mutant")
    parser.add_argument("--keep", action="store_true", help="keep the mutated copies")
    parser.add_argument("--write", metavar="PATH", help="also write the table as a page")
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip rerunning the killing tests on the unmutated tree",
    )
    args = parser.parse_args(argv)

    check_rows(MUTANTS)
    mutants = MUTANTS
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in MUTANTS})
        if unknown:
            parser.error(f"unknown mutants {unknown}; known: {[m.name for m in MUTANTS]}")
        mutants = tuple(m for m in MUTANTS if m.name in args.only)
    if args.list:
        for m in mutants:
            print(f"{m.name:30s} {m.path:42s} {m.bug}")
        return 0

    began = datetime.datetime.now(datetime.UTC)
    tree = pathlib.Path(tempfile.mkdtemp(prefix="karula-mutant-tree-"))
    try:
        snapshot(tree)
        check_rows(mutants, tree)
        outcomes = []
        for i, m in enumerate(mutants, 1):
            print(f"[{i}/{len(mutants)}] {m.name}: {m.bug} ...", flush=True)
            o = run_mutant(m, tree, timeout=args.timeout, keep=args.keep)
            print(f"  {o.status} in {o.seconds:.0f} s {o.detail}", flush=True)
            outcomes.append(o)
        if not args.no_baseline:
            outcomes = baseline(outcomes, tree, timeout=args.timeout)
    finally:
        shutil.rmtree(tree, ignore_errors=True)

    text = table(mutants, outcomes)
    killed = sum(o.status == "killed" for o in outcomes)
    summary = f"{killed} of {len(outcomes)} mutants killed"
    print("\n" + text + "\n\n" + summary)
    if args.write:
        command = "python tests/mutation.py " + " ".join(argv if argv is not None else sys.argv[1:])
        page = (
            "# Mutation check\n\n"
            f"Command: `{command.strip()}`  \n"
            f"Run: {began:%Y-%m-%d %H:%M} UTC, "
            f"commit {_head()} plus the working tree, Python {sys.version.split()[0]}\n\n"
            f"{text}\n\n{summary}.\n"
        )
        path = pathlib.Path(args.write)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(page)
    return 0 if killed == len(outcomes) else 1


def _head() -> str:
    run = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    )
    return run.stdout.strip() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
