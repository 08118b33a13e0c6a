"""Partitioners (fedjax_sim.data.partition): sizes, label histograms, clusters, seeds, refusals.

References are plain per-client Python loops written here from Flower Datasets'
documented semantics, not calls back into the module.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedjax_sim.data import FederatedData
from fedjax_sim.data import partition as P

NUM_CLASSES = 10


def _labels(n=2000, seed=0, k=NUM_CLASSES):
    return np.random.default_rng(seed).integers(0, k, n)


def _assert_disjoint(parts, n, cover=True):
    flat = np.concatenate(parts)
    assert flat.dtype == np.int64
    assert np.unique(flat).size == flat.size, "an example went to two clients"
    assert flat.min() >= 0 and flat.max() < n
    if cover:
        assert flat.size == n


# ---------------------------------------------------------------------------- IID


def test_iid_sizes_and_contiguous_order():
    parts = P.iid_partition(103, 10, shuffle=False)
    assert [p.size for p in parts] == [11, 11, 11] + [10] * 7
    start = 0
    for p in parts:  # Dataset.shard(contiguous=True): consecutive slices
        np.testing.assert_array_equal(p, np.arange(start, start + p.size))
        start += p.size
    shuffled = P.iid_partition(103, 10, seed=3)
    _assert_disjoint(shuffled, 103)
    assert [p.size for p in shuffled] == [p.size for p in parts]


# ---------------------------------------------------------------------------- Dirichlet


def _flower_dirichlet_reference(labels, m, alpha, seed, self_balancing):
    """One Dirichlet draw, Flower's algorithm written out (dataset order, no shuffles)."""
    rng = np.random.default_rng(seed)
    parts = [[] for _ in range(m)]
    avg = labels.size / m
    for c in np.unique(labels):
        members = np.nonzero(labels == c)[0]
        p = rng.dirichlet(np.full(m, alpha))
        if self_balancing:
            for j in range(m):
                if len(parts[j]) > avg:
                    p[j] = 0.0
            p = p / p.sum()
        cum = 0.0
        start = 0
        for j in range(m):
            cum += p[j]
            end = members.size if j == m - 1 else int(cum * members.size)
            parts[j].extend(members[start:end].tolist())
            start = end
    return parts


@pytest.mark.parametrize("self_balancing", [False, True])
def test_dirichlet_matches_flower_algorithm(self_balancing):
    labels = _labels(600)
    got = P.dirichlet_partition(labels, 7, 0.5, min_partition_size=0, shuffle=False, seed=5,
                                self_balancing=self_balancing)
    want = _flower_dirichlet_reference(labels, 7, 0.5, 5, self_balancing)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, np.asarray(w, np.int64))
    _assert_disjoint(got, labels.size)


def test_dirichlet_large_alpha_tends_to_iid_small_alpha_skews():
    labels = _labels(20000)
    m = 10
    overall = np.bincount(labels, minlength=NUM_CLASSES) / labels.size
    iid = P.dirichlet_partition(labels, m, 1e5, seed=1)
    _assert_disjoint(iid, labels.size)
    for p in iid:
        hist = np.bincount(labels[p], minlength=NUM_CLASSES) / p.size
        # Dir(1e5) proportions have std ≈ 1e-3; floor cuts move ≤ 1 example per class.
        np.testing.assert_allclose(hist, overall, atol=0.01)
        assert abs(p.size - labels.size / m) <= 0.02 * labels.size / m
    skewed = P.dirichlet_partition(labels, m, 0.05, min_partition_size=1, seed=1)
    top = [np.bincount(labels[p], minlength=NUM_CLASSES).max() / p.size for p in skewed]
    assert np.mean(top) > 0.5  # IID would give ≈ 0.1


def test_dirichlet_min_partition_size_and_balancing():
    labels = _labels(1000)
    parts = P.dirichlet_partition(labels, 20, 0.3, min_partition_size=10, seed=0,
                                  max_attempts=50)
    assert min(p.size for p in parts) >= 10
    balanced = P.dirichlet_partition(labels, 20, 0.3, min_partition_size=0, seed=0,
                                     self_balancing=True)
    # A client stops receiving once over N/m, so it overshoots by at most one class.
    biggest_class = np.bincount(labels).max()
    assert max(p.size for p in balanced) <= 1000 / 20 + biggest_class


def test_dirichlet_retries_then_gives_up():
    labels = _labels(200)
    with pytest.raises(ValueError, match=r"max_attempts=2 .*smallest client had"):
        P.dirichlet_partition(labels, 10, 0.01, min_partition_size=20, max_attempts=2)


def test_dirichlet_per_client_alpha():
    labels = _labels(500)
    parts = P.dirichlet_partition(labels, 3, [1.0, 2.0, 3.0], min_partition_size=0)
    _assert_disjoint(parts, 500)


# ---------------------------------------------------------------------------- pathological


@pytest.mark.parametrize("mode", P.CLASS_ASSIGNMENT_MODES)
def test_pathological_exactly_c_classes(mode):
    labels = _labels(3000)
    m, c = 25, 3
    parts = P.pathological_partition(labels, m, c, class_assignment_mode=mode, seed=2)
    _assert_disjoint(parts, labels.size, cover=False)
    held = [set(np.unique(labels[p]).tolist()) for p in parts]
    assert all(len(h) == c for h in held)
    for j, h in enumerate(held):
        if mode == "deterministic":
            assert h == {(j + i) % NUM_CLASSES for i in range(c)}
        if mode == "first-deterministic":
            assert j % NUM_CLASSES in h
    # Each class is cut into near-equal parts among the clients holding it.
    for k in range(NUM_CLASSES):
        counts = [int(np.sum(labels[p] == k)) for p, h in zip(parts, held, strict=True)
                  if k in h]
        if counts:
            assert max(counts) - min(counts) <= 1
            assert sum(counts) == int(np.sum(labels == k))


def test_pathological_warns_for_unused_classes():
    labels = _labels(500)
    with pytest.warns(UserWarning, match="held by no client"):
        parts = P.pathological_partition(labels, 2, 2, class_assignment_mode="deterministic")
    assert {int(v) for p in parts for v in np.unique(labels[p])} == {0, 1, 2}


# ---------------------------------------------------------------------------- shards


def test_shards_fixed_count_and_size():
    labels = np.repeat(np.arange(NUM_CLASSES), 100)  # class counts are multiples of 50
    parts = P.shard_partition(labels, 10, num_shards_per_partition=2, shard_size=50, seed=4)
    assert [p.size for p in parts] == [100] * 10
    _assert_disjoint(parts, 1000)
    assert all(np.unique(labels[p]).size <= 2 for p in parts)  # a shard holds one class
    # Every client's examples are two whole label-sorted shards of 50.
    for p in parts:
        vals, counts = np.unique(labels[p], return_counts=True)
        assert sorted(counts.tolist()) in ([50, 50], [100])


def test_shards_computed_size_and_flower_examples():
    labels = _labels(600)
    parts = P.shard_partition(labels, 10, num_shards_per_partition=3)
    assert [p.size for p in parts] == [3 * 20] * 10  # shard_size = floor(600 / 30)
    # Flower's docstring example 2, scaled down 100×: 60 shards over 9 clients.
    parts = P.shard_partition(labels, 9, shard_size=10)
    assert [p.size for p in parts] == [70] * 6 + [60] * 3
    # Example 3: keep_incomplete_shard uses every example; one shard is the short rest.
    labels = _labels(6000)
    parts = P.shard_partition(labels, 10, shard_size=99, keep_incomplete_shard=True)
    _assert_disjoint(parts, 6000)
    shards = sorted(p.size for p in parts)
    rest = 6000 - 60 * 99
    assert sum(1 for s in shards if s % 99 == rest) == 1
    assert sum(math.ceil(s / 99) for s in shards) == 61


# ---------------------------------------------------------------------------- size skew


def test_size_partition_exact_sizes():
    parts = P.size_partition(100, [10, 30, 60], seed=0)
    assert [p.size for p in parts] == [10, 30, 60]
    _assert_disjoint(parts, 100)
    with pytest.warns(UserWarning, match="left out"):
        parts = P.size_partition(100, [5, 5], shuffle=False)
    np.testing.assert_array_equal(parts[1], np.arange(5, 10))


@pytest.mark.parametrize(
    "fn, f",
    [(P.linear_partition, lambda j: j), (P.square_partition, lambda j: j * j),
     (P.exponential_partition, math.exp)],
)
def test_quantity_skew_sizes_and_ordering(fn, f):
    n, m = 1000, 6
    parts = fn(n, m, seed=0)
    _assert_disjoint(parts, n)
    units = [f(j) for j in range(1, m + 1)]
    want = [int(n * u / sum(units)) for u in units]
    want[-1] += n - sum(want)  # Flower gives the rounding remainder to the last client
    assert [p.size for p in parts] == want
    assert all(a <= b for a, b in zip(want, want[1:], strict=False))


# ---------------------------------------------------------------------------- natural ids


def test_natural_id_groups():
    ids = np.array(["w3", "w1", "w3", "w2", "w1", "w3"])
    parts, natural = P.natural_id_partition(ids)
    assert natural.tolist() == ["w1", "w2", "w3"]
    for p, w in zip(parts, natural, strict=True):
        np.testing.assert_array_equal(p, np.nonzero(ids == w)[0])
    parts, natural = P.natural_id_partition(np.array([7, 7, 2]))
    assert natural.tolist() == [2, 7] and [p.tolist() for p in parts] == [[2], [0, 1]]


# ---------------------------------------------------------------------------- determinism


RANDOMIZED = {
    "iid": lambda y, s: P.iid_partition(y.size, 8, seed=s),
    "dirichlet": lambda y, s: P.dirichlet_partition(y, 8, 0.5, min_partition_size=1, seed=s),
    "pathological": lambda y, s: P.pathological_partition(
        y, 10, 2, class_assignment_mode="first-deterministic", seed=s),
    "shard": lambda y, s: P.shard_partition(y, 8, num_shards_per_partition=2, seed=s),
    "size": lambda y, s: P.size_partition(y.size, [100, 300, 400], seed=s),
    "linear": lambda y, s: P.linear_partition(y.size, 8, seed=s),
    "replicated": lambda y, s: P.replicated_clusters(y.size, 2, 4, seed=s)[0],
}


@pytest.mark.parametrize("name", sorted(RANDOMIZED))
def test_deterministic_per_seed(name):
    labels = _labels(800)
    a, b, c = (RANDOMIZED[name](labels, s) for s in (11, 11, 12))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


# ---------------------------------------------------------------------------- refusals


BAD = [
    (lambda y: P.iid_partition(5, 6), "num_clients=6 exceeds the number of examples"),
    (lambda y: P.iid_partition(5, 0), "num_clients must be an integer >= 1"),
    (lambda y: P.dirichlet_partition(y, 4, 0.0), "alpha must be finite and > 0"),
    (lambda y: P.dirichlet_partition(y, 4, -1.0), "alpha must be finite and > 0"),
    (lambda y: P.dirichlet_partition(y, 4, [1.0, 2.0]), "num_clients=4 values"),
    (lambda y: P.dirichlet_partition(y, 4, 1.0, min_partition_size=60),
     "min_partition_size=60 cannot hold"),
    (lambda y: P.dirichlet_partition(y, 201, 1.0), "num_clients=201 exceeds"),
    (lambda y: P.pathological_partition(y, 4, 11), "num_classes_per_partition=11 exceeds the 10"),
    (lambda y: P.pathological_partition(y, 4, 2, class_assignment_mode="cyclic"),
     "class_assignment_mode must be one of"),
    (lambda y: P.pathological_partition(np.r_[np.zeros(150), [1, 2]].astype(int), 3, 3),
     "has 1 examples but 3 clients need one"),
    (lambda y: P.shard_partition(y, 4), "needs num_shards_per_partition or shard_size"),
    (lambda y: P.shard_partition(y, 10, num_shards_per_partition=30), "exceed the 200 examples"),
    (lambda y: P.shard_partition(y, 4, num_shards_per_partition=2, shard_size=30),
     "240 examples are needed and there are 200"),
    (lambda y: P.shard_partition(y, 4, shard_size=70), "some client would be empty"),
    (lambda y: P.size_partition(200, [150, 100]), "sum to 250, more than the 200"),
    (lambda y: P.size_partition(200, [0, 100]), "must all be >= 1"),
    (lambda y: P.exponential_partition(200, 40), "leaves client 0 with 0"),
    (lambda y: P.exponential_partition(10**6, 1000), "overflows"),
    (lambda y: P.assign_clusters(3, 4), "num_clusters=4 exceeds num_clients=3"),
    (lambda y: P.default_quarter_turns(3), "num_clusters=3 has no evenly spaced"),
    (lambda y: P.rotation_clusters(np.zeros((4, 2, 3)), [np.arange(4)], num_clusters=1,
                                   quarter_turns=(1,)), "non-square"),
    (lambda y: P.rotation_clusters(np.zeros((4, 2, 2)), [np.arange(4)] * 2,
                                   quarter_turns=(0, 1)), r"one rotation per cluster \(num_cl"),
    (lambda y: P.to_federated(np.zeros((4, 2)), np.zeros(4), [np.array([0, 4])]),
     r"fall outside \[0, 4\)"),
    (lambda y: P.to_federated(np.zeros((4, 2)), np.zeros(4), [np.arange(2)], [1],
                              transforms=[lambda x: x]), r"cluster ids must lie in \[0, 1\)"),
]


@pytest.mark.parametrize("call, message", BAD, ids=[m for _, m in BAD])
def test_bad_requests_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call(_labels(200))


# ---------------------------------------------------------------------------- clusters


def test_assign_clusters():
    np.testing.assert_array_equal(P.assign_clusters(6, 3), [0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(P.assign_clusters(5, 2), [0, 0, 0, 1, 1])
    rand = P.assign_clusters(40, 4, mode="random", seed=1)
    assert np.bincount(rand).tolist() == [10] * 4
    assert not np.array_equal(rand, P.assign_clusters(40, 4))


def test_replicated_rotated_clusters_to_federated():
    rng = np.random.default_rng(0)
    n, k, per = 60, 4, 3
    images = rng.integers(0, 256, (n, 5, 5), dtype=np.uint8)
    labels = rng.integers(0, 10, n)
    idx, cluster = P.replicated_clusters(n, k, per, seed=3)
    np.testing.assert_array_equal(cluster, np.repeat(np.arange(k), per))  # cluster-major
    for c in range(k):  # every image once in every cluster
        flat = np.concatenate(idx[c * per:(c + 1) * per])
        np.testing.assert_array_equal(np.sort(flat), np.arange(n))
    test_idx, _ = P.replicated_clusters(n, k, per, shuffle=False)  # test clients: in order
    assert all(np.array_equal(t, np.arange(20 * (i % per), 20 * (i % per) + 20))
               for i, t in enumerate(test_idx))
    assert P.default_quarter_turns(4) == (0, 1, 2, 3)
    data = P.to_federated(images, labels, idx, cluster,
                          transforms=P.rotations(P.default_quarter_turns(k)))
    assert isinstance(data, FederatedData)
    assert data.x.shape == (k * per, n // per, 5, 5)
    np.testing.assert_array_equal(data.cluster, cluster)
    rotated, cl = P.rotation_clusters(images, idx, num_clusters=k, cluster=cluster)
    np.testing.assert_array_equal(cl, cluster)
    for i, ix in enumerate(idx):  # per-client loop: rot90 counter-clockwise q_c times
        want = np.stack([np.rot90(images[j], cluster[i]) for j in ix])
        np.testing.assert_array_equal(np.asarray(data.x[i]), want)
        np.testing.assert_array_equal(rotated[i], want)
        np.testing.assert_array_equal(np.asarray(data.y[i]), labels[ix])


def test_rotation_clusters_default_two_clusters_and_rgb():
    images = np.random.default_rng(1).integers(0, 256, (12, 4, 6, 3), dtype=np.uint8)
    parts = P.iid_partition(12, 4, seed=0)
    rotated, cluster = P.rotation_clusters(images, parts, num_clusters=2)  # 0° and 180°
    np.testing.assert_array_equal(cluster, [0, 0, 1, 1])
    for i, ix in enumerate(parts):
        want = images[ix] if cluster[i] == 0 else images[ix][:, ::-1, ::-1]
        np.testing.assert_array_equal(rotated[i], want)


def test_feature_shift_clusters_random_mode():
    x = np.arange(24, dtype=np.float32).reshape(12, 2)
    parts = P.iid_partition(12, 6, shuffle=False)
    shifts = [lambda b: b, lambda b: b + 100.0, lambda b: -b]
    out, cluster = P.feature_shift_clusters(x, parts, shifts, mode="random", seed=2)
    assert sorted(np.bincount(cluster).tolist()) == [2, 2, 2]
    for i, ix in enumerate(parts):
        np.testing.assert_array_equal(out[i], shifts[cluster[i]](x[ix]))


def test_to_federated_ragged_equals_from_clients():
    labels = _labels(300)
    x = np.random.default_rng(2).normal(size=(300, 3)).astype(np.float32)
    parts = P.dirichlet_partition(labels, 6, 0.3, min_partition_size=0, seed=0)
    parts = parts + [np.zeros(0, np.int64)]  # and an empty client
    got = P.to_federated({"f": x}, labels, parts)
    want = FederatedData.from_clients([x[p] for p in parts], [labels[p] for p in parts])
    np.testing.assert_array_equal(got.num_examples, want.num_examples)
    np.testing.assert_array_equal(got.x["f"], want.x)
    np.testing.assert_array_equal(got.y, want.y)
    np.testing.assert_array_equal(got.cluster, np.full(7, -1))
