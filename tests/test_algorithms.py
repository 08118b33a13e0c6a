"""Algorithms: vectorized rounds against per-client loops, reductions between
algorithms, a synthetic recovery run, determinism, tracing, input validation,
and a smoke test over the registry."""

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
    get_algorithm,
    ifca,
    local_models,
    one_shot_clustering,
    sgd,
    with_initial_params,
    with_restarts,
)
from fedjax_sim.algorithms.mixed import l2_regularizer
from fedjax_sim.data import FederatedData, check_mixture_settings, linear_mixture
from fedjax_sim.models import linear_regression

RTOL = 1e-5
ATOL = 1e-5


def _fixed_params(params):
    """init_params for with_initial_params: always these cluster params (leaves [k, ...])."""
    params = jnp.asarray(params, jnp.float32)
    return lambda key: params


def _np_data(data):
    return np.asarray(data.x), np.asarray(data.y), np.asarray(data.num_examples)


@functools.partial(jax.jit, static_argnums=0)
def _run(alg, data, init_key, round_keys):
    """init, then one round per key, under one jit (compiled once per algorithm object).

    Returns (final state, metrics stacked over rounds).
    """
    state = alg.init(init_key, data)
    return jax.lax.scan(lambda s, k: alg.round(s, data, k), state, round_keys)


# --------------------------------------------------------------------------- reductions (k = 1)


@pytest.mark.parametrize("weighting", ["uniform", "examples"])
def test_ifca_k1_model_averaging_equals_fedavg(ragged, linear_model, weighting):
    training = sgd(0.05, steps=3)
    fed = fedavg(linear_model, training, weighting=weighting)
    clu = with_initial_params(
        ifca(linear_model, training, num_clusters=1, option="model", weighting=weighting),
        lambda key: jax.tree.map(lambda a: a[None], linear_model.init(key)),
    )
    key = jax.random.key(0)
    s_fed, s_clu = fed.init(key, ragged), clu.init(key, ragged)
    chex.assert_trees_all_equal(s_clu.cluster_params[0], s_fed.params)
    round_fed, round_clu = jax.jit(fed.round), jax.jit(clu.round)
    for k in jax.random.split(jax.random.key(1), 4):
        before = s_fed.params
        s_fed, _ = round_fed(s_fed, ragged, k)
        s_clu, _ = round_clu(s_clu, ragged, k)
        chex.assert_trees_all_close(s_clu.cluster_params[0], s_fed.params, rtol=RTOL, atol=ATOL)
        assert not np.allclose(s_fed.params, before)  # the rounds do move the model
    # The empty client takes no part: it is never assigned.
    np.testing.assert_array_equal(s_clu.assignment, np.where(_np_data(ragged)[2] > 0, 0, -1))


def test_ifca_k1_gradient_equals_distributed_gradient_descent(ragged, linear_model, ref):
    """θ ← θ − lr · mean_i ∇F_i(θ) over the m clients holding data (the empty one takes no part)."""
    lr, rounds = 0.1, 5
    theta0 = np.array([0.5, -1.0, 2.0])
    alg = with_initial_params(
        ifca(linear_model, sgd(lr), num_clusters=1, option="gradient"),
        _fixed_params(theta0[None]),
    )
    state, _ = _run(alg, ragged, jax.random.key(0), jax.random.split(jax.random.key(1), rounds))

    x, y, n = _np_data(ragged)
    theta = theta0.copy()
    for _ in range(rounds):
        grads = [ref.grad(theta, x[i], y[i], n[i]) for i in range(ragged.num_clients) if n[i]]
        theta = theta - lr * np.mean(grads, axis=0)
    np.testing.assert_allclose(state.cluster_params[0], theta, rtol=1e-4, atol=1e-5)


def test_ifca_gradient_rounds_equal_loop(ragged, linear_model, ref):
    """Option I with k = 3: each cluster's gradient sum is divided by m (the clients holding
    data), not the cluster size; a cluster nobody picks does not move; the empty client is
    never assigned and not counted."""
    lr, rounds = 0.1, 4
    theta0 = np.array([[0.0, 0.0, 0.0], [1.0, -1.0, 0.5], [50.0, 50.0, 50.0]])
    alg = with_initial_params(
        ifca(linear_model, sgd(lr), num_clusters=3, option="gradient"),
        _fixed_params(theta0),
    )
    x, y, n = _np_data(ragged)
    m = ragged.num_clients
    real = [i for i in range(m) if n[i] > 0]
    theta = theta0.copy()
    state = alg.init(jax.random.key(0), ragged)
    round_ = jax.jit(alg.round)
    for key in jax.random.split(jax.random.key(1), rounds):
        state, metrics = round_(state, ragged, key)
        losses = np.array(
            [[ref.loss(theta[j], x[i], y[i], n[i]) for j in range(3)] for i in range(m)]
        )
        assign = np.where(n > 0, np.argmin(losses, axis=1), -1)
        grads = np.zeros_like(theta)
        for i in real:
            grads[assign[i]] += ref.grad(theta[assign[i]], x[i], y[i], n[i])
        theta = theta - lr * grads / len(real)
        np.testing.assert_array_equal(state.assignment, assign)
        np.testing.assert_allclose(state.cluster_params, theta, rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(
            metrics["cluster_sizes"], np.bincount(assign[real], minlength=3))
        np.testing.assert_allclose(
            metrics["cohort_loss"], np.mean(losses[real, assign[real]]), rtol=1e-4
        )
    np.testing.assert_array_equal(state.cluster_params[2], theta0[2])  # the empty cluster


# --------------------------------------------------------------------------- option II vs a loop


@pytest.mark.parametrize("weighting", ["uniform", "examples"])
def test_ifca_model_round_equals_per_client_loop(ragged, linear_model, ref, weighting):
    """Per client: losses for every cluster, argmin, τ full-batch GD steps from the
    chosen model; then the per-cluster mean, an empty cluster keeping its model."""
    lr, tau, k = 0.05, 3, 3
    theta0 = np.array([[0.0, 0.0, 0.0], [1.0, -1.0, 0.5], [50.0, 50.0, 50.0]])
    alg = with_initial_params(
        ifca(linear_model, sgd(lr, steps=tau), num_clusters=k, option="model",
             weighting=weighting),
        _fixed_params(theta0),
    )
    state = alg.init(jax.random.key(0), ragged)
    new, metrics = jax.jit(alg.round)(state, ragged, jax.random.key(1))

    x, y, n = _np_data(ragged)
    m = ragged.num_clients
    assign, trained, chosen_loss = [], [], []
    for i in range(m):
        losses = [ref.loss(theta0[j], x[i], y[i], n[i]) for j in range(k)]
        j = int(np.argmin(losses)) if n[i] else -1  # the empty client takes no part
        theta = theta0[max(j, 0)].copy()
        for _ in range(tau):
            theta = theta - lr * ref.grad(theta, x[i], y[i], n[i])
        assign.append(j)
        trained.append(theta)
        chosen_loss.append(losses[j])
    weights = (np.ones(m) if weighting == "uniform" else n.astype(np.float64)) * (n > 0)
    want = theta0.copy()
    for j in range(k):
        members = [i for i in range(m) if assign[i] == j]
        w = sum(weights[i] for i in members)
        if w > 0:
            want[j] = sum(weights[i] * trained[i] for i in members) / w

    assert 2 not in assign  # the premise: cluster 2 is empty
    np.testing.assert_array_equal(new.assignment, assign)
    np.testing.assert_allclose(new.cluster_params, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(new.cluster_params[2], theta0[2])
    real = n > 0
    np.testing.assert_array_equal(
        metrics["cluster_sizes"], np.bincount(np.asarray(assign)[real], minlength=k))
    np.testing.assert_allclose(metrics["cohort_loss"], np.mean(np.asarray(chosen_loss)[real]),
                               rtol=1e-4)
    np.testing.assert_array_equal(new.stable, 0)  # the first assignment is a change
    assert int(new.round) == 1


# --------------------------------------------------------------------------- recovery


def test_ifca_recovers_clusters_on_linear_mixture(ref):
    """k=2, m=20, n=50, d=10, R=1, σ=0.1: least-squares floor σ√(d/(N−d)) ≈ 0.014 with
    N = m·n/k = 500, well below the success threshold 0.6σ = 0.06. The best single
    model (pooled least squares, where FedAvg goes) stays ≈ 1 away, so passing the
    threshold needs the clustering."""
    k, m, n, d, sigma = 2, 20, 50, 10, 0.1
    prob = linear_mixture(jax.random.key(0), k=k, m=m, n=n, d=d, sigma=sigma, R=1.0, n_test=20)
    assert not np.array_equal(prob.theta_star[0], prob.theta_star[1])
    model = linear_regression(d)
    init_key, round_keys = jax.random.key(100), jax.random.split(jax.random.key(101), 100)

    def min_dist(params):
        star = np.asarray(prob.theta_star)
        return np.mean([min(np.linalg.norm(p - s) for s in star) for p in np.asarray(params)])

    alg = ifca(model, sgd(0.1), num_clusters=k, option="gradient")
    state, metrics = _run(alg, prob.train, init_key, round_keys)
    assert ref.perm_accuracy(state.assignment, prob.train.cluster, k) == 1.0
    test_assign = alg.evaluate(state, prob.test)["assignment"]
    assert ref.perm_accuracy(test_assign, prob.test.cluster, k) == 1.0
    assert min_dist(state.cluster_params) < 0.6 * sigma
    assert metrics["cohort_loss"][-1] < 2 * sigma**2  # the noise level, σ² = 0.01

    x = np.asarray(prob.train.x, np.float64).reshape(m * n, d)
    pooled = np.linalg.lstsq(x, np.asarray(prob.train.y, np.float64).ravel(), rcond=None)[0]
    assert min_dist(pooled[None]) > 0.6 * sigma


# --------------------------------------------------------------------------- participation


def _six_clients(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(6, 5, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -1.0, 0.5], np.float32)).astype(np.float32)
    return FederatedData.from_arrays(x, y)


@pytest.mark.parametrize("option,divide_by", [("gradient", "m"), ("gradient", "cohort"),
                                               ("model", "m")])
def test_ifca_participation_cohort(linear_model, ref, option, divide_by):
    """Half the clients take part: exactly 3 re-assign, the others keep assignment and
    stable counter; with option II the picked cluster is the mean over the cohort; option
    I divides the cohort's gradient sum by m (the paper) or by the cohort size."""
    data = _six_clients()
    lr, tau = 0.05, 2
    # Everyone sits in cluster 0 (a bad model); any participant will move to cluster 1.
    theta0 = np.array([[50.0, 50.0, 50.0], [1.0, -1.0, 0.0]])
    training = sgd(lr, steps=tau) if option == "model" else sgd(lr)
    alg = with_initial_params(
        ifca(linear_model, training, num_clusters=2, option=option, participation=0.5,
             **({} if option == "model" else {"divide_by": divide_by})),
        _fixed_params(theta0),
    )
    base = alg.init(jax.random.key(0), data)
    base = base._replace(assignment=jnp.zeros(6, jnp.int32), stable=jnp.full(6, 5, jnp.int32))
    round_ = jax.jit(alg.round)
    x, y, n = _np_data(data)
    seen = set()
    for key in jax.random.split(jax.random.key(3), 8):
        new, metrics = round_(base, data, key)
        cohort = np.flatnonzero(np.asarray(new.assignment) == 1)
        rest = np.flatnonzero(np.asarray(new.assignment) != 1)
        assert len(cohort) == 3
        np.testing.assert_array_equal(np.asarray(new.assignment)[rest], 0)
        np.testing.assert_array_equal(np.asarray(new.stable)[rest], 5)
        np.testing.assert_array_equal(np.asarray(new.stable)[cohort], 0)
        np.testing.assert_array_equal(metrics["cluster_sizes"], [0, 3])
        np.testing.assert_array_equal(new.cluster_params[0], theta0[0])
        if option == "model":
            trained = []
            for i in cohort:
                theta = theta0[1].copy()
                for _ in range(tau):
                    theta = theta - lr * ref.grad(theta, x[i], y[i], n[i])
                trained.append(theta)
            want = np.mean(trained, axis=0)
        else:  # the gradient sum over the cohort divided by m = 6 or the cohort size 3
            g = sum(ref.grad(theta0[1], x[i], y[i], n[i]) for i in cohort)
            g /= 6 if divide_by == "m" else 3
            want = theta0[1] - lr * g
        np.testing.assert_allclose(new.cluster_params[1], want, rtol=1e-4, atol=1e-5)
        seen.update(cohort.tolist())
    assert len(seen) > 3  # different keys give different cohorts


def test_ifca_communication_reduction():
    """Starting at the true models the assignment never changes; after r stable
    rounds every client is frozen and gets only its own model (d instead of k·d)."""
    k, m, n, d, r = 2, 8, 20, 4, 2
    prob = linear_mixture(jax.random.key(1), k=k, m=m, n=n, d=d, sigma=0.1, R=1.0)
    alg = with_initial_params(
        ifca(linear_regression(d), sgd(0.05), num_clusters=k, option="gradient",
             stable_rounds=r),
        _fixed_params(prob.theta_star),
    )
    rounds = r + 4
    state = alg.init(jax.random.key(0), prob.train)
    round_ = jax.jit(alg.round)
    frozen, down = [], []
    for key in jax.random.split(jax.random.key(2), rounds):
        state, metrics = round_(state, prob.train, key)
        np.testing.assert_array_equal(state.assignment, prob.train.cluster)  # the premise
        frozen.append(int(metrics["frozen_clients"]))
        down.append(float(metrics["downlink_floats"]))
    # Round 0 assigns (a change from -1); rounds 1..r are the r stable rounds.
    want_frozen = [0] * (r + 1) + [m] * (rounds - r - 1)
    assert frozen == want_frozen
    assert down == [k * d * m if f == 0 else d * m for f in want_frozen]


# --------------------------------------------------------------------------- registry-wide


_TRAINING = sgd(0.05, steps=2)
_POOL = dict(num_clusters=2, pretraining=sgd(0.05, steps=3), kmeans_restarts=2)


def _build(name, model):
    """The registered factory with the pooled training and whichever of the pooled settings
    it accepts."""
    factory = ALGORITHMS[name]
    accepted = inspect.signature(factory).parameters
    pool = dict(_POOL, option="model") if name == "ifca" else _POOL  # option I has no τ
    if factory.__module__ == "fedjax_sim.algorithms.mixed":  # Mixed FL needs a centralized loss
        # (here a server regularizer)
        pool = dict(pool, central_loss=l2_regularizer(0.1))
    return factory(model, _TRAINING, **{k: v for k, v in pool.items() if k in accepted})


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_registry_smoke_determinism_single_trace(name, ragged, linear_model):
    """Every registered algorithm: init, round and evaluate run under jit with finite
    results of the documented shapes; the same key gives a bitwise identical state; the
    jitted round is traced once, whatever the state values and keys."""
    alg = _build(name, linear_model)
    m = ragged.num_clients
    chex.clear_trace_counter()  # the counter is per function name, shared by the parameters

    @jax.jit
    @chex.assert_max_traces(n=1)
    def round_(state, data, key):
        return alg.round(state, data, key)

    init, evaluate = jax.jit(alg.init), jax.jit(alg.evaluate)
    runs = []
    for _ in range(2):
        state = init(jax.random.key(7), ragged)
        for key in jax.random.split(jax.random.key(8), 2):
            state, metrics = round_(state, ragged, key)  # new values, new keys: no retrace
        runs.append(state)
    chex.assert_trees_all_equal(runs[0], runs[1])
    chex.assert_tree_all_finite((jax.tree.leaves(state), metrics))

    out = evaluate(state, ragged)
    chex.assert_shape(out["client_loss"], (m,))
    chex.assert_shape(out["assignment"], (m,))
    assert jnp.issubdtype(out["assignment"].dtype, jnp.integer)
    chex.assert_tree_all_finite(out["client_loss"])

    # Other state values of the same structure do not retrace either.
    perturbed = jax.tree.map(
        lambda a: a + 1 if jnp.issubdtype(a.dtype, jnp.floating) else a, runs[0]
    )
    round_(perturbed, ragged, jax.random.key(9))
    other, _ = round_(init(jax.random.key(70), ragged), ragged, jax.random.key(8))
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(other), jax.tree.leaves(runs[0]), strict=True)
    )


@functools.cache
def _ifca_with_cohorts(model):
    """One IFCA object shared by the tests below, so `_run` compiles it once."""
    return ifca(model, sgd(0.05), num_clusters=2, option="gradient", participation=0.6)


def test_ifca_partial_participation_deterministic(ragged, linear_model):
    """The random path (the cohort) depends only on the key."""
    alg = _ifca_with_cohorts(linear_model)
    keys = jax.random.split(jax.random.key(1), 3)
    a = _run(alg, ragged, jax.random.key(0), keys)
    b = _run(alg, ragged, jax.random.key(0), keys)
    chex.assert_trees_all_equal(a, b)
    c = _run(alg, ragged, jax.random.key(0), jax.random.split(jax.random.key(2), 3))
    assert not np.array_equal(a[0].cluster_params, c[0].cluster_params)


# --------------------------------------------------------------------------- with_restarts


def test_with_restarts_equals_plain_runs_with_folded_keys(ragged, linear_model):
    alg = _ifca_with_cohorts(linear_model)
    restarts = 3
    init_key, round_keys = jax.random.key(0), jax.random.split(jax.random.key(1), 3)
    multi, multi_metrics = _run(with_restarts(alg, restarts), ragged, init_key, round_keys)
    chex.assert_shape(multi.cluster_params, (restarts, 2, ragged.x.shape[-1]))
    chex.assert_shape(multi.assignment, (restarts, ragged.num_clients))
    multi_eval = with_restarts(alg, restarts).evaluate(multi, ragged)
    plain_params = []
    for r in range(restarts):
        fold = lambda k, r=r: jax.random.fold_in(k, r)  # noqa: E731
        plain, plain_metrics = _run(alg, ragged, fold(init_key), jax.vmap(fold)(round_keys))
        mine = jax.tree.map(lambda a, r=r: a[r], multi)
        chex.assert_trees_all_close(mine, plain, rtol=RTOL, atol=ATOL)
        np.testing.assert_array_equal(mine.assignment, plain.assignment)
        # Metrics are stacked by the scan: [rounds, restarts, ...].
        chex.assert_trees_all_close(
            jax.tree.map(lambda a, r=r: a[:, r], multi_metrics),
            plain_metrics,
            rtol=RTOL,
            atol=ATOL,
        )
        chex.assert_trees_all_close(
            jax.tree.map(lambda a, r=r: a[r], multi_eval),
            alg.evaluate(plain, ragged),
            rtol=RTOL,
            atol=ATOL,
        )
        plain_params.append(np.asarray(plain.cluster_params))
    assert not np.allclose(plain_params[0], plain_params[1])  # the restarts differ


# --------------------------------------------------------------------------- other algorithms


def test_local_models_round_is_local_training(ragged, linear_model, ref):
    lr, tau = 0.05, 3
    alg = local_models(linear_model, sgd(lr, steps=tau))
    state = alg.init(jax.random.key(0), ragged)
    np.testing.assert_array_equal(
        state.params, np.broadcast_to(state.params[0], state.params.shape)
    )
    new, _ = jax.jit(alg.round)(state, ragged, jax.random.key(1))
    x, y, n = _np_data(ragged)
    for i in range(ragged.num_clients):
        theta = np.asarray(state.params[i], np.float64)
        for _ in range(tau):
            theta = theta - lr * ref.grad(theta, x[i], y[i], n[i])
        np.testing.assert_allclose(new.params[i], theta, rtol=1e-4, atol=1e-5)


def test_ifca_traced_learning_rate_sweep(ragged, linear_model):
    """A learning rate may be traced: a vmap over lrs equals separate runs."""
    theta0 = np.array([[0.0, 0.0, 0.0], [1.0, -1.0, 0.5]])
    lrs = jnp.asarray([0.01, 0.1])

    def one(lr):
        alg = with_initial_params(
            ifca(linear_model, sgd(lr), num_clusters=2), _fixed_params(theta0)
        )
        state = alg.init(jax.random.key(0), ragged)
        return alg.round(state, ragged, jax.random.key(1))[0].cluster_params

    swept = jax.jit(jax.vmap(one))(lrs)
    for i, lr in enumerate([0.01, 0.1]):
        np.testing.assert_allclose(swept[i], one(lr), rtol=RTOL, atol=ATOL)
    assert not np.allclose(swept[0], swept[1])


# --------------------------------------------------------------------------- validation


# How a client trains is one object, checked where it is built: the settings that were
# factory keywords (learning_rate, local_steps, batch_size) are refused by `sgd` /
# `ClientTraining`, keyed by the names they have there (local_steps is `steps`).
_TRAINING_KEYS = ("learning_rate", "steps", "batch_size")


def _with_training(factory, model, kwargs):
    """factory(model, sgd(the training keys of kwargs), the rest); no learning rate: no
    training at all (None), which every factory that trains clients must refuse."""
    training = {k: v for k, v in kwargs.items() if k in _TRAINING_KEYS}
    rest = {k: v for k, v in kwargs.items() if k not in _TRAINING_KEYS}
    if "learning_rate" not in training:
        return factory(model, None, **rest)
    return factory(model, sgd(training.pop("learning_rate"), **training), **rest)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_clusters=0, learning_rate=0.1), "num_clusters"),
        (dict(num_clusters=1.5, learning_rate=0.1), "num_clusters"),
        (dict(num_clusters=2, learning_rate=-0.1), "learning_rate"),
        (dict(num_clusters=2, learning_rate=float("nan")), "learning_rate"),
        (dict(num_clusters=2), "ClientTraining"),  # was: no learning_rate given
        (dict(num_clusters=2, learning_rate=0.1, option="hybrid"), "option"),
        (dict(num_clusters=2, learning_rate=0.1, weighting="loss"), "weighting"),
        (dict(num_clusters=2, learning_rate=0.1, participation=0.0), "participation"),
        (dict(num_clusters=2, learning_rate=0.1, participation=1.5), "participation"),
        (dict(num_clusters=2, learning_rate=0.1, participation=float("nan")), "participation"),
        (dict(num_clusters=2, learning_rate=0.1, steps=0), "steps"),
        (dict(num_clusters=2, learning_rate=0.1, batch_size=0), "batch_size"),
        (dict(num_clusters=2, learning_rate=0.1, stable_rounds=0), "stable_rounds"),
    ],
)
def test_ifca_rejects_bad_settings(linear_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _with_training(ifca, linear_model, kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(learning_rate=-1.0), "learning_rate"),
        (dict(learning_rate=float("nan")), "learning_rate"),
        (dict(learning_rate=0.1, weighting="median"), "weighting"),
        (dict(learning_rate=0.1, participation=2.0), "participation"),
        (dict(learning_rate=0.1, steps=0), "steps"),
    ],
)
def test_fedavg_rejects_bad_settings(linear_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _with_training(fedavg, linear_model, kwargs)


@pytest.mark.parametrize("lr", [np.float32(np.nan), np.float32(-0.1), np.float64(np.nan)])
def test_sgd_rejects_bad_numpy_learning_rate(lr):
    """A numpy scalar is a concrete number too: it must be range-checked like a float."""
    with pytest.raises(ValueError, match="learning_rate"):
        sgd(lr)


def test_client_training_accepts_good_values():
    assert isinstance(sgd(0.0).optimizer, optax.GradientTransformation)
    opt = optax.sgd(0.3)
    assert ClientTraining(opt).optimizer is opt


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(steps=0), "steps"),
        (dict(steps=1.5), "steps"),
        (dict(batch_size=0), "batch_size"),
        (dict(sampling="shuffled"), "sampling"),
    ],
)
def test_client_training_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ClientTraining(optax.sgd(0.1), **kwargs)
    with pytest.raises(ValueError, match="optimizer"):
        ClientTraining(0.1)


def test_get_algorithm():
    assert get_algorithm("ifca") is ifca
    with pytest.raises(ValueError, match="unknown algorithm 'nope'"):
        get_algorithm("nope")


def test_with_restarts_rejects_zero(linear_model):
    with pytest.raises(ValueError, match="restarts"):
        with_restarts(fedavg(linear_model, sgd(0.1)), 0)


def test_one_shot_rejects_more_clusters_than_clients(ragged, linear_model):
    with pytest.raises(ValueError, match="num_clusters"):
        one_shot_clustering(linear_model, sgd(0.1), num_clusters=9).init(
            jax.random.key(0), ragged
        )
    # The local pre-training's steps are its ClientTraining's (was pretrain_steps=0).
    with pytest.raises(ValueError, match="steps"):
        one_shot_clustering(linear_model, sgd(0.1), num_clusters=2,
                            pretraining=sgd(0.1, steps=0))
    with pytest.raises(ValueError, match="ClientTraining"):
        one_shot_clustering(linear_model, sgd(0.1), num_clusters=2, pretraining=100)


def test_federated_data_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="x and y"):
        FederatedData.from_arrays(np.zeros((3, 4, 2)), np.zeros((3, 5)))
    with pytest.raises(ValueError, match="num_examples"):
        FederatedData.from_arrays(np.zeros((3, 4, 2)), np.zeros((3, 4)), num_examples=[4, 4])
    with pytest.raises(ValueError, match="num_examples"):
        FederatedData.from_arrays(np.zeros((3, 4, 2)), np.zeros((3, 4)), num_examples=[4, 5, 0])
    with pytest.raises(ValueError, match="cluster"):
        FederatedData.from_arrays(np.zeros((3, 4, 2)), np.zeros((3, 4)), cluster=[0, 1])
    with pytest.raises(ValueError, match="same number of rows"):
        FederatedData.from_clients([np.zeros((2, 3)), np.zeros((4, 3))], [np.zeros(2), np.zeros(3)])
    with pytest.raises(ValueError, match="feature shape"):
        FederatedData.from_clients([np.zeros((2, 3)), np.zeros((4, 2))], [np.zeros(2), np.zeros(4)])
    with pytest.raises(ValueError, match="same clients"):
        FederatedData.from_clients([np.zeros((2, 3))], [np.zeros(2), np.zeros(4)])
    with pytest.raises(ValueError, match="n_max"):
        FederatedData.from_clients([np.zeros((2, 3))], [np.zeros(2)], n_max=1)


def test_federated_data_from_clients_pads_and_masks():
    xs = [
        np.ones((2, 3), np.float32),
        np.zeros((0, 3), np.float32),
        np.full((1, 3), 2.0, np.float32),
    ]
    ys = [np.ones(2, np.float32), np.zeros(0, np.float32), np.full(1, 5.0, np.float32)]
    data = FederatedData.from_clients(xs, ys, cluster=[1, 0, 1])
    chex.assert_shape(data.x, (3, 2, 3))
    np.testing.assert_array_equal(data.num_examples, [2, 0, 1])
    np.testing.assert_array_equal(data.mask(), [[1, 1], [0, 0], [1, 0]])
    np.testing.assert_array_equal(data.x[2, 0], 2.0)
    np.testing.assert_array_equal(data.x[2, 1], 0.0)
    np.testing.assert_array_equal(data.cluster, [1, 0, 1])


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(k=0, m=4), "k must"),
        (dict(k=3, m=4), "m must be divisible by k"),
        (dict(k=2, m=4, sigma=-0.1), "sigma"),
        (dict(k=2, m=4, sigma=float("nan")), "sigma"),
        (dict(k=2, m=4, R=float("nan")), "R must"),
        (dict(k=2, m=4, d=0), "d must"),
        (dict(k=2, m=2**32), "m must be at most"),
        (dict(k=2, m=4, n=2**30, d=3), r"n·\(d\+1\) must be at most"),
        (dict(k=2, m=4, n_test=2**62), r"n_test·\(d\+1\) must be at most"),
        (dict(k=2, m=4, n_test=-1), "n_test must"),
    ],
)
def test_check_mixture_settings_rejects(settings, match):
    full = dict(k=2, m=4, n=5, d=3, sigma=0.1, R=1.0) | settings
    with pytest.raises(ValueError, match=match):
        check_mixture_settings(**full)
    check_mixture_settings(k=2, m=4, n=5, d=3, sigma=0.1, R=1.0)  # the valid baseline passes
