"""The DP kernels (fedjax_sim.ops.privacy) against per-client loops written here.

Every reference is a Python loop over clients in float64 (numpy), from the
papers' formulas: McMahan et al. 2018 (clip to C, sum, N(0, σ²C²), fixed or
counted denominator), Andrew et al. 2021 (geometric clip update from the noised
centered count), Kairouz et al. 2021 (prefix-sum noise from a binary tree). The
noise is redrawn in the test with the same `jax.random` calls on the same keys
(the derivation is the module docstring's), or measured over many keys.
"""

from __future__ import annotations

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_sim.ops import privacy

C = 1.5
S = 7


def _updates(seed=0, s=S):
    """A two-leaf pytree of s client updates with norms on both sides of C."""
    rng = np.random.default_rng(seed)
    scale = np.array([0.1, 0.5, 1.0, 3.0, 0.0, 8.0, 0.7][:s] + [2.0] * max(0, s - 7))
    a = rng.normal(size=(s, 3)) * scale[:, None]
    b = rng.normal(size=(s, 2, 2)) * scale[:, None, None]
    a[4], b[4] = 0.0, 0.0  # a zero update: clipping leaves it alone
    return {"a": a.astype(np.float32), "b": b.astype(np.float32)}


def _as_jax(tree):
    return jax.tree.map(jnp.asarray, tree)


def _noise64(key, shapes, stddev):
    """The module's draw: split(key, leaves), one normal per leaf, as float64."""
    keys = jax.random.split(key, len(shapes))
    return [stddev * np.asarray(jax.random.normal(k, shape, jnp.float32), np.float64)
            for k, shape in zip(keys, shapes, strict=True)]


def _clipped_loop(updates, reports, weights, clip):
    """Σ_{i reports} w_i Δ_i min(1, C/‖Δ_i‖) and Σ w_i, a loop over clients in float64."""
    leaves = [np.asarray(updates["a"], np.float64), np.asarray(updates["b"], np.float64)]
    total = [np.zeros(leaf.shape[1:]) for leaf in leaves]
    count = 0.0
    for i in range(leaves[0].shape[0]):
        if not reports[i]:
            continue
        norm = np.sqrt(sum(np.sum(leaf[i] ** 2) for leaf in leaves))
        factor = 1.0 if norm == 0 else min(1.0, clip / norm)
        for t, leaf in zip(total, leaves, strict=True):
            t += weights[i] * factor * leaf[i]
        count += weights[i]
    return total, count


REPORTS = np.array([1, 1, 0, 1, 1, 1, 0], bool)
WEIGHTS = np.array([1.0, 0.5, 1.0, 0.25, 1.0, 1.0, 0.8])


def test_client_norms_are_flat_over_the_pytree():
    updates = _updates()
    got = np.asarray(privacy.client_norms(_as_jax(updates)))
    want = [np.sqrt(np.sum(np.float64(updates["a"][i]) ** 2)
                    + np.sum(np.float64(updates["b"][i]) ** 2)) for i in range(S)]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    clipped, _ = privacy.clip_updates(_as_jax(updates), C)
    assert np.all(np.asarray(privacy.client_norms(clipped)) <= C * (1 + 1e-6))


@pytest.mark.parametrize("denominator", [4.0, None])
def test_noised_mean_matches_a_float64_loop(denominator):
    updates, key, sigma = _updates(), jax.random.key(3), 0.7
    got = jax.jit(lambda u, k: privacy.noised_mean(
        u, k, clip_norm=C, noise_multiplier=sigma, reports=jnp.asarray(REPORTS),
        weights=jnp.asarray(WEIGHTS, jnp.float32), denominator=denominator))(
            _as_jax(updates), key)
    total, count = _clipped_loop(updates, REPORTS, WEIGHTS, C)
    key_sum, _ = jax.random.split(key)
    noise = _noise64(key_sum, [(3,), (2, 2)], sigma * C)
    denom = count if denominator is None else denominator
    for name, t, n in zip(("a", "b"), total, noise, strict=True):
        np.testing.assert_allclose(np.asarray(got.mean[name]), (t + n) / denom,
                                   rtol=1e-5, atol=1e-6)
    assert float(got.count) == pytest.approx(count)
    assert float(got.denominator) == pytest.approx(denom)
    norms = np.asarray(privacy.client_norms(_as_jax(updates)))
    assert float(got.below) == sum(float(norms[i] <= C) - 0.5 for i in range(S) if REPORTS[i])


def test_a_noised_count_denominator_matches_the_loop():
    updates, key, sigma, sigma_n = _updates(), jax.random.key(8), 0.5, 0.8
    got = privacy.noised_mean(_as_jax(updates), key, clip_norm=C, noise_multiplier=sigma,
                              reports=jnp.asarray(REPORTS), count_stddev=sigma_n)
    total, count = _clipped_loop(updates, REPORTS, np.ones(S), C)
    key_sum, key_count = jax.random.split(key)
    noise = _noise64(key_sum, [(3,), (2, 2)], sigma * C)
    denom = max(count + sigma_n * float(jax.random.normal(key_count, ())), 1.0)
    assert float(got.denominator) == pytest.approx(denom, rel=1e-6)
    for name, t, n in zip(("a", "b"), total, noise, strict=True):
        np.testing.assert_allclose(np.asarray(got.mean[name]), (t + n) / denom, rtol=1e-5,
                                   atol=1e-6)


def test_a_masked_slot_adds_nothing_and_is_not_counted():
    updates = _updates()
    loud = jax.tree.map(lambda x: x.copy(), updates)
    loud["a"][2], loud["b"][2] = 1e6, -1e6  # slot 2 does not report
    runs = [privacy.noised_mean(_as_jax(u), jax.random.key(0), clip_norm=C,
                                noise_multiplier=0.3, reports=jnp.asarray(REPORTS))
            for u in (updates, loud)]
    for name in ("a", "b"):
        np.testing.assert_array_equal(runs[0].mean[name], runs[1].mean[name])
    assert float(runs[1].count) == REPORTS.sum()
    # And the count rule on a round where nobody reported keeps a zero update.
    none = privacy.noised_mean(_as_jax(updates), jax.random.key(0), clip_norm=C,
                               noise_multiplier=0.3, reports=jnp.zeros((S,), bool))
    assert float(none.count) == 0.0
    assert all(np.all(np.asarray(v) == 0) for v in jax.tree.leaves(none.mean))


def test_no_noise_and_a_clip_above_every_norm_is_the_plain_mean():
    updates = _updates()
    big = 10.0 * float(np.max(np.asarray(privacy.client_norms(_as_jax(updates)))))
    got = privacy.noised_mean(_as_jax(updates), jax.random.key(1), clip_norm=big,
                              noise_multiplier=0.0, reports=jnp.asarray(REPORTS))
    for name in ("a", "b"):
        rows = [np.float64(updates[name][i]) for i in range(S) if REPORTS[i]]
        np.testing.assert_allclose(np.asarray(got.mean[name]), sum(rows) / len(rows),
                                   rtol=1e-6, atol=1e-7)


def test_chunks_add_up_to_the_whole_cohort():
    updates, key = _as_jax(_updates()), jax.random.key(5)
    whole = privacy.noised_mean(updates, key, clip_norm=C, noise_multiplier=0.9,
                                reports=jnp.asarray(REPORTS), denominator=5.0)
    parts = [privacy.clipped_sum(jax.tree.map(lambda x, sl=sl: x[sl], updates), C,
                                 jnp.asarray(REPORTS[sl]))
             for sl in (slice(0, 3), slice(3, S))]
    chunked = privacy.privatize(optax.tree.add(*parts), key, clip_norm=C,
                                noise_multiplier=0.9, denominator=5.0)
    for name in ("a", "b"):
        np.testing.assert_allclose(chunked.mean[name], whole.mean[name], rtol=1e-6, atol=1e-6)


SEGMENTS = np.array([0, 2, 0, 2, 0, 9, 2])  # cluster 1 empty; slot 5's id is out of range
K = 3


@pytest.mark.parametrize("denominators", [None, [3.0, 2.0, 2.5]])
def test_cluster_means_match_a_float64_loop(denominators):
    updates, key, sigma = _updates(), jax.random.key(7), 0.6
    fallback = {"a": jnp.full((K, 3), 5.0), "b": jnp.full((K, 2, 2), -5.0)}
    got = jax.jit(lambda u, k: privacy.noised_cluster_means(
        u, jnp.asarray(SEGMENTS), K, k, clip_norm=C, noise_multiplier=sigma,
        reports=jnp.asarray(REPORTS), denominators=denominators, fallback=fallback))(
            _as_jax(updates), key)
    key_sum, _ = jax.random.split(key)
    noise = _noise64(key_sum, [(K, 3), (K, 2, 2)], sigma * C)
    for j in range(K):
        members = REPORTS & (SEGMENTS == j)
        total, count = _clipped_loop(updates, members, np.ones(S), C)
        assert float(got.count[j]) == count
        for leaf, (name, t) in enumerate(zip(("a", "b"), total, strict=True)):
            if denominators is None and count == 0:
                want = np.asarray(fallback[name][j])  # an empty cluster keeps its model
            else:
                denom = count if denominators is None else denominators[j]
                want = (t + noise[leaf][j]) / denom
            np.testing.assert_allclose(np.asarray(got.mean[name][j]), want, rtol=1e-5,
                                       atol=1e-6)


def test_noise_scale_measured_over_many_keys():
    # Every update zero: the output is the noise alone, N(0, (σC/D)²) per coordinate.
    sigma, clip, denom, draws = 1.3, 0.8, 4.0, 4000
    zeros = {"w": jnp.zeros((5, 6)), "b": jnp.zeros((5, 2))}
    keys = jax.random.split(jax.random.key(11), draws)
    out = jax.jit(jax.vmap(lambda k: privacy.noised_mean(
        zeros, k, clip_norm=clip, noise_multiplier=sigma, denominator=denom).mean))(keys)
    samples = np.concatenate([np.asarray(v, np.float64).reshape(draws, -1)
                              for v in jax.tree.leaves(out)], axis=1)
    target = (sigma * clip / denom) ** 2
    n = samples.size
    var = samples.var(axis=0, ddof=1)  # per coordinate, over keys
    # The pooled variance of n normal draws has standard error ≈ target·sqrt(2/n).
    assert abs(var.mean() - target) < 5 * target * np.sqrt(2 / n)
    # Each coordinate's own variance, from `draws` keys, within 5 of its standard errors.
    assert np.all(np.abs(var - target) < 5 * target * np.sqrt(2 / (draws - 1)))
    assert abs(samples.mean()) < 5 * np.sqrt(target / n)


def test_cluster_noise_is_independent_per_cluster_at_the_same_scale():
    sigma, clip, draws = 0.9, 2.0, 3000
    zeros = {"w": jnp.zeros((4, 5))}
    keys = jax.random.split(jax.random.key(12), draws)
    out = jax.vmap(lambda k: privacy.noised_cluster_means(
        zeros, jnp.array([0, 1, 1, 0]), 2, k, clip_norm=clip, noise_multiplier=sigma,
        denominators=1.0).mean["w"])(keys)
    x = np.asarray(out, np.float64)  # [draws, 2, 5]
    target = (sigma * clip) ** 2
    assert abs(x.var() - target) < 5 * target * np.sqrt(2 / x.size)
    corr = np.corrcoef(x[:, 0, :].ravel(), x[:, 1, :].ravel())[0, 1]
    assert abs(corr) < 5 / np.sqrt(x[:, 0, :].size)


# ------------------------------------------------------------------------ adaptive clipping


def _adaptive_loop(norms, clip0, keys, gamma, eta, sigma_b, expected):
    """Andrew et al.'s geometric update, a loop over rounds and clients in float64."""
    clip, path = clip0, []
    for key in keys:
        below = sum((1.0 if n <= clip else 0.0) - 0.5 for n in norms)
        z = float(jax.random.normal(key, ()))
        frac = min(1.0, max(0.0, (below + sigma_b * z) / expected + 0.5))
        clip = clip * np.exp(-eta * (frac - gamma))
        path.append(clip)
    return np.array(path)


@pytest.mark.parametrize("gamma", [0.5, 0.8])
def test_adaptive_clip_tracks_the_target_quantile(gamma):
    rng = np.random.default_rng(0)
    s, rounds, eta = 200, 300, 0.2
    norms = np.exp(rng.normal(1.0, 0.7, size=s)).astype(np.float32)  # fixed norm distribution
    direction = rng.normal(size=(s, 4)).astype(np.float32)
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    updates = {"w": jnp.asarray(norms[:, None] * direction)}
    sigma_b = s / 20  # the paper's σ_b = expected count / 20
    keys = jax.random.split(jax.random.key(4), rounds)

    def round_(clip, key):
        below = privacy.clipped_sum(updates, clip, None).below
        clip, frac = privacy.adaptive_clip_update(
            clip, below, key, target_quantile=gamma, learning_rate=eta,
            count_stddev=sigma_b, expected_count=float(s))
        return clip, clip

    _, path = jax.jit(lambda: jax.lax.scan(round_, jnp.float32(0.1), keys))()
    want = _adaptive_loop(norms.astype(np.float64), 0.1, keys, gamma, eta, sigma_b, s)
    np.testing.assert_allclose(np.asarray(path), want, rtol=2e-4)
    # After the climb from C = 0.1, C hovers at the γ-quantile of the norms.
    settled = np.exp(np.mean(np.log(np.asarray(path)[-100:])))
    lo, hi = np.quantile(norms, [gamma - 0.05, gamma + 0.05])
    assert lo <= settled <= hi, (settled, lo, hi, np.quantile(norms, gamma))


def test_adaptive_noise_split_costs_the_stated_multiplier():
    sigma, sigma_b = 1.0, 5.0
    sigma_delta = privacy.adaptive_noise_multiplier(sigma, sigma_b)
    # The sum at σ_Δ and the centered count (sensitivity ½) at σ_b, i.e. multiplier 2σ_b:
    # σ⁻² = σ_Δ⁻² + (2σ_b)⁻².
    assert sigma_delta ** -2 + (2 * sigma_b) ** -2 == pytest.approx(sigma ** -2, rel=1e-12)
    assert sigma_delta > sigma
    with pytest.raises(ValueError, match="count_stddev > noise_multiplier / 2"):
        privacy.adaptive_noise_multiplier(1.0, 0.5)


# ------------------------------------------------------------------------- tree aggregation


def _tree_noise_loop(keys, stddev, shape):
    """n_t = Σ of the dyadic nodes covering 1..t; node [e − 2^l + 1, e] drawn with key_e."""
    out = []
    for t in range(1, len(keys) + 1):
        total, start = np.zeros(shape), 0
        for level in reversed(range(t.bit_length())):
            if t >> level & 1:
                end = start + 2 ** level  # the node covering start+1 … end
                total += _noise64(keys[end - 1], [shape], stddev)[0]
                start = end
        out.append(total)
    return np.array(out)


def test_tree_noise_matches_the_binary_tree():
    steps, stddev = 13, 0.7
    keys = jax.random.split(jax.random.key(9), steps)
    state = privacy.tree_noise_init({"w": jnp.zeros((3,))}, steps)
    _, noise = jax.lax.scan(lambda st, k: privacy.tree_noise_step(st, k, stddev), state, keys)
    np.testing.assert_allclose(np.asarray(noise["w"]), _tree_noise_loop(keys, stddev, (3,)),
                               rtol=1e-5, atol=1e-6)
    # Past its capacity (2^depth − 1 = 15 steps here) the tree answers NaN.
    more = jax.random.split(jax.random.key(1), 16)
    _, noise = jax.lax.scan(lambda st, k: privacy.tree_noise_step(st, k, stddev), state, more)
    assert np.all(np.isfinite(noise["w"][:15])) and np.all(np.isnan(noise["w"][15]))


def test_tree_prefix_noise_variance_is_the_number_of_set_bits():
    # Var n_t = popcount(t) σ²C²: each set bit of t is one node of the prefix.
    steps, draws = 7, 4000
    state = privacy.tree_noise_init(jnp.zeros(()), steps)

    def run(key):
        return jax.lax.scan(lambda st, k: privacy.tree_noise_step(st, k, 1.0), state,
                            jax.random.split(key, steps))[1]

    x = np.asarray(jax.vmap(run)(jax.random.split(jax.random.key(2), draws)), np.float64)
    for t in range(1, steps + 1):
        target = bin(t).count("1")
        assert abs(x[:, t - 1].var() - target) < 5 * target * np.sqrt(2 / (draws - 1))


# -------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("clip", [0.0, -1.0, float("inf"), float("nan")])
def test_a_bad_clip_is_refused_in_one_line(clip):
    with pytest.raises(ValueError, match="clip_norm must be a finite number > 0") as err:
        privacy.noised_mean(_as_jax(_updates()), jax.random.key(0), clip_norm=clip,
                            noise_multiplier=1.0)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("call, message", [
    (lambda: privacy.noised_mean(_as_jax(_updates()), jax.random.key(0), clip_norm=1.0,
                                 noise_multiplier=-0.1), "noise_multiplier must be"),
    (lambda: privacy.adaptive_clip_update(1.0, 0.0, jax.random.key(0), target_quantile=1.5,
                                          learning_rate=0.2, count_stddev=1.0,
                                          expected_count=10.0), "target_quantile must be"),
    (lambda: privacy.adaptive_clip_update(1.0, 0.0, jax.random.key(0), target_quantile=0.5,
                                          learning_rate=0.2, count_stddev=1.0,
                                          expected_count=0.0), "expected_count must be"),
    (lambda: privacy.tree_noise_init(jnp.zeros(3), 0), "num_steps must be an integer"),
])
def test_other_bad_inputs_are_refused_in_one_line(call, message):
    with pytest.raises(ValueError, match=message) as err:
        call()
    assert "\n" not in str(err.value)


def test_module_doctests():
    result = doctest.testmod(privacy, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                             report=False)
    assert result.attempted > 0 and result.failed == 0
