"""Bad input across the public API: a clear ValueError/TypeError that names the argument.

``CASES`` is one table over every subpackage: ``(id, call, exception type, regex)``. ``call``
takes pytest's ``tmp_path`` (for files) and makes ONE bad call; the test asserts the type
and that the message matches the regex, which always names the offending argument.
The tests after the table check each class of fix of
issue 11 on its own (ClientData validation, casts, subsets, empty clients, decoding), then
those of issue 27: arguments that reach a factory traced (every argument ``protocol``
passes through ``run_many``, for every method of its suite), a classifier's labels
against its logits, the order of causes in the non-finite report, a checkpoint of another
algorithm, missing output folders, submodules as attributes, one unstacked model.

Shapes are tiny. Most errors are raised before anything is compiled (at most one abstract
trace of a loss); the rest need a small program (the traced-argument checks, a compiled
init, one Sinkhorn solve, one one-round run), so the file runs in well under a minute.
"""

from __future__ import annotations

import functools
import json
import pathlib
import pkgutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerances import reordered_sum
from hypothesis import given, settings
from hypothesis import strategies as st

import karula_jax as kj
from karula_jax import benchmarking, embedding, models, projection, protocol, reporting, training
from karula_jax.algorithms import (
    fedavg,
    fedsgd,
    ifca,
    karula,
    laplacian_penalty,
    lipschitz_ridge,
    local,
    pfedme,
)
from karula_jax.data import ClientData, client_weights, from_client_arrays, synthetic_ridge
from karula_jax.data.heart_disease import load_heart_disease, read_heart_disease_file
from karula_jax.data.leaf import IMAGE_SIZE, load_leaf, read_leaf_file

KEY = jax.random.key(0)
N, NMAX, DIM = 3, 4, 2
DATA = from_client_arrays(
    [np.arange(2 * DIM, dtype=float).reshape(2, DIM), np.ones((4, DIM)), -np.ones((3, DIM))],
    [np.ones(2), np.zeros(4), np.ones(3)],
)
X, Y, COUNTS = DATA
LOSS = models.ridge_loss(0.1)
THETA = jnp.zeros(DIM)
D = jnp.ones((N, N)) - jnp.eye(N)
HP = {"learning_rate": 0.1, "clients_per_round": 2, "batch_size": 2}
HP_NO_RATE = {"clients_per_round": 2, "batch_size": 2}
ALGOS = {
    "karula": lambda **kw: karula(LOSS, D, **{"t": 1.0, **HP, **kw}),
    "local": lambda **kw: local(LOSS, learning_rate=0.1, batch_size=2, **kw),
    "fedsgd": lambda **kw: fedsgd(LOSS, **{**HP, **kw}),
    "fedavg": lambda **kw: fedavg(LOSS, **{**HP, **kw}),
    "ifca": lambda **kw: ifca(LOSS, num_clusters=2, **{**HP, **kw}),
    "pfedme": lambda **kw: pfedme(LOSS, **{**HP, **kw}),
}
JOINT = jnp.ones((N, NMAX, DIM + 1))
LABELS_0_9 = DATA._replace(y=jnp.array([[0, 1, 0, 0], [2, 8, 9, 7], [3, 4, 5, 0]], jnp.int32))
LOCAL = local(LOSS, learning_rate=0.1, batch_size=2)  # one object: its programs are cached
REF = jnp.zeros((5, DIM + 1))


# --------------------------------------------------------------------------- file helpers


def _leaf_raw(**changes):
    row = [0.5] * IMAGE_SIZE
    raw = {
        "users": ["w"],
        "num_samples": [2],
        "user_data": {"w": {"x": [row, list(row)], "y": [1, 2]}},
    }
    raw.update(changes)
    return raw


def _leaf_file(tmp_path, content, name="bad_train.json") -> pathlib.Path:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def _leaf_dir(tmp_path, train_writer) -> pathlib.Path:
    """A LEAF folder with one shard pair whose training writer ``w`` is ``train_writer``."""
    good = {"x": [[0.5] * IMAGE_SIZE], "y": [1]}
    for split, writer in (("train", train_writer), ("test", good)):
        (tmp_path / split).mkdir(parents=True, exist_ok=True)
        shard = {"users": ["w"], "num_samples": [len(writer["y"])], "user_data": {"w": writer}}
        (tmp_path / split / f"all_data_0_{split}_9.json").write_text(json.dumps(shard))
    return tmp_path


def _writer_with(value):
    row = [0.5] * IMAGE_SIZE
    row[3] = value
    return {"x": [row], "y": [1]}


_HEART_ROW = "63.0,1.0,1.0,145.0,233.0,1.0,2.0,150.0,0.0,2.3,3.0,0.0,6.0,0"


def _heart_file(tmp_path, content) -> pathlib.Path:
    path = tmp_path / "processed.cleveland.data"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def _one_round_state():
    """A local-training state of the 3-client data (no compilation: init only)."""
    alg = local(LOSS, learning_rate=0.1, batch_size=2)
    return alg, alg.init(THETA, DATA, key=KEY)


def _mlp_params(input_dim):
    return models.init_params(models.mlp(hidden=3, num_classes=2), KEY, (1, input_dim))


def _garbage_checkpoint(p):
    path = p / "checkpoint.npz"
    path.write_bytes(b"not a checkpoint")
    return training.load_checkpoint(path, {"a": jnp.zeros(2)})


def _checkpoint_bad_meta(p):
    path = p / "checkpoint.npz"
    np.savez(path, meta=np.array("{not json"))
    return training.load_checkpoint(path, {"a": jnp.zeros(2)})


def _checkpoint_of_fedavg(p):
    path = p / "checkpoint.npz"
    meta = {"algorithm_name": "fedavg"}
    training.save_checkpoint(path, {"a": jnp.zeros(2)}, rounds_done=1, extra_meta=meta)
    return training.load_checkpoint(path, {"b": jnp.zeros(3)}, algorithm="karula")


# --------------------------------------------------------------------------- the table

# (id, call(tmp_path), exception, regex naming the argument)
CASES = [
    # ---- data: ClientData built directly
    ("ClientData counts > N_max", lambda p: ClientData(X, Y, jnp.array([2, 5, 3])), ValueError,
     r"counts must lie in \[0, N_max=4\]"),
    ("ClientData negative counts", lambda p: ClientData(X, Y, jnp.array([2, -1, 3])), ValueError,
     "counts must lie in"),
    ("ClientData float counts", lambda p: ClientData(X, Y, COUNTS.astype(float)), TypeError,
     "counts must hold integers"),
    ("ClientData scalar counts", lambda p: ClientData(X, Y, jnp.int32(2)), ValueError,
     "counts must have shape"),
    ("ClientData counts of a list", lambda p: ClientData(X, Y, [2, 4, 3]), TypeError,
     "counts must be an array"),
    ("ClientData counts too short", lambda p: ClientData(X, Y, COUNTS[:2]), ValueError,
     r"x must have shape \[2, N_max"),
    ("ClientData y of other clients", lambda p: ClientData(X, Y[:2], COUNTS), ValueError,
     r"y must have shape \[3, N_max"),
    ("ClientData y of other N_max", lambda p: ClientData(X, Y[:, :3], COUNTS), ValueError,
     "x and y must share the padded axis"),
    ("ClientData x without N_max axis", lambda p: ClientData(X[:, 0, 0], Y, COUNTS), ValueError,
     "x must have shape"),
    ("ClientData integer x", lambda p: ClientData(X.astype(jnp.int32), Y, COUNTS), TypeError,
     "x must have a floating dtype"),
    ("ClientData complex y", lambda p: ClientData(X, Y.astype(jnp.complex64), COUNTS), TypeError,
     "y must be real"),
    ("ClientData _replace bad counts", lambda p: DATA._replace(counts=COUNTS + 9), ValueError,
     "counts must lie in"),
    ("subset out of range", lambda p: DATA.subset([0, 3]), ValueError,
     r"clients must be indices in \[0, 3\), got 3"),
    ("subset negative", lambda p: DATA.subset([-1]), ValueError, "clients must be indices"),
    ("subset float indices", lambda p: DATA.subset([0.0, 1.0]), TypeError,
     "clients must hold integer"),
    ("subset empty", lambda p: DATA.subset([]), ValueError, "clients must select at least one"),
    ("subset 2-D", lambda p: DATA.subset([[0, 1]]), ValueError, "clients must be a 1-D"),
    ("subset scalar", lambda p: DATA.subset(1), ValueError, "clients must be a 1-D"),
    ("subset mask of other length", lambda p: DATA.subset([True, False]), ValueError,
     r"clients as a boolean mask must have shape \(3,\)"),
    # ---- data: from_client_arrays
    ("finite in float64, inf in float32",
     lambda p: from_client_arrays([np.array([[1e39, 0.0]])], [np.ones(1)]), ValueError,
     r"xs\[0\] has values too large for float32"),
    ("targets overflow float32",
     lambda p: from_client_arrays([np.ones((1, 2))], [np.array([-1e300])]), ValueError,
     r"ys\[0\] has values too large"),
    ("complex features", lambda p: from_client_arrays([np.ones((2, 2)) * 1j], [np.ones(2)]),
     TypeError, r"xs\[0\] must be real"),
    ("complex targets",
     lambda p: from_client_arrays([np.ones((2, 2))], [np.ones(2, complex)]), TypeError,
     r"ys\[0\] must be real"),
    ("string targets", lambda p: from_client_arrays([np.ones((2, 2))], [np.array(["a", "b"])]),
     TypeError, r"ys\[0\] must be numeric"),
    ("object features",
     lambda p: from_client_arrays([np.array([[None, 1]], dtype=object)], [np.ones(1)]),
     TypeError, r"xs\[0\] must be numeric"),
    ("integer dtype", lambda p: from_client_arrays([np.ones((2, 2))], [np.ones(2)],
                                                   dtype=jnp.int32), TypeError, "dtype"),
    ("unknown dtype", lambda p: from_client_arrays([np.ones((2, 2))], [np.ones(2)], dtype="xx"),
     TypeError, "dtype must be a floating dtype"),
    ("num_classes 0", lambda p: from_client_arrays([np.ones((2, 2))], [np.zeros(2)],
                                                   num_classes=0), ValueError, "num_classes"),
    ("num_classes float", lambda p: from_client_arrays([np.ones((2, 2))], [np.zeros(2)],
                                                       num_classes=2.5), TypeError, "num_classes"),
    ("from_client_arrays float16", lambda p: from_client_arrays(
        [np.ones((2, 2))], [np.ones(2)], dtype=jnp.float16), TypeError,
     "dtype must be float32 or float64, got float16"),
    ("from_client_arrays bfloat16", lambda p: from_client_arrays(
        [np.ones((2, 2))], [np.ones(2)], dtype=jnp.bfloat16), TypeError,
     "dtype must be float32 or float64, got bfloat16"),
    # ---- K-fold splits: clients smaller than K, fold ids out of range
    ("cv_datasets folds beyond a client", lambda p: protocol.cv_datasets(
        protocol.stack_datasets([DATA]), protocol.stack_datasets([DATA]), 3,
        key=jax.random.split(KEY, 1)), ValueError, r"num_folds=3 exceeds the smallest client's 2"),
    ("kfold_split fold id >= K", lambda p: kj.evaluation.kfold_split(
        DATA, 2, folds=jnp.array([[0, 1, -1, -1], [0, 1, 2, 0], [0, 1, 0, -1]])), ValueError,
     r"folds must hold ids in \[0, 2\) on real rows, found \[2\]"),
    ("kfold_split -1 on a real row", lambda p: kj.evaluation.kfold_split(
        DATA, 2, folds=jnp.array([[0, -1, -1, -1], [0, 1, 1, 0], [0, 1, 0, -1]])), ValueError,
     r"found \[-1\]"),
    ("kfold_split id on padding", lambda p: kj.evaluation.kfold_split(
        DATA, 2, folds=jnp.array([[0, 1, 0, -1], [0, 1, 1, 0], [0, 1, 0, -1]])), ValueError,
     "-1 on padding"),
    ("member_dissimilarities empty client", lambda p: protocol.member_dissimilarities(
        protocol.stack_datasets([DATA._replace(counts=jnp.array([2, 0, 3], jnp.int32))]), KEY,
        num_reference=5), ValueError, "member 0's client 1 has none"),
    # ---- targets as a column [N_i, 1] against predictions [N_i]: broadcast into [N, N]
    ("ridge loss column targets", lambda p: LOSS(THETA, X[0], Y[0][:, None], DATA.mask[0]),
     ValueError, r"y must hold one target per row, shape \(4,\)"),
    ("fedavg init column targets", lambda p: ALGOS["fedavg"]().init(
        THETA, DATA._replace(y=Y[..., None]), key=KEY), ValueError, "one target per row"),
    ("logistic loss column targets", lambda p: models.logistic_loss(0.1)(
        {"w": THETA, "b": jnp.zeros(())}, X[0], Y[0][:, None], DATA.mask[0]), ValueError,
     "one target per row"),
    ("mse column targets", lambda p: kj.evaluation.mean_squared_error(
        lambda t, x: x @ t, jnp.zeros((N, DIM)), DATA._replace(y=Y[..., None])), ValueError,
     "one target per row"),
    ("r2 column targets", lambda p: kj.evaluation.r2_score(
        lambda t, x: x @ t, jnp.zeros((N, DIM)), DATA._replace(y=Y[..., None])), ValueError,
     "one target per row"),
    ("num_classes past int32", lambda p: from_client_arrays(
        [np.ones((2, 2))], [np.array([0, 2**40])], num_classes=2**41), ValueError, "num_classes"),
    ("max_count float", lambda p: from_client_arrays([np.ones((2, 2))], [np.zeros(2)],
                                                     max_count=3.5), TypeError, "max_count"),
    ("max_count too small", lambda p: from_client_arrays([np.ones((2, 2))], [np.zeros(2)],
                                                         max_count=1), ValueError, "max_count=1"),
    ("xs None", lambda p: from_client_arrays(None, []), TypeError, "xs must be a sequence"),
    ("ragged client rows", lambda p: from_client_arrays([[[1.0, 2.0], [3.0]]], [np.ones(2)]),
     TypeError, "xs and ys entries must be array-like"),
    ("target shapes differ",
     lambda p: from_client_arrays([np.ones((1, 2))] * 2, [np.ones(1), np.ones((1, 2))]),
     ValueError, "target shapes differ.*ys"),
    ("client_weights all zero", lambda p: client_weights(np.zeros(3)), ValueError,
     "counts must be >= 0 and not all zero"),
    ("client_weights negative", lambda p: client_weights(np.array([2, -1])), ValueError,
     "counts must be >= 0"),
    ("client_weights 2-D", lambda p: client_weights(np.ones((2, 2))), ValueError,
     r"counts must have shape \[n\]"),
    # ---- data: synthetic generator
    ("synthetic num_clients float", lambda p: synthetic_ridge(0, num_clients=2.5), TypeError,
     "num_clients"),
    ("synthetic dim 0", lambda p: synthetic_ridge(0, dim=0), ValueError, "dim must be >= 1"),
    ("synthetic min > max", lambda p: synthetic_ridge(0, min_samples=5, max_samples=4),
     ValueError, "min_samples <= max_samples"),
    ("synthetic noise inf", lambda p: synthetic_ridge(0, noise_std=float("inf")), ValueError,
     "noise_std must be finite"),
    ("synthetic theta_std NaN", lambda p: synthetic_ridge(0, theta_std=float("nan")), ValueError,
     "theta_std"),
    ("synthetic no groups", lambda p: synthetic_ridge(0, group_means=()), ValueError,
     "group_means"),
    ("synthetic scale range", lambda p: synthetic_ridge(0, feature_scale_range=(0.0, 1.0)),
     ValueError, "feature_scale_range"),
    ("synthetic num_test 0", lambda p: synthetic_ridge(0, num_test=0), ValueError, "num_test"),
    # ---- data: LEAF files
    ("LEAF non-UTF-8", lambda p: read_leaf_file(_leaf_file(p, b'{"users": ["\xff\xfe"]}')),
     ValueError, r"bad_train\.json: not UTF-8"),
    ("LEAF empty file", lambda p: read_leaf_file(_leaf_file(p, "")), ValueError,
     r"bad_train\.json: not valid JSON"),
    ("LEAF top-level list", lambda p: read_leaf_file(_leaf_file(p, [1, 2])), ValueError,
     r"bad_train\.json: top level must be a JSON object"),
    ("LEAF missing users", lambda p: read_leaf_file(_leaf_file(p, {"num_samples": [],
                                                                   "user_data": {}})),
     ValueError, r"bad_train\.json: missing key 'users'"),
    ("LEAF users not a list", lambda p: read_leaf_file(_leaf_file(p, _leaf_raw(users="w"))),
     ValueError, r"bad_train\.json: 'users' and 'num_samples' must be lists"),
    ("LEAF user_data a list", lambda p: read_leaf_file(_leaf_file(p, _leaf_raw(user_data=[]))),
     ValueError, r"bad_train\.json: 'user_data' must be an object"),
    ("LEAF user without data",
     lambda p: read_leaf_file(_leaf_file(p, _leaf_raw(users=["v"]))), ValueError,
     r"bad_train\.json: writer 'v' is in 'users' but not in 'user_data'"),
    ("LEAF duplicate users",
     lambda p: read_leaf_file(_leaf_file(p, _leaf_raw(users=["w", "w"], num_samples=[2, 2]))),
     ValueError, "'users' lists a writer more than once"),
    ("LEAF ragged pixel row",
     lambda p: read_leaf_file(_leaf_file(p, _leaf_raw(user_data={"w": {
         "x": [[0.5] * IMAGE_SIZE, [0.5] * 3], "y": [1, 2]}}))),
     ValueError, r"user_data\['w'\]\['x'\]\[1\] must have 784 values, got 3"),
    ("LEAF huge label",
     lambda p: read_leaf_file(_leaf_file(p, _leaf_raw(user_data={"w": {
         "x": [[0.5] * IMAGE_SIZE] * 2, "y": [1, 10**30]}}))),
     ValueError, r"user_data\['w'\]\['y'\]"),
    ("LEAF string pixel", lambda p: load_leaf(_leaf_dir(p, _writer_with("a")), num_clients=1,
                                              min_samples=1),
     ValueError, r"train_9\.json: user_data\['w'\]\['x'\] must hold numbers"),
    ("LEAF NaN pixel", lambda p: load_leaf(_leaf_dir(p, _writer_with(float("nan"))),
                                           num_clients=1, min_samples=1),
     ValueError, r"user_data\['w'\]\['x'\] pixel values"),
    ("LEAF seed string", lambda p: load_leaf(p, seed="a"), TypeError, "seed"),
    ("LEAF num_clients bool", lambda p: load_leaf(p, num_clients=True), TypeError,
     "num_clients"),
    ("LEAF seed negative", lambda p: load_leaf(p, seed=-1), ValueError, "seed must be >= 0"),
    ("LEAF digits_only string", lambda p: load_leaf(p, digits_only="no"), TypeError,
     "digits_only must be True or False"),
    ("LEAF invert string", lambda p: load_leaf(p, invert="yes"), TypeError,
     "invert must be True or False"),
    ("LEAF numeric string pixel",
     lambda p: load_leaf(_leaf_dir(p, _writer_with("0.5")), num_clients=1, min_samples=1),
     ValueError, r"user_data\['w'\]\['x'\] must hold numbers, found values parsed as <U"),
    ("LEAF null pixel",
     lambda p: load_leaf(_leaf_dir(p, _writer_with(None)), num_clients=1, min_samples=1),
     ValueError, r"user_data\['w'\]\['x'\] must hold numbers, found values parsed as object"),
    ("LEAF writer with rows not in users",
     lambda p: read_leaf_file(_leaf_file(p, _leaf_raw(user_data={
         "w": {"x": [[0.5] * IMAGE_SIZE] * 2, "y": [1, 2]},
         "v": {"x": [[0.5] * IMAGE_SIZE], "y": [1]}}))),
     ValueError, r"holds 1 writer\(s\) with rows that 'users' does not list \(first: 'v'\)"),
    ("LEAF integer writer id", lambda p: read_leaf_file(_leaf_file(p, _leaf_raw(users=[5]))),
     ValueError, r"'users' must hold writer ids as strings .* got 5 \(int\)"),
    ("LEAF list writer id", lambda p: read_leaf_file(_leaf_file(p, _leaf_raw(users=[["w"]]))),
     ValueError, r"'users' must hold writer ids as strings"),
    ("LEAF num_samples string",
     lambda p: read_leaf_file(_leaf_file(p, _leaf_raw(num_samples=["2"]))), ValueError,
     r"'num_samples' must hold non-negative integers, got '2' \(str\) for writer 'w'"),
    # ---- data: heart disease files
    ("heart non-ASCII", lambda p: read_heart_disease_file(_heart_file(p, "63.0,\xe9\n")),
     ValueError, r"processed\.cleveland\.data: not an ASCII text file"),
    ("heart Latin-1 bytes",
     lambda p: read_heart_disease_file(_heart_file(p, _HEART_ROW.encode() + b"\xff\n")),
     ValueError, r"processed\.cleveland\.data"),
    ("heart empty file", lambda p: read_heart_disease_file(_heart_file(p, "\n")), ValueError,
     r"processed\.cleveland\.data: no data rows"),
    ("heart 13 columns",
     lambda p: read_heart_disease_file(_heart_file(p, _HEART_ROW.rsplit(",", 1)[0])),
     ValueError, r"processed\.cleveland\.data, line 1: expected 14"),
    ("heart diagnosis 7",
     lambda p: read_heart_disease_file(_heart_file(p, _HEART_ROW[:-1] + "7")), ValueError,
     r"column 14 \(num\)"),
    ("heart missing file", lambda p: read_heart_disease_file(p / "nope.data"), ValueError,
     r"nope\.data not found"),
    ("heart seed string", lambda p: load_heart_disease(p, seed="a"), TypeError, "seed"),
    ("heart test_fraction NaN", lambda p: load_heart_disease(p, test_fraction=float("nan")),
     ValueError, "test_fraction"),
    # ---- embedding
    ("dissimilarities not ClientData", lambda p: embedding.dissimilarities((X, Y, COUNTS),
                                                                           key=KEY),
     TypeError, "clients must be a ClientData"),
    ("dissimilarities NaN data",
     lambda p: embedding.dissimilarities(ClientData(X.at[0, 0, 0].set(jnp.nan), Y, COUNTS),
                                         key=KEY), ValueError, "clients.x contains NaN"),
    ("dissimilarities label_scale NaN",
     lambda p: embedding.dissimilarities(DATA, key=KEY, label_scale=float("nan")), ValueError,
     "label_scale"),
    ("dissimilarities num_classes 0",
     lambda p: embedding.dissimilarities(DATA, key=KEY, num_classes=0), ValueError,
     "num_classes"),
    ("dissimilarities epsilon inf",
     lambda p: embedding.dissimilarities(DATA, key=KEY, epsilon=float("inf")), ValueError,
     "epsilon"),
    ("dissimilarities threshold negative",
     lambda p: embedding.dissimilarities(DATA, key=KEY, threshold=-1.0), ValueError,
     "threshold"),
    ("dissimilarities max_iterations 0",
     lambda p: embedding.dissimilarities(DATA, key=KEY, max_iterations=0), ValueError,
     "max_iterations"),
    ("dissimilarities num_reference float",
     lambda p: embedding.dissimilarities(DATA, key=KEY, num_reference=2.5), TypeError,
     "num_reference"),
    ("dissimilarities empty client",
     lambda p: embedding.dissimilarities(ClientData(X, Y, jnp.array([2, 0, 3])), key=KEY),
     ValueError, r"counts must lie in \[1, 4\]"),
    ("dissimilarities stacked data sets",
     lambda p: embedding.dissimilarities(jax.tree.map(lambda a: a[None], DATA), key=KEY),
     ValueError, "clients must be one data set"),
    ("joint_samples labels out of range",
     lambda p: embedding.joint_samples(ClientData(X, Y.astype(jnp.int32) + 5, COUNTS),
                                       num_classes=2), ValueError, r"y must hold integer labels"),
    ("embed joint 2-D", lambda p: embedding.embed(JOINT[0], COUNTS, REF), ValueError,
     r"joint must have shape \[n, N_max, dz\]"),
    ("embed reference of other dz", lambda p: embedding.embed(JOINT, COUNTS, REF[:, :2]),
     ValueError, r"reference must have shape \[N0, 3\]"),
    ("embed counts of other n", lambda p: embedding.embed(JOINT, COUNTS[:2], REF), ValueError,
     r"counts must have shape \[3\]"),
    ("embed float counts", lambda p: embedding.embed(JOINT, COUNTS * 1.0, REF), TypeError,
     "counts must hold integers"),
    ("embed zero count", lambda p: embedding.embed(JOINT, jnp.array([0, 1, 2]), REF),
     ValueError, r"counts must lie in \[1, 4\]"),
    ("embed NaN joint", lambda p: embedding.embed(JOINT.at[1, 1, 1].set(jnp.nan), COUNTS, REF),
     ValueError, "joint contains NaN"),
    ("embed inf reference", lambda p: embedding.embed(JOINT, COUNTS, REF.at[0, 0].set(jnp.inf)),
     ValueError, "reference contains NaN or infinite"),
    ("embed epsilon too small for the cost scale",  # one plain Sinkhorn compile
     lambda p: embedding.embed(jnp.arange(JOINT.size).reshape(JOINT.shape) / 10.0, COUNTS,
                               REF.at[:, 0].set(jnp.arange(5.0)), epsilon=1e-9, momentum_start=None,
                               max_iterations=20, batch_size=None),
     ValueError, r"epsilon=1e-09 is too small for the data's cost scale.*median.*"
                 r"Use epsilon of about"),
    ("embed batch_size 0", lambda p: embedding.embed(JOINT, COUNTS, REF, batch_size=0),
     ValueError, "batch_size"),
    ("embed inner_iterations 0",
     lambda p: embedding.embed(JOINT, COUNTS, REF, inner_iterations=0), ValueError,
     "inner_iterations"),
    ("embed max < inner",
     lambda p: embedding.embed(JOINT, COUNTS, REF, max_iterations=5, inner_iterations=10),
     ValueError, "max_iterations must be >= inner_iterations"),
    ("gaussian_reference empty client",
     lambda p: embedding.gaussian_reference(JOINT, jnp.array([0, 1, 2]), key=KEY), ValueError,
     r"counts must lie in \[1, 4\]"),
    ("gaussian_reference NaN samples",
     lambda p: embedding.gaussian_reference(JOINT.at[0, 0, 0].set(jnp.nan), COUNTS, key=KEY),
     ValueError, "samples contains NaN"),
    ("gaussian_reference key None",
     lambda p: embedding.gaussian_reference(JOINT, COUNTS, key=None), TypeError,
     "key must be a PRNG key"),
    ("gaussian_reference no counts", lambda p: embedding.gaussian_reference(JOINT, key=KEY),
     ValueError, "counts is required"),
    ("gaussian_reference samples 2-D",
     lambda p: embedding.gaussian_reference(JOINT[0], COUNTS, key=KEY), ValueError,
     r"samples must have shape \[n, N_max, dz\]"),
    ("gaussian_reference num_reference 0",
     lambda p: embedding.gaussian_reference(DATA, key=KEY, num_reference=0), ValueError,
     "num_reference"),
    ("pairwise NaN maps",
     lambda p: embedding.pairwise_from_embeddings(JOINT.at[0, 0, 0].set(jnp.nan)), ValueError,
     "maps contains NaN"),
    ("pairwise maps 2-D", lambda p: embedding.pairwise_from_embeddings(JOINT[0]), ValueError,
     r"maps must have shape"),
    ("pairwise norm", lambda p: embedding.pairwise_from_embeddings(JOINT, norm="l2"), ValueError,
     "norm must be one of"),
    # ---- models
    ("ridge_loss lam NaN", lambda p: models.ridge_loss(float("nan")), ValueError, "lam"),
    ("ridge_loss lam inf", lambda p: models.ridge_loss(float("inf")), ValueError, "lam"),
    ("ridge_loss lam array", lambda p: models.ridge_loss(np.ones(2)), TypeError, "lam"),
    ("logistic_loss lam negative", lambda p: models.logistic_loss(-1.0), ValueError, "lam"),
    ("mlp hidden bool", lambda p: models.mlp(hidden=True), TypeError, "hidden"),
    ("mlp hidden float", lambda p: models.mlp(hidden=2.0), TypeError, "hidden"),
    ("linear_params integer dtype", lambda p: models.linear_params(3, dtype=jnp.int32),
     TypeError, "dtype"),
    ("linear_params dim float", lambda p: models.linear_params(3.0), TypeError, "dim"),
    ("init_params input_shape string", lambda p: models.init_params(models.mlp(), KEY, "ab"),
     TypeError, "input_shape"),
    ("output_layer_mask list", lambda p: models.output_layer_mask([jnp.zeros(2)]), TypeError,
     "params must be a dict"),
    ("output_layer_mask unknown layer",
     lambda p: models.output_layer_mask(_mlp_params(2), layer="nope"), ValueError,
     "layer='nope'"),
    ("cross_entropy_loss not callable", lambda p: models.cross_entropy_loss("f"), TypeError,
     "apply_fn"),
    # ---- algorithms: factories
    ("karula t negative", lambda p: ALGOS["karula"](t=-1.0), ValueError, "t must be >= 0"),
    ("karula t NaN", lambda p: karula(LOSS, D, t=float("nan"), **HP), ValueError, "t must be"),
    ("karula t string", lambda p: karula(LOSS, D, t="1", **HP), TypeError, "t must be a real"),
    ("karula learning_rate inf", lambda p: ALGOS["karula"](learning_rate=float("inf")),
     ValueError, "learning_rate must be finite"),
    ("karula D NaN", lambda p: karula(LOSS, D.at[0, 1].set(jnp.nan), t=1.0, **HP), ValueError,
     "D must not contain NaN"),
    ("karula D asymmetric", lambda p: karula(LOSS, D.at[0, 1].set(3.0), t=1.0, **HP),
     ValueError, "D must be symmetric"),
    ("karula D negative", lambda p: karula(LOSS, -D, t=1.0, **HP), ValueError, "D must be >= 0"),
    ("karula D not square", lambda p: karula(LOSS, D[:2], t=1.0, **HP), ValueError,
     "D must be a square matrix"),
    ("karula batch_size 0", lambda p: ALGOS["karula"](batch_size=0), ValueError, "batch_size"),
    ("karula projection_method unknown", lambda p: ALGOS["karula"](projection_method="foo"),
     ValueError, "projection_method must be one of"),
    ("karula projection_tol negative", lambda p: ALGOS["karula"](projection_tol=-1.0),
     ValueError, "projection_tol must be finite and > 0"),
    ("karula projection_max_iter 0", lambda p: ALGOS["karula"](projection_max_iter=0),
     ValueError, "projection_max_iter must be >= 1"),
    ("karula projection_max_iter float", lambda p: ALGOS["karula"](projection_max_iter=10.0),
     TypeError, "projection_max_iter must be a positive Python int"),
    ("karula weights negative", lambda p: ALGOS["karula"](weights=jnp.array([1.0, -1.0, 1.0])),
     ValueError, "weights must be finite, >= 0"),
    ("karula weights 2-D", lambda p: ALGOS["karula"](weights=jnp.ones((3, 1))), ValueError,
     r"weights must have shape"),
    ("karula s > n at init",
     lambda p: ALGOS["karula"](clients_per_round=4).init(THETA, DATA, key=KEY), ValueError,
     "clients_per_round=4 exceeds the number of clients n=3"),
    ("karula D of other n",
     lambda p: karula(LOSS, jnp.zeros((4, 4)), t=1.0, **HP).init(THETA, DATA, key=KEY),
     ValueError, r"D has shape \(4, 4\) but data hold 3 clients"),
    ("local clients_per_round 0", lambda p: local(LOSS, learning_rate=0.1, batch_size=2,
                                                  clients_per_round=0), ValueError,
     "clients_per_round"),
    ("local learning_rate negative", lambda p: local(LOSS, learning_rate=-0.1, batch_size=2),
     ValueError, "learning_rate"),
    ("ClientData of lists", lambda p: ClientData([[[0.0]]], [[0.0]], [1]), TypeError,
     "ClientData: x must be an array, got a list"),
    ("fedsgd memory string", lambda p: ALGOS["fedsgd"](memory="yes"), TypeError,
     "memory must be True or False"),
    ("karula D None", lambda p: karula(LOSS, None, t=1.0, **HP), TypeError,
     "D must be an \\[n, n\\] array"),
    ("radii_squared t negative", lambda p: kj.algorithms.radii_squared(-1.0, D), ValueError,
     "t must be >= 0"),
    ("radii_squared D asymmetric", lambda p: kj.algorithms.radii_squared(1.0, D.at[0, 1].set(9.0)),
     ValueError, "D must be symmetric"),
    ("fedsgd batch_size float", lambda p: ALGOS["fedsgd"](batch_size=2.0), TypeError,
     "batch_size"),
    ("fedavg local_steps 0", lambda p: ALGOS["fedavg"](local_steps=0), ValueError,
     "local_steps"),
    ("ifca num_clusters float", lambda p: ifca(LOSS, num_clusters=2.0, **HP), TypeError,
     "num_clusters"),
    ("ifca init_scale negative", lambda p: ALGOS["ifca"](init_scale=-1.0), ValueError,
     "init_scale"),
    ("pfedme personal_learning_rate 0", lambda p: ALGOS["pfedme"](personal_learning_rate=0.0),
     ValueError, "personal_learning_rate"),
    ("pfedme beta NaN", lambda p: ALGOS["pfedme"](beta=float("nan")), ValueError, "beta"),
    # ---- algorithms: init and round
    *[
        (f"{name} params of length d+1",
         lambda p, name=name: ALGOS[name]().init(jnp.zeros(DIM + 1), DATA, key=KEY), ValueError,
         r"params do not fit the data.*\(3,\).*x of shape \(4, 2\)")
        for name in ALGOS
    ],
    ("fedavg MLP for another input size",
     lambda p: fedavg(models.cross_entropy_loss(models.mlp(3, 2).apply), **HP).init(
         _mlp_params(5), DATA._replace(y=DATA.y.astype(jnp.int32)), key=KEY),
     ValueError, r"params do not fit the data.*\(5, 3\)"),
    ("classifier with 8 logits on labels 0..9",
     lambda p: fedavg(models.cross_entropy_loss(models.mlp(3, 8).apply), **HP).init(
         models.init_params(models.mlp(3, 8), KEY, (1, DIM)), LABELS_0_9, key=KEY),
     ValueError, r"labels data.y lie outside the model's 8 classes \[0, 8\).*client 1 has "
                 r"label\(s\) \[8, 9\]"),
    ("integer params", lambda p: ALGOS["local"]().init(jnp.zeros(DIM, jnp.int32), DATA, key=KEY),
     TypeError, "params leaves must be floating"),
    ("empty params", lambda p: ALGOS["fedsgd"]().init({}, DATA, key=KEY), TypeError,
     "params must be a pytree with at least one array leaf"),
    ("loss returning a vector",
     lambda p: local(lambda th, x, y, m: x @ th, learning_rate=0.1, batch_size=2).init(
         THETA, DATA, key=KEY), TypeError, "loss must return a scalar"),
    ("init key None", lambda p: ALGOS["fedavg"]().init(THETA, DATA, key=None), TypeError,
     "key must be a PRNG key"),
    ("init stacked keys",
     lambda p: ALGOS["pfedme"]().init(THETA, DATA, key=jax.random.split(KEY, 2)), ValueError,
     "key must be one PRNG key"),
    ("init data a tuple", lambda p: ALGOS["ifca"]().init(THETA, (X, Y, COUNTS), key=KEY),
     TypeError, "data must be a ClientData"),
    ("round on data of other n",
     lambda p: (lambda a, s: a.round(s, DATA.subset([0, 1])))(*_one_round_state()), ValueError,
     "data hold 2 clients but state was initialized for 3"),
    ("fedavg personalized of other structure",
     lambda p: ALGOS["fedavg"](personalized={"w": True}).init(THETA, DATA, key=KEY), ValueError,
     "personalized must have the tree structure of params"),
    ("ifca initial_clusters do not fit the data",
     lambda p: ALGOS["ifca"](initial_clusters=jnp.zeros((2, DIM + 1))).init(THETA, DATA, key=KEY),
     ValueError, "initial_clusters do not fit the data"),
    ("lipschitz_ridge lam negative", lambda p: lipschitz_ridge(DATA, -1.0), ValueError, "lam"),
    ("lipschitz_ridge not ClientData", lambda p: lipschitz_ridge((X, Y, COUNTS), 0.1), TypeError,
     "data must be a ClientData"),
    ("lipschitz_ridge weights of other n", lambda p: lipschitz_ridge(DATA, 0.1, jnp.ones(2)),
     ValueError, r"weights must have shape \[3\]"),
    ("lipschitz_ridge every client empty",
     lambda p: lipschitz_ridge(ClientData(X, Y, jnp.zeros(3, jnp.int32)), 0.1), ValueError,
     "counts must be >= 0 and not all zero"),
    ("lipschitz_ridge NaN features",
     lambda p: lipschitz_ridge(ClientData(X.at[0, 0, 0].set(jnp.nan), Y, COUNTS), 0.1),
     ValueError, "data.x contains NaN"),
    # ---- projection
    ("project radii_sq of other n",
     lambda p: projection.project(jnp.zeros((N, DIM)), jnp.zeros((N + 1, N + 1))), ValueError,
     "radii_sq"),
    ("project radii_sq 1-D", lambda p: projection.project(jnp.zeros((N, DIM)), jnp.zeros(N)),
     ValueError, "radii_sq"),
    # ---- training
    ("run num_rounds 0", lambda p: training.run(ALGOS["local"](), THETA, DATA, key=KEY,
                                                num_rounds=0), ValueError, "num_rounds"),
    ("run num_rounds float", lambda p: training.run(ALGOS["local"](), THETA, DATA, key=KEY,
                                                    num_rounds=2.0), TypeError, "num_rounds"),
    ("run chunk_size -1", lambda p: training.run(ALGOS["local"](), THETA, DATA, key=KEY,
                                                 num_rounds=2, chunk_size=-1), ValueError,
     "chunk_size"),
    ("run on_nonfinite", lambda p: training.run(ALGOS["local"](), THETA, DATA, key=KEY,
                                                num_rounds=2, on_nonfinite="warn"), ValueError,
     "on_nonfinite"),
    ("run resume without dir", lambda p: training.run(ALGOS["local"](), THETA, DATA, key=KEY,
                                                      num_rounds=2, resume=True), ValueError,
     "resume=True needs checkpoint_dir"),
    ("run not an Algorithm", lambda p: training.run(lambda s: s, THETA, DATA, key=KEY,
                                                    num_rounds=2), TypeError, "algorithm"),
    ("product_grid no axis", lambda p: training.product_grid(), ValueError, "hyperparameter"),
    ("product_grid 2-D values", lambda p: training.product_grid(t=[[0.0, 1.0]]), ValueError,
     "t must be a non-empty 1-D"),
    ("product_grid empty values", lambda p: training.product_grid(t=[]), ValueError, "t must be"),
    ("run_many one key", lambda p: training.run_many(lambda: ALGOS["local"](), THETA, DATA,
                                                     keys=KEY, num_rounds=1), ValueError, "keys"),
    ("run_many hyper lengths", lambda p: training.run_many(
        lambda **h: ALGOS["local"](), THETA, DATA, keys=jax.random.split(KEY, 2), num_rounds=1,
        hyper={"a": [1.0, 2.0], "b": [1.0]}), ValueError, "hyper arrays must have the same"),
    ("run_many hyper not a dict", lambda p: training.run_many(
        lambda **h: ALGOS["local"](), THETA, DATA, keys=jax.random.split(KEY, 2), num_rounds=1,
        hyper=[1.0]), TypeError, "hyper must be"),
    ("run_many data_per_seed without seed axis", lambda p: training.run_many(
        lambda: ALGOS["local"](), THETA, DATA, keys=jax.random.split(KEY, 2), num_rounds=1,
        data_per_seed=True), ValueError, "data_per_seed"),
    ("run_many D with NaN through batch_kwargs (karula)",
     lambda p: training.run_many(lambda D: karula(LOSS, D, t=1.0, **HP), THETA, DATA,
                                 keys=jax.random.split(KEY, 2), num_rounds=1,
                                 batch_kwargs={"D": jnp.stack([D, D.at[0, 1].set(jnp.nan)])}),
     ValueError, r"dissimilarity D contains NaN in batch member 1 .*batch_kwargs\['D'\] of "
                 r"member 1 holds NaN"),
    ("run_many D negative through batch_kwargs (laplacian_penalty)",
     lambda p: training.run_many(
         lambda D: laplacian_penalty(LOSS, D, mu=1.0, **HP), THETA, DATA,
         keys=jax.random.split(KEY, 2), num_rounds=1, batch_kwargs={"D": jnp.stack([D, -D])}),
     ValueError, r"dissimilarity D has negative entries .*in batch member 1"),
    ("run_many learning_rate NaN in the grid",
     lambda p: training.run_many(lambda learning_rate: fedavg(LOSS, learning_rate=learning_rate,
                                                              clients_per_round=2, batch_size=2),
                                 THETA, DATA, keys=jax.random.split(KEY, 2), num_rounds=1,
                                 hyper={"learning_rate": [0.1, float("nan")]}),
     ValueError, r"learning_rate is NaN in grid point 1"),
    ("checkpoint garbage file", _garbage_checkpoint, ValueError, r"checkpoint\.npz"),
    ("checkpoint meta not JSON", _checkpoint_bad_meta, ValueError, r"checkpoint\.npz"),
    ("checkpoint of another algorithm", _checkpoint_of_fedavg, ValueError,
     r"checkpoint\.npz was written by fedavg, this run is karula"),
    ("project v with NaN",
     lambda p: projection.project(jnp.zeros((N, DIM)).at[0, 0].set(jnp.nan), jnp.ones((N, N))),
     ValueError, "v: leaf 0"),
    ("project v with inf",
     lambda p: projection.project(jnp.zeros((N, DIM)).at[1, 0].set(jnp.inf), jnp.ones((N, N))),
     ValueError, "v: leaf 0"),
    ("project radii_sq complex",
     lambda p: projection.project(jnp.zeros((N, DIM)), jnp.ones((N, N), jnp.complex64)),
     TypeError, "radii_sq: expected a real"),
    ("project radii_sq string", lambda p: projection.project(jnp.zeros((N, DIM)), "abc"),
     TypeError, "radii_sq: expected a real"),
    ("project v string leaf",
     lambda p: projection.project({"a": jnp.zeros((N, DIM)), "b": "xyz"}, jnp.ones((N, N))),
     TypeError, "v: leaf 1 is a str"),
    ("project v complex",
     lambda p: projection.project(jnp.zeros((N, DIM), jnp.complex64), jnp.ones((N, N))),
     TypeError, "v: leaf 0"),
    ("project v without clients",
     lambda p: projection.project(jnp.zeros((0, DIM)), jnp.ones((0, 0))), ValueError, "v: "),
    ("project tol zero",
     lambda p: projection.project(jnp.zeros((N, DIM)), jnp.ones((N, N)), tol=0.0),
     ValueError, "tol"),
    ("project max_iter float",
     lambda p: projection.project(jnp.zeros((N, DIM)), jnp.ones((N, N)), max_iter=10.5),
     TypeError, "max_iter"),
    ("project method dykstra_parallel (dropped)",
     lambda p: projection.project(jnp.zeros((N, DIM)), jnp.ones((N, N)),
                                  method="dykstra_parallel"), ValueError, "method"),
    ("member_default_rates params of another model",
     lambda p: protocol.member_default_rates(
         LOSS, jnp.zeros(DIM + 1), jax.tree.map(lambda a: a[None], DATA), 2, KEY[None]),
     ValueError, r"params do not fit the data, neither as one model nor as 1 stacked"),
    ("save_checkpoint rounds_done negative",
     lambda p: training.save_checkpoint(p / "c.npz", {"a": jnp.zeros(2)}, rounds_done=-1),
     ValueError, "rounds_done"),
]  # fmt: skip


def _ids(cases):
    return [c[0] for c in cases]


def test_table_is_complete():
    assert len(CASES) >= 100
    assert len(set(_ids(CASES))) == len(CASES)


@pytest.mark.parametrize(("name", "call", "exc", "match"), CASES, ids=_ids(CASES))
def test_bad_input(tmp_path, name, call, exc, match):
    with pytest.raises(exc, match=match) as err:
        call(tmp_path)
    assert type(err.value) is exc, f"{name}: {type(err.value).__name__}: {err.value}"


# --------------------------------------------------------------------------- per class


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 3),
    n_max=st.integers(1, 4),
    counts=st.lists(st.integers(-2, 6), min_size=1, max_size=4),
    y_rows=st.integers(1, 4),
)
def test_client_data_validates_counts_and_shapes(n, n_max, counts, y_rows):
    """Direct construction accepts exactly the consistent combinations."""
    x = np.zeros((n, n_max, 2), np.float32)
    y = np.zeros((n, y_rows), np.float32)
    c = np.asarray(counts, np.int32)
    valid = len(counts) == n and y_rows == n_max and all(0 <= k <= n_max for k in counts)
    if valid:
        data = ClientData(x, y, c)
        assert data.num_clients == n and data.max_count == n_max
    else:
        with pytest.raises(ValueError, match="ClientData: (x|y|counts)"):
            ClientData(x, y, c)


def test_client_data_still_works_under_transformations():
    """Tracers, placeholders and rebuilt trees skip the constructor's checks."""
    shapes = jax.eval_shape(lambda d: d, DATA)
    assert isinstance(shapes, ClientData) and shapes.x.shape == (N, NMAX, DIM)
    nones = jax.tree.map(lambda a: None, DATA)
    assert isinstance(nones, ClientData) and nones.x is None
    flags = jax.tree.map(lambda a: bool(np.all(np.asarray(a) == np.asarray(a))), DATA)
    assert isinstance(flags, ClientData) and flags.counts is True
    axes = ClientData(0, 0, None)  # a vmap prefix spec
    sums = jax.vmap(lambda d: d.x.sum() + d.counts.sum(), in_axes=(axes,))(DATA)
    assert sums.shape == (N,)
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), DATA)  # [S, n, ...] data sets
    assert ClientData(*stacked).counts.shape == (2, N)
    jitted = jax.jit(lambda d: ClientData(d.x * 2, d.y, d.counts))(DATA)
    np.testing.assert_array_equal(jitted.x, 2 * DATA.x)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(DATA)[0]]
    assert paths == [".x", ".y", ".counts"]


def test_finite_check_happens_after_the_cast():
    big = np.array([[3e38, 0.0], [1.0, 1.0]])  # finite in float32 too: accepted
    assert np.isfinite(np.asarray(from_client_arrays([big], [np.ones(2)]).x)).all()
    with pytest.raises(ValueError, match="too large for float32"):
        from_client_arrays([big * 10], [np.ones(2)])


def test_subset_keeps_order_and_repeats():
    sub = DATA.subset([2, 0, 2])
    np.testing.assert_array_equal(sub.counts, np.asarray(COUNTS)[[2, 0, 2]])
    np.testing.assert_array_equal(DATA.subset(np.array([False, True, True])).counts, COUNTS[1:])


def test_lipschitz_ridge_with_an_empty_client_is_defined():
    """An empty client's loss is lam/2 ||theta||^2: L_i = lam, and alpha_i = 0 by default."""
    lam = 0.1
    empty = ClientData(X, Y, jnp.array([2, 0, 3], jnp.int32))
    got = lipschitz_ridge(empty, lam)
    x = np.asarray(X, np.float64)
    L_i = [np.linalg.eigvalsh(x[i, :c].T @ x[i, :c] / c)[-1] + lam for i, c in ((0, 2), (2, 3))]
    alpha = np.array([2, 3]) * 3 / 5
    # the library's weights are float32 (a mean and a division: two roundings), the rest
    # float64
    np.testing.assert_allclose(got, np.max(alpha * L_i) / 3, rtol=reordered_sum(2))
    weighted = lipschitz_ridge(empty, lam, weights=jnp.ones(3), per_client=True)
    assert weighted >= lam and np.isfinite(weighted)


def test_params_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match="params do not fit") as err:
        ALGOS["karula"]().init(jnp.zeros(DIM + 1), DATA, key=KEY)
    msg = str(err.value)
    assert "(3,)" in msg and "(4, 2)" in msg
    assert isinstance(err.value.__cause__, TypeError)  # the dot_general error, chained


def test_param_check_works_inside_vmap_over_data():
    """The init check uses shapes only, so it runs on traced (vmapped) data."""
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), DATA)
    keys = jax.random.split(KEY, 2)
    state = jax.vmap(lambda d, k: ALGOS["local"]().init(THETA, d, key=k))(stacked, keys)
    assert state.params.shape == (2, N, DIM)
    with pytest.raises(ValueError, match="params do not fit"):
        jax.vmap(lambda d, k: ALGOS["local"]().init(jnp.zeros(5), d, key=k))(stacked, keys)


def test_non_utf8_leaf_file_through_load_leaf(tmp_path):
    _leaf_dir(tmp_path, {"x": [[0.5] * IMAGE_SIZE], "y": [1]})
    (tmp_path / "train" / "all_data_0_train_9.json").write_bytes(b"\x80\x81")
    with pytest.raises(ValueError, match=r"all_data_0_train_9\.json: not UTF-8"):
        load_leaf(tmp_path, num_clients=1, min_samples=1)


def test_project_integer_v_gives_float_feasible_result():
    v = jnp.array([[0], [3]], jnp.int32)
    out = projection.project(v, jnp.ones((2, 2)))[0]
    assert jnp.issubdtype(out.dtype, jnp.floating)
    # feasible up to the rounding of the float32 pair distance: the projection's own bound,
    # (p + 4) eps (|x_0|^2 + |x_1|^2), twice over (its final additions)
    slack = reordered_sum(1 + 4, rounds=2) * float(jnp.sum(out**2))
    assert float(jnp.sum((out[0] - out[1]) ** 2)) <= 1.0 + slack


# --------------------------------------------------------------------------- issue 27


def test_writers_create_missing_folders(tmp_path):
    """write_table, write_json and publish write into folders that do not exist yet."""
    deep = tmp_path / "a" / "b"
    table = reporting.write_table([{"m": 1.0}], [("m", "M")], deep / "table", title="t")
    assert "| M |" in table
    assert (deep / "table.csv").read_text().splitlines() == ["m", "1.0"]
    assert (deep / "table.md").read_text().startswith("# t")
    reporting.write_json({"x": np.arange(2)}, tmp_path / "c" / "s.json")
    assert json.loads((tmp_path / "c" / "s.json").read_text()) == {"x": [0, 1]}
    benchmarking.publish("report", tmp_path / "d" / "r.md", quick=False)
    assert (tmp_path / "d" / "r.md").read_text() == "report\n"


def test_every_public_submodule_is_an_attribute():
    """``import karula_jax as kj; kj.reporting.write_table`` (and every other public
    submodule, at every depth) works without importing the submodule by name."""
    names = [
        m.name
        for m in pkgutil.walk_packages(kj.__path__, "karula_jax.")
        if not any(part.startswith("_") for part in m.name.split("."))
    ]
    assert "karula_jax.reporting" in names and "karula_jax.data.leaf" in names
    # In a fresh interpreter: this process has imported every submodule by name already
    # (walk_packages and the test modules do), which sets the attributes on its own.
    check = (
        "import sys, karula_jax as kj\n"
        "for name in sys.argv[1:]:\n"
        "    obj = kj\n"
        "    for part in name.split('.')[1:]:\n"
        "        assert hasattr(obj, part), f'{name}: karula_jax has no attribute path to it'\n"
        "        obj = getattr(obj, part)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", check, *names], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    top = {n.split(".")[1] for n in names}
    assert top <= set(kj.__all__), sorted(top - set(kj.__all__))


def test_member_default_rates_broadcasts_one_model():
    """One model without the member axis gives the rates of that model stacked per member."""
    rng = np.random.default_rng(0)
    sets = [
        from_client_arrays([rng.normal(size=(3, DIM)) for _ in range(2)],
                           [rng.normal(size=3) for _ in range(2)])
        for _ in range(2)
    ]  # fmt: skip
    data = protocol.stack_datasets(sets)
    keys = jax.random.split(KEY, 2)
    one = protocol.member_default_rates(LOSS, jnp.ones(DIM), data, 2, keys)
    stacked = protocol.member_default_rates(LOSS, jnp.ones((2, DIM)), data, 2, keys)
    assert set(one) == set(stacked)
    for name in one:
        assert one[name].shape == (2,)
        np.testing.assert_array_equal(one[name], stacked[name])
    assert one["fedavg"][0] != one["fedavg"][1]  # each member's own data


# ---- traced arguments: every argument protocol passes through run_many's batch_kwargs/hyper

MEMBERS = jax.tree.map(lambda a: jnp.stack([a, a]), DATA)  # two batch members
GOOD_KWARGS = {
    "D": jnp.stack([D, D]),
    "labels": jnp.array([[[0, 0, 1], [0, 1, 2]]] * 2, jnp.int32),  # [B, choices, n]
    "clusters": jnp.zeros((2, 2, DIM)),  # IFCA's initial clusters [B, k, d]
    "L_f": jnp.ones(2),
    "L_max": jnp.ones(2),
}
GRIDS = {"IFCA": (2,), "pFedMe": (1.0, 2.0), "Karula": (0.0, 1.0, float("inf")),
         "FedProx": (0.1, 1.0), "Ditto": (1.0, 2.0), "Laplacian penalty on D": (1.0, 2.0),
         "Clustered FedAvg on D": (2, 3)}  # fmt: skip
SUITE_READS = {  # the member arguments each method's factory (or its rates) reads
    "Local": ["L_f"], "FedSGD": ["L_f"], "FedAvg": ["L_max"], "IFCA": ["L_max", "clusters"],
    "pFedMe": ["L_max"], "Karula": ["D", "L_f"], "FedProx": ["L_max"], "SCAFFOLD": ["L_max"],
    "Ditto": ["L_max"], "Laplacian penalty on D": ["D", "L_f"],
    "Clustered FedAvg on D": ["labels", "L_max"],
}  # fmt: skip
PLANTED = {  # a bad value of member 1 and what the error must say
    "D": (lambda a: a.at[1, 0, 2].set(jnp.nan).at[1, 2, 0].set(jnp.nan),
          r"dissimilarity D contains NaN in batch member 1"),
    "L_f": (lambda a: a.at[1].set(jnp.nan), r"learning_rate is NaN in batch member 1"),
    "L_max": (lambda a: a.at[1].set(jnp.nan), r"learning_rate is NaN in batch member 1"),
    "labels": (lambda a: a.at[1, :, 0].set(-1), r"labels are negative .*in batch member 1"),
    "clusters": (lambda a: a.at[1, 0, 0].set(jnp.inf),
                 r"initial_clusters contains NaN or infinite values in batch member 1"),
}  # fmt: skip


def _suite(names, grids=GRIDS):
    rates = protocol.smoothness_rates(karula=0.5, fedavg=0.5, ifca=0.5, personal=0.5,
                                      num_clients=N)  # fmt: skip
    return protocol.build_methods(names, loss=LOSS, rates=rates, grids=grids,
                                  clients_per_round=2, batch_size=2, local_steps=1)  # fmt: skip


def _run_method(method, kwargs):
    """What cross_validate runs for one method, stopped at the first round."""
    return training.run_many(
        functools.partial(method.make, **(method.static_grid or [{}])[0]), THETA, MEMBERS,
        keys=jax.random.split(KEY, 2), num_rounds=1, hyper=method.grid or None,
        data_per_seed=True, batch_kwargs=kwargs, progress=False,
    )  # fmt: skip


@pytest.mark.parametrize(("name", "arg"), [(m, a) for m, args in SUITE_READS.items() for a in args])
def test_traced_member_argument_is_checked(name, arg):
    """A bad value that protocol passes traced (batch_kwargs) is refused before any round,
    naming the argument and the member, for every method of the suite (issue 27)."""
    assert set(SUITE_READS) == set(protocol.SUITE)
    plant, match = PLANTED[arg]
    method = _suite((name,))[name]
    with pytest.raises(ValueError, match=match) as err:
        _run_method(method, {**GOOD_KWARGS, arg: plant(GOOD_KWARGS[arg])})
    assert "Nothing was run" in str(err.value)


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("Karula", -1.0, r"t is negative \(it must be >= 0\) in grid point 1"),
        ("Karula", float("nan"), r"t is NaN in grid point 1.*hyper\['t'\]\[1\] is NaN"),
        ("pFedMe", 0.0, r"lam is <= 0 \(it must be > 0\) in grid point 1"),
        ("FedProx", -1.0, r"mu is negative .*in grid point 1"),
        ("Ditto", float("nan"), r"lam is NaN in grid point 1"),
        ("Laplacian penalty on D", float("nan"), r"mu is NaN in grid point 1"),
    ],
)
def test_traced_grid_value_is_checked(name, value, match):
    """A bad value of a traced grid (hyper) is refused naming the argument and point."""
    grids = {**GRIDS, name: (1.0, value)}
    with pytest.raises(ValueError, match=match):
        _run_method(_suite((name,), grids)[name], GOOD_KWARGS)


def test_traced_checks_match_the_concrete_ones():
    """Every value the factories refuse concretely is reported when it arrives traced, and
    the values they accept (t = inf, D with inf, a zero step) run."""
    make = lambda D, t, lr: karula(LOSS, D, t=t, learning_rate=lr, clients_per_round=2,
                                   batch_size=2)  # fmt: skip
    cases = [  # (D, t, learning_rate) of member 1, concrete message, traced message
        (-D, 1.0, 0.1, "D must be >= 0", "dissimilarity D has negative entries"),
        (D.at[0, 1].set(3.0), 1.0, 0.1, "D must be symmetric", "dissimilarity D is not symmetric"),
        # inf facing 0 (or any finite entry) is asymmetric: it once passed and tied the pair
        (
            D.at[0, 1].set(jnp.inf).at[1, 0].set(0.0),
            1.0,
            0.1,
            r"D must be symmetric: D\[0, 1\] = inf",
            "dissimilarity D is not symmetric",
        ),
        (
            D.at[0, 1].set(jnp.inf).at[1, 0].set(1e-7),
            1.0,
            0.1,
            "D must be symmetric",
            "dissimilarity D is not symmetric",
        ),
        (D, 1.0, float("inf"), "learning_rate must be finite", "learning_rate is infinite"),
        (D, 1.0, -0.1, "learning_rate must be finite and >= 0", "learning_rate is negative"),
        (D, float("nan"), 0.1, "t must be", "t is NaN"),
    ]
    for bad_D, t, lr, concrete, traced in cases:
        with pytest.raises(ValueError, match=concrete):
            make(bad_D, t, lr)
        kw = {"D": jnp.stack([D, bad_D]), "t": jnp.array([1.0, t]), "lr": jnp.array([0.1, lr])}
        with pytest.raises(ValueError, match=traced + ".* in batch member 1"):
            training.vmap_algorithm(make, batch_kwargs=kw)
    ok = {"D": jnp.stack([D, D.at[0, 2].set(jnp.inf).at[2, 0].set(jnp.inf)]),
          "t": jnp.array([jnp.inf, 1.0]), "lr": jnp.array([0.0, 0.1])}  # fmt: skip
    training.vmap_algorithm(make, batch_kwargs=ok)  # no error


def test_checkpoint_of_another_algorithm_is_refused_by_name(tmp_path):
    """The checkpoint names the algorithm that wrote it; another algorithm's resume is
    refused by that name, before any shape is compared (issue 27)."""
    opts = dict(key=KEY, num_rounds=1, checkpoint_dir=tmp_path, progress=False)
    training.run(LOCAL, THETA, DATA, **opts)
    with np.load(tmp_path / training.CHECKPOINT_NAME) as z:  # the JSON header
        assert json.loads(str(z["meta"]))["algorithm_name"] == "local"
    with pytest.raises(ValueError, match=r"was written by local, this run is karula"):
        training.run(ALGOS["karula"](), THETA, DATA, **{**opts, "num_rounds": 2}, resume=True)
    with pytest.raises(ValueError, match=r"was written by local, this run is fedsgd"):
        training.run(ALGOS["fedsgd"](), THETA, DATA, **{**opts, "num_rounds": 2}, resume=True)
    batched = lambda: training.run_many(  # noqa: E731
        lambda: ALGOS["local"](), THETA, DATA, keys=jax.random.split(KEY, 2),
        num_rounds=2, checkpoint_dir=tmp_path, resume=True, progress=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"by local, this run is local \(batched by run_many\)"):
        batched()


def test_labels_outside_the_classes_are_refused_by_the_runners():
    """A classifier's labels are checked when the loss is first applied: by init on
    concrete data, inside the compiled init (reported before any round) under run and
    run_many (issue 27)."""
    model = models.mlp(3, 8)
    params = models.init_params(model, KEY, (1, DIM))
    make = lambda lr: fedavg(models.cross_entropy_loss(model.apply), learning_rate=lr,
                             clients_per_round=2, batch_size=2)  # fmt: skip
    match = r"labels data.y lie outside the model's 8 classes \[0, 8\).*Nothing was run"
    with pytest.raises(ValueError, match=match):
        training.run(make(0.1), params, LABELS_0_9, key=KEY, num_rounds=1, progress=False)
    members = jax.tree.map(lambda a: jnp.stack([a, a]), LABELS_0_9)
    members = members._replace(y=members.y.at[0].set(members.y[0] % 8))  # member 0 is fine
    with pytest.raises(ValueError, match=match.replace("Nothing", r"in batch member 1\. Nothing")):
        training.run_many(make, params, members, keys=jax.random.split(KEY, 2), num_rounds=1,
                          data_per_seed=True, batch_kwargs={"lr": jnp.array([0.1, 0.1])},
                          progress=False)  # fmt: skip


def test_nonfinite_report_names_the_data_first():
    """ClientData built directly with NaN features: the non-finite report names the client
    whose real rows hold NaN, then the labels, then the step size (issue 27)."""
    bad = DATA._replace(x=DATA.x.at[2, 1, 0].set(jnp.nan))
    with pytest.raises(FloatingPointError) as err:
        training.run(LOCAL, THETA, bad, key=KEY, num_rounds=1, progress=False)
    msg = str(err.value)
    first = msg.index("(1) non-finite data: data.x has NaN or inf in the real rows of client 2")
    assert first < msg.index("(2) labels outside the model's classes") < msg.index("(3) a step")
    finite = str(training.diagnostics.nonfinite_error(3, np.array(False), "none", ""))
    assert "(1) non-finite data: none found" in finite and "lower learning_rate" in finite
    padded = DATA._replace(x=DATA.x.at[0, 3, 0].set(jnp.inf))  # padding: not a cause
    assert training.diagnostics.nonfinite_data(padded) == ""
    assert "(batch member, client) pair (1, 2)" in training.diagnostics.nonfinite_data(
        jax.tree.map(lambda a, b: jnp.stack([a, b]), DATA, bad)
    )


def test_karula_trains_on_a_D_symmetric_to_its_tolerance():
    """D asymmetric by 5e-6 relative (or 1e-7 facing 0) passes karula's check (rtol 1e-5,
    atol 1e-6); the traced radii t * D must not then be blanked as invalid inside the
    compiled run (a review found that they were)."""
    for bad in (D.at[0, 1].multiply(1 + 5e-6), D.at[0, 1].set(1e-7).at[1, 0].set(0.0)):
        alg = karula(LOSS, bad, t=0.01, **HP)
        res = training.run(alg, THETA, DATA, key=KEY, num_rounds=3, progress=False)
        assert np.isfinite(np.asarray(jax.tree.leaves(res.state.params)[0])).all()


def test_mean_normalized_leaves_a_matrix_without_spread_as_it_is():
    """Identical clients (every off-diagonal entry 0) and n = 1 have no scale: D stays as
    it is (0 / 0 made it all NaN); other matrices are divided by their off-diagonal mean."""
    for D in (np.zeros((3, 3)), np.zeros((1, 1)), jnp.zeros((2, 4, 4))):
        out = protocol.mean_normalized(D)
        assert np.all(np.asarray(out) == 0) and type(out) is type(D)
    D = np.array([[0.0, 2.0, 4.0], [2.0, 0.0, 6.0], [4.0, 6.0, 0.0]])
    # integer sums and a division by the mean 4, a power of 2: exact, in float64 and float32
    np.testing.assert_array_equal(protocol.mean_normalized(D), D / 4.0)
    stacked = jnp.stack([jnp.zeros((3, 3)), jnp.asarray(D, jnp.float32)])
    np.testing.assert_array_equal(protocol.mean_normalized(stacked)[1], D / 4.0)


def test_vmap_algorithm_names_a_single_key():
    make = lambda learning_rate: fedavg(LOSS, learning_rate=learning_rate, **HP_NO_RATE)  # noqa: E731
    alg = training.vmap_algorithm(make, {"learning_rate": jnp.array([0.01, 0.1])})
    with pytest.raises(ValueError, match=r"key must be stacked keys \[S\]"):
        alg.init(THETA, DATA, key=KEY)


def test_losses_check_the_mask_labels_and_logits_and_diverged_models_have_no_accuracy():
    """A mask ``[B, 1]`` broadcast the loss into ``[B, B]`` and a float mask weighted rows;
    per-position logits ``[B, T, C]`` were read at position 0; label -1 wrapped to the last
    class; a NaN model scored the share of label-0 rows as its accuracy."""
    net = models.mlp(hidden=4, num_classes=3)
    p = models.init_params(net, KEY, (1, 5))
    ce, acc = models.cross_entropy_loss(net.apply), models.accuracy(net.apply)
    x, y = jax.random.normal(KEY, (6, 5)), jnp.array([0, 1, 2, 0, 1, 2])
    mask = jnp.ones(6, bool)
    assert np.isfinite(float(ce(p, x, y, mask)))
    with pytest.raises(ValueError, match=r"mask must have shape \(6,\), got \(6, 1\)"):
        ce(p, x, y, mask[:, None])
    with pytest.raises(TypeError, match="mask must be boolean"):
        LOSS(THETA, X[0], Y[0], jnp.full(4, 0.5))
    with pytest.raises(ValueError, match=r"logits \[B, C\]"):
        ce(p, x.reshape(2, 3, 5), y.reshape(2, 3), mask.reshape(2, 3))
    assert np.isnan(float(ce(p, x, y.at[0].set(-1), mask)))
    assert np.isfinite(float(ce(p, x, y.at[0].set(-1), mask.at[0].set(False))))  # padding
    nan_p = jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), p)
    assert np.isnan(float(acc(nan_p, x, y, mask)))
    logistic = {"w": jnp.full((DIM,), jnp.nan), "b": jnp.zeros(())}
    assert np.isnan(float(models.logistic_accuracy(logistic, X[0], Y[0], DATA.mask[0])))
    per_client = kj.evaluation.accuracy(
        net.apply,
        jax.tree.map(lambda a: a[None], nan_p),
        ClientData(x[None], y[None], jnp.array([6])),
    )
    assert np.isnan(np.asarray(per_client)).all()
