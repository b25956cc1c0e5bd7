"""The methods a study compares: one registry row per method.

A :class:`MethodRow` says how to build a method for a study: its factory, the
hyperparameter cross-validation tunes and its default grid, the rate rules its steps come
from (:mod:`karula_jax.protocol.rates`), the member arguments it reads (its ``D``, its
clusters) and the study settings it takes. :func:`build_methods` turns rows into the
:class:`Method` objects that :func:`karula_jax.protocol.cross_validate` and
:func:`~karula_jax.protocol.compare` run. Adding a method is adding a row::

    def my_method(loss, *, lam, learning_rate, clients_per_round, batch_size): ...

    register(MethodRow("Mine", my_method, hyper="lam", grid=(0.1, 1.0),
                       rates={"learning_rate": "fedavg"}))
    methods = build_methods(["Mine", "FedAvg"], loss=loss, rates=rates, ...)
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax import algorithms as A
from karula_jax import evaluation as ev
from karula_jax._checks import check_positive_int
from karula_jax.algorithms.base import Algorithm, LossFn
from karula_jax.protocol.rates import check_multiples

__all__ = [
    "GRID_KINDS",
    "REGISTRY",
    "SUITE",
    "PERSONAL",
    "STEP_KEYWORDS",
    "TAGS",
    "Method",
    "MethodRow",
    "build_methods",
    "choice_grid",
    "cross_choice",
    "grid_of",
    "register",
    "scalar_grid",
    "tagged",
]


class Method(NamedTuple):
    """A method to compare and the hyperparameters to choose from.

    Attributes:
      make: ``make(**member_kwargs, **hyper) -> Algorithm`` (traced values).
      grid: ``{name: [G] values}`` crossed in one compiled program (traced), or None.
      static_grid: entries ``{name: value}`` passed as Python values, one compilation
        each (a value that fixes shapes and has no traced form), or None.
      label: names a grid point for tables, ``label(point) -> str``.
      natural: whether a grid point is a natural limit of the method (no wider grid
        exists beyond it), ``natural(point) -> bool``; None: a point whose every value is
        0 or infinite (``t = 0``, ``t = inf``, ``mu = 0``). A CV choice on another edge of
        the grid is flagged (:func:`karula_jax.evaluation.grid_edge`).
      edges: for a grid of several axes (:func:`cross_choice`), ``edges(index) -> bool``
        per chosen index ``[S]``: the choice is on an edge of an axis that is not a
        natural limit; None: :meth:`edge` applies ``natural`` to the list of points.
      projects: whether its rounds project (Karula): its outcomes then always carry the
        projection's report (worst certified gap, unconverged rounds).
    """

    make: Callable[..., Algorithm]
    grid: Mapping[str, Any] | None = None
    static_grid: Sequence[Mapping[str, Any]] | None = None
    label: Callable[[Mapping[str, Any]], str] | None = None
    natural: Callable[[Mapping[str, Any]], bool] | None = None
    edges: Callable[[np.ndarray], np.ndarray] | None = None
    projects: bool = False

    @property
    def tuned(self) -> bool:
        return bool(self.grid) or bool(self.static_grid)

    def points(self) -> list[dict[str, Any]]:
        """Every grid point, static entries outermost (the order of the results)."""
        grid = self.grid or {}
        traced = [dict(zip(grid, v, strict=True)) for v in zip(*grid.values(), strict=True)]
        statics = self.static_grid or [{}]
        return [dict(s) | t for s, t in itertools.product(statics, traced or [{}])]

    def natural_points(self) -> list[int]:
        """Indices of the grid points that are natural limits (see ``natural``)."""
        rule = self.natural or (
            lambda p: all(np.all((np.asarray(v) == 0) | np.isinf(v)) for v in p.values())
        )
        return [i for i, p in enumerate(self.points()) if self.tuned and rule(p)]

    def labels(self) -> list[str]:
        if not self.tuned:
            return [""]
        name = self.label or (lambda p: ", ".join(f"{k}={v:.3g}" for k, v in p.items()))
        return [name(p) for p in self.points()]

    def edge(self, index) -> np.ndarray:
        """Whether each chosen point index ``[S]`` sits on an edge of the grid that is not a
        natural limit (the grid is too narrow there)."""
        if self.edges is not None:
            return np.asarray(self.edges(np.asarray(index)), bool)
        return ev.grid_edge(index, len(self.labels()), natural=self.natural_points())


def scalar_grid(name: str, values, *, shown: str | None = None) -> dict[str, Any]:
    """``Method`` keywords for a traced grid of one scalar argument ``name`` (float32);
    points are labelled ``shown=value`` (``shown`` defaults to ``name``)."""
    text = shown or name
    return dict(
        grid={name: np.asarray(values, np.float32)}, label=lambda p: f"{text}={p[name]:.3g}"
    )


def choice_grid(
    name: str, choices, *, natural: Callable[[Any], bool] = lambda choice: choice == 1
) -> dict[str, Any]:
    """``Method`` keywords for a traced grid over ``choices`` by index (e.g. a number of
    clusters whose labels the member arguments hold per choice): ``make`` receives the
    index as ``name``; labels show the choice; ``natural(choice)`` marks a natural limit
    (default: one cluster, nothing below it)."""
    choices = list(choices)
    return dict(
        grid={name: np.arange(len(choices))},
        label=lambda p: f"{name}={choices[int(p[name])]}",
        natural=lambda p: natural(choices[int(p[name])]),
    )


def cross_choice(
    method: Method, name: str, choices: Sequence[str], *, ordered: int | None = None
) -> Method:
    """``method`` with its grid crossed with a traced choice ``name`` (e.g. a step size).

    ``make`` receives the index of a choice as ``name`` (traced), to look up per-member
    values (e.g. ``rates[key][name]``, a ``[C]`` table per member); every point of
    ``method`` is run with every choice, in one compiled program.

    Args:
      method: the method and its grid (traced and static); untuned methods get the
        choices alone.
      name: the keyword of the choice index.
      choices: the choices' labels, ``[C]``.
      ordered: the first ``ordered`` choices are ordered values (e.g. multiples of a
        rate, increasing), so a choice of the first or last of them is an edge; the
        others (e.g. a method's own default) are not on an axis. Default: all ``C``.

    Returns:
      A :class:`Method` whose points are ``method``'s times the choices (choice
      innermost), labelled ``"<point> + <choice>"``, with an edge wherever ``method``'s
      point or the ordered choice is one.
    """
    C, base = len(choices), method.points()
    ordered = C if ordered is None else ordered
    grid = {k: np.repeat(np.asarray(v), C) for k, v in (method.grid or {}).items()}
    G = len(next(iter(grid.values()))) // C if grid else 1
    grid[name] = np.tile(np.arange(C), G)
    base_labels = method.labels()

    def label(point) -> str:
        index = [i for i, b in enumerate(base) if all(point[k] == v for k, v in b.items())]
        text = base_labels[index[0]] if index else ""
        return " + ".join(x for x in (text, str(choices[int(point[name])])) if x)

    def edges(index):
        own = method.edge(index // C) if method.tuned else np.zeros(np.shape(index), bool)
        choice = index % C
        return own | (ordered > 1) & ((choice == 0) | (choice == ordered - 1))

    return method._replace(grid=grid, label=label, natural=None, edges=edges)


GRID_KINDS = ("traced", "static", "choice")
# The factory keywords that are step sizes: with rate multiples (build_methods), CV
# chooses each as its rule times a multiple; the choice's keyword in a Method's grid.
STEP_KEYWORDS = ("learning_rate", "personal_learning_rate")
RATE_CHOICE = "rate"
TAGS = ("paper", "baseline", "uses-D", "variant")
PERSONAL = ("no", "optional", "required")


class MethodRow(NamedTuple):
    """One method of the registry.

    Attributes:
      name: the display name (keys of the suite, rows of the tables).
      factory: ``factory(loss, **keywords) -> Algorithm``. The keywords are the
        ``settings`` it takes, the member arguments ``members`` maps, the values of its
        ``rates`` and its tuned hyperparameter ``hyper``, plus per-study ``options``.
      hyper: the keyword cross-validation tunes, or None.
      grid: the default grid of ``hyper``: a tuple (CV chooses among its values) or a
        single value (fixed). A study may pass its own.
      rates: ``{factory keyword: rule name}``; the study's ``rates[rule]`` is evaluated
        as ``rule(**member_kwargs, **grid_point)`` per member and grid point and
        overrides ``hyper`` when both name the same keyword (e.g. the penalty's ``mu``).
        Default: the FedAvg family's step, ``{"learning_rate": "fedavg"}``.
      members: ``{factory keyword: member argument}`` the factory reads per member (e.g.
        ``{"D": "D"}``); a member argument the study does not give is not passed.
      settings: the study-wide settings the factory takes, among the keywords of
        :func:`build_methods`. Default: ``clients_per_round``, ``batch_size`` and
        ``local_steps`` (the FedAvg family's).
      kind: how the grid runs (:data:`GRID_KINDS`): ``"traced"`` (float32 values, one
        compiled program), ``"static"`` (Python values, one compilation each, for a value
        that fixes shapes and has no traced form; IFCA's number of clusters has one, see
        ``bound``) or ``"choice"`` (the factory receives the
        index of a value, traced; e.g. per-member labels ``[choices, n]``).
      shown: the hyperparameter's name in labels (default ``hyper``).
      natural: ``natural(value) -> bool``, a value beyond which no wider grid exists;
        None: a value of 0 or inf (``"choice"``: a value of 1).
      projects: whether the method's rounds project (:attr:`Method.projects`).
      bound: the factory keyword that takes a tuned grid's largest value, so that a
        hyperparameter that fixes shapes runs traced below it, one compiled program for
        the grid (IFCA's ``max_clusters``); a fixed value is passed as it is, without it.
      groups: ``hyper`` is a number of groups of clients (IFCA's clusters, the clustered
        FedAvg's k): where :func:`build_methods` is told the number of clients ``n``,
        every value ``>= n`` is a natural limit as well (at most one group per client:
        no wider grid exists).
      personal: whether the factory takes ``personalized`` (:data:`PERSONAL`): ``"no"``,
        ``"optional"`` (a mask of the leaves each client keeps, with the factory's own
        default) or ``"required"`` (FedPer): :func:`build_methods`' ``personalized``
        reaches every row that takes it, and a required one without it is refused there.
      tags: what the method is to a study (:data:`TAGS`): ``"paper"`` (the paper's own
        comparison), ``"baseline"`` (another federated method), ``"uses-D"`` (another
        use of Karula's ``D``), ``"variant"`` (Karula changed in one respect); a study
        selects its methods by name or by tag (:func:`tagged`), never by position.
    """

    name: str
    factory: Callable[..., Algorithm]
    hyper: str | None = None
    grid: Any = None
    rates: Mapping[str, str] = {"learning_rate": "fedavg"}
    members: Mapping[str, str] = {}
    settings: tuple[str, ...] = ("clients_per_round", "batch_size", "local_steps")
    kind: str = "traced"
    shown: str | None = None
    natural: Callable[[Any], bool] | None = None
    projects: bool = False
    bound: str | None = None
    groups: bool = False
    personal: str = "no"
    tags: tuple[str, ...] = ()

    def method(
        self,
        loss: LossFn,
        rates: Mapping[str, Callable[..., Any]],
        *,
        grid: Any = None,
        options: Mapping[str, Any] | None = None,
        rate_multiples: Sequence[float] = (),
        **settings,
    ) -> Method:
        """The :class:`Method` of this row in a study.

        Args:
          loss: the study's loss.
          rates: the study's rate rules (must hold every rule of ``self.rates`` whose
            keyword ``options`` does not fix).
          grid: the study's grid of ``hyper`` (default ``self.grid``): a tuple or list is
            chosen by CV, a single value is fixed.
          options: further factory keywords of this study (override ``settings``, and a
            rate rule of the same keyword: a fixed step).
          rate_multiples: if given (increasing), every step keyword
            (:data:`STEP_KEYWORDS`) the row's rules set is its rule times a multiple that
            CV chooses, crossed with the grid of ``hyper`` (:func:`cross_choice`, choice
            ``"rate"``; either end is a grid edge); ``()``: the rules' steps as they are.

        Raises:
          ValueError: a rule is missing from ``rates``; an unknown ``kind``; ``hyper``
            without a grid here or in the row.
        """
        fixed = {k: settings[k] for k in self.settings if k in settings} | dict(options or {})
        # a keyword the options fix (e.g. a step) is not taken from its rule
        row = self._replace(rates={k: r for k, r in self.rates.items() if k not in fixed})
        return row._method(loss, rates, grid, fixed, tuple(rate_multiples))

    def _method(self, loss, rates, grid, fixed, rate_multiples) -> Method:
        """:meth:`method` once the fixed keywords are known (``self.rates``: the rules
        that still apply)."""
        missing = sorted(set(self.rates.values()) - set(rates))
        if missing:
            raise ValueError(
                f"{self.name} needs the rate rule(s) {missing}; rates has {sorted(rates)}"
            )
        if self.kind not in GRID_KINDS:
            raise ValueError(f"{self.name}: kind must be one of {GRID_KINDS}, got {self.kind!r}")
        stepped = [k for k in self.rates if k in STEP_KEYWORDS]
        multiples = rate_multiples if stepped else ()
        make = functools.partial(_build, self, loss, rates, fixed, multiples)
        grid = self.grid if grid is None else grid
        method = self._grid(make, grid)._replace(projects=self.projects)
        if not multiples:
            return method
        labels = [f"rate x{m:.3g}" for m in multiples]
        return cross_choice(method, RATE_CHOICE, labels)

    def _grid(self, make, grid) -> Method:
        """The :class:`Method` of ``make`` over the study's ``grid`` of ``hyper``."""
        if self.hyper is None:
            return Method(make)
        if grid is None:
            raise ValueError(f"{self.name}: no grid or value of {self.hyper} (row or study)")
        if isinstance(grid, np.ndarray | jax.Array | range):  # a 1-D array is a grid too
            values = np.asarray(grid)
            if values.ndim > 1:
                raise ValueError(f"{self.name}: a grid must be 1-D, got shape {values.shape}")
            grid = tuple(values.tolist()) if values.ndim else values.item()
        if not isinstance(grid, tuple | list):  # a fixed value
            return Method(functools.partial(make, **{self.hyper: grid}))
        if not grid:
            raise ValueError(f"{self.name}: the grid of {self.hyper} is empty")
        shown, hyper = self.shown or self.hyper, self.hyper
        if self.bound is not None:
            make = functools.partial(make, **{self.bound: max(grid)})
        if self.kind == "choice":
            natural = self.natural or (lambda c: c == 1)
            return Method(make, **choice_grid(hyper, grid, natural=natural))
        natural = None if self.natural is None else (lambda p: self.natural(p[hyper]))
        if self.kind == "static":
            label = lambda p: f"{shown}={_text(p[hyper])}"
            static = [{hyper: v} for v in grid]
            return Method(make, static_grid=static, label=label, natural=natural)
        return Method(make, **scalar_grid(hyper, grid, shown=shown), natural=natural)


def _text(value) -> str:
    """A grid value in a label: integers as they are, other numbers to 3 digits."""
    return str(value) if isinstance(value, int | np.integer) else f"{value:.3g}"


def _build(row: MethodRow, loss, rates, fixed, multiples, /, **given) -> Algorithm:
    """``row``'s algorithm for one member and grid point; ``given`` holds the member
    arguments and the point (traced or static), under any names (``rates`` included).
    With ``multiples``, ``given[RATE_CHOICE]`` indexes the multiple of every step
    keyword's rule (the rules do not see it)."""
    kw = dict(fixed)
    if row.hyper is not None:
        kw[row.hyper] = given[row.hyper]
    if row.bound in given:  # a tuned grid's largest value (MethodRow.bound)
        kw[row.bound] = given[row.bound]
    kw |= {key: given[name] for key, name in row.members.items() if name in given}
    choice = given.pop(RATE_CHOICE, None) if multiples else None
    kw |= {key: rates[rule](**given) for key, rule in row.rates.items()}
    if multiples:
        factor = jnp.asarray(multiples, jnp.float32)[choice]
        kw |= {key: kw[key] * factor for key in row.rates if key in STEP_KEYWORDS}
    return row.factory(loss, **kw)


def _clustered_on_D(loss, *, labels, k, **kw) -> Algorithm:
    """:func:`~karula_jax.algorithms.clustered_fedavg` on the ``k``-th clustering of
    the member's labels ``[choices, n]`` (``k`` traced)."""
    return A.clustered_fedavg(loss, labels[k], **kw)


def _fedper(loss, *, personalized=None, **kw) -> Algorithm:
    """FedPer: :func:`~karula_jax.algorithms.fedavg` with the leaves ``personalized``
    marks (e.g. the output layer) kept by each client, the others averaged; Karula at
    ``t = inf`` on the same mask. A study passes the mask in its options."""
    if personalized is None or personalized is False:
        raise ValueError(
            "FedPer needs `personalized`: True or a mask of the leaves each client keeps "
            "(e.g. the output layer), given in the study's options for 'FedPer'"
        )
    return A.fedavg(loss, personalized=personalized, **kw)


def _karula_theorem(loss, **kw) -> Algorithm:
    """:func:`~karula_jax.algorithms.karula` at Theorem 4.3's step ``3 / (8 L_max)``
    (``learning_rate="theorem"``)."""
    return A.karula(loss, learning_rate="theorem", **kw)


_COMMON = ("clients_per_round", "batch_size")
_D = {"D": "D"}
_PAPER = ("paper",)
# The built-in methods, in the order of the studies' tables. Default grids: the synthetic
# study's (results/synthetic/README.md).
_ROWS = (
    MethodRow("Local", A.local, rates={"learning_rate": "local"}, settings=_COMMON, tags=_PAPER),
    MethodRow("FedSGD", A.fedsgd, rates={"learning_rate": "fedsgd"}, settings=_COMMON, tags=_PAPER),
    MethodRow("FedAvg", A.fedavg, personal="optional", tags=_PAPER),
    MethodRow(
        "IFCA",
        A.ifca,
        hyper="num_clusters",
        grid=(1, 2, 3, 4, 5),
        rates={"learning_rate": "ifca"},
        members={"initial_clusters": "clusters"},
        shown="k",
        bound="max_clusters",
        natural=lambda k: k == 1,
        groups=True,
        tags=_PAPER,
    ),
    MethodRow(
        "pFedMe",
        A.pfedme,
        hyper="lam",
        grid=tuple(float(x) for x in np.geomspace(0.01, 1.0, 5)),
        rates={"learning_rate": "pfedme", "personal_learning_rate": "pfedme_personal"},
        shown="lambda",
        tags=_PAPER,
    ),
    MethodRow(
        "Karula",
        A.karula,
        hyper="t",
        grid=(2.0, 4.0, 8.0, 16.0, 32.0),
        rates={"learning_rate": "karula"},
        members=_D,
        settings=_COMMON,
        projects=True,
        personal="optional",
        tags=_PAPER,
    ),
    MethodRow(
        "FedProx",
        A.fedprox,
        hyper="mu",
        grid=(0.01, 0.1, 1.0, 10.0),
        rates={"learning_rate": "fedprox"},
        personal="optional",
        tags=("baseline",),
    ),
    MethodRow("SCAFFOLD", A.scaffold, personal="optional", tags=("baseline",)),
    MethodRow(
        "Ditto",
        A.ditto,
        hyper="lam",
        grid=(0.01, 0.1, 1.0, 10.0),
        rates={"learning_rate": "fedavg", "personal_learning_rate": "ditto_personal"},
        personal="optional",
        tags=("baseline",),
    ),
    MethodRow(
        "Laplacian penalty on D",
        A.laplacian_penalty,
        hyper="mu",
        grid=(1e-3, 1e-2, 0.1, 1.0, 10.0),
        rates={"learning_rate": "penalty", "mu": "penalty_mu"},
        members=_D,
        settings=_COMMON,
        shown="mu/L_f",
        personal="optional",
        tags=("uses-D",),
    ),
    MethodRow(
        "Clustered FedAvg on D",
        _clustered_on_D,
        hyper="k",
        grid=(1, 2, 3, 4, 5),
        members={"labels": "labels"},
        kind="choice",
        groups=True,
        personal="optional",
        tags=("uses-D",),
    ),
)
# Variants a study adds by name: FedPer (Karula at t = inf on its mask) and Karula at
# Theorem 4.3's step.
_VARIANTS = (
    MethodRow(
        "Karula (theorem step)",
        _karula_theorem,
        hyper="t",
        grid=(2.0, 4.0, 8.0, 16.0, 32.0),
        rates={},
        members=_D,
        settings=_COMMON,
        projects=True,
        personal="optional",
        tags=("variant",),
    ),
    MethodRow("FedPer", _fedper, personal="required", tags=("variant",)),
)
REGISTRY: dict[str, MethodRow] = {row.name: row for row in _ROWS + _VARIANTS}


def tagged(*tags: str, registry: Mapping[str, MethodRow] | None = None) -> tuple[str, ...]:
    """The names of the registered methods carrying any of ``tags``, in registry order.

    Raises:
      ValueError: a tag not in :data:`TAGS`, or no tag.
    """
    unknown = [tag for tag in tags if tag not in TAGS]
    if unknown or not tags:
        raise ValueError(f"tags must be some of {TAGS}, got {list(tags)}")
    rows = (REGISTRY if registry is None else registry).values()
    return tuple(row.name for row in rows if set(row.tags) & set(tags))


# The eleven methods of the studies' comparisons: the paper's, the other baselines and the
# other uses of D, in the registry's order.
SUITE: tuple[str, ...] = tagged("paper", "baseline", "uses-D")


def grid_of(name: str, grids: Mapping[str, Any] | None = None, registry=None) -> Any:
    """The grid method ``name`` runs: ``grids[name]`` where given, else its registry row's
    default (:attr:`MethodRow.grid`; ``registry`` default :data:`REGISTRY`).

    Raises:
      ValueError: ``name`` is in neither.
    """
    if grids and name in grids:
        return grids[name]
    rows = REGISTRY if registry is None else registry
    if name not in rows:
        raise ValueError(f"unknown method {name!r}: no grid given and no registry row")
    return rows[name].grid


def register(row: MethodRow, *, replace: bool = False) -> MethodRow:
    """Adds ``row`` to :data:`REGISTRY` (``replace``: over a row of the same name).

    Raises:
      TypeError: ``row`` is not a :class:`MethodRow` or its name not a string.
      ValueError: a row named ``row.name`` exists and not ``replace``; an unknown ``kind``
        or tag.
    """
    if not isinstance(row, MethodRow):
        raise TypeError(f"row must be a MethodRow, got {type(row).__name__}")
    if not isinstance(row.name, str):
        raise TypeError(f"row.name must be a string, got {row.name!r}")
    if row.kind not in GRID_KINDS:
        raise ValueError(f"{row.name}: kind must be one of {GRID_KINDS}, got {row.kind!r}")
    if row.personal not in PERSONAL:
        raise ValueError(f"{row.name}: personal must be one of {PERSONAL}, got {row.personal!r}")
    if not isinstance(row.tags, tuple) or any(tag not in TAGS for tag in row.tags):
        raise ValueError(f"{row.name}: tags must be a tuple of {TAGS}, got {row.tags!r}")
    if row.name in REGISTRY and not replace:
        raise ValueError(f"a method named {row.name!r} is registered; pass replace=True")
    REGISTRY[row.name] = row
    return row


def build_methods(
    names: Sequence[str],
    *,
    loss: LossFn,
    rates: Mapping[str, Callable[..., Any]],
    grids: Mapping[str, Any] | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    registry: Mapping[str, MethodRow] | None = None,
    num_clients: int | None = None,
    personalized: Any = None,
    rate_multiples: Sequence[float] | None = None,
    **settings,
) -> dict[str, Method]:
    """The :class:`Method` of every method in ``names``, from its registry row.

    A method's ``make`` receives the member arguments (e.g. ``D [n, n]``; ``labels
    [choices, n]``, the clients' groups per choice of the clustered FedAvg; optional
    ``clusters``, IFCA's initial cluster models; the constants its rate rules read) and
    its grid point.

    Args:
      names: registered method names, in the order of the result.
      loss: the loss of every method.
      rates: the study's rate rules (:mod:`karula_jax.protocol.rates`), at least those
        the rows of ``names`` read.
      grids: ``{name: grid}``, the study's grids (a tuple: chosen by CV; a single value:
        fixed); a method without an entry takes its row's default.
      options: ``{name: {keyword: value}}``, further factory keywords per method (e.g.
        Karula's ``projection_tol``, pFedMe's ``inner_steps``, a ``personalized`` mask).
      registry: the rows to build from (default :data:`REGISTRY`).
      num_clients: the study's number of clients, if known: a CV choice of ``k >=
        num_clients`` groups is then a natural limit of a row with ``groups`` (not an
        edge of its grid to widen).
      personalized: the leaves each client keeps, for every method of the comparison
        that has the notion (rows with ``personal`` "optional" or "required": Karula,
        FedAvg's personal layers, FedPer, Ditto, ...; a method's own ``options`` entry
        wins): True, False or a pytree of bools like the model (e.g.
        :func:`karula_jax.models.output_layer_mask`). None: each factory's default, and
        a method that requires it (FedPer) is refused here, before anything runs.
      rate_multiples: the multiples of each method's rate rule that CV chooses its steps
        among, jointly with its own hyperparameter (every method whose ``learning_rate``
        or ``personal_learning_rate`` comes from a rule; choice ``"rate"``, labels
        ``"rate x3"``; a choice at either end is a grid edge). None (default): the
        multiples ``rates`` carries: ``default_rate_rules()`` carries
        :data:`~karula_jax.protocol.RATE_MULTIPLES` (``1/3, 1, 3, 10``), so the documented
        path is tuned by default; a plain mapping of rules (the studies' own rates)
        carries none. ``()``: the rules' steps as they are (no rate CV). A step fixed in
        a method's ``options`` (``{"FedAvg": {"learning_rate": 0.1}}``) is neither taken
        from its rule nor crossed.
      **settings: study-wide factory keywords (``clients_per_round``, ``batch_size``,
        ``local_steps``); each method takes those its row lists.

    Returns:
      ``{name: Method}``.

    Raises:
      ValueError: a name is not registered or given twice; a row's rate rule is missing
        from ``rates``; ``num_clients < 1``; an empty grid; ``rate_multiples`` not
        positive and increasing; a method requires
        ``personalized`` and neither it nor the method's options give it.
      TypeError: ``names`` is a string; ``num_clients`` is not an int; a setting that no
        registered row takes (a misspelt ``local_steps`` was dropped silently).
    """
    registry = REGISTRY if registry is None else registry
    grids, options = grids or {}, options or {}
    if isinstance(names, str):
        raise TypeError(f"names must be a sequence of method names, got the string {names!r}")
    unknown = [name for name in [*names, *grids, *options] if name not in registry]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; registered: {list(registry)}")
    twice = sorted({name for name in names if list(names).count(name) > 1})
    if twice:
        raise ValueError(f"names must be distinct, got {twice} more than once")
    taken = {k for row in registry.values() for k in row.settings}
    stray = sorted(set(settings) - taken)
    if stray:
        raise TypeError(f"unknown setting(s) {stray}; the rows take {sorted(taken)}")
    rows = {name: registry[name] for name in names}
    options = _with_personalized(rows, options, personalized)
    if num_clients is not None:
        n = check_positive_int("num_clients", num_clients)
        rows |= {name: _up_to_clients(row, n) for name, row in rows.items() if row.groups}
    multiples = getattr(rates, "multiples", ()) if rate_multiples is None else rate_multiples
    multiples = check_multiples(multiples)
    return {
        name: row.method(
            loss,
            rates,
            grid=grids.get(name),
            options=options.get(name),
            rate_multiples=multiples,
            **settings,
        )
        for name, row in rows.items()
    }


def _with_personalized(rows, options, personalized) -> dict[str, Mapping[str, Any]]:
    """``options`` with ``personalized`` added for every row that takes it (a method's own
    entry wins); a ValueError naming the methods that require it and lack it."""
    takes = {name for name, row in rows.items() if row.personal != "no"}
    if personalized is not None:
        options = {
            name: {"personalized": personalized} | dict(options.get(name, {}))
            if name in takes
            else options.get(name, {})
            for name in set(options) | takes
        }
    lacking = [
        name
        for name, row in rows.items()
        if row.personal == "required" and options.get(name, {}).get("personalized") in (None, False)
    ]
    if lacking:
        raise ValueError(
            f"{lacking} need `personalized` (True or a mask of the leaves each client keeps, "
            f"e.g. models.output_layer_mask(params)): pass build_methods(personalized=...)"
        )
    return options


def _up_to_clients(row: MethodRow, num_clients: int) -> MethodRow:
    """``row`` (a number of groups) with every value ``>= num_clients`` a natural limit
    too, besides its own (default: 1)."""
    own = row.natural or (lambda k: k == 1)
    return row._replace(natural=lambda k: own(k) or k >= num_clients)
