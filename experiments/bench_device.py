"""Benchmark: every accelerator table in one prepared run, within a time budget.

A GPU is lent for minutes, so this is the one command to run on it; it sets nothing up
and writes its page after every part, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import time

import jax

from experiments import bench_scale, bench_study
from experiments.paths import OUTPUT
from karula_jax.benchmarking import bench_page, publish, run_header
from karula_jax.reporting import cli

# The parts in the order they run: the binding rounds (issue 55's targets), the run at
# many clients, then the vmapped study batches (an older H200 table exists for those).
PARTS = ("binding", "many", "study")


@dataclasses.dataclass(frozen=True)
class DeviceConfig:
    """The accelerator's tables: Karula's round against FedAvg's where constraints bind.

    Command: ``python -m experiments.bench_device [--FIELD VALUE ...] [--out FILE]``
    writes ``runs/bench/device_<card>.md`` (``<card>`` the device's kind, e.g.
    ``nvidia_h200``; ``--out results/bench/device_nvidia_h200.md`` refreshes a committed
    page). ``--quick`` runs every part at toy sizes on any machine (about 1 min on 2 CPU
    cores, nearly all compilation; the test suite runs it).

    Parts (each a table of ``experiments.bench_scale`` or ``experiments.bench_study``):

    * ``binding``: the FEMNIST-shaped MLP, output layer personalized, Karula at its
      default step and ``t``, one unbatched run per n of ``binding_sizes``, every solver
      of ``projection_methods`` a row, after ``warmup`` rounds; the share of pairs with a
      positive multiplier is printed on every row.
    * ``many``: the same at ``many_sizes`` (10,000 clients) with ``many_rows`` rows a
      client (the projection, not the data, is what is measured), the state and the
      device's peak memory reported.
    * ``study``: ``experiments.bench_study``'s vmapped ridge, logistic and MLP batches
      (its default config; with ``--quick`` the ridge batch of its quick config).

    A part (or size, or study workload) starts only while the elapsed time is below
    ``budget_s``; one not started is listed as such, and each part's page says how long it
    took. Sizing (one H200, 2026-12-04, ``results/bench/device_nvidia_h200.md``): the
    binding part with both solvers and the many part at 2 + 2 rounds took 456 s together,
    the study part 120 s; the defaults since (Newton-CG and its direct variant,
    ``laplacian_direct``, not yet measured on a GPU; ``fista`` by ``--projection-methods``;
    1 + 1 rounds at 10,000 clients) are expected to fit all three parts in about 8 min.

    Attributes:
      binding_sizes: n of the binding part.
      projection_methods: Karula's solvers, comma-separated, each a row.
      t: Karula's t (squared radii ``t * D``, D uniform in [0.5, 1.5]).
      warmup, rounds, rounds_large: untimed rounds, then timed rounds (median) below and
        from 1000 clients on.
      many_sizes, many_rows, many_methods, many_warmup, many_rounds: the many-client part.
      parts: the parts to run, comma-separated, among ``binding``, ``many``, ``study``.
      budget_s: seconds after which no further part or size starts.
    """

    binding_sizes: tuple[int, ...] = (30, 100, 300, 1000)
    projection_methods: str = "laplacian,laplacian_direct"
    t: float = 1e-3
    warmup: int = 5
    rounds: int = 5
    rounds_large: int = 3
    many_sizes: tuple[int, ...] = (10000,)
    many_rows: tuple[int, ...] = (20, 40)
    many_methods: str = "laplacian"
    many_warmup: int = 1
    many_rounds: int = 1
    parts: str = ",".join(PARTS)
    budget_s: float = 420.0


def quick(cfg: DeviceConfig) -> DeviceConfig:
    """Every part at toy sizes (a smoke run on any machine), the default solvers side by
    side (a further solver is one more row of the same code, and one more compilation).
    The many-client part runs the binding part's shapes (n and rows), so that its
    programs are ones already compiled (a smoke run checks the code path, not a size)."""
    return dataclasses.replace(
        cfg,
        binding_sizes=(6,),
        warmup=1,
        rounds=1,
        rounds_large=1,
        many_sizes=(6,),
        many_rows=bench_scale.ScaleConfig().rows,
        many_warmup=1,
        many_rounds=1,
    )


# The study part of a quick run: bench_study's quick ridge batch alone.
QUICK_STUDY = dataclasses.replace(bench_study.QUICK, mlp_sizes=(), mlp_members=())


def card() -> str:
    """The device's kind as a file name: ``nvidia_h200``, ``cpu``."""
    return re.sub(r"[^a-z0-9]+", "_", jax.devices()[0].device_kind.lower()).strip("_") or "cpu"


def parts_of(cfg: DeviceConfig) -> list[str]:
    """The parts of ``cfg.parts``, checked against :data:`PARTS`."""
    parts = [p.strip() for p in cfg.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        raise ValueError(f"parts must be among {', '.join(PARTS)}, got {cfg.parts!r}")
    return parts


def scale_config(cfg: DeviceConfig, part: str) -> bench_scale.ScaleConfig:
    """The bench_scale config of the ``binding`` or ``many`` part."""
    fields = {
        "binding": dict(
            sizes=cfg.binding_sizes,
            rounds=cfg.rounds,
            rounds_large=cfg.rounds_large,
            warmup=cfg.warmup,
            projection_method=cfg.projection_methods,
        ),
        "many": dict(
            sizes=cfg.many_sizes,
            rounds=cfg.many_rounds,
            rounds_large=cfg.many_rounds,
            warmup=cfg.many_warmup,
            projection_method=cfg.many_methods,
            rows=cfg.many_rows,
        ),
    }[part]
    return bench_scale.ScaleConfig(
        t_values=(cfg.t,), karula_default_step=True, large=1000, **fields
    )


def peak_memory() -> str:
    """The device's peak memory in use so far, or ``"not reported"`` (a CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return "not reported" if peak is None else f"{peak / 2**30:.2f} GiB"


class Page:
    """The page as it grows: a header, then each part's section (paragraphs and tables),
    rewritten whenever a section is added or updated."""

    def __init__(self, cfg: DeviceConfig, argv, out, quick: bool):
        self.cfg, self.argv, self.out, self.quick = cfg, argv, out, quick
        self.sections: list[list[str | tuple[str, list[str]]]] = []
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def over_budget(self) -> bool:
        return self.elapsed() >= self.cfg.budget_s

    def add(self, *parts, final: bool = False) -> int:
        """Appends a section of paragraphs or ``(head, rows)`` tables and rewrites the page
        (a quick run writes none); the ``final`` call also prints it. Returns the section's
        index for :meth:`update`."""
        self.sections.append(list(parts))
        self._write(final)
        return len(self.sections) - 1

    def update(self, index: int, *parts) -> None:
        """Replaces section ``index`` (a part that grows workload by workload) and rewrites
        the page, so that a run cut short keeps what it measured."""
        self.sections[index] = list(parts)
        self._write(final=False)

    def _write(self, final: bool) -> None:
        text = bench_page(
            "Karula against FedAvg on one device: the accelerator tables",
            run_header("experiments.bench_device", self.argv, self.cfg),
            "Every table: one process, the methods taking turns round by round; ratios are "
            f"against FedAvg's round in the same table. {self.elapsed():.0f} s so far.\n",
            *(part for section in self.sections for part in section),
        )
        publish(text, self.out, quick=self.quick, echo=final)


def scale_part(page: Page, part: str) -> None:
    """The ``binding`` or ``many`` table, size by size while within the budget."""
    scfg = scale_config(page.cfg, part)
    title = {
        "binding": "Binding rounds: the MLP's output layer personalized",
        "many": "Many clients: the binding round at the largest n",
    }[part]
    rows, skipped, started = [], [], page.elapsed()
    for n in scfg.sizes:
        if page.over_budget():
            skipped.append(n)
            continue
        rows += bench_scale.bench_n(scfg, n)
    notes = f"\n### {title}\n\n{scfg}.\n"
    if skipped:
        notes += f"\nNot run (budget of {page.cfg.budget_s:g} s spent): n = {skipped}.\n"
    if part == "many" and rows:
        notes += f"\nDevice peak memory in use: {peak_memory()}.\n"
    notes += f"\nThis part: {page.elapsed() - started:.0f} s.\n"
    page.add(notes, *([(bench_scale.HEAD, rows)] if rows else []))


def study_part(page: Page) -> None:
    """bench_study's tables, workload by workload while within the budget; the page is
    rewritten after each workload."""
    # (quick: its first workload only, a ridge batch)
    scfg = QUICK_STUDY if page.quick else bench_study.StudyConfig()
    heading = f"\n### Vmapped study batches (experiments.bench_study)\n\n{scfg}.\n"
    section = page.add(heading)
    results, skipped, started = [], 0, page.elapsed()
    makers = list(bench_study.workloads(scfg))

    def report(tail: str) -> None:
        notes = heading + f"\nThis part: {page.elapsed() - started:.0f} s{tail}"
        page.update(section, notes, *tables_of(results))

    for done, make in enumerate(makers, start=1):
        if page.over_budget():
            skipped += 1
            continue
        results.append(bench_study.bench_workload(scfg, make()))
        report(".\n" if done == len(makers) else f" ({done} of {len(makers)} workloads so far).\n")
    if skipped:
        report(f".\nNot run (budget of {page.cfg.budget_s:g} s spent): {skipped} workload(s).\n")


def tables_of(results: list) -> list:
    """The study part's two tables (member-rounds by window, whole runs) of ``results``."""
    if not results:
        return []
    return [
        (bench_study.HEAD, [line for r in results for line in bench_study.rows(r)]),
        "\nWhole runs:\n",
        (bench_study.RUN_HEAD, [bench_study.run_row(r) for r in results]),
    ]


def main(argv=None) -> None:
    default_out = OUTPUT / "bench" / f"device_{card()}.md"
    cfg, args = cli(DeviceConfig, argv, quick=quick, description=__doc__, out=default_out)
    page = Page(cfg, argv, pathlib.Path(args.out), args.quick)
    for part in parts_of(cfg):
        if page.over_budget():
            page.add(f"\n### {part}\n\nNot run (budget of {cfg.budget_s:g} s spent).\n")
        elif part == "study":
            study_part(page)
        else:
            scale_part(page, part)
    page.add(f"\nDone in {page.elapsed():.0f} s.\n", final=True)


if __name__ == "__main__":
    main()
