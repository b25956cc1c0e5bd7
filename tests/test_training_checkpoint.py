"""Checkpoints (``karula_jax.training.checkpoint``): bit-identical resume, the file format,
refusing another run, damaged files, a kill mid-write.

They run on the toy algorithm of ``tests/_training_helpers.py``, so that they do not
depend on the real algorithms.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _training_helpers import (
    ALG,
    DATA,
    PARAMS,
    eval_fn,
    fresh_trace_counters,  # noqa: F401 - the autouse fixture
    leaves_equal,
    toy,
    traced_at_most,
)

from karula_jax import training
from karula_jax.algorithms.base import RoundInfo
from karula_jax.training import checkpoint, loop


@pytest.mark.parametrize("typed_key", [False, True])
def test_resume_is_bit_identical(tmp_path, typed_key):
    alg = ALG
    key = jax.random.key(11) if typed_key else jax.random.PRNGKey(11)
    kw = dict(chunk_size=2, eval_fn=eval_fn, progress=False)
    full = training.run(
        alg, PARAMS, DATA, key=key, num_rounds=6, checkpoint_dir=tmp_path / "a", **kw
    )
    # A run killed after 4 rounds (its checkpoint is all that is left) ...
    training.run(alg, PARAMS, DATA, key=key, num_rounds=4, checkpoint_dir=tmp_path / "b", **kw)
    # ... resumed to 6 rounds in a fresh call.
    resumed = training.run(
        alg,
        PARAMS,
        DATA,
        key=key,
        num_rounds=6,
        checkpoint_dir=tmp_path / "b",
        resume=True,
        **kw,
    )
    leaves_equal(full.state, resumed.state)
    leaves_equal(full.info, resumed.info)
    assert resumed.info.loss.shape == (6,)
    np.testing.assert_array_equal(full.metric_rounds, resumed.metric_rounds)
    for name in full.metrics:
        np.testing.assert_array_equal(full.metrics[name], resumed.metrics[name])
    # Both checkpoints now hold the same thing.
    za = np.load(tmp_path / "a" / training.CHECKPOINT_NAME, allow_pickle=False)
    zb = np.load(tmp_path / "b" / training.CHECKPOINT_NAME, allow_pickle=False)
    assert za.files == zb.files
    for name in za.files:
        np.testing.assert_array_equal(za[name], zb[name])
    # Resuming a finished run returns it without running anything.
    again = training.run(
        alg,
        PARAMS,
        DATA,
        key=key,
        num_rounds=6,
        checkpoint_dir=tmp_path / "b",
        resume=True,
        **kw,
    )
    leaves_equal(full.state, again.state)
    assert again.timings["compile_s"] == 0.0


def test_checkpoint_is_plain_npz_and_roundtrips(tmp_path):
    alg = ALG
    key = jax.random.key(2)
    res = training.run(
        alg,
        PARAMS,
        DATA,
        key=key,
        num_rounds=3,
        chunk_size=2,
        eval_fn=eval_fn,
        checkpoint_dir=tmp_path,
        progress=False,
    )
    path = tmp_path / training.CHECKPOINT_NAME
    assert sorted(os.listdir(tmp_path)) == [training.CHECKPOINT_NAME]  # no temp files left
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}  # would raise if anything needed pickle
    assert all(a.dtype != object for a in arrays.values())
    meta = json.loads(str(arrays["meta"]))
    assert meta["rounds_done"] == 3 and meta["metric_names"] == ["loss", "mean_b"]
    template = jax.eval_shape(alg.init, PARAMS, DATA, key=key)
    state, hist, _ = training.load_checkpoint(path, template)
    leaves_equal(state, res.state)
    assert jax.dtypes.issubdtype(state.key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(hist["metric_rounds"], [0, 2, 3])
    np.testing.assert_array_equal(hist["info"].participants, res.info.participants)


# --------------------------------------------------------------------------- resume refuses


def _resume(alg, tmp_path, *, params=PARAMS, data=DATA, key=None, chunk_size=2, num_rounds=4):
    key = jax.random.PRNGKey(0) if key is None else key
    return training.run(
        alg,
        params,
        data,
        key=key,
        num_rounds=num_rounds,
        chunk_size=chunk_size,
        checkpoint_dir=tmp_path,
        resume=True,
        progress=False,
    )


def test_resume_refuses_another_run_and_names_what_differs(tmp_path):
    key = jax.random.PRNGKey(0)
    training.run(
        ALG,
        PARAMS,
        DATA,
        key=key,
        num_rounds=2,
        chunk_size=2,
        checkpoint_dir=tmp_path,
        progress=False,
    )
    path = str(tmp_path / training.CHECKPOINT_NAME)

    def refused(what, **kw):
        return pytest.raises(ValueError, match=rf"checkpoint {path} .*What differs: .*{what}")

    chunks = loop._jitted_chunk.cache_info().misses
    with refused(r"algorithm or hyperparameters"):
        _resume(toy(eta=0.31), tmp_path)  # a Python float: a literal of the program
    with refused(r"algorithm or hyperparameters"):
        _resume(toy(t=jnp.float32(0.6)), tmp_path)  # an array: a constant of the program
    with refused(r"algorithm or hyperparameters"):
        _resume(toy(s=3), tmp_path)
    assert loop._jitted_chunk.cache_info().misses == chunks  # refused before any chunk
    other = DATA._replace(x=DATA.x.at[0, 0, 0].add(1e-3))  # same shapes and counts
    with refused(r"data content"):
        _resume(ALG, tmp_path, data=other)
    with refused(r"initial params"):
        _resume(ALG, tmp_path, params={"a": jnp.ones(3), "b": jnp.zeros(())})
    with refused(r"chunk_size \(checkpoint: 2, this run: 3"):
        _resume(ALG, tmp_path, chunk_size=3)
    with refused(r"different key"):
        _resume(ALG, tmp_path, key=jax.random.PRNGKey(1))
    with refused(r"algorithm or hyperparameters.*; data content.*; chunk_size"):
        _resume(toy(eta=0.2), tmp_path, data=other, chunk_size=1)
    # The same run (a new but identical algorithm object) is accepted.
    res = _resume(toy(), tmp_path)
    assert res.info.loss.shape == (4,)


def test_a_python_scalar_in_the_initial_model_is_fingerprinted(tmp_path):
    """The fingerprint traces shapes and dtypes: a Python float leaf has no ``.dtype``."""
    params = {"a": jnp.zeros(3), "b": 0.0}
    kw = dict(key=jax.random.PRNGKey(0), chunk_size=2, checkpoint_dir=tmp_path, progress=False)
    training.run(ALG, params, DATA, num_rounds=2, **kw)
    res = training.run(ALG, params, DATA, num_rounds=4, resume=True, **kw)
    assert res.info.loss.shape == (4,)


# --------------------------------------------------------------------------- bad checkpoint files


@pytest.fixture(scope="module")
def valid_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("valid")
    training.run(
        ALG,
        PARAMS,
        DATA,
        key=jax.random.PRNGKey(0),
        num_rounds=2,
        chunk_size=2,
        eval_fn=eval_fn,
        checkpoint_dir=directory,
        progress=False,
    )
    path = directory / training.CHECKPOINT_NAME
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return path.read_bytes(), arrays


def _npz_bytes(arrays, tmp_path):
    np.savez(tmp_path / "scratch.npz", **arrays)
    return (tmp_path / "scratch.npz").read_bytes()


def _with_meta(arrays, **changes):
    meta = json.loads(str(arrays["meta"]))
    meta.update(changes)
    return {**arrays, "meta": np.array(json.dumps(meta))}


BAD_FILES = {
    "empty": lambda good, arrays, tmp: b"",
    "truncated": lambda good, arrays, tmp: good[: len(good) // 2],
    "random bytes": lambda good, arrays, tmp: np.random.default_rng(0).bytes(5000),
    "npy, not npz": lambda good, arrays, tmp: (
        np.save(tmp / "x.npy", np.zeros(3)),
        (tmp / "x.npy").read_bytes(),
    )[1],
    "no meta": lambda good, arrays, tmp: _npz_bytes(
        {k: v for k, v in arrays.items() if k != "meta"}, tmp
    ),
    "malformed JSON": lambda good, arrays, tmp: _npz_bytes(
        {**arrays, "meta": np.array('{"format": ')}, tmp
    ),
    "meta not an object": lambda good, arrays, tmp: _npz_bytes(
        {**arrays, "meta": np.array("[1, 2]")}, tmp
    ),
    "meta missing fields": lambda good, arrays, tmp: _npz_bytes(
        {**arrays, "meta": np.array(json.dumps({"format": checkpoint._FORMAT}))}, tmp
    ),
    "missing state array": lambda good, arrays, tmp: _npz_bytes(
        {k: v for k, v in arrays.items() if k != "state_0001"}, tmp
    ),
    "missing info array": lambda good, arrays, tmp: _npz_bytes(
        {k: v for k, v in arrays.items() if k != "info_loss"}, tmp
    ),
    "state array of wrong shape": lambda good, arrays, tmp: _npz_bytes(
        {**arrays, "state_0000": np.zeros((2, 2), np.float32)}, tmp
    ),
    "pickled object array": lambda good, arrays, tmp: _npz_bytes(
        {**arrays, "info_loss": np.array([{"a": 1}], dtype=object)}, tmp
    ),
    "older format": lambda good, arrays, tmp: _npz_bytes(
        _with_meta(arrays, format="karula_jax.training.checkpoint/1"), tmp
    ),
}


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_bad_checkpoint_files_name_the_checkpoint(tmp_path, valid_checkpoint, kind):
    good, arrays = valid_checkpoint
    content = BAD_FILES[kind](good, arrays, tmp_path)
    directory = tmp_path / "ckpt"
    directory.mkdir()
    path = directory / training.CHECKPOINT_NAME
    path.write_bytes(content)
    key = jax.random.PRNGKey(0)
    template = jax.eval_shape(ALG.init, PARAMS, DATA, key=key)
    pattern = rf"checkpoint {path} is corrupt or not a karula_jax checkpoint"
    with pytest.raises(ValueError, match=pattern) as exc:
        training.load_checkpoint(path, template)
    assert "pickle" not in str(exc.value)
    with pytest.raises(ValueError, match=pattern) as exc:
        _resume(ALG, directory)
    assert "pickle" not in str(exc.value)


def test_checkpoint_with_other_round_info_fields_is_refused(tmp_path, valid_checkpoint):
    _, arrays = valid_checkpoint
    old = {k: v for k, v in arrays.items() if k != "info_proj_converged"}
    fields = [f for f in RoundInfo._fields if f != "proj_converged"]
    (tmp_path / training.CHECKPOINT_NAME).write_bytes(
        _npz_bytes(_with_meta(old, info_fields=fields), tmp_path)
    )
    template = jax.eval_shape(ALG.init, PARAMS, DATA, key=jax.random.PRNGKey(0))
    with pytest.raises(
        ValueError, match=r"holds round info with fields .* \(missing: \['proj_converged'\]"
    ):
        training.load_checkpoint(tmp_path / training.CHECKPOINT_NAME, template)


# --------------------------------------------------------------------------- checkpoint directory


def test_unwritable_checkpoint_dir_fails_before_compiling(tmp_path, monkeypatch):
    alg = toy(traced=traced_at_most(0))  # nothing may be traced, let alone compiled
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    for where in (blocker / "sub", blocker):
        with pytest.raises(OSError, match=rf"checkpoint_dir '{where}' cannot be created"):
            training.run(
                alg, PARAMS, DATA, key=jax.random.PRNGKey(0), num_rounds=2, checkpoint_dir=where
            )

    # Permission bits do not stop root, so a refused write is simulated.
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(checkpoint.tempfile, "mkstemp", refuse)
    with pytest.raises(PermissionError, match=r"checkpoint_dir .*read_only.* cannot be"):
        training.run(
            alg,
            PARAMS,
            DATA,
            key=jax.random.PRNGKey(0),
            num_rounds=2,
            checkpoint_dir=tmp_path / "read_only",
        )


def test_run_removes_temporary_files_left_by_a_kill(tmp_path):
    stale = tmp_path / f"{checkpoint._TMP_PREFIX}abc123.npz"
    stale.write_bytes(b"half a checkpoint")
    unrelated = [tmp_path / "notes.txt", tmp_path / ".tmp-someone-else.npz"]
    for f in unrelated:
        f.write_text("keep me")
    training.run(
        ALG,
        PARAMS,
        DATA,
        key=jax.random.PRNGKey(0),
        num_rounds=2,
        checkpoint_dir=tmp_path,
        progress=False,
    )
    assert not stale.exists()
    assert all(f.exists() for f in unrelated)
    assert (tmp_path / training.CHECKPOINT_NAME).exists()


KILLED_WRITER = """
import os, signal, sys
import numpy as np
from karula_jax import training

def savez_then_die(f, **arrays):
    f.write(b"PK\\x03\\x04 a torn archive")
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)

training.checkpoint.np.savez = savez_then_die
training.save_checkpoint(sys.argv[1], {"a": np.ones(3)}, rounds_done=2)
"""


def test_checkpoint_survives_a_kill_mid_write_and_run_cleans_up(tmp_path):
    import signal
    import subprocess
    import sys

    path = tmp_path / training.CHECKPOINT_NAME
    training.save_checkpoint(path, {"a": np.zeros(3)}, rounds_done=1)
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, str(path)],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    leftovers = [f for f in os.listdir(tmp_path) if f.startswith(checkpoint._TMP_PREFIX)]
    assert len(leftovers) == 1
    state, _, meta = training.load_checkpoint(path, {"a": np.zeros(3)})  # the old one, intact
    assert meta["rounds_done"] == 1 and not np.asarray(state["a"]).any()
    training.run(
        ALG,
        PARAMS,
        DATA,
        key=jax.random.PRNGKey(0),
        num_rounds=2,
        checkpoint_dir=tmp_path,
        progress=False,
    )
    assert sorted(os.listdir(tmp_path)) == [training.CHECKPOINT_NAME]


def test_save_refuses_what_it_cannot_store_and_load_keeps_64_bit_values(tmp_path):
    """An object array would be pickled by np.savez (then reported 'corrupt' on load): it is
    refused when saving, naming it; extra_meta may not overwrite the format's own fields
    (rounds_done=500 replaced the real 2); a 64-bit leaf without x64 comes back as the
    numpy array it was (jnp.asarray narrowed 2**40 + 7 to 7)."""
    from karula_jax.training import load_checkpoint, save_checkpoint

    path = tmp_path / "c.npz"
    objects = np.array([{"x": 1}], dtype=object)
    with pytest.raises(TypeError, match="metric 'm' has dtype object"):
        save_checkpoint(path, {"a": jnp.ones(2)}, rounds_done=1, metrics={"m": objects})
    with pytest.raises(TypeError, match="state leaf 0 has dtype"):
        save_checkpoint(path, {"a": np.array(["x"])}, rounds_done=1)
    with pytest.raises(ValueError, match=r"\['rounds_done'\]"):
        save_checkpoint(path, {"a": jnp.ones(2)}, rounds_done=2, extra_meta={"rounds_done": 500})
    big = {"n": np.array([2**40 + 7], np.int64), "w": jnp.ones(2)}
    save_checkpoint(path, big, rounds_done=2, extra_meta={"note": "ok"})
    state, _, meta = load_checkpoint(path, big)
    assert meta["rounds_done"] == 2 and meta["note"] == "ok"
    if not jax.config.jax_enable_x64:
        assert state["n"].dtype == np.int64 and int(state["n"][0]) == 2**40 + 7
    np.testing.assert_array_equal(state["w"], np.ones(2))
