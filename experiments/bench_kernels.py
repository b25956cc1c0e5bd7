"""Benchmark: a kernel-launch proxy of one compiled Karula round (issue 24, item 5).

Accelerators pay per kernel launch, so what a round costs there depends on how many
operations it executes, not only on its flops. This counts, for one compiled, unbatched
round of Karula and of FedAvg on the synthetic study's ridge clients, the HLO operations it
executes: every operation of the optimized program (a fusion, a dot, a custom call, a copy,
a loop's control; not parameters, tuples, constants and bitcasts), each loop body's and
condition's operations times the trips they made. Trips are counted in a second, otherwise
identical program whose loop bodies report to the host (``jax.debug.callback``, keyed by
the nest of ``jax.lax`` loop calls in the source), in rounds ``early`` (after the clients
have trained apart) and ``late`` (where the synthetic study's 600 rounds end), and matched to
the optimized program's loops by their source lines. A ``lax.cond``/``switch`` counts its
largest branch (an upper bound where the screen answers a projection).

Command: ``python -m experiments.bench_kernels [--FIELD VALUE ...] [--out FILE]`` writes
``runs/bench/kernels.md`` (``--out results/bench/kernels.md`` refreshes the committed page).
``--counts-only FILE.json`` writes the raw counts and imports nothing but public API the
library already had on 2026-11-26 (``data.synthetic_ridge``, ``algorithms.karula`` /
``fedavg``, ``models.ridge_loss``, ``evaluation.ridge_solutions`` /
``pairwise_sq_distances``, ``protocol.smoothness_constants`` / ``stack_datasets``), so
that the same script counts an older commit's solver: run it by path with ``PYTHONPATH``
set to that commit's tree, then pass the file as ``--before FILE.json`` (and
``--before-label``) to put its counts beside.
Runtime: about 2 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import json
import os
import re
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax import algorithms as A
from karula_jax import evaluation as ev
from karula_jax import protocol
from karula_jax.data import synthetic_ridge
from karula_jax.models import ridge_loss


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """What is counted.

    Attributes:
      sizes: numbers of clients ``n`` (the synthetic study's ridge clients, ``d = dim``,
        ``s = n / 3``, full gradients, D the mean-normalized squared distances between
        exact local ridge fits, as ``experiments/bench_study.py``).
      dim, lam, t: d, the L2 penalty and Karula's t (8: the synthetic study's usual CV
        choice).
      early, late: the first round of each counted window (0-based); ``late`` is capped at
        ``late_large`` from ``large`` clients on.
      rounds: rounds per window (counts are per round, averaged over them).
      rate_karula, rate_fedavg, local_steps: Karula's step ``rate_karula / L_f`` (the
        synthetic study's rule), FedAvg's learning rate and E.
      projection_tol: Karula's tolerance (the experiments').
      projection_method: Karula's projection solver (``auto``: the library's choice).
      accelerator_only: count Karula's round with the accelerators' linear algebra only,
        not as compiled for the CPU (its CPU columns ``-``): for a solver whose CPU
        eliminations run too long to reach the windows (``laplacian_direct`` at n = 300).
    """

    sizes: tuple[int, ...] = (30, 300)
    dim: int = 50
    lam: float = 1e-6
    t: float = 8.0
    early: int = 10
    late: int = 590
    late_large: int = 290
    large: int = 100
    rounds: int = 10
    rate_karula: float = 3 / 8
    rate_fedavg: float = 0.05
    local_steps: int = 5
    projection_tol: float = 1e-4
    projection_method: str = "auto"
    accelerator_only: bool = False


QUICK = KernelConfig(sizes=(10,), early=2, late=6, rounds=2)

# Operations that launch nothing: they name, group or reinterpret buffers.
_FREE = {
    "parameter",
    "get-tuple-element",
    "tuple",
    "constant",
    "bitcast",
    "after-all",
    "add-dependency",
    "opt-barrier",
}
# The patched loops: where each takes its body (positional index, keyword).
_BODY = {
    "while_loop": (1, "body_fun"),
    "fori_loop": (2, "body_fun"),
    "scan": (0, "f"),
    "map": (0, "f"),
}


# ---------------------------------------------------------------- trip counting


class _TripCounter:
    """Patches ``jax.lax``'s loops while a program is traced, so that each loop body
    reports one trip to the host, keyed by the nest of loop call sites ``((file, line),
    ...)`` around it; :meth:`counts` reads them (after the program ran)."""

    def __init__(self):
        self._stack: list[tuple[str, int]] = []
        self._trips: collections.Counter = collections.Counter()
        self._saved: dict = {}
        self.traced: set = set()  # every loop nest traced, also those that never run

    def __enter__(self):
        for name in _BODY:
            self._saved[name] = getattr(jax.lax, name)
            setattr(jax.lax, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(jax.lax, name, fn)

    def counts(self) -> collections.Counter:
        jax.effects_barrier()
        return collections.Counter(self._trips)

    def reset(self) -> None:
        jax.effects_barrier()
        self._trips.clear()

    def _wrap(self, name, loop):
        body_at, body_kw = _BODY[name]

        def patched(*args, **kwargs):
            site = _caller()
            key = (*self._stack, site)
            self.traced.add(key)
            args = list(args)
            body = args[body_at] if len(args) > body_at else kwargs[body_kw]

            def counted(*a):
                self._stack.append(site)
                try:
                    jax.debug.callback(lambda: self._trips.update([key]))
                    return body(*a)
                finally:
                    self._stack.pop()

            if len(args) > body_at:
                args[body_at] = counted
            else:
                kwargs[body_kw] = counted
            return loop(*args, **kwargs)

        return patched


# Frames in files under this folder are the library's (the package's own directory: a
# checkout folder of the same name does not count).
_LIBRARY = (
    os.path.dirname(os.path.abspath(A.__file__)).rsplit(os.sep, 1)[0].replace(os.sep, "/") + "/"
)


def _dedupe(frames) -> tuple:
    """``frames`` without consecutive repeats (a ``fori_loop`` lowered to a ``scan``
    records its call site twice)."""
    out = []
    for f in frames:
        if not out or out[-1] != f:
            out.append(f)
    return tuple(out)


def _caller() -> tuple[tuple[str, int], ...]:
    """The loop's call site: the stack's frames in this library's files, innermost first,
    as the program's source metadata records them."""
    out = []
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = os.path.abspath(frame.filename).replace(os.sep, "/")
        if path.startswith(_LIBRARY):
            out.append((os.path.basename(path), int(frame.lineno)))
    return _dedupe(out)


# ---------------------------------------------------------------- HLO parsing


@dataclasses.dataclass
class _Op:
    opcode: str
    calls: dict  # role -> [computation names]
    site: tuple | None  # the library frames of its source, innermost first
    known_trips: int | None


def _frames(text: str) -> dict[int, tuple[tuple[str, int], ...]]:
    """``{stack frame id: ((file, line), ...)}`` from the module's source tables: the
    frames in this library's files, innermost first (a frame's ``parent_frame_id`` is
    printed one above the parent's id, 0 for none)."""
    files, locations, parents, table = {}, {}, {}, None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            table = line
            continue
        m = re.match(r"(\d+) (.*)$", line)
        if table is None or m is None:
            table = None if line.startswith(("%", "ENTRY")) else table
            continue
        key, rest = int(m.group(1)), m.group(2)
        if table == "FileNames":
            files[key] = os.path.abspath(rest.strip('"')).replace(os.sep, "/")
        elif table == "FileLocations":
            f = re.search(r"file_name_id=(\d+)", rest)
            ln = re.search(r"\bline=(\d+)", rest)
            locations[key] = (int(f.group(1)), int(ln.group(1)))
        elif table == "StackFrames":
            loc = int(re.search(r"file_location_id=(\d+)", rest).group(1))
            parent = int(re.search(r"parent_frame_id=(\d+)", rest).group(1)) - 1
            parents[key] = (loc, parent)

    def chain(frame):
        out = []
        while frame in parents:
            loc, frame = parents[frame]
            path, line = files[locations[loc][0]], locations[loc][1]
            if path.startswith(_LIBRARY):
                out.append((os.path.basename(path), line))
        return _dedupe(out)

    return {k: chain(k) for k in parents}


def _parse_hlo(text: str) -> tuple[dict[str, list[_Op]], str]:
    """Computations of an optimized HLO module: ``({name: [ops]}, entry name)``."""
    comps, entry, current = {}, None, None
    frames = _frames(text)
    header = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
    for line in text.splitlines():
        if current is None:
            m = header.match(line)
            if m and not line.startswith(" ") and "=" not in line.split("(")[0]:
                current = m.group(2)
                comps[current] = []
                entry = current if m.group(1) else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        op = _parse_op(line, frames)
        if op is not None:
            comps[current].append(op)
    return comps, entry


def _parse_op(line: str, frames: dict) -> _Op | None:
    if " = " not in line:
        return None
    rest = line.split(" = ", 1)[1].lstrip()
    if rest.startswith("("):  # a tuple type: skip its balanced parentheses
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                rest = rest[i + 1 :].lstrip()
                break
    else:
        rest = rest.split(" ", 1)[1] if " " in rest else ""
    m = re.match(r"([\w\-]+)\(", rest)
    if m is None:
        return None
    calls = {}
    for role in ("condition", "body", "to_apply", "true_computation", "false_computation"):
        hit = re.search(rf"\b{role}=%?([\w.\-]+)", line)
        if hit:
            calls[role] = [hit.group(1)]
    hit = re.search(r"branch_computations=\{([^}]*)\}", line)
    if hit:
        calls["branches"] = [c.strip().lstrip("%") for c in hit.group(1).split(",")]
    site = None
    f, ln = re.search(r'source_file="([^"]+)"', line), re.search(r"source_line=(\d+)", line)
    frame = re.search(r"stack_frame_id=(\d+)", line)
    if frame and int(frame.group(1)) in frames:
        site = frames[int(frame.group(1))]
    elif f and ln:  # older metadata: the innermost frame only
        site = ((os.path.basename(f.group(1)), int(ln.group(1))),)
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
    return _Op(m.group(1), calls, site, int(known.group(1)) if known else None)


def _name(site) -> str:
    """``file:line`` of a site's innermost frame (``round``: outside every loop; a
    ``"shared"`` mark from :func:`_launches` kept in front)."""
    if site and site[0] == "shared":
        return "shared " + _name(site[1:])
    return f"{site[0][0]}:{site[0][1]}" if site else "round"


def _by_name(by_site) -> collections.Counter:
    """Launches per innermost loop call site (nests through different callers merged)."""
    out = collections.Counter()
    for site, v in by_site.items():
        out[_name(site)] += v
    return out


def _collapse(counts, traced, comps, rounds) -> dict:
    """Trips per round keyed by loop nests of the optimized program (0 for a nest traced
    but never run): loops that XLA removed (one trip) or unrolled are dropped from the
    counted nests."""
    kept = {op.site for ops in comps.values() for op in ops if op.opcode == "while"}
    match = functools.cache(lambda site: _kept_site(site, kept))

    def nest(key):
        return tuple(m for m in map(match, key) if m is not None)

    out = collections.Counter({nest(key): 0.0 for key in traced if match(key[-1]) is not None})
    for key, trips in counts.items():
        if match(key[-1]) is not None:
            out[nest(key)] += trips / rounds
    return dict(out)


def _kept_site(site, kept):
    """The loop site of the optimized program that ``site`` (a traced call site) is: itself,
    or else the one kept site with the same innermost frame whose frames all appear in
    ``site`` in order (a program traced through a cached custom-batching rule can record
    one caller frame fewer than the counted trace); None if there is none or several."""
    if site in kept:
        return site

    def within(short):
        frames = iter(site)
        return all(f in frames for f in short)

    found = [k for k in kept if k and site and k[0] == site[0] and within(k)]
    return found[0] if len(found) == 1 else None


def _launches(comps, name, path, execs, trips, by_site, missing, seen=None):
    """Operations computation ``name`` executes, run ``execs`` times inside the loop nest
    ``path``; loop bodies take ``trips[path + (site,)]`` (total per round). ``missing``
    collects loops without counted trips, and (marked ``"shared"``) loops whose nest
    another loop of the program also has."""
    seen = set() if seen is None else seen
    total = 0.0
    for op in comps[name]:
        if op.opcode in _FREE:
            continue
        total += execs
        by_site[path[-1] if path else ()] += execs
        if op.opcode == "while":
            key = (*path, op.site)
            if key in seen:  # two loops of one nest share its trips: both get all of them
                missing.add(("shared",) + op.site)
            seen.add(key)
            if key in trips:
                n = trips[key]
            elif op.known_trips is not None:
                n = op.known_trips * execs
            else:
                n = 0.0
                missing.add(op.site)
            total += _launches(comps, op.calls["body"][0], key, n, trips, by_site, missing, seen)
            total += _launches(
                comps, op.calls["condition"][0], key, n + execs, trips, by_site, missing, seen
            )
        elif op.opcode == "conditional":
            names = op.calls.get("branches") or [
                *op.calls.get("true_computation", []),
                *op.calls.get("false_computation", []),
            ]
            parts = []
            for b in names:
                sub = collections.Counter()
                own = set(seen)  # one branch runs: its loops do not share with another's
                parts.append((_launches(comps, b, path, execs, trips, sub, missing, own), sub))
            best, sub = max(parts, key=lambda x: x[0])
            total += best
            by_site.update(sub)
        elif op.opcode == "call":
            total += _launches(
                comps, op.calls["to_apply"][0], path, execs, trips, by_site, missing, seen
            )
    return total


# ---------------------------------------------------------------- the workload


def _workload(cfg: KernelConfig, n: int):
    """The synthetic study's ridge clients (seed 0), D between exact local ridge fits
    (:func:`karula_jax.evaluation.ridge_solutions`), divided by its mean off-diagonal
    entry, and Karula's step ``rate_karula / L_f`` (the study's rule,
    :func:`karula_jax.protocol.smoothness_constants`)."""
    data = synthetic_ridge(0, num_clients=n, dim=cfg.dim).train
    D = ev.pairwise_sq_distances(ev.ridge_solutions(data, cfg.lam)[0])
    D = D / np.mean(D[~np.eye(n, dtype=bool)])  # (no protocol.mean_normalized in d97f750)
    L_f = protocol.smoothness_constants(protocol.stack_datasets([data]), cfg.lam)[0][0]
    return data, jnp.asarray(D, jnp.float32), cfg.rate_karula / float(L_f)


def _compile(fn, *args):
    jitted = jax.jit(fn)
    try:  # the runner's compiler options, where this library version has them
        from karula_jax.training._compile import compile_loops
    except ImportError:
        return jitted.lower(*args).compile()
    return compile_loops(jitted, *args)


@contextlib.contextmanager
def _accelerator_linalg():
    """Dense linear algebra as compiled for accelerators (a Cholesky inverse and a LAPACK
    QR: one custom call each), where this library version picks it per platform; else
    nothing changes."""
    from karula_jax import _linalg

    per_platform = getattr(_linalg, "_per_platform", None)
    if per_platform is None:
        yield
        return

    def default_branch(a, *, cpu, default):
        flat = jnp.reshape(a, (-1, *a.shape[-2:]))
        out = jax.vmap(default)(flat)
        return jnp.reshape(out, (*a.shape[:-2], *out.shape[-2:]))

    _linalg._per_platform = default_branch
    try:
        yield
    finally:
        _linalg._per_platform = per_platform


def _count_method(cfg, make, params, data, windows, patch=contextlib.nullcontext):
    """Launch counts of one method's round in each window (see the module docstring)."""
    jax.clear_caches()  # no program traced for another method or variant is reused
    with patch():
        alg = make()
        state = jax.jit(lambda d, k: alg.init(params, d, key=k))(data, jax.random.key(0))
        plain = _compile(lambda st, d: alg.round(st, d), state, data)
    comps, entry = _parse_hlo(plain.as_text())
    counter = _TripCounter()
    jax.clear_caches()  # inner jitted functions are traced again, with the loops patched
    with patch(), counter:
        inst = make()
        counted = _compile(lambda st, d: inst.round(st, d), state, data)
    rows, r = {}, 0
    for label, start in windows.items():
        while r < start:
            state, _ = plain(state, data)
            r += 1
        counter.reset()
        its = []
        for _ in range(cfg.rounds):
            state, info = counted(state, data)
            its.append(float(getattr(info, "proj_iterations", 0)))
            r += 1
        trips = _collapse(counter.counts(), counter.traced, comps, cfg.rounds)
        by_site, missing = collections.Counter(), set()
        total = _launches(comps, entry, (), 1.0, trips, by_site, missing)
        rows[label] = {
            "rounds": [start, start + cfg.rounds],
            "launches": total,
            "iterations": float(np.mean(its)),
            "by_site": dict(_by_name(by_site).most_common(8)),
            "unmatched_loops": sorted(_name(k) for k in missing),
        }
    return rows


def count_size(cfg: KernelConfig, n: int) -> dict:
    """Per-round launch counts of FedAvg and Karula at ``n`` clients, per window; Karula
    also with the accelerators' linear algebra (``"Karula, accelerator linalg"``)."""
    data, D, step = _workload(cfg, n)
    s, batch = max(1, n // 3), int(data.x.shape[1])
    params = jnp.zeros((cfg.dim,), jnp.float32)
    loss = ridge_loss(cfg.lam)

    def karula():
        return A.karula(
            loss,
            D,
            t=cfg.t,
            learning_rate=step,
            clients_per_round=s,
            batch_size=batch,
            projection_tol=cfg.projection_tol,
            **(
                {}
                if cfg.projection_method == "auto"
                else {"projection_method": cfg.projection_method}
            ),
        )

    def fedavg():
        return A.fedavg(
            loss,
            learning_rate=cfg.rate_fedavg,
            local_steps=cfg.local_steps,
            clients_per_round=s,
            batch_size=batch,
        )

    late = min(cfg.late, cfg.late_large) if n >= cfg.large else cfg.late
    windows = {"early": cfg.early, "late": late}
    out = {"n": n, "s": s}
    out["FedAvg"] = _count_method(cfg, fedavg, params, data, windows)
    if not cfg.accelerator_only:
        out["Karula"] = _count_method(cfg, karula, params, data, windows)
    out["Karula, accelerator linalg"] = _count_method(
        cfg, karula, params, data, windows, _accelerator_linalg
    )
    return out


def count(cfg: KernelConfig) -> list[dict]:
    return [count_size(cfg, n) for n in cfg.sizes]


# ---------------------------------------------------------------- the page

HEAD = (
    "n | window (rounds) | FedAvg | Karula | Newton iterations / round | ratio"
    " | Karula, accelerator linalg | Newton iterations / round | ratio"
    " | Karula's largest sites (launches / round; CPU program, else accelerator linalg)"
)


def _rows(results, label=""):
    lines = []
    for r in results:
        for w in ("early", "late"):
            f = r["FedAvg"][w]
            acc = r.get("Karula, accelerator linalg", r.get("Karula"))[w]
            k = r["Karula"][w] if "Karula" in r else None
            sites = ", ".join(f"{s} {v:,.0f}" for s, v in list((k or acc)["by_site"].items())[:4])
            cpu = (
                "- | - | -"
                if k is None
                else f"{k['launches']:,.0f} | {k['iterations']:.2f} | "
                f"{k['launches'] / f['launches']:.1f}x"
            )
            lines.append(
                f"{r['n']} | {label}{w} ({acc['rounds'][0] + 1}-{acc['rounds'][1]}) | "
                f"{f['launches']:,.0f} | {cpu} | {acc['launches']:,.0f} | "
                f"{acc['iterations']:.2f} | {acc['launches'] / f['launches']:.1f}x | {sites}"
            )
    return lines


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--counts-only" in argv:  # the oldest API only: see the module docstring
        p = argparse.ArgumentParser()
        p.add_argument("--counts-only", required=True)
        p.add_argument("--sizes", default=None)
        p.add_argument("--late-large", type=int, default=None)
        a = p.parse_args(argv)
        cfg = KernelConfig()
        if a.sizes:
            cfg = dataclasses.replace(cfg, sizes=tuple(int(v) for v in a.sizes.split(",")))
        if a.late_large is not None:
            cfg = dataclasses.replace(cfg, late_large=a.late_large)
        with open(a.counts_only, "w") as fh:
            json.dump(count(cfg), fh, indent=1)
        return

    from experiments.paths import OUTPUT
    from karula_jax.benchmarking import bench_page, publish, run_header
    from karula_jax.reporting import cli, markdown_table

    extra = dict(
        before=dict(default=None, help="counts of an older commit (--counts-only)"),
        before_label=dict(default="before", help="that commit's name in the table"),
    )
    cfg, args = cli(
        KernelConfig,
        argv,
        quick=lambda _: QUICK,
        description=__doc__,
        out=OUTPUT / "bench/kernels.md",
        **extra,
    )
    results = count(cfg)
    lines = _rows(results)
    if args.before:
        with open(args.before) as fh:
            lines += _rows(json.load(fh), f"{args.before_label}: ")
    print(markdown_table(HEAD, lines), flush=True)
    unmatched = sorted(
        {
            s
            for r in results
            for a in r
            if a not in ("n", "s")
            for w in r[a].values()
            for s in w["unmatched_loops"]
        }
    )
    page = bench_page(
        "Kernel-launch proxy: HLO operations one compiled round executes",
        run_header("experiments.bench_kernels", argv, cfg),
        "One compiled, unbatched round (one run of n clients) of each method on the "
        "synthetic study's ridge clients; operations of the optimized program, loops "
        "counted at their measured trips (mean over the window's rounds), a conditional at "
        "its largest branch. Sites: `file:line` of the innermost loop around the "
        "operations (`round`: outside every loop). Loops whose trips were not matched to a "
        f"source line (counted at 0 unless XLA knows their trip count): {unmatched or 'none'}. "
        "Accelerator linalg: the same round compiled with the linear algebra the library "
        "runs off the CPU (a Cholesky inverse and a LAPACK QR, one custom call each, "
        "instead of the CPU's Gauss-Jordan and Householder loops); a library version "
        "without per-platform linear algebra counts the same in both Karula columns.\n",
        (HEAD, lines),
    )
    publish(page, args.out, quick=args.quick)


if __name__ == "__main__":
    main()
