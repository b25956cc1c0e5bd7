"""Benchmark: why a binding round's projection takes a dozen Newton iterations (issue 55).

On ``experiments.bench_floor``'s workload (FEMNIST-shaped 784-100-10 MLP, output layer
personalized, Karula at its default step, t = 1e-3, ``n // 10`` participants a round) the
rounds' projection problems are captured as ``bench_floor`` captures them (the same round
without its projection gives ``v``, the round's state the warm start) and taken apart:

* **moves**: how far each client's model moved since the previous round's answer, in units
  of the median radius; the round's participants (its sampled clients,
  ``RoundInfo.participants``) and the others.
* **path** (the first captured round): the solver stopped after ``j = 1, 2, ...`` Newton
  iterations (``max_iter = j``, the same warm start; the solver is deterministic, so it is
  iterate ``j`` of the full run; the last ``j`` is checked to give the full run's
  multipliers): pairs with a positive multiplier, and the KKT residual of
  ``theta(lam) = (I + L_lam)^-1 v`` computed here in float64 from the multipliers alone
  (:func:`kkt_residual`; the solver's own measure, ``laplacian._kkt``).
* **warm starts**: Newton iterations from the round's warm start, from 0 (a cold start),
  from the answer's own multipliers, from the answer's multipliers on the pairs of a
  participant (the warm start's elsewhere) and on the other pairs (the warm start's on the
  participants').
* **tolerance**: Newton iterations and time of the projection at each of ``tols``.

Command: ``python -m experiments.bench_active_set [--FIELD VALUE ...] [--out FILE]`` writes
``runs/bench/active_set.md`` (``--out results/bench/active_set.md`` refreshes the committed
page); ``--quick``: n = 12, one captured round, one step of the path (a smoke run; the
tests run it).
Runtime: about 10 min at the defaults on 2 CPU cores (n = 1000 dominates: each ``max_iter``
of the path is a program of its own).

Expected: every client moves several radii a round, the participants most; the pairs with a
positive multiplier swell to several times the answer's before they shrink back, the KKT
residual falls 2-4x an iteration until about 0.1 and faster after; the answer's multipliers
on one part of the pairs still leave 10 or more iterations, only the whole answer's none; a
looser tolerance saves the last few.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_floor import _flat, _median_ms, _own
from experiments.paths import OUTPUT
from karula_jax import algorithms as A
from karula_jax.benchmarking import bench_page, compiled_round, mlp_problem, publish, run_header
from karula_jax.models import output_layer_mask
from karula_jax.projection import ProjectionState, project
from karula_jax.reporting import cli, markdown_table


@dataclasses.dataclass(frozen=True)
class ActiveSetConfig:
    """Binding MLP rounds, captured; the projection's path and its warm starts.

    Attributes:
      sizes: numbers of clients n (``n // 10`` participate in a round).
      t: Karula's t (squared radii ``t * D``, D uniform in [0.5, 1.5]).
      warmup: Karula rounds before the first captured one.
      rounds: rounds captured (the path is taken on the first).
      tols: the projection's tolerances compared (the first: Karula's default).
      reps: timed calls per tolerance and round (median).
      rows: the range of each client's rows.
      path_max: the path's last Newton iteration (0: the full run's last).
    """

    sizes: tuple[int, ...] = (300, 1000)
    t: float = 1e-3
    warmup: int = 5
    rounds: int = 3
    tols: tuple[float, ...] = (1e-6, 1e-4, 1e-3)
    reps: int = 2
    rows: tuple[int, ...] = (150, 210)
    path_max: int = 0


def quick(cfg: ActiveSetConfig) -> ActiveSetConfig:
    """A smoke run at toy size."""
    return dataclasses.replace(
        cfg, sizes=(12,), warmup=1, rounds=1, tols=(1e-6,), reps=1, path_max=1
    )


def kkt_residual(v, r2, lam) -> float:
    """The KKT residual of ``theta(lam) = (I + L_lam)^-1 v`` (float64): the largest
    ``|d^2 - r^2| / r^2`` over pairs with a positive multiplier and ``(d^2 - r^2) / r^2``
    over the other pairs with a finite radius, at least 0; dimensionless, 0 at the solution.
    ``v`` ``[n, p]``, ``r2`` and ``lam`` ``[n, n]`` (unit masses: no two clients merged)."""
    v, r2, lam = (np.asarray(a, np.float64) for a in (v, r2, lam))
    n = v.shape[0]
    lam = 0.5 * (lam + lam.T) * (1.0 - np.eye(n))
    theta = np.linalg.solve(np.diag(1.0 + lam.sum(axis=1)) - lam, v)
    sq = np.sum(theta * theta, axis=1)
    d2 = np.maximum(sq[:, None] + sq[None, :] - 2.0 * theta @ theta.T, 0.0)
    pairs = np.triu(np.isfinite(r2) & (r2 > 0), 1)
    rel = (d2[pairs] - r2[pairs]) / r2[pairs]
    on = lam[pairs] > 0
    return float(max(0.0, np.max(np.where(on, np.abs(rel), rel), initial=0.0)))


def captured(cfg: ActiveSetConfig, n: int):
    """``(r2, [(v, previous answer, warm state, participants), ...])``: ``cfg.rounds`` of
    the binding rounds' projection problems after ``cfg.warmup`` rounds (``v`` and the
    previous answer flattened ``[n, p]``, as the projection flattens the personalized
    leaves; ``participants`` the round's sampled clients, bool ``[n]``)."""
    data, params, loss, D = mlp_problem(n, rows=cfg.rows)
    pers = output_layer_mask(params)
    make = functools.partial(
        A.karula,
        loss,
        D,
        t=cfg.t,
        learning_rate=None,
        personalized=pers,
        clients_per_round=max(1, n // 10),
        batch_size=32,
    )
    algs = {"karula": make(projection_method="laplacian"), "bare": make(projection_method="none")}
    key = jax.random.PRNGKey(0)
    states = {k: a.init(params, data, key=key) for k, a in algs.items()}
    fns = {k: compiled_round(a.round, states[k], data)[0] for k, a in algs.items()}
    state = states["karula"]
    for _ in range(cfg.warmup):
        state, _ = fns["karula"](state, data)
    problems = []
    for _ in range(cfg.rounds):
        previous = _flat(_own(pers, state.params), n)
        bare, info = fns["bare"](jax.tree.map(jnp.copy, state), data)
        warm = jax.tree.map(jnp.copy, state.proj_state)  # the round donates its state
        sampled = np.asarray(info.participants, bool)  # the same key: the round's sample
        problems.append((_flat(_own(pers, bare.params), n), previous, warm, sampled))
        state, _ = fns["karula"](state, data)
    return A.radii_squared(cfg.t, D), problems


def bench_n(cfg: ActiveSetConfig, n: int) -> dict:
    """The measurements at ``n`` clients: ``{"n", "rounds": [one dict a captured round:
    "participants" / "others" (their moves in median radii), "iterations" (from each
    start), "active" / "warm_active" (pairs with lam > 0 in the answer / warm start),
    "new" / "new_touching" (the answer's pairs at 0 in the warm start / of those, a
    participant's), "tol" ({tol: (iterations, ms)})], "path": [(j, pairs with lam > 0,
    KKT residual)], "path_start": (pairs, KKT residual) at the warm start,
    "path_matches": whether the path's last step gave the full run's multipliers}``."""
    r2, problems = captured(cfg, n)

    @functools.cache
    def solver(tol, max_iter):
        def solve(v, lam):
            warm = ProjectionState(lam, jnp.zeros((0, v.shape[1]), v.dtype))
            return project(v, r2, warm_start=warm, method="laplacian", tol=tol, max_iter=max_iter)

        return jax.jit(solve)

    default = solver(cfg.tols[0], 1000)
    radius = float(np.median(np.sqrt(np.asarray(r2)[~np.eye(n, dtype=bool)])))
    out = {"n": n, "rounds": [], "path": []}
    for index, (v, previous, warm, sampled) in enumerate(problems):
        _, info = default(v, warm.lam)
        star = info.state.lam
        moves = np.linalg.norm(np.asarray(v - previous, np.float64), axis=1) / radius
        touches = jnp.asarray(sampled[:, None] | sampled[None, :])
        starts = {  # the round's own warm start is ``info``, solved above
            "cold": jnp.zeros_like(warm.lam),
            "answer": star,
            "participants": jnp.where(touches, star, warm.lam),
            "others": jnp.where(touches, warm.lam, star),
        }
        row = {
            "participants": moves[sampled].tolist(),
            "others": moves[~sampled].tolist(),
            "iterations": {"warm": int(info.iterations)}
            | {k: int(default(v, lam)[1].iterations) for k, lam in starts.items()},
            "active": _active(star, n),
            "warm_active": _active(warm.lam, n),
            # the answer's pairs with lam > 0 that were at 0 in the warm start, and of those
            # the pairs of a participant
            "new": _active((star > 0) & ~(warm.lam > 0), n),
            "new_touching": _active((star > 0) & ~(warm.lam > 0) & touches, n),
            "tol": {},
        }
        for tol in cfg.tols:
            fn = solver(tol, 1000)
            its = info.iterations if fn is default else fn(v, warm.lam)[1].iterations
            row["tol"][tol] = (int(its), _median_ms(fn, v, warm.lam, reps=cfg.reps))
        out["rounds"].append(row)
        if index == 0:
            last = int(info.iterations)
            for j in range(1, min(last, cfg.path_max or last) + 1):
                lam = solver(cfg.tols[0], j)(v, warm.lam)[1].state.lam
                out["path"].append((j, _active(lam, n), kkt_residual(v, r2, lam)))
            # stopped at the full run's count, the solver gives the full run's multipliers
            full = bool(out["path"]) and out["path"][-1][0] == last
            out["path_matches"] = bool(jnp.array_equal(lam, star)) if full else None
            out["path_start"] = (_active(warm.lam, n), kkt_residual(v, r2, warm.lam))
    return out


def _verdict(matches) -> str:
    """``path_matches`` in words."""
    return {True: "yes", False: "no", None: "not checked (path_max)"}[matches]


def _active(lam, n) -> int:
    """Pairs ``i < j`` with a positive multiplier."""
    return int(np.count_nonzero(np.triu(np.asarray(lam) > 0, 1)))


def _span(values, fmt="{:.0f}") -> str:
    """``lo-hi`` of ``values`` formatted by ``fmt`` (one value where they format alike)."""
    lo, hi = (fmt.format(x) for x in (min(values), max(values)))
    return lo if lo == hi else f"{lo}-{hi}"


MOVES_HEAD = (
    "n | round | participants' moves (radii, min-max) | others' moves (median, max)"
    " | pairs with lam > 0: warm start / answer | new in the answer (of a participant)"
    " | Newton iterations from: the warm start / 0 (cold) / the answer / the answer on"
    " the participants' pairs / the answer on the other pairs"
)
PATH_HEAD = "n | Newton iteration | pairs with lam > 0 | KKT residual of theta(lam)"


def tol_head(cfg) -> str:
    """The tolerance table's header: one column of iterations and ms per ``cfg.tols``."""
    return "n | " + " | ".join(f"tol {t:g}: Newton iterations, ms" for t in cfg.tols)


def rows_of(cfg, r) -> tuple[list[str], list[str], str]:
    """``(moves rows, path rows, tolerance row)`` of :func:`bench_n`'s result ``r``."""
    n = r["n"]
    moves = []
    for k, row in enumerate(r["rounds"]):
        its = row["iterations"]
        moves.append(
            f"{n} | {cfg.warmup + k + 1} | {min(row['participants']):.1f}-"
            f"{max(row['participants']):.1f} | {np.median(row['others'] or [0.0]):.1f}, "
            f"{max(row['others'], default=0.0):.1f} | {row['warm_active']:,} / "
            f"{row['active']:,} | {row['new'] / max(row['active'], 1):.0%} "
            f"({row['new_touching'] / max(row['new'], 1):.0%}) | {its['warm']} / "
            f"{its['cold']} / {its['answer']} / {its['participants']} / {its['others']}"
        )
    start = r["path_start"]
    path = [f"{n} | 0 (warm start) | {start[0]:,} | {start[1]:.3g}"]
    path += [f"{n} | {j} | {a:,} | {k:.3g}" for j, a, k in r["path"]]
    cells = []
    for tol in cfg.tols:
        its = [row["tol"][tol][0] for row in r["rounds"]]
        ms = [row["tol"][tol][1] for row in r["rounds"]]
        cells.append(f"{_span(its)}, {_span(ms, '{:.1f}')}")
    return moves, path, f"{n} | " + " | ".join(cells)


def to_markdown(cfg, argv, results) -> str:
    """The page: the moves and warm starts, the path and the tolerances of every size."""
    rows = [rows_of(cfg, r) for r in results]
    return bench_page(
        "Why a binding round's projection takes a dozen Newton iterations",
        run_header("experiments.bench_active_set", argv, cfg),
        "Captured rounds of the binding MLP (as `bench_floor`). Moves: each client's model "
        "against the previous round's answer, in median radii; participants: the round's "
        "n // 10 sampled clients. New in the answer: its pairs with lam > 0 that the warm "
        "start had at 0 (in parentheses: the share of those that are a participant's). "
        "Newton iterations from five starts: the round's, all multipliers 0, the answer's, "
        "the answer's on the pairs of a participant (the round's elsewhere), the answer's on "
        "the other pairs (the round's on the participants').\n",
        (MOVES_HEAD, [m for ms, _, _ in rows for m in ms]),
        f"\nThe path of the first captured round (round {cfg.warmup + 1}): the solver "
        "stopped after each Newton iteration; the KKT residual of theta(lam) = "
        "(I + L_lam)^-1 v in float64 from the multipliers alone. Stopped at the full "
        "run's count, the solver gave the full run's multipliers: "
        + ", ".join(f"n = {r['n']}: {_verdict(r.get('path_matches'))}" for r in results)
        + ".\n",
        (PATH_HEAD, [p for _, ps, _ in rows for p in ps]),
        "\nThe projection at each tolerance, from the round's warm start (ranges over the "
        "captured rounds; ms: median of the timed calls, compiled, in one process).\n",
        (tol_head(cfg), [t for _, _, t in rows]),
    )


def main(argv=None) -> None:
    out = OUTPUT / "bench/active_set.md"
    cfg, args = cli(ActiveSetConfig, argv, quick=quick, description=__doc__, out=out)
    results = []
    for n in cfg.sizes:
        results.append(bench_n(cfg, n))
        print(markdown_table(PATH_HEAD, rows_of(cfg, results[-1])[1]), flush=True)
    publish(to_markdown(cfg, argv, results), args.out, quick=args.quick)


if __name__ == "__main__":
    main()
