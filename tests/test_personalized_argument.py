"""``personalized`` means the same in every factory that takes it (issue 26, item 2).

True (or a mask leaf True) = that leaf is per client; False = shared; a bool applies to
every leaf. Each factory's default is the bool that gives its numbers from before the
argument had one meaning (then ``None`` meant "every leaf" in Karula, Ditto and the
Laplacian penalty and "no leaf" in FedAvg, FedProx, SCAFFOLD and the clustered FedAvg);
``None`` itself is now refused, so code written against the old default cannot change
meaning silently.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _alg_problems import grad_magnitudes, intercept_loss, problem, scan_run, true_dissimilarity
from _tolerances import certified_distance, reordered_sum

from karula_jax import algorithms as A
from karula_jax.algorithms._personalized import personalized_flags, shared_leaves

D = true_dissimilarity()
LABELS = np.array([0, 0, 1, 1, 2, 2], np.int32)
KW = dict(clients_per_round=3, batch_size=4)
LOCAL = dict(KW, local_steps=2)
MAKERS = {
    "karula": lambda **p: A.karula(intercept_loss, D, t=1.0, learning_rate=0.5, **KW, **p),
    "laplacian_penalty": lambda **p: A.laplacian_penalty(
        intercept_loss, D, mu=0.3, learning_rate=0.5, **KW, **p
    ),
    "ditto": lambda **p: A.ditto(intercept_loss, lam=0.5, learning_rate=0.1, **LOCAL, **p),
    "fedavg": lambda **p: A.fedavg(intercept_loss, learning_rate=0.1, **LOCAL, **p),
    "fedprox": lambda **p: A.fedprox(intercept_loss, mu=0.2, learning_rate=0.1, **LOCAL, **p),
    "scaffold": lambda **p: A.scaffold(intercept_loss, learning_rate=0.1, **LOCAL, **p),
    "clustered_fedavg": lambda **p: A.clustered_fedavg(
        intercept_loss, LABELS, learning_rate=0.1, **LOCAL, **p
    ),
}
# The default's meaning before issue 26 (personalized=None) for each factory.
DEFAULT = {"karula": True, "laplacian_penalty": True, "ditto": True}
DEFAULT |= dict.fromkeys(("fedavg", "fedprox", "scaffold", "clustered_fedavg"), False)
# Three rounds of each factory at its default, computed with the code before issue 26
# (personalized omitted, i.e. None): sum of the clients' w, sum of their c, sum of squares.
OLD_NUMBERS = {
    "karula": (7.288210675120354, 0.5262826606631279, 4.817826790497279),
    "laplacian_penalty": (7.224266983568668, 0.5511154681444168, 4.672102507931039),
    "ditto": (9.022147083655, -0.6317762583494186, 9.459739664692497),
    "fedavg": (14.223584532737732, -0.9726279079914093, 12.342584136076601),
    "fedprox": (14.104667901992798, -0.9701697528362274, 12.132632145225342),
    "scaffold": (15.68686330318451, -1.3367306292057037, 16.23758393264808),
    "clustered_fedavg": (14.721090495586395, -1.541820228099823, 20.009111424083102),
}


def _params():
    return {"w": jnp.zeros(3, jnp.float32), "c": jnp.zeros((), jnp.float32)}


def _final(alg, *, infos=False):
    _, info, traj = scan_run(alg, _params(), problem().train, jax.random.key(5), 3)
    final = {k: np.asarray(v[-1]) for k, v in traj.items()}
    return (final, info) if infos else final


def _fingerprint_tolerance(name, got, info) -> np.ndarray:
    """Bound on how far the fingerprint moves with the float32 rounding of the 3 rounds
    (another processor, another order of their sums), for ``(sum w, sum c, sum of
    squares)``: each round rounds the models by ``reordered_sum`` of its chain (two local
    steps on 4 rows of d + 1 terms, an average over the n clients) relative to the models
    and their step, and the (nonexpansive) rounds carry it on; Karula's projection also
    lands anywhere within its certified distance (its gap plus the gap's float32 rounding,
    relative to S <= |theta|^2 / 2, sums of n^2 + 2 n p terms)."""
    w, c = got["w"].astype(np.float64), got["c"].astype(np.float64)
    n, p = w.shape[0], w.shape[1] + 1
    lr = 0.5 if name in ("karula", "laplacian_penalty") else 0.1
    size = np.sqrt(np.sum(w**2) + np.sum(c**2))
    step = lr * np.linalg.norm(grad_magnitudes(problem().train, w, intercept=np.abs(c).max()))
    delta = reordered_sum(2 * (4 + p + 3) + n + 4, rounds=3) * (size + step)
    if name == "karula":
        gap_rounding = 0.5 * reordered_sum(n * (n + 2 * p)) * 0.5 * size**2
        delta += sum(certified_distance(float(d) + gap_rounding) for d in info.proj_delta)
    return np.array([np.sqrt(w.size) * delta, np.sqrt(c.size) * delta, 2 * size * delta + delta**2])


def test_every_factory_that_takes_personalized_is_covered():
    import inspect

    takers = {
        name
        for name in A.__all__
        if inspect.isfunction(getattr(A, name))
        and "personalized" in inspect.signature(getattr(A, name)).parameters
    }
    assert takers == set(MAKERS)
    for name in MAKERS:
        default = inspect.signature(getattr(A, name)).parameters["personalized"].default
        assert default is DEFAULT[name], name


@pytest.mark.parametrize("name", list(MAKERS))
def test_default_keeps_the_old_numbers_and_none_is_refused(name):
    make = MAKERS[name]
    got, info = _final(make(), infos=True)
    w, c = got["w"].astype(np.float64), got["c"].astype(np.float64)
    fingerprint = (w.sum(), c.sum(), (w**2).sum() + (c**2).sum())
    bound = _fingerprint_tolerance(name, got, info)
    assert np.all(np.abs(np.subtract(fingerprint, OLD_NUMBERS[name])) <= bound), (
        fingerprint,
        OLD_NUMBERS[name],
        bound,
    )
    # the default is the bool DEFAULT[name] (signature test), the mask of it on every leaf
    flag = DEFAULT[name]
    same = _final(make(personalized={"w": flag, "c": flag}))
    for k in got:
        np.testing.assert_array_equal(same[k], got[k], err_msg=f"{name} {k}")
    # the other bool is the other meaning, again the same as its all-leaves mask
    other, other_mask = (
        _final(make(personalized=not flag)),
        _final(make(personalized={"w": not flag, "c": not flag})),
    )
    for k in got:
        np.testing.assert_array_equal(other[k], other_mask[k], err_msg=f"{name} {k}")
    assert not np.array_equal(other["w"], got["w"])
    with pytest.raises(ValueError, match=r"personalized=None is not accepted.*True.*False"):
        make(personalized=None)


def test_flags_and_shared_leaves():
    params = _params()
    assert personalized_flags(True, params) == {"w": True, "c": True}
    assert personalized_flags(np.bool_(False), params) == {"w": False, "c": False}
    assert personalized_flags({"w": True, "c": False}, params) == {"w": True, "c": False}
    assert shared_leaves(True, params) is None
    assert shared_leaves({"w": True, "c": True}, params) is None
    assert shared_leaves({"w": True, "c": False}, params) == {"w": False, "c": True}
    assert shared_leaves(False, params) == {"w": True, "c": True}
    with pytest.raises(ValueError, match="tree structure of params"):
        personalized_flags({"w": True}, params)
    with pytest.raises(TypeError, match="personalized: expected Python bools"):
        personalized_flags({"w": jnp.array(True), "c": True}, params)
    with pytest.raises(TypeError, match="personalized: expected Python bools"):
        A.fedavg(intercept_loss, learning_rate=0.1, personalized="all", **KW)
