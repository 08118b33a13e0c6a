"""`with_aggregator`: robust rules and Byzantine clients in rounds, against float64 loops.

Each loop is written from the rules' definitions (Yin et al. 2018: the coordinate-wise
median and β-trimmed mean of the reporting clients' changes; the sign-flip attack
x_b ← −c x_b): every client holding data takes τ full-batch GD steps from θ, its change
Δ_i = θ̃_i − θ; the Byzantine clients' changes are replaced by the attack's; θ moves by
the rule's statistic over the reporting clients (per cluster in IFCA: over that
cluster's members only; a cluster nobody picked keeps its model).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.algorithms import (
    drfa,
    fedavg,
    ifca,
    sgd,
    with_aggregator,
    with_initial_params,
    with_systems,
)
from fedjax_sim.execution import planned
from fedjax_sim.ops import attacks, robust, sample_cohort
from fedjax_sim.systems import Systems

LR, TAU, ROUNDS = 0.1, 3, 3


def _np(data):
    return np.asarray(data.x), np.asarray(data.y), np.asarray(data.num_examples)


def _gd(ref, theta, x, y, n):
    theta = np.asarray(theta, np.float64).copy()
    for _ in range(TAU):
        theta = theta - LR * ref.grad(theta, x, y, n)
    return theta


def _trimmed(values, f):
    srt = np.sort(np.asarray(values), axis=0)
    return srt[f:len(srt) - f].mean(axis=0)


def _federation():
    from conftest import make_ragged

    return make_ragged(5, sizes=(3, 2, 4, 1, 2, 3, 0, 2, 4, 1),
                       clusters=(0, 1, 0, 1, 0, 1, 0, 1, 0, 1))


def test_coordinate_median_of_the_reporting_clients(ragged, linear_model, ref):
    alg = with_aggregator(fedavg(linear_model, sgd(LR, steps=TAU)), robust.coordinate_median())
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np(ragged)
    w = np.asarray(state.params, np.float64)
    for key in jax.random.split(jax.random.key(1), ROUNDS):
        state, _ = jax.jit(alg.round)(state, ragged, key)
        changes = [_gd(ref, w, x[i], y[i], n[i]) - w for i in range(len(n)) if n[i]]
        w = w + np.median(changes, axis=0)
        np.testing.assert_allclose(state.params, w, rtol=1e-5, atol=1e-6)


def test_trimmed_mean_against_sign_flipping_clients(linear_model, ref):
    """Two Byzantine clients of ten send −10 Δ_i; the trimmed mean drops the 2 largest and
    smallest per coordinate. The Byzantine clients are the state's (drawn at init)."""
    data = _federation()
    alg = with_aggregator(fedavg(linear_model, sgd(LR, steps=TAU)), robust.trimmed_mean(f=2),
                          byzantine=2, attack=attacks.sign_flip(scale=10.0))
    state = alg.init(jax.random.key(0), data)
    byz = np.asarray(state.aggregation.byzantine)
    assert byz.sum() == 2
    x, y, n = _np(data)
    w = np.asarray(state.params, np.float64)
    for key in jax.random.split(jax.random.key(2), ROUNDS):
        state, metrics = jax.jit(alg.round)(state, data, key)
        changes = []
        for i in range(len(n)):
            if n[i]:
                delta = _gd(ref, w, x[i], y[i], n[i]) - w
                changes.append(-10.0 * delta if byz[i] else delta)
        w = w + _trimmed(changes, 2)
        np.testing.assert_allclose(state.params, w, rtol=1e-5, atol=1e-6)
        assert int(metrics["byzantine_reports"]) == int(sum(byz[i] for i in range(10) if n[i]))


def test_partial_participation_and_dropout_enter_no_statistic(linear_model, ref):
    """A cohort of 6 of 10 with dropout 0.3: the median is over the reporting members
    holding data only (cohort and reports from `ops.sample_cohort`, the documented draw)."""
    data = _federation()
    systems = Systems(dropout=0.3)
    alg = with_aggregator(with_systems(fedavg(linear_model, sgd(LR, steps=TAU),
                                              participation=0.6), systems),
                          robust.coordinate_median())
    state = alg.init(jax.random.key(0), data)
    x, y, n = _np(data)
    w = np.asarray(state.params, np.float64)
    for t, key in enumerate(jax.random.split(jax.random.key(3), 5)):
        state, _ = jax.jit(alg.round)(state, data, key)
        cohort = sample_cohort(key, 10, 6, systems=systems, round_=jnp.int32(t))
        changes = [_gd(ref, w, x[i], y[i], n[i]) - w
                   for i, rep in zip(np.asarray(cohort.ids), np.asarray(cohort.reports),
                                     strict=True) if rep and n[i]]
        if changes:
            w = w + np.median(changes, axis=0)
        np.testing.assert_allclose(state.params, w, rtol=1e-5, atol=1e-6)


def test_ifca_median_per_cluster_over_its_members(ragged, linear_model, ref):
    k = 3
    theta0 = np.array([[0.0, 0.0, 0.0], [1.0, -1.0, 0.5], [50.0, 50.0, 50.0]])
    params = jnp.asarray(theta0, jnp.float32)
    alg = with_aggregator(with_initial_params(
        ifca(linear_model, sgd(LR, steps=TAU), num_clusters=k, option="model"),
        lambda key: params), robust.coordinate_median())
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np(ragged)
    theta = theta0.copy()
    for key in jax.random.split(jax.random.key(4), ROUNDS):
        state, _ = jax.jit(alg.round)(state, ragged, key)
        members = {j: [] for j in range(k)}
        for i in range(len(n)):
            if n[i]:
                j = int(np.argmin([ref.loss(theta[c], x[i], y[i], n[i]) for c in range(k)]))
                members[j].append(_gd(ref, theta[j], x[i], y[i], n[i]) - theta[j])
        theta = np.stack([theta[j] + np.median(members[j], axis=0) if members[j] else theta[j]
                          for j in range(k)])
        np.testing.assert_allclose(state.cluster_params, theta, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(state.cluster_params[2], theta0[2])


def test_a_chunked_cohort_gives_the_same_round(linear_model):
    data = _federation()
    alg = with_aggregator(fedavg(linear_model, sgd(LR, steps=TAU)),
                          [robust.nearest_neighbor_mixing(f=1), robust.krum(f=1)],
                          byzantine=1, attack=attacks.a_little_is_enough())
    state = alg.init(jax.random.key(0), data)
    whole, _ = jax.jit(alg.round)(state, data, jax.random.key(5))
    chunked, _ = jax.jit(alg.round)(state, planned(data, client_chunk=3), jax.random.key(5))
    np.testing.assert_allclose(chunked.params, whole.params, rtol=1e-5, atol=1e-6)


def test_the_mean_rule_without_byzantine_clients_is_fedavg(ragged, linear_model):
    plain = fedavg(linear_model, sgd(LR, steps=TAU))
    robust_mean = with_aggregator(plain, robust.mean())
    a, b = plain.init(jax.random.key(0), ragged), robust_mean.init(jax.random.key(0), ragged)
    for key in jax.random.split(jax.random.key(6), ROUNDS):
        a, _ = jax.jit(plain.round)(a, ragged, key)
        b, _ = jax.jit(robust_mean.round)(b, ragged, key)
        np.testing.assert_allclose(b.params, a.params, rtol=1e-5, atol=1e-6)


def test_refusals_are_one_line(ragged, linear_model):
    with pytest.raises(ValueError, match="has no `aggregation`"):
        with_aggregator(drfa(linear_model, sgd(LR)), robust.mean()).init(
            jax.random.key(0), ragged)
    with pytest.raises(ValueError, match="an attack needs Byzantine clients"):
        with_aggregator(fedavg(linear_model, sgd(LR)), robust.mean(),
                        attack=attacks.sign_flip())
    with pytest.raises(ValueError, match="byzantine must be"):
        with_aggregator(fedavg(linear_model, sgd(LR)), robust.mean(), byzantine=1.5)
    with pytest.raises(ValueError, match="takes an ops.robust Aggregator"):
        with_aggregator(fedavg(linear_model, sgd(LR)), "median")
