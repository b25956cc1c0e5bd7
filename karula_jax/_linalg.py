"""Dense factorizations whose batches cannot hang XLA's CPU thread pool.

jaxlib 0.10 splits a batched LAPACK call (LU, triangular solve, QR, eigh) of more than
about 2e5 flops into chunks on XLA's intra-op thread pool, and the calling thread, itself a
pool thread, blocks until they finish. When as many such calls run at once as the pool has
threads (2 on a 2-core machine: e.g. two independent inverses in a vmapped while loop,
which XLA's thunk executor starts concurrently), every thread blocks and the program hangs
(the reproducer and how often it hung: ``docs/implementation_notes.md``). Later
open-source jaxlib builds no longer parallelize these calls.

``eigh`` and ``eigvalsh`` batch, under ``jax.vmap`` or over leading axes, as a loop of
unbatched calls on the CPU (jaxlib runs an unbatched call inline) and as one batched call
on other platforms. Nested vmaps stay unbatched too: the loop body calls the wrapped
function again, so every enclosing vmap applies the same rule. ``qr_q`` and
``inv_spd_dominant`` call no LAPACK on the CPU at all (plain XLA operations, which batch as
array operations) and the batched ``jnp`` routines elsewhere (:func:`_per_platform`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["eigh", "eigvalsh", "inv_spd_dominant", "qr_q", "solve_spd"]


def _unbatched_on_cpu(fn):
    """``fn`` on single matrices, with a vmap rule that loops over the batch on the CPU."""
    one = jax.custom_batching.custom_vmap(fn)

    @one.def_vmap
    def _rule(axis_size, in_batched, *args):
        args = [
            a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
            for a, batched in zip(args, in_batched, strict=True)
        ]
        out = jax.lax.platform_dependent(
            *args,
            cpu=lambda *a: jax.lax.map(lambda xs: one(*xs), a),
            default=lambda *a: jax.vmap(fn)(*a),
        )
        return out, jax.tree.map(lambda _: True, out)

    def wrapped(a):
        a = jnp.asarray(a)
        if a.ndim < 2:
            raise ValueError(f"expected a matrix or a batch of matrices, got shape {a.shape}")
        lead = a.shape[:-2]
        if not lead:
            return one(a)
        out = jax.vmap(one)(jnp.reshape(a, (-1, *a.shape[-2:])))
        return jax.tree.map(lambda x: jnp.reshape(x, (*lead, *x.shape[1:])), out)

    return wrapped


eigh = _unbatched_on_cpu(lambda a: tuple(jnp.linalg.eigh(a)))
eigh.__doc__ = "``jnp.linalg.eigh`` of ``[..., n, n]`` as ``(w, v)``; batches run unbatched on CPU."

eigvalsh = _unbatched_on_cpu(lambda a: jnp.linalg.eigvalsh(a))
eigvalsh.__doc__ = "``jnp.linalg.eigvalsh`` of ``[..., n, n]``; batches run unbatched on CPU."


# Householder reflections are taken by panels of at most this many columns (a reflection
# inside a panel reads only the panel; the rest of the matrix takes the panel's at once).
_QR_BLOCK = 32


def _reflector(x, j, rows):
    """The unit vector ``v`` of the reflection ``I - 2 v v^T`` that maps ``x`` (zero above
    row ``j``) onto ``-sign(x_j) ||x|| e_j`` (LAPACK's sign, so no cancellation); ``v = 0``
    (the identity) where ``x`` is zero or has the single entry ``j = m - 1``, as LAPACK."""
    big = jnp.max(jnp.abs(x))
    x = x / jnp.where(big > 0, big, 1.0)  # scaled: no overflow in the squares
    head = jax.lax.dynamic_index_in_dim(x, j, keepdims=False)
    norm = jnp.sqrt(jnp.sum(x * x))
    v = x + jnp.where(head < 0, -norm, norm) * (rows == j)
    size = jnp.sqrt(jnp.sum(v * v))
    return jnp.where((size > 0) & (j < rows.shape[0] - 1), v / jnp.where(size > 0, size, 1.0), 0.0)


def _compact_wy(v):
    """``T`` ``[b, b]`` upper triangular with ``H_1 ... H_b = I - V T V^T`` for the
    reflections ``H_i = I - 2 v_i v_i^T`` of the columns of ``v`` ``[m, b]``.

    ``T^{-1} = I / 2 + strictly_upper(V^T V)`` (Schreiber and Van Loan), so ``T = 2 (I +
    N)^{-1}`` with ``N = 2 strictly_upper(V^T V)`` nilpotent: ``(I + N)^{-1} = (I - N)(I +
    N^2)(I + N^4) ...`` up to ``N^b = 0``, ``ceil(log2 b)`` factors, matrix products only.
    """
    b = v.shape[1]
    n = 2.0 * jnp.triu(v.T @ v, 1)
    eye = jnp.eye(b, dtype=v.dtype)
    t, power = eye - n, n @ n
    for _ in range(max(0, (b - 1).bit_length() - 1)):
        t = t @ (eye + power)
        power = power @ power
    return 2.0 * t


def _householder_q(a):
    """``Q`` of the reduced QR of one ``[m, k]`` matrix by Householder reflections in plain
    XLA operations, ``[m, r]`` with ``r = min(m, k)``.

    Reflection ``j`` (:func:`_reflector`) zeroes column ``j`` below row ``j``. They are
    taken by panels of ``b <= _QR_BLOCK`` columns: inside a panel one at a time on the
    panel, then the panel's product ``I - V T V^T`` (``V`` its unit vectors ``[m, b]``,
    ``T`` upper triangular, LAPACK's compact WY form) on the whole matrix by three matrix
    products. ``Q`` is the product of all reflections applied to the first ``r`` columns of
    the identity, panel by panel, so its columns are orthonormal for every ``a`` and the
    columns of ``a`` lie in their span. The work is held transposed (``[columns, m]``), so
    that a reflection reads and writes contiguous rows (``docs/implementation_notes.md``).
    """
    m, k = a.shape
    r = min(m, k)
    b = min(r, _QR_BLOCK)
    panels = -(-r // b)
    # the first r columns determine Q; zero columns (up to a whole panel) reflect nothing
    work = jnp.zeros((panels * b, m), a.dtype).at[:r].set(a[:, :r].T)  # a^T, padded
    rows = jnp.arange(m)

    def panel_step(p, carry):
        work, vs, ts = carry
        j0 = p * b

        def reflect(i, c):
            panel, v_panel = c  # [b, m] each: the panel's columns and unit vectors as rows
            col = jax.lax.dynamic_index_in_dim(panel, i, 0, keepdims=False)
            v = _reflector(jnp.where(rows >= j0 + i, col, 0.0), j0 + i, rows)
            panel = panel - 2.0 * (panel @ v)[:, None] * v[None, :]
            return panel, jax.lax.dynamic_update_index_in_dim(v_panel, v, i, 0)

        panel = jax.lax.dynamic_slice_in_dim(work, j0, b, axis=0)
        _, v = jax.lax.fori_loop(0, b, reflect, (panel, jnp.zeros((b, m), a.dtype)))

        t = _compact_wy(v.T)
        work = work - ((work @ v.T) @ t) @ v  # the panel's reflections, first to last
        vs = jax.lax.dynamic_update_index_in_dim(vs, v, p, 0)
        return work, vs, jax.lax.dynamic_update_index_in_dim(ts, t, p, 0)

    init = (work, jnp.zeros((panels, b, m), a.dtype), jnp.zeros((panels, b, b), a.dtype))
    _, vs, ts = jax.lax.fori_loop(0, panels, panel_step, init)

    def apply(i, q):  # the last panel first
        v, t = vs[panels - 1 - i], ts[panels - 1 - i]
        return q - v.T @ (t @ (v @ q))

    return jax.lax.fori_loop(0, panels, apply, jnp.eye(m, r, dtype=a.dtype))


def qr_q(a):
    """``Q`` ``[..., m, min(m, k)]`` of the reduced QR of ``[..., m, k]``: orthonormal
    columns whose span holds the columns of ``a``.

    On the CPU: Householder reflections in plain XLA operations (:func:`_householder_q`),
    which batch under ``vmap`` as array operations and never wait on XLA's thread pool
    (jaxlib's LAPACK QR of more than about ``2e5`` flops does, and stalls while other
    processes keep the cores busy: ``docs/implementation_notes.md``). Other
    platforms: ``jnp.linalg.qr``. The two ``Q`` agree up to rounding (the same signs).
    """
    a = jnp.asarray(a)
    if a.ndim < 2:
        raise ValueError(f"expected a matrix or a batch of matrices, got shape {a.shape}")
    return _per_platform(a, cpu=_householder_q, default=lambda x: jnp.linalg.qr(x)[0])


def _per_platform(a, *, cpu, default):
    """``cpu`` (on the CPU) or ``default`` (elsewhere) of every matrix of ``a``
    ``[..., m, k]``, vmapped over the flattened leading axes; ``[..., m', k']``."""
    flat = jnp.reshape(a, (-1, *a.shape[-2:]))
    out = jax.lax.platform_dependent(flat, cpu=jax.vmap(cpu), default=jax.vmap(default))
    return jnp.reshape(out, (*a.shape[:-2], *out.shape[-2:]))


# Above this size Gauss-Jordan eliminates blocks of at most this many columns at a time.
_BLOCK = 48


def _gauss_jordan(a):
    """In-place Gauss-Jordan inversion of one ``[n, n]`` matrix, without pivoting.

    Step ``k`` replaces pivot row ``k`` by itself over the pivot, column ``k`` by minus
    itself over the pivot, the pivot by its inverse and every other entry by
    ``a_ij - a_ik a_kj / a_kk``; written as one elementwise expression (one fused kernel
    per step, no in-place updates that XLA would copy).
    """
    n = a.shape[-1]
    idx = jnp.arange(n)

    def step(k, a):
        pivot = a[k, k]
        row = a[k] / pivot  # [n]
        col = a[:, k]  # [n]
        on_row, on_col = (idx == k)[:, None], (idx == k)[None, :]
        rest = a - col[:, None] * row[None, :]
        out = jnp.where(on_row, row[None, :], jnp.where(on_col, -col[:, None] / pivot, rest))
        return jnp.where(on_row & on_col, 1.0 / pivot, out)

    return jax.lax.fori_loop(0, n, step, a)


def _gauss_jordan_blocked(a):
    """Gauss-Jordan inversion of one ``[n, n]`` matrix by blocks of ``b <= _BLOCK`` pivots.

    Block step ``K`` inverts the pivot block ``P = a_KK`` (scalar Gauss-Jordan, ``b``
    steps on ``[b, b]``), then sets ``a_Kj <- P^-1 a_Kj``, ``a_iK <- -a_iK P^-1`` and
    ``a_ij <- a_ij - a_iK P^-1 a_Kj``: one rank-``b`` matrix product per block instead
    of ``b`` rank-one passes over the whole matrix, each bound by memory traffic (timings:
    ``docs/implementation_notes.md``). ``n`` is padded with identity rows to
    ``ceil(n / b) * b``; the pivot blocks of a strictly diagonally dominant matrix and
    all its Schur complements are strictly diagonally dominant, so no block is singular.
    """
    n = a.shape[-1]
    blocks = -(-n // _BLOCK)
    b = -(-n // blocks)
    m = blocks * b
    if m > n:
        a = jnp.eye(m, dtype=a.dtype).at[:n, :n].set(a)

    def step(k, a):
        k0 = k * b
        rows = jax.lax.dynamic_slice(a, (k0, 0), (b, m))
        cols = jax.lax.dynamic_slice(a, (0, k0), (m, b))
        pivot_inv = _gauss_jordan(jax.lax.dynamic_slice(rows, (0, k0), (b, b)))
        new_rows = pivot_inv @ rows
        out = a - cols @ new_rows
        out = jax.lax.dynamic_update_slice(out, new_rows, (k0, 0))
        out = jax.lax.dynamic_update_slice(out, -(cols @ pivot_inv), (0, k0))
        return jax.lax.dynamic_update_slice(out, pivot_inv, (k0, k0))

    return jax.lax.fori_loop(0, blocks, step, a)[:n, :n]


def _gauss_jordan_inverse(a):
    """Gauss-Jordan inverse of one ``[n, n]`` matrix: scalar pivots up to ``_BLOCK`` rows,
    blocks of pivots above."""
    return (_gauss_jordan if a.shape[-1] <= _BLOCK else _gauss_jordan_blocked)(a)


def _cholesky_inverse(a):
    """Inverse of one symmetric positive definite ``[n, n]`` matrix by its Cholesky factor."""
    factor = jax.scipy.linalg.cho_factor(a, lower=True)
    return jax.scipy.linalg.cho_solve(factor, jnp.eye(a.shape[-1], dtype=a.dtype))


def inv_spd_dominant(a):
    """Inverse of ``[..., n, n]`` matrices that are symmetric and strictly diagonally
    dominant with a positive diagonal (so positive definite), as ``M + L_lambda`` is.

    On the CPU: Gauss-Jordan elimination without pivoting in plain XLA operations (``n``
    rank-one updates, by blocks of pivots above ``_BLOCK`` rows; the whole matrix is read),
    which batches under ``vmap`` as array operations and calls neither LAPACK nor XLA's
    thread pool. Without pivoting it is stable exactly for strictly diagonally dominant
    matrices: every Schur complement of one is strictly diagonally dominant again, so no
    pivot is small. Other platforms: Cholesky factor and two triangular solves, which read
    the lower triangle only and on a GPU cost 0.45-0.85x ``jnp.linalg.inv``'s pivoted LU at
    n = 300 to 30 (``results/bench/README.md``). float32 or float64; neither symmetry nor
    dominance is checked.
    """
    a = jnp.asarray(a)
    if a.ndim < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"expected a square matrix or a batch of them, got shape {a.shape}")
    return _per_platform(a, cpu=_gauss_jordan_inverse, default=_cholesky_inverse)


def _cholesky_solve(ab):
    """``a^-1 b`` ``[m, 1]`` for one augmented ``[a | b]`` ``[m, m + 1]``, ``a`` symmetric
    positive definite, by its Cholesky factor."""
    m = ab.shape[0]
    factor = jax.scipy.linalg.cho_factor(ab[:, :m], lower=True)
    return jax.scipy.linalg.cho_solve(factor, ab[:, m:])


def _gauss_jordan_solve(ab):
    """``a^-1 b`` ``[m, 1]`` for one augmented ``[a | b]`` by the Gauss-Jordan inverse."""
    m = ab.shape[0]
    return _gauss_jordan_inverse(ab[:, :m]) @ ab[:, m:]


def solve_spd(a, b):
    """``a^-1 b`` for symmetric positive definite ``a`` ``[..., m, m]`` and ``b`` ``[..., m]``.

    On the CPU: the Gauss-Jordan inverse of :func:`inv_spd_dominant` (no LAPACK, batches
    as array operations) times ``b``. Without pivoting it is stable for positive definite
    matrices too: every pivot is a diagonal entry of a Schur complement of ``a``, itself
    positive definite, so pivots stay positive (elimination without pivoting is backward
    stable there). Other platforms: Cholesky factor and two triangular solves. Not checked:
    symmetry or definiteness. For an indefinite or singular ``a`` the Cholesky solve gives
    non-finite entries, but the elimination can return finite values: a caller that may
    pass such a matrix must test the answer itself (e.g. ``x . b > 0``, which every
    positive definite ``a`` gives for ``b != 0``).
    """
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.ndim < 2 or a.shape[-1] != a.shape[-2] or b.shape != a.shape[:-1]:
        raise ValueError(
            f"expected a square matrix [..., m, m] and a vector [..., m], got shapes "
            f"{a.shape} and {b.shape}"
        )
    ab = jnp.concatenate([a, b[..., None]], axis=-1)
    out = _per_platform(ab, cpu=_gauss_jordan_solve, default=_cholesky_solve)
    return out[..., 0]
