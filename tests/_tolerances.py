"""Tolerances of the tests, each derived from the error of the computation it bounds.

A test compares two evaluations of one quantity, or one against a reference. Their
difference has a source, and the tolerance is that source's bound, not what one machine
happened to print (XLA's CPU code differs by processor: another instruction set, another
order of a reduction):

==========================  ==========================================================
source                      bound used
==========================  ==========================================================
float32 rounding of a sum   ``reordered_sum(m)``: two orders of an m-term float32 sum
or dot product in another   differ by at most ``m * EPS32`` of the sum of magnitudes
order (another compilation, (Higham's gamma_m with unit roundoff EPS32 / 2, twice);
device split, vmap)         ``rounds`` dependent steps compound it linearly
an iterative solver that    the solver's own tolerance (its ``tol``/``threshold``
stops at a tolerance        argument), scaled as the solver defines it
a certified duality gap     ``certified_distance(gap)``: a 1-strongly convex objective
``delta`` of a projection   within ``delta`` of its minimum is within ``sqrt(2 delta)``
                            of the minimizer
Monte Carlo estimates       a multiple of the standard error of the mean (the number of
                            standard errors named beside it)
a contracting iteration     ``iteration_floor(kappa, terms, step)``: each step's rounding
(gradient descent to a      over the step's contraction, at every step (a geometric
fixed point), run in        series); ``kappa`` carries the gradient's rounding into the
float32                     parameters
==========================  ==========================================================
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "EPS32",
    "EPS64",
    "accumulated_rounding",
    "certified_distance",
    "iteration_floor",
    "reordered_sum",
]

EPS32 = float(np.finfo(np.float32).eps)  # 2**-23: twice float32's unit roundoff
EPS64 = float(np.finfo(np.float64).eps)  # 2**-52


def reordered_sum(terms: int, rounds: int = 1, eps: float = EPS32) -> float:
    """Relative difference bound for two evaluations of ``terms``-term sums in different
    orders, compounded over ``rounds`` dependent steps: ``terms * rounds * eps``, relative
    to the sum of the terms' magnitudes."""
    return float(terms) * float(rounds) * eps


def certified_distance(gap: float) -> float:
    """Distance bound to the minimizer of a 1-strongly convex objective (the projection's
    ``0.5 ||theta - v||^2``) from a certified gap ``gap`` to its minimum: ``sqrt(2 gap)``."""
    return math.sqrt(2.0 * max(float(gap), 0.0))


def iteration_floor(kappa: float, terms: int, step: float = 1.0, eps: float = EPS32) -> float:
    """Relative error (of the parameters' scale) that rounding leaves in a contracting
    gradient iteration, at any step, against the exact iteration or its fixed point.

    A step ``step / L`` on an objective with curvature in ``[mu, L]`` (``kappa = L / mu``)
    contracts the error by the factor ``1 - step / kappa`` and adds the gradient's rounding,
    ``reordered_sum(terms)`` of the gradient's scale (``L`` times the parameters'), times
    the step, and the update's own, ``eps / 2`` of the parameters. Summed as a geometric
    series: ``kappa * (reordered_sum(terms) + eps / (2 step))``."""
    step = float(step)
    per_step = step * reordered_sum(terms, eps=eps) + eps / 2.0
    return accumulated_rounding(per_step, step / float(kappa))


def accumulated_rounding(per_step: float, gap: float) -> float:
    """What rounding ``per_step`` a step leaves in an iteration that contracts its error by
    ``1 - gap`` a step adds up to at most, the geometric series ``per_step / gap``."""
    return float(per_step) / float(gap)
