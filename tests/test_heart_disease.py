"""UCI heart disease loader: preprocessing, split, leakage-free standardization, errors."""

import csv
import shutil

import numpy as np
import pytest
from _tolerances import EPS32

from karula_jax.data import HeartDiseaseData, load_heart_disease
from karula_jax.data.heart_disease import ENCODINGS, HOSPITALS, read_heart_disease_file

EXPECTED_ROWS = {"cleveland": 303, "hungarian": 261, "switzerland": 46, "va": 130}


@pytest.fixture(scope="module")
def heart_dir(shared_data_dir):
    return shared_data_dir / "heart_disease"


def _csv_reference(path):
    """Independent parse with the csv module: rows complete outside columns 11-13."""
    feats, labels = [], []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            kept = row[:10] + row[13:]
            if "?" in kept:
                continue
            feats.append([float(v) for v in kept[:10]])
            labels.append(int(float(kept[10]) > 0))
    return np.asarray(feats), np.asarray(labels)


@pytest.mark.parametrize("hospital", HOSPITALS)
def test_rows_after_preprocessing(heart_dir, hospital):
    feats, labels = read_heart_disease_file(heart_dir / f"processed.{hospital}.data")
    assert feats.shape == (EXPECTED_ROWS[hospital], 10)
    ref_feats, ref_labels = _csv_reference(heart_dir / f"processed.{hospital}.data")
    np.testing.assert_array_equal(feats, ref_feats)
    np.testing.assert_array_equal(labels, ref_labels)


@pytest.fixture(scope="module")
def heart(heart_dir):
    return load_heart_disease(heart_dir)


def _real(part, i):
    n = int(part.counts[i])
    return np.asarray(part.x[i, :n]), np.asarray(part.y[i, :n])


def test_split_sizes_and_label_balance(heart, heart_dir):
    assert isinstance(heart, HeartDiseaseData)
    assert heart.hospitals == list(HOSPITALS)
    assert heart.train.x.shape[2] == 13 == len(heart.feature_names)  # FLamby's count
    assert heart.train.y.dtype == np.int32
    for i, h in enumerate(HOSPITALS):
        _, y_all = read_heart_disease_file(heart_dir / f"processed.{h}.data")
        _, ytr = _real(heart.train, i)
        _, yte = _real(heart.test, i)
        assert len(ytr) + len(yte) == EXPECTED_ROWS[h]
        # Stratified: each class sends round(0.25 * count) rows to the test set.
        for c in (0, 1):
            assert np.sum(yte == c) == round(0.25 * np.sum(y_all == c))
            assert np.sum(ytr == c) + np.sum(yte == c) == np.sum(y_all == c)
    ytr_all = np.asarray(heart.train.y)[np.asarray(heart.train.mask)]
    yte_all = np.asarray(heart.test.y)[np.asarray(heart.test.mask)]
    assert len(ytr_all) + len(yte_all) == 740
    # 383 of the 740 rows are positive (139 / 98 / 45 / 101): the stratified splits keep
    # that rate within a row per class and hospital.
    positives = sum(_csv_reference(heart_dir / f"processed.{h}.data")[1].sum() for h in HOSPITALS)
    assert positives == 383
    rate = positives / 740
    # a set's rate moves by its rows' rounding over its size: each of the 4 hospitals' 2
    # classes rounds its test count by half a row, 2 rows of a class in all (0.011 for the
    # test set, 0.0036 for the training set; they were 0.02 and 0.01)
    off = 0.5 * len(HOSPITALS)
    assert abs(ytr_all.mean() - rate) <= off / len(ytr_all)
    assert abs(yte_all.mean() - rate) <= off / len(yte_all)


def test_standardization_fitted_on_pooled_training_rows(heart):
    x = np.asarray(heart.train.x)[np.asarray(heart.train.mask)].astype(np.float64)
    onehot = np.array(["=" in n for n in heart.feature_names])
    # fitted in float64, stored in float32: each value rounds by EPS32 / 2 of its size, and
    # so can their mean and standard deviation (the fit's float64 error is 1e-12)
    atol = EPS32 * np.abs(x[:, ~onehot]).max()
    np.testing.assert_allclose(x[:, ~onehot].mean(axis=0), 0.0, atol=atol)
    np.testing.assert_allclose(x[:, ~onehot].std(axis=0), 1.0, atol=atol)
    # Indicator columns stay indicators, at most one level per categorical variable (none
    # for the reference level, the first).
    assert set(np.unique(x[:, onehot])) == {0.0, 1.0}
    for var, levels in (("cp", 4), ("restecg", 3)):
        cols = [j for j, n in enumerate(heart.feature_names) if n.startswith(var + "=")]
        assert len(cols) == levels - 1
        assert x[:, cols].sum(axis=1).max() == 1.0
        assert (x[:, cols].sum(axis=1) == 0).any()  # the reference level occurs
    # Test rows are not standardized by themselves (their own mean is not exactly 0).
    xt = np.asarray(heart.test.x)[np.asarray(heart.test.mask)]
    assert np.abs(xt[:, ~onehot].mean(axis=0)).max() > 1e-3  # 1e4 times the rounding above


def test_same_affine_map_for_train_and_test(heart, heart_dir):
    # Within each hospital, standardized ages (train and test together) are one affine
    # function of the raw ages, with the same slope in every hospital.
    j = heart.feature_names.index("age")
    slopes, slack = [], []
    for i, h in enumerate(HOSPITALS):
        raw = np.sort(read_heart_disease_file(heart_dir / f"processed.{h}.data")[0][:, 0])
        std = np.sort(
            np.concatenate([_real(heart.train, i)[0][:, j], _real(heart.test, i)[0][:, j]])
        )
        a, b = np.polyfit(raw, std, 1)
        # the standardized ages hold float32 rounding, delta <= EPS32 / 2 |std| each; a
        # least-squares line through them moves a fitted value by at most delta times the
        # hat matrix's row sum, 1 + |r_i - mean r| sum_j |r_j - mean r| / S_rr, and the
        # slope by delta sum_j |r_j - mean r| / S_rr (float64 adds 1e-15)
        delta = EPS32 / 2 * np.abs(std).max()
        dev = np.abs(raw - raw.mean())
        s_rr = np.sum(dev**2)
        atol = delta * (2 + dev.max() * dev.sum() / s_rr)
        np.testing.assert_allclose(a * raw + b, std, atol=atol)
        slopes.append(a)
        slack.append(delta * dev.sum() / s_rr)
    gap = np.abs(np.array(slopes) - slopes[0])
    assert np.all(gap <= np.array(slack) + slack[0]), (slopes, slack)


def _modify_row(src, dst, hospital, row, column, value):
    shutil.copytree(src, dst)
    path = dst / f"processed.{hospital}.data"
    path.chmod(0o644)
    lines = path.read_text().splitlines()
    fields = lines[row].split(",")
    fields[column] = value
    lines[row] = ",".join(fields)
    path.write_text("\n".join(lines) + "\n")


def test_no_leakage_from_test_rows(heart, heart_dir, tmp_path):
    # The split depends on labels and seed only, so changing a feature keeps every row on
    # its side. A test row's change must leave all training data (hence the fitted
    # standardization) untouched; a training row's change must move it.
    seen = {"test": False, "train": False}
    for row in range(12):
        d = tmp_path / f"r{row}"
        _modify_row(heart_dir, d, "cleveland", row, 4, "900.0")  # chol
        out = load_heart_disease(d)
        np.testing.assert_array_equal(out.train.counts, heart.train.counts)
        same_train = np.array_equal(np.asarray(out.train.x), np.asarray(heart.train.x))
        if same_train:
            seen["test"] = True
            diff = np.asarray(out.test.x) != np.asarray(heart.test.x)
            j = out.feature_names.index("chol")
            assert diff.sum() == 1 and diff[0, :, j].sum() == 1
        else:
            seen["train"] = True
            diff = np.asarray(out.train.x) != np.asarray(heart.train.x)
            # Refitting chol's mean and std moves that column in every real row, train and test.
            j = out.feature_names.index("chol")
            assert diff[..., j][np.asarray(heart.train.mask)].all()
            assert not np.delete(diff, j, axis=2).any()
    assert seen["test"] and seen["train"]


def test_options_and_seed(heart_dir, heart):
    raw = load_heart_disease(heart_dir, categorical="codes")
    assert raw.feature_names == [
        "age", "sex", "cp", "trestbps", "chol", "fbs", "restecg", "thalach", "exang", "oldpeak",
    ]  # fmt: skip
    np.testing.assert_array_equal(raw.train.counts, heart.train.counts)
    full = load_heart_disease(heart_dir, categorical="one_hot")
    assert len(full.feature_names) == ENCODINGS["one_hot"]
    # the reference coding is the full one-hot coding without the first level's columns,
    # and the first level's indicator is one minus the others'
    keep = [full.feature_names.index(name) for name in heart.feature_names]
    np.testing.assert_array_equal(np.asarray(full.train.x)[..., keep], np.asarray(heart.train.x))
    mask = np.asarray(full.train.mask)
    for var, first in (("cp", "cp=1"), ("restecg", "restecg=0")):
        cols = [j for j, n in enumerate(full.feature_names) if n.startswith(var + "=")]
        x = np.asarray(full.train.x)[mask]
        j = full.feature_names.index(first)
        np.testing.assert_array_equal(x[:, j], 1.0 - x[:, [c for c in cols if c != j]].sum(1))
    with pytest.raises(ValueError, match="categorical must be one of"):
        load_heart_disease(heart_dir, categorical="dummies")
    again = load_heart_disease(heart_dir)
    np.testing.assert_array_equal(np.asarray(again.test.x), np.asarray(heart.test.x))
    other = load_heart_disease(heart_dir, seed=1)
    assert not np.array_equal(np.asarray(other.test.x), np.asarray(heart.test.x))
    half = load_heart_disease(heart_dir, test_fraction=0.5)
    assert int(half.test.counts.sum()) > int(heart.test.counts.sum())


def test_bad_arguments_and_missing_files(heart_dir, tmp_path):
    with pytest.raises(ValueError, match="test_fraction"):
        load_heart_disease(heart_dir, test_fraction=1.0)
    with pytest.raises(TypeError, match="test_fraction"):
        load_heart_disease(heart_dir, test_fraction="a")
    with pytest.raises(ValueError, match="leaves hospital switzerland"):
        load_heart_disease(heart_dir, test_fraction=0.01)
    with pytest.raises(ValueError, match="folder .* not found"):
        load_heart_disease(tmp_path / "nope")
    shutil.copytree(heart_dir, tmp_path / "h")
    (tmp_path / "h" / "processed.va.data").unlink()
    with pytest.raises(ValueError, match="processed.va.data not found"):
        load_heart_disease(tmp_path / "h")


@pytest.mark.parametrize(
    "column, value, message",
    [
        (None, None, "expected 14 comma-separated columns, got 13"),
        (0, "abc", r"line 3, column 1 \(age\): expected a number or '\?', got 'abc'"),
        (13, "5", r"column 14 \(num\) must hold diagnoses 0-4"),
        (2, "7", r"column 3 \(cp\) must be one of \(1, 2, 3, 4\), got 7.0"),
        (1, "0.5", r"column 2 \(sex\) must be one of \(0, 1\)"),
        (3, "inf", "not finite"),
    ],
)
def test_malformed_file(heart_dir, tmp_path, column, value, message):
    if column is None:
        shutil.copytree(heart_dir, tmp_path / "h")
        path = tmp_path / "h" / "processed.hungarian.data"
        path.chmod(0o644)
        lines = path.read_text().splitlines()
        lines[2] = lines[2].rsplit(",", 1)[0]
        path.write_text("\n".join(lines) + "\n")
    else:
        _modify_row(heart_dir, tmp_path / "h", "hungarian", 2, column, value)
        path = tmp_path / "h" / "processed.hungarian.data"
    with pytest.raises(ValueError, match=message) as err:
        load_heart_disease(tmp_path / "h")
    assert "processed.hungarian.data" in str(err.value)
