"""Local MNIST / CIFAR-10 / EMNIST / FEMNIST loaders on tiny files the tests write; no download.

Three sources: plain .npz, an array_record build made here by the package's own
tfds builder (no TensorFlow), and a tfds catalog dataset under
`tfds.testing.mock_data` (the TF-free way to exercise `tfds.data_source`).
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from PIL import Image

from fedjax_sim.data import tfds_local as T
from fedjax_sim.data.archives import DataUnavailable

tfds = pytest.importorskip("tensorflow_datasets")


def _images(n, shape, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n,) + shape, dtype=np.uint8)


def _write(path, **arrays):
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)


def _tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else None


# ---------------------------------------------------------------------------- .npz


def test_npz_mnist_and_cifar(tmp_path):
    x = _images(9, (28, 28))
    y = np.arange(9) % 10
    _write(tmp_path / "mnist" / "train.npz", x=x, y=y)
    got_x, got_y = T.load_images("mnist", tmp_path, "train")
    np.testing.assert_array_equal(got_x, x)
    np.testing.assert_array_equal(got_y, y)
    assert got_x.dtype == np.uint8 and got_y.dtype == np.int32
    # tfds-style keys and a channel axis; floats in [0, 1] are scaled to 0..255.
    _write(tmp_path / "mnist" / "test.npz", image=(x[..., None] / 255.0), label=y)
    got_x, _ = T.load_images("mnist", tmp_path, "test")
    np.testing.assert_array_equal(got_x, x)
    rgb = _images(4, (32, 32, 3))
    _write(tmp_path / "cifar10_test.npz", images=rgb, labels=np.array([0, 9, 3, 3]))  # flat
    got_x, got_y = T.load_images("cifar10", tmp_path, "test")
    assert got_x.shape == (4, 32, 32, 3)
    np.testing.assert_array_equal(got_x, rgb)


def test_npz_femnist_writers_and_emnist_config(tmp_path):
    writers = np.array(["f0001_3", "f0000_7", "f0001_3"])
    _write(tmp_path / "femnist" / "train.npz", x=_images(3, (28, 28)), y=np.array([0, 61, 5]),
           writer_id=writers)
    x, y, w = T.load_femnist(tmp_path, "train")
    assert x.shape == (3, 28, 28) and y.tolist() == [0, 61, 5]
    np.testing.assert_array_equal(w, writers)
    _write(tmp_path / "emnist" / "letters" / "train.npz", x=_images(2, (28, 28)),
           y=np.array([1, 36]))
    _, y = T.load_images("emnist/letters", tmp_path, "train")
    assert y.tolist() == [1, 36]


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"x": np.zeros((3, 27, 28), np.uint8), "y": np.zeros(3, int)}, r"\[N, 28, 28\]"),
        ({"x": np.zeros((3, 28, 28), np.uint8), "y": np.full(3, 10)}, r"\[0, 10\)"),
        ({"pixels": np.zeros((3, 28, 28), np.uint8), "y": np.zeros(3, int)}, "no images"),
        ({"x": np.full((3, 28, 28), 2.0), "y": np.zeros(3, int)}, r"lie in \[0, 1\]"),
    ],
)
def test_npz_bad_contents_refused(tmp_path, arrays, message):
    _write(tmp_path / "mnist" / "train.npz", **arrays)
    with pytest.raises(ValueError, match=message):
        T.load_images("mnist", tmp_path, "train")


# ---------------------------------------------------------------------------- own build


def test_own_array_record_build_round_trip(tmp_path):
    manual, data, cache = tmp_path / "manual", tmp_path / "data", tmp_path / "cache"
    x_train, y_train = _images(12, (28, 28), seed=1), np.arange(12) % 10
    x_test, y_test = _images(5, (28, 28), seed=2), np.arange(5)
    _write(manual / "mnist" / "train.npz", x=x_train, y=y_train)
    _write(manual / "mnist" / "test.npz", x=x_test, y=y_test)
    build = T.prepare_npz_build("mnist", manual, data)
    assert build == data / "fedjax_sim_images" / "mnist" / "1.0.0"
    assert list(build.glob("*-train.array_record*"))
    for split, (x, y) in {"train": (x_train, y_train), "test": (x_test, y_test)}.items():
        got_x, got_y = T.load_images("mnist", data, split, cache_dir=cache)
        np.testing.assert_array_equal(got_x, x)  # the builder keeps the .npz order
        np.testing.assert_array_equal(got_y, y)
    cached = sorted((cache / "tfds_local").glob("mnist-*.npz"))
    assert len(cached) == 2
    # The second read comes from the cache and gives the same arrays.
    stamp = [p.stat().st_mtime_ns for p in cached]
    got_x, _ = T.load_images("mnist", data, "train", cache_dir=cache)
    np.testing.assert_array_equal(got_x, x_train)
    assert [p.stat().st_mtime_ns for p in cached] == stamp
    # tfds slicing works on a build.
    _, y = T.load_images("mnist", data, "train[:4]", cache_dir=False)
    np.testing.assert_array_equal(y, y_train[:4])


def test_own_build_femnist_through_the_command(tmp_path):
    manual, data = tmp_path / "manual", tmp_path / "data"
    writers = np.array([3, 1, 3, 2])
    x = _images(4, (28, 28, 1))
    _write(manual / "femnist" / "train.npz", image=x, label=np.array([1, 2, 3, 61]),
           writer_id=writers)
    T.main(["femnist", "--manual_dir", str(manual), "--data_dir", str(data)])
    got_x, got_y, got_w = T.load_femnist(data, "train", cache_dir=False)
    np.testing.assert_array_equal(got_x, x[..., 0])
    assert got_y.tolist() == [1, 2, 3, 61]
    assert got_w.tolist() == ["3", "1", "3", "2"]  # stored as text, so LEAF names fit too


# ---------------------------------------------------------------------------- tfds catalog


@pytest.mark.parametrize(
    "name, shape, classes",
    [("mnist", (28, 28), 10), ("cifar10", (32, 32, 3), 10), ("emnist", (28, 28), 62),
     ("emnist/letters", (28, 28), 37)],
)
def test_catalog_data_source_under_mock(tmp_path, name, shape, classes):
    with tfds.testing.mock_data(num_examples=7):
        x, y = T.load_images(name, tmp_path, "train", cache_dir=tmp_path / "cache")
    assert x.shape == (7,) + shape and x.dtype == np.uint8
    assert y.dtype == np.int32 and y.min() >= 0 and y.max() < classes
    assert not (tmp_path / "cache").exists()  # nothing to key a mock's cache by


def _fake_catalog_build(tmp_path, tfds_name, version, images, labels, num_classes):
    """A build in the catalog's own format (PNG images, ClassLabel), prepared without TF.

    The builder is unregistered: `tfds.data_source(tfds_name)` then reads the
    files with the real catalog builder, as it would read a build copied in.
    """
    name, _, config = tfds_name.partition("/")
    meta = tmp_path / "meta"
    meta.mkdir(exist_ok=True)

    class Fake(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version(version)
        BUILDER_CONFIGS = [tfds.core.BuilderConfig(name=config)] if config else []
        pkg_dir_path = tfds.core.Path(meta)  # no metadata beside this test module

        def _info(self):
            features = {
                "image": tfds.features.Image(shape=images.shape[1:3] + (
                    images.shape[3] if images.ndim == 4 else 1,)),
                "label": tfds.features.ClassLabel(num_classes=num_classes),
            }
            if name == "cifar10":
                features["id"] = tfds.features.Text()
            return self.dataset_info_from_configs(features=tfds.features.FeaturesDict(features),
                                                  disable_shuffling=True)

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples()}

        def _generate_examples(self):
            for i, (img, lab) in enumerate(zip(images, labels, strict=True)):
                buf = io.BytesIO()
                Image.fromarray(img).save(buf, format="PNG")  # Pillow: no TensorFlow
                buf.seek(0)
                example = {"image": buf, "label": int(lab)}
                if name == "cifar10":
                    example["id"] = f"train_{i}"
                yield i, example

    Fake.name = name
    builder = Fake(config=config or None, data_dir=str(tmp_path / "data"),
                   file_format="array_record")
    builder.download_and_prepare()
    return tmp_path / "data"


@pytest.mark.parametrize(
    "name, version, shape, classes",
    [("mnist", "3.0.1", (28, 28), 10), ("emnist", "3.1.0", (28, 28), 62),
     ("cifar10", "3.0.2", (32, 32, 3), 10)],
)
def test_catalog_array_record_build(tmp_path, name, version, shape, classes):
    images = _images(5, shape, seed=3)
    labels = np.array([0, 1, 2, 3, classes - 1])
    data = _fake_catalog_build(tmp_path, T.SPECS[name].tfds_name, version, images, labels,
                               classes)
    cache = tmp_path / "cache"
    x, y = T.load_images(name, data, "train", cache_dir=cache)
    # EMNIST builds hold transposed images; the loader turns them upright.
    want = np.swapaxes(images, 1, 2) if name == "emnist" else images
    np.testing.assert_array_equal(x, want)
    np.testing.assert_array_equal(y, labels)
    assert len(list((cache / "tfds_local").glob("*.npz"))) == 1
    x2, _ = T.load_images(name, data, "train", cache_dir=cache)
    np.testing.assert_array_equal(x2, want)


@pytest.mark.parametrize("name, transposed", [("mnist", False), ("emnist", True)])
def test_catalog_emnist_is_transposed_upright(tmp_path, name, transposed):
    rows = [{"image": _images(1, (28, 28, 1), seed=i)[0], "label": i} for i in range(3)]

    def source(self, split, **kwargs):
        return rows

    with tfds.testing.mock_data(as_data_source_fn=source):
        x, y = T.load_images(name, tmp_path, "test")
    for i, row in enumerate(rows):
        want = row["image"][..., 0]
        np.testing.assert_array_equal(x[i], want.T if transposed else want)
    assert y.tolist() == [0, 1, 2]


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("name", ["mnist", "cifar10", "emnist", "femnist"])
def test_missing_data_dir_refused_before_writing(tmp_path, name):
    missing = tmp_path / "nowhere"
    cache = tmp_path / "cache"
    with pytest.raises(DataUnavailable) as err:
        T.load_images(name, missing, "train", cache_dir=cache)
    text = str(err.value)
    assert "does not exist" in text
    assert str(missing / name / "train.npz") in text
    assert str(missing / f"{name}_train.npz") in text
    assert str(missing / "fedjax_sim_images" / name.replace("/", "_") / "1.0.0") in text
    assert "python -m fedjax_sim.data.tfds_local" in text
    if name == "femnist":
        assert "no FEMNIST" in text
    else:
        assert f"tfds build {T.SPECS[name].tfds_name}" in text
        assert "--file_format array_record" in text
    assert not missing.exists() and not cache.exists()


def test_empty_data_dir_refused_and_left_empty(tmp_path):
    with pytest.raises(DataUnavailable, match="none of the files below exist") as err:
        T.load_images("cifar10", tmp_path, "test", cache_dir=tmp_path / "cache")
    assert str(tmp_path / "cifar10" / "test.npz") in str(err.value)
    assert _tree(tmp_path) == []
    with pytest.raises(DataUnavailable, match="no data_dir was given"):
        T.load_images("mnist", None, "train")


def test_tfrecord_build_named(tmp_path):
    build = tmp_path / "mnist" / "3.0.1"
    build.mkdir(parents=True)
    (build / "mnist-train.tfrecord-00000-of-00001").write_bytes(b"")
    with pytest.raises(DataUnavailable, match="tfrecord build"):
        T.load_images("mnist", tmp_path, "train")


def test_bad_name_and_split(tmp_path):
    with pytest.raises(ValueError, match="name must be one of"):
        T.load_images("svhn", tmp_path, "train")
    with pytest.raises(ValueError, match="split must be a split name"):
        T.load_images("mnist", tmp_path, "../train")
    assert os.listdir(tmp_path) == []
