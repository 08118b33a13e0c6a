"""`with_dp` and `with_dp_ftrl` on FedAvg and IFCA: rounds against float64 loops.

Each loop is written from McMahan et al.'s DP-FedAvg (arXiv:1710.06963): every reporting
client's change Δ_i = θ̃_i − θ (θ̃_i: τ full-batch GD steps from θ) clipped to L2 norm C,
summed, N(0, σ²C²) added, divided by the expected cohort D. The noise is redrawn here from
the documented key rule (fedjax_sim.algorithms.private and ops/privacy.py's docstrings):

    k = fold_in(round_key, PRIVACY_STREAM);  key_sum, key_clip = split(k)
    key_noise, key_count = split(key_sum)
    leaf j's noise = σ_Δ C · normal(split(key_noise, leaves)[j], leaf.shape)

and adaptive clipping's count noise is normal(key_clip, ()) · σ_b (Andrew et al.).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.algorithms import (
    AdaptiveClipping,
    afl,
    drfa,
    fedavg,
    ifca,
    qffl,
    sgd,
    with_dp,
    with_dp_ftrl,
    with_initial_params,
    with_server_optimizer,
    with_systems,
)
from fedjax_sim.algorithms.private import PRIVACY_STREAM
from fedjax_sim.execution import planned
from fedjax_sim.ops import sample_cohort
from fedjax_sim.systems import Systems

LR, TAU, ROUNDS = 0.1, 3, 3


def _np(data):
    return np.asarray(data.x), np.asarray(data.y), np.asarray(data.num_examples)


def _gd(ref, theta, x, y, n, steps=TAU, lr=LR):
    theta = np.asarray(theta, np.float64).copy()
    for _ in range(steps):
        theta = theta - lr * ref.grad(theta, x, y, n)
    return theta


def _clip(delta, clip):
    norm = np.linalg.norm(delta)
    return delta * min(1.0, clip / norm) if norm > 0 else delta


def _keys(round_key):
    k = jax.random.fold_in(round_key, PRIVACY_STREAM)
    key_sum, key_clip = jax.random.split(k)
    key_noise, _ = jax.random.split(key_sum)
    return key_noise, key_clip


def _noise(round_key, shape, stddev):
    """One leaf's noise (these models have one leaf: θ [d] or [k, d])."""
    key_noise, _ = _keys(round_key)
    (leaf_key,) = jax.random.split(key_noise, 1)
    return stddev * np.asarray(jax.random.normal(leaf_key, shape, jnp.float32), np.float64)


def _fixed(theta0):
    params = jnp.asarray(theta0, jnp.float32)
    return lambda key: params


# ------------------------------------------------------------------------------- FedAvg


@pytest.mark.parametrize("sigma", [0.0, 0.7])
def test_fedavg_dp_rounds_equal_the_loop(ragged, linear_model, ref, sigma):
    """Every client in the cohort (5 slots, one without data): the 4 holding data clip their
    change to C (small enough that some are clipped), D = 5 slots."""
    clip = 0.3
    alg = with_dp(fedavg(linear_model, sgd(LR, steps=TAU)), clip, sigma)
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np(ragged)
    m = ragged.num_clients
    w = np.asarray(state.params, np.float64)
    round_ = jax.jit(alg.round)
    clipped_any = False
    for key in jax.random.split(jax.random.key(1), ROUNDS):
        state, metrics = round_(state, ragged, key)
        total = np.zeros_like(w)
        for i in range(m):
            if n[i]:
                delta = _gd(ref, w, x[i], y[i], n[i]) - w
                clipped_any |= np.linalg.norm(delta) > clip
                total += _clip(delta, clip)
        w = w + (total + _noise(key, w.shape, sigma * clip)) / m
        np.testing.assert_allclose(state.params, w, rtol=1e-5, atol=1e-6)
        assert float(metrics["dp_clip_norm"]) == pytest.approx(clip)
    assert clipped_any


def test_partial_participation_and_dropout_count_only_reporting_clients(linear_model, ref):
    """A cohort of 4 of 10 clients, each failing to report with probability 0.4: the loop
    takes the cohort and its reports from `ops.sample_cohort` (the documented draw) and sums
    only the reporting clients holding data; D = 4."""
    from conftest import make_ragged

    data = make_ragged(3, sizes=(3, 2, 4, 1, 2, 3, 0, 2, 4, 1),
                       clusters=(0, 1, 0, 1, 0, 1, 0, 1, 0, 1))
    systems = Systems(dropout=0.4)
    clip, sigma = 0.5, 0.3
    alg = with_dp(with_systems(fedavg(linear_model, sgd(LR, steps=TAU), participation=0.4),
                               systems), clip, sigma)
    state = alg.init(jax.random.key(0), data)
    x, y, n = _np(data)
    w = np.asarray(state.params, np.float64)
    round_ = jax.jit(alg.round)
    reported_none = reported_some = False
    for t, key in enumerate(jax.random.split(jax.random.key(2), 6)):
        state, _ = round_(state, data, key)
        cohort = sample_cohort(key, 10, 4, systems=systems, round_=jnp.int32(t))
        total = np.zeros_like(w)
        counted = 0
        for i, reports in zip(np.asarray(cohort.ids), np.asarray(cohort.reports), strict=True):
            if reports and n[i]:
                total += _clip(_gd(ref, w, x[i], y[i], n[i]) - w, clip)
                counted += 1
        reported_none |= counted == 0
        reported_some |= 0 < counted < 4
        w = w + (total + _noise(key, w.shape, sigma * clip)) / 4
        np.testing.assert_allclose(state.params, w, rtol=1e-5, atol=1e-6)
    assert reported_some


def test_chunked_cohort_gives_the_same_round(ragged, linear_model):
    alg = with_dp(fedavg(linear_model, sgd(LR, steps=TAU)), 0.3, 0.5)
    state = alg.init(jax.random.key(0), ragged)
    whole, _ = jax.jit(alg.round)(state, ragged, jax.random.key(3))
    chunked, _ = jax.jit(alg.round)(state, planned(ragged, client_chunk=2), jax.random.key(3))
    np.testing.assert_allclose(chunked.params, whole.params, rtol=1e-6, atol=1e-7)


def test_no_noise_and_a_clip_above_every_norm_is_plain_fedavg(ragged, linear_model):
    plain = fedavg(linear_model, sgd(LR, steps=TAU))
    private = with_dp(plain, 1e6, 0.0, denominator="count")
    a = plain.init(jax.random.key(0), ragged)
    b = private.init(jax.random.key(0), ragged)
    for key in jax.random.split(jax.random.key(4), ROUNDS):
        a, _ = jax.jit(plain.round)(a, ragged, key)
        b, _ = jax.jit(private.round)(b, ragged, key)
        np.testing.assert_allclose(b.params, a.params, rtol=1e-5, atol=1e-6)


def test_noise_scale_is_sigma_c_over_d_per_coordinate(ragged, linear_model):
    """Clients that do not move (learning rate 0): each round changes the model by the noise
    alone, N(0, (σC/D)²) per coordinate. The sample variance over 400 rounds × 3 coordinates
    is within 4 standard errors of (σC/D)² (its standard error √(2/N) (σC/D)²)."""
    sigma, clip, m = 1.3, 2.0, ragged.num_clients
    alg = with_dp(fedavg(linear_model, sgd(0.0, steps=1)), clip, sigma)
    state = alg.init(jax.random.key(0), ragged)

    def step(state, key):
        new, _ = alg.round(state, ragged, key)
        return new, new.params - state.params

    _, changes = jax.jit(lambda s: jax.lax.scan(step, s, jax.random.split(
        jax.random.key(5), 400)))(state)
    changes = np.asarray(changes, np.float64).ravel()
    want = (sigma * clip / m) ** 2
    assert abs(np.mean(changes**2) - want) < 4 * np.sqrt(2 / changes.size) * want


def test_adaptive_clipping_moves_c_by_the_noised_unclipped_count(ragged, linear_model, ref):
    """C ← C exp(−η (b̃ − γ)), b̃ = clip((Σ_i (1[‖Δ_i‖ ≤ C] − ½) + σ_b z) / D + ½, 0, 1) with
    z = normal(key_clip, ()), σ_b = D / 20; the sum noised at σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−½)."""
    sigma, clip0, gamma, eta = 0.3, 0.3, 0.5, 0.2
    alg = with_dp(fedavg(linear_model, sgd(LR, steps=TAU)), clip0, sigma,
                  adaptive=AdaptiveClipping(gamma, eta))
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np(ragged)
    m = ragged.num_clients
    sigma_b = m / 20
    sigma_delta = (sigma**-2 - (2 * sigma_b) ** -2) ** -0.5
    w, clip = np.asarray(state.params, np.float64), clip0
    round_ = jax.jit(alg.round)
    for key in jax.random.split(jax.random.key(6), 4):
        state, metrics = round_(state, ragged, key)
        total, below = np.zeros_like(w), 0.0
        for i in range(m):
            if n[i]:
                delta = _gd(ref, w, x[i], y[i], n[i]) - w
                below += (np.linalg.norm(delta) <= clip) - 0.5
                total += _clip(delta, clip)
        w = w + (total + _noise(key, w.shape, sigma_delta * clip)) / m
        _, key_clip = _keys(key)
        z = float(jax.random.normal(key_clip, ()))
        fraction = min(1.0, max(0.0, (below + sigma_b * z) / m + 0.5))
        clip = clip * np.exp(-eta * (fraction - gamma))
        np.testing.assert_allclose(state.params, w, rtol=1e-5, atol=1e-6)
        assert float(metrics["dp_unclipped_fraction"]) == pytest.approx(fraction, abs=1e-6)
        assert float(state.aggregation.clip_norm) == pytest.approx(clip, rel=1e-5)


def test_noise_cohort_size_shrinks_the_noise_by_d_over_n(ragged, linear_model):
    """The peers' shortcut: noise calibrated for a cohort of N while D clients train, i.e.
    the same draw scaled by D / N."""
    plain = with_dp(fedavg(linear_model, sgd(0.0, steps=1)), 1.0, 1.0)
    shortcut = with_dp(fedavg(linear_model, sgd(0.0, steps=1)), 1.0, 1.0, noise_cohort_size=50)
    a = plain.init(jax.random.key(0), ragged)
    b = shortcut.init(jax.random.key(0), ragged)
    key = jax.random.key(7)
    a1, _ = jax.jit(plain.round)(a, ragged, key)
    b1, _ = jax.jit(shortcut.round)(b, ragged, key)
    np.testing.assert_allclose(b1.params - b.params, (a1.params - a.params) * 5 / 50,
                               rtol=1e-5, atol=1e-7)


def test_server_optimizer_steps_on_the_privatised_mean(ragged, linear_model, ref):
    """FedAvgM (server momentum β = 0.9, η = 1) over DP-FedAvg: v ← β v + Δ̃, θ ← θ + v."""
    clip, sigma = 0.3, 0.5
    alg = with_server_optimizer(with_dp(fedavg(linear_model, sgd(LR, steps=TAU)), clip, sigma),
                                "sgdm")
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np(ragged)
    m = ragged.num_clients
    w = np.asarray(state.params, np.float64)
    v = np.zeros_like(w)
    for key in jax.random.split(jax.random.key(8), ROUNDS):
        state, _ = jax.jit(alg.round)(state, ragged, key)
        total = sum(_clip(_gd(ref, w, x[i], y[i], n[i]) - w, clip) for i in range(m) if n[i])
        v = 0.9 * v + (total + _noise(key, w.shape, sigma * clip)) / m
        w = w + v
        np.testing.assert_allclose(state.params, w, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------- IFCA


def test_ifca_dp_noises_each_cluster_and_divides_by_d_over_k(ragged, linear_model, ref):
    """Option II: client i picks argmin_j F_i(θ_j), clips its change of θ_j; cluster j's
    sum gets its own N(0, σ²C²) draw (row j of one [k, d] draw) and is divided by D / k;
    a cluster nobody picked moves by its noise alone."""
    k, clip, sigma = 3, 0.4, 0.6
    theta0 = np.array([[0.0, 0.0, 0.0], [1.0, -1.0, 0.5], [50.0, 50.0, 50.0]])
    alg = with_dp(with_initial_params(
        ifca(linear_model, sgd(LR, steps=TAU), num_clusters=k, option="model"),
        _fixed(theta0)), clip, sigma)
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np(ragged)
    m = ragged.num_clients
    theta = theta0.copy()
    round_ = jax.jit(alg.round)
    for key in jax.random.split(jax.random.key(9), ROUNDS):
        state, _ = round_(state, ragged, key)
        totals = np.zeros_like(theta)
        for i in range(m):
            if n[i]:
                j = int(np.argmin([ref.loss(theta[c], x[i], y[i], n[i]) for c in range(k)]))
                totals[j] += _clip(_gd(ref, theta[j], x[i], y[i], n[i]) - theta[j], clip)
        theta = theta + (totals + _noise(key, theta.shape, sigma * clip)) / (m / k)
        np.testing.assert_allclose(state.cluster_params, theta, rtol=1e-4, atol=1e-5)


def test_ifca_dp_without_noise_and_count_denominator_is_plain_ifca(ragged, linear_model):
    theta0 = np.array([[0.0, 0.0, 0.0], [1.0, -1.0, 0.5]])
    plain = with_initial_params(ifca(linear_model, sgd(LR, steps=TAU), num_clusters=2,
                                     option="model"), _fixed(theta0))
    private = with_dp(plain, 1e6, 0.0, denominator="count")
    a, b = plain.init(jax.random.key(0), ragged), private.init(jax.random.key(0), ragged)
    for key in jax.random.split(jax.random.key(10), ROUNDS):
        a, _ = jax.jit(plain.round)(a, ragged, key)
        b, _ = jax.jit(private.round)(b, ragged, key)
        np.testing.assert_allclose(b.cluster_params, a.cluster_params, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(b.assignment, a.assignment)


# ------------------------------------------------------------------------------- DP-FTRL


def test_dp_ftrl_adds_the_tree_noise_of_each_prefix(ragged, linear_model, ref):
    """θ_t = θ_{t−1} + (S_t + n_t − n_{t−1}) / D, n_t = Σ over the set bits l of t of the
    latest node at level l; the node at level ctz(t) is drawn at step t, N(0, σ²C²), from
    the round's key fold_in(key, PRIVACY_STREAM) split per leaf (ops.privacy.gaussian_noise)."""
    clip, sigma, rounds = 0.3, 0.8, 6
    alg = with_dp_ftrl(fedavg(linear_model, sgd(LR, steps=TAU)), clip, sigma, rounds=rounds)
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np(ragged)
    m = ragged.num_clients
    w = np.asarray(state.params, np.float64)
    nodes, previous = {}, np.zeros_like(w)
    for t, key in enumerate(jax.random.split(jax.random.key(11), rounds), start=1):
        state, _ = jax.jit(alg.round)(state, ragged, key)
        level = (t & -t).bit_length() - 1
        (leaf_key,) = jax.random.split(jax.random.fold_in(key, PRIVACY_STREAM), 1)
        nodes[level] = sigma * clip * np.asarray(jax.random.normal(leaf_key, w.shape), np.float64)
        prefix = sum(nodes[lv] for lv in range(t.bit_length()) if (t >> lv) & 1)
        total = sum(_clip(_gd(ref, w, x[i], y[i], n[i]) - w, clip) for i in range(m) if n[i])
        w = w + (total + prefix - previous) / m
        previous = prefix
        np.testing.assert_allclose(state.params, w, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("build", [
    lambda model: drfa(model, sgd(LR), participation=0.5),
    lambda model: afl(model, sgd(LR)),
    lambda model: qffl(model, sgd(LR), q=1.0),
], ids=["drfa", "afl", "qffl"])
def test_algorithms_using_client_losses_are_refused_in_one_line(ragged, linear_model, build):
    alg = with_dp(build(linear_model), 1.0, 1.0)
    with pytest.raises(ValueError, match="uses more than the clipped sum") as info:
        alg.init(jax.random.key(0), ragged)
    assert "\n" not in str(info.value)


def test_ifca_gradient_option_and_ftrl_on_clusters_are_refused(ragged, linear_model):
    alg = with_dp(ifca(linear_model, sgd(LR), num_clusters=2, option="gradient"), 1.0, 1.0)
    state = alg.init(jax.random.key(0), ragged)
    with pytest.raises(ValueError, match="needs option 'model'"):
        alg.round(state, ragged, jax.random.key(1))
    ftrl = with_dp_ftrl(ifca(linear_model, sgd(LR), num_clusters=2, option="model"), 1.0, 1.0,
                        rounds=4)
    with pytest.raises(ValueError, match="one model per cluster"):
        ftrl.init(jax.random.key(0), ragged)


@pytest.mark.parametrize("kwargs, message", [
    ({"clip_norm": 0.0, "noise_multiplier": 1.0}, "clip_norm must be a finite number > 0"),
    ({"clip_norm": -1.0, "noise_multiplier": 1.0}, "clip_norm must be a finite number > 0"),
    ({"clip_norm": 1.0, "noise_multiplier": -0.5}, "noise_multiplier must be a finite number"),
    ({"clip_norm": 1.0, "noise_multiplier": 1.0, "denominator": "mean"},
     "denominator must be one of"),
    ({"clip_norm": 1.0, "noise_multiplier": 0.0, "adaptive": AdaptiveClipping()},
     "adaptive clipping needs noise_multiplier > 0"),
    ({"clip_norm": 1.0, "noise_multiplier": 1.0, "adaptive": AdaptiveClipping(1.5)},
     "target_quantile must be in"),
    ({"clip_norm": 1.0, "noise_multiplier": 1.0, "noise_cohort_size": 0},
     "noise_cohort_size must be a number > 0"),
])
def test_bad_settings_are_refused_in_one_line(linear_model, kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        with_dp(fedavg(linear_model, sgd(LR)), **kwargs)
    assert "\n" not in str(info.value)


def test_adaptive_count_noise_below_half_sigma_is_refused_when_traced(ragged, linear_model):
    """σ_b = D / 20 = 0.25 for the 5 slots: σ = 0.8 would leave the sum no noise budget."""
    alg = with_dp(fedavg(linear_model, sgd(LR)), 1.0, 0.8, adaptive=AdaptiveClipping())
    state = alg.init(jax.random.key(0), ragged)
    with pytest.raises(ValueError, match=r"D / 20 = 0.25 .* must exceed noise_multiplier / 2"):
        alg.round(state, ragged, jax.random.key(1))


def test_dp_twice_is_refused(ragged, linear_model):
    alg = with_dp(with_dp(fedavg(linear_model, sgd(LR)), 1.0, 1.0), 1.0, 1.0)
    with pytest.raises(ValueError, match="already GaussianSum"):
        alg.init(jax.random.key(0), ragged)
