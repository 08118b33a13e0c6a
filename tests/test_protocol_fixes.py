"""Protocol fixes against plain float64 loops written from the papers (and FedTorch's code):
FedAvg's client weights, DRFA's official-code snapshot, local epochs, IFCA's cluster identity
under partial participation and its downlink count."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_sim.algorithms import drfa, fedavg, ifca, sgd, with_seeds
from fedjax_sim.data import FederatedData
from fedjax_sim.experiments import drfa_molecules, ifca_images, study
from fedjax_sim.experiments.registry import get_preset
from fedjax_sim.experiments.runner import resolve_settings
from fedjax_sim.models import linear_regression
from fedjax_sim.ops import epoch_batches, local_update, sample_cohort
from fedjax_sim.ops.local_update import EPOCH_STREAM

D = 3
SIZES = (5, 1, 4, 0, 3, 7)  # ragged: a one-row client and an empty one
LR = 0.05


def _clients(seed=0, sizes=SIZES, thetas=None):
    rng = np.random.default_rng(seed)
    theta = rng.normal(size=D)
    xs, ys = [], []
    for i, n_i in enumerate(sizes):
        t = theta if thetas is None else thetas[i]
        x = rng.normal(size=(n_i, D))
        xs.append(x.astype(np.float32))
        ys.append((x @ t + 0.3 * rng.normal(size=n_i)).astype(np.float32))
    return FederatedData.from_clients(xs, ys), xs, ys


def _loss(theta, x, y):
    """F_i(θ) = (1/n_i) Σ_r (x_rᵀθ − y_r)², the model's squared error (no ½)."""
    r = np.asarray(x, np.float64) @ theta - np.asarray(y, np.float64)
    return float(np.mean(r * r))


def _grad(theta, x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return 2.0 * x.T @ (x @ theta - y) / len(y)


def _gd(theta, x, y, steps, lr):
    for _ in range(steps):
        theta = theta - lr * _grad(theta, x, y)
    return theta


# --------------------------------------------------------------------------- 1. FedAvg weights


@pytest.mark.parametrize("participation", [1.0, 4 / 6])
@pytest.mark.parametrize("weighting", ["examples", "uniform"])
def test_fedavg_round_equals_the_weighted_mean_of_a_per_client_loop(weighting, participation):
    """McMahan et al.: w ← Σ_{k∈S} n_k w_k / Σ_{k∈S} n_k (examples; DRFLM's objective weights
    clients so) or the plain mean over the cohort's clients holding data (uniform). τ = 3
    full-batch GD steps from w on each client; a client without rows has no weight."""
    data, xs, ys = _clients()
    tau = 3
    alg = fedavg(linear_regression(D), sgd(LR, steps=tau), participation=participation,
                 weighting=weighting)
    state = alg.init(jax.random.key(0), data)
    theta = np.asarray(state.params, np.float64)
    m = len(SIZES)
    s = max(1, int(round(participation * m)))
    round_ = jax.jit(alg.round)
    for r in range(3):
        key = jax.random.key(10 + r)
        state, _ = round_(state, data, key)
        ids = np.asarray(sample_cohort(key, m, s).ids)  # the round's cohort (its draw only)
        total, weight = np.zeros(D), 0.0
        for i in ids:
            n_i = SIZES[i]
            if n_i == 0:
                continue
            w_i = n_i if weighting == "examples" else 1.0
            total += w_i * _gd(theta, xs[i], ys[i], tau, LR)
            weight += w_i
        if weight > 0:
            theta = total / weight
        np.testing.assert_allclose(state.params, theta, rtol=2e-5, atol=1e-6)


def _molecule_settings(**overrides):
    return resolve_settings(get_preset("drfa-synthetic-noise"),
                            {"num_clients": 6, "n": 10, "batch_size": 4, "local_steps": 2,
                             **overrides}, "compare")  # settings for every method


def test_drfa_presets_weight_fedavg_by_rows_and_fedavg_mixup_honours_official_code():
    """The DRFLM/DRFA presets' FedAvg is sample-weighted by default; FedAvg+mixup keeps λ at
    FedAvg's weights (∝ rows, or uniform) and takes the FedTorch form with official_code."""
    for name in ("drflm-esol", "drflm-freesolv", "drflm-lipophilicity", "drfa-synthetic-noise"):
        assert get_preset(name).defaults["weighting"] == "examples", name
    data, _, _ = _clients(sizes=(6, 2, 0, 9, 3, 4))
    rows = np.asarray(data.num_examples, np.float64)
    model = linear_regression(D)
    for weighting, official in itertools.product(("examples", "uniform"), (False, True)):
        s = _molecule_settings(weighting=weighting, official_code=official, d=D)
        alg = study.build_method(drfa_molecules.EXPERIMENT, "fedavg_mixup", s, model)
        state = alg.init(jax.random.key(0), data)
        want = rows / rows.sum() if weighting == "examples" else np.full(6, 1 / 6)
        np.testing.assert_allclose(state.lam, want, rtol=1e-6)
        state, _ = jax.jit(alg.round)(state, data, jax.random.key(1))
        if official:  # FedTorch: C_s uniform without replacement, γ decays (0 stays 0)
            assert np.asarray(state.sampled).max() == 1
        floor = 1e-3 if official else 0.0  # FedTorch's clip floor raises the empty client
        lam = np.maximum(want, floor)
        np.testing.assert_allclose(state.lam, lam / lam.sum(), rtol=1e-5, atol=1e-7)
        weighted = study.build_method(drfa_molecules.EXPERIMENT, "fedavg", s, model)
        st = weighted.init(jax.random.key(0), data)
        st, _ = jax.jit(weighted.round)(st, data, jax.random.key(1))
        assert np.all(np.isfinite(np.asarray(st.params)))


def test_fedavg_reports_its_client_weights_as_lambda():
    """FedAvg keeps no λ; the DRFA experiment reports its fixed weights in λ's columns."""
    data, _, _ = _clients(sizes=(6, 2, 0, 9))
    rows = np.asarray(data.num_examples, np.float64)
    model = linear_regression(D)
    problem = drfa_molecules.Problem(data, data, [1.0, 1.0], np.zeros(4, bool), "y", {}, model,
                                     True)
    alg = with_seeds(fedavg(model, sgd(LR)), 2, shared_data=True)
    state = alg.init(jax.random.key(0), data)
    for weighting, want in (("examples", rows / rows.sum()), ("uniform", np.full(4, 0.25))):
        out = drfa_molecules.metrics_fn(alg, problem, weighting)(state)
        np.testing.assert_allclose(out["lambda_hat_max"], [want.max()] * 2)
        np.testing.assert_allclose(out["lambda_2"], [want[2]] * 2)


# ------------------------------------------------------------- 2. DRFA, FedTorch's snapshot

TAU = 4
GAMMA0 = 2.0
FLOOR = 1e-3


def _np_projection(v):
    """Euclidean projection onto the simplex by sorting (FedTorch: projection_simplex_sort)."""
    u = np.sort(v)[::-1]
    cssv = np.cumsum(u) - 1.0
    ind = np.arange(1, len(v) + 1)
    rho = ind[u - cssv / ind > 0][-1]
    return np.maximum(v - cssv[rho - 1] / rho, 0.0)


def fedtorch_round(w, lam, gamma, xs, ys, key, *, m):
    """One round of FedTorch's centered DRFA (train_and_validate_drfa_centered), float64.

    In its order: γ ← 0.9 γ; each online client (uniform, without replacement) loads w,
    draws k uniform on {1, ..., τ−1} and, in its loop over local steps, copies its model
    when the step counter reaches k (before that step's update: after k − 1 updates);
    w ← w − Σ_j (λ_j N/m)(w − w_j); w̃ = the mean of the copies; the λ-clients (uniform,
    without replacement) return (N/m)·loss of w̃; λ ← Π(λ + γ τ v); entries ≤ 1e-3 are set
    to 1e-3 and λ renormalised. The random draws are the round key's, as drfa documents
    them (cohort key, step-index key, λ-cohort key); full-batch steps and probes. A client
    without rows (none in FedTorch) trains nothing and is left out of w̃'s mean.
    """
    n = len(xs)
    gamma = 0.9 * gamma
    key_c, key_t, key_u = jax.random.split(key, 3)
    online = np.asarray(sample_cohort(key_c, n, m).ids)
    ks = np.asarray(jax.random.randint(key_t, (m,), 1, TAU))
    update, snaps = np.zeros_like(w), []
    for j, i in enumerate(online):
        if len(ys[i]) == 0:
            continue
        model, kth = w.copy(), None
        for step in range(1, TAU + 1):
            if step == ks[j]:
                kth = model.copy()
            model = model - LR * _grad(model, xs[i], ys[i])
        update += lam[i] * n / m * (w - model)
        snaps.append(kth)
    w_new = w - update
    w_tilde = np.mean(snaps, axis=0)
    probe_ids = np.asarray(sample_cohort(key_u, n, m).ids)
    v = np.zeros(n)
    probe = []
    for i in probe_ids:
        loss = _loss(w_tilde, xs[i], ys[i]) if len(ys[i]) else 0.0
        v[i] = loss * n / m
        probe.append(loss)
    lam = _np_projection(lam + gamma * TAU * v)
    lam[lam <= FLOOR] = FLOOR
    lam = lam / lam.sum()
    return w_new, lam, gamma, w_tilde, max(probe)


def test_drfa_official_code_round_equals_fedtorchs_order_of_operations():
    """Params (the λ-weighted aggregation), λ (γ decay, projection, floor) and the snapshot
    w̃ (through the probe losses: λ's move and the worst probe loss) over two rounds."""
    thetas = np.random.default_rng(5).normal(size=(6, D)) * 2.0  # clients disagree: λ moves
    data, xs, ys = _clients(seed=1, thetas=thetas)
    m = 3
    alg = drfa(linear_regression(D), sgd(LR, steps=TAU), participation=m / 6,
               lambda_lr=GAMMA0, official_code=True)
    state = alg.init(jax.random.key(0), data)
    rows = np.asarray(SIZES, np.float64)
    lam = rows / rows.sum()  # FedTorch: λ₀ ∝ sample counts
    np.testing.assert_allclose(state.lam, lam, rtol=1e-6)
    w, gamma = np.asarray(state.params, np.float64), GAMMA0
    round_ = jax.jit(alg.round)
    for r in range(2):
        key = jax.random.key(20 + r)
        state, metrics = round_(state, data, key)
        w, lam, gamma, w_tilde, probe_worst = fedtorch_round(w, lam, gamma, xs, ys, key, m=m)
        np.testing.assert_allclose(state.params, w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state.lambda_lr, gamma, rtol=1e-6)
        np.testing.assert_allclose(state.lam, lam, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(metrics["probe_loss_worst"], probe_worst, rtol=1e-5)
        assert not np.allclose(w_tilde, w)  # the snapshot is not the round's result
    assert np.asarray(state.lam).min() < 2e-3  # the floor was exercised (the empty client)


# --------------------------------------------------------------------------- 3. local epochs


@pytest.mark.parametrize("batch", [4, 3])
def test_each_epoch_visits_every_real_row_exactly_once(batch):
    n_max, steps = 12, 9
    counts = (0, 1, 5, 7, 12, 4)
    keys = jax.random.split(jax.random.key(3), len(counts))
    draw = jax.jit(jax.vmap(lambda k, n: epoch_batches(k, n, n_max, batch, steps)))
    idx, mask = (np.asarray(a) for a in draw(keys, jnp.asarray(counts)))
    for c, n in enumerate(counts):
        per_epoch = max(-(-n // batch), 1)
        assert not mask[c].any() if n == 0 else mask[c].any()
        perms = []
        for e in range(-(-steps // per_epoch)):
            rows = np.concatenate([idx[c, t][mask[c, t]]
                                   for t in range(e * per_epoch, min((e + 1) * per_epoch, steps))])
            assert np.all(rows < n), "padding drawn"
            assert len(set(rows.tolist())) == len(rows), "a row twice in one epoch"
            if (e + 1) * per_epoch <= steps:  # a complete epoch: every row once
                np.testing.assert_array_equal(np.sort(rows), np.arange(n))
                perms.append(rows)
            for t in range(e * per_epoch, min((e + 1) * per_epoch, steps)):
                # full batches, the remainder last; masked slots trail
                want = min(batch, n - (t - e * per_epoch) * batch) if n else 0
                np.testing.assert_array_equal(mask[c, t], np.arange(batch) < want)
        if n >= 5:  # a fresh permutation every epoch
            assert any(not np.array_equal(perms[0], p) for p in perms[1:])


def test_local_update_in_epochs_equals_a_per_client_loop_over_the_permutations():
    """E epochs of minibatch SGD: per epoch a permutation of the client's rows, cut into
    batches of b (the last one the remainder); one SGD step on each batch's mean loss."""
    data, xs, ys = _clients(seed=2)
    b, steps = 2, 7
    keys = jax.random.split(jax.random.key(4), len(SIZES))
    start = jnp.zeros((len(SIZES), D), jnp.float32) + jnp.arange(D, dtype=jnp.float32) * 0.1
    params, _, losses = local_update(linear_regression(D), optax.sgd(LR), start, data, keys,
                                     num_steps=steps, batch_size=b, sampling="epochs")
    n_max = data.max_examples
    for i, n_i in enumerate(SIZES):
        idx, mask = epoch_batches(jax.random.fold_in(keys[i], EPOCH_STREAM), n_i, n_max, b,
                                  steps)
        idx, mask = np.asarray(idx), np.asarray(mask)
        per_epoch = max(-(-n_i // b), 1)
        theta = np.asarray(start[i], np.float64)
        step = 0
        while step < steps:  # one epoch: its permutation, cut into batches of b
            perm = np.concatenate([idx[t][mask[t]] for t in
                                   range(step, min(step + per_epoch, steps))]).astype(int)
            for j in range(per_epoch):
                if step == steps:
                    break
                rows = perm[j * b:(j + 1) * b]
                if len(rows):
                    np.testing.assert_allclose(losses[i, step], _loss(theta, xs[i][rows],
                                                                      ys[i][rows]), rtol=1e-5)
                    theta = theta - LR * _grad(theta, xs[i][rows], ys[i][rows])
                step += 1
        np.testing.assert_allclose(params[i], theta, rtol=1e-5, atol=1e-6)


def test_sampling_is_checked():
    model = linear_regression(D)
    with pytest.raises(ValueError, match="sampling"):
        fedavg(model, sgd(LR, sampling="epoch"))
    # IFCA option I takes full-batch gradients, which read every row whatever the sampling
    # mode: it refuses the minibatches a mode would draw.
    with pytest.raises(ValueError, match="batch_size=None"):
        ifca(model, sgd(LR, batch_size=2, sampling="epochs"), num_clusters=2,
             option="gradient")
    assert get_preset("ifca-rotated-cifar").defaults["sampling"] == "epochs"


# ------------------------------------------------------- 4. IFCA under partial participation


def _plain_identity(assignment, truth, k):
    """Best relabelling by brute force over the clients that have taken part (assignment >= 0)."""
    part = [(a, t) for a, t in zip(assignment, truth, strict=True) if a >= 0 and t >= 0]
    if not part:
        return float("nan")
    best = max(sum(perm[a] == t for a, t in part) for perm in itertools.permutations(range(k)))
    return best / len(part)


def test_participant_identity_accuracy_equals_a_plain_loop():
    rng = np.random.default_rng(0)
    k = 3
    for trial in range(30):
        m = 12
        truth = rng.integers(0, k, m)
        assignment = rng.integers(0, k, m)
        assignment[rng.random(m) < 0.4] = -1  # never sampled
        if trial == 0:
            assignment[:] = -1
        got = ifca_images.participant_identity_accuracy(assignment, truth, k)
        want = _plain_identity(assignment, truth, k)
        if np.isnan(want):
            assert np.isnan(got)
        else:
            assert got == pytest.approx(want)
    # perfect clustering of the clients seen so far scores 1, whoever was not sampled
    truth = np.array([0, 0, 1, 1, 2, 2])
    assert ifca_images.participant_identity_accuracy(
        np.array([2, -1, 0, -1, -1, 1]), truth, 3) == 1.0


def test_ifca_keeps_each_clients_most_recent_assignment_and_counts_downlink_of_data_slots():
    """Partial participation: after every round state.assignment is, for each client, the
    argmin_j F_i(θ_j) of the last round it took part in (θ at that round's start), -1 while
    never sampled; the downlink is k·d floats per cohort slot holding data."""
    k, m = 2, 8
    sizes = (4, 0, 3, 5, 2, 6, 0, 3)
    thetas = [np.full(D, 1.0) if i % 2 else np.full(D, -1.0) for i in range(m)]
    data, xs, ys = _clients(seed=3, sizes=sizes, thetas=thetas)
    s = 3
    alg = ifca(linear_regression(D), sgd(LR, steps=2), num_clusters=k, option="model",
               participation=s / m)
    state = alg.init(jax.random.key(0), data)
    last = np.full(m, -1)
    round_ = jax.jit(alg.round)
    empty_sampled = False
    for r in range(6):
        key = jax.random.key(30 + r)
        params = np.asarray(state.cluster_params, np.float64)
        state, metrics = round_(state, data, key)
        ids = np.asarray(sample_cohort(key, m, s).ids)
        with_data = 0
        for i in ids:
            if sizes[i] == 0:
                empty_sampled = True
                continue
            last[i] = int(np.argmin([_loss(params[j], xs[i], ys[i]) for j in range(k)]))
            with_data += 1
        np.testing.assert_array_equal(state.assignment, last)
        assert float(metrics["downlink_floats"]) == with_data * k * D
    assert empty_sampled, "some cohort must hold a client without data"
    assert (last == -1).any() and (last >= 0).any()
