"""`with_aggregator` on every algorithm of the seam: the mean rule without Byzantine clients
is the algorithm's own round (to float rounding; uniform weights, as every rule counts
each reporting client alike), and an attack moves it.

The robust rules themselves are checked against loops in tests/test_robust.py and
tests/test_byzantine_rounds.py; here, that each algorithm hands the rule its clients'
changes (SCAFFOLD's model and control-variate pair, FedNova's normalised d_i, Ditto's
global model, HypCluster per cluster) and applies the rule's result where its plain
mean went.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from fedjax_sim.algorithms import (
    cfl,
    ditto,
    fednova,
    fedprox,
    hypcluster,
    scaffold,
    sgd,
    with_aggregator,
)
from fedjax_sim.ops import attacks, robust

LR, TAU = 0.1, 3

BUILDS = {
    "fedprox": lambda model: fedprox(model, sgd(LR, steps=TAU), mu=0.1),
    "fednova": lambda model: fednova(model, sgd(LR, steps=TAU), weighting="uniform"),
    "scaffold": lambda model: scaffold(model, sgd(LR, steps=TAU)),
    "ditto": lambda model: ditto(model, sgd(LR, steps=TAU)),
    "hypcluster": lambda model: hypcluster(model, sgd(LR, steps=TAU), num_clusters=2,
                                           weighting="uniform"),
}


def _server_model(state):
    return state.cluster_params if hasattr(state, "cluster_params") else state.params


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_the_mean_rule_is_the_plain_round(ragged, linear_model, name):
    plain = BUILDS[name](linear_model)
    wrapped = with_aggregator(plain, robust.mean())
    a, b = plain.init(jax.random.key(0), ragged), wrapped.init(jax.random.key(0), ragged)
    for key in jax.random.split(jax.random.key(1), 3):
        a, _ = jax.jit(plain.round)(a, ragged, key)
        b, _ = jax.jit(wrapped.round)(b, ragged, key)
        np.testing.assert_allclose(_server_model(b), _server_model(a), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_a_sign_flipping_client_moves_the_mean_but_not_the_median(ragged, linear_model, name):
    """One Byzantine client of five sending −100 Δ_i: the mean goes far, the coordinate-wise
    median of the four reporting clients moves by no more than the honest changes do."""
    plain = BUILDS[name](linear_model)
    flip = attacks.sign_flip(scale=100.0)
    mean = with_aggregator(plain, robust.mean(), byzantine=1, attack=flip)
    median = with_aggregator(plain, robust.coordinate_median(), byzantine=1, attack=flip)
    # an init key whose Byzantine client holds data (the draw is ops.attacks')
    holding = np.asarray(ragged.num_examples) > 0
    init_key = next(jax.random.key(i) for i in range(20) if holding[np.asarray(
        mean.init(jax.random.key(i), ragged).aggregation.byzantine)].all())
    s0 = plain.init(init_key, ragged)
    honest, _ = jax.jit(plain.round)(s0, ragged, jax.random.key(2))
    step = np.abs(np.asarray(_server_model(honest)) - np.asarray(_server_model(s0))).max()
    moved = {}
    for label, alg in (("mean", mean), ("median", median)):
        state = alg.init(init_key, ragged)
        new, _ = jax.jit(alg.round)(state, ragged, jax.random.key(2))
        moved[label] = np.abs(np.asarray(_server_model(new))
                              - np.asarray(_server_model(state))).max()
    assert moved["mean"] > 5 * step
    assert moved["median"] <= 2 * step + 1e-6


def test_cfl_takes_no_rule(ragged, linear_model):
    alg = with_aggregator(cfl(linear_model, sgd(LR)), robust.coordinate_median())
    state = alg.init(jax.random.key(0), ragged)
    with pytest.raises(ValueError, match="CFL takes no aggregation rule"):
        alg.round(state, ragged, jax.random.key(1))
