"""Clients that are not stored copies: views into one shared dataset, and generated clients.

A round over views (index rows + a rotation into images held once: rotated
digits, rotated CIFAR-shaped images, hetero's partitioned digits) must give
exactly the numbers of the same round over stored copies, chunked or not, on
1 and 4 (forced CPU) devices (on 4, one evaluation row may differ by 1 ulp of
one client's loss, see the test); generated synthetic clients must equal
`linear_mixture`'s, and a chunked round over them must hold O(chunk) data.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from federations import eight_clients, evaluate_as_run, subprocess_env

from fedjax_sim import ALGORITHMS, cli, logs, memory, simulate
from fedjax_sim.algorithms import sgd, with_restarts, with_seeds
from fedjax_sim.data import (
    ClientViews,
    FederatedData,
    copies_axes,
    copy_at,
    generated_mixture,
    linear_mixture,
    stack_views,
    synthetic,
)
from fedjax_sim.data.images import (
    digits,
    fixed_split,
    rotate,
    rotated_clusters,
    rotated_views,
    rotation_maps,
)
from fedjax_sim.execution import Execution, planned
from fedjax_sim.experiments import ifca_synthetic
from fedjax_sim.experiments.ifca_synthetic.common import build_algorithm, metrics_fn
from fedjax_sim.models.core import from_flax, linear_regression
from fedjax_sim.models.zoo import mlp_classifier
from fedjax_sim.ops.chunking import mapped_chunk
from fedjax_sim.ops.cohort import cohort_sums, sample_cohort, take

FIELDS = ("x", "y", "num_examples", "cluster")


def ragged_linear():
    """8 linear clients of 1–6 rows and one of 0 (two clusters, d = 5), as stored copies."""
    return eight_clients(counts=(1, 6, 0, 6, 2, 5, 6, 3))[0]


def views_of(copies: FederatedData, seed: int = 0) -> ClientViews:
    """The same clients as views: every real row once in a shuffled shared base."""
    x, y = np.asarray(copies.x), np.asarray(copies.y)
    counts = np.asarray(copies.num_examples)
    real = np.arange(x.shape[1])[None, :] < counts[:, None]
    where = np.argwhere(real)  # (client, row) of each real row
    order = np.random.default_rng(seed).permutation(len(where))
    base_x, base_y = x[real][order], y[real][order]
    rows = np.zeros(real.shape, np.int64)
    rows[where[order, 0], where[order, 1]] = np.arange(len(where))
    return ClientViews.from_indices(base_x, base_y, rows, counts, np.asarray(copies.cluster))


def rotated_digits(**kw):
    """(copies, views) of rotated digits: 4 clusters of 2 clients of 10 images, 8×8."""
    images, labels = digits()
    train, test = fixed_split(labels, 20)
    args = (images[train], labels[train], images[test], labels[test])
    kw = {"n": 10, "seed": 1, "k": 4, "clients_per_cluster": 2, **kw}
    return rotated_clusters(*args, **kw), rotated_views(*args, **kw)


def rotated_cifar_shaped():
    """(copies, views) of k=2 rotated (0°/180°, as IFCA's CIFAR) random 32×32×3 images:
    2 clients of 5 images per cluster."""
    rng = np.random.default_rng(2)
    images = rng.random((15, 32, 32, 3), dtype=np.float32)
    labels = rng.integers(0, 10, 15).astype(np.int32)
    kw = {"n": 5, "seed": 1, "k": 2, "clients_per_cluster": 2}
    args = (images[:10], labels[:10], images[10:], labels[10:])
    return rotated_clusters(*args, **kw).train, rotated_views(*args, **kw).train


def seeded_digits():
    """(copies, views) of rotated digits for seeds 1 and 2: copies stacked per seed, views
    stacked on one shared base (`stack_views`)."""
    from fedjax_sim.experiments.base import stack_seeds

    pairs = [rotated_digits(seed=seed) for seed in (1, 2)]
    return (stack_seeds([c.train for c, _ in pairs]),
            stack_views([v.train for _, v in pairs]))


def partitioned_digits():
    """(copies, views) of hetero's clients: Dirichlet(0.1) digits, 2 rotation clusters of 4
    ragged clients, the last of each with noisy labels (rows appended to the views' base)."""
    from fedjax_sim.experiments import get_preset, hetero, resolve_settings

    sizes = {"seeds": 1, "partitioner": "dirichlet", "alpha": 0.1, "num_clients": 8,
             "rotations": 2, "noisy_clients": 1, "test_fraction": 0.9}
    out = []
    for clients in ("copies", "views"):
        s = resolve_settings(get_preset("hetero-digits"), {**sizes, "clients": clients},
                             "compare")
        out.append(copy_at(hetero.build_problem(s)["train"], 0))
    return tuple(out)


def tiny_conv():
    """A 3×3 convolution, 4 channels, then a dense layer: [n, 8, 8] digits -> 10 logits."""
    import flax.linen as nn

    class Conv(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(4, (3, 3))(x[..., None]))
            return nn.Dense(10)(x.reshape(x.shape[0], -1))

    return from_flax(Conv(), jnp.zeros((1, 8, 8)))


# (name, data, model, training, algorithm settings, client chunk, devices); every case runs
# over copies and over views (planned with the chunk), on the device counts it names.
# Between them the cases cover every data kind (plain ragged views with an empty client,
# rotated digits, rotated CIFAR-shaped images with channels, a Dirichlet partition with
# appended noisy rows, two seeds on one base), IFCA's
# option I and II, FedAvg, an MLP and a convolution (a gather fused into a dot or a conv
# must not change the result), whole cohorts and chunks (even, uneven, with partial
# participation): chunked and unchunked on both 1 and 4 devices. On 4 devices, every data
# kind a mesh places differently (plain and rotated views, the partition's, the seeds'
# stacked rows over one replicated base) in a chunked case, and an unchunked one. Each case
# compiles its own programs (the most of this test's time), so a case that adds nothing the
# others lack is not here.
LOCAL = sgd(0.1, steps=2, batch_size=5)
ROUND_CASES = [
    ("ifca", "linear", "linear", sgd(0.1), {"num_clusters": 2}, None, (1, 4)),
    ("ifca", "linear", "linear", sgd(0.1), {"num_clusters": 2}, 3, (1,)),
    ("ifca", "linear", "linear", sgd(0.1), {"num_clusters": 2, "participation": 0.5}, 4,
     (1, 4)),
    ("ifca", "digits", "mlp", LOCAL, {"num_clusters": 4, "option": "model",
                                      "participation": 0.5}, 3, (1, 4)),
    ("fedavg", "digits", "conv", LOCAL, {}, None, (1,)),
    ("ifca", "cifar", "mlp3", LOCAL, {"num_clusters": 2, "option": "model"}, None, (1,)),
    ("fedavg", "partition", "mlp", LOCAL, {"participation": 0.5}, 4, (1, 4)),
    # Two seeds (`with_seeds`): copies stacked per seed vs views of one shared base.
    ("ifca", "seeds", "mlp", LOCAL, {"num_clusters": 4, "option": "model"}, 4, (1, 4)),
]


def _largest_gap(a, b) -> float:
    """The largest |a - b| / max(|a|, 1e-30) over two lists of arrays (NaN == NaN)."""
    gaps = [0.0]
    for x, y in zip(a, b, strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        same = (x == y) | (np.isnan(x) & np.isnan(y))
        if not np.all(same):
            gaps.append(float(np.max(np.abs(x - y)[~same] / np.maximum(np.abs(x[~same]), 1e-30))))
    return max(gaps)


def compare_rounds(devices: int) -> dict[str, float]:
    """Runs every case of `devices` (ROUND_CASES) over copies and views on that many devices.

    Returns:
      {what: largest relative difference} for every state, evaluation and
      history that is not bit-identical (empty when all are), and
      {"placement": 1.0} when the views' base is not replicated by type.
    """
    from fedjax_sim.parallel import input_shardings, make_mesh

    mesh = None if devices == 1 else make_mesh(devices)
    linear = ragged_linear()
    copies, views = rotated_digits()
    built = {"linear": lambda: (linear, views_of(linear)),
             "digits": lambda: (copies.train, views.train), "cifar": rotated_cifar_shaped,
             "partition": partitioned_digits, "seeds": seeded_digits}
    data = {kind: built[kind]() for kind in {case[1] for case in ROUND_CASES
                                              if devices in case[-1]}}
    models = {"linear": linear_regression(5), "mlp": mlp_classifier((8, 8), [16], 10),
              "conv": tiny_conv(), "mlp3": mlp_classifier((32, 32, 3), [8], 10)}
    gaps = {}
    if mesh is not None:  # the shared base replicated, the indices sharded: by type
        shardings = input_shardings(views.train, mesh)
        if (shardings.base_x.spec != jax.sharding.PartitionSpec()
                or shardings.rows.spec != jax.sharding.PartitionSpec("clients")):
            gaps["placement"] = 1.0
    for i, (name, kind, model, training, settings, chunk, on) in enumerate(ROUND_CASES):
        if devices not in on:
            continue
        algorithm = ALGORITHMS[name](models[model], training, **settings)
        seeded = {}
        if kind == "seeds":
            algorithm = with_seeds(algorithm, 2)
            seeded = {"copies": 1, "data_copies": 1}
        results = []
        for clients in data[kind]:
            clients = planned(clients, client_chunk=chunk)
            state, history = simulate.run(algorithm, clients, jax.random.key(3), rounds=2,
                                          eval_every=2, execution=Execution(
                                              progress=False, mesh=mesh, **seeded))
            # Every client's evaluation. On 1 device through the program run compiled
            # (no new compile); on a mesh op by op, the state sharded as run left it.
            evaluated = (algorithm.evaluate(state, clients) if mesh is not None
                         else evaluate_as_run(algorithm, state, clients))
            results.append((jax.tree.leaves(state), jax.tree.leaves(evaluated),
                            [row[key] for row in history for key in sorted(row)]))
        for what, a, b in zip(("state", "evaluation", "history"), *results, strict=True):
            gap = _largest_gap(a, b)
            if gap:
                gaps[f"case {i} ({name}, {model}, {settings}, chunk {chunk}): {what}"] = gap
    return gaps


def test_rotated_views_take_equals_copies():
    copies, views = rotated_digits(clients_per_cluster=5, n_test=7)
    assert isinstance(views.train, ClientViews) and isinstance(views.test, ClientViews)
    np.testing.assert_array_equal(copies.test_of_client, views.test_of_client)
    assert copies.rotations == views.rotations
    for part in ("train", "test"):
        a, b = getattr(copies, part), getattr(views, part)
        assert (a.num_clients, a.max_examples) == (b.num_clients, b.max_examples)
        ids = jnp.array([0, 3, a.num_clients - 1, 3, 7])  # a repeat too
        for got, want in ((b.take(ids), a.take(ids)), (b.materialize(), a)):
            for field in FIELDS:
                np.testing.assert_array_equal(getattr(got, field), getattr(want, field),
                                              err_msg=f"{part}.{field}")
    # The shared base holds each training image once (digits: 1797 less 200 for testing),
    # whatever the number of clusters and clients.
    assert views.train.base_x.shape == (1597, 8, 8)
    paired = views.test.subset(jnp.asarray(views.test_of_client))
    for field in FIELDS:
        np.testing.assert_array_equal(getattr(paired.materialize(), field),
                                      getattr(copies.test.take(copies.test_of_client), field))


def test_rotation_maps_match_rotate():
    image = np.arange(2 * 3 * 3 * 2, dtype=np.float32).reshape(2, 3, 3, 2)  # with channels
    maps = rotation_maps(image.shape[1:], (0, 1, 2, 3))
    for t in range(4):
        got = image.reshape(2, -1)[:, maps[t]].reshape(image.shape)
        np.testing.assert_array_equal(got, rotate(image, t))


def test_cifar_shaped_and_partitioned_views_take_equals_copies():
    for copies, views in (rotated_cifar_shaped(), partitioned_digits()):
        assert isinstance(views, ClientViews)
        ids = jnp.array([0, 3, copies.num_clients - 1, 3])
        for got, want in ((views.take(ids), copies.take(ids)), (views.materialize(), copies)):
            for field in FIELDS:
                np.testing.assert_array_equal(getattr(got, field), getattr(want, field))


def test_stacked_views_share_one_base():
    copies, views = seeded_digits()
    assert views.shared_base and views.base_x.shape == (1597, 8, 8)  # once, for both seeds
    assert views.rows.shape[0] == 2 and views.features_per_example() == 64
    axes = copies_axes({"clients": views})["clients"]
    assert (axes.rows, axes.base_x, axes.base_y) == (0, None, None)
    for seed in range(2):
        for field in FIELDS:
            np.testing.assert_array_equal(getattr(copy_at(views, seed).materialize(), field),
                                          getattr(copy_at(copies, seed), field))
    other = rotated_digits(clients_per_cluster=3)[1].train
    with pytest.raises(ValueError, match="stacking needs one"):
        stack_views([views.copy_at(0), other])
    shifted = other.replace(base_x=other.base_x + 1.0)
    with pytest.raises(ValueError, match="index different bases"):
        stack_views([other, shifted])


def test_ragged_views_pad_with_zeros_like_copies():
    copies = ragged_linear()
    views = views_of(copies)
    for field in FIELDS:
        np.testing.assert_array_equal(getattr(views.materialize(), field),
                                      getattr(copies, field))
    np.testing.assert_array_equal(views.active(), copies.active())
    np.testing.assert_array_equal(views.mask(), copies.mask())


def test_views_refuse_bad_indices():
    x, y = np.zeros((4, 2), np.float32), np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="rows of real examples must lie in"):
        ClientViews.from_indices(x, y, np.array([[0, 4]]))
    with pytest.raises(ValueError, match="transform needs maps"):
        ClientViews.from_indices(x, y, np.array([[0, 1]]), transform=np.array([1]))
    with pytest.raises(ValueError, match=r"maps must be \[T, F=2\]"):
        ClientViews.from_indices(x, y, np.array([[0, 1]]), maps=np.zeros((1, 3), np.int32))
    with pytest.raises(ValueError, match="transform must lie in"):
        ClientViews.from_indices(x, y, np.array([[0, 1]]), transform=np.array([2]),
                                 maps=np.array([[0, 1], [1, 0]]))


def test_cohort_take_and_sums_over_views_equal_copies():
    """The cohort path itself: `take` and a chunked `cohort_sums` over a sampled cohort."""
    copies = ragged_linear()
    views = views_of(copies)
    cohort = sample_cohort(jax.random.key(0), copies.num_clients, 5)
    for field in FIELDS:
        np.testing.assert_array_equal(getattr(take(cohort, views), field),
                                      getattr(take(cohort, copies), field))

    def step(batch):  # per-slot row sums and their total
        rows = jnp.sum(batch.data.x, axis=(1, 2)) * batch.real
        return jnp.sum(rows), rows

    for chunk in (None, 2):
        got = jax.jit(lambda d: cohort_sums(step, d, cohort))(planned(views, client_chunk=chunk))
        want = jax.jit(lambda d: cohort_sums(step, d, cohort))(
            planned(copies, client_chunk=chunk))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)


def test_rounds_over_views_equal_copies_one_device():
    assert compare_rounds(1) == {}


@pytest.mark.slow
def test_rounds_over_views_equal_copies_four_devices():
    script = ("import json, test_client_sources as t; "
              "print('RESULT' + json.dumps(t.compare_rounds(4)))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=subprocess_env(4), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    gaps = json.loads(line[len("RESULT"):])
    # States and evaluations are bit-identical on 4 devices. One evaluation row inside
    # simulate.run (case 2, round 0, a 4-client chunk per device) has come out with one
    # client's f32 loss 1 ulp apart (mean 2.3e-8 relative): on a mesh the copies' chunk
    # is a slice of the sharded grid and the views' a gather, which XLA partitions and
    # compiles apart. Only that much is tolerated, and only in histories.
    assert all(what.endswith(": history") and gap <= 1e-7 for what, gap in gaps.items()), gaps


SIZES = {"k": 4, "n": 10, "d": 10, "sigma": 0.1, "R": 1.0}


def test_generated_clients_equal_linear_mixture():
    key = jax.random.key(5)
    stored = linear_mixture(key, m=40, n_test=3, **SIZES)
    generated = generated_mixture(key, m=40, n_test=3, **SIZES)
    np.testing.assert_array_equal(generated.theta_star, stored.theta_star)
    ids = jnp.array([0, 9, 10, 39, 22, 9])
    for part in ("train", "test"):
        a, b = getattr(stored, part), getattr(generated, part)
        assert (b.num_clients, b.max_examples) == (a.num_clients, a.max_examples)
        for got, want in ((b.take(ids), a.take(ids)), (b.materialize(), a)):
            for field in FIELDS:
                np.testing.assert_array_equal(getattr(got, field), getattr(want, field),
                                              err_msg=f"{part}.{field}")
    np.testing.assert_array_equal(generated.train.active(), stored.train.active())
    np.testing.assert_array_equal(generated.train.cluster, stored.train.cluster)
    # Only the key, θ* and σ are leaves: nothing per client is stored.
    assert sum(a.size for a in jax.tree.leaves(generated.train)) < 100


def test_a_subset_of_generated_clients_is_those_clients_still_generated():
    key = jax.random.key(5)
    stored = linear_mixture(key, m=40, n_test=3, **SIZES)
    generated = generated_mixture(key, m=40, n_test=3, **SIZES)
    ids = jnp.array([39, 0, 21, 21, 10])
    for part in ("train", "test"):
        a, b = getattr(stored, part), getattr(generated, part)
        sub = b.subset(ids)
        assert sub.num_clients == 5 and sub.m == 40
        # Nothing drawn yet: the ids are the subset's only per-client leaf.
        assert sum(x.size for x in jax.tree.leaves(sub)) < 100 + ids.size
        np.testing.assert_array_equal(sub.cluster, a.cluster[ids])
        np.testing.assert_array_equal(sub.num_examples, a.num_examples[ids])
        np.testing.assert_array_equal(sub.active(), a.active()[ids])
        inner = jnp.array([4, 1])  # a subset of the subset: clients 10 and 0
        for got, want in ((sub.materialize(), a.take(ids)), (sub.take(inner), a.take(ids[inner])),
                          (sub.subset(inner).materialize(), a.take(ids[inner]))):
            for field in FIELDS:
                np.testing.assert_array_equal(getattr(got, field), getattr(want, field),
                                              err_msg=f"{part}.{field}")
    # Copies answer a subset with copies.
    assert isinstance(stored.train.subset(ids), FederatedData)


def test_mapped_chunk_takes_the_smaller_of_the_callers_and_the_sources():
    generated = generated_mixture(jax.random.key(5), m=4000, n_test=100, **SIZES)
    per_block = synthetic.MAP_DRAW_FLOATS // (100 * 11)  # n_test rows of d features + target
    assert generated.test.map_chunk() == per_block
    assert mapped_chunk(generated.test, None) == per_block
    assert mapped_chunk(generated.test, 7) == 7
    assert mapped_chunk((generated.test, jnp.zeros(4000)), 10**6) == per_block
    assert mapped_chunk(generated.test.subset(jnp.arange(per_block)), None) is None  # fits
    stored = linear_mixture(jax.random.key(5), m=40, **SIZES).train
    assert mapped_chunk(stored, None) is None and mapped_chunk(stored, 7) == 7


def test_an_evaluation_draws_generated_clients_block_by_block(monkeypatch):
    """IFCA's evaluation (each client's argmin-loss cluster, as in the official code) over
    generated clients mapped 3 at a time equals a per-client loop over the stored rows."""
    monkeypatch.setattr(synthetic, "MAP_DRAW_FLOATS", 3 * 10 * 11)  # 3 clients of 10 rows
    key = jax.random.key(5)
    stored = linear_mixture(key, m=40, **SIZES).train
    generated = generated_mixture(key, m=40, **SIZES).train
    assert generated.map_chunk() == 3
    algorithm = ALGORITHMS["ifca"](linear_regression(10), sgd(0.1), num_clusters=4)
    theta = jax.random.normal(jax.random.key(2), (4, 10))
    state = algorithm.init(jax.random.key(1), stored)._replace(cluster_params=theta)
    jaxpr = str(jax.make_jaxpr(algorithm.evaluate)(state, generated))
    assert "length=14" in jaxpr  # ⌈40 / 3⌉ blocks, each drawn inside the scan
    for data in (generated, generated.subset(jnp.arange(40))):
        out = jax.jit(algorithm.evaluate)(state, data)
        x, y = np.asarray(stored.x, np.float64), np.asarray(stored.y, np.float64)
        for i in range(40):
            losses = [np.mean((x[i] @ np.asarray(theta[j], np.float64) - y[i]) ** 2)
                      for j in range(4)]
            assert int(out["assignment"][i]) == int(np.argmin(losses)), i
            np.testing.assert_allclose(float(out["client_loss"][i]), min(losses), rtol=1e-5)


@pytest.mark.parametrize("chunk", [None, 10, 7])
def test_ifca_round_over_generated_equals_copies(chunk):
    key = jax.random.key(5)
    stored = linear_mixture(key, m=40, **SIZES)
    generated = generated_mixture(key, m=40, **SIZES)
    algorithm = ALGORITHMS["ifca"](linear_regression(10), sgd(0.1), num_clusters=4)
    out = [simulate.run(algorithm, planned(data, client_chunk=chunk), jax.random.key(1),
                        rounds=3, eval_every=3, execution=Execution(progress=False))
           for data in (stored.train, generated.train)]
    (state_a, hist_a), (state_b, hist_b) = out
    # Unchunked: bit for bit. Chunked, the rows drawn inside the chunk's program let XLA
    # lay out and sum the option-I gradient products in another order than over stored
    # rows: the cluster models may differ by float rounding (seen: 1 ulp), the
    # assignments, counts and every integer not at all.
    exact = chunk is None
    for a, b in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_b), strict=True):
        if exact or not jnp.issubdtype(a.dtype, jnp.floating):
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    if exact:
        assert json.dumps(hist_a) == json.dumps(hist_b)
    assert [sorted(r) for r in hist_a] == [sorted(r) for r in hist_b]
    for row_a, row_b in zip(hist_a, hist_b, strict=True):
        for name, value in row_a.items():
            np.testing.assert_allclose(np.asarray(row_b[name], float),
                                       np.asarray(value, float), rtol=1e-6, atol=1e-7,
                                       err_msg=name)


def _round_bytes(m: int, generated: bool, keep_client_state: bool = True,
                 restarts: int = 1) -> int:
    """temp + argument bytes of one compiled IFCA round (chunks of 500 clients)."""
    key = jax.random.key(0)
    problem = (generated_mixture if generated else linear_mixture)(key, m=m, **SIZES)
    algorithm = with_restarts(ALGORITHMS["ifca"](linear_regression(10), sgd(0.1),
                                                 num_clusters=4), restarts)
    train = planned(problem.train, client_chunk=500, keep_client_state=keep_client_state)
    state = jax.eval_shape(algorithm.init, key, train)
    compiled = jax.jit(algorithm.round).lower(state, train, key).compile()
    analysis = compiled.memory_analysis()
    return analysis.temp_size_in_bytes + analysis.argument_size_in_bytes


def test_generated_round_memory_grows_only_by_per_client_state():
    small, large = 2000, 8000
    per_client = (_round_bytes(large, True) - _round_bytes(small, True)) / (large - small)
    copies = (_round_bytes(large, False) - _round_bytes(small, False)) / (large - small)
    data_bytes = SIZES["n"] * (SIZES["d"] + 1) * 4  # one client's x and y
    # What remains per client is state and per-slot outputs: the assignment and
    # stability counters (8 B), the cohort's keys and its [m, k] losses.
    assert per_client <= 48, per_client
    assert copies >= data_bytes, copies


def test_generated_round_without_assignments_holds_nothing_per_client():
    # 3 restarts, no per-client state: the round's metrics are summed chunk by chunk, so
    # neither the [restarts, m, k] losses nor the [restarts, m] assignments exist.
    small, large = 2000, 8000
    grown = (_round_bytes(large, True, False, 3) - _round_bytes(small, True, False, 3))
    assert grown / (large - small) < 1, grown


@pytest.mark.parametrize("chunk", [None, 7])
def test_ifca_without_assignments_trains_the_same(chunk):
    key = jax.random.key(5)
    data = generated_mixture(key, m=40, **SIZES).train
    algorithm = ALGORITHMS["ifca"](linear_regression(10), sgd(0.1), num_clusters=4)
    runs = []
    for keep in (True, False):
        runs.append(simulate.run(algorithm, planned(data, client_chunk=chunk,
                                                    keep_client_state=keep),
                                 jax.random.key(1), rounds=3, eval_every=1,
                                 execution=Execution(progress=False, round_metrics=True)))
    (kept, hist_a, metrics_a), (none, hist_b, metrics_b) = runs
    assert none.assignment is None and none.stable is None and kept.assignment.shape == (40,)
    np.testing.assert_array_equal(kept.cluster_params, none.cluster_params)
    assert json.dumps(hist_a) == json.dumps(hist_b)
    for name in metrics_a:
        np.testing.assert_array_equal(metrics_a[name], metrics_b[name], err_msg=name)
    # Was refused by the factory (keep_assignments=False); the plan is the data's, so
    # init refuses it.
    with pytest.raises(ValueError, match="no per-client state needs IFCA at participation 1"):
        ALGORITHMS["ifca"](linear_regression(10), sgd(0.1), num_clusters=4,
                           participation=0.5).init(key, planned(data, keep_client_state=False))


def _in_chunks_of(problem, chunk: int):
    """The problem with its training clients planned `chunk` at a time (as the executor
    plans them): the metrics evaluate them chunk by chunk."""
    return problem._replace(train=planned(problem.train, client_chunk=chunk))


@pytest.mark.parametrize("name", ["ifca", "hypcluster"])
def test_chunked_metrics_equal_whole(name):
    # Evaluated 7 clients at a time and summed on the host (HypCluster's state holds each
    # client's cluster: its chunk is sliced too) against every client at once.
    s = {**ifca_synthetic.EXPERIMENT.defaults(), "m": 40, "n": 10, "d": 10, "k": 4, "n_test": 3,
         "R": 1.0, "algorithm": name}
    problem = generated_mixture(jax.random.key(5), k=4, m=40, n=10, d=10, sigma=0.1, R=1.0,
                                n_test=3)
    algorithm = with_restarts(build_algorithm(name, s), 3)
    state, _ = simulate.run(algorithm, problem.train, jax.random.key(1), rounds=2,
                            execution=Execution(progress=False, copies=1))
    whole = metrics_fn(name, algorithm, problem, 4)(state)
    chunked = metrics_fn(name, algorithm, _in_chunks_of(problem, 7), 4)(state)
    assert whole.keys() == chunked.keys()
    for metric, value in whole.items():
        if metric.endswith("loss"):  # float64 sums in another order
            np.testing.assert_allclose(chunked[metric], value, rtol=1e-6, err_msg=metric)
        else:
            np.testing.assert_allclose(chunked[metric], value, rtol=1e-6, atol=0,
                                       err_msg=metric)



def test_a_long_chunked_evaluation_reports_its_chunks(capsys, monkeypatch):
    """A pass over the clients that outlasts progress_every reports "evaluating ... clients:
    i/n chunks" lines (10⁸ generated clients evaluate for many minutes); a quick one, or
    one without progress, prints nothing."""
    problem = generated_mixture(jax.random.key(5), k=4, m=40, n=10, d=10, sigma=0.1, R=1.0,
                                n_test=3)
    s = {**ifca_synthetic.EXPERIMENT.defaults(), "m": 40, "n": 10, "d": 10, "k": 4, "n_test": 3}
    algorithm = with_restarts(build_algorithm("ifca", s), 2)
    state = jax.jit(algorithm.init)(jax.random.key(1), problem.train)
    monkeypatch.setattr(logs, "_PROGRESS_EVERY", 0.0)  # every pass counts as long
    chunked = _in_chunks_of(problem, 7)
    quiet = metrics_fn("ifca", algorithm, chunked, 4)(state)
    assert capsys.readouterr().err == ""
    shown = metrics_fn("ifca", algorithm, chunked, 4, progress=True,
                       description="ifca-synthetic")(state)
    lines = capsys.readouterr().err.splitlines()
    # 6 chunks a pass: the line starts after the first chunk, then one per chunk.
    want = [f"ifca-synthetic: evaluating {split} clients: {i}/6 chunks"
            for split in ("train", "test") for i in range(2, 7)]
    assert [line.split(" (")[0] for line in lines] == want
    for metric, value in quiet.items():
        np.testing.assert_array_equal(shown[metric], value, err_msg=metric)
    monkeypatch.setattr(logs, "_PROGRESS_EVERY", 3600.0)
    metrics_fn("ifca", algorithm, chunked, 4, progress=True)(state)
    assert capsys.readouterr().err == ""


def test_a_run_reports_its_long_chunked_evaluations(tmp_path, capsys, monkeypatch):
    """`fedjax-sim run` passes its progress to the chunked evaluation: a 10⁸-client run
    otherwise printed nothing for the first hour (its round-0 evaluation)."""
    monkeypatch.setattr(memory, "plan_client_chunk", lambda footprint, budget_bytes=0.0: 7)
    monkeypatch.setattr(logs, "_PROGRESS_EVERY", 10.0)  # set back after the CLI sets it
    small = ["rounds=2", "restarts=2", "eval_every=2", "checkpoint_every=0", "clients=generated"]
    for shown in (True, False):
        out = tmp_path / str(shown)
        assert cli.main(["run", "ifca-synthetic-tiny", "--set", *small, "--out", str(out),
                         "--progress-every", "0"]  # every pass counts as long
                        + ([] if shown else ["--no-progress"])) == 0
        err = capsys.readouterr().err
        for split in ("train", "test"):
            assert ("ifca-synthetic: evaluating " + split + " clients: 2/") in err if shown \
                else "evaluating" not in err, err


# ---- the experiments' `clients` setting


def _metrics(path):
    with open(path / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("chunk", ["planned", 7])
def test_run_with_generated_clients_equals_copies(tmp_path, monkeypatch, chunk):
    if chunk != "planned":  # force one chunk on both (else copies and generated may differ)
        monkeypatch.setattr(memory, "plan_client_chunk",
                            lambda footprint, budget_bytes=0.0: chunk)
    small = ["rounds=6", "restarts=2", "eval_every=3", "checkpoint_every=0"]
    runs = {}
    for clients in ("copies", "generated"):
        out = tmp_path / clients
        assert cli.main(["run", "ifca-synthetic-tiny", "--set", *small, f"clients={clients}",
                         "--out", str(out), "--no-progress"]) == 0
        runs[clients] = _metrics(out)
    copies, generated = runs["copies"], runs["generated"]
    assert [r.keys() for r in copies] == [r.keys() for r in generated] and len(copies) == 6
    for a, b in zip(copies, generated, strict=True):
        for column in a:
            # Losses and models drawn inside a chunk's program may round 1 ulp apart
            # (XLA lays out a drawn [c, n, d] block differently from a stored one, also
            # in the option-I gradient products); counts and accuracies are exact.
            if "loss" in column or column.startswith("distance"):
                np.testing.assert_allclose(float(b[column]), float(a[column]), rtol=1e-6)
            else:
                assert a[column] == b[column], (column, a, b)


def _planned(s: dict, copies: int):
    """The executor's chunk for a synthetic run of `copies` restarts (no budget)."""
    return Execution().client_chunk(ifca_synthetic.footprint_of(s, copies=copies))


def test_generated_clients_plan_a_chunk_and_store_nothing():
    s = {**ifca_synthetic.EXPERIMENT.defaults(), "m": 10**8, "n": 10, "d": 10, "k": 4,
         "clients": "generated"}
    ifca_synthetic.EXPERIMENT.validate(s, "run")
    chunk = _planned(s, s["restarts"])
    # O(chunk) rows: the chunk's working memory within GENERATED_WORK_BYTES
    per_client = s["restarts"] * memory.estimate_bytes_per_client(
        linear_regression(10), linear_mixture(jax.random.key(0), m=4, n=10, d=10, k=4,
                                              sigma=0.1, R=1.0).train, local_training=False,
        num_clusters=4)
    assert 1 <= chunk and chunk * per_client <= memory.GENERATED_WORK_BYTES
    small = {**s, "m": 20}
    assert _planned(small, 2) is None  # all 20 fit at once


def test_copies_past_the_machine_suggest_generated_clients():
    s = {**ifca_synthetic.EXPERIMENT.defaults(), "m": 10**8, "n": 10, "d": 10, "k": 4,
         "clients": "copies"}
    with pytest.raises(ValueError, match="set clients=generated"):
        ifca_synthetic.EXPERIMENT.validate(s, "run")
    s = {**ifca_synthetic.EXPERIMENT.defaults(), "m": 10**7, "clients": "copies"}
    with pytest.raises(ValueError, match=r"more than this machine.*or set clients=generated"):
        ifca_synthetic.EXPERIMENT.validate(s, "run")


def test_clients_auto_picks_generated_where_copies_do_not_fit(monkeypatch):
    monkeypatch.setattr(memory, "machine_bytes", lambda: 24 * 2**30)
    shape = {"n": 10, "d": 10, "k": 4}
    for m, want in ((10**8, "generated"), (10**6, "generated"), (10**4, "copies")):
        s = {**ifca_synthetic.EXPERIMENT.defaults(), "m": m, **shape}
        assert s["clients"] == "auto"
        ifca_synthetic.EXPERIMENT.validate(s, "run")
        assert s["clients"] == want, m
    # compare does not read the setting: it stays auto (copies)
    s = {**ifca_synthetic.EXPERIMENT.defaults(), "m": 100, **shape}
    ifca_synthetic.EXPERIMENT.validate(s, "compare")
    assert s["clients"] == "auto"


def test_clients_setting_is_refused_where_not_read(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["compare", "ifca-synthetic-tiny", "--set", "clients=generated",
                     "--out", str(out), "--no-progress"]) == 2
    assert "setting clients is not read by compare" in capsys.readouterr().err
    assert not out.exists()
