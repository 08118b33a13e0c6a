"""A learning rate that decays with the round: a schedule in the client training.

`sgd(round_decay(lr, decay))` trains round t's clients at lr·decay^t. The rounds are
checked against plain float64 loops written from the definition (FedAvg, IFCA options
I and II, SCAFFOLD, whose control variates divide by the round's rate), and every
registered algorithm against the per-round rebuild it replaces
(`with_lr_decay` below: what experiments did before the schedule), bit for bit.
"""

from __future__ import annotations

import functools
import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_sim.algorithms import (
    ALGORITHMS,
    ClientTraining,
    fedavg,
    ifca,
    round_decay,
    scaffold,
    sgd,
    with_initial_params,
)
from fedjax_sim.algorithms.mixed import l2_regularizer

LR, DECAY, TAU, ROUNDS = 0.05, 0.5, 3, 4



def with_lr_decay(build_at, lr: float, decay: float):
    """The algorithm rebuilt inside every round at lr·decay^t (t = state.round): how the
    rotated-CIFAR schedule was applied before the client training held it."""
    base = build_at(lr)
    if decay == 1.0:
        return base

    def round_(state, data, key):
        rate = lr * jnp.power(jnp.float32(decay), state.round.astype(jnp.float32))
        return build_at(rate).round(state, data, key)

    return base._replace(round=round_)

def _np_data(data):
    return np.asarray(data.x), np.asarray(data.y), np.asarray(data.num_examples)


def _rate(t):
    """lr·decay^t as the schedule computes it (float32), for the float64 loops."""
    return float(np.float32(LR) * np.power(np.float32(DECAY), np.float32(t)))


def _local_gd(ref, theta, x, y, n, lr, steps, extra=None):
    """`steps` full-batch GD steps at `lr` (float64); extra(θ): a term added to ∇F_i."""
    theta = np.asarray(theta, np.float64).copy()
    for _ in range(steps):
        grad = ref.grad(theta, x, y, n)
        theta = theta - lr * (grad if extra is None else grad + extra(theta))
    return theta


def _fixed_params(params):
    params = jnp.asarray(params, jnp.float32)
    return lambda key: params


# --------------------------------------------------------------------------- the schedule


def test_round_decay_is_the_per_round_rate_bit_for_bit():
    """round_decay(lr, d)(t) is lr·d^t computed as the per-round rebuild computed it (float32
    power of the round cast to float32), for concrete and traced rounds; d = 1 is lr."""
    schedule = round_decay(LR, DECAY)
    for t in range(6):
        want = LR * jnp.power(jnp.float32(DECAY), jnp.int32(t).astype(jnp.float32))
        assert np.asarray(schedule(t)).tobytes() == np.asarray(want).tobytes()
        traced = jax.jit(schedule)(jnp.int32(t))
        assert np.asarray(traced).tobytes() == np.asarray(want).tobytes()
    assert round_decay(LR, 1.0)(7) == LR


def test_at_round_resolves_the_schedule_and_keeps_a_constant():
    training = sgd(round_decay(LR, DECAY), steps=TAU, batch_size=2, sampling="epochs")
    assert training.scheduled
    at_3 = training.at_round(3)
    assert not at_3.scheduled
    assert float(at_3.learning_rate) == pytest.approx(LR * DECAY**3)
    assert (at_3.steps, at_3.batch_size, at_3.sampling) == (TAU, 2, "epochs")
    constant = sgd(LR, steps=TAU)
    assert constant.at_round(jnp.int32(3)) is constant  # traces as it always did


def test_a_scheduled_training_refuses_to_train_unresolved(ragged, linear_model):
    training = sgd(round_decay(LR, DECAY), steps=TAU)
    params = jax.tree.map(lambda p: jnp.broadcast_to(p, (ragged.num_clients,) + p.shape),
                          linear_model.init(jax.random.key(0)))
    keys = jax.random.split(jax.random.key(1), ragged.num_clients)
    with pytest.raises(ValueError, match=r"at_round\(state.round\)"):
        training.update_clients(linear_model, params, ragged, keys)


def test_bad_schedules_are_refused_when_built():
    with pytest.raises(ValueError, match="optimizer of the round"):
        ClientTraining(optax.sgd(0.1), learning_rate=round_decay(LR, DECAY))
    with pytest.raises(ValueError, match="decay must be a finite number >= 0"):
        round_decay(LR, -0.5)
    with pytest.raises(ValueError, match="learning_rate must be a finite number >= 0"):
        sgd(lambda t: -1.0)
    with pytest.raises(ValueError, match="function of the round returning one"):
        ClientTraining(lambda t: "not an optimizer")


# --------------------------------------------------------------------------- vs float64 loops


def test_fedavg_decaying_rate_equals_loop(ragged, linear_model, ref):
    """Round t: every client holding data takes τ full-batch GD steps at lr·decay^t from w;
    w is their mean (the empty client takes no part)."""
    alg = fedavg(linear_model, sgd(round_decay(LR, DECAY), steps=TAU))
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np_data(ragged)
    holding = [i for i in range(ragged.num_clients) if n[i] > 0]
    w = np.asarray(state.params, np.float64)
    round_ = jax.jit(alg.round)
    for t, key in enumerate(jax.random.split(jax.random.key(1), ROUNDS)):
        state, _ = round_(state, ragged, key)
        w = np.mean([_local_gd(ref, w, x[i], y[i], n[i], _rate(t), TAU) for i in holding],
                    axis=0)
        np.testing.assert_allclose(state.params, w, rtol=1e-5, atol=1e-6)


def test_ifca_model_decaying_rate_equals_loop(ragged, linear_model, ref):
    """Option II, round t: each client picks argmin_j F_i(θ_j), takes τ GD steps at
    lr·decay^t from it; each cluster is its members' mean (an empty cluster is kept)."""
    k = 3
    theta0 = np.array([[0.0, 0.0, 0.0], [1.0, -1.0, 0.5], [50.0, 50.0, 50.0]])
    alg = with_initial_params(
        ifca(linear_model, sgd(round_decay(LR, DECAY), steps=TAU), num_clusters=k,
             option="model"), _fixed_params(theta0))
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np_data(ragged)
    theta = theta0.copy()
    round_ = jax.jit(alg.round)
    for t, key in enumerate(jax.random.split(jax.random.key(1), ROUNDS)):
        state, _ = round_(state, ragged, key)
        trained = {j: [] for j in range(k)}
        for i in range(ragged.num_clients):
            if n[i]:
                j = int(np.argmin([ref.loss(theta[c], x[i], y[i], n[i]) for c in range(k)]))
                trained[j].append(_local_gd(ref, theta[j], x[i], y[i], n[i], _rate(t), TAU))
        theta = np.stack([np.mean(trained[j], axis=0) if trained[j] else theta[j]
                          for j in range(k)])
        np.testing.assert_allclose(state.cluster_params, theta, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(state.cluster_params[2], theta0[2])  # the empty cluster


def test_ifca_gradient_decaying_rate_equals_loop(ragged, linear_model, ref):
    """Option I, round t: θ_j ← θ_j − (lr·decay^t / m) Σ_{i: ĵ_i = j} ∇F_i(θ_j)."""
    k = 2
    theta0 = np.array([[0.0, 0.0, 0.0], [1.0, -1.0, 0.5]])
    alg = with_initial_params(
        ifca(linear_model, sgd(round_decay(LR, DECAY)), num_clusters=k, option="gradient"),
        _fixed_params(theta0))
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np_data(ragged)
    holding = [i for i in range(ragged.num_clients) if n[i] > 0]
    theta = theta0.copy()
    round_ = jax.jit(alg.round)
    for t, key in enumerate(jax.random.split(jax.random.key(1), ROUNDS)):
        state, _ = round_(state, ragged, key)
        grads = np.zeros_like(theta)
        for i in holding:
            j = int(np.argmin([ref.loss(theta[c], x[i], y[i], n[i]) for c in range(k)]))
            grads[j] += ref.grad(theta[j], x[i], y[i], n[i])
        theta = theta - _rate(t) * grads / len(holding)
        np.testing.assert_allclose(state.cluster_params, theta, rtol=1e-4, atol=1e-5)


def test_scaffold_decaying_rate_equals_loop(ragged, linear_model, ref):
    """Round t at η_t = lr·decay^t: y_i ← K corrected GD steps at η_t, c_i⁺ = c_i − c +
    (x − y_i)/(K η_t), x += mean Δy, c += mean Δc (every client holding data)."""
    alg = scaffold(linear_model, sgd(round_decay(LR, DECAY), steps=TAU))
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np_data(ragged)
    m = ragged.num_clients
    holding = [i for i in range(m) if n[i] > 0]
    xs = np.asarray(state.params, np.float64)
    c, ci = np.zeros_like(xs), np.zeros((m, xs.size))
    round_ = jax.jit(alg.round)
    for t, key in enumerate(jax.random.split(jax.random.key(1), ROUNDS)):
        state, _ = round_(state, ragged, key)
        eta = _rate(t)
        new_ci, dys = ci.copy(), []
        for i in holding:
            yi = _local_gd(ref, xs, x[i], y[i], n[i], eta, TAU,
                           extra=lambda th, i=i: c - ci[i])
            new_ci[i] = ci[i] - c + (xs - yi) / (TAU * eta)
            dys.append(yi - xs)
        xs = xs + np.mean(dys, axis=0)
        c = c + np.mean([new_ci[i] - ci[i] for i in holding], axis=0)
        ci = new_ci
        np.testing.assert_allclose(state.params, xs, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(state.client_controls, ci, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- vs the rebuild


_POOL = dict(num_clusters=2, pretraining=sgd(0.05, steps=3), kmeans_restarts=2, mu=0.1)


def _build(name, model, training):
    """The registered factory with `training` and whichever pooled settings it accepts."""
    factory = ALGORITHMS[name]
    accepted = inspect.signature(factory).parameters
    pool = dict(_POOL, option="model") if name == "ifca" else _POOL
    if factory.__module__ == "fedjax_sim.algorithms.mixed":
        pool = dict(pool, central_loss=l2_regularizer(0.1))
    return factory(model, training, **{k: v for k, v in pool.items() if k in accepted})


@functools.partial(jax.jit, static_argnums=0)
def _run(alg, data, init_key, round_keys):
    state = alg.init(init_key, data)
    return jax.lax.scan(lambda s, k: (alg.round(s, data, k)[0], None), state, round_keys)[0]


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_schedule_equals_the_per_round_rebuild(name, ragged, linear_model):
    """Every registered algorithm trained by sgd(round_decay(lr, d)) ends, after several
    rounds of minibatch steps, in the state the per-round rebuild at lr·d^t gives, bit
    for bit: each algorithm's round trains (and reads the rate) at its round's rate."""
    def training(lr):
        return sgd(lr, steps=TAU, batch_size=2)

    scheduled = _build(name, linear_model, training(round_decay(LR, DECAY)))
    rebuilt = with_lr_decay(lambda lr: _build(name, linear_model, training(lr)), LR, DECAY)
    keys = jax.random.split(jax.random.key(1), ROUNDS)
    chex.assert_trees_all_equal(_run(scheduled, ragged, jax.random.key(0), keys),
                                _run(rebuilt, ragged, jax.random.key(0), keys))


def test_ifca_gradient_schedule_equals_the_per_round_rebuild(ragged, linear_model):
    """Option I steps the cluster models with the training's optimizer: at the round's rate."""
    def build(lr):
        return ifca(linear_model, sgd(lr), num_clusters=2, option="gradient")

    keys = jax.random.split(jax.random.key(1), ROUNDS)
    chex.assert_trees_all_equal(
        _run(build(round_decay(LR, DECAY)), ragged, jax.random.key(0), keys),
        _run(with_lr_decay(build, LR, DECAY), ragged, jax.random.key(0), keys))


def test_an_optimizer_of_the_round_equals_the_per_round_rebuild(ragged, linear_model):
    """Any optimizer can follow the round: a function of the round returning it (here SGD
    with weight decay chained before it, as the rotated-CIFAR training is)."""
    schedule = round_decay(LR, DECAY)

    def decayed(lr):
        return optax.chain(optax.add_decayed_weights(1e-2), optax.sgd(lr))

    scheduled = fedavg(linear_model, ClientTraining(lambda t: decayed(schedule(t)), TAU, 2))
    rebuilt = with_lr_decay(lambda lr: fedavg(linear_model, ClientTraining(decayed(lr), TAU, 2)),
                            LR, DECAY)
    keys = jax.random.split(jax.random.key(1), ROUNDS)
    chex.assert_trees_all_equal(_run(scheduled, ragged, jax.random.key(0), keys),
                                _run(rebuilt, ragged, jax.random.key(0), keys))


def test_a_scheduled_round_is_traced_once(ragged, linear_model):
    alg = fedavg(linear_model, sgd(round_decay(LR, DECAY), steps=TAU))
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def round_(state, data, key):
        return alg.round(state, data, key)

    state = alg.init(jax.random.key(0), ragged)
    for key in jax.random.split(jax.random.key(1), 3):
        state, _ = round_(state, ragged, key)
    assert int(state.round) == 3
