"""CIFAR-10 from a `data_dir`: the python-pickle archive, pfl-research's pickles, npz or tfds.

Nothing is downloaded (docs/protocols.md#data-sources). `load_cifar10(data_dir, split)`
looks, in this order, for:

1. `<data_dir>/cifar-10-batches-py/`: the extracted python version of the archive
   (https://www.cs.toronto.edu/~kriz/cifar.html): `data_batch_1` … `data_batch_5`
   (train) and `test_batch` (test), each a pickled dict whose `data` is uint8
   [10000, 3072] (the red plane, then green, then blue, each row-major 32×32) and
   `labels` a list of 10000 ints.
2. `<data_dir>/cifar-10-python.tar.gz`: that archive itself, read member by member
   without extracting it.
3. `<data_dir>/cifar10_train.p` and `cifar10_test.p`: the pickles pfl-research's
   `pfl:benchmarks/dataset/cifar10/download_preprocess.py` writes, a tuple (images,
   labels [N, 1]) whose images are the archive's [N, 3072] rows reshaped to
   [N, 32, 32, 3] as they lie, i.e. not as pictures (see `pfl_layout`): they are
   turned back into pictures here, so every source gives the same images.
4. `fedjax_sim.data.tfds_local.load_images("cifar10", data_dir, split)`:
   `<data_dir>/cifar10/<split>.npz` (or `cifar10_<split>.npz`) with x uint8
   [N, 32, 32, 3] and y labels, or a tfds build (`tfds build cifar10 --file_format
   array_record`).

Pickles can run code when loaded; these are read with an unpickler that builds
nothing but numpy arrays, lists, dicts, numbers and strings (anything else is
refused naming the file).

Returns images uint8 [N, 32, 32, 3] (height, width, channel; upright) and labels
int32 [N]; a missing or empty `data_dir` raises `DataUnavailable` naming every
path looked for.
"""

from __future__ import annotations

import importlib
import io
import pickle
import tarfile
from pathlib import Path

import numpy as np

from fedjax_sim.data.archives import DataUnavailable

SPLITS = ("train", "test")
BATCHES_DIR = "cifar-10-batches-py"
ARCHIVE = "cifar-10-python.tar.gz"
PFL_PICKLES = {"train": "cifar10_train.p", "test": "cifar10_test.p"}
_MEMBERS = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10


def _multiarray():
    try:  # numpy >= 2
        return importlib.import_module("numpy._core.multiarray")
    except ImportError:  # numpy 1.26
        return importlib.import_module("numpy.core.multiarray")


class _ArraysOnly(pickle.Unpickler):
    """An unpickler that builds numpy arrays and plain containers, nothing else."""

    def find_class(self, module: str, name: str):
        if module in ("numpy.core.multiarray", "numpy._core.multiarray") and name in (
                "_reconstruct", "scalar"):
            return getattr(_multiarray(), name)
        if module == "numpy" and name in ("ndarray", "dtype"):
            return getattr(np, name)
        if module == "_codecs" and name == "encode":  # bytes pickled by Python 3, protocol 2
            import codecs

            return codecs.encode
        raise pickle.UnpicklingError(f"refusing to build {module}.{name}")


def _unpickle(data: bytes, where: str):
    try:
        return _ArraysOnly(io.BytesIO(data), encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError) as err:
        raise ValueError(f"{where}: not a CIFAR-10 pickle of numpy arrays ({err}).") from None


def planes_to_images(rows: np.ndarray) -> np.ndarray:
    """The archive's [N, 3072] rows (three 32×32 planes, R then G then B) as [N, 32, 32, 3]."""
    return np.ascontiguousarray(rows.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))


def pfl_layout(images: np.ndarray) -> np.ndarray:
    """Images [N, 32, 32, 3] laid out as pfl-research's CIFAR-10 pickles hold them: the
    archive's [N, 3072] rows reshaped to [N, 32, 32, 3] as they lie (pfl's
    `download_preprocess.py`), so pixel (i, j, c) holds plane value 96·i + 3·j + c. The
    inverse of the conversion `load_cifar10` applies to those pickles."""
    images = np.asarray(images)
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2).reshape(-1, *IMAGE_SHAPE))


def _batch(data: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
    batch = _unpickle(data, where)
    if not isinstance(batch, dict):
        raise ValueError(f"{where}: a CIFAR-10 batch is a dict with 'data' and 'labels'.")
    rows = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    rows = np.asarray(rows) if rows is not None else None
    if rows is None or labels is None or rows.ndim != 2 or rows.shape[1] != 3072:
        raise ValueError(f"{where}: a CIFAR-10 batch holds 'data' uint8 [N, 3072] and "
                         "'labels' [N].")
    labels = np.asarray(labels)
    if labels.shape != (rows.shape[0],):
        raise ValueError(f"{where}: {labels.shape} labels for {rows.shape[0]} images.")
    return planes_to_images(rows.astype(np.uint8)), labels


def _read_batches(files: list[tuple[str, bytes]]) -> tuple[np.ndarray, np.ndarray]:
    parts = [_batch(data, where) for where, data in files]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _from_dir(folder: Path, split: str):
    files = []
    for name in _MEMBERS[split]:
        path = folder / name
        if not path.is_file():
            raise ValueError(f"{folder} lacks {name} (the python archive's {split} split).")
        files.append((str(path), path.read_bytes()))
    return _read_batches(files)


def _from_archive(path: Path, split: str):
    try:
        with tarfile.open(path, "r:*") as tar:
            members = {Path(m.name).name: m for m in tar.getmembers() if m.isfile()}
            files = []
            for name in _MEMBERS[split]:
                if name not in members:
                    raise ValueError(f"{path} has no member {BATCHES_DIR}/{name}.")
                files.append((f"{path}:{members[name].name}",
                              tar.extractfile(members[name]).read()))
    except (tarfile.TarError, EOFError, OSError) as err:
        raise ValueError(f"{path}: not a readable tar.gz ({err}).") from None
    return _read_batches(files)


def _from_pfl(path: Path):
    loaded = _unpickle(path.read_bytes(), str(path))
    if not (isinstance(loaded, tuple) and len(loaded) == 2):
        raise ValueError(f"{path}: pfl-research's pickle is a tuple (images, labels).")
    images, labels = (np.asarray(a) for a in loaded)
    if images.ndim != 4 or images.shape[1:] != IMAGE_SHAPE:
        raise ValueError(f"{path}: images must be [N, 32, 32, 3]; got {images.shape}.")
    return planes_to_images(images.reshape(len(images), -1).astype(np.uint8)), \
        labels.reshape(len(images))


def _checked(images, labels, where: str) -> tuple[np.ndarray, np.ndarray]:
    labels = np.asarray(labels)
    if labels.dtype.kind not in "iu" or (labels.size and (labels.min() < 0
                                                          or labels.max() >= NUM_CLASSES)):
        raise ValueError(f"{where}: labels must be integers in [0, {NUM_CLASSES}).")
    return images, labels.astype(np.int32)


def sources(data_dir, split: str) -> list[Path]:
    """The paths `load_cifar10` tries first, in order (before the npz / tfds layouts)."""
    root = Path(data_dir).expanduser()
    return [root / BATCHES_DIR, root / ARCHIVE, root / PFL_PICKLES[split]]


# What a data_dir may hold, in one line (the experiments' refusals and setting help).
DATA_DIR_HELP = (
    "CIFAR-10 is read from the data_dir setting (nothing ships or downloads): the python "
    "archive cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html (or its "
    "extracted cifar-10-batches-py/ folder), pfl-research's cifar10_train.p and cifar10_test.p, "
    "cifar10/train.npz and test.npz (x uint8 [N, 32, 32, 3], y labels), or a tfds cifar10 "
    "build (array_record); set it with --set data_dir=DIR"
)


def load_cifar10(data_dir, split: str, *, cache_dir=None) -> tuple[np.ndarray, np.ndarray]:
    """One split of a local CIFAR-10 copy: (images uint8 [N, 32, 32, 3], labels int32 [N]).

    Args:
      data_dir: a directory holding one of the layouts of the module docstring.
      split: "train" (50 000 images in the full set) or "test" (10 000).
      cache_dir: for a tfds build's decoded arrays (`tfds_local.load_images`).

    Raises:
      DataUnavailable: none of the layouts is there; the message names each path.
      ValueError: a file was found but is not what its layout says (naming it).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}; got {split!r}.")
    if not data_dir:
        raise DataUnavailable("no data_dir was given: CIFAR-10 is read from a directory "
                              f"holding {BATCHES_DIR}/, {ARCHIVE}, pfl-research's "
                              f"{PFL_PICKLES[split]}, or cifar10/{split}.npz.")
    batches, archive, pfl = sources(data_dir, split)
    if batches.is_dir():
        return _checked(*_from_dir(batches, split), str(batches))
    if archive.is_file():
        return _checked(*_from_archive(archive, split), str(archive))
    if pfl.is_file():
        return _checked(*_from_pfl(pfl), str(pfl))
    from fedjax_sim.data.tfds_local import load_images

    try:
        return load_images("cifar10", data_dir, split, cache_dir=cache_dir)
    except DataUnavailable as err:
        raise DataUnavailable(
            f"CIFAR-10 ({split}) is not in data_dir={str(data_dir)!r}: looked for {batches}/ "
            f"(the python archive extracted), {archive} (the archive, from "
            f"https://www.cs.toronto.edu/~kriz/cifar.html), {pfl} (pfl-research's pickles), "
            "and then: " + " ".join(str(err).split("\n", 1)[-1].split())) from None


def write_archive(path, train: tuple, test: tuple, *, extracted: bool = False) -> Path:
    """Writes images and labels in the python archive's format (for tests and examples).

    train, test: (images uint8 [N, 32, 32, 3], labels [N]); the training images are cut
    into five batches. extracted=True writes the `cifar-10-batches-py/` folder under
    `path`, else `path/cifar-10-python.tar.gz`. Returns what was written.
    """
    def batch(images, labels, name):
        rows = np.asarray(images, np.uint8).transpose(0, 3, 1, 2).reshape(len(images), -1)
        return pickle.dumps({b"batch_label": name.encode(), b"labels": [int(v) for v in labels],
                             b"data": rows}, protocol=2)

    images, labels = train
    cuts = np.array_split(np.arange(len(images)), 5)
    files = {f"data_batch_{i + 1}": batch(images[c], np.asarray(labels)[c], f"batch {i + 1}")
             for i, c in enumerate(cuts)}
    files["test_batch"] = batch(*test, "test")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    if extracted:
        folder = root / BATCHES_DIR
        folder.mkdir(exist_ok=True)
        for name, data in files.items():
            (folder / name).write_bytes(data)
        return folder
    target = root / ARCHIVE
    with tarfile.open(target, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{BATCHES_DIR}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return target
