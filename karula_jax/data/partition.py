"""Splitting one pool of samples ``(x, y)`` into clients, the ways FL papers make them differ.

A user with a centralized data set makes a federated one by dealing its rows to ``n``
clients. Three standard heterogeneities:

* :func:`split_label_skew`: every client holds the rows of ``k`` classes only
  (McMahan et al.'s pathological non-IID split, "#C = k" in NIID-Bench, Li et al. 2022);
* :func:`split_dirichlet`: each class is shared among the clients in proportions drawn
  from a symmetric Dirichlet(``alpha``) (Hsu et al. 2019): small ``alpha`` gives few
  classes per client, large ``alpha`` nearly the pool's label mix;
* :func:`split_feature_shift`: labels and sizes as in an IID split, but each client sees
  its features through its own affine map and noise level (NIID-Bench's noise-based
  feature imbalance, with a per-client scale and offset).

Every function takes the pool as host arrays ``x [N, *feature_shape]`` and ``y [N, ...]``
and one PRNG key (``key=``; the same key gives the same split), and returns a
:class:`~karula_jax.data.ClientData` built by :func:`~karula_jax.data.from_client_arrays`:
clients padded to the largest one, float32 features, int32 labels for the label splits.
Each client's rows keep their order in ``x``. Splitting runs on the host (numpy, seeded
from the key), once, before anything is compiled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from karula_jax._checks import (
    check_finite,
    check_key,
    check_nonnegative,
    check_positive,
    check_positive_int,
    check_real_array,
)
from karula_jax.data.clients import ClientData, from_client_arrays

__all__ = ["split_dirichlet", "split_feature_shift", "split_label_skew"]

# Redraws of split_dirichlet before it gives up on giving every client min_count rows.
MAX_DIRICHLET_DRAWS = 100


def _pool(x, y, num_clients, key, *, labels: bool, num_classes=None):
    """Checked ``(x, y, n, C, rng)``: numpy arrays, the client count, the class count
    (None unless ``labels``) and a numpy generator seeded from ``key``."""
    n = check_positive_int("num_clients", num_clients)
    check_key("key", key)
    arrays = []
    for name, a in (("x", x), ("y", y)):
        if isinstance(a, str | bytes) or a is None:
            raise TypeError(f"{name} must be an array, got {type(a).__name__}")
        a = np.asarray(a)
        if a.ndim < 1:
            raise ValueError(f"{name} must have a leading sample axis [N, ...], got a scalar")
        check_real_array(name, a)
        check_finite(name, a)
        arrays.append(a)
    x, y = arrays
    if x.shape[0] != y.shape[0]:
        raise ValueError(
            f"x and y must have the same number of rows, got {x.shape[0]} and {y.shape[0]}"
        )
    if x.shape[0] < n:
        raise ValueError(
            f"num_clients={n} is more than the {x.shape[0]} samples: every client needs a row"
        )
    C = None
    if labels:
        if y.ndim != 1:
            raise ValueError(f"y must hold one class label per row, shape [N], got {y.shape}")
        if y.dtype == bool or not np.all(y == np.round(y)):
            raise ValueError("y must hold integer class labels")
        y = y.astype(np.int64)
        if y.min() < 0:
            raise ValueError(f"y must hold class labels >= 0, got {y.min()}")
        C = int(y.max()) + 1
        if num_classes is not None:
            C = check_positive_int("num_classes", num_classes)
            if y.max() >= C:
                raise ValueError(f"y holds label {y.max()}, outside num_classes={C}")
    rng = np.random.default_rng(np.asarray(jax.random.bits(key, (4,), jnp.uint32)))
    return x, y, n, C, rng


def _deal(x, y, parts, num_classes) -> ClientData:
    """ClientData of the clients' row indices ``parts`` (each sorted, non-empty)."""
    empty = [i for i, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise ValueError(
            f"client {empty[0]} received no row ({len(empty)} empty clients in all); use "
            "fewer clients or a less skewed split"
        )
    return from_client_arrays([x[p] for p in parts], [y[p] for p in parts], num_classes=num_classes)


def _even_parts(rows: np.ndarray, k: int) -> list[np.ndarray]:
    """``rows`` cut into ``k`` consecutive pieces whose sizes differ by at most one."""
    return np.array_split(rows, k)


def split_label_skew(
    x, y, num_clients: int, *, classes_per_client: int, key, num_classes: int | None = None
) -> ClientData:
    """Every client holds the rows of ``classes_per_client`` classes only.

    The classes that occur in ``y`` are put in a random cyclic order ``c_0, ..., c_{C-1}``;
    client ``i`` owns the ``k`` consecutive classes ``c_{(ik + j) mod C}``, ``j < k``
    (``k = classes_per_client``), so its classes are distinct and every class has
    ``floor(nk / C)`` or ``ceil(nk / C)`` owners. A class's rows, shuffled, are dealt to
    its owners in pieces whose sizes differ by at most one. Every row of an owned class
    goes to exactly one client; when ``nk < C``, the classes ``c_{nk}, ...`` have no owner
    and their rows are left out. A client holds at most ``k`` labels (fewer only when one
    of its classes has fewer rows than owners).

    Args:
      x: features, array ``[N, *feature_shape]``, real and finite.
      y: integer class labels ``>= 0``, array ``[N]``.
      num_clients: ``n``, at most ``N``.
      classes_per_client: ``k``, between 1 and the number of distinct labels in ``y``.
      key: PRNG key of the class order and the shuffles.
      num_classes: the label range ``[0, num_classes)`` kept in the result's label check
        (default ``max(y) + 1``).

    Returns:
      :class:`ClientData` with leaves ``[n, N_max, ...]`` and int32 labels.

    Raises:
      ValueError: shapes that do not match, non-integer or negative labels, NaN or inf,
        more clients than rows, ``classes_per_client`` out of range, or a client left
        without rows.
      TypeError: non-numeric input, a bad ``key``, non-integer sizes.

    Examples:
      >>> import jax
      >>> import numpy as np
      >>> from karula_jax.data import split_label_skew
      >>> x = np.arange(24.0).reshape(12, 2)
      >>> y = np.repeat(np.arange(4), 3)  # 4 classes of 3 rows
      >>> data = split_label_skew(x, y, 4, classes_per_client=2, key=jax.random.key(0))
      >>> data.num_clients, int(data.counts.sum())  # every row to one client
      (4, 12)
      >>> [len(set(np.asarray(yi[:c]).tolist())) for yi, c in zip(data.y, data.counts)]
      [2, 2, 2, 2]
    """
    x, y, n, C, rng = _pool(x, y, num_clients, key, labels=True, num_classes=num_classes)
    k = check_positive_int("classes_per_client", classes_per_client)
    present = np.unique(y)
    if k > present.size:
        raise ValueError(
            f"classes_per_client={k} is more than the {present.size} distinct labels in y"
        )
    order = rng.permutation(present)
    owners: dict[int, list[int]] = {int(c): [] for c in present}
    for i in range(n):
        for j in range(k):
            owners[int(order[(i * k + j) % present.size])].append(i)
    parts: list[list[np.ndarray]] = [[] for _ in range(n)]
    for c, who in owners.items():
        if who:
            rows = rng.permutation(np.flatnonzero(y == c))
            for i, piece in zip(who, _even_parts(rows, len(who)), strict=True):
                parts[i].append(piece)
    return _deal(x, y, [np.sort(np.concatenate(p)) for p in parts], C)


def split_dirichlet(
    x,
    y,
    num_clients: int,
    *,
    alpha: float,
    key,
    num_classes: int | None = None,
    min_count: int = 1,
) -> ClientData:
    """Each class shared among the clients in Dirichlet(``alpha``) proportions.

    For every class ``c`` with ``m_c`` rows, proportions ``p ~ Dirichlet(alpha 1_n)`` are
    drawn and the class's rows, shuffled, are cut at ``round(m_c cumsum(p))``: client ``i``
    receives about ``p_i m_c`` of them. Every row goes to exactly one client. The expected
    label distribution of every client is the pool's; its spread shrinks as ``alpha``
    grows (``alpha -> 0``: each class to a single client; ``alpha -> inf``: the pool's
    mix everywhere). When some client gets fewer than ``min_count`` rows the whole split
    is drawn again, with ``fold_in(key, attempt)``, up to ``MAX_DIRICHLET_DRAWS`` times.

    Args:
      x: features, array ``[N, *feature_shape]``, real and finite.
      y: integer class labels ``>= 0``, array ``[N]``.
      num_clients: ``n``, at most ``N``.
      alpha: concentration ``> 0`` (dimensionless); 0.1 to 1 are the usual "skewed"
        settings.
      key: PRNG key of the proportions and shuffles.
      num_classes: the label range (default ``max(y) + 1``).
      min_count: the fewest rows a client may receive (``>= 1``).

    Returns:
      :class:`ClientData` with leaves ``[n, N_max, ...]`` and int32 labels.

    Raises:
      ValueError: as :func:`split_label_skew`; ``alpha`` not finite and ``> 0``;
        ``n * min_count > N``; no draw gave every client ``min_count`` rows.
      TypeError: non-numeric input, a bad ``key``, non-integer sizes.

    Examples:
      >>> import jax
      >>> import numpy as np
      >>> from karula_jax.data import split_dirichlet
      >>> x = np.random.default_rng(0).normal(size=(60, 2))
      >>> y = np.arange(60) % 3
      >>> data = split_dirichlet(x, y, 5, alpha=0.5, key=jax.random.key(0), min_count=2)
      >>> data.num_clients, int(data.counts.sum()), bool(data.counts.min() >= 2)
      (5, 60, True)
    """
    x, y, n, C, _ = _pool(x, y, num_clients, key, labels=True, num_classes=num_classes)
    check_positive("alpha", alpha)
    min_count = check_positive_int("min_count", min_count)
    if n * min_count > len(y):
        raise ValueError(
            f"num_clients * min_count = {n * min_count} is more than the {len(y)} samples"
        )
    classes = np.unique(y)
    for attempt in range(MAX_DIRICHLET_DRAWS):
        seed = jax.random.bits(jax.random.fold_in(key, attempt), (4,), jnp.uint32)
        rng = np.random.default_rng(np.asarray(seed))
        parts: list[list[np.ndarray]] = [[] for _ in range(n)]
        for c in classes:
            rows = rng.permutation(np.flatnonzero(y == c))
            p = _dirichlet(rng, float(alpha), n)
            cuts = np.round(np.cumsum(p)[:-1] * len(rows)).astype(int)
            for i, piece in enumerate(np.split(rows, cuts)):
                parts[i].append(piece)
        parts = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(p) for p in parts) >= min_count:
            return _deal(x, y, parts, C)
    raise ValueError(
        f"no Dirichlet(alpha={alpha}) split in {MAX_DIRICHLET_DRAWS} draws gave every one of "
        f"{n} clients at least min_count={min_count} rows; raise alpha, or lower num_clients "
        "or min_count"
    )


def _dirichlet(rng: np.random.Generator, alpha: float, n: int) -> np.ndarray:
    """One draw of Dirichlet(``alpha 1_n``); a uniformly chosen vertex of the simplex
    where every gamma variate underflows (tiny ``alpha``), the distribution's limit."""
    g = rng.standard_gamma(alpha, size=n)
    total = g.sum()
    if not np.isfinite(total) or total <= 0:
        return np.eye(n)[rng.integers(n)]
    return g / total


def split_feature_shift(
    x,
    y,
    num_clients: int,
    *,
    key,
    noise: float = 0.0,
    scale: float = 0.0,
    offset: float = 0.0,
    num_classes: int | None = None,
) -> ClientData:
    """An IID split in which every client sees its features through its own distortion.

    The rows, shuffled, are dealt to the clients in pieces whose sizes differ by at most
    one (every row to exactly one client, labels untouched). Client ``i``'s features are
    then

        x' = exp(scale g_i) x + offset u_i + noise (i / max(n - 1, 1)) e

    with ``g_i ~ N(0, 1)`` one number per client (its contrast), ``u_i ~ N(0, I)`` one
    vector of the feature shape per client (its offset) and ``e ~ N(0, I)`` fresh per row
    and feature: client 0 is noise-free and client ``n - 1`` has noise of standard
    deviation ``noise`` (NIID-Bench's noise-based feature imbalance). The labelling
    stays that of the undistorted features, so the clients' feature distributions
    ``P_i(x)`` differ while what a label means does not. With all three amounts 0 it is
    an IID split.

    Args:
      x: features, array ``[N, *feature_shape]``, real and finite.
      y: targets, array ``[N, ...]`` (labels or regression targets), unchanged.
      num_clients: ``n``, at most ``N``.
      key: PRNG key of the shuffle and the distortions.
      noise: standard deviation of the last client's feature noise, in the units of
        ``x``, ``>= 0``.
      scale: standard deviation of the clients' log contrast, ``>= 0`` (dimensionless).
      offset: standard deviation of the clients' offsets, in the units of ``x``, ``>= 0``.
      num_classes: if given, ``y`` are class labels in ``[0, num_classes)`` (stored
        int32); otherwise floating targets.

    Returns:
      :class:`ClientData` with leaves ``[n, N_max, ...]``, ``N_max = ceil(N / n)``.

    Raises:
      ValueError: shapes that do not match, NaN or inf, more clients than rows, a
        negative or non-finite amount, labels outside ``num_classes``.
      TypeError: non-numeric input, a bad ``key``, non-integer sizes.

    Examples:
      >>> import jax
      >>> import numpy as np
      >>> from karula_jax.data import split_feature_shift
      >>> x = np.random.default_rng(0).normal(size=(10, 2))
      >>> y = np.arange(10) % 2
      >>> data = split_feature_shift(x, y, 3, key=jax.random.key(0), noise=0.5, num_classes=2)
      >>> data.x.shape, data.counts.tolist()
      ((3, 4, 2), [4, 3, 3])
    """
    x, y, n, _, rng = _pool(x, y, num_clients, key, labels=False)
    for name, value in (("noise", noise), ("scale", scale), ("offset", offset)):
        check_nonnegative(name, value)
    parts = [np.sort(p) for p in _even_parts(rng.permutation(len(y)), n)]
    xs = []
    for i, p in enumerate(parts):
        level = noise * i / max(n - 1, 1)
        contrast = np.exp(scale * rng.standard_normal())
        shift = offset * rng.standard_normal(x.shape[1:])
        xs.append(contrast * x[p] + shift + level * rng.standard_normal(x[p].shape))
    return from_client_arrays(xs, [y[p] for p in parts], num_classes=num_classes)
