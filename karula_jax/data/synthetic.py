"""The synthetic ridge-regression setting of the KARULA paper (section 5.1)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from karula_jax._checks import check_nonnegative, check_positive_int
from karula_jax.data.clients import ClientData, from_client_arrays

__all__ = ["SyntheticRidge", "synthetic_ridge"]


class SyntheticRidge(NamedTuple):
    """Output of :func:`synthetic_ridge`.

    Attributes:
      train: training data, ``x`` of shape ``[n, N_max, d]``, ``y`` of shape ``[n, N_max]``.
      test: held-out data from the same per-client distributions, ``num_test`` rows each.
      theta_true: true per-client parameters, shape ``[n, d]``.
      groups: group index of each client, int32 array of shape ``[n]``.
    """

    train: ClientData
    test: ClientData
    theta_true: jnp.ndarray  # [n, d] float32
    groups: jnp.ndarray  # [n] int32


def synthetic_ridge(
    seed: int = 0,
    *,
    num_clients: int = 30,
    dim: int = 50,
    group_means: Sequence[float] = (1.0, 1.5, 2.0),
    theta_std: float = 0.1,
    min_samples: int = 10,
    max_samples: int = 100,
    feature_mean_std: float = 0.2,
    feature_scale_range: tuple[float, float] = (0.8, 1.2),
    noise_std: float = 0.6,
    num_test: int = 100,
    group_feature_std: float = 0.0,
) -> SyntheticRidge:
    """Heterogeneous linear-regression clients in groups with different true models.

    The paper fixes ``n = 30``, ``d = 50``, three equally sized groups whose true
    parameters are drawn around means 1, 1.5 and 2, client-specific normal feature
    distributions, and ``N_i ~ Uniform{10..100}``. It leaves the rest open; the
    choices made here are:

    * Groups: client ``i`` belongs to group ``i * G // n`` (contiguous thirds).
    * True parameters: ``theta_i* ~ N(m_g 1_d, theta_std^2 I)`` for the group mean
      ``m_g``; the same draw for every coordinate scale.
    * Features: client ``i`` draws rows ``x ~ N(mu_i, diag(s_i^2))`` with
      ``mu_i ~ N(0, feature_mean_std^2 I)`` and ``s_i ~ Uniform(feature_scale_range)``
      per coordinate, so feature distributions differ across clients but only
      mildly (big feature shifts would make data differ where models do not).
      With ``group_feature_std > 0`` every group also draws an offset
      ``m_g ~ N(0, group_feature_std^2 I)`` that its clients add to ``mu_i``, so that
      the feature distributions follow the groups (a sensitivity setting; the default
      0 keeps features independent of the groups).
    * Responses: ``y = x . theta_i* + e`` with ``e ~ N(0, noise_std^2)``, no intercept.
      The paper tunes the noise "so that the global model beats local models"; what
      the default 0.6 gives local and global fits: ``results/synthetic/README.md``.
    * Sizes: ``N_i`` uniform on ``{min_samples, ..., max_samples}``; the test set has
      ``num_test`` fresh rows per client from the same distribution.

    Everything is drawn from one ``numpy.random.Generator`` seeded with ``seed``, in the
    order: sizes, groups' parameters, feature distributions (group offsets last, drawn
    only when ``group_feature_std > 0``), train rows, test rows.

    Args:
      seed: seed of the data draw.
      num_clients: number of clients ``n``.
      dim: feature dimension ``d``.
      group_means: centre of each group's true parameters.
      theta_std: spread of true parameters within a group.
      min_samples: smallest training set size.
      max_samples: largest training set size.
      feature_mean_std: spread of the clients' feature means.
      feature_scale_range: range of per-coordinate feature standard deviations.
      noise_std: standard deviation of the response noise.
      num_test: test rows per client.
      group_feature_std: spread of the per-group feature-mean offsets (0: none).

    Returns:
      A :class:`SyntheticRidge`.

    Examples:
      >>> import karula_jax as kj
      >>> ds = kj.data.synthetic_ridge(0, num_clients=6, dim=3)
      >>> ds.train.num_clients, ds.train.x.shape[2], ds.test.x.shape
      (6, 3, (6, 100, 3))
      >>> ds.theta_true.shape, ds.groups.tolist()
      ((6, 3), [0, 0, 1, 1, 2, 2])
      >>> bool((ds.train.counts >= 10).all() and (ds.train.counts <= 100).all())
      True
    """
    num_clients = check_positive_int("num_clients", num_clients)
    dim = check_positive_int("dim", dim)
    min_samples = check_positive_int("min_samples", min_samples)
    max_samples = check_positive_int("max_samples", max_samples)
    num_test = check_positive_int("num_test", num_test)
    if min_samples > max_samples:
        raise ValueError(
            f"need 1 <= min_samples <= max_samples, got {min_samples} and {max_samples}"
        )
    for name, value in (
        ("noise_std", noise_std),
        ("theta_std", theta_std),
        ("feature_mean_std", feature_mean_std),
        ("group_feature_std", group_feature_std),
    ):
        check_nonnegative(name, value)
    try:
        means_arr = np.asarray(group_means, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise TypeError(f"group_means must be a sequence of numbers, got {group_means!r}") from e
    if means_arr.ndim != 1 or means_arr.size == 0 or not np.all(np.isfinite(means_arr)):
        raise ValueError(
            f"group_means must be a non-empty sequence of finite numbers, got {group_means!r}"
        )
    try:
        lo, hi = (float(v) for v in feature_scale_range)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"feature_scale_range must be a pair of numbers (lo, hi), got {feature_scale_range!r}"
        ) from e
    if not (0 < lo <= hi and np.isfinite(hi)):
        raise ValueError(
            f"feature_scale_range must satisfy 0 < lo <= hi < inf, got {feature_scale_range}"
        )

    rng = np.random.default_rng(seed)
    num_groups = len(group_means)
    sizes = rng.integers(min_samples, max_samples + 1, size=num_clients)
    groups = np.arange(num_clients) * num_groups // num_clients
    means = means_arr[groups]
    theta = means[:, None] + theta_std * rng.standard_normal((num_clients, dim))
    mu = feature_mean_std * rng.standard_normal((num_clients, dim))
    scale = rng.uniform(lo, hi, size=(num_clients, dim))
    if group_feature_std > 0:  # only then, so the default draws stay as they were
        mu = mu + group_feature_std * rng.standard_normal((num_groups, dim))[groups]

    def draw(i, rows):
        x = mu[i] + scale[i] * rng.standard_normal((rows, dim))
        return x, x @ theta[i] + noise_std * rng.standard_normal(rows)

    train = [draw(i, sizes[i]) for i in range(num_clients)]
    test = [draw(i, num_test) for i in range(num_clients)]
    return SyntheticRidge(
        train=from_client_arrays([a for a, _ in train], [b for _, b in train]),
        test=from_client_arrays([a for a, _ in test], [b for _, b in test]),
        theta_true=jnp.asarray(theta, dtype=jnp.float32),
        groups=jnp.asarray(groups, dtype=jnp.int32),
    )
