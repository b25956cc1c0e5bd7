"""UCI Heart Disease: four hospitals as four naturally federated clients.

The files are the pristine UCI ``processed.{hospital}.data`` tables: no header, 14
comma-separated columns, ``?`` for a missing value. Columns (1-based): 1 age, 2 sex,
3 cp (chest pain type, 1-4), 4 trestbps, 5 chol, 6 fbs, 7 restecg (0-2), 8 thalach,
9 exang, 10 oldpeak, 11 slope, 12 ca, 13 thal, 14 num (diagnosis 0-4).

Preprocessing (the common one, as in FLamby's Fed-Heart-Disease):

1. drop the sparsely filled columns 11-13 (slope, ca, thal);
2. drop every row that still has a missing value: 303 / 261 / 46 / 130 rows remain
   for cleveland / hungarian / switzerland / va;
3. label = ``num > 0`` (any disease);
4. encode the categorical columns cp (4 levels) and restecg (3 levels) by indicators of
   every level but the first (FLamby's ``get_dummies(..., drop_first=True)``): 13
   features. All levels (15 features) or the integer codes (10) are options.

Known quirk kept as is: ``chol`` is recorded as 0 for every Swiss row and for 33 VA
rows (a missing value coded as 0 in the source); dropping them would change the
standard row counts. Switzerland is also almost all positive (45 of 46).
"""

from __future__ import annotations

import os
import pathlib
from typing import NamedTuple

import numpy as np

from karula_jax.data.clients import ClientData, from_client_arrays

__all__ = [
    "ENCODINGS",
    "HOSPITALS",
    "HeartDiseaseData",
    "load_heart_disease",
    "read_heart_disease_file",
]

HOSPITALS = ("cleveland", "hungarian", "switzerland", "va")
_COLUMNS = (
    "age",
    "sex",
    "cp",
    "trestbps",
    "chol",
    "fbs",
    "restecg",
    "thalach",
    "exang",
    "oldpeak",
    "slope",
    "ca",
    "thal",
    "num",
)
_DROPPED = (10, 11, 12)  # 0-based slope, ca, thal
_RAW = tuple(c for j, c in enumerate(_COLUMNS[:13]) if j not in _DROPPED)
# Allowed values of the discrete columns, used both to validate and to one-hot encode.
_LEVELS = {
    "sex": (0, 1),
    "cp": (1, 2, 3, 4),
    "fbs": (0, 1),
    "restecg": (0, 1, 2),
    "exang": (0, 1),
}
_CATEGORICAL = ("cp", "restecg")
# How cp and restecg enter x: {encoding: number of features}.
ENCODINGS = {"reference": 13, "one_hot": 15, "codes": 10}


class HeartDiseaseData(NamedTuple):
    """Output of :func:`load_heart_disease`.

    Attributes:
      train: standardized training rows, ``x`` float32 ``[4, N_max, d]``, ``y`` int32
        ``[4, N_max]`` in ``{0, 1}``.
      test: the held-out rows of each hospital, standardized with the training
        statistics.
      hospitals: client names, ``hospitals[i]`` is client ``i``.
      feature_names: the ``d`` column names of ``x`` (indicator columns as ``cp=2`` ...).
    """

    train: ClientData
    test: ClientData
    hospitals: list[str]
    feature_names: list[str]


def read_heart_disease_file(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """Parses one ``processed.*.data`` file and applies steps 1-3 of the preprocessing.

    Args:
      path: the UCI file.

    Returns:
      ``(features, labels)``: float64 ``[N, 10]`` raw features in the order age, sex,
      cp, trestbps, chol, fbs, restecg, thalach, exang, oldpeak, and int32 ``[N]``
      labels in ``{0, 1}``.

    Raises:
      ValueError: naming the file (and line and column where there is one) on a file
        that is not ASCII text, a wrong number of columns, a non-numeric entry, a
        diagnosis outside 0-4 or a discrete column off its levels.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"data_dir: heart disease file {path} not found")
    try:
        text = path.read_text(encoding="ascii")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not an ASCII text file, so not a UCI table ({e})") from e
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.strip().split(",")
        if len(fields) != len(_COLUMNS):
            raise ValueError(
                f"{path}, line {lineno}: expected {len(_COLUMNS)} comma-separated columns, "
                f"got {len(fields)}"
            )
        row = []
        for j, v in enumerate(fields):
            v = v.strip()
            if v == "?":
                row.append(np.nan)
                continue
            try:
                row.append(float(v))
            except ValueError:
                raise ValueError(
                    f"{path}, line {lineno}, column {j + 1} ({_COLUMNS[j]}): "
                    f"expected a number or '?', got {v!r}"
                ) from None
            if not np.isfinite(row[-1]):
                raise ValueError(f"{path}, line {lineno}, column {j + 1}: value {v!r} not finite")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no data rows")
    table = np.delete(np.asarray(rows, dtype=np.float64), _DROPPED, axis=1)
    # Validate every recorded value (missing ones are NaN and skipped) before dropping rows.
    num = table[:, -1]
    bad = ~np.isnan(num) & ~np.isin(num, (0, 1, 2, 3, 4))
    if bad.any():
        raise ValueError(f"{path}: column 14 (num) must hold diagnoses 0-4, got {num[bad][0]}")
    for name, levels in _LEVELS.items():
        col = table[:, _RAW.index(name)]
        bad = ~np.isnan(col) & ~np.isin(col, levels)
        if bad.any():
            raise ValueError(
                f"{path}: column {_COLUMNS.index(name) + 1} ({name}) must be one of {levels}, "
                f"got {col[bad][0]}"
            )
    table = table[~np.isnan(table).any(axis=1)]
    if len(table) == 0:
        raise ValueError(f"{path}: every row has a missing value outside columns 11-13")
    feats, num = table[:, :-1], table[:, -1]
    return feats, (num > 0).astype(np.int32)


def _encode(feats: np.ndarray, encoding: str) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Returns encoded features, their names and a bool mask of the columns to standardize."""
    cols, names, scale = [], [], []
    for j, name in enumerate(_RAW):
        if encoding != "codes" and name in _CATEGORICAL:
            levels = _LEVELS[name][1:] if encoding == "reference" else _LEVELS[name]
            for level in levels:
                cols.append((feats[:, j] == level).astype(np.float64))
                names.append(f"{name}={level}")
                scale.append(False)  # indicators stay 0/1
        else:
            cols.append(feats[:, j])
            names.append(name)
            scale.append(True)
    return np.stack(cols, axis=1), names, np.asarray(scale)


def _split(labels: np.ndarray, test_fraction: float, rng: np.random.Generator):
    """Stratified split: each class gives ``round(test_fraction * n_class)`` test rows."""
    test = []
    for c in (0, 1):
        idx = np.flatnonzero(labels == c)
        k = int(round(test_fraction * len(idx)))
        test.append(rng.permutation(idx)[:k])
    test = np.sort(np.concatenate(test))
    train = np.setdiff1d(np.arange(len(labels)), test)
    return train, test


def load_heart_disease(
    data_dir: str | os.PathLike,
    *,
    test_fraction: float = 0.25,
    seed: int = 0,
    categorical: str = "reference",
) -> HeartDiseaseData:
    """Loads the four hospitals as clients, split and standardized.

    Split: within each hospital and each label, ``round(test_fraction * count)`` rows
    drawn with ``numpy.random.default_rng(seed)`` go to the test set (stratified, so
    class balance is kept per hospital); hospitals are processed in the order of
    :data:`HOSPITALS`.

    Standardization: every column except the one-hot indicators becomes
    ``(x - mean) / std`` with mean and std fitted on the pooled TRAINING rows of all
    hospitals (test rows never enter). The statistics are computed the federated way:
    each hospital reports its row count, column sums and sums of squares, and the
    server combines them, which equals the pooled fit exactly and needs no raw row to
    leave a hospital. A constant column keeps std 1.

    Args:
      data_dir: folder with the four ``processed.{hospital}.data`` files.
      test_fraction: fraction of each hospital's rows (per class) held out, in (0, 1).
      seed: seed of the split.
      categorical: how cp and restecg enter (:data:`ENCODINGS`): ``"reference"``, an
        indicator per level but the first (cp=1, restecg=0 are the reference; 13
        features, FLamby's encoding); ``"one_hot"``, an indicator per level (15; with an
        intercept the indicators of one column sum to 1, collinear with it); ``"codes"``,
        the integer codes as numbers (10).

    Returns:
      A :class:`HeartDiseaseData`.

    Raises:
      ValueError: on a missing folder or file, malformed files (see
        :func:`read_heart_disease_file`), or a ``test_fraction`` leaving a hospital
        without training or test rows.
    """
    root = pathlib.Path(data_dir)
    if not root.is_dir():
        raise ValueError(f"data_dir: folder {root} not found")
    try:
        test_fraction = float(test_fraction)
    except (TypeError, ValueError) as e:
        raise TypeError(f"test_fraction must be a number, got {test_fraction!r}") from e
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    if categorical not in ENCODINGS:
        raise ValueError(f"categorical must be one of {sorted(ENCODINGS)}, got {categorical!r}")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise TypeError(f"seed must be an int, got {seed!r}")
    rng = np.random.default_rng(seed)

    parts = []
    names: list[str] = []
    scale = None
    for h in HOSPITALS:
        feats, labels = read_heart_disease_file(root / f"processed.{h}.data")
        x, names, scale = _encode(feats, categorical)
        tr, te = _split(labels, test_fraction, rng)
        if len(tr) == 0 or len(te) == 0:
            raise ValueError(
                f"test_fraction={test_fraction} leaves hospital {h} ({len(labels)} rows) with "
                f"{len(tr)} training and {len(te)} test rows; both must be positive"
            )
        parts.append((x[tr], labels[tr], x[te], labels[te]))

    # Federated standardization: sums of the hospitals' sufficient statistics.
    count = sum(len(p[0]) for p in parts)
    total = sum(p[0].sum(axis=0) for p in parts)
    total_sq = sum((p[0] ** 2).sum(axis=0) for p in parts)
    mean = total / count
    var = np.maximum(total_sq / count - mean**2, 0.0)
    std = np.sqrt(var)
    std = np.where(std > 1e-12 * np.maximum(1.0, np.abs(mean)), std, 1.0)
    mean = np.where(scale, mean, 0.0)
    std = np.where(scale, std, 1.0)

    def standardize(a):
        return ((a - mean) / std).astype(np.float32)

    train = from_client_arrays(
        [standardize(p[0]) for p in parts], [p[1] for p in parts], num_classes=2
    )
    test = from_client_arrays(
        [standardize(p[2]) for p in parts], [p[3] for p in parts], num_classes=2
    )
    return HeartDiseaseData(train, test, list(HOSPITALS), names)
