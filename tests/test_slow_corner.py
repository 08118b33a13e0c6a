"""The kernels behind a comparison's slow corner: k-means as GEMMs, local models on their tests.

Each against a plain loop written here: Lloyd's algorithm in float64 numpy with
exact distances Σ_d (x_d − c_d)², and the official local-model accuracy (each
local model on every test client of its cluster) as a Python loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.data import copies_axes
from fedjax_sim.experiments import ifca_images as E
from fedjax_sim.experiments.ifca_images import DIGITS, PRESETS
from fedjax_sim.experiments.settings import resolve
from fedjax_sim.ops import kmeans


def np_lloyd(points, weights, centers, iters):
    """Lloyd from `centers`: `iters` (assign, weighted mean) steps, then the final labels."""
    points, centers = points.astype(np.float64), centers.astype(np.float64)

    def assign(c):
        d2 = np.array([[np.sum((x - cj) ** 2) for cj in c] for x in points])
        return d2.argmin(1), d2.min(1)

    for _ in range(iters):
        labels, _ = assign(centers)
        for j in range(len(centers)):
            w = weights * (labels == j)
            if w.sum() > 0:  # an empty cluster keeps its center
                centers[j] = (w[:, None] * points).sum(0) / w.sum()
    labels, d2 = assign(centers)
    return labels, float(np.sum(weights * d2))


def initial_centers(key, points, weights, k, restarts):
    """kmeans' initial centers: restart r draws k distinct points of positive weight."""
    probs = (weights > 0) / max((weights > 0).sum(), 1)
    return [np.asarray(points)[np.asarray(jax.random.choice(kk, len(points), (k,), replace=False,
                                                            p=jnp.asarray(probs)))]
            for kk in jax.random.split(key, restarts)]


def local_models_like(rng, m, p, k, offset=3.0):
    """m long vectors sharing a large common part (local models from one init), k groups."""
    truth = np.arange(m) % k
    shared = offset + rng.normal(size=p)
    directions = rng.normal(size=(k, p)) * 0.05
    points = shared + directions[truth] + 0.02 * rng.normal(size=(m, p))
    return points.astype(np.float32), truth


@pytest.mark.parametrize("iters", [1, 2, 3, 50])
@pytest.mark.parametrize("restarts", [1, 3])
def test_kmeans_equals_float64_lloyd_loop(iters, restarts, ref):
    """Labels and inertia equal exact-distance Lloyd from the same initial centers, for any
    number of iterations (the early stop at a fixed point changes nothing); a zero-weight
    point still gets its nearest center."""
    rng = np.random.default_rng(iters + 10 * restarts)
    points, truth = local_models_like(rng, 24, 3000, 3)
    weights = np.ones(24, np.float32)
    weights[5] = 0.0
    key = jax.random.key(iters)
    labels, inertia = kmeans(key, jnp.asarray(points), 3, iters=iters, restarts=restarts,
                             weights=jnp.asarray(weights))
    runs = [np_lloyd(points, weights, c, iters)
            for c in initial_centers(key, points, weights, 3, restarts)]
    want_labels, want_inertia = min(runs, key=lambda r: r[1])
    np.testing.assert_array_equal(np.asarray(labels), want_labels)
    np.testing.assert_allclose(float(inertia), want_inertia, rtol=1e-4)
    if iters == 50:
        assert ref.perm_accuracy(labels, truth, 3) == 1.0


def test_kmeans_under_vmap_matches_each_seed():
    """One-shot runs k-means vmapped over seeds: each seed as alone."""
    rng = np.random.default_rng(7)
    stacks = [local_models_like(rng, 12, 500, 2)[0] for _ in range(3)]
    keys = jax.random.split(jax.random.key(1), 3)
    batched, _ = jax.vmap(lambda kk, x: kmeans(kk, x, 2, restarts=2))(keys, jnp.asarray(stacks))
    for s in range(3):
        alone, _ = kmeans(keys[s], jnp.asarray(stacks[s]), 2, restarts=2)
        np.testing.assert_array_equal(np.asarray(batched[s]), np.asarray(alone))


def _digits_problem(seeds=2, n=100):
    preset = next(p for p in PRESETS if p.name == "ifca-rotated-digits")
    s = resolve(DIGITS.declared, preset.defaults,
                {"seeds": seeds, "n": n, "hidden": 8, "test_per_class": 30})
    return s, DIGITS.problem(s)


@pytest.mark.parametrize("n, rows_per_product, short", [
    (100, E.metrics.ROWS_PER_PRODUCT, False),  # 3 test clients of 100 rows a cluster: 1 a step
    (70, E.metrics.ROWS_PER_PRODUCT, True),  # 4 of 70 (2 a step, 140 rows), some rows padding
    (70, 1000, False),  # all 4 test clients of a cluster in one product
])
def test_local_official_accuracy_equals_loop_over_test_clients(monkeypatch, n, rows_per_product,
                                                               short):
    """The local baseline's test_accuracy: Σ correct / Σ n of each local model over every test
    client of its cluster, averaged over models; written as a loop over (model, test client),
    whatever number of test clients one product takes, and with test clients shorter than
    their padded length."""
    monkeypatch.setattr(E.metrics, "ROWS_PER_PRODUCT", rows_per_product)
    s, problem = _digits_problem(n=n)
    model = problem["model"][False]
    train, test = problem["train"], problem["test"]
    if short:  # every third test client keeps only its first n - 13 - t rows
        cut = np.asarray(test.num_examples).copy()
        cut[:, ::3] -= 13 + np.arange(cut[:, ::3].shape[1])
        test = test.replace(num_examples=jnp.asarray(cut))
    seeds, m = train.num_examples.shape
    params = jax.vmap(jax.vmap(model.init))(
        jax.random.split(jax.random.key(0), seeds * m).reshape(seeds, m))
    k, per_test = s["k"], problem["test_clients"] // s["k"]
    official = E.local_on_cluster_tests(model, problem["test_of_client"], per_test, k)
    correct, weight = jax.jit(jax.vmap(official, in_axes=(0, copies_axes(test))))(params, test)
    guesses = np.asarray(jax.jit(jax.vmap(jax.vmap(jax.vmap(
        lambda p, x: model.apply(p, x).argmax(-1), in_axes=(None, 0)), in_axes=(0, None))))(
        params, test.x))  # [seeds, m, test clients, n_max]: every model on every test client
    clusters, test_clusters = np.asarray(train.cluster), np.asarray(test.cluster)
    sizes, labels = np.asarray(test.num_examples), np.asarray(test.y)
    correct, weight = np.asarray(correct), np.asarray(weight)
    for seed in range(seeds):
        for i in range(m):
            cluster = clusters[seed, i]
            hits = total = 0
            for t in range(problem["test_clients"]):
                if test_clusters[seed, t] != cluster:
                    continue
                n = sizes[seed, t]
                hits += int(np.sum(guesses[seed, i, t, :n] == labels[seed, t, :n]))
                total += n
            np.testing.assert_allclose(float(correct[seed, i]), hits, atol=1e-3)
            assert float(weight[seed, i]) == total


def test_local_official_accuracy_refuses_a_layout_it_cannot_group():
    with pytest.raises(ValueError, match="cluster-major"):
        E.local_on_cluster_tests(None, np.array([0, 2, 1, 3]), per_test=2, k=2)


def test_kmeans_of_a_pytree_equals_kmeans_of_its_concatenation():
    """One-shot passes the stacked models as they are: the same labels as the flattened rows."""
    rng = np.random.default_rng(3)
    flat, _ = local_models_like(rng, 20, 70, 3)
    tree = {"w": jnp.asarray(flat[:, :60].reshape(20, 6, 10)), "b": jnp.asarray(flat[:, 60:])}
    # tree leaves in key order ("b", "w"): the same point up to a permutation of coordinates
    labels_tree, inertia_tree = kmeans(jax.random.key(2), tree, 3, restarts=4)
    labels_flat, inertia_flat = kmeans(jax.random.key(2), jnp.asarray(flat), 3, restarts=4)
    np.testing.assert_array_equal(np.asarray(labels_tree), np.asarray(labels_flat))
    np.testing.assert_allclose(float(inertia_tree), float(inertia_flat), rtol=1e-5)


@pytest.mark.parametrize("m,batch_bytes", [(7, 1), (7, 104 * 3), (8, 104 * 4), (8, 2**30)])
def test_init_per_client_equals_each_clients_own_init(m, batch_bytes):
    """Local models' own inits drawn in batches (of 1; of 3, the last shifted back; of 4;
    all at once) are each client's model.init(key_i), also under a vmap over seeds."""
    from fedjax_sim.algorithms.local import init_per_client
    from fedjax_sim.models import mlp_classifier

    model = mlp_classifier((5,), [3], 2)  # 5·3 + 3 + 3·2 + 2 = 26 float32: 104 bytes
    keys = jax.random.split(jax.random.key(4), m)
    seeds = jnp.stack([keys, jax.random.split(jax.random.key(5), m)])
    both = jax.jit(jax.vmap(lambda k: init_per_client(model, k, batch_bytes)))(seeds)
    for s in range(2):
        for i in range(m):
            want = model.init(seeds[s, i])
            jax.tree.map(lambda a, w, s=s, i=i: np.testing.assert_array_equal(
                np.asarray(a[s, i]), np.asarray(w)), both, want)
