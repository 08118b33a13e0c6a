"""FedOpt (server optimizers), FedProx, SCAFFOLD and q-FedAvg: each round against a plain
float64 loop over clients written here from the paper, the reductions to FedAvg, SCAFFOLD
against client drift, and the new algorithms on 4 forced CPU devices.

The ragged federation (conftest.py) has clients of 4, 1, 0, 3 and 2 rows: every round
sees a one-example client and an empty one, which takes no part.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from federations import local_gd, weighted_mean

from fedjax_sim.algorithms import (
    ALGORITHMS,
    drfa,
    fedavg,
    fedprox,
    ifca,
    qffl,
    scaffold,
    sgd,
    with_initial_params,
    with_server_optimizer,
    with_weight_sharing,
)
from fedjax_sim.algorithms.base import cohort_size
from fedjax_sim.algorithms.server import apply_server_update, make_server_optimizer
from fedjax_sim.data import FederatedData
from fedjax_sim.execution import planned
from fedjax_sim.models import linear_regression, mlp_classifier
from fedjax_sim.ops import sample_cohort

RTOL, ATOL = 1e-4, 1e-5


def _np(data):
    return np.asarray(data.x), np.asarray(data.y), np.asarray(data.num_examples)


def _cohort(key, m, participation):
    """The clients of a round (the cohort op's draw; its sampling is tested in test_ops)."""
    return np.asarray(sample_cohort(key, m, cohort_size(m, participation)).ids).tolist()


# --------------------------------------------------------------------------- FedProx


@pytest.mark.parametrize("participation,weighting", [(1.0, "uniform"), (0.6, "examples")])
def test_fedprox_rounds_equal_loop(ragged, linear_model, ref, participation, weighting):
    """Per client: τ GD steps on F_i(w) + μ/2‖w − w_t‖²; then the (weighted) mean."""
    lr, tau, mu = 0.05, 3, 0.5
    alg = fedprox(linear_model, sgd(lr, steps=tau), mu=mu, participation=participation,
                  weighting=weighting)
    state = alg.init(jax.random.key(0), ragged)
    round_ = jax.jit(alg.round)
    x, y, n = _np(ragged)
    w = np.asarray(state.params, np.float64)
    for key in jax.random.split(jax.random.key(1), 3):
        state, _ = round_(state, ragged, key)
        trained, weights = [], []
        for i in _cohort(key, ragged.num_clients, participation):
            w_t = w
            trained.append(local_gd(ref, w, x[i], y[i], n[i], lr, tau,
                                     extra=lambda th, w_t=w_t: mu * (th - w_t)))
            weights.append(float(n[i] > 0) * (n[i] if weighting == "examples" else 1.0))
        w = weighted_mean(trained, weights, w)
        np.testing.assert_allclose(state.params, w, rtol=RTOL, atol=ATOL)
    # The proximal term matters at this μ: FedAvg's model differs.
    plain = fedavg(linear_model, sgd(lr, steps=tau), participation=participation,
                   weighting=weighting)
    s = plain.init(jax.random.key(0), ragged)
    for key in jax.random.split(jax.random.key(1), 3):
        s, _ = jax.jit(plain.round)(s, ragged, key)
    assert not np.allclose(s.params, state.params, rtol=1e-3)


def test_fedprox_mu0_is_fedavg_bit_for_bit(ragged, linear_model):
    """μ = 0 adds an exact zero to every gradient: the same bits as FedAvg, with minibatches,
    partial participation and several rounds."""
    training, kw = sgd(0.05, steps=3, batch_size=2), dict(participation=0.6)
    a, b = fedprox(linear_model, training, mu=0.0, **kw), fedavg(linear_model, training, **kw)
    sa, sb = a.init(jax.random.key(0), ragged), b.init(jax.random.key(0), ragged)
    ra, rb = jax.jit(a.round), jax.jit(b.round)
    for key in jax.random.split(jax.random.key(1), 4):
        sa, ma = ra(sa, ragged, key)
        sb, mb = rb(sb, ragged, key)
        chex.assert_trees_all_equal((sa, ma), (sb, mb))


# --------------------------------------------------------------------------- SCAFFOLD


@pytest.mark.parametrize("participation,weighting,server_lr",
                         [(1.0, "uniform", 1.0), (0.6, "uniform", 0.7), (0.6, "examples", 1.0)])
def test_scaffold_rounds_equal_loop(ragged, linear_model, ref, participation, weighting,
                                    server_lr):
    """Algorithm 1, option II, over several rounds with a changing cohort: corrected local
    steps, c_i⁺ = c_i − c + (x − y_i)/(K η_l) for the cohort only, x += η_g mean Δy,
    c += (|S|/N) mean Δc (N, S: the clients holding data)."""
    lr, steps = 0.05, 3
    alg = scaffold(linear_model, sgd(lr, steps=steps), participation=participation,
                   weighting=weighting, server_lr=server_lr)
    state = alg.init(jax.random.key(0), ragged)
    round_ = jax.jit(alg.round)
    x, y, n = _np(ragged)
    m = ragged.num_clients
    holding = [i for i in range(m) if n[i] > 0]
    p = {i: (n[i] if weighting == "examples" else 1.0) for i in holding}
    total_p = sum(p.values())
    xs = np.asarray(state.params, np.float64)
    c, ci = np.zeros_like(xs), np.zeros((m, xs.size))
    cohorts = []
    for key in jax.random.split(jax.random.key(1), 5):
        state, _ = round_(state, ragged, key)
        cohort = [i for i in _cohort(key, m, participation) if n[i] > 0]
        cohorts.append(frozenset(cohort))
        new_ci = ci.copy()
        dys, dcs = {}, {}
        for i in cohort:
            yi = local_gd(ref, xs, x[i], y[i], n[i], lr, steps,
                           extra=lambda th, i=i: c - ci[i])
            new_ci[i] = ci[i] - c + (xs - yi) / (steps * lr)
            dys[i], dcs[i] = yi - xs, new_ci[i] - ci[i]
        if weighting == "uniform":  # the paper's form
            xs = xs + server_lr * np.mean([dys[i] for i in cohort], axis=0)
            c = c + len(cohort) / len(holding) * np.mean([dcs[i] for i in cohort], axis=0)
        else:
            xs = xs + server_lr * weighted_mean([dys[i] for i in cohort],
                                                 [p[i] for i in cohort], 0)
            c = c + sum(p[i] * dcs[i] for i in cohort) / total_p
        ci = new_ci
        np.testing.assert_allclose(state.params, xs, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(state.control, c, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(state.client_controls, ci, rtol=RTOL, atol=ATOL)
        # c stays the (weighted) mean of every client's c_i; the empty client's stays 0.
        np.testing.assert_allclose(
            state.control, sum(p[i] * np.asarray(state.client_controls[i]) for i in holding)
            / total_p, rtol=RTOL, atol=ATOL)
        np.testing.assert_array_equal(state.client_controls[2], 0.0)
    if participation < 1:
        assert len(set(cohorts)) > 1  # the cohort did change
        # Some client sat a round out with a non-zero c_i that was kept.
        assert any(np.any(ci[i] != 0) for i in holding)


def test_scaffold_chunked_equals_whole_cohort(ragged, linear_model):
    alg = scaffold(linear_model, sgd(0.05, steps=2, batch_size=2), participation=0.6)
    chunked = planned(ragged, client_chunk=2)
    sa, sb = alg.init(jax.random.key(0), ragged), alg.init(jax.random.key(0), chunked)
    round_ = jax.jit(alg.round)
    for key in jax.random.split(jax.random.key(1), 3):
        sa, ma = round_(sa, ragged, key)
        sb, mb = round_(sb, chunked, key)
        chex.assert_trees_all_close((sa, ma), (sb, mb), rtol=1e-5, atol=1e-6)
    assert np.any(np.asarray(sa.client_controls) != 0)


def _drift_problem(seed=0):
    """4 clients of a 2-d linear regression with different optima and different feature
    scales (so different Hessians: FedAvg's fixed point is then biased), no noise."""
    rng = np.random.default_rng(seed)
    scales = np.array([[3.0, 0.3], [0.3, 3.0], [2.0, 0.5], [0.5, 2.0]])
    optima = np.array([[2.0, -1.0], [-2.0, 1.0], [1.0, 2.0], [-1.0, -2.0]])
    xs = [rng.normal(size=(16, 2)) * s for s in scales]
    ys = [x @ t for x, t in zip(xs, optima, strict=True)]
    return FederatedData.from_clients([x.astype(np.float32) for x in xs],
                                      [y.astype(np.float32) for y in ys])


def test_scaffold_beats_fedavg_under_client_drift(ref):
    """With many local steps FedAvg drifts to a biased point; SCAFFOLD's corrections remove
    the drift and reach the global optimum's training loss."""
    data = _drift_problem()
    model = linear_regression(2)
    training = sgd(0.02, steps=25)
    x, y, n = _np(data)

    def objective(theta):  # the mean client loss, float64
        return np.mean([ref.loss(theta, x[i], y[i], n[i]) for i in range(4)])

    finals = {}
    for name, alg in (("fedavg", fedavg(model, training)),
                      ("scaffold", scaffold(model, training))):
        state = alg.init(jax.random.key(0), data)
        state, _ = jax.lax.scan(lambda s, k, alg=alg: alg.round(s, data, k), state,
                                jax.random.split(jax.random.key(1), 60))
        finals[name] = objective(np.asarray(state.params))
    # The global optimum: Σ_i (2/n_i) X_iᵀ(X_i θ − y_i) = 0.
    xs = [np.asarray(x[i, :n[i]], np.float64) for i in range(4)]
    ys = [np.asarray(y[i, :n[i]], np.float64) for i in range(4)]
    star = np.linalg.solve(sum(a.T @ a / len(a) for a in xs),
                           sum(a.T @ b / len(a) for a, b in zip(xs, ys, strict=True)))
    best = objective(star)
    assert finals["scaffold"] < best + 1e-3 * best
    assert finals["fedavg"] > best + 0.05 * best  # FedAvg's drift is real here
    assert finals["scaffold"] < finals["fedavg"]


# --------------------------------------------------------------------------- q-FedAvg


@pytest.mark.parametrize("participation", [1.0, 0.6])
def test_qffl_rounds_equal_loop(ragged, linear_model, ref, participation):
    """Algorithm 2: Δ_k = F_k^q L(w − w̄_k), h_k = q F_k^{q−1}‖L(w − w̄_k)‖² + L F_k^q,
    w ← w − ΣΔ_k/Σh_k, L = 1/η, F_k on the client's training data at w (+1e-10)."""
    lr, tau, q = 0.05, 3, 2.0
    alg = qffl(linear_model, sgd(lr, steps=tau), q=q, participation=participation)
    state = alg.init(jax.random.key(0), ragged)
    round_ = jax.jit(alg.round)
    x, y, n = _np(ragged)
    big_l = 1.0 / lr
    w = np.asarray(state.params, np.float64)
    for key in jax.random.split(jax.random.key(1), 3):
        state, metrics = round_(state, ragged, key)
        deltas, hs, fqs = [], [], []
        for i in _cohort(key, ragged.num_clients, participation):
            if n[i] == 0:
                continue
            loss = ref.loss(w, x[i], y[i], n[i]) + 1e-10
            dw = big_l * (w - local_gd(ref, w, x[i], y[i], n[i], lr, tau))
            deltas.append(loss**q * dw)
            hs.append(q * loss ** (q - 1) * dw @ dw + big_l * loss**q)
            fqs.append(loss**q)
        w = w - sum(deltas) / sum(hs)
        np.testing.assert_allclose(state.params, w, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(metrics["fair_weight_max"], max(fqs) / sum(fqs), rtol=1e-4)


def test_qffl_q0_equals_fedavg_to_rounding(ragged, linear_model):
    """q = 0: Δ_k = L(w − w̄_k), h_k = L, so w ← mean_k w̄_k: FedAvg (uniform), equal to float
    rounding (w − Σ L(w − w̄_k)/(|S| L) is not the same arithmetic as the mean)."""
    training, kw = sgd(0.05, steps=3, batch_size=2), dict(participation=0.6)
    a, b = qffl(linear_model, training, q=0.0, **kw), fedavg(linear_model, training, **kw)
    sa, sb = a.init(jax.random.key(0), ragged), b.init(jax.random.key(0), ragged)
    for key in jax.random.split(jax.random.key(1), 4):
        sa, _ = jax.jit(a.round)(sa, ragged, key)
        sb, _ = jax.jit(b.round)(sb, ragged, key)
        np.testing.assert_allclose(sa.params, sb.params, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- FedOpt


class Algorithm2:
    """Reddi et al.'s Algorithm 2 (and FedAvgM) in float64: step(Δ) -> the model's change."""

    def __init__(self, name, eta, b1=0.9, b2=0.99, tau=1e-3):
        self.name, self.eta, self.b1, self.b2, self.tau = name, eta, b1, b2, tau
        self.m = self.v = None

    def step(self, delta):
        if self.m is None:
            self.m, self.v = np.zeros_like(delta), np.full_like(delta, self.tau**2)
        if self.name == "sgdm":  # heavy ball: v ← 0.9 v + Δ, x ← x + η v
            self.m = 0.9 * self.m + delta
            return self.eta * self.m
        b1, b2 = self.b1, self.b2
        self.m = b1 * self.m + (1 - b1) * delta
        if self.name == "adagrad":
            self.v = self.v + delta**2
        elif self.name == "yogi":
            self.v = self.v - (1 - b2) * delta**2 * np.sign(self.v - delta**2)
        else:
            self.v = b2 * self.v + (1 - b2) * delta**2
        return self.eta * self.m / (np.sqrt(self.v) + self.tau)


@pytest.mark.parametrize("name", ["sgdm", "adam", "yogi", "adagrad"])
def test_fedopt_presets_equal_algorithm_2(ragged, linear_model, ref, name):
    """x ← x + ServerOpt(Δ), Δ the mean over the cohort's clients holding data of their
    τ-step change, with β₁ = 0.9, β₂ = 0.99, τ = 1e-3, m_{−1} = 0, v_{−1} = τ²."""
    lr, tau, eta = 0.05, 2, 0.3
    alg = with_server_optimizer(fedavg(linear_model, sgd(lr, steps=tau), participation=0.6),
                                name, server_lr=eta)
    state = alg.init(jax.random.key(0), ragged)
    round_ = jax.jit(alg.round)
    x, y, n = _np(ragged)
    w = np.asarray(state.params, np.float64)
    server = Algorithm2(name, eta)
    for key in jax.random.split(jax.random.key(1), 4):
        state, _ = round_(state, ragged, key)
        cohort = [i for i in _cohort(key, ragged.num_clients, 0.6) if n[i] > 0]
        w = w + server.step(np.mean([local_gd(ref, w, x[i], y[i], n[i], lr, tau) - w
                                     for i in cohort], axis=0))
        np.testing.assert_allclose(state.params, w, rtol=RTOL, atol=ATOL)


def test_fedopt_sgd_at_server_lr_1_equals_fedavg_to_rounding(ragged, linear_model):
    """x + 1·(mean − x) is FedAvg's mean up to float rounding (not bit for bit)."""
    b = fedavg(linear_model, sgd(0.05, steps=3, batch_size=2), participation=0.6,
               weighting="examples")
    a = with_server_optimizer(b, "sgd", server_lr=1.0)
    sa, sb = a.init(jax.random.key(0), ragged), b.init(jax.random.key(0), ragged)
    for key in jax.random.split(jax.random.key(1), 4):
        sa, ma = jax.jit(a.round)(sa, ragged, key)
        sb, mb = jax.jit(b.round)(sb, ragged, key)
        np.testing.assert_allclose(sa.params, sb.params, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(ma["cohort_loss"], mb["cohort_loss"])


def test_ifca_fedopt_per_cluster_equals_loop(ragged, linear_model, ref):
    """IFCA option II with FedOpt: each cluster model steps on its members' mean delta with
    its own Algorithm 2 state; the cluster nobody picks keeps model and state."""
    lr, tau, eta, k = 0.05, 2, 0.3, 3
    theta0 = np.array([[0.0, 0.0, 0.0], [1.0, -1.0, 0.5], [50.0, 50.0, 50.0]])
    alg = with_server_optimizer(
        with_initial_params(ifca(linear_model, sgd(lr, steps=tau), num_clusters=k,
                                 option="model"),
                            lambda key: jnp.asarray(theta0, jnp.float32)),
        "adam", server_lr=eta)
    state = alg.init(jax.random.key(0), ragged)
    round_ = jax.jit(alg.round)
    x, y, n = _np(ragged)
    theta = theta0.copy()
    servers = [Algorithm2("adam", eta) for _ in range(k)]
    for key in jax.random.split(jax.random.key(1), 3):
        state, _ = round_(state, ragged, key)
        members = {j: [] for j in range(k)}
        for i in range(ragged.num_clients):
            if n[i]:
                j = int(np.argmin([ref.loss(theta[c], x[i], y[i], n[i]) for c in range(k)]))
                members[j].append(local_gd(ref, theta[j], x[i], y[i], n[i], lr, tau))
        for j in range(k):
            if members[j]:
                theta[j] = theta[j] + servers[j].step(np.mean(members[j], axis=0) - theta[j])
        np.testing.assert_allclose(state.cluster_params, theta, rtol=RTOL, atol=ATOL)
    assert servers[2].m is None  # the premise: cluster 2 was never picked
    np.testing.assert_array_equal(state.cluster_params[2], theta0[2])
    np.testing.assert_array_equal(state.server_state[0].m[2], 0.0)  # its state kept too
    np.testing.assert_array_equal(state.server_state[0].v[2], np.float32(1e-3**2))


def test_drfa_fedopt_steps_on_the_mean_change(ragged, linear_model):
    """DRFA with server SGD at η: w + η (mean_j w_j − w), the λ step unchanged."""
    plain = drfa(linear_model, sgd(0.05, steps=3, batch_size=2), participation=0.6,
                 lambda_lr=0.1)
    opt = with_server_optimizer(plain, "sgd", server_lr=0.5)
    state = plain.init(jax.random.key(0), ragged)
    key = jax.random.key(1)
    want, _ = jax.jit(plain.round)(state, ragged, key)
    got, _ = jax.jit(opt.round)(opt.init(jax.random.key(0), ragged), ragged, key)
    np.testing.assert_allclose(got.params, state.params + 0.5 * (want.params - state.params),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got.lam, want.lam)
    assert not np.allclose(want.params, state.params)


def test_server_step_is_skipped_when_nobody_trained():
    """The server step's own skip: `trained=False` keeps model and state (what
    `with_server_optimizer` passes when the round's model did not change, next test)."""
    opt = make_server_optimizer("sgdm", 1.0)
    params = jnp.array([1.0, 2.0])
    state = opt.init(params)
    params1, state1 = apply_server_update(opt, params, state, jnp.array([0.5, -0.5]), True)
    kept = apply_server_update(opt, params1, state1, jnp.zeros(2), False)
    chex.assert_trees_all_equal(kept, (params1, state1))
    moved = apply_server_update(opt, params1, state1, jnp.zeros(2), True)  # momentum moves it
    assert not np.allclose(moved[0], params1)


def test_fedopt_round_is_skipped_when_nobody_with_data_trained(ragged, linear_model):
    """The combinator's side of the skip: `with_server_optimizer` reads "no client holding
    data took part" off the round's model not changing (FedAvg keeps w when the cohort's
    weight is 0), and then keeps the model and the momentum, which a zero pseudo-gradient
    step would have moved (the test above)."""
    alg = with_server_optimizer(fedavg(linear_model, sgd(0.1), participation=0.2), "sgdm")
    keys = list(jax.random.split(jax.random.key(4), 40))
    empty = next(k for k in keys if _cohort(k, 5, 0.2) == [2])  # the client without rows
    holding = next(k for k in keys if _cohort(k, 5, 0.2) == [0])
    round_ = jax.jit(alg.round)
    state, _ = round_(alg.init(jax.random.key(0), ragged), ragged, holding)
    assert any(np.any(np.asarray(v) != 0) for v in jax.tree.leaves(state.server_state))
    kept, _ = round_(state, ragged, empty)
    chex.assert_trees_all_equal(kept, state._replace(round=state.round + 1))
    moved, _ = round_(state, ragged, holding)
    assert not np.allclose(moved.params, state.params)


@pytest.mark.xfail(strict=True, reason=(
    "with_server_optimizer reads 'nobody trained' off 'the model did not change': a round "
    "whose clients holding data all return their start model (here a zero gradient) also "
    "freezes the momentum; FedAvgM (and fedavg(server_optimizer='sgdm') before the surface "
    "redesign) steps x + η·βv on a zero Δ"))
def test_fedavgm_momentum_carries_a_round_whose_clients_did_not_move():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 3)).astype(np.float32)
    zeros = np.zeros((4, 3), np.float32)  # rows whose gradient is 0 at every θ
    data = FederatedData.from_clients([x, zeros], [x @ np.ones(3, np.float32), zeros[:, 0]])
    keys = list(jax.random.split(jax.random.key(3), 20))
    first, second = (next(k for k in keys if _cohort(k, 2, 0.5) == [i]) for i in (0, 1))
    alg = with_server_optimizer(fedavg(linear_regression(3), sgd(0.1), participation=0.5),
                                "sgdm")
    round_ = jax.jit(alg.round)
    state, _ = round_(alg.init(jax.random.key(0), data), data, first)
    after, _ = round_(state, data, second)
    # The step a zero pseudo-gradient takes with momentum (x + η·βv, v = round 1's Δ).
    want, _ = apply_server_update(make_server_optimizer("sgdm", None), state.params,
                                  state.server_state, jnp.zeros(3), True)
    assert not np.allclose(want, state.params)
    np.testing.assert_allclose(after.params, want, rtol=1e-6)


# --------------------------------------------------------------------------- validation


def _fedavg(model):
    return fedavg(model, sgd(0.1))


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda m: fedprox(m, sgd(0.1), mu=-1.0), "mu"),
        (lambda m: fedprox(m, sgd(0.1), mu=float("nan")), "mu"),
        (lambda m: scaffold(m, sgd(0.0)), "learning_rate"),
        (lambda m: scaffold(m, sgd(0.1), weighting="loss"), "weighting"),
        # scaffold no longer takes a server optimizer (its own server step is server_lr's
        # SGD); the refusal of none moved to the combinator that adds one.
        (lambda m: with_server_optimizer(scaffold(m, sgd(0.1)), None), "needs an optimizer"),
        (lambda m: qffl(m, sgd(0.1), q=-0.5), "q must"),
        (lambda m: qffl(m, sgd(0.0)), "learning_rate"),
        (lambda m: with_server_optimizer(_fedavg(m), "nesterov"), "server_optimizer"),
        (lambda m: with_server_optimizer(_fedavg(m), "adam", server_lr=0.0), "server_lr"),
        (lambda m: with_server_optimizer(_fedavg(m), optax.adam(0.1), server_lr=0.1),
         "server_lr"),
        (lambda m: with_server_optimizer(_fedavg(m), None, server_lr=0.1), "server_lr"),
    ],
)
def test_rejects_bad_settings(linear_model, build, match):
    with pytest.raises(ValueError, match=match):
        build(linear_model)


def test_ifca_server_optimizer_refuses_a_shared_trunk(ragged):
    """FedOpt steps each cluster's own model; the trunk of weight sharing has no server step
    (the old `ifca(..., weight_sharing=True, server_optimizer=...)` refusal, now at init)."""
    model = mlp_classifier((3,), [4], 2, split=True)
    alg = with_server_optimizer(
        with_weight_sharing(ifca(model, sgd(0.1), num_clusters=2, option="model"), model),
        "adam")
    data = ragged.replace(y=(np.asarray(ragged.y) > 0).astype(np.int32))
    with pytest.raises(ValueError, match="trunk"):
        alg.init(jax.random.key(0), data)


def test_registered_names():
    assert (ALGORITHMS["fedprox"], ALGORITHMS["scaffold"], ALGORITHMS["qffl"]) == (
        fedprox, scaffold, qffl)


# --------------------------------------------------------------------------- devices

# 1 vs 4 devices: test_sharding.py::test_sharded_equals_unsharded runs FedAvg with Adam at
# the server (and the FedOpt recipes), FedProx with SGD momentum at the server, SCAFFOLD in
# chunks of 2 and q-FFL in chunks of 3 (not dividing the cohort; the chunk on the data's
# plan), all with minibatches, in its one subprocess of every algorithm.
