"""Full MNIST, CIFAR-10 and EMNIST / FEMNIST from a user's local `data_dir`, without TensorFlow.

None of these can be downloaded here (docs/protocols.md#data-sources), so the loaders read a copy
the user brought. For `load_images(name, data_dir, split)` with name in
{"mnist", "cifar10", "emnist", "emnist/<config>", "femnist"} they look, in
this order, for:

1. `<data_dir>/<name>/<split>.npz`: a plain numpy archive (`np.savez`) with
   images under `x` (or `image`, `images`) and labels under `y` (or `label`,
   `labels`); FEMNIST also needs writer ids under `writer_id` (or
   `writer_ids`, `writer`). Images are uint8 [N, H, W] or [N, H, W, C]
   (floats in [0, 1] are scaled to 0..255), upright; labels integers in
   [0, num_classes). E.g. `<data_dir>/cifar10/train.npz`,
   `<data_dir>/emnist/letters/test.npz`. The flat name
   `<data_dir>/<name>_<split>.npz` (`cifar10_train.npz`; "/" in a name
   written "_") is read too.
2. `<data_dir>/fedjax_sim_images/<config>/1.0.0/`: an array_record build of
   such .npz files made by this module's own tfds builder (`FedjaxSimImages`,
   `tfds.features.Tensor` features, so preparing it needs no TensorFlow)::

     python -m fedjax_sim.data.tfds_local mnist --manual_dir M --data_dir D

   reads `M/mnist/train.npz` and `M/mnist/test.npz` (the layout of 1.).
3. A tensorflow-datasets catalog build (`mnist`, `cifar10`, `emnist/byclass`,
   ...) prepared as array_record, read with `tfds.data_source` (no TensorFlow
   needed to read it; its PNG images decode with Pillow). Prepare it where
   TensorFlow and the internet are available and copy `<data_dir>/<name>/`::

     tfds build mnist --data_dir D --file_format array_record

   tfds has no FEMNIST; for it 1., 2. and the LEAF files below apply.

FEMNIST also reads LEAF's own JSON files (https://github.com/TalwalkarLab/leaf,
`data/femnist`), looked for after 1.: `<data_dir>/femnist/<split>/*.json`,
i.e. LEAF's `data/train/` and `data/test/` folders (its per-user split, e.g.
`./preprocess.sh -s niid --sf 0.05 -k 100 -t sample`) copied to
`<data_dir>/femnist/train/` and `<data_dir>/femnist/test/`; for split
"train" without such a folder, LEAF's unsplit `data/all_data/all_data_*.json`
copied to `<data_dir>/femnist/all_data/` (no test split then: an experiment
splits each writer itself). Each file is {"users": [...], "num_samples":
[...], "user_data": {user: {"x": [[784 floats]], "y": [ints]}}}; the writer
id is the user name. LEAF's x is `np.asarray(gray).flatten() / 255` of the
28×28 PIL image (`data/femnist/preprocess/data_to_json.py`): row-major, so
reshaped to [28, 28] it is upright, and NOT inverted: NIST's white background
is near 1 and the ink near 0. The images returned are `round(255·x)` in that
same polarity (an .npz written from LEAF's arrays ×255 reads the same).

Shapes returned: grayscale images as uint8 [N, 28, 28] (the channel axis
dropped), CIFAR-10 as uint8 [N, 32, 32, 3]; labels int32 [N]. tfds's EMNIST
stores images transposed (as the original EMNIST files); they are transposed
back, so every source gives upright digits and letters, as MNIST and FEMNIST.
A tfds build's rows come in the build's order (tfds shuffles a catalog build
when preparing it; this module's builder keeps the .npz order).

Decoding a tfds build row by row is slow (seconds per 10k rows), so the
decoded arrays are kept as an .npz in the cache directory (`cache_dir`, else
$FEDJAX_SIM_CACHE, else ~/.cache/fedjax_sim; under `tfds_local/`), keyed by
the build's file names, sizes and times, written atomically.

A missing or empty `data_dir` raises `DataUnavailable` before anything is
written, naming every path looked for and how to prepare each.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import re
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import NamedTuple

import numpy as np

from fedjax_sim.data.archives import DataUnavailable, cache_root
from fedjax_sim.extras import require


class ImageSpec(NamedTuple):
    image_shape: tuple[int, ...]  # (H, W) for grayscale, (H, W, C) otherwise
    num_classes: int
    tfds_name: str | None  # the tfds catalog name[/config], None if tfds has none
    transposed_in_tfds: bool = False
    has_writers: bool = False


_EMNIST_CLASSES = {"byclass": 62, "bymerge": 47, "balanced": 47, "letters": 37, "digits": 10,
                   "mnist": 10}

SPECS: dict[str, ImageSpec] = {
    "mnist": ImageSpec((28, 28), 10, "mnist"),
    "cifar10": ImageSpec((32, 32, 3), 10, "cifar10"),
    # The default EMNIST is tfds's default config, byclass: FEMNIST's 62 classes.
    "emnist": ImageSpec((28, 28), 62, "emnist/byclass", transposed_in_tfds=True),
    **{f"emnist/{c}": ImageSpec((28, 28), k, f"emnist/{c}", transposed_in_tfds=True)
       for c, k in _EMNIST_CLASSES.items()},
    "femnist": ImageSpec((28, 28), 62, None, has_writers=True),
}

BUILDER_NAME = "fedjax_sim_images"
BUILDER_VERSION = "1.0.0"
_IMAGE_KEYS = ("x", "image", "images")
_LABEL_KEYS = ("y", "label", "labels")
_WRITER_KEYS = ("writer_id", "writer_ids", "writer")
_CHUNK = 4096


def _spec(name: str) -> ImageSpec:
    if name not in SPECS:
        raise ValueError(f"name must be one of {sorted(SPECS)}; got {name!r}.")
    return SPECS[name]


def _config_name(name: str) -> str:
    return name.replace("/", "_")


def _check_split(split: str) -> str:
    if not isinstance(split, str) or not re.fullmatch(r"[A-Za-z0-9_]+(\[[^\]]*\])?", split):
        raise ValueError(
            f"split must be a split name such as 'train' or 'test' (tfds builds also take "
            f"slices such as 'train[:10%]'); got {split!r}."
        )
    return split


def _base_split(split: str) -> str:
    return split.split("[", 1)[0]


# ---------------------------------------------------------------------------- arrays


def _as_images(a: np.ndarray, spec: ImageSpec, where: str) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim == len(spec.image_shape) + 2 and len(spec.image_shape) == 2 and a.shape[-1] == 1:
        a = a[..., 0]  # [N, H, W, 1] -> [N, H, W]
    if a.shape[1:] != spec.image_shape:
        raise ValueError(
            f"{where}: images must be [N, {', '.join(map(str, spec.image_shape))}]; "
            f"got shape {a.shape}."
        )
    if a.dtype == np.uint8:
        return a
    if a.dtype.kind == "f":
        if a.size and (not np.all(np.isfinite(a)) or a.min() < 0 or a.max() > 1):
            raise ValueError(f"{where}: float images must lie in [0, 1]; got another range.")
        return np.round(a * 255).astype(np.uint8)
    if a.dtype.kind in "iu":
        if a.size and (a.min() < 0 or a.max() > 255):
            raise ValueError(f"{where}: integer images must lie in [0, 255].")
        return a.astype(np.uint8)
    raise ValueError(f"{where}: images must be uint8 (or floats in [0, 1]); got {a.dtype}.")


def _as_labels(a: np.ndarray, n: int, spec: ImageSpec, where: str) -> np.ndarray:
    a = np.asarray(a).reshape(-1) if np.ndim(a) == 2 and np.shape(a)[1] == 1 else np.asarray(a)
    if a.shape != (n,) or a.dtype.kind not in "iu":
        raise ValueError(f"{where}: labels must be [N]=({n},) integers; got {a.dtype} {a.shape}.")
    if a.size and (a.min() < 0 or a.max() >= spec.num_classes):
        raise ValueError(
            f"{where}: labels must lie in [0, {spec.num_classes}); got range "
            f"[{a.min()}, {a.max()}]."
        )
    return a.astype(np.int32)


def _as_writers(a: np.ndarray, n: int, where: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype.kind == "O":
        a = a.astype(str)
    if a.dtype.kind == "S":
        a = np.char.decode(a, "utf-8")
    if a.shape != (n,) or a.dtype.kind not in "iuU":
        raise ValueError(
            f"{where}: writer ids must be [N]=({n},) integers or strings; got {a.dtype} {a.shape}."
        )
    return a.astype(np.int64) if a.dtype.kind in "iu" else a


def _pick(keys, arrays, where: str, what: str):
    for k in keys:
        if k in arrays:
            return arrays[k]
    raise ValueError(f"{where} has no {what} under any of the keys {list(keys)}; "
                     f"it holds {sorted(arrays)}.")


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array of an .npz; ValueError naming the file when it is not one np.load can read
    (truncated, empty, random bytes, pickled objects)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"PK\x03\x04":  # np.load would try to unpickle anything else
            raise ValueError("empty" if not magic else "not a zip archive, which an .npz is")
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, EOFError, ValueError, OSError, KeyError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        if "allow_pickle" in reason or "pickled" in reason:
            reason = "it holds Python objects (object arrays), which are not read"
        elif isinstance(err, (zipfile.BadZipFile, EOFError)):
            reason = f"truncated or damaged: {reason}"
        raise ValueError(
            f"{path}: not a readable .npz of numeric arrays ({reason}); write it with "
            "np.savez(path, x=uint8 images, y=int labels)."
        ) from None


def _read_npz(path: Path, spec: ImageSpec):
    where = str(path)
    arrays = _load_npz(path)
    images = _as_images(_pick(_IMAGE_KEYS, arrays, where, "images"), spec, where)
    labels = _as_labels(_pick(_LABEL_KEYS, arrays, where, "labels"), images.shape[0], spec, where)
    writers = None
    if spec.has_writers:
        writers = _as_writers(_pick(_WRITER_KEYS, arrays, where, "writer ids"),
                              images.shape[0], where)
    return images, labels, writers


def _read_source(source, spec: ImageSpec, where: str, transpose: bool):
    """Every row of a tfds data source as (images, labels, writers)."""
    n = len(source)
    rows = []
    for start in range(0, n, _CHUNK):
        keys = list(range(start, min(start + _CHUNK, n)))
        try:
            rows.extend(source.__getitems__(keys))
        except (TypeError, AttributeError):  # older sources, mocks: one record at a time
            rows.extend(source[i] for i in keys)
    if not rows:
        raise ValueError(f"{where} holds no examples.")
    images = np.stack([np.asarray(r["image"]) for r in rows])
    if transpose:
        images = np.swapaxes(images, 1, 2)
    images = _as_images(images, spec, where)
    labels = _as_labels(np.array([r["label"] for r in rows]), n, spec, where)
    writers = None
    if spec.has_writers:
        writers = _as_writers(np.array([r["writer_id"] for r in rows]), n, where)
    return images, labels, writers


def _leaf_files(data_dir: Path, split: str) -> list[Path]:
    """LEAF FEMNIST JSON files of `split`: `femnist/<split>/*.json`, else (train only)
    `femnist/all_data/*.json`; [] when there are none."""
    base = data_dir / "femnist"
    files = sorted((base / split).glob("*.json")) if (base / split).is_dir() else []
    if not files and split == "train" and (base / "all_data").is_dir():
        files = sorted((base / "all_data").glob("*.json"))
    return files


def _read_leaf(files: list[Path], spec: ImageSpec):
    """(images uint8 [N, 28, 28], labels, writer ids) of LEAF JSON files, users in file order."""
    import json

    images, labels, writers = [], [], []
    for path in files:
        where = str(path)
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            users, data = doc["users"], doc["user_data"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{where}: not a LEAF FEMNIST JSON file with 'users' and "
                             f"'user_data' ({type(err).__name__}: {err}).") from None
        for user in users:
            rows = data.get(user)
            if not isinstance(rows, dict) or "x" not in rows or "y" not in rows:
                raise ValueError(f"{where}: user {user!r} has no 'x' and 'y' in 'user_data'.")
            x = np.asarray(rows["x"], np.float64)
            n = len(rows["y"])
            if x.shape != (n, 784):
                raise ValueError(f"{where}: user {user!r}: 'x' must be {n} rows of 784 floats "
                                 f"(28×28 images); got shape {x.shape}.")
            images.append(x.reshape(n, 28, 28))
            labels.append(np.asarray(rows["y"]).reshape(n))
            writers += [str(user)] * n
    if not writers:
        raise ValueError(f"{files[0].parent}: the LEAF JSON files hold no examples.")
    where = str(files[0].parent)
    x = _as_images(np.concatenate(images), spec, where)
    y = _as_labels(np.concatenate(labels).astype(np.int64), len(x), spec, where)
    return x, y, np.asarray(writers)


def _fingerprint(build: Path, split: str) -> str | None:
    """A key of the split's files (names, sizes, times); None when there are none (a mock)."""
    files = sorted(build.glob(f"*-{_base_split(split)}.array_record*")) if build.is_dir() else []
    if not files:
        return None
    h = hashlib.sha256(f"{build.resolve()}|{split}".encode())
    for f in files:
        st = f.stat()
        h.update(f"|{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def _cached_read(source_fn, build: Path, name: str, split: str, cache_dir):
    """Decoding a tfds build row by row is slow (~15 s for MNIST's 60k); keep the arrays."""
    key = _fingerprint(build, split)
    if key is None or cache_dir is False:
        return source_fn()
    folder = cache_root(None if cache_dir is True else cache_dir) / "tfds_local"
    path = folder / f"{_config_name(name)}-{re.sub(r'[^A-Za-z0-9_]+', '_', split)}-{key}.npz"
    if path.is_file():
        try:
            z = _load_npz(path)
            return z["images"], z["labels"], z.get("writers")
        except (ValueError, KeyError):  # a damaged cache file: decode the build again
            pass
    images, labels, writers = source_fn()
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {"images": images, "labels": labels}
    if writers is not None:
        arrays["writers"] = writers
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".npz.tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the whole file or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return images, labels, writers


# ---------------------------------------------------------------------------- lookup


def _npz_paths(data_dir: Path, name: str, split: str) -> list[Path]:
    """`<data_dir>/<name>/<split>.npz`, or flat beside it as `<name>_<split>.npz`."""
    base = _base_split(split)
    return [data_dir / name / f"{base}.npz", data_dir / f"{_config_name(name)}_{base}.npz"]


def _own_build_dir(data_dir: Path, name: str) -> Path:
    return data_dir / BUILDER_NAME / _config_name(name) / BUILDER_VERSION


def _catalog_dir(data_dir: Path, spec: ImageSpec) -> Path:
    return data_dir / spec.tfds_name


def _has_split(build: Path, split: str) -> bool:
    return build.is_dir() and any(build.glob(f"*-{_base_split(split)}.array_record*"))


def _unavailable(name: str, data_dir: Path, split: str, spec: ImageSpec, reason: str):
    npz, flat = _npz_paths(data_dir, name, split)
    own = _own_build_dir(data_dir, name)
    writer = ", writer ids under 'writer_id'" if spec.has_writers else ""
    lines = [
        f"{name} ({split}) is not available in data_dir={str(data_dir)!r}: {reason}",
        "Looked for:",
        f"  1. {npz} or {flat}: np.savez(..., x=uint8 "
        f"[N, {', '.join(map(str, spec.image_shape))}], y=int labels in "
        f"[0, {spec.num_classes}){writer}) (keys image(s)/label(s) also accepted);",
        f"  2. {own}/ with {BUILDER_NAME}-{_base_split(split)}.array_record*: build it from "
        f"such .npz files with `python -m fedjax_sim.data.tfds_local {name} --manual_dir M "
        f"--data_dir {data_dir}` (reads M/{name}/train.npz and M/{name}/test.npz);",
    ]
    if spec.tfds_name is not None:
        lines.append(
            f"  3. {_catalog_dir(data_dir, spec)}/<version>/ with "
            f"{spec.tfds_name.split('/')[0]}-{_base_split(split)}.array_record*: a "
            f"tensorflow-datasets build; prepare it where TensorFlow and the internet are "
            f"available with `tfds build {spec.tfds_name} --data_dir {data_dir} "
            f"--file_format array_record` and copy the folder here."
        )
    else:
        base = _base_split(split)
        lines.append(f"  3. {data_dir / 'femnist' / base}/*.json: LEAF's FEMNIST files (its "
                     f"data/{base}/ folder after ./preprocess.sh -s niid --sf 0.05 -k 100 -t "
                     "sample in leaf/data/femnist, https://github.com/TalwalkarLab/leaf)"
                     + (f", or {data_dir / 'femnist' / 'all_data'}/*.json (LEAF's unsplit "
                        "data/all_data/)" if base == "train" else "") + ".")
        lines.append("  (tensorflow-datasets has no FEMNIST build, so only 1., 2. and 3. "
                     "apply.)")
    return DataUnavailable("\n".join(lines))


def _load(name: str, data_dir, split: str, cache_dir=None):
    spec = _spec(name)
    split = _check_split(split)
    if data_dir is None:
        raise _unavailable(name, Path("<data_dir>"), split, spec,
                           "no data_dir was given (set the data_dir setting).")
    data_dir = Path(data_dir).expanduser()
    if not data_dir.is_dir():
        raise _unavailable(name, data_dir, split, spec, "the directory does not exist.")
    for npz in _npz_paths(data_dir, name, split):
        if npz.is_file():
            if _base_split(split) != split:
                raise ValueError(
                    f"split slices such as {split!r} need a tfds build; {npz} is an .npz."
                )
            return _read_npz(npz, spec)
    leaf = _leaf_files(data_dir, _base_split(split)) if name == "femnist" else []
    if leaf:
        if _base_split(split) != split:
            raise ValueError(f"split slices such as {split!r} need a tfds build; "
                             f"{leaf[0].parent} holds LEAF JSON files.")
        return _read_leaf(leaf, spec)
    own = _own_build_dir(data_dir, name)
    if spec.tfds_name is None and not _has_split(own, split):  # no tfds needed to say so
        raise _unavailable(name, data_dir, split, spec, "none of the files below exist.")
    require("tensorflow_datasets", "tfds", f"reading {name} from a tfds build in {data_dir}")
    import tensorflow_datasets as tfds  # here, not at import: it takes a second

    if _has_split(own, split):
        npz_builder()  # registers the builder class, so tfds can read its build
        source = tfds.data_source(f"{BUILDER_NAME}/{_config_name(name)}:{BUILDER_VERSION}",
                                  data_dir=str(data_dir), split=split, download=False)
        return _cached_read(lambda: _read_source(source, spec, str(own), transpose=False),
                            own, name, split, cache_dir)
    if spec.tfds_name is None:
        raise _unavailable(name, data_dir, split, spec, "none of the files below exist.")
    catalog = _catalog_dir(data_dir, spec)
    if catalog.is_dir() and not any(catalog.rglob("*.array_record*")) \
            and any(catalog.rglob("*.tfrecord*")):
        raise _unavailable(name, data_dir, split, spec,
                           f"{catalog} is a tfrecord build, which needs TensorFlow to read; "
                           f"prepare it again with --file_format array_record.")
    try:
        # tfds.data_source also answers inside tfds.testing.mock_data, with no files at all.
        source = tfds.data_source(spec.tfds_name, data_dir=str(data_dir), split=split,
                                  download=False)
    except Exception as err:  # tfds says "not prepared" with several exception types
        reason = "none of the files below exist."
        if catalog.is_dir():
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            reason = f"tensorflow-datasets could not read {catalog}: {first}"
        raise _unavailable(name, data_dir, split, spec, reason) from err
    info = getattr(source, "dataset_info", None)  # absent from a mocked source
    build = Path(str(info.data_dir)) if info is not None else catalog
    return _cached_read(
        lambda: _read_source(source, spec, str(build), transpose=spec.transposed_in_tfds),
        build, name, split, cache_dir)


def load_images(name: str, data_dir, split: str, *,
                cache_dir=None) -> tuple[np.ndarray, np.ndarray]:
    """Images and labels of one split of a local MNIST / CIFAR-10 / EMNIST / FEMNIST copy.

    Args:
      name: "mnist", "cifar10", "emnist" (= "emnist/byclass", 62 classes),
        "emnist/<config>" (bymerge, balanced, letters, digits, mnist) or "femnist".
      data_dir: the directory holding one of the layouts in the module docstring.
      split: "train" or "test" (tfds builds also take slices, e.g. "train[:10%]").
      cache_dir: where arrays decoded from a tfds build are kept as .npz for the
        next call (under `tfds_local/`; None: FEDJAX_SIM_CACHE or
        ~/.cache/fedjax_sim; False: no cache). Keyed by the build's files, so
        a rebuilt dataset is decoded again. .npz sources are read directly.

    Returns:
      (images, labels): uint8 [N, H, W] (grayscale) or [N, H, W, C], and int32 [N].

    Raises:
      DataUnavailable: data_dir is missing, or holds none of the layouts; the
        message names every path looked for and how to prepare it.
      ValueError: a file was found but holds the wrong shapes, dtypes or keys.
    """
    images, labels, _ = _load(name, data_dir, split, cache_dir)
    return images, labels


def load_femnist(data_dir, split: str, *,
                 cache_dir=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FEMNIST images, labels (62 classes) and writer ids, for `natural_id_partition`.

    Args and sources as `load_images("femnist", ...)`.

    Returns:
      (images uint8 [N, 28, 28], labels int32 [N], writer_ids [N]: int64 if
      the file holds integers, else strings such as LEAF's "f0000_14").
    """
    return _load("femnist", data_dir, split, cache_dir)


# ---------------------------------------------------------------------------- builder


@functools.cache
def npz_builder():
    """The tfds `GeneratorBasedBuilder` that turns local .npz files into an array_record build.

    Defined on first use (importing tfds takes a second) but in this package
    module, where tfds looks for its metadata. Its configs are the names of
    `SPECS` ("/" written "_"); each reads `<manual_dir>/<name>/<split>.npz`
    (splits "train" and "test", whichever exist) with `tfds.features.Tensor`
    features, which encode and decode without TensorFlow.
    """
    import tensorflow_datasets as tfds

    class FedjaxSimImages(tfds.core.GeneratorBasedBuilder):
        """Local MNIST / CIFAR-10 / EMNIST / FEMNIST .npz files as an array_record build."""

        VERSION = tfds.core.Version(BUILDER_VERSION)
        RELEASE_NOTES = {BUILDER_VERSION: "First release."}
        BUILDER_CONFIGS = [tfds.core.BuilderConfig(name=_config_name(n), description=n)
                           for n in SPECS]
        _NAMES = {_config_name(n): n for n in SPECS}
        MANUAL_DOWNLOAD_INSTRUCTIONS = (
            "Place <manual_dir>/<name>/train.npz and test.npz (keys x: uint8 images, y: int "
            "labels; FEMNIST also writer_id), see fedjax_sim.data.tfds_local."
        )

        def _name(self) -> str:
            return self._NAMES[self.builder_config.name]

        def _info(self):
            spec = SPECS[self._name()]
            features = {
                "image": tfds.features.Tensor(shape=spec.image_shape, dtype=np.uint8),
                "label": tfds.features.Tensor(shape=(), dtype=np.int64),
            }
            if spec.has_writers:
                features["writer_id"] = tfds.features.Text()
            return self.dataset_info_from_configs(
                features=tfds.features.FeaturesDict(features), disable_shuffling=True
            )

        def _split_generators(self, dl_manager):
            folder = Path(dl_manager.manual_dir) / self._name()
            splits = {p.stem: p for p in sorted(folder.glob("*.npz"))}
            if not splits:
                raise DataUnavailable(
                    f"no <split>.npz files in {folder}; {self.MANUAL_DOWNLOAD_INSTRUCTIONS}"
                )
            return {s: self._generate_examples(p) for s, p in splits.items()}

        def _generate_examples(self, path):
            images, labels, writers = _read_npz(Path(path), SPECS[self._name()])
            for i in range(labels.shape[0]):
                example = {"image": images[i], "label": int(labels[i])}
                if writers is not None:
                    example["writer_id"] = str(writers[i])
                yield i, example

    return FedjaxSimImages


def prepare_npz_build(name: str, manual_dir, data_dir) -> Path:
    """Builds `<data_dir>/fedjax_sim_images/<config>/1.0.0/` from `<manual_dir>/<name>/*.npz`.

    Returns:
      The build directory, which `load_images(name, data_dir, split)` then reads.
    """
    require("tensorflow_datasets", "tfds", "preparing a tfds build")
    import tensorflow_datasets as tfds

    _spec(name)
    folder = Path(manual_dir).expanduser() / name
    if not any(folder.glob("*.npz")):
        raise DataUnavailable(
            f"no .npz files in {folder}: put train.npz / test.npz there (keys x: uint8 "
            f"images, y: int labels{', writer_id' if SPECS[name].has_writers else ''})."
        )
    builder = npz_builder()(config=_config_name(name), data_dir=str(Path(data_dir).expanduser()),
                            file_format="array_record")
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=str(Path(manual_dir).expanduser()))
    )
    return Path(builder.data_dir)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedjax_sim.data.tfds_local",
        description="Prepare an array_record build of local .npz image files (no TensorFlow).",
    )
    parser.add_argument("name", choices=sorted(SPECS))
    parser.add_argument("--manual_dir", required=True,
                        help="holds <name>/train.npz and <name>/test.npz")
    parser.add_argument("--data_dir", required=True, help="where the build goes (load's data_dir)")
    args = parser.parse_args(argv)
    # The builder must live in the package module, not in __main__ (tfds looks beside it).
    from fedjax_sim.data import tfds_local

    try:
        print(tfds_local.prepare_npz_build(args.name, args.manual_dir, args.data_dir))
    except (DataUnavailable, ValueError) as err:  # one line, as `fedjax-sim` errors
        print(f"{parser.prog}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except OSError as err:
        where = f"{err.filename}: " if err.filename else ""
        print(f"{parser.prog}: error: {where}{err.strerror or err}", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
