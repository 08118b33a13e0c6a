"""The robust aggregators against plain numpy references written here from their papers.

Every reference loops over the reporting slots in float64 (Krum's scores by brute force,
the trimmed mean by sorting each coordinate, Bulyan's recursive selection, bucketing and
NNM by their definitions, centered clipping step by step); the geometric median is
checked against scipy's general-purpose minimiser. The cohort is a two-leaf pytree whose
non-reporting slots hold NaN: a statistic that let one in would be NaN.
"""

from __future__ import annotations

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize

from fedjax_sim.ops import robust

S = 11
MASK = np.array([1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1], bool)  # 9 of 11 report


def cohort(seed=0, s=S, mask=MASK, garbage=np.nan):
    """Updates {"a": [s, 3, 2], "b": [s, 4]} (P = 10), non-reporting slots set to `garbage`."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(s, 3, 2)).astype(np.float32)
    b = rng.normal(size=(s, 4)).astype(np.float32)
    a[~mask], b[~mask] = garbage, garbage
    return {"a": jnp.asarray(a), "b": jnp.asarray(b)}


def rows(tree) -> np.ndarray:
    """Leaves [s, ...] -> [s, P] float64, in the pytree's leaf order."""
    return np.concatenate([np.asarray(x, np.float64).reshape(x.shape[0], -1)
                           for x in jax.tree.leaves(tree)], axis=1)


def flat(tree) -> np.ndarray:
    """Leaves [...] (one update) -> [P] float64."""
    return np.concatenate([np.asarray(x, np.float64).reshape(-1) for x in jax.tree.leaves(tree)])


def run(agg, updates, mask=MASK, key=0, state=None):
    state = agg.init(jax.tree.map(lambda x: x[0], updates)) if state is None else state
    out, state = jax.jit(agg.aggregate)(updates, jnp.asarray(mask), jax.random.key(key), state)
    return out, state


def reporting(updates, mask=MASK):
    return rows(updates)[mask]


# --------------------------------------------------------------------------- references


def np_krum_scores(x, f):
    """Blanchard et al.: Σ of the squared distances to the n − f − 2 nearest others."""
    n = len(x)
    k = min(max(n - f - 2, 1), n - 1)
    scores = []
    for i in range(n):
        d = sorted(float(np.sum((x[i] - x[j]) ** 2)) for j in range(n) if j != i)
        scores.append(sum(d[:k]))
    return np.array(scores)


def np_multi_krum(x, f, m):
    order = np.argsort(np_krum_scores(x, f), kind="stable")
    return x[order[:m]].mean(axis=0)


def np_trimmed_mean(x, t):
    n, p = x.shape
    t = min(t, (n - 1) // 2)
    out = np.empty(p)
    for j in range(p):
        col = sorted(x[:, j])
        out[j] = np.mean(col[t:n - t])
    return out


def np_weiszfeld(x, nu, iterations):
    v = x.mean(axis=0)
    for _ in range(iterations):
        beta = np.array([1.0 / max(nu, np.linalg.norm(v - xi)) for xi in x])
        v = sum(b * xi for b, xi in zip(beta, x, strict=True)) / beta.sum()
    return v


def np_centered_clipping(x, centre, tau, iterations):
    v = centre.copy()
    for _ in range(iterations):
        step = np.zeros_like(v)
        for xi in x:
            d = np.linalg.norm(xi - v)
            step += (xi - v) * min(1.0, tau / d if d > 0 else 1.0)
        v = v + step / len(x)
    return v


def np_bulyan(x, f):
    n = len(x)
    theta, remaining, picked = max(n - 2 * f, 1), list(range(n)), []
    for _ in range(theta):
        scores = np_krum_scores(x[remaining], f)
        i = remaining[int(np.argmin(scores))]
        picked.append(i)
        remaining.remove(i)
    beta = max(theta - 2 * f, 1)
    sel = x[sorted(picked)]
    out = np.empty(x.shape[1])
    for j in range(x.shape[1]):
        col = sel[:, j]
        med = np.median(col)
        nearest = col[np.argsort(np.abs(col - med), kind="stable")[:beta]]
        out[j] = nearest.mean()
    return out


def np_nnm(x, f):
    n = len(x)
    out = np.empty_like(x)
    for i in range(n):
        d = [float(np.sum((x[i] - x[j]) ** 2)) for j in range(n)]
        near = np.argsort(d, kind="stable")[:n - f]
        out[i] = x[near].mean(axis=0)
    return out


# --------------------------------------------------------------------------- tests


def test_mean_is_the_plain_masked_mean_bit_for_bit():
    x = cohort(garbage=5.0)  # finite values in the slots that do not report, as FedAvg has
    w = jnp.asarray(MASK, jnp.float32)
    out, _ = run(robust.mean(), x)
    for name in x:
        expected = jnp.tensordot(w, x[name], axes=1) / jnp.sum(w)
        np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(expected))


@pytest.mark.parametrize("mask", [MASK, np.array([1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 0], bool)],
                         ids=["odd-n", "even-n"])
def test_coordinate_median_over_the_reporting_slots(mask):
    x = cohort(mask=mask)
    out, _ = run(robust.coordinate_median(), x, mask)
    ref = [np.median(col) for col in reporting(x, mask).T]
    np.testing.assert_allclose(flat(out), ref, rtol=1e-6)


@pytest.mark.parametrize("kw,s,mask", [
    ({"f": 2}, S, MASK),
    ({"beta": 0.25}, S, MASK),                      # ⌊0.25 · 9⌋ = 2 per side
    ({"f": 6}, 13, np.r_[MASK, False, False]),      # 9 report: t floored at (9 − 1) // 2
], ids=["f=2", "beta=0.25", "f floored"])
def test_trimmed_mean_matches_sorting_each_coordinate(kw, s, mask):
    x = cohort(s=s, mask=mask)
    out, _ = run(robust.trimmed_mean(**kw), x, mask)
    t = kw["f"] if "f" in kw else int(kw["beta"] * mask.sum())
    np.testing.assert_allclose(flat(out), np_trimmed_mean(reporting(x, mask), t), rtol=1e-6)


@pytest.mark.parametrize("f,m", [(2, 1), (2, 3), (1, None), (3, 2)])
def test_krum_and_multi_krum_match_brute_force_scores(f, m):
    x = cohort(seed=1)
    agg = robust.krum(f=f) if m == 1 else robust.multi_krum(f=f, m=m)
    out, _ = run(agg, x)
    ref_x = reporting(x)
    n = len(ref_x)
    np.testing.assert_allclose(flat(out), np_multi_krum(ref_x, f, n - f if m is None else m),
                               rtol=1e-5, atol=1e-6)


def test_krum_picks_an_honest_update_against_outliers():
    x = cohort(seed=2, garbage=0.0)
    x = jax.tree.map(lambda v: v.at[jnp.array([0, 4])].add(100.0), x)  # two far updates
    out, _ = run(robust.krum(f=2), x)
    picked = flat(out)
    assert any(np.allclose(picked, row) for row in reporting(x)[[1, 2, 4, 5, 6, 7, 8]])


def test_pairwise_distances_are_one_gram_product_of_the_reporting_slots():
    x = cohort(seed=3)
    d2 = np.asarray(robust.pairwise_sq_distances(x, jnp.asarray(MASK)))
    r = rows(x)
    for i in range(S):
        for j in range(S):
            if MASK[i] and MASK[j]:
                np.testing.assert_allclose(d2[i, j], np.sum((r[i] - r[j]) ** 2),
                                           rtol=1e-5, atol=1e-5)
            else:
                assert d2[i, j] == np.inf


def test_geometric_median_minimises_the_sum_of_distances():
    """Against scipy.optimize.minimize on Σ‖v − x_i‖ (7 points in 3 dimensions)."""
    rng = np.random.default_rng(4)
    pts = rng.normal(size=(7, 3))
    pts[0] += 20.0  # an outlier the median ignores and the mean does not
    mask = np.array([1, 1, 1, 1, 1, 1, 1, 0], bool)
    x = jnp.asarray(np.r_[pts, np.full((1, 3), np.nan)].astype(np.float32))
    out, _ = jax.jit(robust.geometric_median(nu=1e-8, iterations=200).aggregate)(
        x, jnp.asarray(mask), jax.random.key(0), ())
    res = scipy.optimize.minimize(lambda v: np.sum(np.linalg.norm(pts - v, axis=1)),
                                  pts.mean(axis=0), method="Nelder-Mead",
                                  options={"xatol": 1e-10, "fatol": 1e-12, "maxiter": 20000})
    np.testing.assert_allclose(np.asarray(out, np.float64), res.x, atol=2e-4)


@pytest.mark.parametrize("nu,iterations", [(1e-6, 3), (0.5, 4)])
def test_geometric_median_is_the_smoothed_weiszfeld_iteration(nu, iterations):
    x = cohort(seed=5)
    out, _ = run(robust.geometric_median(nu=nu, iterations=iterations), x)
    np.testing.assert_allclose(flat(out), np_weiszfeld(reporting(x), nu, iterations),
                               rtol=1e-5, atol=1e-6)


def test_centered_clipping_matches_a_loop_and_keeps_its_centre():
    agg = robust.centered_clipping(tau=0.8, iterations=3)
    x1, x2 = cohort(seed=6), cohort(seed=7)
    out1, state = run(agg, x1)
    ref1 = np_centered_clipping(reporting(x1), np.zeros(10), 0.8, 3)
    np.testing.assert_allclose(flat(out1), ref1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(flat(state.centre), ref1, rtol=1e-5, atol=1e-6)
    out2, state = run(agg, x2, state=state)  # the second round starts from the first's v
    ref2 = np_centered_clipping(reporting(x2), ref1, 0.8, 3)
    np.testing.assert_allclose(flat(out2), ref2, rtol=1e-5, atol=1e-6)
    empty, kept = run(agg, x2, mask=np.zeros(S, bool), state=state)
    assert not np.any(flat(empty))
    np.testing.assert_array_equal(flat(kept.centre), flat(state.centre))


@pytest.mark.parametrize("f,s,mask", [
    (1, S, MASK),                                   # n = 9 ≥ 4f + 3
    (2, S, np.ones(S, bool)),                        # n = 11 = 4f + 3
    (2, S, MASK),                                    # n = 9 < 11: θ, β floored
])
def test_bulyan_matches_recursive_krum_then_the_closest_to_the_median(f, s, mask):
    x = cohort(seed=8, mask=mask)
    out, _ = run(robust.bulyan(f=f), x, mask)
    np.testing.assert_allclose(flat(out), np_bulyan(reporting(x, mask), f), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("b", [1, 2, 4])
def test_bucketing_averages_buckets_of_the_permuted_reporting_slots(b):
    x = cohort(seed=9)
    key = jax.random.key(3)
    buckets, bmask, _ = jax.jit(robust.bucketing(bucket_size=b).apply)(
        x, jnp.asarray(MASK), key, ())
    perm = np.asarray(jax.random.permutation(key, S))
    order = [i for i in perm if MASK[i]]
    r = rows(x)
    ref = [r[order[i:i + b]].mean(axis=0) for i in range(0, len(order), b)]
    nb = -(-S // b)
    assert bmask.shape == (nb,) and int(np.sum(bmask)) == len(ref)
    assert np.all(np.asarray(bmask)[:len(ref)])
    got = np.concatenate([np.asarray(v, np.float64).reshape(nb, -1)
                          for v in jax.tree.leaves(buckets)], axis=1)
    np.testing.assert_allclose(got[:len(ref)], np.array(ref), rtol=1e-5, atol=1e-6)
    # chained: the rule after it sees only the reporting buckets
    out, _ = run(robust.chain(robust.bucketing(bucket_size=b), robust.mean()), x,
                 key=11)
    perm = np.asarray(jax.random.permutation(jax.random.split(jax.random.key(11), 2)[0], S))
    order = [i for i in perm if MASK[i]]
    ref = np.mean([r[order[i:i + b]].mean(axis=0) for i in range(0, len(order), b)], axis=0)
    np.testing.assert_allclose(flat(out), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("f", [0, 2, 4])
def test_nearest_neighbor_mixing_is_its_definition(f):
    x = cohort(seed=10)
    mixed, mask, _ = jax.jit(robust.nearest_neighbor_mixing(f=f).apply)(
        x, jnp.asarray(MASK), jax.random.key(0), ())
    np.testing.assert_array_equal(np.asarray(mask), MASK)
    np.testing.assert_allclose(rows(mixed)[MASK], np_nnm(reporting(x), f), rtol=1e-5,
                               atol=1e-6)
    assert not np.any(rows(mixed)[~MASK])


def test_chain_composes_nnm_then_a_rule_and_carries_the_states():
    x = cohort(seed=11)
    agg = robust.chain(robust.nearest_neighbor_mixing(f=2), robust.centered_clipping(tau=1.0))
    out, state = run(agg, x)
    assert len(state) == 2 and state[0] == ()
    ref = np_centered_clipping(np_nnm(reporting(x), 2), np.zeros(10), 1.0, 1)
    np.testing.assert_allclose(flat(out), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(flat(state[1].centre), ref, rtol=1e-5, atol=1e-6)
    out, _ = run(robust.chain(robust.nearest_neighbor_mixing(f=2), robust.trimmed_mean(f=2)), x)
    np.testing.assert_allclose(flat(out), np_trimmed_mean(np_nnm(reporting(x), 2), 2),
                               rtol=1e-5, atol=1e-6)


RULES = {
    "mean": lambda: robust.mean(),
    "median": lambda: robust.coordinate_median(),
    "trimmed_mean": lambda: robust.trimmed_mean(f=2),
    "krum": lambda: robust.krum(f=2),
    "multi_krum": lambda: robust.multi_krum(f=2),
    "geometric_median": lambda: robust.geometric_median(),
    "centered_clipping": lambda: robust.centered_clipping(tau=1.0),
    "bulyan": lambda: robust.bulyan(f=1),
    "nnm+krum": lambda: robust.chain(robust.nearest_neighbor_mixing(f=2), robust.krum(f=2)),
}


@pytest.mark.parametrize("name", sorted(RULES))
def test_slots_that_do_not_report_change_nothing(name):
    """NaN in the non-reporting slots: the same update as the reporting slots alone."""
    x = cohort(seed=12)
    out, _ = run(RULES[name](), x)
    alone = jax.tree.map(lambda v: v[np.flatnonzero(MASK)], x)
    ref, _ = jax.jit(RULES[name]().aggregate)(
        alone, jnp.ones(int(MASK.sum()), bool), jax.random.key(0),
        RULES[name]().init(jax.tree.map(lambda v: v[0], x)))
    assert np.all(np.isfinite(flat(out)))
    np.testing.assert_allclose(flat(out), flat(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(RULES))
def test_a_cohort_where_nobody_reports_gets_the_zero_update(name):
    out, _ = run(RULES[name](), cohort(seed=13), mask=np.zeros(S, bool))
    np.testing.assert_array_equal(flat(out), np.zeros(10))


def test_a_rule_vmapped_over_cluster_masks_is_the_rule_per_cluster():
    """Per-cluster aggregation: one vmap over [k, s] masks, each the cluster's reporting
    members; a cluster none of whose members reports gets the zero update."""
    x = cohort(seed=14, garbage=0.0)
    clusters = np.array([0, 1, 2, 0, 1, 0, 1, 2, 0, 1, 0])
    masks = np.stack([(clusters == c) & MASK for c in range(3)])
    agg = robust.coordinate_median()
    outs, _ = jax.jit(jax.vmap(agg.aggregate, in_axes=(None, 0, 0, None)))(
        x, jnp.asarray(masks), jax.random.split(jax.random.key(0), 3), ())
    r = rows(x)
    for c in range(3):
        got = np.concatenate([np.asarray(v[c], np.float64).reshape(-1)
                              for v in jax.tree.leaves(outs)])
        # cluster 2's members (slots 2 and 7) do not report: an empty cluster gets 0
        ref = np.median(r[masks[c]], axis=0) if masks[c].any() else np.zeros(10)
        np.testing.assert_allclose(got, ref, rtol=1e-6)


BAD = [
    (lambda: robust.krum(f=3), 8, "krum: needs n > 2f + 2 with f = 3, i.e. at least 9"),
    (lambda: robust.multi_krum(f=1, m=9), 9, "multi_krum: m must be at most s - f = 8"),
    (lambda: robust.multi_krum(f=1, m=0), 9, "multi_krum: m must be an integer >= 1"),
    (lambda: robust.bulyan(f=2), 10, "bulyan: needs n ≥ 4f + 3 with f = 2, i.e. at least 11"),
    (lambda: robust.trimmed_mean(f=5), 10, "trimmed_mean: needs n > 2f with f = 5"),
    (lambda: robust.trimmed_mean(), 10, "give exactly one of f"),
    (lambda: robust.trimmed_mean(f=1, beta=0.1), 10, "give exactly one of f"),
    (lambda: robust.trimmed_mean(beta=0.5), 10, "beta must be in [0, 0.5)"),
    (lambda: robust.nearest_neighbor_mixing(f=5), 10, "nearest_neighbor_mixing: needs n > 2f"),
    (lambda: robust.krum(f=-1), 10, "krum: f must be an integer >= 0"),
    (lambda: robust.krum(f=True), 10, "f must be an integer >= 0"),
    (lambda: robust.geometric_median(nu=0.0), 10, "nu must be a positive number"),
    (lambda: robust.geometric_median(iterations=0), 10, "iterations must be an integer >= 1"),
    (lambda: robust.centered_clipping(tau=-1.0), 10, "tau must be a positive number"),
    (lambda: robust.bucketing(bucket_size=0), 10, "bucket_size must be an integer >= 1"),
    (lambda: robust.chain(robust.mean(), robust.mean()), 10, "every stage before the last"),
    (lambda: robust.chain(robust.bucketing(bucket_size=2)), 10, "one Aggregator last"),
]


@pytest.mark.parametrize("build,s,message", BAD, ids=[m for _, _, m in BAD])
def test_bad_inputs_are_refused_in_one_line(build, s, message):
    with pytest.raises(ValueError) as err:
        agg = build()
        x = jnp.zeros((s, 3))
        apply = agg.aggregate if isinstance(agg, robust.Aggregator) else agg.apply
        apply(x, jnp.ones(s, bool), jax.random.key(0), agg.init(jnp.zeros(3)))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_masks_and_cohorts_are_refused_in_one_line():
    agg = robust.coordinate_median()
    for updates, mask, message in [
        (jnp.zeros((4, 2)), jnp.ones(3, bool), "mask: needs a [4] boolean array"),
        (jnp.zeros((4, 2)), jnp.ones(4), "mask: needs a [4] boolean array"),
        ({"a": jnp.zeros((4, 2)), "b": jnp.zeros((3,))}, jnp.ones(4, bool), "same leading"),
    ]:
        with pytest.raises(ValueError, match=message.replace("[", r"\[")) as err:
            agg.aggregate(updates, mask, jax.random.key(0), ())
        assert "\n" not in str(err.value)


def test_the_examples_in_the_docstrings_run():
    result = doctest.testmod(robust, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                             report=False)
    assert result.attempted >= 3 and result.failed == 0
