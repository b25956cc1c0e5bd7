"""karula_jax._linalg: same values as jnp.linalg, and batches that never use jaxlib's pool."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerances import EPS32, EPS64, reordered_sum

from karula_jax import _linalg


def _eig_tol(n, norm):
    """Error bound of a backward-stable symmetric eigensolver (LAPACK's) in float32, as
    eigenvalues or residual ``V W V^T - A``: ``p(n) u ||A||_2`` (Weyl), ``p(n) = 2 (n + 2)``
    for the ``n`` reflections and the scalar steps (measured at most 3.6 ``EPS32 ||A||``)."""
    return reordered_sum(n + 2) * norm


def _qr_tol(shape, eps):
    """Columnwise backward error of a Householder ``Q`` (Higham, Theorem 19.4): ``r``
    reflections, each an ``m``-term dot product and 4 scalar roundings, ``m r u`` worst case
    (measured at most 8 ``eps``, 30 ``eps`` for ``Q Q^T a``)."""
    m, k = shape[-2:]
    return reordered_sum(m + 4, rounds=min(m, k), eps=eps)


def _assert_inverse(got, a, ref, eps):
    """``got`` within elimination's bound of ``ref = a^-1``, entry by entry: without
    pivoting on a diagonally dominant matrix (growth at most 2) the componentwise backward
    error is ``n + 2`` roundings of ``|a|`` (the pivots' divisions and square roots too), so
    ``|got - ref| <= (n + 2) eps |ref| |a| |ref|`` (measured at most 1.1 ``eps`` of it)."""
    a = np.asarray(a, np.float64)
    err = np.abs(np.asarray(got, np.float64) - ref)
    bound = reordered_sum(a.shape[-1] + 2, eps=eps) * (np.abs(ref) @ np.abs(a) @ np.abs(ref))
    assert np.all(err <= bound), float(np.max(err - bound))


def _spd(shape, seed=0):
    a = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    n = shape[-1]
    return a @ np.swapaxes(a, -1, -2) + n * np.eye(n, dtype=np.float32)


@pytest.mark.parametrize("n", [1, 2, 7, 30])
def test_values_match_numpy_unbatched_batched_and_nested_vmap(n):
    a = _spd((2, 3, n, n), seed=n)
    ref_w = np.linalg.eigvalsh(a.astype(np.float64))
    tol = dict(rtol=0, atol=_eig_tol(n, ref_w.max()))  # the largest eigenvalue: ||A||_2
    np.testing.assert_allclose(_linalg.eigvalsh(a[0, 0]), ref_w[0, 0], **tol)
    np.testing.assert_allclose(_linalg.eigvalsh(a), ref_w, **tol)
    np.testing.assert_allclose(jax.jit(jax.vmap(jax.vmap(_linalg.eigvalsh)))(a), ref_w, **tol)
    w, v = jax.vmap(_linalg.eigh)(a[0])
    np.testing.assert_allclose(w, ref_w[0], **tol)
    w, v = np.asarray(w, np.float64), np.asarray(v, np.float64)  # the residual in float64
    np.testing.assert_allclose(v @ (w[..., None] * np.swapaxes(v, -1, -2)), a[0], **tol)
    # unbatched arguments of a vmapped call are broadcast
    b = jnp.asarray(a[0, 0])
    out = jax.vmap(lambda s: s * _linalg.eigvalsh(b))(jnp.arange(3.0))
    # times 2 (exact): twice the error
    np.testing.assert_allclose(out[2], 2 * ref_w[0, 0], rtol=0, atol=2 * tol["atol"])


@pytest.mark.parametrize(
    "shape",
    [(1, 1), (3, 1), (1, 3), (5, 3), (3, 5), (4, 4), (50, 30), (4, 9, 4), (2442, 15), (100, 70)]
    + [(70, 100), (300, 64)],  # several panels of 32 reflections, the last one padded
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_qr_q_is_orthonormal_spans_the_columns_and_equals_lapacks(shape, dtype):
    a = np.random.default_rng(1).normal(size=shape).astype(dtype)
    with jax.enable_x64(dtype == np.float64):
        q = np.asarray(jax.jit(jax.vmap(_linalg.qr_q))(a[None])[0])
        assert q.dtype == dtype
    r = min(shape[-2:])
    eye = np.broadcast_to(np.eye(r), q.shape[:-2] + (r, r))
    # raised where m r is large: from 1e-5 (float32) and 1e-12 (float64) to m r eps, up to
    # 4.4e-3 and 8e-12 at 2442 x 15
    atol = _qr_tol(shape, EPS32 if dtype == np.float32 else EPS64)
    q, a = q.astype(np.float64), a.astype(np.float64)  # the checks' own products in float64
    np.testing.assert_allclose(np.swapaxes(q, -1, -2) @ q, eye, atol=atol)
    # columns of a in Q's span: Q's backward error relative to each column's norm, twice
    # (the check's own products, in the computation's dtype, round as much again at most)
    col = np.linalg.norm(a, axis=-2, keepdims=True)
    assert np.all(np.abs(q @ (np.swapaxes(q, -1, -2) @ a) - a) <= 2 * atol * col)
    # the same signs as LAPACK's Householder QR (numpy's), column by column: two backward
    # errors apart (a flipped sign is 2 max|q_j| >= 0.13 apart here); Q's sensitivity can
    # add up to kappa(a) (8e3 at 70 x 100), but measured within 30 eps
    np.testing.assert_allclose(q, np.linalg.qr(a)[0], atol=2 * atol)


@pytest.mark.parametrize("kind", ["zero", "repeated", "rank one", "huge", "tiny"])
def test_qr_q_of_degenerate_matrices_is_orthonormal_and_finite(kind):
    rng = np.random.default_rng(2)
    a = {
        "zero": np.zeros((90, 40)),
        "repeated": np.repeat(rng.normal(size=(90, 8)), 5, axis=1),
        "rank one": np.outer(rng.normal(size=90), rng.normal(size=40)),
        "huge": 1e30 * rng.normal(size=(90, 40)),
        "tiny": 1e-30 * rng.normal(size=(90, 40)),
    }[kind].astype(np.float32)
    q = np.asarray(_linalg.qr_q(a), np.float64)
    assert np.isfinite(q).all()
    # raised from 1e-5 to the bound of _qr_tol, 4.5e-4 (measured 1.3e-6)
    atol = _qr_tol(a.shape, EPS32)
    np.testing.assert_allclose(q.T @ q, np.eye(40), atol=atol)
    scale = np.abs(a).max() if np.abs(a).max() > 0 else 1.0
    a = a.astype(np.float64) / scale
    # as above, relative to each column's norm (the scaling, in float64, rounds 1e-16)
    col = np.linalg.norm(a, axis=0, keepdims=True)
    assert np.all(np.abs(q @ (q.T @ a) - a) <= 2 * atol * col)


def test_bad_shape_is_a_value_error():
    with pytest.raises(ValueError, match="matrix"):
        _linalg.eigvalsh(jnp.ones(3))


def _lapack_lines(hlo_text):
    return [line for line in hlo_text.splitlines() if 'custom_call_target="lapack_' in line]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="LAPACK custom calls are CPU only")
def test_batched_calls_reach_lapack_one_matrix_at_a_time():
    # jaxlib 0.10 runs a batched LAPACK call of more than ~2e5 flops on XLA's thread pool,
    # which deadlocks when pool-size such calls run at once; unbatched calls run inline.
    a = _spd((4, 8, 30, 30))
    fns = {
        "vmap(vmap(eigvalsh))": jax.vmap(jax.vmap(_linalg.eigvalsh)),
        "leading axes": _linalg.eigvalsh,
        "vmap(eigvalsh)": jax.vmap(_linalg.eigvalsh),
    }
    for name, fn in fns.items():
        txt = jax.jit(fn).lower(a).compile().as_text()
        # the first shape of each LAPACK line is its (first) result's
        calls = [re.search(r"f32\[[0-9,]*\]", line)[0] for line in _lapack_lines(txt)]
        assert calls and all(shape == "f32[30,30]" for shape in calls), (name, calls)
    # qr_q calls no LAPACK at all on the CPU (plain Householder reflections)
    txt = jax.jit(jax.vmap(jax.vmap(_linalg.qr_q))).lower(a).compile().as_text()
    assert not _lapack_lines(txt)
    # the plain jnp call is batched: the check above can fail
    txt = jax.jit(jax.vmap(jnp.linalg.inv)).lower(a[0]).compile().as_text()
    assert any("f32[8,30,30]" in line for line in _lapack_lines(txt))


def _dominant(shape, seed=0):
    """A positive diagonal plus a graph Laplacian (the projection's ``M + L_lam``)."""
    rng = np.random.default_rng(seed)
    n = shape[-1]
    w = np.triu(rng.uniform(0, 5, size=shape) * (rng.uniform(size=shape) < 0.5), 1)
    w = w + np.swapaxes(w, -1, -2)
    mass = rng.uniform(1, 3, size=shape[:-1])
    return (np.eye(n) * (mass + w.sum(-1))[..., None] - w).astype(np.float32)


@pytest.mark.parametrize("n", [1, 2, 7, 30, 49, 96, 101])
def test_inv_spd_dominant_matches_numpy_unbatched_batched_and_nested_vmap(n):
    a = _dominant((2, 3, n, n), seed=n)
    ref = np.linalg.inv(a.astype(np.float64))
    _assert_inverse(_linalg.inv_spd_dominant(a[0, 0]), a[0, 0], ref[0, 0], EPS32)
    _assert_inverse(_linalg.inv_spd_dominant(a), a, ref, EPS32)
    inv = jax.jit(jax.vmap(jax.vmap(_linalg.inv_spd_dominant)))
    _assert_inverse(inv(a), a, ref, EPS32)
    if jax.default_backend() == "cpu":
        # the CPU's elimination reads the whole matrix: a non-symmetric, row-dominant one too
        b = a[0, 0] + np.triu(np.full((n, n), 0.1 / n, np.float32), 1)
        _assert_inverse(_linalg.inv_spd_dominant(b), b, np.linalg.inv(b.astype(np.float64)), EPS32)


@pytest.mark.parametrize("n", [1, 2, 7, 30, 101])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_inv_spd_dominant_on_every_platform_path(n, dtype):
    """The CPU's Gauss-Jordan and the accelerators' Cholesky inverse (called directly
    here: this machine lowers only the CPU branch) against numpy in float64."""
    a = _dominant((3, n, n), seed=n).astype(dtype)
    ref = np.linalg.inv(a.astype(np.float64))
    eps = EPS32 if dtype == np.float32 else EPS64
    with jax.enable_x64(dtype == np.float64):
        _assert_inverse(_linalg.inv_spd_dominant(a), a, ref, eps)
        cholesky = jax.jit(jax.vmap(_linalg._cholesky_inverse))(jnp.asarray(a))
        assert cholesky.dtype == dtype
        _assert_inverse(cholesky, a, ref, eps)
        _assert_inverse(jax.vmap(_linalg.inv_spd_dominant)(a), a, ref, eps)


def test_inv_spd_dominant_lowers_to_cholesky_on_gpus_no_lapack_on_cpus_checks_its_shape():
    """Which inverse each platform compiles: exported for CUDA (no GPU needed), the
    Cholesky factorization and no LU; compiled here on the CPU (batched under vmap, as
    the projection's members are), no LAPACK call at all (see the module docstring)."""
    a = jnp.asarray(_dominant((4, 30, 30)))
    gpu = jax.export.export(jax.jit(_linalg.inv_spd_dominant), platforms=["cuda"])(a[0])
    text = gpu.mlir_module()
    assert "cusolver_potrf" in text and "getrf" not in text
    if jax.default_backend() == "cpu":
        txt = jax.jit(jax.vmap(_linalg.inv_spd_dominant)).lower(a).compile().as_text()
        assert not _lapack_lines(txt)
    with pytest.raises(ValueError, match="square"):
        _linalg.inv_spd_dominant(jnp.ones((3, 4)))


def _assert_solve(got, a, b, eps):
    """``got`` within a backward-stable SPD solve's normwise bound of ``a^-1 b``: a backward
    error of ``3 m + 2`` roundings of ``|a|`` (the factor or elimination and the
    substitutions or the product) grows into ``kappa_2(a)`` times that in the solution
    (Higham, Theorem 10.4 and section 14.4)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ref = np.linalg.solve(a, b[..., None])[..., 0]
    m = a.shape[-1]
    kappa = np.linalg.cond(a)[..., None] if a.ndim > 2 else np.linalg.cond(a)
    err = np.linalg.norm(np.asarray(got, np.float64) - ref, axis=-1, keepdims=True)
    bound = reordered_sum(3 * m + 2, eps=eps) * kappa * np.linalg.norm(ref, axis=-1, keepdims=True)
    assert np.all(err <= bound), float(np.max(err - bound))


def _spd_conditioned(shape, kappa, seed):
    """Symmetric positive definite ``[..., m, m]`` with eigenvalues from 1 to ``kappa``
    (log-spaced) in a random orthonormal basis, as a damped pair Hessian is."""
    rng = np.random.default_rng(seed)
    m = shape[-1]
    q, _ = np.linalg.qr(rng.normal(size=shape))
    w = np.logspace(0, np.log10(kappa), m)
    return (q * w) @ np.swapaxes(q, -1, -2)


@pytest.mark.parametrize("m", [1, 2, 7, 48, 49, 130])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_solve_spd_on_every_platform_path(m, dtype):
    """The CPU's Gauss-Jordan and the accelerators' Cholesky solve (called directly: this
    machine lowers only the CPU branch), unbatched, batched and vmapped, against numpy in
    float64, at condition numbers 1e2 and 1e4."""
    eps = EPS32 if dtype == np.float32 else EPS64
    for kappa in (1e2, 1e4):
        a = _spd_conditioned((3, m, m), kappa, seed=m).astype(dtype)
        b = np.random.default_rng(m + 1).normal(size=(3, m)).astype(dtype)
        with jax.enable_x64(dtype == np.float64):
            got = _linalg.solve_spd(a, b)
            assert got.dtype == dtype and got.shape == (3, m)
            _assert_solve(got, a, b, eps)
            _assert_solve(_linalg.solve_spd(a[0], b[0]), a[0], b[0], eps)
            _assert_solve(jax.jit(jax.vmap(_linalg.solve_spd))(a, b), a, b, eps)
            ab = jnp.concatenate([jnp.asarray(a), jnp.asarray(b)[..., None]], axis=-1)
            _assert_solve(jax.vmap(_linalg._cholesky_solve)(ab)[..., 0], a, b, eps)
            _assert_solve(jax.vmap(_linalg._gauss_jordan_solve)(ab)[..., 0], a, b, eps)


def test_solve_spd_lowers_to_cholesky_on_gpus_no_lapack_on_cpus_checks_its_shapes():
    a = jnp.asarray(_spd((4, 30, 30)))
    b = jnp.ones((4, 30))
    gpu = jax.export.export(jax.jit(_linalg.solve_spd), platforms=["cuda"])(a[0], b[0])
    text = gpu.mlir_module()
    assert "cusolver_potrf" in text and "getrf" not in text
    if jax.default_backend() == "cpu":
        txt = jax.jit(jax.vmap(_linalg.solve_spd)).lower(a, b).compile().as_text()
        assert not _lapack_lines(txt)
    for bad_a, bad_b in [(jnp.ones((3, 4)), jnp.ones(3)), (a[0], jnp.ones(29)), (a, b[0])]:
        with pytest.raises(ValueError, match=r"square matrix \[\.\.\., m, m\] and a vector"):
            _linalg.solve_spd(bad_a, bad_b)
