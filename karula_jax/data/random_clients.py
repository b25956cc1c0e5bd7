"""Random classification clients of a chosen shape, for measuring time and memory."""

from __future__ import annotations

import numpy as np

from karula_jax._checks import check_positive_int
from karula_jax.data.clients import ClientData, from_client_arrays

__all__ = ["random_classification"]


def random_classification(
    num_clients: int,
    *,
    seed: int = 0,
    rows: tuple[int, int] = (150, 210),
    features: int = 784,
    num_classes: int = 10,
) -> ClientData:
    """Clients whose rows are standard normal features with uniformly drawn labels.

    The defaults have the shapes of FEMNIST writers' digits (784 pixels, 10 classes, 150 to
    210 digits per writer); there is nothing to learn. Client ``i`` holds ``N_i`` rows,
    ``N_i`` uniform on ``rows[0]..rows[1]``; all draws come from ``np.random.default_rng(seed)``
    (first the counts, then every client's features, then every client's labels).

    Raises:
      ValueError: ``num_clients``, ``features`` or ``num_classes`` below 1, or ``rows`` not
        two integers with ``1 <= rows[0] <= rows[1]``.

    Examples:
      >>> from karula_jax.data import random_classification
      >>> data = random_classification(3, rows=(5, 8), features=4, num_classes=2)
      >>> data.num_clients, data.x.shape[2], data.y.dtype
      (3, 4, dtype('int32'))
    """
    n = check_positive_int("num_clients", num_clients)
    check_positive_int("features", features)
    check_positive_int("num_classes", num_classes)
    lo, hi = rows
    if not 1 <= lo <= hi:
        raise ValueError(f"rows must be (low, high) with 1 <= low <= high, got {rows}")
    rng = np.random.default_rng(seed)
    counts = rng.integers(lo, hi + 1, size=n)
    xs = [rng.normal(size=(c, features)).astype(np.float32) for c in counts]
    ys = [rng.integers(0, num_classes, size=c) for c in counts]
    return from_client_arrays(xs, ys, num_classes=num_classes)
