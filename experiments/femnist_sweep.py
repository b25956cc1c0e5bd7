"""FEMNIST: Karula at every t of a sweep at one step, and FedPer (what the constraints add
over free output layers). Entry point: ``python -m experiments.femnist --t-sweep ...``;
findings: ``results/femnist/README.md``."""

from __future__ import annotations

import functools
import pathlib

import numpy as np

from experiments.femnist import (
    Config,
    active_pairs,
    make_methods,
    rates_text,
    seed_values,
    setup,
    study,
)
from karula_jax import protocol, reporting
from karula_jax.stats import mean_and_se

__all__ = ["run_t_sweep", "sweep_study"]


def sweep_study(cfg: Config, tag: str = "t_sweep") -> protocol.Study:
    """Karula at every ``t`` of ``cfg.t_sweep`` at one step, and FedPer: what the
    constraints add over free output layers (the seeds' writers, no CV).

    Every t takes the same step: Karula's default without coupling (its ``t = inf`` rule,
    which the projection, a nonexpansive map, cannot make unstable) with ``rates="default"``,
    else Karula's paper rate; so accuracy against t isolates the constraint. FedPer is
    FedAvg with the output layer personalized (its own rate rule). The table adds the
    share of active pairs at the end; ``<tag>.png`` plots accuracy and active pairs
    against t, the paper's ``t = 20`` marked.
    """
    S, comparison = cfg.seeds, study(cfg, tag)
    model, loss, personal = setup(cfg)
    base = make_methods(cfg, loss, personal, ["Karula", "FedPer"])
    ts = {f"Karula t={t:g}": float(t) for t in cfg.t_sweep}
    methods = {
        m: base["Karula"]._replace(make=functools.partial(base["Karula"].make, t=t))
        for m, t in ts.items()
    }
    methods |= {"FedPer": base["FedPer"]} if "FedPer" in cfg.methods else {}
    reference = max(ts, key=ts.get)

    def active(name, o, data) -> np.ndarray:  # % per seed; FedPer: no constraint, none
        if name not in ts:
            return np.zeros(len(data.seeds))
        return 100 * active_pairs(o.params, data.D, ts[name], personal)

    def values(name, o, data) -> dict[str, np.ndarray]:
        return seed_values(name, o, data) | {"active": active(name, o, data)}

    def notes(result) -> list[str]:
        rates = np.asarray(result.member_kwargs["rates"]["karula"])
        return [
            f"{S} writer draws of {cfg.num_clients} as in table.md, {cfg.rounds} rounds, "
            f"{'inverted' if cfg.invert else 'LEAF'} pixels. Karula at every t takes one step "
            f"(seed 0: {rates[0]:.4g}; {rates_text(cfg)}, Karula's without coupling), "
            "output layer personalized, D the row-norm linearized W1; FedPer: FedAvg "
            f"({cfg.local_steps} local steps, its own rate) with the output layer personalized.",
            "Active: pairs i < j with ||theta_i - theta_j||^2 >= (1 - 1e-3) t D_ij over the "
            "output layers at the end (t = 0: every pair; t = inf and FedPer: none), mean over "
            f"draws. ± is the 95% Student-t interval over draws; paired differences against "
            f"{reference}, decided when the paired t-test's p-value, Holm-adjusted over the "
            "table's comparisons, is below 0.05.",
        ]

    def plot(result, path):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        v = result.values  # per seed, as in the table
        finite = [t for t in ts.values() if 0 < t < np.inf] or [20.0]
        lo, hi = min(finite) / 3, max(finite) * 3
        x = np.array([lo if t == 0 else hi if np.isinf(t) else t for t in ts.values()])
        fig, axes = plt.subplots(1, 2, figsize=(10.4, 3.8))
        m, e = np.array([mean_and_se(v[name]["test_acc"]) for name in ts]).T  # mean, 2 SE
        axes[0].errorbar(x, m, yerr=e, marker="o", capsize=3, label="Karula (± 2 SE)")
        if "FedPer" in v:
            axes[0].axhline(v["FedPer"]["test_acc"].mean(), color="gray", ls="--", label="FedPer")
        axes[1].plot(x, [v[name]["active"].mean() for name in ts], marker="o")
        for ax, ylabel in zip(
            axes, ("mean per-writer test accuracy (%)", "active pairs (%)"), strict=True
        ):
            ax.set(xscale="log", xlabel="t (left end: t = 0, right end: t = inf)", ylabel=ylabel)
            ax.axvline(20.0, color="red", lw=0.8, ls=":", label="paper's t = 20")
            ax.grid(alpha=0.3)
        axes[0].legend(frameon=False, fontsize=8)
        fig.suptitle(f"FEMNIST: Karula over t at one step, {S} writer draws")
        fig.tight_layout()
        fig.savefig(path, dpi=130)
        plt.close(fig)

    key = reference.lower() + "_minus"
    columns = [c for c in comparison.columns if c[0] not in ("cv_choice", "runtime_s")]
    columns = [(k.replace("karula_minus", key), h.replace("Karula", reference)) for k, h in columns]
    columns += [("active", reporting.banded("active pairs at the end (%)"))]
    columns += [("runtime_s", "runtime (s)")]
    return comparison._replace(
        title=f"FEMNIST: Karula over t at one step{' - ' + tag if tag else ''}",
        methods=lambda _: methods,
        num_folds=0,
        tuning_seeds=(),
        values=values,
        columns=columns,
        reference=reference,
        report=lambda result: protocol.Report(
            notes(result), figures={f"{tag or 't_sweep'}.png": functools.partial(plot, result)}
        ),
        digits=comparison.digits | {key: 1, "active": 2},
    )


def run_t_sweep(cfg: Config, out: pathlib.Path, tag: str = "t_sweep") -> dict:
    """Runs :func:`sweep_study`; writes ``table_<tag>``, ``<tag>.png`` and
    ``summary_<tag>.json`` (per-seed accuracies and active pairs in ``"per_seed"``)."""
    return protocol.run_study(sweep_study(cfg, tag), out).summary
