"""AFL, HypCluster, CFL, Ditto and robust IFCA: each round against a plain numpy loop over
clients (float64), the reductions to FedAvg / IFCA, behaviour on small problems built
here (4 forced CPU devices against 1: in test_sharding.py's run of every algorithm).

The references use full-batch SGD (so no minibatch keys enter) and draw the cohort as the
cohort path documents it: split(round key) -> (ids key, slot keys), the ids uniform
without replacement. The ragged fixture has clients of 4, 1, 0, 3 and 2 rows.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from federations import brute_bipartition, np_simplex_projection

from fedjax_sim.algorithms import (
    afl,
    cfl,
    ditto,
    fedavg,
    hypcluster,
    ifca,
    robust_ifca,
    sgd,
    with_initial_params,
)
from fedjax_sim.data import FederatedData
from fedjax_sim.execution import planned
from fedjax_sim.models import linear_regression
from fedjax_sim.ops.clustering import optimal_bipartition

LR, TAU = 0.05, 2
RTOL, ATOL = 1e-5, 1e-6


def _np(data):
    return np.asarray(data.x, np.float64), np.asarray(data.y, np.float64), np.asarray(
        data.num_examples)


def _cohort_ids(key, m, s):
    """The cohort's clients, as `sample_cohort` documents: everyone in order when s = m."""
    if s == m:
        return np.arange(m)
    key_ids, _ = jax.random.split(key)
    return np.asarray(jax.random.choice(key_ids, m, (s,), replace=False))


def _sgd(ref, theta, x, y, n, steps, lr=LR, pull=None, lam=0.0):
    """`steps` full-batch GD steps of F(θ) (+ λ/2‖θ − pull‖²), float64."""
    theta = np.array(theta, np.float64)
    for _ in range(steps):
        g = ref.grad(theta, x, y, n)
        if pull is not None:
            g = g + lam * (theta - pull)
        theta = theta - lr * g
    return theta


def _rounds(alg, data, state, keys):
    round_ = jax.jit(alg.round)
    for key in keys:
        state, _ = round_(state, data, key)
        yield key, state


KEYS = list(jax.random.split(jax.random.key(3), 3))


# --------------------------------------------------------------------------- AFL


def afl_reference(ref, theta, lam, data, ids, gamma):
    """One AFL round: λ-weighted mean of the cohort's τ-step models; λ += γ (m/s) F_i(w)."""
    x, y, n = _np(data)
    m, s = len(n), len(ids)
    total, weight, v = np.zeros_like(theta), 0.0, np.zeros(m)
    for i in ids:
        if n[i] == 0:
            continue
        v[i] = m / s * ref.loss(theta, x[i], y[i], n[i])
        total += lam[i] * _sgd(ref, theta, x[i], y[i], n[i], TAU)
        weight += lam[i]
    new_theta = total / weight if weight > 0 else theta
    new_lam = np.zeros(m)
    active = n > 0
    new_lam[active] = np_simplex_projection((lam + gamma * v)[active])
    return new_theta, new_lam


@pytest.mark.parametrize("participation", [1.0, 0.6])
def test_afl_round_equals_per_client_loop(ragged, linear_model, ref, participation):
    gamma = 0.3
    alg = afl(linear_model, sgd(LR, steps=TAU), participation=participation, lambda_lr=gamma)
    state = start = alg.init(jax.random.key(0), ragged)
    n = np.asarray(ragged.num_examples)
    np.testing.assert_allclose(state.lam, (n > 0) / np.sum(n > 0))  # empty client: λ = 0
    theta, lam = np.asarray(state.params, np.float64), np.asarray(state.lam, np.float64)
    s = round(participation * 5)
    for key, state in _rounds(alg, ragged, start, KEYS):
        theta, lam = afl_reference(ref, theta, lam, ragged, _cohort_ids(key, 5, s), gamma)
        np.testing.assert_allclose(state.params, theta, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(state.lam, lam, atol=1e-6)
    assert lam[2] == 0 and not np.allclose(lam, lam[0] * (n > 0))  # λ moved, not to the empty


@pytest.mark.parametrize("participation", [1.0, 0.6])
def test_afl_evaluates_the_averaged_iterates(ragged, linear_model, ref, participation):
    """Stochastic-AFL's output: w^A = (1/T) Σ_{t=1..T} w_t and λ^A likewise, the iterates
    after each update (not w_0); before any round the start. `evaluate_iterate="last"`:
    w_T and λ_T."""
    gamma = 0.3
    kw = dict(participation=participation, lambda_lr=gamma)
    averaged = afl(linear_model, sgd(LR, steps=TAU), **kw)
    last = afl(linear_model, sgd(LR, steps=TAU), evaluate_iterate="last", **kw)
    start = averaged.init(jax.random.key(0), ragged)
    x, y, n = _np(ragged)

    def losses(theta):
        return [ref.loss(theta, x[i], y[i], n[i]) for i in range(len(n))]

    theta = np.asarray(start.params, np.float64)
    lam = np.asarray(start.lam, np.float64)
    np.testing.assert_allclose(averaged.evaluate(start, ragged)["client_loss"], losses(theta),
                               rtol=1e-5, atol=1e-7)
    thetas, lams = [], []
    s = round(participation * 5)
    for key, state in _rounds(averaged, ragged, start, KEYS):
        theta, lam = afl_reference(ref, theta, lam, ragged, _cohort_ids(key, 5, s), gamma)
        thetas.append(theta)
        lams.append(lam)
        w_avg, lam_avg = np.mean(thetas, axis=0), np.mean(lams, axis=0)
        np.testing.assert_allclose(state.params_avg, w_avg, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(state.lam_avg, lam_avg, atol=1e-6)
        out = averaged.evaluate(state, ragged)
        np.testing.assert_allclose(out["client_loss"], losses(w_avg), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(out["client_lambda"], lam_avg, atol=1e-6)
        out = last.evaluate(state, ragged)
        np.testing.assert_allclose(out["client_loss"], losses(theta), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(out["client_lambda"], lam, atol=1e-6)
    assert not np.allclose(losses(w_avg), losses(theta), rtol=1e-3)  # the two differ here
    with pytest.raises(ValueError, match="evaluate_iterate"):
        afl(linear_model, sgd(LR), evaluate_iterate="mean")


def _spread_problem(rows=20):
    """4 clients, d = 2: three agree on θ* = (1, 0), one wants (−1, 0) (noise-free)."""
    rng = np.random.default_rng(0)
    thetas = [(1.0, 0.0)] * 3 + [(-1.0, 0.0)]
    xs = [rng.normal(size=(rows, 2)).astype(np.float32) for _ in thetas]
    ys = [(x @ np.asarray(t, np.float32)).astype(np.float32) for x, t in zip(xs, thetas,
                                                                             strict=True)]
    return FederatedData.from_clients(xs, ys), linear_regression(2)


def test_afl_lowers_the_worst_clients_loss_below_fedavgs():
    data, model = _spread_problem()
    worst = {}
    for name, alg in (("fedavg", fedavg(model, sgd(0.1))),
                      ("afl", afl(model, sgd(0.1), lambda_lr=0.1))):
        state = alg.init(jax.random.key(0), data)
        state, _ = jax.lax.scan(lambda st, k, a=alg: a.round(st, data, k), state,
                                jax.random.split(jax.random.key(1), 300))
        worst[name] = float(jnp.max(alg.evaluate(state, data)["client_loss"]))
    # FedAvg sits near the mean (0.5, 0): the outlier's loss ≈ 1.5² = 2.25; AFL near the
    # minimax point (0, 0): every loss ≈ 1.
    assert worst["fedavg"] > 1.8
    assert worst["afl"] < 0.7 * worst["fedavg"]


# --------------------------------------------------------------------------- HypCluster


def _two_models(seed=0, k=2):
    return np.random.default_rng(seed).normal(size=(k, 3)).astype(np.float32)


def hypcluster_reference(ref, params, assignment, data, ids):
    """argmin-loss hypothesis, τ steps from it, example-weighted mean per hypothesis."""
    x, y, n = _np(data)
    k = len(params)
    total, weight = np.zeros_like(params), np.zeros(k)
    assignment = assignment.copy()
    for i in ids:
        if n[i] == 0:
            continue
        j = int(np.argmin([ref.loss(p, x[i], y[i], n[i]) for p in params]))
        total[j] += n[i] * _sgd(ref, params[j], x[i], y[i], n[i], TAU)
        weight[j] += n[i]
        assignment[i] = j
    new = np.where(weight[:, None] > 0, total / np.maximum(weight, 1)[:, None], params)
    return new, assignment


@pytest.mark.parametrize("participation", [1.0, 0.6])
def test_hypcluster_round_equals_per_client_loop(ragged, linear_model, ref, participation):
    alg = hypcluster(linear_model, sgd(LR, steps=TAU), num_clusters=2,
                     participation=participation)
    state = start = alg.init(jax.random.key(0), ragged)._replace(
        cluster_params=jnp.asarray(_two_models()))
    params, assignment = _two_models().astype(np.float64), np.full(5, -1)
    s = round(participation * 5)
    for key, state in _rounds(alg, ragged, start, KEYS):
        params, assignment = hypcluster_reference(ref, params, assignment, ragged,
                                                  _cohort_ids(key, 5, s))
        np.testing.assert_allclose(state.cluster_params, params, rtol=RTOL, atol=ATOL)
        np.testing.assert_array_equal(state.assignment, assignment)  # the training-time choice
        evaluation_equals_choice_under_current_hypotheses(alg, state, ragged, params, ref)


def evaluation_equals_choice_under_current_hypotheses(alg, state, data, params, ref):
    """Mansour et al. / FedJAX's HypClusterEvaluator: each client takes the hypothesis of
    lowest loss on its data under the current h_j (ties: the first) and is scored with it."""
    out = alg.evaluate(state, data)
    x, y, n = _np(data)
    for i in range(len(n)):
        if n[i] == 0:
            assert out["assignment"][i] == -1 and out["client_weight"][i] == 0
            continue
        losses = [ref.loss(p, x[i], y[i], n[i]) for p in params]
        j = int(np.argmin(losses))
        assert out["assignment"][i] == j, i
        np.testing.assert_allclose(out["client_loss"][i], losses[j], rtol=1e-5, atol=1e-7)


def test_hypcluster_evaluation_ignores_the_training_time_assignment(ragged, linear_model, ref):
    """The state's assignment (each client's choice at the start of its last round) is not
    read by the evaluation: with every stored choice flipped the clients are still scored
    with their best current hypothesis."""
    alg = hypcluster(linear_model, sgd(LR, steps=TAU), num_clusters=2)
    state = alg.init(jax.random.key(0), ragged)._replace(
        cluster_params=jnp.asarray(_two_models()))
    state, _ = jax.jit(alg.round)(state, ragged, KEYS[0])
    flipped = state._replace(assignment=jnp.where(state.assignment >= 0,
                                                  1 - state.assignment, -1))
    chex.assert_trees_all_equal(alg.evaluate(flipped, ragged), alg.evaluate(state, ragged))
    evaluation_equals_choice_under_current_hypotheses(
        alg, flipped, ragged, np.asarray(state.cluster_params, np.float64), ref)


def test_hypcluster_k1_equals_fedavg_with_example_weights(ragged, linear_model):
    training, kw = sgd(LR, steps=TAU, batch_size=2), dict(participation=0.6)
    h = hypcluster(linear_model, training, num_clusters=1, **kw)
    f = fedavg(linear_model, training, weighting="examples", **kw)
    sf = f.init(jax.random.key(0), ragged)
    sh = h.init(jax.random.key(0), ragged)._replace(cluster_params=sf.params[None])
    rh, rf = jax.jit(h.round), jax.jit(f.round)
    for key in jax.random.split(jax.random.key(5), 4):
        sh, _ = rh(sh, ragged, key)
        sf, _ = rf(sf, ragged, key)
        np.testing.assert_allclose(sh.cluster_params[0], sf.params, rtol=1e-6, atol=1e-7)


def test_hypcluster_kmeans_init_picks_client_models_far_apart(ref):
    """k-means++ (FedJAX's variant): the second hypothesis is the model of the client the
    first fits worst; with two opposite groups the two come from different groups."""
    data, model = _opposite_clusters()
    alg = hypcluster(model, sgd(0.1), num_clusters=2, init="kmeans++", init_steps=30)
    params = np.asarray(alg.init(jax.random.key(0), data).cluster_params)
    truth = np.asarray(data.cluster)
    x, y, n = _np(data)
    chosen = [int(np.argmin([ref.loss(p, x[i], y[i], n[i]) for p in params])) for i in range(8)]
    assert ref.perm_accuracy(chosen, truth, 2) == 1.0


# --------------------------------------------------------------------------- Ditto


def ditto_reference(ref, w, personal, data, ids, lam, personal_steps):
    x, y, n = _np(data)
    total, count, personal = np.zeros_like(w), 0, personal.copy()
    for i in ids:
        if n[i] == 0:
            continue
        total += _sgd(ref, w, x[i], y[i], n[i], TAU)
        count += 1
        personal[i] = _sgd(ref, personal[i], x[i], y[i], n[i], personal_steps, pull=w, lam=lam)
    return (total / count if count else w), personal


@pytest.mark.parametrize("participation", [1.0, 0.6])
def test_ditto_round_equals_per_client_loop(ragged, linear_model, ref, participation):
    lam = 0.5
    alg = ditto(linear_model, sgd(LR, steps=TAU), personal=sgd(LR, steps=3),
                ditto_lambda=lam, participation=participation)
    state = start = alg.init(jax.random.key(0), ragged)
    w = w0 = np.asarray(state.params, np.float64)
    personal = np.tile(w, (5, 1))
    s = round(participation * 5)
    for key, state in _rounds(alg, ragged, start, KEYS):
        w, personal = ditto_reference(ref, w, personal, ragged, _cohort_ids(key, 5, s), lam, 3)
        np.testing.assert_allclose(state.params, w, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(state.personal, personal, rtol=RTOL, atol=ATOL)
    out = alg.evaluate(state, ragged)
    x, y, n = _np(ragged)
    want = [ref.loss(personal[i], x[i], y[i], n[i]) for i in range(5)]
    np.testing.assert_allclose(out["client_loss"], want, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(out["assignment"], -1)
    np.testing.assert_array_equal(state.personal[2], w0.astype(np.float32))  # no data: kept
    assert not np.allclose(personal[0], w)  # personal models differ from the global one


def test_ditto_global_model_is_fedavgs(ragged, linear_model):
    training, kw = sgd(LR, steps=TAU, batch_size=2), dict(participation=0.6)
    d = ditto(linear_model, training, ditto_lambda=0.3, **kw)
    f = fedavg(linear_model, training, **kw)
    sd, sf = d.init(jax.random.key(0), ragged), f.init(jax.random.key(0), ragged)
    for key in jax.random.split(jax.random.key(5), 3):
        sd, _ = jax.jit(d.round)(sd, ragged, key)
        sf, _ = jax.jit(f.round)(sf, ragged, key)
    np.testing.assert_array_equal(sd.params, sf.params)


# --------------------------------------------------------------------------- robust IFCA


def robust_reference(ref, params, assignment, lam, data, ids, gamma):
    """The documented round: entry weight 1/|C_j| (old membership), λ-weighted cluster means,
    per-cluster renormalisation, then λ_C ← Π(λ_C + γτ (|C|/|S∩C|) F_i)."""
    x, y, n = _np(data)
    k, m = len(params), len(n)
    old = np.bincount(assignment[assignment >= 0], minlength=k)
    entry = 1.0 / np.maximum(old, 1)
    total, weight = np.zeros_like(params), np.zeros(k)
    assignment, lam = assignment.copy(), lam.copy()
    loss_of, chosen = {}, {}
    for i in ids:
        if n[i] == 0:
            continue
        losses = [ref.loss(p, x[i], y[i], n[i]) for p in params]
        j = int(np.argmin(losses))
        w = lam[i] if assignment[i] == j else entry[j]
        total[j] += w * _sgd(ref, params[j], x[i], y[i], n[i], TAU)
        weight[j] += w
        assignment[i], lam[i], loss_of[i], chosen[i] = j, w, losses[j], j
    new = np.where(weight[:, None] > 0, total / np.where(weight > 0, weight, 1)[:, None], params)
    size = np.bincount(assignment[assignment >= 0], minlength=k)
    in_cohort = np.bincount(list(chosen.values()), minlength=k)
    v = np.zeros(m)
    for i, j in chosen.items():
        v[i] = size[j] / in_cohort[j] * loss_of[i]
    out = np.zeros(m)
    for j in range(k):
        members = assignment == j
        if members.any():
            part = lam[members] / lam[members].sum()
            out[members] = np_simplex_projection(part + gamma * TAU * v[members])
    return new, assignment, out


@pytest.mark.parametrize("participation", [1.0, 0.6])
def test_robust_ifca_round_equals_per_client_loop(ragged, linear_model, ref, participation):
    gamma = 0.2
    alg = robust_ifca(linear_model, sgd(LR, steps=TAU), num_clusters=2,
                      participation=participation, lambda_lr=gamma)
    state = start = alg.init(jax.random.key(0), ragged)._replace(
        cluster_params=jnp.asarray(_two_models()))
    params, assignment, lam = _two_models().astype(np.float64), np.full(5, -1), np.zeros(5)
    s = round(participation * 5)
    for key, state in _rounds(alg, ragged, start, KEYS):
        params, assignment, lam = robust_reference(ref, params, assignment, lam, ragged,
                                                   _cohort_ids(key, 5, s), gamma)
        np.testing.assert_allclose(state.cluster_params, params, rtol=RTOL, atol=ATOL)
        np.testing.assert_array_equal(state.assignment, assignment)
        np.testing.assert_allclose(state.lam, lam, atol=1e-6)
    for j in range(2):  # each cluster's λ on its simplex; the empty client has none
        if (assignment == j).any():
            np.testing.assert_allclose(np.asarray(state.lam)[assignment == j].sum(), 1, atol=1e-6)
    assert state.lam[2] == 0


def test_robust_ifca_with_lambda_step_0_equals_ifca_option_ii(ragged, linear_model):
    """Equal to float rounding (Σλθ/Σλ against Σθ/count), with minibatches and a cohort."""
    training, kw = sgd(LR, steps=TAU, batch_size=2), dict(num_clusters=2, participation=0.6)
    start = jnp.asarray(_two_models())
    r = with_initial_params(robust_ifca(linear_model, training, lambda_lr=0.0, **kw),
                            lambda key: start)
    i = with_initial_params(ifca(linear_model, training, option="model", **kw),
                            lambda key: start)
    sr, si = r.init(jax.random.key(0), ragged), i.init(jax.random.key(0), ragged)
    rr, ri = jax.jit(r.round), jax.jit(i.round)
    for key in jax.random.split(jax.random.key(11), 6):
        sr, _ = rr(sr, ragged, key)
        si, _ = ri(si, ragged, key)
        np.testing.assert_allclose(sr.cluster_params, si.cluster_params, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(sr.assignment, si.assignment)
    a, lam = np.asarray(sr.assignment), np.asarray(sr.lam)
    for j in range(2):  # uniform within each cluster
        if (a == j).any():
            np.testing.assert_allclose(lam[a == j], 1.0 / np.sum(a == j), rtol=1e-6)


# --------------------------------------------------------------------------- CFL


def test_optimal_bipartition_equals_brute_force():
    rng = np.random.default_rng(0)
    for trial in range(20):
        s = 7
        v = rng.normal(size=(s, 4))
        sim = v @ v.T / np.outer(np.linalg.norm(v, axis=1), np.linalg.norm(v, axis=1))
        member = rng.random(s) < 0.8
        member[trial % s] = True
        member[(trial + 3) % s] = True
        members = list(np.flatnonzero(member))
        got = np.asarray(optimal_bipartition(jnp.asarray(sim, jnp.float32), jnp.asarray(member)))
        score, c2, _ = brute_bipartition(sim, members)
        assert set(np.flatnonzero(got)) == c2, trial
    # one member: nothing to split
    one = np.zeros(s, bool)
    one[2] = True
    assert not np.asarray(optimal_bipartition(jnp.asarray(sim, jnp.float32), one)).any()


def cfl_reference(ref, params, cid, used, data, ids, eps1, eps2):
    """Criteria per cluster on the round's updates, brute-force bipartitions in slot order,
    then θ_c += example-weighted mean Δ within the clusters after the splits."""
    x, y, n = _np(data)
    slots = len(params)
    params, cid = params.copy(), cid.copy()
    act = [i for i in ids if n[i] > 0]
    delta = {i: _sgd(ref, params[cid[i]], x[i], y[i], n[i], TAU) - params[cid[i]] for i in act}
    wants = {}
    for c in range(slots):
        mem = [i for i in act if cid[i] == c]
        if not mem:
            continue
        mean = sum(n[i] * delta[i] for i in mem) / sum(n[i] for i in mem)
        wants[c] = (np.linalg.norm(mean) < eps1 and max(np.linalg.norm(delta[i]) for i in mem)
                    > eps2 and len(mem) >= 2)
    for c in range(slots):
        if wants.get(c) and used < slots:
            mem = [i for i in act if cid[i] == c]
            sim = {(i, j): delta[i] @ delta[j] / np.linalg.norm(delta[i]) / np.linalg.norm(
                delta[j]) for i in mem for j in mem}
            simm = np.zeros((len(n), len(n)))
            for (i, j), a in sim.items():
                simm[i, j] = a
            # c₁ holds the first member in cohort order
            order = [i for i in ids if i in mem]
            _, c2, _ = brute_bipartition(simm, order)
            for i in c2:
                cid[i] = used
            params[used] = params[c]
            used += 1
    for c in range(slots):
        mem = [i for i in act if cid[i] == c]
        if mem:
            params[c] = params[c] + sum(n[i] * delta[i] for i in mem) / sum(n[i] for i in mem)
    return params, cid, used


@pytest.mark.parametrize(("participation", "eps1"), [(1.0, 1e3), (0.8, 1e3), (1.0, 0.0)])
def test_cfl_round_equals_per_client_loop(ragged, linear_model, ref, participation, eps1):
    """ε₁ = 10³, ε₂ = 0: every cluster with two members splits until the 3 slots are used
    (round 1 splits cluster 0; round 2 splits one more, the other finds no free slot).
    ε₁ = 0: never."""
    alg = cfl(linear_model, sgd(LR, steps=TAU), participation=participation, max_clusters=3,
              eps1=eps1, eps2=0.0)
    state = start = alg.init(jax.random.key(0), ragged)
    params = np.asarray(state.cluster_params, np.float64)
    cid, used = np.zeros(5, int), 1
    s = round(participation * 5)
    for key, state in _rounds(alg, ragged, start, KEYS):
        params, cid, used = cfl_reference(ref, params, cid, used, ragged,
                                          list(_cohort_ids(key, 5, s)), eps1, 0.0)
        np.testing.assert_array_equal(state.assignment, cid)
        assert int(state.num_clusters) == used
        np.testing.assert_allclose(state.cluster_params, params, rtol=RTOL, atol=ATOL)
    assert used == (3 if eps1 > 0 else 1)


def _opposite_clusters(rows=20, d=3):
    """8 clients, 4 with θ* = +1 and 4 with θ* = −1 (ragged, small noise)."""
    rng = np.random.default_rng(1)
    truth = [0, 1] * 4
    sizes = [rows, rows - 5, rows, rows - 3, rows - 8, rows, rows - 1, rows]
    xs = [rng.normal(size=(c, d)).astype(np.float32) for c in sizes]
    ys = [(x @ (np.ones(d) if t == 0 else -np.ones(d)) + 0.05 * rng.normal(size=len(x)))
          .astype(np.float32) for x, t in zip(xs, truth, strict=True)]
    return FederatedData.from_clients(xs, ys, cluster=truth), linear_regression(d)


def test_cfl_separates_two_clusters_with_opposite_optima(ref):
    data, model = _opposite_clusters()
    alg = cfl(model, sgd(0.05), max_clusters=4, eps1=0.05, eps2=0.1)
    state = alg.init(jax.random.key(0), data)
    state, metrics = jax.lax.scan(lambda st, k: alg.round(st, data, k), state,
                                  jax.random.split(jax.random.key(1), 80))
    assert int(state.num_clusters) == 2
    assert int(np.sum(metrics["splits"])) == 1
    truth = np.asarray(data.cluster)
    assert ref.perm_accuracy(np.asarray(state.assignment), truth, 2) == 1.0
    out = alg.evaluate(state, data)
    assert float(jnp.max(out["client_loss"])) < 0.05  # each cluster at its own optimum


# --------------------------------------------------------------------------- multi-device


# 1 vs 4 devices: test_sharding.py::test_sharded_equals_unsharded runs AFL, HypCluster
# (k-means++ init), CFL (partial participation, with a split: test_compared_cfl_runs_split_a_
# cluster), Ditto and Robust IFCA with minibatches in its one subprocess of every algorithm.


def test_state_declares_its_client_axes(ragged, linear_model):
    """Per-client leaves are declared (devices shard them by this, never by shape)."""
    for alg, fields in (
        (afl(linear_model, sgd(LR)), ("lam", "lam_avg")),
        (hypcluster(linear_model, sgd(LR), num_clusters=2), ("assignment",)),
        (cfl(linear_model, sgd(LR)), ("assignment",)),
        (ditto(linear_model, sgd(LR)), ("personal",)),
        (robust_ifca(linear_model, sgd(LR), num_clusters=2), ("assignment", "lam")),
    ):
        state = alg.init(jax.random.key(0), ragged)
        axes = alg.client_axes(state)
        for field, value in zip(state._fields, axes, strict=True):
            want = 0 if field in fields else -1
            assert all(a == want for a in jax.tree.leaves(value)), (field, value)
            if field in fields:
                chex.assert_tree_shape_prefix(getattr(state, field), (5,))


@pytest.mark.parametrize("name", ["afl", "hypcluster", "cfl", "ditto", "robust_ifca"])
def test_client_chunks_equal_the_whole_cohort(ragged, linear_model, name):
    """Chunks of 2 clients (3 chunks, one padded; the data's execution plan) give the
    whole-cohort round and evaluation to float rounding."""
    factory = {"afl": afl, "hypcluster": hypcluster, "cfl": cfl, "ditto": ditto,
               "robust_ifca": robust_ifca}[name]
    kw = {"afl": dict(lambda_lr=0.3), "hypcluster": dict(num_clusters=2),
          "cfl": dict(max_clusters=3, eps1=1e3, eps2=0.0), "ditto": {},
          "robust_ifca": dict(num_clusters=2, lambda_lr=0.2)}[name]
    alg = factory(linear_model, sgd(LR, steps=TAU, batch_size=2), **kw)
    round_ = jax.jit(alg.round)
    states = []
    for data in (ragged, planned(ragged, client_chunk=2)):
        state = alg.init(jax.random.key(0), data)
        for key in KEYS[:2]:
            state, _ = round_(state, data, key)
        states.append((state, alg.evaluate(state, data)))
    chex.assert_trees_all_close(states[0], states[1], rtol=1e-5, atol=1e-6)
