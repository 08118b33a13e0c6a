"""The attacks against their papers' formulas, computed here in float64 from the honest updates.

The cohort: 12 slots, slots 9-11 Byzantine, slot 3 (honest) and slot 11 (Byzantine) not
reporting; slot 3 holds NaN, so a statistic that let it in would be NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from fedjax_sim.ops import attacks

S = 12
BYZ = np.zeros(S, bool)
BYZ[9:] = True
MASK = np.ones(S, bool)
MASK[[3, 11]] = False
HONEST = MASK & ~BYZ  # 8 honest reporting slots


def cohort(seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    a = (scale * rng.normal(size=(S, 3, 2)) + 0.5).astype(np.float32)
    b = (scale * rng.normal(size=(S, 5)) - 0.2).astype(np.float32)
    a[3], b[3] = np.nan, np.nan
    return {"a": jnp.asarray(a), "b": jnp.asarray(b)}


def rows(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).reshape(x.shape[0], -1)
                           for x in jax.tree.leaves(tree)], axis=1)


def attack(fn, x, key=0, byz=BYZ, mask=MASK):
    return jax.jit(fn)(x, jnp.asarray(byz), jax.random.key(key), jnp.asarray(mask))


def honest_stats(x):
    h = rows(x)[HONEST]
    return h, h.mean(axis=0), h.std(axis=0, ddof=1)


def assert_others_untouched(out, x, byz=BYZ):
    np.testing.assert_array_equal(rows(out)[~byz], rows(x)[~byz])


@pytest.mark.parametrize("n,f,s", [(50, 12, 14), (50, 24, 2), (10, 2, 4), (11, 0, 6), (10, 7, 1)])
def test_alie_z_is_baruch_et_al_z_max(n, f, s):
    """s = ⌊n/2 + 1⌋ − f (floored at 1), z = Φ⁻¹((n − s)/n)."""
    assert max(int(np.floor(n / 2 + 1)) - f, 1) == s
    np.testing.assert_allclose(float(attacks.alie_z(n, f)), scipy.stats.norm.ppf((n - s) / n),
                               rtol=1e-5)


def test_a_little_is_enough_sends_mu_minus_z_sigma():
    x = cohort()
    out = attack(attacks.a_little_is_enough(), x)
    _, mu, sd = honest_stats(x)
    n, f = MASK.sum(), (MASK & BYZ).sum()  # 10 report, 2 of them Byzantine
    z = scipy.stats.norm.ppf((n - (n // 2 + 1 - f)) / n)
    for i in np.flatnonzero(BYZ):
        np.testing.assert_allclose(rows(out)[i], mu - z * sd, rtol=1e-5, atol=1e-6)
    assert_others_untouched(out, x)
    fixed = attack(attacks.a_little_is_enough(z=1.5), x)
    np.testing.assert_allclose(rows(fixed)[10], mu - 1.5 * sd, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("eps", [0.1, 100.0])
def test_inner_product_manipulation_sends_minus_epsilon_mu(eps):
    x = cohort(seed=1)
    out = attack(attacks.inner_product_manipulation(epsilon=eps), x)
    _, mu, _ = honest_stats(x)
    np.testing.assert_allclose(rows(out)[BYZ], np.tile(-eps * mu, (3, 1)), rtol=1e-5, atol=1e-6)
    assert_others_untouched(out, x)


def test_sign_flip_negates_each_byzantine_slots_own_update():
    x = cohort(seed=2)
    out = attack(attacks.sign_flip(scale=3.0), x)
    np.testing.assert_allclose(rows(out)[BYZ], -3.0 * rows(x)[BYZ], rtol=1e-6)
    assert_others_untouched(out, x)


def test_gaussian_noise_is_independent_normal_noise_of_scale_sigma():
    x = {"w": jnp.zeros((S, 20000), jnp.float32)}
    out = np.asarray(attack(attacks.gaussian_noise(sigma=2.0), x)["w"], np.float64)
    noise = out[BYZ]
    assert abs(noise.mean()) < 0.05 and abs(noise.std() - 2.0) < 0.05
    assert abs(np.corrcoef(noise[0], noise[1])[0, 1]) < 0.05  # independent across slots
    assert not np.any(out[~BYZ])
    again = np.asarray(attack(attacks.gaussian_noise(sigma=2.0), x)["w"])
    np.testing.assert_array_equal(out, again)


def _gamma(out, mu, p):
    """γ of μ + γ p, read back from a Byzantine row."""
    return float((out - mu) @ p / (p @ p))


def _direction(name, h, mu, sd):
    return {"std": -sd, "sign": -np.sign(mu), "unit": -mu / np.linalg.norm(mu)}[name]


@pytest.mark.parametrize("direction", ["std", "sign", "unit"])
def test_min_max_finds_the_largest_gamma_within_the_honest_diameter(direction):
    x = cohort(seed=3)
    out = rows(attack(attacks.min_max(direction=direction), x))
    h, mu, sd = honest_stats(x)
    p = _direction(direction, h, mu, sd)
    bound = max(np.sum((hi - hj) ** 2) for hi in h for hj in h)

    def worst(g):
        return max(np.sum((mu + g * p - hi) ** 2) for hi in h)

    gamma = _gamma(out[9], mu, p)
    np.testing.assert_allclose(out[9], mu + gamma * p, rtol=1e-5, atol=1e-6)
    assert worst(gamma) <= bound * (1 + 1e-5)           # the constraint holds
    assert worst(gamma * (1 + 1e-3)) > bound            # and γ is maximal within 0.1 %
    # the same γ from the quadratics ‖μ − h_i‖² + 2γ⟨μ − h_i, p⟩ + γ²‖p‖² = bound
    a, b, c = p @ p, (mu - h) @ p, np.sum((mu - h) ** 2, axis=1)
    exact = np.min((-b + np.sqrt(b * b - a * (c - bound))) / a)
    np.testing.assert_allclose(gamma, exact, rtol=1e-4)
    np.testing.assert_array_equal(out[10], out[9])
    assert_others_untouched({"r": jnp.asarray(out)}, {"r": jnp.asarray(rows(x))})


@pytest.mark.parametrize("direction", ["std", "unit"])
def test_min_sum_finds_the_largest_gamma_within_the_honest_sums(direction):
    x = cohort(seed=4)
    out = rows(attack(attacks.min_sum(direction=direction), x))
    h, mu, sd = honest_stats(x)
    p = _direction(direction, h, mu, sd)
    bound = max(sum(np.sum((hi - hj) ** 2) for hj in h) for hi in h)

    def total(g):
        return sum(np.sum((mu + g * p - hi) ** 2) for hi in h)

    gamma = _gamma(out[9], mu, p)
    assert total(gamma) <= bound * (1 + 1e-5)
    assert total(gamma * (1 + 1e-3)) > bound
    # Σ_i ⟨μ − h_i, p⟩ = 0, so Σ_i ‖μ + γp − h_i‖² = Σ_i ‖μ − h_i‖² + nγ²‖p‖²
    exact = np.sqrt((bound - np.sum((mu - h) ** 2)) / (len(h) * (p @ p)))
    np.testing.assert_allclose(gamma, exact, rtol=1e-4)


def test_min_max_search_converges_from_a_far_initial_gamma():
    x = cohort(seed=5)
    near = rows(attack(attacks.min_max(gamma_init=10.0), x))[9]
    far = rows(attack(attacks.min_max(gamma_init=1e-3), x))[9]
    np.testing.assert_allclose(far, near, rtol=1e-4, atol=1e-6)


def test_mimic_copies_the_honest_update_furthest_along_the_top_direction():
    rng = np.random.default_rng(6)
    direction = rng.normal(size=10)
    direction /= np.linalg.norm(direction)
    base = rng.normal(scale=0.05, size=(S, 10)) + np.outer(rng.normal(scale=3.0, size=S),
                                                           direction)
    base[3] = np.nan
    x = {"w": jnp.asarray(base.astype(np.float32))}
    out = np.asarray(attack(attacks.mimic(), x)["w"], np.float64)
    h = np.asarray(x["w"], np.float64)[HONEST]
    top = np.linalg.eigh(np.cov(h.T))[1][:, -1]
    candidates = {int(np.argmax(h @ top)), int(np.argmax(-(h @ top)))}
    copied = [i for i in range(len(h)) if np.array_equal(h[i], out[9])]
    assert copied and copied[0] in candidates
    np.testing.assert_array_equal(out[10], out[9])
    simple = np.asarray(attack(attacks.mimic(target=2), x)["w"], np.float64)
    np.testing.assert_array_equal(simple[9], h[2])  # the third honest reporting slot (slot 2)
    wraps = np.asarray(attack(attacks.mimic(target=10), x)["w"], np.float64)
    np.testing.assert_array_equal(wraps[9], h[10 % 8])


ALL = {
    "sign_flip": attacks.sign_flip(), "gaussian_noise": attacks.gaussian_noise(),
    "alie": attacks.a_little_is_enough(), "ipm": attacks.inner_product_manipulation(),
    "min_max": attacks.min_max(), "min_sum": attacks.min_sum(), "mimic": attacks.mimic(),
}


@pytest.mark.parametrize("name", sorted(ALL))
def test_no_byzantine_slot_means_no_change_bit_for_bit(name):
    x = cohort(seed=7)
    out = attack(ALL[name], x, byz=np.zeros(S, bool))
    for leaf, ref in zip(jax.tree.leaves(out), jax.tree.leaves(x), strict=True):
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(ref))


@pytest.mark.parametrize("name", sorted(ALL))
def test_attacks_ignore_the_slots_that_do_not_report(name):
    out = rows(attack(ALL[name], cohort(seed=8)))
    assert np.all(np.isfinite(out[BYZ]))


def test_flip_labels_maps_y_to_c_minus_1_minus_y_on_byzantine_clients():
    y = np.array([[0, 3, 9], [1, 1, 2], [9, 0, 5]])
    byz = np.array([True, False, True])
    out = np.asarray(attacks.flip_labels(jnp.asarray(y), 10, jnp.asarray(byz)))
    for i in range(3):
        for j in range(3):
            assert out[i, j] == (9 - y[i, j] if byz[i] else y[i, j])


def test_byzantine_clients_are_a_fixed_draw_of_the_key():
    key = jax.random.key(4)
    one = np.asarray(attacks.byzantine_clients(key, 20, 6))
    assert one.sum() == 6
    np.testing.assert_array_equal(one, np.asarray(attacks.byzantine_clients(key, 20, 6)))
    other = np.asarray(attacks.byzantine_clients(jax.random.key(5), 20, 6))
    assert not np.array_equal(one, other)


BAD = [
    (lambda: attacks.min_max(direction="up"), "min_max: direction must be one of"),
    (lambda: attacks.min_sum(iterations=-1), "min_sum: iterations must be an integer >= 0"),
    (lambda: attacks.inner_product_manipulation(epsilon=0), "epsilon must be a positive"),
    (lambda: attacks.gaussian_noise(sigma=-1.0), "sigma must be a positive number"),
    (lambda: attacks.a_little_is_enough(z=-1.0), "z must be >= 0"),
    (lambda: attacks.sign_flip(scale=float("nan")), "scale must be a positive number"),
    (lambda: attacks.mimic(target=-1), "mimic: target must be an integer >= 0"),
    (lambda: attacks.flip_labels(jnp.zeros((2, 3)), 10, jnp.ones(2, bool)),
     "y must hold integer class labels"),
    (lambda: attacks.flip_labels(jnp.zeros((2, 3), int), 1, jnp.ones(2, bool)),
     "num_classes must be an integer >= 2"),
    (lambda: attacks.byzantine_clients(jax.random.key(0), 5, 6), "count must be at most"),
    (lambda: attacks.sign_flip()(jnp.zeros((4, 2)), jnp.ones(3, bool), jax.random.key(0)),
     "byzantine: needs a [4] boolean array"),
    (lambda: attacks.sign_flip()(jnp.zeros((4, 2)), jnp.ones(4, bool), jax.random.key(0),
                                 jnp.ones(4)), "mask: needs a [4] boolean array"),
]


@pytest.mark.parametrize("build,message", BAD, ids=[m for _, m in BAD])
def test_bad_inputs_are_refused_in_one_line(build, message):
    with pytest.raises(ValueError) as err:
        build()
    assert message in str(err.value) and "\n" not in str(err.value)
