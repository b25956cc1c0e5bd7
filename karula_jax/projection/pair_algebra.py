"""Algebra on the pair multipliers shared by the dual solvers (laplacian, fista).

Multipliers live on the pairs ``i < j`` as symmetric ``[n, n]`` arrays with a zero
diagonal: :func:`symmetric` keeps them so to the bit, :func:`pair_dot` is their inner
product, :func:`hvp` the dual Hessian's product at a
:class:`~karula_jax.projection.certificate.DualEval`, and :func:`low_rank` says which of
its two forms is cheaper.
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["hvp", "low_rank", "pair_dot", "symmetric"]


def low_rank(n, k):
    """Whether ``n`` models in ``k`` coordinates span few enough dimensions (``3k < 2n``)
    that ``[n, k]`` products beat ``[n, n]`` ones: the Hessian-vector product goes
    through the factors and certificates pull violated pairs together first."""
    return 3 * k < 2 * n


def symmetric(a):
    """``(a + a^T) / 2``, symmetric to the bit. Steps and trial points are symmetric by
    construction, but XLA may round ``(i, j)`` and ``(j, i)`` differently (fused
    multiply-adds in vector lanes and not in a loop's tail), and CG amplifies that where
    the Hessian is singular (p = 1): a lopsided step fixed one side of a pair only, and
    projections stalled short of tol (``results/bench/README.md``)."""
    return 0.5 * (a + a.T)


def pair_dot(a, b):
    """Inner product over the pairs ``i < j`` of two symmetric ``[n, n]`` arrays."""
    return 0.5 * jnp.sum(a * b)


def hvp(ev, mask, x):
    """``-H x`` for the dual Hessian ``H`` at ``ev``, ``x`` [n, n] symmetric over pairs.

    ``(B^T A^-1 B o (B^T th)(B^T th)^T) x`` is the pair differences of ``U th^T`` with
    ``U = A^-1 L_x th`` ([n, k]): ``<U_i - U_j, th_i - th_j>``. Three ``[n, n] x [n, k]``
    products when :func:`low_rank` (cheaper there: ``docs/implementation_notes.md``), else
    two ``[n, n]`` products through the Gram matrix.
    """
    if low_rank(*ev.th.shape):
        u = ev.a_inv @ (jnp.sum(x, axis=1)[:, None] * ev.th - x @ ev.th)
        yt = u @ ev.th.T
        dg = jnp.sum(u * ev.th, axis=1)
    else:
        yt = ev.a_inv @ (jnp.sum(x, axis=1)[:, None] * ev.gram - x @ ev.gram)
        dg = jnp.diag(yt)
    # (yt + yt^T) and dg_i + dg_j are symmetric to the bit, so is the product (CG's
    # updates may still round apart: ``symmetric``)
    return jnp.where(mask, dg[:, None] + dg[None, :] - (yt + yt.T), 0.0)
