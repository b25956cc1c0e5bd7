"""The scan loop: a federated run as one compiled program per chunk of rounds.

A run of ``num_rounds`` rounds is a Python loop over *chunks* of ``chunk_size`` rounds.
Each chunk is one jitted ``lax.scan`` of ``algorithm.round``, compiled once (ahead of
time) and reused for every chunk, so between chunks the driver can draw a progress bar,
evaluate user metrics, check for NaN/inf and write a checkpoint without recompiling.

The last chunk may hold fewer than ``chunk_size`` rounds. Rather than compiling a
second, shorter scan, every chunk runs the same executable with a *number of active
rounds*: round ``i`` of the chunk is skipped (``lax.cond``, the state passes through
unchanged and the info slot is filled with zeros) when ``i >= num_active``. Skipped rounds
cost nothing but a branch, there is exactly one compilation per run, and a resumed run
executes the same program as an uninterrupted one, which is what makes resume
bit-identical.

At the end of a run the driver summarizes the projection diagnostics of every round
(:attr:`RunResult.diagnostics`, :func:`round_diagnostics`) and warns
(:class:`ProjectionNotConvergedWarning`) when some round's projection stopped at its
iteration cap before reaching its tolerance.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from karula_jax._checks import DeferredChecks, check_positive_int, deferred_checks
from karula_jax.algorithms.base import Algorithm, FedState, RoundInfo
from karula_jax.training import checkpoint as ckpt
from karula_jax.training._compile import compile_loops
from karula_jax.training.diagnostics import (
    first_nonfinite,
    nonfinite_data,
    nonfinite_error,
    raise_failed_checks,
    round_diagnostics,
    warn_unconverged,
)
from karula_jax.training.progress import RoundBar, scalar_summary
from karula_jax.training.sharding import Placement, client_placement, gather_to_host

__all__ = ["RunResult", "run", "scan_rounds"]

EvalFn = Callable[[Any, Any], Mapping[str, Any]]


class RunResult(NamedTuple):
    """Outcome of :func:`run` (host-side numpy histories).

    Attributes:
      state: final :class:`FedState` (device arrays).
      info: :class:`RoundInfo` of every round run so far, each leaf stacked with a leading
        round axis ``[num_rounds, ...]`` (``participants`` is ``[num_rounds, n]``; for
        batched runs the batch axes follow the round axis).
      metrics: dict name -> array ``[num_evals, ...]``, the values returned by ``eval_fn``.
      metric_rounds: int array ``[num_evals]``: number of rounds completed when each
        evaluation was taken (0 = the initial models).
      timings: seconds spent compiling the chunk (``compile_s``; near 0 when an earlier
        ``run`` with the same algorithm object compiled it already), in compiled chunks
        (``run_s``), evaluating (``eval_s``), checkpointing (``checkpoint_s``), in total
        (``total_s``), ``rounds_per_s`` = rounds run / ``run_s``, and
        ``best_rounds_per_s``, the fastest chunk's rate (robust to a busy machine). Only this call's
        work is counted (a resumed run does not inherit the killed run's times).
      nonfinite_round: first round (0-based) whose info reported a non-finite value when
        ``on_nonfinite="record"``; ``None`` if every round was finite.
      diagnostics: :func:`round_diagnostics` of ``info``: the worst certified projection
        gap, the largest constraint violation and the rounds whose projection did not
        converge (of any batch member).
    """

    state: FedState
    info: RoundInfo  # leaves [num_rounds, ...]
    metrics: dict[str, np.ndarray]  # name -> [num_evals, ...]
    metric_rounds: np.ndarray  # [num_evals] int64
    timings: dict[str, float]
    nonfinite_round: int | None = None
    diagnostics: dict[str, Any] | None = None


# --------------------------------------------------------------------------- pure core


def scan_rounds(
    algorithm: Algorithm, state: FedState, data: Any, num_rounds: int
) -> tuple[FedState, RoundInfo]:
    """Runs ``num_rounds`` rounds as one ``lax.scan`` (pure; jit/vmap it yourself).

    Args:
      algorithm: the federated algorithm.
      state: its state, e.g. ``algorithm.init(params, data, key=key)``.
      data: the clients' data (a ``ClientData`` or whatever ``algorithm.round`` takes).
      num_rounds: static Python int >= 1.

    Returns:
      ``(state, info)`` where each leaf of ``info`` has a leading axis ``[num_rounds]``.

    Example (10 seeds as one program)::

        def one_seed(key):
            state = algorithm.init(params, data, key=key)
            return scan_rounds(algorithm, state, data, 100)

        states, infos = jax.jit(jax.vmap(one_seed))(jax.random.split(key, 10))
    """
    num_rounds = check_positive_int("num_rounds", num_rounds)

    def body(st, _):
        return algorithm.round(st, data)

    return lax.scan(body, state, None, length=num_rounds)


def _masked_chunk(algorithm: Algorithm, chunk_size: int):
    """A chunk of ``chunk_size`` scan steps of which only the first ``num_active`` run."""
    round_fn = _jitted_round(algorithm)

    def chunk(state, data, num_active):
        # Shapes of the info come from the traced round; jit's trace cache makes the
        # scan below reuse that trace, so the round is traced exactly once.
        info_shape = jax.eval_shape(round_fn, state, data)[1]

        def skip(st):
            return st, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), info_shape)

        def body(st, i):
            return lax.cond(i < num_active, lambda s: round_fn(s, data), skip, st)

        return lax.scan(body, state, jnp.arange(chunk_size, dtype=jnp.int32))

    return chunk


# The jitted programs are cached per algorithm object (its functions are hashed by
# identity), so repeated ``run`` calls with the same algorithm, e.g. one per seed, reuse
# the traces and executables instead of compiling again.


@functools.lru_cache(maxsize=32)
def _jitted_init(algorithm: Algorithm):
    """``init`` returning ``(state, DeferredChecks)``: the value checks that ``init`` could
    not make on its traced inputs (e.g. the labels of a classifier), for the driver."""

    def init(params, data, *, key):
        with deferred_checks() as found:
            state = algorithm.init(params, data, key=key)
        return state, DeferredChecks([m for m, _ in found], [ok for _, ok in found])

    return jax.jit(init)


@functools.lru_cache(maxsize=32)
def _jitted_round(algorithm: Algorithm):
    # Shared by the chunk and the checkpoint fingerprint, so that both use one trace.
    return jax.jit(algorithm.round)


@functools.lru_cache(maxsize=32)
def _fingerprinted_round(algorithm: Algorithm):
    """The jitted round whose program identifies a run in its checkpoints: a round split
    over devices (``run_many``'s batch on a mesh) is fingerprinted ``unsplit``."""
    unsplit = getattr(algorithm.round, "unsplit", None)
    return _jitted_round(algorithm) if unsplit is None else jax.jit(unsplit)


@functools.lru_cache(maxsize=32)
def _jitted_chunk(algorithm: Algorithm, chunk_size: int):
    return jax.jit(_masked_chunk(algorithm, chunk_size), donate_argnums=0)


@functools.lru_cache(maxsize=32)
def _jitted_eval(algorithm: Algorithm, eval_fn: EvalFn):
    return jax.jit(lambda st, d, ed: eval_fn(algorithm.client_params(st, d), ed))


# --------------------------------------------------------------------------- histories


def _stack_infos(parts: list[RoundInfo]) -> RoundInfo:
    return RoundInfo(*(np.concatenate(f, axis=0) for f in zip(*parts, strict=True)))


def _stack_metrics(history: list[dict]) -> dict[str, np.ndarray]:
    if not history:
        return {}
    return {k: np.stack([h[k] for h in history]) for k in history[0]}


def _check_metrics(out: Any) -> dict[str, np.ndarray]:
    if not isinstance(out, Mapping):
        raise TypeError(f"eval_fn must return a dict of arrays, got {type(out).__name__}")
    for k in out:
        if not isinstance(k, str):
            raise TypeError(f"eval_fn must return a dict with str keys, got key {k!r}")
    return {k: gather_to_host(v) for k, v in out.items()}


# --------------------------------------------------------------------------- driver


def run(
    algorithm: Algorithm,
    params: Any,
    data: Any,
    *,
    key: jax.Array,
    num_rounds: int,
    chunk_size: int = 50,
    eval_fn: EvalFn | None = None,
    eval_data: Any = None,
    eval_every_chunk: bool = True,
    checkpoint_dir: str | os.PathLike | None = None,
    resume: bool = False,
    on_nonfinite: str = "raise",
    mesh: Mesh | None = None,
    progress: bool = True,
) -> RunResult:
    """Runs ``num_rounds`` rounds of ``algorithm`` as a loop over compiled chunks.

    The chunk program (a ``lax.scan`` over ``chunk_size`` rounds, state buffers donated) is
    compiled once (on CPU at LLVM's optimization level 2 unless ``XLA_FLAGS`` sets one:
    :func:`karula_jax.training._compile.loop_compiler_options`); the final chunk runs the
    same program with its trailing rounds masked (see the module docstring). After every
    chunk the driver checks the rounds' ``finite`` flags, evaluates metrics, writes a
    checkpoint and updates the progress bar.

    Args:
      algorithm: an :class:`Algorithm` (``init``, ``round``, ``client_params``).
      params: one model (pytree) every client starts from.
      data: the clients' training data, passed to ``init``/``round``/``client_params``.
      key: PRNG key of the run.
      num_rounds: total number of rounds (>= 1), counting rounds done before a resume.
      chunk_size: rounds per compiled chunk (>= 1).
      eval_fn: ``eval_fn(client_params, eval_data) -> dict[str, array]`` where
        ``client_params`` has leaves ``[n, ...]``; traced and jitted once. Evaluated on
        the initial models and after every chunk (or only at the end when
        ``eval_every_chunk`` is False).
      eval_data: second argument of ``eval_fn`` (e.g. ``(train, test)``); defaults to
        ``data``.
      eval_every_chunk: evaluate after every chunk (True) or only at start and end.
      checkpoint_dir: if given, ``<checkpoint_dir>/checkpoint.npz`` is rewritten
        atomically after every chunk. The directory is created if needed and checked
        to be writable before anything is compiled; temporary files a killed run left
        in it (``.tmp-karula_jax-*``) are deleted, so two runs must not share it.
      resume: continue from the checkpoint in ``checkpoint_dir`` instead of calling
        ``init``; the result is bit-identical to an uninterrupted run. The checkpoint
        must come from the same run: the same algorithm and hyperparameters (a hash of
        the traced ``init``/``round`` programs and the constants they close over), the
        same data content and initial ``params`` (sha256), ``chunk_size`` and key;
        otherwise a ValueError names what differs. If the checkpoint already holds
        ``num_rounds`` rounds it is returned as is.
      on_nonfinite: ``"raise"`` (default): after a chunk in which some round reported
        ``finite=False``, raise :class:`FloatingPointError` naming the first such round
        (no checkpoint is written for that chunk; the exception's ``result`` attribute
        holds the history up to and including it). ``"record"``: keep going and report the
        first such round in :attr:`RunResult.nonfinite_round` (for grids where some
        settings are expected to diverge).
      mesh: if given, the client axis (the leading axis of the state's and the data's
        leaves) is split over this 1-D mesh (:func:`client_mesh`); leaves without it
        are replicated. The number of clients must be a multiple of the mesh size. The
        mesh may span several processes (``jax.distributed``; every process makes the
        same call with the same inputs and gets the whole history; the state stays
        split, :func:`gather_to_host` fetches it; no checkpoints, and the progress bar
        is drawn by process 0 only).
      progress: show a tqdm progress bar on stderr (rounds, last loss, latest metrics).

    Returns:
      A :class:`RunResult`. If some round's projection did not converge (its
      ``RoundInfo.proj_converged`` is False), a :class:`ProjectionNotConvergedWarning`
      names those rounds and the worst certified gap (also in ``diagnostics``).

    Raises:
      ValueError: bad ``num_rounds``/``chunk_size``/``on_nonfinite``, ``resume`` without a
        checkpoint, a corrupt checkpoint, one written by a different run (structure,
        algorithm or hyperparameters, data content, initial params, chunk size or key),
        or a client count that the mesh size does not divide.
      OSError: ``checkpoint_dir`` cannot be created or written to (before any compiling).
      TypeError: non-integer sizes, or ``eval_fn`` not returning a dict.
      FloatingPointError: a round produced NaN/inf and ``on_nonfinite="raise"``.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import karula_jax as kj
      >>> ds = kj.data.synthetic_ridge(0, num_clients=6, dim=3)
      >>> L = kj.algorithms.lipschitz_ridge(ds.train, 1e-6)
      >>> alg = kj.algorithms.local(
      ...     kj.models.ridge_loss(1e-6), learning_rate=1 / L, batch_size=ds.train.max_count
      ... )
      >>> def metrics(theta, data):  # client models [n, d] -> {name: [n]}
      ...     return {"error": kj.evaluation.estimation_error(theta, ds.theta_true)}
      >>> res = kj.training.run(
      ...     alg, jnp.zeros(3), ds.train, key=jax.random.key(1), num_rounds=300, chunk_size=100,
      ...     eval_fn=metrics, progress=False,
      ... )
      >>> res.info.loss.shape, res.metrics["error"].shape, res.metric_rounds.tolist()
      ((300,), (4, 6), [0, 100, 200, 300])
      >>> bool(res.info.finite.all()), res.nonfinite_round
      (True, None)
      >>> round(float(res.metrics["error"][-1].mean()), 2)  # mean ||theta_i - theta_i*||^2
      0.08
    """
    if not isinstance(algorithm, Algorithm):
        raise TypeError(f"algorithm must be an Algorithm, got {type(algorithm).__name__}")
    placement = None if mesh is None else client_placement(mesh, data)
    out = run_chunks(
        algorithm,
        params,
        data,
        key=key,
        num_rounds=num_rounds,
        chunk_size=chunk_size,
        eval_fn=eval_fn,
        eval_data=data if eval_data is None else eval_data,
        eval_every_chunk=eval_every_chunk,
        checkpoint_dir=checkpoint_dir,
        resume=resume,
        on_nonfinite=on_nonfinite,
        placement=placement,
        progress=progress,
    )
    warn_unconverged(out.diagnostics, stacklevel=2)
    return out


def run_chunks(
    algorithm: Algorithm,
    params: Any,
    data: Any,
    *,
    key: jax.Array,
    num_rounds: int,
    chunk_size: int,
    eval_fn: Callable | None,
    eval_data: Any,
    eval_every_chunk: bool,
    checkpoint_dir: str | os.PathLike | None,
    resume: bool,
    on_nonfinite: str,
    placement: Placement | None,
    progress: bool,
    desc: str | None = None,
    fingerprints: Callable[[], Mapping[str, Any]] | None = None,
    name: str | None = None,
) -> RunResult:
    """The loop of :func:`run` and :func:`run_many` (private; no warning at the end).

    ``eval_fn(algorithm.client_params(state, data), eval_data)`` is the metric program;
    ``placement`` puts data and state on a mesh; ``fingerprints()`` returns checkpoint
    fingerprints that replace or add to the default ones (``algorithm``, ``data``,
    ``params``, ``chunk_size``, ``key``); ``name`` is the algorithm's name in the
    checkpoint (default :func:`~karula_jax.training.checkpoint.algorithm_name`).
    """
    t_start = time.perf_counter()
    num_rounds, chunk_size, ckpt_path = _check_loop_options(
        num_rounds, chunk_size, on_nonfinite, resume, checkpoint_dir
    )
    if placement is not None:
        data = placement.data(data)
        if eval_fn is not None:
            eval_data = placement.eval_data(eval_data)

    init = _jitted_init(algorithm)
    ckpt_meta = {}
    if ckpt_path is not None:
        loaded, ckpt_meta = _open_checkpoint(
            ckpt_path, algorithm, init, params, data, key, chunk_size, resume, name, fingerprints
        )

    hist = _History(t_start)
    if resume:
        state, done = hist.resume(ckpt_path, *loaded, ckpt_meta, num_rounds)
    else:
        state, checks = init(params, data, key=key)
        raise_failed_checks(gather_to_host(checks))  # a collective on a multi-host mesh
        done = 0
    hist.inherited = hist.rounds()  # rounds from the checkpoint
    # Private copies: jit may forward input arrays (e.g. the key) into the state, and the
    # chunk donates the state's buffers.
    state = jax.tree.map(lambda x: x.copy(), state)
    if placement is not None:
        state = placement.state(state)

    eval_jit = None if eval_fn is None else _jitted_eval(algorithm, eval_fn)
    if eval_jit is not None and not hist.metric_rounds:
        hist.evaluate(eval_jit, state, done, data=data, eval_data=eval_data)
    if done == num_rounds:
        return hist.result(state)

    t0 = time.perf_counter()
    # (a NumPy count: the compiler options follow where the state and data live)
    compiled = compile_loops(
        _jitted_chunk(algorithm, chunk_size), state, data, np.int32(chunk_size)
    )
    hist.timings["compile_s"] = time.perf_counter() - t0
    bar = RoundBar(num_rounds, done, progress and jax.process_index() == 0, desc)
    try:
        state, first_bad = _chunks(
            compiled,
            state,
            data,
            hist,
            bar,
            done=done,
            num_rounds=num_rounds,
            chunk_size=chunk_size,
            on_nonfinite=on_nonfinite,
            evaluate=None
            if eval_jit is None
            else functools.partial(hist.evaluate, eval_jit, data=data, eval_data=eval_data),
            eval_every_chunk=eval_every_chunk,
            ckpt_path=ckpt_path,
            ckpt_meta=ckpt_meta,
        )
    finally:
        bar.close()
    return hist.result(state, first_bad)


def _check_loop_options(num_rounds, chunk_size, on_nonfinite, resume, checkpoint_dir):
    """Checks of :func:`run_chunks`'s options; prepares ``checkpoint_dir``.

    Returns:
      ``(num_rounds, chunk_size, ckpt_path)``, ``ckpt_path`` None without ``checkpoint_dir``.
    """
    num_rounds = check_positive_int("num_rounds", num_rounds)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    if on_nonfinite not in ("raise", "record"):
        raise ValueError(f"on_nonfinite must be 'raise' or 'record', got {on_nonfinite!r}")
    if resume and checkpoint_dir is None:
        raise ValueError("resume=True needs checkpoint_dir (where the checkpoint lives)")
    ckpt_path = (
        None if checkpoint_dir is None else os.path.join(checkpoint_dir, ckpt.CHECKPOINT_NAME)
    )
    if resume and not os.path.isfile(ckpt_path):
        raise ValueError(f"resume=True but there is no checkpoint at {ckpt_path}")
    if checkpoint_dir is not None and jax.process_count() > 1:
        raise ValueError(
            f"checkpoint_dir is not supported with {jax.process_count()} processes "
            "(jax.distributed): the checkpoint would have to gather the state on one host"
        )
    if checkpoint_dir is not None:
        ckpt.prepare_checkpoint_dir(checkpoint_dir)
    return num_rounds, chunk_size, ckpt_path


def _open_checkpoint(
    ckpt_path, algorithm, init, params, data, key, chunk_size, resume, name, fingerprints
):
    """The checkpoint's contents when resuming (else None) and the run's fingerprints.

    Returns:
      ``(loaded, meta)``: ``loaded`` is :func:`~karula_jax.training.checkpoint.load_checkpoint`'s
      ``(state, histories, meta)`` or None; ``meta`` the header entries this run writes
      and a resumed checkpoint must match.
    """
    name = ckpt.algorithm_name(algorithm) if name is None else name
    template = jax.eval_shape(init, params, data, key=key)[0]
    loaded = None
    if resume:  # first: a state of another structure cannot even be traced
        loaded = ckpt.load_checkpoint(ckpt_path, template, algorithm=name)
    extra = dict(fingerprints()) if fingerprints is not None else {}
    meta = {
        "algorithm_name": name,
        "key": ckpt.key_fingerprint(key),
        "algorithm": ckpt.algorithm_fingerprint(
            init, _fingerprinted_round(algorithm), template, params, data, key
        ),
        "data": extra.pop("data") if "data" in extra else ckpt.content_hash(data),
        "params": ckpt.content_hash(params),
        "chunk_size": chunk_size,
        **extra,
    }
    return loaded, meta


class _History:
    """What :func:`run_chunks` records as it goes: round infos, metrics and timings."""

    def __init__(self, t_start: float):
        self.t_start = t_start
        self.info_parts: list[RoundInfo] = []
        self.metric_history: list[dict] = []
        self.metric_rounds: list[int] = []
        self.timings = {"compile_s": 0.0, "run_s": 0.0, "eval_s": 0.0, "checkpoint_s": 0.0}
        self.best_rate = 0.0
        self.inherited = 0  # rounds read from the checkpoint

    def rounds(self) -> int:
        return sum(p.loss.shape[0] for p in self.info_parts)

    def resume(self, ckpt_path, state, hist, meta, ckpt_meta, num_rounds):
        """Takes the histories of a checkpoint; returns its ``(state, rounds_done)``."""
        ckpt.check_same_run(ckpt_path, meta, ckpt_meta)
        done = int(meta["rounds_done"])
        if done > num_rounds:
            raise ValueError(
                f"checkpoint {ckpt_path} already holds {done} rounds, more than "
                f"num_rounds={num_rounds}"
            )
        if hist["info"] is not None and done > 0:
            self.info_parts.append(hist["info"])
        for i, r in enumerate(hist["metric_rounds"]):
            self.metric_history.append({k: v[i] for k, v in hist["metrics"].items()})
            self.metric_rounds.append(int(r))
        return state, done

    def evaluate(self, eval_jit, st, rounds, *, data, eval_data):
        t0 = time.perf_counter()
        out = _check_metrics(eval_jit(st, data, eval_data))
        if self.metric_history and set(out) != set(self.metric_history[0]):
            raise ValueError(
                f"eval_fn returned metrics {sorted(out)}, earlier evaluations (or the "
                f"checkpoint) have {sorted(self.metric_history[0])}"
            )
        self.metric_history.append(out)
        self.metric_rounds.append(rounds)
        self.timings["eval_s"] += time.perf_counter() - t0
        return out

    def save(self, ckpt_path, state, done, ckpt_meta) -> None:
        t1 = time.perf_counter()
        self.info_parts[:] = [_stack_infos(self.info_parts)]  # keep one array per field
        ckpt.save_checkpoint(
            ckpt_path,
            state,
            rounds_done=done,
            info=self.info_parts[0],
            metrics=_stack_metrics(self.metric_history),
            metric_rounds=np.asarray(self.metric_rounds, dtype=np.int64),
            extra_meta=ckpt_meta,
        )
        self.timings["checkpoint_s"] += time.perf_counter() - t1

    def result(self, state, nonfinite=None) -> RunResult:
        info = _stack_infos(self.info_parts) if self.info_parts else None
        timings = self.timings
        timings["total_s"] = time.perf_counter() - self.t_start
        ran = self.rounds() - self.inherited
        timings["rounds_per_s"] = ran / timings["run_s"] if timings["run_s"] > 0 else math.nan
        timings["best_rounds_per_s"] = self.best_rate if self.best_rate > 0 else math.nan
        return RunResult(
            state=state,
            info=info,
            metrics=_stack_metrics(self.metric_history),
            metric_rounds=np.asarray(self.metric_rounds, dtype=np.int64),
            timings=dict(timings),
            nonfinite_round=nonfinite,
            diagnostics=round_diagnostics(info),
        )


def _chunks(
    compiled,
    state,
    data,
    hist: _History,
    bar: RoundBar,
    *,
    done: int,
    num_rounds: int,
    chunk_size: int,
    on_nonfinite: str,
    evaluate: Callable | None,
    eval_every_chunk: bool,
    ckpt_path: str | None,
    ckpt_meta: dict,
):
    """Runs the chunks from round ``done`` to ``num_rounds``: ``(state, first bad round)``.

    The state goes where the compiled chunk takes it, before every call: not where it was
    when the chunk was compiled. Where the state was on one device and some of the data on
    a mesh (a batch no device count divides, with data placed by an earlier batch), XLA
    chose a mesh placement for the state; the first call moves an uncommitted state there,
    but a committed one is refused (found with 5 CV folds on 2 devices)."""
    shardings = compiled.input_shardings[0][0]
    state = jax.device_put(state, shardings)
    first_bad: int | None = None
    while done < num_rounds:
        active = min(chunk_size, num_rounds - done)
        t0 = time.perf_counter()
        state, info = compiled(state, data, jnp.int32(active))
        info = RoundInfo(*(a[:active] for a in gather_to_host(info)))
        dt = time.perf_counter() - t0
        hist.timings["run_s"] += dt
        hist.best_rate = max(hist.best_rate, active / dt)
        state = jax.device_put(state, shardings)  # keep the compiled input placement
        bad = first_nonfinite(info.finite)
        if bad is not None:
            if first_bad is None:
                first_bad = done + bad
            if on_nonfinite == "raise":
                hist.info_parts.append(RoundInfo(*(a[: bad + 1] for a in info)))
                saved = ckpt_path is not None and os.path.isfile(ckpt_path)
                last = f"{done} rounds in {ckpt_path}" if saved else "none"
                err = nonfinite_error(done + bad, info.finite[bad], last, nonfinite_data(data))
                err.result = hist.result(state, first_bad)
                raise err
        hist.info_parts.append(info)
        done += active
        last_metrics = {}
        if evaluate is not None and (eval_every_chunk or done == num_rounds):
            last_metrics = evaluate(state, done)
        if ckpt_path is not None:
            hist.save(ckpt_path, state, done, ckpt_meta)
        last_info = RoundInfo(*(a[-1] for a in info))
        bar.update(active, scalar_summary(last_info, last_metrics))
    return state, first_bad
