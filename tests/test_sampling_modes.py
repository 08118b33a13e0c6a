"""Every algorithm that trains clients, in every sampling mode, against a per-client loop.

One round from a fixed state (chosen here, e.g. non-zero SCAFFOLD controls, a non-uniform
λ) on the ragged federation of conftest.py (clients of 4, 1, 0, 3 and 2 rows: a one-row
client and an empty one), local training `sgd(0.1, steps=3, batch_size=2, sampling=mode)`
for mode in `SAMPLINGS` ("with_replacement", "epochs"), at participation 1 and 0.6 (a
cohort of 3 holding the one-row and the empty client). The reference is a plain Python
loop over the cohort's clients written from each paper in float64 numpy for the linear
model y = x·θ (squared error): losses, gradients, local steps, averaging and each
algorithm's own rule. From the library it takes only what is random: the cohort
(`ops.sample_cohort`, which the algorithms document as their draw) and each client's
minibatch rows (`ops.sample_batches` / `ops.epoch_batches` with `ops.client_update`'s key
derivation: the step keys are split(client key, τ), each split in two, the first half
drawing the batch; epochs are keyed fold_in(client key, EPOCH_STREAM)).

Covered by a loop: fedavg, fedprox, scaffold (option II, from non-zero controls), qffl,
afl (from a non-uniform λ), ditto (global and personal models, the personal steps on
fold_in(client key, 1)), hypcluster, ifca option II, cfl (two clusters in use, ε₁ = 0: no
split), local_models (every client; it has no participation setting), drfa (its C_s
update: λ-sampled slots with replacement, their mean model), one_shot_clustering's rounds
(per-cluster FedAvg on fixed assignments, from a fixed state after its init),
mixed_parallel, mixed_gt1 and mixed_gt2 (a datacenter, full-batch central steps).
Covered by a reduction: robust_ifca at λ step 0 equals ifca option II, and drflm with
mixup Beta(1, 1e-6) (γ = 1, every mixup the identity) equals drfa's loop, in every mode.
Not covered here: IFCA option I (one full-batch gradient: no sampling), the FedOpt
recipes (`with_server_optimizer` over fedavg: the clients are fedavg's), and
mixed_centralized (the oracle draws one fresh batch per cohort member and step,
whatever the mode).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.algorithms import (
    SAMPLINGS,
    afl,
    cfl,
    ditto,
    drfa,
    drflm,
    fedavg,
    fedprox,
    hypcluster,
    ifca,
    local_models,
    mixed_gt1,
    mixed_gt2,
    mixed_parallel,
    one_shot_clustering,
    qffl,
    robust_ifca,
    scaffold,
    sgd,
    with_initial_params,
)
from fedjax_sim.algorithms.base import cohort_size
from fedjax_sim.data import ServerData
from fedjax_sim.ops import client_keys, epoch_batches, sample_batches, sample_cohort
from fedjax_sim.ops.local_update import EPOCH_STREAM

LR, STEPS, BATCH = 0.1, 3, 2
M = 5  # the ragged federation's clients (rows 4, 1, 0, 3, 2)
RTOL, ATOL = 2e-5, 2e-6
PARTICIPATIONS = (1.0, 0.6)
MODES = [pytest.param(s, p, id=f"{s}-p{p}") for s in SAMPLINGS for p in PARTICIPATIONS]


def _round_key():
    """A round key whose cohort of 3 holds the one-row client 1, the empty client 2 and a
    client of more rows than a batch (0 or 3: where the two modes draw differently)."""
    for seed in range(100):
        key = jax.random.key(seed)
        ids = set(np.asarray(sample_cohort(key, M, 3).ids).tolist())
        if {1, 2} <= ids and ids & {0, 3}:
            return key
    raise AssertionError("no such key")


ROUND_KEY = _round_key()


def training(sampling):
    return sgd(LR, steps=STEPS, batch_size=BATCH, sampling=sampling)


# --------------------------------------------------------------------------- the reference


@functools.partial(jax.jit, static_argnames=("n_max", "sampling"))
def _draw(key, n, n_max, sampling):
    """The rows client_update's steps read, as it documents its keys: (idx, mask) [τ, b]."""
    if sampling == "epochs":
        return epoch_batches(jax.random.fold_in(key, EPOCH_STREAM), n, n_max, BATCH, STEPS)
    halves = jax.vmap(jax.random.split)(jax.random.split(key, STEPS))
    return sample_batches(halves[:, 0], n, n_max, BATCH)


class Clients:
    """The federation as float64 numpy, with the loop's maths."""

    def __init__(self, data):
        self.x = np.asarray(data.x, np.float64)
        self.y = np.asarray(data.y, np.float64)
        self.n = np.asarray(data.num_examples)
        self.n_max = self.x.shape[1]

    def rows(self, key, i, sampling):
        """Client i's minibatch rows, step by step (a list of τ index arrays)."""
        idx, mask = (np.asarray(a) for a in _draw(key, int(self.n[i]), self.n_max, sampling))
        return [idx[t][mask[t]] for t in range(STEPS)]

    def loss_grad(self, theta, i, rows=None):
        """The mean of (xθ − y)² over `rows` of client i (all its rows: None) and its
        gradient (2/|B|) X_Bᵀ(X_B θ − y_B); 0 and 0 for no rows."""
        rows = np.arange(self.n[i]) if rows is None else rows
        if len(rows) == 0:
            return 0.0, np.zeros_like(theta)
        x, y = self.x[i, rows], self.y[i, rows]
        r = x @ theta - y
        return float(np.mean(r * r)), 2.0 / len(rows) * x.T @ r

    def local(self, theta, i, key, sampling, *, direction=None, lr=LR):
        """τ SGD steps of client i from θ on its minibatches; the step goes along
        direction(g, θ) (default the minibatch gradient g). Returns (θ, first loss, first g)."""
        theta = np.array(theta, np.float64)
        first = None
        for rows in self.rows(key, i, sampling):
            loss, g = self.loss_grad(theta, i, rows)
            if first is None:
                first = (loss, g)
            theta = theta - lr * (g if direction is None else direction(g, theta))
        return theta, *first


def cohort(participation, key=ROUND_KEY, weights=None):
    """The round's (slot client ids, slot keys), drawn by the documented cohort op."""
    c = sample_cohort(key, M, cohort_size(M, participation), weights=weights)
    return np.asarray(c.ids).tolist(), list(c.keys)


def mean(values, weights, fallback):
    total = float(np.sum(weights))
    if total == 0:
        return np.array(fallback, np.float64)
    return sum(w * v for w, v in zip(weights, values, strict=True)) / total


def project(v):
    """Euclidean projection onto the simplex (the sort method), float64."""
    u = np.sort(v)[::-1]
    css = np.cumsum(u) - 1.0
    j = np.arange(1, len(v) + 1)
    rho = j[u - css / j > 0][-1]
    return np.maximum(v - css[rho - 1] / rho, 0.0)


def close(got, want, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(got), want, rtol=rtol, atol=atol)


def one_round(alg, state, inputs, key=ROUND_KEY):
    new, _ = jax.jit(alg.round)(state, inputs, key)
    return new


@pytest.fixture(scope="module")
def clients(ragged):
    return Clients(ragged)


RNG = np.random.default_rng(0)
THETA0 = RNG.normal(size=3)  # the fixed start of every shared model
PER_CLIENT = RNG.normal(size=(M, 3))  # fixed per-client models / control variates
CLUSTERS = np.stack([np.array([1.0, -1.0, 0.5]), np.array([-0.5, 0.8, -1.2])])


def _f32(a):
    return jnp.asarray(a, jnp.float32)


# --------------------------------------------------------------------------- FedAvg family


def fedavg_reference(clients, theta, participation, sampling, *, direction=None,
                     weighting="uniform"):
    ids, keys = cohort(participation)
    trained, weights = [], []
    for i, key in zip(ids, keys, strict=True):
        if clients.n[i] == 0:
            continue
        trained.append(clients.local(theta, i, key, sampling, direction=direction)[0])
        weights.append(clients.n[i] if weighting == "examples" else 1.0)
    return mean(trained, weights, theta)


@pytest.mark.parametrize(("sampling", "participation"), MODES)
def test_fedavg(ragged, linear_model, clients, sampling, participation):
    """McMahan et al.: w ← the mean over the cohort's clients holding data of τ local steps."""
    alg = fedavg(linear_model, training(sampling), participation=participation)
    state = alg.init(jax.random.key(0), ragged)._replace(params=_f32(THETA0))
    new = one_round(alg, state, ragged)
    close(new.params, fedavg_reference(clients, THETA0, participation, sampling))


@pytest.mark.parametrize(("sampling", "participation"), MODES)
def test_fedprox(ragged, linear_model, clients, sampling, participation):
    """Li et al.: the local steps descend F_B(w) + μ/2‖w − w_t‖² (gradient g + μ(w − w_t))."""
    mu = 0.5
    alg = fedprox(linear_model, training(sampling), mu=mu, participation=participation)
    state = alg.init(jax.random.key(0), ragged)._replace(params=_f32(THETA0))
    new = one_round(alg, state, ragged)
    want = fedavg_reference(clients, THETA0, participation, sampling,
                            direction=lambda g, th: g + mu * (th - THETA0))
    close(new.params, want)


@pytest.mark.parametrize(("sampling", "participation"), MODES)
def test_scaffold(ragged, linear_model, clients, sampling, participation):
    """Karimireddy et al., option II: y ← y − η(g(y) − c_i + c); c_i⁺ = c_i − c + (x − y)/(Kη);
    x ← x + η_g mean Δy; c ← c + Σ_S Δc_i / N (N: the clients holding data)."""
    server_lr = 0.8
    alg = scaffold(linear_model, training(sampling), participation=participation,
                   server_lr=server_lr)
    c, ci = 0.1 * THETA0[::-1], 0.2 * PER_CLIENT
    ci[2] = 0.0  # the empty client never trained
    state = alg.init(jax.random.key(0), ragged)._replace(
        params=_f32(THETA0), control=_f32(c), client_controls=_f32(ci))
    new = one_round(alg, state, ragged)
    ids, keys = cohort(participation)
    new_ci, dys, dcs = ci.copy(), [], []
    for i, key in zip(ids, keys, strict=True):
        if clients.n[i] == 0:
            continue
        y = clients.local(THETA0, i, key, sampling,
                          direction=lambda g, th, i=i: g - ci[i] + c)[0]
        new_ci[i] = ci[i] - c + (THETA0 - y) / (STEPS * LR)
        dys.append(y - THETA0)
        dcs.append(new_ci[i] - ci[i])
    close(new.params, THETA0 + server_lr * np.mean(dys, axis=0))
    close(new.control, c + np.sum(dcs, axis=0) / np.sum(clients.n > 0))
    close(new.client_controls, new_ci)


@pytest.mark.parametrize(("sampling", "participation"), MODES)
def test_qffl(ragged, linear_model, clients, sampling, participation):
    """Li et al. (q-FedAvg): F_k on all its rows at w (+1e-10), ΔW_k = L(w − w̄_k), L = 1/η,
    Δ_k = F_k^q ΔW_k, h_k = q F_k^{q−1}‖ΔW_k‖² + L F_k^q, w ← w − ΣΔ_k / Σh_k."""
    q = 2.0
    alg = qffl(linear_model, training(sampling), q=q, participation=participation)
    state = alg.init(jax.random.key(0), ragged)._replace(params=_f32(THETA0))
    new = one_round(alg, state, ragged)
    ids, keys = cohort(participation)
    big_l, deltas, hs = 1.0 / LR, [], []
    for i, key in zip(ids, keys, strict=True):
        if clients.n[i] == 0:
            continue
        loss = clients.loss_grad(THETA0, i)[0] + 1e-10
        dw = big_l * (THETA0 - clients.local(THETA0, i, key, sampling)[0])
        deltas.append(loss**q * dw)
        hs.append(q * loss ** (q - 1) * dw @ dw + big_l * loss**q)
    close(new.params, THETA0 - np.sum(deltas, axis=0) / np.sum(hs), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("sampling", "participation"), MODES)
def test_afl(ragged, linear_model, clients, sampling, participation):
    """Mohri et al.: w ← Σ_S λ_i w_i / Σ_S λ_i; v_i = (m/s) F_i(w) (the first minibatch's
    loss); λ ← Π_Δ(λ + γ v) over the clients holding data."""
    gamma = 0.3
    lam = np.array([0.4, 0.1, 0.0, 0.3, 0.2])
    alg = afl(linear_model, training(sampling), participation=participation, lambda_lr=gamma)
    state = alg.init(jax.random.key(0), ragged)._replace(params=_f32(THETA0), lam=_f32(lam))
    new = one_round(alg, state, ragged)
    ids, keys = cohort(participation)
    trained, weights, v = [], [], np.zeros(M)
    for i, key in zip(ids, keys, strict=True):
        if clients.n[i] == 0:
            continue
        theta, first_loss, _ = clients.local(THETA0, i, key, sampling)
        trained.append(theta)
        weights.append(lam[i])
        v[i] = M / len(ids) * first_loss
    active = clients.n > 0
    want_lam = np.zeros(M)
    want_lam[active] = project((lam + gamma * v)[active])
    close(new.params, mean(trained, weights, THETA0))
    close(new.lam, want_lam, atol=1e-6)


@pytest.mark.parametrize(("sampling", "participation"), MODES)
def test_ditto(ragged, linear_model, clients, sampling, participation):
    """Li et al.: the global model is FedAvg's; each cohort client k holding data takes s
    steps v ← v − η(∇F_B(v) + λ(v − w^t)) from its own v_k on its own minibatches (key
    fold_in(client key, 1)); the others keep v_k."""
    lam = 0.5
    alg = ditto(linear_model, training(sampling), ditto_lambda=lam, participation=participation)
    state = alg.init(jax.random.key(0), ragged)._replace(params=_f32(THETA0),
                                                          personal=_f32(PER_CLIENT))
    new = one_round(alg, state, ragged)
    close(new.params, fedavg_reference(clients, THETA0, participation, sampling))
    personal = PER_CLIENT.copy()
    ids, keys = cohort(participation)
    for i, key in zip(ids, keys, strict=True):
        if clients.n[i] == 0:
            continue
        personal[i] = clients.local(PER_CLIENT[i], i, jax.random.fold_in(key, 1), sampling,
                                    direction=lambda g, v: g + lam * (v - THETA0))[0]
    close(new.personal, personal)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_local_models(ragged, linear_model, clients, sampling):
    """Every client τ steps from its own model, key fold_in(round key, i); no participation."""
    alg = local_models(linear_model, training(sampling))
    state = alg.init(jax.random.key(0), ragged)._replace(params=_f32(PER_CLIENT))
    new = one_round(alg, state, ragged)
    keys = client_keys(ROUND_KEY, jnp.arange(M))
    want = np.stack([clients.local(PER_CLIENT[i], i, keys[i], sampling)[0] for i in range(M)])
    close(new.params, want)


# --------------------------------------------------------------------------- clustered


def clustered_reference(clients, centers, starts, ids, keys, sampling, weighting):
    """Each cohort client holding data trains from its cluster's model (starts[i]: its
    cluster); cluster j ← the (weighted) mean of its members' models (kept if none)."""
    members = {j: ([], []) for j in range(len(centers))}
    for i, key in zip(ids, keys, strict=True):
        if clients.n[i] == 0:
            continue
        j = starts[i]
        members[j][0].append(clients.local(centers[j], i, key, sampling)[0])
        members[j][1].append(clients.n[i] if weighting == "examples" else 1.0)
    return np.stack([mean(*members[j], centers[j]) for j in range(len(centers))])


def argmin_clusters(clients, centers):
    return [int(np.argmin([clients.loss_grad(c, i)[0] for c in centers])) if clients.n[i] else -1
            for i in range(M)]


@pytest.mark.parametrize(("sampling", "participation"), MODES)
@pytest.mark.parametrize(("name", "weighting"), [("ifca", "uniform"),
                                                 ("hypcluster", "examples")])
def test_ifca_option_ii_and_hypcluster(ragged, linear_model, clients, name, weighting, sampling,
                                       participation):
    """Ghosh et al. option II / Mansour et al.: ĵ_i = argmin_j F_i(θ_j) on all its rows,
    τ steps from θ_ĵ, θ_j ← the mean of its members' models (IFCA: uniform; HypCluster:
    by examples); an empty cluster keeps θ_j; a client's assignment is its last choice."""
    factory = {"ifca": lambda t, **kw: ifca(linear_model, t, option="model", **kw),
               "hypcluster": lambda t, **kw: hypcluster(linear_model, t, **kw)}[name]
    alg = factory(training(sampling), num_clusters=2, participation=participation)
    before = np.array([1, -1, -1, 0, 1])
    state = alg.init(jax.random.key(0), ragged)._replace(cluster_params=_f32(CLUSTERS),
                                                         assignment=jnp.asarray(before))
    new = one_round(alg, state, ragged)
    ids, keys = cohort(participation)
    chosen = argmin_clusters(clients, CLUSTERS)
    close(new.cluster_params,
          clustered_reference(clients, CLUSTERS, chosen, ids, keys, sampling, weighting))
    after = before.copy()
    for i in ids:
        if clients.n[i]:
            after[i] = chosen[i]
    np.testing.assert_array_equal(new.assignment, after)
    assert len(set(chosen) - {-1}) == 2  # both clusters are picked


@pytest.mark.parametrize(("sampling", "participation"), MODES)
def test_robust_ifca_at_lambda_step_0_is_ifca_option_ii(ragged, linear_model, sampling,
                                                        participation):
    """γ = 0: uniform weights within every cluster, IFCA option II to float rounding."""
    kw = dict(num_clusters=2, participation=participation)
    start = _f32(CLUSTERS)
    robust = with_initial_params(robust_ifca(linear_model, training(sampling), lambda_lr=0.0,
                                             **kw), lambda key: start)
    plain = with_initial_params(ifca(linear_model, training(sampling), option="model", **kw),
                                lambda key: start)
    a = one_round(robust, robust.init(jax.random.key(0), ragged), ragged)
    b = one_round(plain, plain.init(jax.random.key(0), ragged), ragged)
    close(a.cluster_params, np.asarray(b.cluster_params), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(a.assignment, b.assignment)
    assert not np.allclose(np.asarray(a.cluster_params), CLUSTERS)


@pytest.mark.parametrize(("sampling", "participation"), MODES)
def test_cfl(ragged, linear_model, clients, sampling, participation):
    """Sattler et al. (ε₁ = 0: no split): Δθ_i = τ steps from θ_c(i) minus θ_c(i);
    θ_c ← θ_c + Σ_{i∈c} n_i Δθ_i / Σ_{i∈c} n_i over the cohort's members holding data."""
    alg = cfl(linear_model, training(sampling), participation=participation, max_clusters=3,
              eps1=0.0, eps2=0.0)
    cluster_id = np.array([0, 1, 0, 1, 0])
    centers = np.concatenate([CLUSTERS, THETA0[None]])  # slot 2 unused
    state = alg.init(jax.random.key(0), ragged)._replace(
        cluster_params=_f32(centers), assignment=jnp.asarray(cluster_id),
        num_clusters=jnp.asarray(2, jnp.int32))
    new = one_round(alg, state, ragged)
    ids, keys = cohort(participation)
    close(new.cluster_params,
          clustered_reference(clients, centers, cluster_id, ids, keys, sampling, "examples"))
    np.testing.assert_array_equal(new.assignment, cluster_id)
    assert int(new.num_clusters) == 2


@pytest.mark.parametrize(("sampling", "participation"), MODES)
def test_one_shot_clustering_rounds(ragged, linear_model, clients, sampling, participation):
    """Its rounds: per-cluster FedAvg on the assignment its init fixed (here replaced by a
    fixed one), weighted by examples; the init's local pre-training in the same mode."""
    alg = one_shot_clustering(linear_model, training(sampling), num_clusters=2,
                              pretraining=sgd(LR, steps=2, batch_size=BATCH, sampling=sampling),
                              participation=participation)
    fixed = np.array([0, 1, -1, 1, 0])
    state = alg.init(jax.random.key(0), ragged)._replace(cluster_params=_f32(CLUSTERS),
                                                         assignment=jnp.asarray(fixed))
    new = one_round(alg, state, ragged)
    ids, keys = cohort(participation)
    close(new.cluster_params,
          clustered_reference(clients, CLUSTERS, fixed, ids, keys, sampling, "examples"))
    np.testing.assert_array_equal(new.assignment, fixed)


# --------------------------------------------------------------------------- DRFA


@pytest.mark.parametrize(("sampling", "participation"), MODES)
@pytest.mark.parametrize("name", ["drfa", "drflm_identity_mixup"])
def test_drfa_model_update(ragged, linear_model, clients, name, sampling, participation):
    """Deng et al.'s C_s step: m = ⌈participation·N⌉ slots drawn ∝ λ with replacement from
    the round key's first third, each slot holding data τ steps from w, w ← their mean.
    DRFLM with Beta(1, 1e-6) mixes with γ = 1 (the identity): the same round."""
    lam = np.array([0.3, 0.25, 0.1, 0.2, 0.15])
    if name == "drfa":
        alg = drfa(linear_model, training(sampling), participation=participation)
    else:
        alg = drflm(linear_model, training(sampling), participation=participation,
                    mixup=(1.0, 1e-6))
    state = alg.init(jax.random.key(0), ragged)._replace(params=_f32(THETA0), lam=_f32(lam))
    new = one_round(alg, state, ragged)
    key_c = jax.random.split(ROUND_KEY, 3)[0]
    ids, keys = cohort(participation, key=key_c, weights=jnp.asarray(lam, jnp.float32))
    trained = [clients.local(THETA0, i, key, sampling)[0]
               for i, key in zip(ids, keys, strict=True) if clients.n[i]]
    close(new.params, mean(trained, np.ones(len(trained)), THETA0))
    if name == "drfa" and participation == 1.0:
        assert len(set(ids)) < len(ids)  # a client drawn twice trains twice


# --------------------------------------------------------------------------- Mixed FL


def _server(seed=1, rows=6):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 3))
    y = x @ np.array([0.5, 1.0, -1.0]) + 0.1 * rng.normal(size=rows)
    return x, y


XC, YC = _server()


def central_grad(theta):
    r = XC @ theta - YC
    return 2.0 / len(YC) * XC.T @ r


@pytest.mark.parametrize(("sampling", "participation"), MODES)
@pytest.mark.parametrize("variant", ["parallel", "gt1", "gt2"])
def test_mixed(ragged, linear_model, clients, variant, sampling, participation):
    """Augenstein et al., K = τ, a datacenter read whole by the central steps (the default
    central training: the clients' SGD and K, every row; server SGD at 1):
    PT: Δ = w_f mean_i Δ_i + w_c Δ_c (K central steps on f_c from x);
    1-GT: the clients step along w_f g_i + w_c ĝ_c (ĝ_c = ∇f_c(x)), Δ = mean_i Δ_i;
    2-GT: as 1-GT, and the server steps along w_c g_c + w_f ĝ_f (ĝ_f = the clients' mean
    first minibatch gradient at x), Δ = ½ mean_i Δ_i + ½ Δ_c."""
    w_f, w_c = 0.6, 0.4
    factory = {"parallel": mixed_parallel, "gt1": mixed_gt1, "gt2": mixed_gt2}[variant]
    alg = factory(linear_model, training(sampling), w_f=w_f, w_c=w_c,
                  participation=participation)
    inputs = (ragged, ServerData({"x": _f32(XC), "y": _f32(YC)}))
    state = alg.init(jax.random.key(0), inputs)._replace(params=_f32(THETA0))
    new = one_round(alg, state, inputs)
    hat_g_c = central_grad(THETA0)
    direction = None if variant == "parallel" else lambda g, th: w_f * g + w_c * hat_g_c
    ids, keys = cohort(participation)
    deltas, grads = [], []
    for i, key in zip(ids, keys, strict=True):
        if clients.n[i] == 0:
            continue
        theta, _, g0 = clients.local(THETA0, i, key, sampling, direction=direction)
        deltas.append(theta - THETA0)
        grads.append(g0)
    delta_f, hat_g_f = np.mean(deltas, axis=0), np.mean(grads, axis=0)
    y = THETA0.copy()
    for _ in range(STEPS):
        y = y - LR * (central_grad(y) if variant == "parallel"
                      else w_c * central_grad(y) + w_f * hat_g_f)
    want = {"parallel": THETA0 + w_f * delta_f + w_c * (y - THETA0),
            "gt1": THETA0 + delta_f,
            "gt2": THETA0 + 0.5 * delta_f + 0.5 * (y - THETA0)}[variant]
    close(new.params, want)
