"""Benchmark: what a target ratio leaves for Karula's projection where constraints bind.

For the binding MLP rounds of ``experiments.bench_scale`` (FEMNIST-shaped 784-100-10 MLP,
output layer personalized, Karula at its default step, t = 1e-3, the Laplacian dual) this
splits a Karula round into the round without its projection and the projection, and the
projection into the solver and what runs around it (the screen, the reduction onto the
span and the exact violation check of the answer). The solver's calls are counted in a
separate run whose solver reports every call to the host: dual evaluations (an inverse of
``M + L_lam``, ``theta`` by an ``[n, n] x [n, k]`` product and its Gram matrix),
Hessian-vector products (two ``[n, n]`` products where the models span many dimensions)
and certificates (distances from the evaluation's Gram matrix or, for the last one, explicit
differences). Each unit cost is timed on the captured problems, so the table says what a
target ratio against FedAvg's round leaves once the projection's fixed costs and the
solver's measured evaluations and certificates are paid, and how many Hessian products
that affords: the room this solver's measured counts and unit costs leave, not a bound on
every possible solver.

Command: ``python -m experiments.bench_floor [--FIELD VALUE ...] [--out FILE]`` writes
``runs/bench/floor.md`` (``--out results/bench/floor.md`` refreshes the committed page);
``--quick``: n = 20, one captured round (a smoke run, about 1 min; the tests run it).
Runtime: about 8 min at the defaults on 2 CPU cores (n = 1000 dominates).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from scipy.sparse import csgraph, csr_matrix

from experiments.paths import OUTPUT
from karula_jax import algorithms as A
from karula_jax.benchmarking import (
    bench_page,
    compile_loops,
    compiled_round,
    mlp_problem,
    publish,
    run_header,
)
from karula_jax.models import output_layer_mask
from karula_jax.projection import (
    api,
    certificate,
    laplacian,
    pair_algebra,
    project,
    reduction,
)
from karula_jax.reporting import cli, markdown_table


@dataclasses.dataclass(frozen=True)
class FloorConfig:
    """Binding MLP rounds, captured and taken apart.

    Expected (2 CPU cores): at n = 300 and 1000 the projection is over 90% of Karula's
    round; at the targets of issue 55 (3x FedAvg's round at n = 300, 10x at n = 1000) the
    budget affords far fewer Hessian products than the solver takes.

    Attributes:
      sizes: numbers of clients n (``n // 10`` participate in a round).
      targets: Karula's round against FedAvg's that each size is measured against (one
        per size).
      t: Karula's t (squared radii ``t * D``, D uniform in [0.5, 1.5]).
      warmup: Karula rounds before the first captured one.
      rounds: rounds captured (each: its projection timed alone and counted; the round,
        the round without projection and FedAvg's round timed beside it).
      reps: timed calls of each unit cost (median).
      rows: the range of each client's rows.
    """

    sizes: tuple[int, ...] = (300, 1000)
    targets: tuple[float, ...] = (3.0, 10.0)
    t: float = 1e-3
    warmup: int = 5
    rounds: int = 3
    reps: int = 3
    rows: tuple[int, ...] = (150, 210)


def quick(cfg: FloorConfig) -> FloorConfig:
    """A smoke run at toy size."""
    return dataclasses.replace(cfg, sizes=(20,), targets=(3.0,), warmup=1, rounds=1, reps=1)


# The solver's calls that the counted run reports: (module, attribute) -> the label of a
# call, from its keyword arguments (a certificate by explicit differences unless ``gram``).
COUNTED = {
    (laplacian, "hvp"): lambda kw: "hessian_products",
    (laplacian, "dual_eval"): lambda kw: "evaluations",
    (laplacian, "restore_and_certify"): lambda kw: (
        "certificates_gram" if kw.get("gram", False) else "certificates_exact"
    ),
}
LABELS = ("evaluations", "hessian_products", "certificates_gram", "certificates_exact")


@contextlib.contextmanager
def counting(counts: collections.Counter):
    """Programs traced inside report every call of :data:`COUNTED` to the host.

    jax's caches are cleared on entry and on exit, so that a program compiled before
    (the projection's jitted core) is traced again with the counters, and a program
    compiled inside is not reused after."""
    saved = {key: getattr(*key) for key in COUNTED}
    jax.clear_caches()

    def counted(fn, label_of):
        def call(*args, **kwargs):
            label = label_of(kwargs)
            jax.debug.callback(lambda: counts.update([label]))
            return fn(*args, **kwargs)

        return call

    try:
        for (module, name), label_of in COUNTED.items():
            setattr(module, name, counted(saved[(module, name)], label_of))
        yield counts
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)
        jax.clear_caches()


def _median_ms(fn, *args, reps: int) -> float:
    """Median milliseconds of ``fn(*args)`` over ``reps`` calls after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def _own(pers, params) -> list:
    """The personalized leaves of ``params`` (``pers`` its boolean mask tree)."""
    return [a for a, m in zip(jax.tree.leaves(params), jax.tree.leaves(pers), strict=True) if m]


def _flat(leaves, n: int):
    """Leaves with a leading client axis ``n`` as one ``[n, p]`` matrix, in leaf order (as
    the projection flattens them)."""
    return jnp.concatenate([jnp.reshape(a, (n, -1)) for a in leaves], axis=1)


def sparse_products(ev, mask, x):
    """``hvp(ev, mask, x)`` on the pairs where ``x`` is nonzero, computed pair by pair, in
    two forms; ``(pairs, forms)``: ``pairs`` ``(i, j)`` the ``q`` pairs ``i < j`` (index
    arrays in the order of ``np.nonzero`` over the upper triangle) and ``forms`` ``{name:
    fn}``, each ``fn(ev, xv)`` of their values ``xv`` ``[q]`` returning ``[q]``.

    Both form ``Z = L_x G`` by gathers of the Gram rows of the pairs and a scatter-add
    (``O(q n)``, where the dense product's ``x @ G`` is ``O(n^3)``); then ``"one
    product"`` multiplies ``Z`` by ``A^-1`` (``O(n^3)``) and gathers the pair entries,
    ``"entries"`` computes only the entries the output needs, ``(A^-1 Z)_ij`` as dot
    products of gathered rows and ``diag(A^-1 Z)`` (``O(q n + n^2)``). Eager: ``q`` is a
    shape."""
    n = x.shape[0]
    iu, ju = np.triu_indices(n, 1)
    on = np.asarray(x)[iu, ju] != 0
    pi, pj = jnp.asarray(iu[on]), jnp.asarray(ju[on])

    def lx_gram(ev, xv):  # L_x G: row i gets x_ij (G_i - G_j), row j its negative
        rows = xv[:, None] * (ev.gram[pi] - ev.gram[pj])
        return jnp.zeros_like(ev.gram).at[pi].add(rows).at[pj].add(-rows)

    def out(dg, y_ij, y_ji):
        return jnp.where(mask[pi, pj], dg[pi] + dg[pj] - y_ij - y_ji, 0.0)

    def one_product(ev, xv):
        yt = ev.a_inv @ lx_gram(ev, xv)
        return out(jnp.diag(yt), yt[pi, pj], yt[pj, pi])

    def entries(ev, xv):
        zt = lx_gram(ev, xv).T  # row j: column j of L_x G
        dg = jnp.sum(ev.a_inv * zt, axis=1)
        y_ij = jnp.sum(ev.a_inv[pi] * zt[pj], axis=1)
        y_ji = jnp.sum(ev.a_inv[pj] * zt[pi], axis=1)
        return out(dg, y_ij, y_ji)

    return (pi, pj), {"one product": one_product, "entries": entries}


def active_components(lam) -> tuple[int, int]:
    """(number, largest size in clients) of the connected components of the graph whose
    edges are the pairs with a positive multiplier, ``lam`` ``[n, n]``; a client in no such
    pair is a component of its own. Where it splits, ``M + L_lam`` is block diagonal and each
    block's clients could be solved apart; one component of ``n`` leaves no such block."""
    edges = csr_matrix(np.triu(np.asarray(lam) > 0, 1))
    count, labels = csgraph.connected_components(edges, directed=False)
    return int(count), int(np.bincount(labels).max())


def unit_costs(v, r2, warm, reps: int) -> dict:
    """Milliseconds of what a projection of ``v`` [n, p] runs around its solver (the
    screen's Gram product, the reduction onto the span, the exact violation check of the
    answer) and of one dual evaluation (distances from the Gram matrix, as the solver's
    first phase takes them), Hessian-vector product and certificate (from the Gram matrix
    and by explicit differences) at the warm start's multipliers; ``k``: coordinates
    after the reduction."""
    n, p = v.shape
    rotate = p >= 2 * n  # as the Laplacian dual's registry row
    red = reduction.reduce_problem(v, r2, rotate=rotate)
    mask = certificate.dual_mask(red)
    lam = jnp.where(mask, warm.lam, 0.0)
    ev = certificate.dual_eval(lam, red, gram=True)
    x = jnp.where(mask & (lam > 0), 1.0, 0.0)

    def cert(th, gm):  # as the solver certifies: through ev's Gram matrix gm, else exactly
        sq = None if gm is None else reduction.sq_dists_of_gram(gm)
        return certificate.restore_and_certify(th, ev.g, red, gram=gm is not None, sq_dists=sq)[1]

    timed = lambda fn, *args: _median_ms(compile_loops(jax.jit(fn), *args), *args, reps=reps)
    # the pair-sparse forms on the pairs with lam > 0, timed as the dense product is
    (pi, pj), forms = sparse_products(ev, mask, x)
    xv = x[pi, pj]
    dense = pair_algebra.hvp(ev, mask, x)[pi, pj]
    scale = float(jnp.max(jnp.abs(dense), initial=0.0)) or 1.0
    sparse = {}
    for name, form in forms.items():  # compiled once: checked, then timed
        fn = compile_loops(jax.jit(lambda xv, form=form: form(ev, xv)), xv)
        error = float(jnp.max(jnp.abs(fn(xv) - dense), initial=0.0)) / scale
        sparse[name] = (_median_ms(fn, xv, reps=reps), error)
    return {
        # the projection's own screen and check (explicit differences) of its answer
        "screen": timed(lambda v, r2: api._screen(v, r2).beta, v, r2),
        "reduction": timed(lambda v, r2: reduction.reduce_problem(v, r2, rotate=rotate), v, r2),
        "violation_check": timed(lambda v, r2: api._violation(v, r2)[0], v, r2),
        "evaluation": timed(lambda lam: certificate.dual_eval(lam, red, gram=True).g, lam),
        "hessian_product": timed(lambda x: pair_algebra.hvp(ev, mask, x), x),
        "sparse_product": sparse["one product"][0],
        "sparse_entries": sparse["entries"][0],
        "sparse_error": max(error for _, error in sparse.values()),
        "certificate_gram": timed(cert, ev.th, ev.gram),
        "certificate_exact": timed(lambda th: cert(th, None), ev.th),
        "k": red.w.shape[1],
    }


def bench_n(cfg: FloorConfig, n: int, target: float) -> dict:
    data, params, loss, D = mlp_problem(n, rows=cfg.rows)
    pers = output_layer_mask(params)
    kw = dict(clients_per_round=max(1, n // 10), batch_size=32)
    make = functools.partial(
        A.karula, loss, D, t=cfg.t, learning_rate=None, personalized=pers, **kw
    )
    algs = {
        "fedavg": A.fedavg(loss, learning_rate=0.05, local_steps=5, **kw),
        "karula": make(projection_method="laplacian"),
        "bare": make(projection_method="none"),  # the same round, projection skipped
    }
    key = jax.random.PRNGKey(0)
    states = {k: jax.block_until_ready(a.init(params, data, key=key)) for k, a in algs.items()}
    fns = {k: compiled_round(a.round, states[k], data)[0] for k, a in algs.items()}
    for _ in range(cfg.warmup):
        states["karula"], _ = jax.block_until_ready(fns["karula"](states["karula"], data))
    r2 = A.radii_squared(cfg.t, D)

    def projection(v, warm):  # as Karula's round calls it (its default tol and cap)
        return project(v, r2, warm_start=warm, method="laplacian", tol=1e-6, max_iter=1000)

    solve = counted_solve = None
    counts = collections.Counter()
    rows = collections.defaultdict(list)
    for _ in range(cfg.rounds):
        # The round's projection problem: the same round without its projection (same
        # participants and minibatches: both derive them from the state's key and round).
        start = states["karula"]
        copy = jax.block_until_ready(jax.tree.map(jnp.copy, start))
        bare_state, _ = jax.block_until_ready(fns["bare"](copy, data))
        v = _own(pers, bare_state.params)
        warm = start.proj_state
        # compiled as the round compiles its program (the runner's compiler options)
        if solve is None:
            solve = compile_loops(jax.jit(projection), v, warm)
        theta, info = jax.block_until_ready(solve(v, warm))
        rows["projection_ms"].append(_median_ms(solve, v, warm, reps=cfg.reps))
        if counted_solve is None:  # traced and compiled once, its counters reset each round
            with counting(counts):
                counted_solve = jax.jit(projection).lower(v, warm).compile()
        counts.clear()
        _, counted = jax.block_until_ready(counted_solve(v, warm))
        jax.effects_barrier()
        rows["counted_iterations"].append(int(counted.iterations))
        for label in LABELS:
            rows[label].append(counts[label])
        rows["iterations"].append(int(info.iterations))
        lam = np.asarray(info.state.lam)
        rows["active"].append(np.count_nonzero(np.triu(lam, 1)) / (n * (n - 1) / 2))
        count, largest = active_components(lam)
        rows["components"].append(count)
        rows["largest_component"].append(largest)
        # the three rounds, in turn, each from a copy of the same state
        for name in ("fedavg", "bare", "karula"):
            state = states["fedavg"] if name == "fedavg" else start
            state = jax.block_until_ready(jax.tree.map(jnp.copy, state))
            t0 = time.perf_counter()
            out, round_info = jax.block_until_ready(fns[name](state, data))
            rows[name + "_ms"].append(1e3 * (time.perf_counter() - t0))
            if name == "fedavg":
                states["fedavg"] = out
        states["karula"] = out
        # the captured problem is the round's: its projection equals the round's output
        got, want = _flat(_own(pers, out.params), n), _flat(theta, n)
        scale = float(jnp.max(jnp.abs(want))) or 1.0
        rows["capture_error"].append(float(jnp.max(jnp.abs(got - want))) / scale)
        rows["round_iterations"].append(int(round_info.proj_iterations))
    units = unit_costs(_flat(v, n), r2, warm, cfg.reps)
    same = lambda a: sum(x == y for x, y in zip(rows[a], rows["iterations"], strict=True))
    return {
        "n": n,
        "target": target,
        **{k: float(np.median(x)) for k, x in rows.items()},
        "capture_error": max(rows["capture_error"]),
        "rounds": cfg.rounds,
        "same_counted": same("counted_iterations"),
        "same_round": same("round_iterations"),
        **units,
    }


ROUND_HEAD = (
    "n | pairs with lam > 0 | components of their graph (largest, clients) | FedAvg ms"
    " | Karula ms | ratio | round without projection ms"
    " | projection ms (alone) | target | budget for the projection ms"
)
ANATOMY_HEAD = (
    "n | k | Newton iterations | evaluations | Hessian products | certificates (Gram / exact)"
    " | around the solver ms (screen / reduction / check) | evaluation ms"
    " | Hessian product ms"
    " | certificate ms (Gram / exact) | explained share of the projection"
    " | fixed costs ms | Hessian products the budget affords"
    " | pair-sparse Hessian product ms (one product / entries)"
)


def rows_of(result: dict) -> tuple[str, str]:
    """The round row and the anatomy row of one size's ``result`` (:func:`bench_n`).

    Budget: ``target x FedAvg - the round without projection``. Around the solver: the
    screen, the reduction and the violation check, once each. Fixed costs: around the
    solver plus the measured evaluations and certificates at their unit costs.
    Affordable Hessian products: ``(budget - fixed costs) / one product`` (0 when
    negative). Explained share: fixed costs plus the Hessian products at their unit cost,
    over the projection's time."""
    r = result
    budget = r["target"] * r["fedavg_ms"] - r["bare_ms"]
    around = r["screen"] + r["reduction"] + r["violation_check"]
    certs = (
        r["certificates_gram"] * r["certificate_gram"]
        + r["certificates_exact"] * r["certificate_exact"]
    )
    fixed = around + r["evaluations"] * r["evaluation"] + certs
    explained = (fixed + r["hessian_products"] * r["hessian_product"]) / r["projection_ms"]
    afford = max(budget - fixed, 0.0) / r["hessian_product"]
    round_row = (
        f"{r['n']} | {100 * r['active']:.1f}% | "
        f"{r['components']:.0f} ({r['largest_component']:.0f}) | "
        f"{r['fedavg_ms']:.1f} | {r['karula_ms']:.1f} | "
        f"{r['karula_ms'] / r['fedavg_ms']:.1f}x | {r['bare_ms']:.1f} | "
        f"{r['projection_ms']:.1f} | {r['target']:g}x | {budget:.1f}"
    )
    anatomy_row = (
        f"{r['n']} | {r['k']} | {r['iterations']:.0f} | {r['evaluations']:.0f} | "
        f"{r['hessian_products']:.0f} | {r['certificates_gram']:.0f} / "
        f"{r['certificates_exact']:.0f} | {around:.1f} ({r['screen']:.1f} / "
        f"{r['reduction']:.1f} / {r['violation_check']:.1f}) | {r['evaluation']:.2f} | "
        f"{r['hessian_product']:.2f} | "
        f"{r['certificate_gram']:.2f} / {r['certificate_exact']:.2f} | "
        f"{100 * explained:.0f}% | {fixed:.1f} | {afford:.0f} | "
        f"{r['sparse_product']:.2f} / {r['sparse_entries']:.2f} "
        f"({min(r['sparse_product'], r['sparse_entries']) / r['hessian_product']:.1f}x)"
    )
    return round_row, anatomy_row


def to_markdown(cfg, argv, results) -> str:
    rows = [rows_of(r) for r in results]
    worst = max(r["capture_error"] for r in results)
    return bench_page(
        "What bounds Karula's round where constraints bind",
        run_header("experiments.bench_floor", argv, cfg),
        "Medians over the captured rounds (rounds "
        f"{cfg.warmup + 1}-{cfg.warmup + cfg.rounds}); rounds timed in turn in one process. "
        "Budget for the projection: target x FedAvg's round - the round without "
        "projection. Components: of the graph whose edges are the pairs with lam > 0 "
        "(`active_components`); one of n clients means M + L_lam has no diagonal block "
        "that could be solved apart.\n",
        (ROUND_HEAD, [a for a, _ in rows]),
        "\nThe projection taken apart: the solver's calls counted in a separate run, unit "
        "costs timed on the last captured problem, each a compiled call of its own (one "
        "dispatch included; k: coordinates after the reduction). Around the solver: the "
        "screen, the reduction onto the span (with its QR where p >= 2n) and the exact "
        "violation check of the answer (the map back is in the rest). Fixed costs: around "
        "the solver + the evaluations and certificates. Explained share: (fixed costs + "
        "Hessian products x Hessian product) / projection; the rest is line searches, "
        "CG's vector updates, the map back and loop control. Hessian "
        "products the budget affords: (budget - fixed costs) / one Hessian product. "
        "Pair-sparse Hessian product: the same product on the pairs with lam > 0 alone "
        "(fewer than CG's free pairs), pair by pair (`sparse_products`: L_x G by gathers "
        "and a scatter-add, O(q n), then one [n, n] product by A^-1, or only the entries "
        "needed, O(q n + n^2)), each compiled and timed as the dense product the solver "
        "runs; in parentheses the faster form over the dense one (they differ by at most "
        f"{max(r['sparse_error'] for r in results):.1e} of its largest entry).\n",
        (ANATOMY_HEAD, [b for _, b in rows]),
        f"\nCaptured problems against the rounds' own projections: largest difference "
        f"{worst:.1e} of the largest coordinate; the same iterations in "
        f"{sum(r['same_round'] for r in results)} of {sum(r['rounds'] for r in results)} "
        f"rounds. The counted runs took the timed runs' iterations in "
        f"{sum(r['same_counted'] for r in results)} of them.\n",
    )


def main(argv=None) -> None:
    out = OUTPUT / "bench/floor.md"
    cfg, args = cli(FloorConfig, argv, quick=quick, description=__doc__, out=out)
    if len(cfg.targets) != len(cfg.sizes):
        raise ValueError(
            f"targets must give one ratio per size ({len(cfg.sizes)}), got {cfg.targets}"
        )
    results = []
    for n, target in zip(cfg.sizes, cfg.targets, strict=True):
        results.append(bench_n(cfg, n, target))
        print(markdown_table(ROUND_HEAD, [rows_of(results[-1])[0]]), flush=True)
    publish(to_markdown(cfg, argv, results), args.out, quick=args.quick)


if __name__ == "__main__":
    main()
