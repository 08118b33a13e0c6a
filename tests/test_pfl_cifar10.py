"""pfl-research's CIFAR-10 benchmark (`fedavg-cifar10-pfl`): the CIFAR-10 readers, pfl's
users, its simple_cnn, a round against a per-client loop, and the preset end to end on tiny
archives the tests write (no CIFAR-10 ships; nothing downloads)."""

from __future__ import annotations

import csv
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim import cli, memory
from fedjax_sim.data import cifar
from fedjax_sim.execution import Execution, plan_of, planned
from fedjax_sim.experiments import pfl_cifar10 as P
from fedjax_sim.experiments import run_preset, study
from fedjax_sim.experiments.registry import PRESETS
from fedjax_sim.models.zoo import SimpleCNN, simple_cnn


def tiny_cifar(train: int = 60, test: int = 20, seed: int = 0):
    """(train, test) of (uint8 [N, 32, 32, 3], labels [N]): noise with a mark whose channel
    and corner differ, so a transposed or channel-swapped read would differ; every class."""
    rng = np.random.default_rng(seed)
    out = []
    for n in (train, test):
        x = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
        x[:, :4, :7, 0] = 255
        x[:, -3:, :2, 2] = 0
        out.append((x, np.arange(n) % 10))
    return tuple(out)


def write_npz(root, train, test):
    (root / "cifar10").mkdir(parents=True, exist_ok=True)
    for split, (x, y) in (("train", train), ("test", test)):
        np.savez(root / "cifar10" / f"{split}.npz", x=x, y=y)


def write_pfl_pickles(root, train, test):
    """pfl-research's download_preprocess.py output: the archive's [N, 3072] plane rows
    reshaped to [N, 32, 32, 3] as they lie, labels [N, 1]."""
    root.mkdir(parents=True, exist_ok=True)
    for split, (x, y) in (("train", train), ("test", test)):
        rows = x.transpose(0, 3, 1, 2).reshape(len(x), -1)
        with open(root / f"cifar10_{split}.p", "wb") as f:
            pickle.dump((rows.reshape(-1, 32, 32, 3), np.asarray(y).reshape(-1, 1)), f)


# ----------------------------------------------------------------------------- reader


@pytest.mark.parametrize("layout", ["archive", "extracted", "pfl", "npz"])
def test_every_source_gives_the_pictures(tmp_path, layout):
    train, test = tiny_cifar()
    if layout == "archive":
        cifar.write_archive(tmp_path, train, test)
    elif layout == "extracted":
        cifar.write_archive(tmp_path, train, test, extracted=True)
    elif layout == "pfl":
        write_pfl_pickles(tmp_path, train, test)
    else:
        write_npz(tmp_path, train, test)
    for split, (x, y) in (("train", train), ("test", test)):
        images, labels = cifar.load_cifar10(tmp_path, split)
        assert images.dtype == np.uint8 and images.shape == x.shape
        np.testing.assert_array_equal(images, x)
        np.testing.assert_array_equal(labels, y)
        assert labels.dtype == np.int32


def test_the_archive_holds_the_planes_of_the_pictures(tmp_path):
    """The python archive's row is R, G, B planes, each row-major (cifar.html): written by
    hand here, not by `write_archive`."""
    train, test = tiny_cifar(train=10, test=10)
    folder = tmp_path / cifar.BATCHES_DIR
    folder.mkdir()
    for name, (x, y) in [*((f"data_batch_{i}", (train[0][2 * i - 2:2 * i],
                                                 train[1][2 * i - 2:2 * i]))
                           for i in range(1, 6)), ("test_batch", test)]:
        rows = np.stack([np.concatenate([img[:, :, c].ravel() for c in range(3)]) for img in x])
        with open(folder / name, "wb") as f:
            pickle.dump({b"data": rows, b"labels": list(map(int, y))}, f, protocol=2)
    images, labels = cifar.load_cifar10(tmp_path, "train")
    np.testing.assert_array_equal(images, train[0])
    np.testing.assert_array_equal(labels, train[1])
    # pfl's layout: pixel (i, j, c) holds plane value 96·i + 3·j + c
    flat = np.concatenate([images[0][:, :, c].ravel() for c in range(3)])
    assert cifar.pfl_layout(images)[0, 5, 7, 2] == flat[96 * 5 + 3 * 7 + 2]


class _Boom:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_a_pickle_building_anything_else_is_refused(tmp_path, capsys):
    folder = tmp_path / cifar.BATCHES_DIR
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)]:
        (folder / name).write_bytes(pickle.dumps({b"data": _Boom(), b"labels": []}))
    with pytest.raises(ValueError, match=r"data_batch_1: not a CIFAR-10 pickle.*builtins.print"):
        cifar.load_cifar10(tmp_path, "train")
    assert "never run" not in capsys.readouterr().out


def test_no_data_names_every_layout(tmp_path):
    with pytest.raises(cifar.DataUnavailable) as err:
        cifar.load_cifar10(tmp_path, "test")
    for what in ("cifar-10-batches-py", "cifar-10-python.tar.gz", "cifar10_test.p",
                 "test.npz", "tfds build"):
        assert what in str(err.value), what


# ----------------------------------------------------------------------------- users


def test_iid_users_cut_a_permutation_in_order():
    users = P.iid_users(105, 10, np.random.RandomState(3))
    assert [len(u) for u in users] == [10] * 10 + [5]
    joined = np.concatenate(users)
    np.testing.assert_array_equal(joined, np.random.RandomState(3).permutation(105))


def test_dirichlet_users_are_disjoint_full_and_skewed():
    labels = np.repeat(np.arange(10), 100)
    rng = np.random.RandomState(0)
    users = P.dirichlet_users(labels, 20, 0.1, rng)
    assert len(users) == 50 and all(len(u) == 20 for u in users)
    joined = np.concatenate(users)
    assert len(set(joined.tolist())) == len(joined) == 1000
    top = [np.bincount(labels[u], minlength=10).max() / 20 for u in users]
    iid = [np.bincount(labels[u], minlength=10).max() / 20
           for u in P.iid_users(1000, 20, np.random.RandomState(0))]
    # Dir(0.1): most users mostly one class (the last users take what is left)
    assert np.median(top) >= 0.6 > np.median(iid)


def test_channel_stats_are_the_float64_ones():
    x = np.random.default_rng(1).integers(0, 256, (7, 5, 4, 3), dtype=np.uint8)
    mean, std = P.channel_stats(x)
    np.testing.assert_allclose(mean, x.astype(np.float64).mean(axis=(0, 1, 2)), rtol=1e-12)
    np.testing.assert_allclose(std, x.astype(np.float64).std(axis=(0, 1, 2)), rtol=1e-12)


# ----------------------------------------------------------------------------- model


def test_simple_cnn_has_pfls_layers_and_parameter_count():
    params = simple_cnn().init(jax.random.key(0))
    shapes = jax.tree.map(jnp.shape, params)
    assert shapes == {"Conv_0": {"kernel": (3, 3, 3, 32), "bias": (32,)},
                      "Conv_1": {"kernel": (3, 3, 32, 64), "bias": (64,)},
                      "Dense_0": {"kernel": (14 * 14 * 64, 128), "bias": (128,)},
                      "Dense_1": {"kernel": (128, 10), "bias": (10,)}}
    assert sum(int(p.size) for p in jax.tree.leaves(params)) == 1_626_442  # pfl's ≈ 1.63 M


def _numpy_cnn(p, x, mean, std):
    """simple_cnn's forward pass (dropout off) in float64 numpy, loops over kernel offsets."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    h = (x.astype(np.float64) - mean) / std

    def conv(h, kernel, bias):
        kh, kw, _, out = kernel.shape
        rows, cols = h.shape[1] - kh + 1, h.shape[2] - kw + 1
        y = np.zeros((h.shape[0], rows, cols, out))
        for i in range(kh):
            for j in range(kw):
                y += h[:, i:i + rows, j:j + cols, :] @ kernel[i, j]
        return np.maximum(y + bias, 0.0)

    h = conv(h, p["Conv_0"]["kernel"], p["Conv_0"]["bias"])
    h = conv(h, p["Conv_1"]["kernel"], p["Conv_1"]["bias"])
    n, r, c, ch = h.shape
    h = h.reshape(n, r // 2, 2, c // 2, 2, ch).max(axis=(2, 4)).reshape(n, -1)
    h = np.maximum(h @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"], 0.0)
    return h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]


def test_simple_cnn_equals_a_plain_forward_pass_and_dropout_needs_train():
    mean, std = (120.0, 110.0, 100.0), (60.0, 55.0, 50.0)
    model = simple_cnn(mean=mean, std=std)
    params = model.init(jax.random.key(1))
    x = tiny_cifar(train=3, test=1)[0][0]
    np.testing.assert_allclose(np.asarray(model.apply(params, x)),
                               _numpy_cnn(params, x, np.array(mean), np.array(std)),
                               rtol=2e-4, atol=2e-5)
    module = SimpleCNN(10, mean, std)
    rngs = {"dropout": jax.random.key(2)}
    train = module.apply({"params": params}, x, train=True, rngs=rngs)
    assert not np.allclose(np.asarray(train), np.asarray(model.apply(params, x)))


@pytest.mark.parametrize("bad", [dict(input_shape=(4, 4, 3)), dict(mean=(0.0,)),
                                 dict(std=(1.0, 0.0, 1.0))])
def test_simple_cnn_refuses_bad_arguments(bad):
    with pytest.raises(ValueError, match=r"input_shape|mean and std"):
        simple_cnn(**bad)


# ----------------------------------------------------------------------------- a round


def small_images(train: int, test: int, side: int = 8, seed: int = 0):
    """Random uint8 images side×side×3 (the experiment takes any size ≥ 6×6; small ones
    keep XLA:CPU's convolution gradients quick), labels cycling through the classes."""
    rng = np.random.default_rng(seed)
    return tuple((rng.integers(0, 256, (n, side, side, 3), dtype=np.uint8), np.arange(n) % 10)
                 for n in (train, test))


@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("chunk", [None, 1, 2], ids=["whole", "one at a time", "chunks of 2"])
def test_a_round_equals_a_per_client_loop(dropout, chunk):
    """Every user, two full-batch local steps each, central SGD at 0.5: the experiment's
    vectorized round against a loop over users written here (float32), the cohort vmapped
    whole or in the client chunks the executor may plan (one user at a time on a CPU:
    `test_the_executor_trains_one_user_at_a_time_on_a_cpu`). With model_dropout (the
    preset's default) each step calls SimpleCNN with train=True and
    rngs={"dropout": fold_in(k_t, 3)}, k_t = split(c_j, 2)[t] for user j's slot key
    c_j = fold_in(split(r)[1], j), r = fold_in(round key, seed 0) (`with_seeds`,
    `ops.sample_cohort`, `ops.client_update`'s documented keys)."""
    train, test = small_images(40, 10)
    s = {**PRESETS["fedavg-cifar10-pfl"].defaults, "datapoints_per_user": 8, "cohort_size": 5,
         "batch_size": 0, "local_epochs": 2, "central_lr": 0.5, "lr": 0.05,
         "model_dropout": dropout}
    problem = P.PFL.problem(s, (*train, *test))
    problem = {**problem, "train": planned(problem["train"], client_chunk=chunk)}
    spec = study.method_run(P.PFL, "fedavg", s, problem)
    assert plan_of(spec.data).client_chunk == chunk
    key = jax.random.key(0)
    state = spec.algorithm.init(key, spec.data)
    new, _ = jax.jit(spec.algorithm.round)(state, spec.data, jax.random.key(1))

    module = SimpleCNN(10, tuple(map(float, problem["mean"])), tuple(map(float, problem["std"])))
    start = jax.tree.map(lambda a: a[0], state.params)
    users = P.iid_users(40, 8, np.random.RandomState(s["seed"]))

    def loss(p, x, y, k):
        logits = (module.apply({"params": p}, x, train=True, rngs={"dropout": k}) if dropout
                  else module.apply({"params": p}, x))
        return jnp.mean(-jax.nn.log_softmax(logits)[jnp.arange(len(y)), y])

    grad = jax.jit(jax.grad(loss))
    slot_keys = jax.random.split(jax.random.fold_in(jax.random.key(1), 0))[1]
    trained = []
    for j, u in enumerate(users):
        p = start
        step_keys = jax.random.split(jax.random.fold_in(slot_keys, j), 2)
        for t in range(2):
            g = grad(p, train[0][u], jnp.asarray(train[1][u]),
                     jax.random.fold_in(step_keys[t], 3))
            p = jax.tree.map(lambda a, b: a - 0.05 * b, p, g)
        trained.append(p)
    mean = jax.tree.map(lambda *a: sum(a) / len(a), *trained)
    want = jax.tree.map(lambda w, m: w + 0.5 * (m - w), start, mean)
    got = jax.tree.map(lambda a: a[0], new.params)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_the_executor_trains_one_user_at_a_time_on_a_cpu(monkeypatch, backend):
    """Shapes only: at the preset's sizes (users of 50 32×32 images, simple_cnn) a user's
    working memory in a round (a local step's activations, the model's copies) exceeds
    the CPU's bound on a round's working memory (`memory.CPU_ROUND_WORK_BYTES`), so the
    executor plans the training users one at a time there, and the cohort whole on an
    accelerator; the test images are not planned."""
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    train, test = small_images(4 * 50, 10, side=32)
    s = {**PRESETS["fedavg-cifar10-pfl"].defaults, "cohort_size": 2}
    problem = P.PFL.problem(s, (*train, *test))
    footprint = P.PFL.footprint("fedavg", s, problem)
    want = None
    if backend == "cpu":  # (the convolutions' patches are counted: the CPU's conv form)
        per_user = memory.estimate_bytes_per_client(footprint.model, footprint.clients)
        assert per_user > memory.CPU_ROUND_WORK_BYTES
        want = 1
    assert Execution().client_chunk(footprint) == want
    spec = study.method_spec(P.PFL, "fedavg", s, problem)
    assert plan_of(spec.data).client_chunk == want


def test_evaluation_is_the_mean_over_every_test_image():
    train, test = small_images(40, 13)
    s = {**PRESETS["fedavg-cifar10-pfl"].defaults, "datapoints_per_user": 8, "cohort_size": 5,
         "eval_batch_size": 5}
    problem = P.PFL.problem(s, (*train, *test))
    spec = study.method_run(P.PFL, "fedavg", s, problem)
    state = spec.algorithm.init(jax.random.key(0), spec.data)
    got = spec.evaluate(state)
    p = jax.tree.map(lambda a: a[0], state.params)
    logits = np.asarray(problem["model"].apply(p, test[0]), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - logits.max(1, keepdims=True)
    np.testing.assert_allclose(got["test_loss"], [-logp[np.arange(13), test[1]].mean()],
                               rtol=1e-5)
    np.testing.assert_allclose(got["test_accuracy"], [(logits.argmax(1) == test[1]).mean()])


# ----------------------------------------------------------------------------- the preset


TINY = ["datapoints_per_user=6", "cohort_size=3", "rounds=2", "eval_every=1",
        "checkpoint_every=0"]


@pytest.mark.parametrize("data_dir", [None, "missing", "empty"])
def test_without_data_refused_in_one_line_before_writing(tmp_path, capsys, data_dir):
    out = tmp_path / "out"
    given = []
    if data_dir is not None:
        (tmp_path / "empty").mkdir()
        given = ["--set", f"data_dir={tmp_path / data_dir}"]
    assert cli.main(["run", "fedavg-cifar10-pfl", *given, "--out", str(out),
                     "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "setting data_dir" in err
    assert "cifar-10-python.tar.gz" in err
    assert not out.exists()


def test_a_cohort_larger_than_the_users_is_refused(tmp_path):
    cifar.write_archive(tmp_path / "data", *tiny_cifar())
    with pytest.raises(ValueError, match=r"^setting cohort_size=11 exceeds the 10 users"):
        run_preset("fedavg-cifar10-pfl", [f"data_dir={tmp_path / 'data'}",
                                          "datapoints_per_user=6", "cohort_size=11"],
                   tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def _metrics(path):
    with open(path / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("dataset", ["cifar10_iid", "cifar10"])
def test_the_preset_runs_alike_from_the_archive_and_npz(tmp_path, dataset):
    """End to end on tiny copies: the python archive and .npz give the same metrics."""
    train, test = tiny_cifar()
    cifar.write_archive(tmp_path / "archive", train, test)
    write_npz(tmp_path / "npz", train, test)
    rows = {}
    for source in ("archive", "npz"):
        out = tmp_path / f"out_{source}"
        run_preset("fedavg-cifar10-pfl", [f"data_dir={tmp_path / source}",
                                          f"dataset={dataset}", *TINY], out, progress=False)
        rows[source] = _metrics(out)
    assert rows["archive"] == rows["npz"]
    assert [int(r["round"]) for r in rows["npz"]] == [0, 1, 2]
    for r in rows["npz"]:
        assert 0.0 <= float(r["test_accuracy"]) <= 1.0 and np.isfinite(float(r["test_loss"]))


def test_cohort_size_rounds_as_documented():
    """participation · m to the nearest integer (halves to even), at least 1
    (algorithms.base.cohort_size, fedavg's docstring), and the round draws that many."""
    from fedjax_sim.algorithms.base import cohort_size, draw_cohort
    from fedjax_sim.data import linear_mixture

    assert [cohort_size(m, p) for m, p in ((1000, 0.05), (5, 0.5), (7, 0.5), (10, 0.01),
                                           (10, 0.26), (10, 0.34))] == [50, 2, 4, 1, 3, 3]
    data = linear_mixture(jax.random.key(0), k=1, m=7, n=4, d=2, sigma=0.1, R=1.0).train
    cohort = draw_cohort(jax.random.key(1), data, 0.5)
    assert cohort.ids.shape == (4,) and len(set(np.asarray(cohort.ids).tolist())) == 4


def test_pixel_layout_pfl_gives_the_arrays_pfls_pickles_hold(tmp_path):
    """pixel_layout=pfl: the images as pfl-research's own pickles store them (what its
    network trains on), whichever source they were read from."""
    train, test = tiny_cifar(train=20, test=10)
    write_pfl_pickles(tmp_path / "pfl", train, test)
    cifar.write_archive(tmp_path / "archive", train, test)
    with open(tmp_path / "pfl" / "cifar10_train.p", "rb") as f:
        stored = pickle.load(f)[0]
    for source in ("pfl", "archive"):
        s = {"data_dir": str(tmp_path / source), "cache_dir": "", "pixel_layout": "pfl"}
        np.testing.assert_array_equal(P.load_split_images(s)[0], stored)
        s["pixel_layout"] = "images"
        np.testing.assert_array_equal(P.load_split_images(s)[0], train[0])
