"""LEAF JSON loader: small hand-written shards and the real FEMNIST folder."""

import json

import numpy as np
import pytest
from _tolerances import EPS32

from karula_jax.data import LeafData, load_leaf
from karula_jax.data.leaf import IMAGE_SIZE, read_leaf_file


def _writer(rng, labels):
    x = rng.uniform(0.0, 1.0, size=(len(labels), IMAGE_SIZE)).round(3)
    return {"x": x.tolist(), "y": [int(v) for v in labels]}


def _shard(writers):
    return {
        "users": list(writers),
        "num_samples": [len(w["y"]) for w in writers.values()],
        "user_data": writers,
    }


def _write_leaf(root, train_shards, test_shards, names=None):
    """Writes shards ``{index: {writer: {"x", "y"}}}`` under root/train and root/test."""
    (root / "train").mkdir(parents=True, exist_ok=True)
    (root / "test").mkdir(parents=True, exist_ok=True)
    for i, shard in train_shards.items():
        name = f"all_data_{i}_niid_05_keep_0_train_9.json"
        (root / "train" / name).write_text(json.dumps(_shard(shard)))
    for i, shard in test_shards.items():
        name = f"all_data_{i}_niid_05_keep_0_test_9.json"
        (root / "test" / name).write_text(json.dumps(_shard(shard)))


@pytest.fixture
def small_leaf(tmp_path):
    """Two shards (indices 2 and 10, so numeric order differs from name order)."""
    rng = np.random.default_rng(0)
    # Numeric order puts shard 2 before shard 10; name order would do the reverse.
    train = {
        10: {
            "w_a": _writer(rng, [0, 1, 2, 3, 40, 50]),  # 4 digits
            "w_b": _writer(rng, [5, 5, 5]),  # 3 digits
        },
        2: {
            "w_c": _writer(rng, [9, 8, 7, 6, 11]),  # 4 digits
            "w_d": _writer(rng, [12, 13, 14, 1, 2]),  # 2 digits
            "w_e": _writer(rng, [0, 0, 0, 0, 0, 0]),  # 6 digits, but no digit in test
        },
    }
    test = {
        10: {"w_a": _writer(rng, [4, 30]), "w_b": _writer(rng, [5, 6])},
        2: {
            "w_c": _writer(rng, [1]),
            "w_d": _writer(rng, [3, 20]),
            "w_e": _writer(rng, [20, 21]),
        },
    }
    _write_leaf(tmp_path, train, test)
    return tmp_path, train, test


def _digits(entry):
    y = np.asarray(entry["y"])
    keep = y < 10
    return np.asarray(entry["x"], dtype=np.float32)[keep], y[keep]


def test_small_leaf_first_writers_in_file_order(small_leaf):
    root, train, test = small_leaf
    out = load_leaf(root, num_clients=3, min_samples=2)
    assert isinstance(out, LeafData)
    # Shard 2 before shard 10; w_e is excluded (no digit test sample).
    assert out.writers == ["w_c", "w_d", "w_a"]
    shards = {"w_c": 2, "w_d": 2, "w_a": 10}
    np.testing.assert_array_equal(out.train.counts, [4, 2, 4])
    np.testing.assert_array_equal(out.test.counts, [1, 1, 1])
    assert out.train.x.shape == (3, 4, IMAGE_SIZE) and out.train.x.dtype == np.float32
    assert out.train.y.dtype == np.int32
    for i, w in enumerate(out.writers):
        x, y = _digits(train[shards[w]][w])
        n = len(y)
        # pixels in [0, 1] stored in float32: EPS32 / 2 at most, twice over
        np.testing.assert_allclose(np.asarray(out.train.x[i, :n]), x, atol=EPS32)
        np.testing.assert_array_equal(np.asarray(out.train.y[i, :n]), y)
        assert np.all(np.asarray(out.train.x[i, n:]) == 0)
        tx, ty = _digits(test[shards[w]][w])
        np.testing.assert_allclose(np.asarray(out.test.x[i, : len(ty)]), tx, atol=EPS32)
        np.testing.assert_array_equal(np.asarray(out.test.y[i, : len(ty)]), ty)


def test_small_leaf_all_classes_invert_and_padding(small_leaf):
    root, train, _ = small_leaf
    out = load_leaf(root, num_clients=2, min_samples=5, digits_only=False, invert=True)
    assert out.writers == ["w_c", "w_d"]
    np.testing.assert_array_equal(out.train.counts, [5, 5])
    np.testing.assert_array_equal(np.asarray(out.train.y[1]), [12, 13, 14, 1, 2])
    x_raw = np.asarray(train[2]["w_c"]["x"], dtype=np.float32)
    # 1 - x of pixels in [0, 1]: the storage's and the subtraction's float32 roundings
    np.testing.assert_allclose(np.asarray(out.train.x[0]), 1.0 - x_raw, atol=EPS32)
    padded = load_leaf(
        root, num_clients=2, min_samples=5, digits_only=False, max_count=9, test_max_count=4
    )
    assert padded.train.x.shape == (2, 9, IMAGE_SIZE) and padded.test.x.shape == (2, 4, IMAGE_SIZE)
    with pytest.raises(ValueError, match="max_count"):
        load_leaf(root, num_clients=2, min_samples=2, max_count=3)


def test_small_leaf_seeded_choice(small_leaf):
    root, _, _ = small_leaf
    eligible = ["w_c", "w_d", "w_a", "w_b"]  # file order, min_samples=2
    picks = {
        tuple(load_leaf(root, num_clients=2, min_samples=2, seed=s).writers) for s in range(12)
    }
    for p in picks:
        assert set(p) <= set(eligible) and len(set(p)) == 2
        assert list(p) == sorted(p, key=eligible.index)  # kept in file order
    assert len(picks) > 1  # the seed changes the choice
    a = load_leaf(root, num_clients=2, min_samples=2, seed=3)
    b = load_leaf(root, num_clients=2, min_samples=2, seed=3)
    assert a.writers == b.writers


def test_a_file_is_parsed_once_and_again_after_it_changes(small_leaf, monkeypatch):
    root, train, test = small_leaf
    from karula_jax.data import leaf

    calls = []
    real = leaf.read_leaf_file
    monkeypatch.setattr(leaf, "read_leaf_file", lambda path: calls.append(path) or real(path))
    leaf._read_cached.cache_clear()
    first = load_leaf(root, num_clients=4, min_samples=1, seed=0)
    assert len(calls) == 4  # two train and two test shards
    again = load_leaf(root, num_clients=2, min_samples=1, seed=3)
    assert len(calls) == 4 and again.train.x.shape[0] == 2
    # a rewritten shard (new size and time) is read anew, and its new values are used
    rng = np.random.default_rng(1)
    train[2]["w_c"] = _writer(rng, [9, 8, 7, 6, 11, 3])
    _write_leaf(root, train, test)  # rewrites every shard: all four are read again
    changed = load_leaf(root, num_clients=4, min_samples=1, seed=0)
    assert len(calls) == 8
    assert changed.train.counts.tolist() != first.train.counts.tolist()


def test_small_leaf_too_few_eligible(small_leaf):
    root, _, _ = small_leaf
    with pytest.raises(ValueError, match="num_clients=5 but only 4 writers"):
        load_leaf(root, num_clients=5, min_samples=2)
    with pytest.raises(ValueError, match="num_clients"):
        load_leaf(root, num_clients=0)
    with pytest.raises(ValueError, match="min_samples"):
        load_leaf(root, min_samples=0)


def test_missing_folders(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_leaf(tmp_path / "nope")
    (tmp_path / "train").mkdir()
    with pytest.raises(ValueError, match="test.*not found"):
        load_leaf(tmp_path)
    (tmp_path / "test").mkdir()
    with pytest.raises(ValueError, match="no .json files"):
        load_leaf(tmp_path)


def test_unpaired_train_file(tmp_path):
    rng = np.random.default_rng(1)
    _write_leaf(tmp_path, {0: {"w": _writer(rng, [1, 2])}}, {1: {"w": _writer(rng, [1])}})
    with pytest.raises(ValueError, match="no matching test file"):
        load_leaf(tmp_path, num_clients=1, min_samples=1)


def test_writer_missing_from_test(tmp_path):
    rng = np.random.default_rng(1)
    _write_leaf(tmp_path, {0: {"w": _writer(rng, [1, 2])}}, {0: {"v": _writer(rng, [1])}})
    with pytest.raises(ValueError, match="writer 'w' .* no entry in its test file"):
        load_leaf(tmp_path, num_clients=1, min_samples=1)


def _valid_raw(rng):
    return _shard({"w": _writer(rng, [1, 2, 3]), "v": _writer(rng, [4])})


def _drop(key):
    def f(raw):
        del raw[key]

    return f


MALFORMED = {
    "missing users": (_drop("users"), "missing key 'users'"),
    "missing num_samples": (_drop("num_samples"), "missing key 'num_samples'"),
    "missing user_data": (_drop("user_data"), "missing key 'user_data'"),
    "users vs num_samples": (
        lambda r: r["num_samples"].append(3),
        "'users' has 2 entries but 'num_samples' has 3",
    ),
    "num_samples vs x": (
        lambda r: r["user_data"]["w"]["x"].pop(),
        r"user_data\['w'\]: 'num_samples' says 3 but len\(x\) = 2, len\(y\) = 3",
    ),
    "num_samples vs y": (
        lambda r: r["num_samples"].__setitem__(1, 2),
        r"user_data\['v'\]: 'num_samples' says 2 but len\(x\) = 1",
    ),
    "row length": (
        lambda r: r["user_data"]["w"]["x"][1].pop(),
        r"user_data\['w'\]\['x'\]\[1\] must have 784 values, got 783",
    ),
    "non-integer label": (
        lambda r: r["user_data"]["v"]["y"].__setitem__(0, 2.5),
        r"user_data\['v'\]\['y'\] must hold integer labels",
    ),
    "string label": (
        lambda r: r["user_data"]["v"]["y"].__setitem__(0, "4"),
        "must hold integer labels",
    ),
    "writer without data": (
        lambda r: r["user_data"].pop("v"),
        "writer 'v' is in 'users' but not in 'user_data'",
    ),
    "missing y": (
        lambda r: r["user_data"]["w"].pop("y"),
        r"user_data\['w'\] must be an object with keys 'x' and 'y'",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_file_raises(tmp_path, case):
    mutate, message = MALFORMED[case]
    raw = _valid_raw(np.random.default_rng(2))
    mutate(raw)
    path = tmp_path / "bad_train.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=message) as err:
        read_leaf_file(path)
    assert "bad_train.json" in str(err.value)


def test_malformed_values_and_json(tmp_path):
    rng = np.random.default_rng(3)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json: not valid JSON"):
        read_leaf_file(tmp_path / "broken.json")
    # Malformed data reached through load_leaf: pixels outside [0, 1] and labels above 61.
    bad = _writer(rng, [1, 2])
    bad["x"][0][5] = 3.0
    _write_leaf(tmp_path / "a", {0: {"w": bad}}, {0: {"w": _writer(rng, [1])}})
    with pytest.raises(ValueError, match=r"train_9.json: user_data\['w'\]\['x'\] pixel values"):
        load_leaf(tmp_path / "a", num_clients=1, min_samples=1)
    _write_leaf(tmp_path / "b", {0: {"w": _writer(rng, [1, 62])}}, {0: {"w": _writer(rng, [1])}})
    with pytest.raises(ValueError, match="labels outside"):
        load_leaf(tmp_path / "b", num_clients=1, min_samples=1)


# ---------------------------------------------------------------- real FEMNIST folder


@pytest.fixture(scope="module")
def femnist_all(shared_data_dir):
    return load_leaf(shared_data_dir / "femnist", num_clients=54)


def test_femnist_eligible_writers_and_totals(shared_data_dir, femnist_all):
    # ../shared/data/README.md: 54 writers with >= 50 digit training samples, 5,346 digit
    # training samples in all (the 9 other writers hold 102 between them).
    out = femnist_all
    assert len(out.writers) == 54 and len(set(out.writers)) == 54
    counts = np.asarray(out.train.counts)
    assert counts.min() >= 50
    assert out.train.x.shape == (54, counts.max(), IMAGE_SIZE)
    assert out.test.x.shape == (54, int(out.test.counts.max()), IMAGE_SIZE)
    assert int(np.asarray(out.test.counts).min()) >= 1
    with pytest.raises(ValueError, match="only 54 writers"):
        load_leaf(shared_data_dir / "femnist", num_clients=55)
    # min_samples=1 admits every writer with a digit in both splits: 59 of the 63 (the other
    # 4 hold no digit at all), so all 5,346 digit training samples come back.
    everyone = load_leaf(shared_data_dir / "femnist", num_clients=59, min_samples=1)
    assert int(np.asarray(everyone.train.counts).sum()) == 5346
    assert set(out.writers) == {
        w
        for w, c in zip(everyone.writers, np.asarray(everyone.train.counts), strict=True)
        if c >= 50
    }
    with pytest.raises(ValueError, match="only 59 writers"):
        load_leaf(shared_data_dir / "femnist", num_clients=60, min_samples=1)


def test_femnist_values_and_labels(femnist_all):
    out = femnist_all
    for part in (out.train, out.test):
        x, y, mask = np.asarray(part.x), np.asarray(part.y), np.asarray(part.mask)
        assert x.dtype == np.float32 and y.dtype == np.int32
        assert x.min() >= 0.0 and x.max() <= 1.0
        assert y[mask].min() >= 0 and y[mask].max() <= 9
        assert np.all(x[~mask] == 0) and np.all(y[~mask] == 0)
        # LEAF convention: white background, so most pixels of a real image are ~1.
        assert np.median(x[mask]) > 0.9
    assert len(np.unique(np.asarray(out.train.y)[np.asarray(out.train.mask)])) == 10


def test_femnist_default_is_first_30_eligible(shared_data_dir, femnist_all):
    first = load_leaf(shared_data_dir / "femnist")
    assert first.writers == femnist_all.writers[:30]
    np.testing.assert_array_equal(first.train.counts, femnist_all.train.counts[:30])
    picked = load_leaf(shared_data_dir / "femnist", num_clients=5, seed=0, invert=True)
    idx = [femnist_all.writers.index(w) for w in picked.writers]
    assert idx == sorted(idx)
    for i, j in enumerate(idx):
        n = int(picked.train.counts[i])
        assert n == int(femnist_all.train.counts[j])
        # inverted pixels in [0, 1]: one float32 rounding each side (was rtol 1e-7, of a
        # value that can be near 0)
        np.testing.assert_allclose(
            np.asarray(picked.train.x[i, :n]),
            1.0 - np.asarray(femnist_all.train.x[j, :n]),
            rtol=0,
            atol=EPS32,
        )


def test_writer_in_two_test_files_is_refused(tmp_path):
    """Another writer's layout: a writer's test rows split over two test shards. LEAF keeps
    them in the test file of the writer's training shard; rows elsewhere were dropped
    without a word, now the load names both files."""
    rng = np.random.default_rng(1)
    train = {0: {"u1": _writer(rng, [1, 2, 3])}, 1: {"u2": _writer(rng, [4, 5, 6])}}
    test = {
        0: {"u1": _writer(rng, [1]), "u2": _writer(rng, [4])},
        1: {"u2": _writer(rng, [5, 6])},
    }
    _write_leaf(tmp_path, train, test)
    with pytest.raises(ValueError, match=r"writer 'u2' appears in both .*_0_.*test.* and .*_1_"):
        load_leaf(tmp_path, num_clients=2, min_samples=1, seed=0)


def test_numpy_integer_counts_are_accepted(small_leaf):
    root, _, _ = small_leaf
    a = load_leaf(root, num_clients=np.int64(2), min_samples=np.int32(2), seed=np.int64(1))
    b = load_leaf(root, num_clients=2, min_samples=2, seed=1)
    assert a.writers == b.writers
    np.testing.assert_array_equal(a.train.x, b.train.x)


def test_unlisted_empty_writer_is_skipped(tmp_path):
    """LEAF's split_data.py leaves the writers it drops in user_data with empty x and y:
    such a shard loads, the empty writer skipped."""
    rng = np.random.default_rng(2)
    _write_leaf(tmp_path, {0: {"u1": _writer(rng, [1, 2])}}, {0: {"u1": _writer(rng, [3])}})
    for split in ("train", "test"):
        f = next((tmp_path / split).glob("*.json"))
        raw = json.loads(f.read_text())
        raw["user_data"]["dropped"] = {"x": [], "y": []}
        f.write_text(json.dumps(raw))
    assert load_leaf(tmp_path, num_clients=1, min_samples=1).writers == ["u1"]
