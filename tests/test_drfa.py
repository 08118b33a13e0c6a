"""DRFA / DRFLM: the vectorized round against a plain per-client loop, and their invariants."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from federations import assert_reported_as_finished, np_simplex_projection, recording_context
from scipy import stats as scipy_stats

from fedjax_sim.algorithms import drfa, drflm, sgd
from fedjax_sim.data import FederatedData
from fedjax_sim.models import linear_regression
from fedjax_sim.ops import mixup, mixup_client, project_simplex, sample_batch, sample_cohort

D = 3
SIZES = (5, 1, 4, 0, 3)  # a one-example client and an empty one
LR, TAU, BATCH = 0.1, 3, 2


def _data(seed=0, sizes=SIZES, noise=(0.1, 0.1, 0.1, 0.1, 2.0)):
    rng = np.random.default_rng(seed)
    theta = rng.normal(size=D).astype(np.float32)
    xs, ys = [], []
    for n_i, s in zip(sizes, noise, strict=True):
        x = rng.normal(size=(n_i, D)).astype(np.float32)
        xs.append(x)
        ys.append((x @ theta + s * rng.normal(size=n_i)).astype(np.float32))
    return FederatedData.from_clients(xs, ys)


@pytest.fixture(scope="module")
def data():
    return _data()


@pytest.fixture(scope="module")
def model():
    return linear_regression(D)


def _batch_loss(theta, x, y, idx, mask):
    r = x[idx] @ theta - y[idx]
    return jnp.sum(mask * r * r) / jnp.maximum(jnp.sum(mask), 1.0)


_grad = jax.jit(jax.grad(_batch_loss))
_loss = jax.jit(_batch_loss)


def reference_round(theta, lam, data, key, *, m, eta):
    """One paper-form DRFA round written as a loop over cohort slots (numpy + per-step jax.grad).

    Keys follow the documented layout: the round key splits into (cohort, t', U_s) keys; a
    cohort key splits into (ids, slots) and slot j's key is fold_in(slots, j); local step t
    of a slot uses split(slot_key, τ)[t], split again into (minibatch, loss) keys.
    """
    n = data.num_clients
    x, y, counts = (np.asarray(a) for a in (data.x, data.y, data.num_examples))
    key_c, key_t, key_u = jax.random.split(key, 3)
    key_ids, key_slots = jax.random.split(key_c)
    ids = np.asarray(jax.random.choice(key_ids, n, (m,), replace=True, p=jnp.asarray(lam)))
    t_snap = int(jax.random.randint(key_t, (), 1, TAU + 1))
    finals, snaps = [], []
    for j, i in enumerate(ids):
        if counts[i] == 0:  # a client without data takes no part
            continue
        p = jnp.asarray(theta)
        snap = p
        step_keys = jax.random.split(jax.random.fold_in(key_slots, j), TAU)
        for t in range(TAU):
            k_batch, _ = jax.random.split(step_keys[t])
            idx, mask = sample_batch(k_batch, counts[i], x.shape[1], BATCH)
            p = p - LR * _grad(p, x[i], y[i], idx, mask.astype(jnp.float32))
            if t + 1 == t_snap:
                snap = p
        finals.append(np.asarray(p))
        snaps.append(np.asarray(snap))
    new_theta = np.mean(finals, axis=0)
    w_tilde = np.mean(snaps, axis=0)
    key_uids, key_uslots = jax.random.split(key_u)
    u_ids = np.asarray(jax.random.choice(key_uids, n, (m,), replace=False))
    v = np.zeros(n)
    for j, i in enumerate(u_ids):
        k_batch, _ = jax.random.split(jax.random.fold_in(key_uslots, j))
        idx, mask = sample_batch(k_batch, counts[i], x.shape[1], BATCH)
        if counts[i] > 0:
            v[i] = n / m * float(_loss(jnp.asarray(w_tilde), x[i], y[i], idx,
                                       mask.astype(jnp.float32)))
    new_lam = np_simplex_projection(np.asarray(lam, np.float64) + eta * TAU * v)
    return new_theta, new_lam, ids, u_ids


LAM0 = np.array([0.5, 0.2, 0.1, 0.05, 0.15], np.float32)
M = 4  # participation 0.8 of 5 clients


@pytest.fixture(scope="module")
def shared(model):
    """One DRFA build and its jitted round, reused across tests (λ and γ live in the state,
    so tests set them with `_replace` instead of compiling another round)."""
    alg = drfa(model, sgd(LR, steps=TAU, batch_size=BATCH), participation=M / 5,
               lambda_lr=0.05, lambda_init=LAM0)
    return alg, jax.jit(alg.round)


@pytest.mark.parametrize("eta", [0.0, 0.05])
def test_drfa_round_equals_per_client_loop_with_a_client_drawn_twice(data, shared, eta):
    """DRFA = the loop reference. At η = 0 this is FedAvg with clients sampled by λ₀: λ stays
    λ₀ and the model is the plain mean over the λ₀-drawn slots (the reference's update)."""
    alg, round_ = shared
    state = alg.init(jax.random.key(0), data)
    state = state._replace(lambda_lr=jnp.float32(eta))
    theta, lam = np.asarray(state.params), LAM0.astype(np.float64)
    seen_twice = False
    for r in range(3):
        key = jax.random.key(100 + r)
        state, _ = round_(state, data, key)
        theta, lam, ids, _ = reference_round(theta, lam, data, key, m=M, eta=eta)
        seen_twice |= len(set(ids.tolist())) < len(ids)
        np.testing.assert_allclose(state.params, theta, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state.lam, lam, atol=1e-6)
    assert seen_twice, "the fixture's λ₀ must draw some client twice"
    if eta == 0.0:
        np.testing.assert_allclose(state.lam, LAM0, rtol=1e-6)  # the projection's rounding
        np.testing.assert_allclose(state.lam_avg, LAM0, rtol=1e-6)


def test_drflm_with_gamma_one_equals_drfa(data, model, shared):
    """Beta(1, 1e-6) puts γ at 1 (in float32): every mixup is the identity."""
    alg, round_ = shared
    b = drflm(model, sgd(LR, steps=TAU, batch_size=BATCH), mixup=(1.0, 1e-6),
              participation=M / 5, lambda_lr=0.05, lambda_init=LAM0)
    round_b = jax.jit(b.round)
    sa, sb = alg.init(jax.random.key(0), data), b.init(jax.random.key(0), data)
    for r in range(2):
        sa, _ = round_(sa, data, jax.random.key(r))
        sb, _ = round_b(sb, data, jax.random.key(r))
    chex.assert_trees_all_close(sa.params, sb.params, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(sa.lam, sb.lam, atol=1e-7)


def _expected(lam, total):
    p = np.asarray(lam, np.float64)
    return p / p.sum() * total


def test_sampling_frequencies_follow_lambda(data, shared):
    """The cohort path draws ∝ λ with replacement: chi-square goodness of fit on 4000 draws
    (seed fixed; we refuse at p < 0.001, a 1-in-1000 false alarm for a correct sampler),
    and the algorithm's own `sampled` counter over 150 rounds (η = 0) likewise."""
    lam = jnp.asarray([0.4, 0.3, 0.15, 0.1, 0.05])
    keys = jax.random.split(jax.random.key(42), 400)
    ids = jax.vmap(lambda k: sample_cohort(k, 5, 10, weights=lam).ids)(keys)
    counts = np.bincount(np.asarray(ids).ravel(), minlength=5)
    assert scipy_stats.chisquare(counts, _expected(lam, counts.sum())).pvalue > 1e-3
    # A wrong sampler (uniform) is rejected by the same test.
    assert scipy_stats.chisquare(counts, _expected(np.ones(5), counts.sum())).pvalue < 1e-3
    alg, round_ = shared
    state = alg.init(jax.random.key(0), data)._replace(lambda_lr=jnp.float32(0.0), lam=lam)
    for r in range(150):
        state, _ = round_(state, data, jax.random.key(1000 + r))
    sampled = np.asarray(state.sampled)
    assert sampled.sum() == 150 * M
    assert scipy_stats.chisquare(sampled, _expected(lam, sampled.sum())).pvalue > 1e-3


def test_lambda_stays_on_simplex_floor_holds_and_moves_only_through_projection(
        data, model, shared):
    floor = 0.05
    alg = drfa(model, sgd(LR, steps=TAU, batch_size=BATCH), participation=0.4,
               lambda_lr=0.5, lambda_floor=floor)
    state = alg.init(jax.random.key(0), data)
    round_ = jax.jit(alg.round)
    for r in range(6):
        key = jax.random.key(r)
        before = np.asarray(state.lam, np.float64)
        state, _ = round_(state, data, key)
        lam = np.asarray(state.lam, np.float64)
        np.testing.assert_allclose(lam.sum(), 1.0, atol=1e-6)
        assert lam.min() >= floor - 1e-7
        # Clients outside U_s have v_i = 0: the projection shifts them all by one θ
        # (where they stay above the floor).
        u_ids = np.asarray(sample_cohort(jax.random.split(key, 3)[2], 5, 2).ids)
        outside = np.setdiff1d(np.arange(5), u_ids)
        moved = (before - lam)[outside][lam[outside] > floor + 1e-6]
        if moved.size > 1:
            np.testing.assert_allclose(moved, moved[0], atol=1e-6)
    # Without a floor and a large step, λ reaches 0 somewhere and stays on the simplex.
    alg0, round0 = shared
    s0 = alg0.init(jax.random.key(0), data)._replace(lambda_lr=jnp.float32(5.0))
    for r in range(4):
        s0, _ = round0(s0, data, jax.random.key(r))
        assert np.all(np.asarray(s0.lam) >= 0) and abs(float(s0.lam.sum()) - 1) < 1e-6
        np.testing.assert_allclose(s0.lam_avg.sum(), 1.0, atol=1e-6)
    assert np.asarray(s0.lam).min() == 0.0


def test_official_code_variant(data, model):
    """λ₀ ∝ sample counts; γ decays by 0.9 per round; the 1e-3 clip floor on every entry;
    w-clients drawn without replacement (all five, once each, at participation 1)."""
    alg = drfa(model, sgd(LR, steps=TAU), lambda_lr=1.0, official_code=True)
    state = alg.init(jax.random.key(0), data)
    counts = np.asarray(SIZES, np.float32)
    np.testing.assert_allclose(state.lam, counts / counts.sum(), rtol=1e-6)
    round_ = jax.jit(alg.round)
    for r in range(3):
        state, _ = round_(state, data, jax.random.key(r))
        np.testing.assert_allclose(state.lambda_lr, 0.9 ** (r + 1), rtol=1e-5)
        lam = np.asarray(state.lam)
        np.testing.assert_allclose(lam.sum(), 1.0, atol=1e-6)
        assert lam.min() >= 1e-3 / (1 + 5e-3) - 1e-7
    np.testing.assert_array_equal(state.sampled, np.full(5, 3))
    with pytest.raises(ValueError, match="local_steps"):
        drfa(model, sgd(LR, steps=1), official_code=True)


# --------------------------------------------------------------------------- mixup


def test_mixup_gamma_one_is_identity_for_pytrees():
    rng = np.random.default_rng(0)
    x = {"a": jnp.asarray(rng.normal(size=(6, 3)), jnp.float32),
         "b": jnp.asarray(rng.normal(size=(6, 2, 2)), jnp.float32)}
    y = jnp.asarray(rng.normal(size=6), jnp.float32)
    xm, ym, g = mixup_client(jax.random.key(0), x, y, 4, 1.0, 1e-6)
    assert float(g) == 1.0
    chex.assert_trees_all_equal((xm, ym), (x, y))


def test_mixup_rows_are_convex_combinations_within_one_client():
    """With g = identity, each mixed row is γ x_j + (1 − γ) x_k for rows j, k of the same
    client (never another client's); padding rows stay as they are."""
    m, n, d = 3, 5, 4
    rng = np.random.default_rng(1)
    # Client c's rows lie near 100·c, so a row of another client would show at once.
    x = (100.0 * np.arange(m)[:, None, None] + rng.normal(size=(m, n, d))).astype(np.float32)
    y = (100.0 * np.arange(m)[:, None] + rng.normal(size=(m, n))).astype(np.float32)
    counts = np.array([5, 3, 1], np.int32)
    keys = jax.random.split(jax.random.key(3), m)
    xm, ym, g = (np.asarray(a) for a in mixup(keys, jnp.asarray(x), jnp.asarray(y),
                                               jnp.asarray(counts), 0.5, 0.5))
    for c in range(m):
        gamma = float(g[c])
        assert 0.0 <= gamma <= 1.0
        for j in range(n):
            if j >= counts[c]:
                np.testing.assert_array_equal(xm[c, j], x[c, j])
                continue
            partner = (xm[c, j] - gamma * x[c, j]) / max(1.0 - gamma, 1e-6)
            if 1.0 - gamma < 1e-4:
                np.testing.assert_allclose(xm[c, j], x[c, j], atol=1e-3)
                continue
            dists = np.abs(x[:, : max(counts)] - partner).max(-1)  # to every client's row
            cc, k = np.unravel_index(np.argmin(dists), dists.shape)
            assert cc == c and k < counts[c] and dists[cc, k] < 1e-2, (c, j)
            np.testing.assert_allclose(ym[c, j], gamma * y[c, j] + (1 - gamma) * y[c, k],
                                       rtol=1e-4, atol=1e-3)


def test_project_simplex_exact_floor_is_the_floored_projection():
    rng = np.random.default_rng(0)
    for _ in range(5):
        v = rng.normal(size=6) * 2
        floor = 0.04
        got = np.asarray(project_simplex(jnp.asarray(v, jnp.float32), floor, "exact"))
        want = floor + (1 - 6 * floor) * np_simplex_projection((v - floor) / (1 - 6 * floor))
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert got.min() >= floor - 1e-7


# --------------------------------------------------------------------------- the preset


def test_synthetic_noise_preset_small_drfa_chases_noisy_clients():
    """drfa-synthetic-noise at a small size (3 seeds, 30 rounds; FedAvg and DRFA only): on
    every seed DRFA's worst-client clean-test RMSE is more than twice FedAvg's, λ̂ puts most
    of its mass on the 2 noisy clients (uniform: 0.2), and the runner's paired comparison
    calls the difference significant."""
    from fedjax_sim import experiments, stats
    from fedjax_sim.experiments import drfa_molecules, study

    preset = experiments.get_preset("drfa-synthetic-noise", "compare")
    s = experiments.resolve_settings(preset, {"seeds": 3, "rounds": 30, "eval_every": 30,
                                              "n_test": 20, "methods": "fedavg,drfa"},
                                     "compare")
    experiment = drfa_molecules.EXPERIMENT.replace(methods=("fedavg", "drfa"))
    ctx, finished = recording_context()
    comparison = study.compare(experiment, s, ctx)
    assert_reported_as_finished(finished, comparison, experiment.methods)
    fa, dr = comparison.per_seed["fedavg"], comparison.per_seed["drfa"]
    assert np.all(dr["test_rmse_worst"] > 2 * fa["test_rmse_worst"])
    assert np.all(dr["lambda_hat_noisy"] > 0.5)
    np.testing.assert_allclose(fa["lambda_hat_noisy"], 0.2)
    rows = {r["method"]: r for r in stats.paired_comparison(
        comparison.per_seed, comparison.baseline, comparison.metrics)}
    assert rows["drfa"]["test_rmse_worst_diff"] > 0 and rows["drfa"]["test_rmse_worst_significant"]
    # λ trajectories and sampling counts are logged per client in the history.
    last = comparison.histories["drfa"][-1]
    assert {f"lambda_{i}" for i in range(10)} <= set(last)
    assert sum(last[f"sampled_{i}"] for i in range(10)) == pytest.approx(30 * 5)
