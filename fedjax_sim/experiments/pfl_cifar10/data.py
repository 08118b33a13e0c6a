"""The users of pfl-research's CIFAR-10 benchmark: images read once, users cut per seed.

pfl-research (Apple; arXiv:2404.06430), `pfl:benchmarks/dataset/cifar10/numpy.py` of
apple/pfl-research, makes its users from the 50 000 training images
(docs/protocols.md#cifar-10-pfl-research):

- `cifar10_iid`: a permutation of the images cut in order into users of
  `datapoints_per_user` (50: 1 000 users; a remainder makes one smaller last user);
- `cifar10`: after the same permutation, users of `datapoints_per_user` images whose
  class shares are drawn from Dir(alpha) (alpha = 0.1), pfl's
  `partition_by_dirichlet_class_distribution`: each of a user's images is drawn from
  a class picked by its shares, taking that class's last remaining image; a pick of
  an exhausted class draws again, and every `20 · datapoints_per_user` draws the
  shares are evened out by 2 % (renormalised). Users are made until fewer images
  than one user's are left (those are dropped).

Both draw from `np.random.RandomState(seed + i)` for seed i of the seeds axis, in
pfl's order of calls, so seed 0 of `seed=0` draws what pfl's `np.random.seed(0)`
run draws (the users are then pfl's when the images come in pfl's order).

Central evaluation reads every test image. Images stay uint8 (held once: the users
are index rows into them, `ClientViews`); the model standardizes them by the
training images' per-channel mean and standard deviation (`channel_stats`), the
statistics pfl standardizes its images with.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedjax_sim.data import ClientViews, stack_views
from fedjax_sim.data.archives import DataUnavailable
from fedjax_sim.data.cifar import DATA_DIR_HELP, load_cifar10, pfl_layout

DATASETS = ("cifar10_iid", "cifar10")
PIXEL_LAYOUTS = ("images", "pfl")
SPREAD_EVERY, SPREAD_BY = 20, 0.02  # pfl's spread_distribution_after_num_fails / _percentage


_CACHE: dict = {}


def load_split_images(s: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train images, train labels, test images, test labels) of data_dir, uint8 images in
    the setting's pixel layout (cached, one data set at a time).

    Raises:
      ValueError: in one line, when data_dir holds no CIFAR-10 (naming what is looked for).
    """
    key = (s["data_dir"], s.get("cache_dir", ""), s["pixel_layout"])
    if key in _CACHE:
        return _CACHE[key]
    if not s["data_dir"]:
        raise ValueError(f"setting data_dir is empty: {DATA_DIR_HELP}.")
    if not Path(s["data_dir"]).expanduser().is_dir():
        raise ValueError(f"setting data_dir={s['data_dir']!r} is not a directory: {DATA_DIR_HELP}.")
    try:
        parts = []
        for split in ("train", "test"):
            images, labels = load_cifar10(s["data_dir"], split, cache_dir=s.get("cache_dir")
                                          or None)
            if s["pixel_layout"] == "pfl":
                images = pfl_layout(images)
            parts += [np.asarray(images, np.uint8), np.asarray(labels, np.int32)]
    except DataUnavailable as err:
        raise ValueError(f"setting data_dir={s['data_dir']!r}: "
                         + " ".join(str(err).split())) from None
    _CACHE.clear()
    _CACHE[key] = out = tuple(parts)
    return out


def channel_stats(images: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and standard deviation (ddof 0) of uint8 images [N, H, W, C], exact in
    float64 (from each channel's histogram: no float copy of the images)."""
    flat = np.asarray(images).reshape(-1, images.shape[-1])
    values = np.arange(256, dtype=np.float64)
    means, stds = [], []
    for c in range(flat.shape[1]):
        counts = np.bincount(flat[:, c], minlength=256).astype(np.float64)
        total = counts.sum()
        mean = (counts * values).sum() / total
        means.append(float(mean))
        stds.append(float(np.sqrt((counts * (values - mean) ** 2).sum() / total)))
    return tuple(means), tuple(stds)


def iid_users(num_images: int, per_user: int, rng: np.random.RandomState) -> list[np.ndarray]:
    """pfl's `cifar10_iid` users: a permutation cut in order into users of `per_user`
    images (the last one smaller when they do not divide)."""
    order = rng.permutation(num_images)
    return [order[i:i + per_user] for i in range(0, num_images, per_user)]


def dirichlet_users(labels: np.ndarray, per_user: int, alpha: float,
                    rng: np.random.RandomState) -> list[np.ndarray]:
    """pfl's `cifar10` users (`partition_by_dirichlet_class_distribution` after a
    permutation of the images): index arrays into `labels`, in pfl's order of draws."""
    order = rng.permutation(len(labels))
    permuted = labels[order]
    classes = int(permuted.max()) + 1  # pfl: the distinct labels, 0..C-1
    left = [list(np.flatnonzero(permuted == c)) for c in range(classes)]
    remaining = len(permuted)
    users = []
    while True:
        shares = rng.dirichlet([alpha] * classes)
        cdf = np.cumsum(shares)
        cdf[-1] = 1.0
        if per_user > remaining:
            break
        user: list[int] = []
        draws = 1
        while len(user) < per_user:
            c = int(np.argmax(rng.uniform() < cdf))
            if left[c]:
                user.append(left[c].pop())
            if draws % (per_user * SPREAD_EVERY) == 0:
                shares = (shares + SPREAD_BY) / (shares + SPREAD_BY).sum()
                cdf = np.cumsum(shares)
                shares[-1] = 1.0  # as pfl writes it (the cdf's last entry is not pinned here)
            draws += 1
        remaining -= per_user
        users.append(order[np.asarray(user, np.int64)])
    return users


def seed_users(s: dict, labels: np.ndarray, i: int) -> list[np.ndarray]:
    """Seed i's users: index arrays into the training images."""
    rng = np.random.RandomState(s["seed"] + i)
    if s["dataset"] == "cifar10_iid":
        return iid_users(len(labels), s["datapoints_per_user"], rng)
    return dirichlet_users(labels, s["datapoints_per_user"], s["partition_alpha"], rng)


def user_views(images: np.ndarray, labels: np.ndarray, per_seed: list[list[np.ndarray]]):
    """Every seed's users as `ClientViews` into the images held once, stacked on a leading
    [seeds] axis (every seed padded to the same user count and n_max)."""
    m = max(len(users) for users in per_seed)
    n_max = max(len(u) for users in per_seed for u in users)
    views = []
    for users in per_seed:
        rows = np.zeros((m, n_max), np.int64)
        counts = np.zeros(m, np.int32)
        for j, u in enumerate(users):
            rows[j, :len(u)], counts[j] = u, len(u)
        views.append(ClientViews.from_indices(images, labels, rows, num_examples=counts))
    return stack_views(views)


def build_problem(s: dict, arrays=None) -> dict:
    """Users of every seed and the test set: {"train": ClientViews [seeds, m, n_max, ...],
    "test_x" uint8 [T, 32, 32, 3], "test_y" int32 [T], "users": [seeds] user counts,
    "mean", "std": the training images' channel statistics}.

    arrays: (train x, train y, test x, test y) to use instead of data_dir's (synthetic
    data of the benchmarks).
    """
    tx, ty, vx, vy = load_split_images(s) if arrays is None else arrays
    per_seed = [seed_users(s, ty, i) for i in range(s["seeds"])]
    mean, std = channel_stats(tx)
    return {"train": user_views(tx, ty, per_seed), "test_x": vx, "test_y": vy,
            "users": [len(u) for u in per_seed], "mean": mean, "std": std,
            "sizes": sorted({len(u) for users in per_seed for u in users})}
