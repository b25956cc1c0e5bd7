"""Theorem 4.3 measured: the gradient mapping against the paper's bound, and its floor.

Ridge clients in groups, Karula at the theorem's step ``3 / (8 L_max)`` with partial
participation, from a common (feasible) start. For each setting the seed mean of
``||G_eta(theta^k)||^2`` (the expectation over participation draws), its running minimum
over ``k < K`` and the bound ``(8 L / 3)((f(theta^0) - f*) / K + 4 sigma^2 (s + 1) / s +
2 delta)`` with ``f*`` from cvxpy, ``sigma^2`` measured along the iterates
(:func:`karula_jax.theory.minibatch_sigma_sq`) and ``delta`` the largest certified
projection error of the run (paper units). Two sweeps, over the minibatch and over the
projection's iteration cap, compare the measured floor (the mean of ``E ||G||^2`` over the
last quarter of the rounds) with the bound's floor ``(8 L / 3)(4 sigma^2 (s + 1) / s + 2
delta)``. The proof's bound (:func:`karula_jax.theory.theorem_4_3_proof_bound`, constant
``64 L / 3``, on the average over ``k < K`` with the measured decrease ``f(theta^0) - E
f(theta^K)``) is checked beside it. Definitions: ``docs/theory.md``.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import cvxpy as cp
import jax
import jax.numpy as jnp
import numpy as np

from experiments.paths import OUTPUT
from karula_jax import provenance, reporting, theory
from karula_jax.algorithms import karula, lipschitz_ridge
from karula_jax.data import client_weights, synthetic_ridge
from karula_jax.models import ridge_loss

__all__ = ["TheoryConfig", "main"]


@dataclasses.dataclass(frozen=True)
class TheoryConfig:
    """Karula on ridge clients at the theorem's step: exact, minibatch and inexact settings.

    Command: ``python -m experiments.theory`` writes ``runs/theory/`` (``--out
    results/theory`` refreshes the committed page); ``--quick`` is a smoke run.
    Expected: the bound holds at every K in every setting, and the measured floor grows
    with the bound's floor in both sweeps; about 3 min on 2 CPU cores.

    Attributes:
      num_clients, dim, clients_per_round: n, d and s (2 <= s <= n - 1).
      lam: the ridge penalty. radius_scale: squared radii are this times the squared
        distances of the generating models (several pairs bind at the optimum).
      rounds, seeds: K and the participation draws averaged for the expectation.
      minibatches: B of the noisy settings (decreasing B, growing sigma^2).
      inexact_caps: the projection's iteration caps of the inexact settings (tolerance
        1e-3; a smaller cap, a larger delta), against 20000 (tolerance 1e-12) elsewhere.
    """

    num_clients: int = 10
    dim: int = 5
    clients_per_round: int = 4
    lam: float = 0.1
    radius_scale: float = 0.05
    rounds: int = 400
    seeds: int = 16
    minibatches: tuple[int, ...] = (8, 4, 2, 1)
    inexact_caps: tuple[int, ...] = (4, 2, 1)


def _quick(cfg: TheoryConfig) -> TheoryConfig:
    return dataclasses.replace(cfg, rounds=40, seeds=2, minibatches=(2,), inexact_caps=(2,))


def _f(A, b, a, theta):
    """``(1/n) sum_i alpha_i (theta_i^T A_i theta_i / 2 - b_i^T theta_i)``, ``[..., n, p]``."""
    quad = 0.5 * np.einsum("...ni,nij,...nj->...n", theta, A, theta)
    return (a * (quad - np.einsum("ni,...ni->...n", b, theta))).sum(-1) / len(a)


def _problem(cfg: TheoryConfig):
    ds = synthetic_ridge(0, num_clients=cfg.num_clients, dim=cfg.dim, min_samples=5, max_samples=15)
    data = ds.train
    x, y = np.asarray(data.x, np.float64), np.asarray(data.y, np.float64)
    counts = np.asarray(data.counts)
    mask = np.arange(x.shape[1])[None] < counts[:, None]
    x, y = np.where(mask[..., None], x, 0.0), np.where(mask, y, 0.0)
    A = np.einsum("nki,nkj->nij", x, x) / counts[:, None, None] + cfg.lam * np.eye(cfg.dim)
    b = np.einsum("nki,nk->ni", x, y) / counts[:, None]
    th = np.asarray(ds.theta_true, np.float64)
    radii = np.float32(cfg.radius_scale) * ((th[:, None] - th[None]) ** 2).sum(-1)
    radii = np.asarray(radii.astype(np.float32), np.float64)
    return data, A, b, np.asarray(client_weights(data.counts), np.float64), radii


def _f_star(A, b, a, radii) -> float:
    n, p = b.shape
    W = cp.Variable((n, p))
    obj = sum(a[i] * (0.5 * cp.quad_form(W[i], A[i]) - b[i] @ W[i]) for i in range(n)) / n
    cons = [cp.sum_squares(W[i] - W[j]) <= radii[i, j] for i in range(n) for j in range(i + 1, n)]
    prob = cp.Problem(cp.Minimize(obj), cons)
    prob.solve(solver=cp.CLARABEL)
    return float(prob.value)


def _run(cfg, data, radii, eta, *, batch_size, tol, max_iter):
    """Iterates ``[seeds, K, n, p]`` (before each round) and certified deltas ``[seeds, K]``."""
    loss = ridge_loss(cfg.lam)
    alg = karula(
        loss,
        jnp.asarray(radii),
        t=1.0,
        learning_rate=eta,
        clients_per_round=cfg.clients_per_round,
        batch_size=batch_size,
        projection_tol=tol,
        projection_max_iter=max_iter,
    )

    def one(key):
        state = alg.init(jnp.zeros(cfg.dim, jnp.float64), data, key=key)

        def body(st, _):
            before = alg.client_params(st, data)
            st, info = alg.round(st, data)
            return st, (before, info.proj_delta)

        return jax.lax.scan(body, state, None, length=cfg.rounds)[1]

    keys = jax.random.split(jax.random.key(0), cfg.seeds)
    return jax.jit(jax.vmap(one))(keys)


def _mapping_sq(cfg, data, theta, a, radii, eta):
    x, y = jnp.asarray(data.x, jnp.float64), jnp.asarray(data.y, jnp.float64)
    mask = jnp.arange(x.shape[1])[None] < jnp.asarray(data.counts)[:, None]
    fn = jax.jit(theory.gradient_mapping_sq_norms, static_argnums=0)
    args = (jnp.asarray(a), jnp.asarray(radii), eta)
    return np.asarray(fn(ridge_loss(cfg.lam), jnp.asarray(theta), x, y, mask, *args)[0])


def _sigma_sq(cfg, data, theta, a, batch_size) -> float:
    loss = ridge_loss(cfg.lam)
    args = (jnp.asarray(data.x, jnp.float64), jnp.asarray(data.y, jnp.float64))
    counts, alpha = jnp.asarray(data.counts), jnp.asarray(a)
    flat = theta.reshape(-1, *theta.shape[-2:])[:: max(1, theta.shape[1] // 50)]
    fn = jax.jit(
        jax.vmap(lambda th: theory.minibatch_sigma_sq(loss, th, *args, counts, alpha, batch_size))
    )
    return float(np.max(fn(flat)))


def run(cfg: TheoryConfig, out, command: str) -> list[dict]:
    """Runs every setting, writes ``table.md`` and the figures to ``out`` and, where
    ``out`` holds a results page (``README.md``), its run header; returns the rows."""
    start = time.perf_counter()
    facts = provenance.run_provenance()  # the code that runs: read before it runs
    data, A, b, a, radii = _problem(cfg)
    L = lipschitz_ridge(data, cfg.lam, per_client=True)
    eta = float(theory.theorem_step(L))
    f_star = _f_star(A, b, a, radii)
    gap0 = float(_f(A, b, a, np.zeros_like(b))) - f_star
    n_max = int(np.max(data.counts))
    settings = {"exact gradients, exact projections": (n_max, 1e-12, 20000)}
    settings |= {f"minibatch B = {B}": (B, 1e-12, 20000) for B in cfg.minibatches}
    settings |= {f"projection capped at {c}": (n_max, 1e-3, c) for c in cfg.inexact_caps}
    rows, curves = [], {}
    K = np.arange(1, cfg.rounds + 1)
    with jax.enable_x64(True):
        for name, (B, tol, max_iter) in settings.items():
            theta, deltas = _run(cfg, data, radii, eta, batch_size=B, tol=tol, max_iter=max_iter)
            theta = np.asarray(theta)
            sq = _mapping_sq(cfg, data, theta, a, radii, eta)
            sigma_sq = 0.0 if B >= n_max else _sigma_sq(cfg, data, theta, a, B)
            delta = float(np.max(np.asarray(theory.paper_delta(np.asarray(deltas), eta))))
            expected = sq.mean(0)  # over participation draws
            observed = np.minimum.accumulate(expected)
            bound = np.asarray(
                theory.theorem_4_3_bound(
                    L, gap0, K, sigma_sq=sigma_sq, s=cfg.clients_per_round, delta=delta
                )
            )
            # the proof's average form, K = 1 .. rounds - 1 (theta^K is the next iterate)
            avg = np.cumsum(expected)[:-1] / K[:-1]
            decrease = _f(A, b, a, theta[:, 0]).mean() - _f(A, b, a, theta[:, 1:]).mean(0)
            proof = np.asarray(
                theory.theorem_4_3_proof_bound(
                    L, decrease, K[:-1], sigma_sq=sigma_sq, s=cfg.clients_per_round, delta=delta
                )
            )
            curves[name] = {"observed min E||G||^2": observed, "Theorem 4.3 bound": bound}
            rows.append(
                {
                    "setting": name,
                    "sigma_sq": sigma_sq,
                    "delta": delta,
                    "observed": float(observed[-1]),
                    "bound": float(bound[-1]),
                    "floor": float(bound[-1] - 8 * L / 3 * gap0 / cfg.rounds),
                    "observed_floor": float(expected[-(cfg.rounds // 4) :].mean()),
                    "holds": bool(np.all(observed <= bound)),
                    "tightest": float(np.min(bound / observed)),
                    "proof_holds": bool(np.all(avg <= proof)),
                    "proof_ratio": float(np.max(avg / proof)),
                }
            )
    out.mkdir(parents=True, exist_ok=True)
    _plot_floors(rows, out)
    # bound.png: the exact run and the lower middle of each sweep (B = 2 and cap 2 by default)
    middle = lambda xs: sorted(xs)[(len(xs) - 1) // 2]  # noqa: E731
    shown = ["exact gradients, exact projections"]
    shown += [f"minibatch B = {middle(cfg.minibatches)}"] if cfg.minibatches else []
    shown += [f"projection capped at {middle(cfg.inexact_caps)}"] if cfg.inexact_caps else []
    reporting.plot_lines(
        K,
        {name: curves[name] for name in shown},
        out / "bound.png",
        xlabel="K (rounds)",
        ylabel="min_{k<K} E||G_eta(theta^k)||^2",
        title="Theorem 4.3 at eta = 3/(8 L_max)",
    )
    head = (
        "setting | sigma^2 | delta (paper units) | min_k E ‖G‖² at K | bound at K | "
        "bound's floor (8L/3) eps | measured floor | holds at every K | "
        "min over K of bound / observed | proof's bound holds (average form) | "
        "max over K of average / proof's bound"
    )
    lines = [
        f"{r['setting']} | {r['sigma_sq']:.3g} | {r['delta']:.3g} | {r['observed']:.3g} | "
        f"{r['bound']:.3g} | {r['floor']:.3g} | {r['observed_floor']:.3g} | "
        f"{'yes' if r['holds'] else 'NO'} | {r['tightest']:.2f} | "
        f"{'yes' if r['proof_holds'] else 'NO'} | {r['proof_ratio']:.3g}"
        for r in rows
    ]
    text = "\n".join(
        [
            "# Theorem 4.3 measured",
            "",
            f"n = {cfg.num_clients}, d = {cfg.dim}, s = {cfg.clients_per_round}, ridge lam = "
            f"{cfg.lam}, K = {cfg.rounds}, {cfg.seeds} participation draws; L_max = {L:.4g}, "
            f"eta = 3/(8 L_max) = {eta:.4g}, f(theta^0) - f* = {gap0:.4g} (cvxpy).",
            "",
            reporting.markdown_table(head, lines),
            "",
            "Measured floor: the mean of E‖G‖² over the last quarter of the rounds. Figures: "
            "`bound.png` (running minimum against the bound), `floor_minibatch.png` and "
            "`floor_projection.png` (measured floor against the bound's floor).",
            f"Command: `{command}`; {time.perf_counter() - start:.0f} s.",
        ]
    )
    (out / "table.md").write_text(text + "\n")
    print(text)
    header = provenance.provenance_header(facts, seconds=time.perf_counter() - start)
    if provenance.stamp_page(out / "README.md", header):
        print(f"updated the run header of {out / 'README.md'}")
    return rows


def _plot_floors(rows: list[dict], out) -> None:
    """``floor_minibatch.png`` and ``floor_projection.png``: per sweep of two settings or
    more, the measured floor against the bound's floor (log-log, the bound's floor on both
    axes as the line the measured one must stay under)."""
    for name, key, title in (
        ("minibatch", "minibatch", "minibatch"),
        ("projection", "capped", "capped projection"),
    ):
        got = np.array(
            sorted((r["floor"], r["observed_floor"]) for r in rows if key in r["setting"])
        )
        if len(got) > 1:
            reporting.plot_lines(
                got[:, 0],
                {title: {"measured floor": got[:, 1], "bound": got[:, 0]}},
                out / f"floor_{name}.png",
                xlabel="bound's floor (8L/3)(4 sigma^2 (s+1)/s + 2 delta)",
                ylabel="mean E||G||^2, last quarter of rounds",
            )


def main(argv=None):
    flags = list(sys.argv[1:] if argv is None else argv)
    cfg, args = reporting.cli(
        TheoryConfig, flags, quick=_quick, description=__doc__, out=OUTPUT / "theory"
    )
    return run(cfg, args.out, "python -m experiments.theory")


if __name__ == "__main__":
    main()
