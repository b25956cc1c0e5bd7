"""Reader for LEAF JSON folders (FEMNIST and friends), writers as clients.

LEAF (Caldas et al., 2019) writes a data set as numbered JSON shards in ``train/``
and ``test/`` folders. Each shard is

    {"users": [id, ...], "num_samples": [N, ...],
     "user_data": {id: {"x": [[f, ...], ...], "y": [label, ...]}, ...}}

and the train and test shards with the same index hold the same writers (LEAF's
per-writer split). FEMNIST images are 28 x 28 flattened row-major to 784 floats in
``[0, 1]`` with **1.0 the white background and dark ink** (the reverse of classic
MNIST); pass ``invert=True`` to get ink = 1. Labels are ``0-9`` (digits), ``10-35``
(upper case) and ``36-61`` (lower case).

Only JSON is read (no pickle) and nothing is cached on disk.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
from typing import NamedTuple

import numpy as np

from karula_jax._checks import check_positive_int
from karula_jax.data.clients import ClientData, from_client_arrays

__all__ = ["IMAGE_SIZE", "LeafData", "load_leaf", "read_leaf_file"]

IMAGE_SIZE = 784  # 28 x 28 pixels, flattened row-major
_NUM_DIGITS = 10
_NUM_CLASSES = 62


class LeafData(NamedTuple):
    """Output of :func:`load_leaf`.

    Attributes:
      train: training data of the selected writers, ``x`` float32 of shape
        ``[n, N_max, 784]``, ``y`` int32 of shape ``[n, N_max]``.
      test: the same writers' test data, ``x`` of shape ``[n, M_max, 784]``.
      writers: LEAF writer ids, ``writers[i]`` is client ``i``.
    """

    train: ClientData
    test: ClientData
    writers: list[str]


def _file_index(path: pathlib.Path) -> tuple[int, str]:
    # LEAF names shards ``all_data_{i}_..._{split}_{frac}.json``: order by the first number.
    m = re.search(r"\d+", path.name)
    return (int(m.group()) if m else -1, path.name)


def _counterpart(train_file: pathlib.Path, test_dir: pathlib.Path) -> pathlib.Path:
    name = train_file.name
    k = name.rfind("train")
    if k < 0:
        raise ValueError(
            f"cannot pair {train_file}: a LEAF training file name must contain 'train' "
            "(its test file has the same name with 'test')"
        )
    other = test_dir / (name[:k] + "test" + name[k + len("train") :])
    if not other.is_file():
        raise ValueError(f"training file {train_file} has no matching test file {other}")
    return other


def read_leaf_file(path: str | os.PathLike) -> dict[str, tuple[list, np.ndarray]]:
    """Reads and validates one LEAF JSON shard.

    Structure is checked for every writer (keys, lengths, row lengths, integer
    labels); pixels are returned as the parsed lists so that only the writers a
    caller keeps pay for the conversion to arrays.

    Args:
      path: a LEAF ``.json`` file.

    Returns:
      Dict from writer id to ``(x_rows, y)``, in the file's ``users`` order: ``x_rows``
      the list of ``N`` rows of 784 floats, ``y`` an int64 array of shape ``[N]``.

    Raises:
      ValueError: naming the file and the offending key when the file is not valid
        LEAF JSON.
    """
    path = pathlib.Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text, so not LEAF JSON ({e})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: top level must be a JSON object, got {type(raw).__name__}")
    for key in ("users", "num_samples", "user_data"):
        if key not in raw:
            raise ValueError(f"{path}: missing key '{key}'")
    users, num_samples, user_data = raw["users"], raw["num_samples"], raw["user_data"]
    if not isinstance(users, list) or not isinstance(num_samples, list):
        raise ValueError(f"{path}: 'users' and 'num_samples' must be lists")
    if not isinstance(user_data, dict):
        raise ValueError(f"{path}: 'user_data' must be an object keyed by writer id")
    if len(users) != len(num_samples):
        raise ValueError(
            f"{path}: 'users' has {len(users)} entries but 'num_samples' has {len(num_samples)}"
        )
    for user, count in zip(users, num_samples, strict=True):
        if not isinstance(user, str):
            raise ValueError(
                f"{path}: 'users' must hold writer ids as strings (the keys of 'user_data' "
                f"are JSON strings), got {user!r} ({type(user).__name__})"
            )
        if type(count) is not int or count < 0:
            raise ValueError(
                f"{path}: 'num_samples' must hold non-negative integers, got {count!r} "
                f"({type(count).__name__}) for writer '{user}'"
            )
    if len(set(users)) != len(users):
        raise ValueError(f"{path}: 'users' lists a writer more than once")
    out = {}
    for user, count in zip(users, num_samples, strict=True):
        where = f"{path}: user_data['{user}']"
        if user not in user_data:
            raise ValueError(f"{path}: writer '{user}' is in 'users' but not in 'user_data'")
        entry = user_data[user]
        if not isinstance(entry, dict) or "x" not in entry or "y" not in entry:
            raise ValueError(f"{where} must be an object with keys 'x' and 'y'")
        x, y = entry["x"], entry["y"]
        if not isinstance(x, list) or not isinstance(y, list):
            raise ValueError(f"{where}: 'x' and 'y' must be lists")
        if not (len(x) == len(y) == count):
            raise ValueError(
                f"{where}: 'num_samples' says {count} but len(x) = {len(x)}, len(y) = {len(y)}"
            )
        for r, row in enumerate(x):
            if not isinstance(row, list) or len(row) != IMAGE_SIZE:
                got = len(row) if isinstance(row, list) else type(row).__name__
                raise ValueError(f"{where}['x'][{r}] must have {IMAGE_SIZE} values, got {got}")
        # Integral floats (3.0) are tolerated; bools, strings and 2.5 are not.
        if not all(type(v) is int or (type(v) is float and v.is_integer()) for v in y):
            raise ValueError(f"{where}['y'] must hold integer labels")
        try:
            labels = np.asarray(y, dtype=np.int64).reshape(-1)
        except OverflowError as e:
            raise ValueError(f"{where}['y'] holds a label too large for int64 ({e})") from e
        out[user] = (x, labels)
    # LEAF's split_data.py leaves writers it dropped (fewer than 2 samples) in user_data
    # with empty x and y: those are skipped; an unlisted writer with rows is an error.
    unlisted = [u for u, e in user_data.items() if u not in out and _has_rows(e)]
    if unlisted:
        raise ValueError(
            f"{path}: 'user_data' holds {len(unlisted)} writer(s) with rows that 'users' does "
            f"not list (first: '{unlisted[0]}'); a LEAF shard lists every writer it keeps"
        )
    return out


def _has_rows(entry) -> bool:
    """Whether a ``user_data`` entry holds any sample (``x`` or ``y`` non-empty)."""
    if not isinstance(entry, dict):
        return True
    return bool(entry.get("x")) or bool(entry.get("y"))


def _read_once(path: pathlib.Path) -> dict[str, tuple[list, np.ndarray]]:
    """:func:`read_leaf_file`, parsed once per process while the file's size and
    modification time stay the same (a study draws writers from the same shards once
    per seed; parsing is most of a load). Callers must not modify the result."""
    stat = path.stat()
    return _read_cached(path.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _read_cached(path: pathlib.Path, mtime_ns: int, size: int):
    del mtime_ns, size  # part of the key only
    return read_leaf_file(path)


def _to_pixels(rows: list, where: str, invert: bool) -> np.ndarray:
    # Parsed without a dtype first: numpy would read the strings "0.5" and a lone null
    # or true as numbers; rows of JSON numbers come out integer or float.
    try:
        parsed = np.asarray(rows)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}['x'] must hold numbers ({e})") from e
    if parsed.size and parsed.dtype.kind not in "fiu":
        raise ValueError(
            f"{where}['x'] must hold numbers, found values parsed as {parsed.dtype} "
            "(JSON strings, nulls, or rows of booleans only)"
        )
    x = parsed.astype(np.float32).reshape(len(rows), IMAGE_SIZE)
    if x.size and (not np.all(np.isfinite(x)) or x.min() < 0.0 or x.max() > 1.0):
        raise ValueError(f"{where}['x'] pixel values must lie in [0, 1]")
    return 1.0 - x if invert else x


def _check_load_args(num_clients, min_samples, seed, digits_only, invert) -> tuple[int, int]:
    """:func:`load_leaf`'s scalar arguments checked; ``(num_clients, min_samples)`` as ints."""
    num_clients = check_positive_int("num_clients", num_clients)
    min_samples = check_positive_int("min_samples", min_samples)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int | np.integer)):
        raise TypeError(f"seed must be None or an int, got {seed!r}")
    if seed is not None and seed < 0:
        raise ValueError(f"seed must be >= 0 (numpy.random.default_rng's range), got {seed}")
    for name, value in (("digits_only", digits_only), ("invert", invert)):
        if not isinstance(value, bool | np.bool_):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    return num_clients, min_samples


def _note_test_writers(seen: dict, test_part: dict, test_file: pathlib.Path) -> None:
    """Records the writers of ``test_file`` in ``seen``; a writer already seen in another
    test file is refused (LEAF keeps a writer's test rows in its training shard's pair)."""
    for user in test_part:
        if seen.setdefault(user, test_file) != test_file:
            raise ValueError(
                f"writer '{user}' appears in both {seen[user]} and {test_file}: LEAF keeps a "
                "writer's test rows in the test file of its training shard"
            )


def load_leaf(
    data_dir: str | os.PathLike,
    *,
    num_clients: int = 30,
    min_samples: int = 50,
    digits_only: bool = True,
    seed: int | None = None,
    max_count: int | None = None,
    test_max_count: int | None = None,
    invert: bool = False,
) -> LeafData:
    """Loads LEAF writers as padded federated clients.

    Files: every ``*.json`` in ``data_dir/train`` is a shard; shards are visited in the
    order of the first number in their names (LEAF's shard index), writers in each
    shard's ``users`` order. Each training shard is paired with the test shard of the
    same name with ``train`` replaced by ``test``, and writers are matched by id. A
    process parses each file once (again after it changes size or modification time).

    Selection: a writer is *eligible* when, after the label filter, it has at least
    ``min_samples`` training samples **and at least one test sample** (writers whose
    test split holds no digit cannot be evaluated, so they are excluded rather than
    returned empty). Without ``seed`` the first ``num_clients`` eligible writers are
    taken (and later shards are not read); with ``seed`` a uniform random subset of
    ``num_clients`` eligible writers is drawn with ``numpy.random.default_rng(seed)``
    and kept in file order.

    Args:
      data_dir: folder holding ``train/`` and ``test/``.
      num_clients: number of writers ``n`` to return.
      min_samples: smallest number of (filtered) training samples of an eligible writer.
      digits_only: keep labels ``< 10`` only (10 classes); otherwise all 62 classes.
      seed: if given, choose writers at random among the eligible ones.
      max_count: pad training data to this many rows (for static shapes across
        selections); at least the largest selected writer. Default: that largest count.
      test_max_count: the same for test data.
      invert: return ``1 - x`` so that ink is 1 and background 0 (MNIST convention).
        The default keeps LEAF's own values (background 1.0).

    Returns:
      A :class:`LeafData` with ``x`` float32 in ``[0, 1]`` and int32 labels.

    Raises:
      ValueError: on a missing folder, malformed or unpaired files (the message names
        the file and key), a training writer without test data, a writer in two test
        files, fewer eligible writers than ``num_clients``, or counts below 1 / a
        negative ``seed``.
      TypeError: ``num_clients``, ``min_samples`` or ``seed`` not integers,
        ``digits_only`` or ``invert`` not booleans.
    """
    num_clients, min_samples = _check_load_args(num_clients, min_samples, seed, digits_only, invert)
    root = pathlib.Path(data_dir)
    train_dir, test_dir = root / "train", root / "test"
    for d in (train_dir, test_dir):
        if not d.is_dir():
            raise ValueError(f"data_dir: LEAF folder {d} not found (expected train/ and test/)")
    train_files = sorted(train_dir.glob("*.json"), key=_file_index)
    if not train_files:
        raise ValueError(f"data_dir: no .json files in {train_dir}")
    num_classes = _NUM_DIGITS if digits_only else _NUM_CLASSES

    # eligible: (writer, train file, train rows, train labels, test file, test rows, test labels)
    eligible = []
    seen, seen_test = {}, {}
    for train_file in train_files:
        test_file = _counterpart(train_file, test_dir)
        train_part = _read_once(train_file)
        test_part = _read_once(test_file)
        _note_test_writers(seen_test, test_part, test_file)
        for user, (x_rows, y) in train_part.items():
            if user in seen:
                raise ValueError(f"writer '{user}' appears in both {seen[user]} and {train_file}")
            seen[user] = train_file
            if user not in test_part:
                raise ValueError(
                    f"writer '{user}' of {train_file} has no entry in its test file {test_file}"
                )
            for name, labels, f in (
                ("train", y, train_file),
                ("test", test_part[user][1], test_file),
            ):
                if labels.size and (labels.min() < 0 or labels.max() >= _NUM_CLASSES):
                    raise ValueError(
                        f"{f}: user_data['{user}']['y'] ({name}) has labels outside "
                        f"[0, {_NUM_CLASSES})"
                    )
            tx_rows, ty = test_part[user]
            keep = y < num_classes
            tkeep = ty < num_classes
            if int(keep.sum()) >= min_samples and int(tkeep.sum()) >= 1:
                eligible.append((user, train_file, x_rows, y, keep, test_file, tx_rows, ty, tkeep))
        if seed is None and len(eligible) >= num_clients:
            break  # the first num_clients eligible writers are known; skip the rest
    if len(eligible) < num_clients:
        what = "digit " if digits_only else ""
        raise ValueError(
            f"num_clients={num_clients} but only {len(eligible)} writers in {root} have at "
            f"least min_samples={min_samples} {what}training samples and a {what}test sample"
        )
    if seed is None:
        chosen = list(range(num_clients))
    else:
        rng = np.random.default_rng(seed)
        chosen = sorted(rng.choice(len(eligible), size=num_clients, replace=False).tolist())

    writers, xs, ys, txs, tys = [], [], [], [], []
    for k in chosen:
        user, f, x_rows, y, keep, tf, tx_rows, ty, tkeep = eligible[k]
        x = _to_pixels(x_rows, f"{f}: user_data['{user}']", invert)
        tx = _to_pixels(tx_rows, f"{tf}: user_data['{user}']", invert)
        writers.append(user)
        xs.append(x[keep])
        ys.append(y[keep].astype(np.int32))
        txs.append(tx[tkeep])
        tys.append(ty[tkeep].astype(np.int32))
    train = from_client_arrays(xs, ys, num_classes=num_classes, max_count=max_count)
    test = from_client_arrays(txs, tys, num_classes=num_classes, max_count=test_max_count)
    return LeafData(train, test, writers)
