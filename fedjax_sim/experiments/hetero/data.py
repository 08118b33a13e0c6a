"""The clients of the heterogeneous-FL experiments: Flower partitioners over images.

Protocol. For each rotation cluster c the partitioner cuts the whole dataset
into num_clients/rotations clients with its own seed, turned c·360°/rotations
(np.rot90): every example appears once per cluster. Each client holds out
⌊test_fraction·n_i⌋ of its (shuffled) examples as its test set (Flower's
per-partition train/test split), so every metric is over the same clients. A
noisy client's labels, train and test, become a uniform random class with
probability `label_noise`: its data is harder, not only mislabelled in
training. Seed i draws its own partitions and noise (seed sequence [seed, i]);
every method gets the same data, init keys and round keys per seed.

Unseen clients (setting unseen_clients > 0): seed i holds out
`unseen_count(s)` of its clients, drawn from its own stream (seed sequence
[seed, i, UNSEEN_STREAM]) and the same for every method; the methods train on
the other clients only, and the held-out ones keep their own train and test
parts for the evaluation (`metrics.py`).

Clients are stored copies, or (setting clients=views) `ClientViews`: each
client's partition indices and its cluster's rotation into the images held
once, gathered per cohort chunk inside the round, with the same numbers.
"""

from __future__ import annotations

import numpy as np

from fedjax_sim.data import partition
from fedjax_sim.data.archives import DataUnavailable
from fedjax_sim.data.federated import ClientViews, FederatedData, stack_views
from fedjax_sim.data.images import (
    default_rotations,
    digits,
    mnist_5k,
    rotate,
    rotation_maps,
)
from fedjax_sim.experiments.base import stack_seeds
from fedjax_sim.experiments.unseen import held_out_count, held_out_ids, pick_clients, split_ids

DATASETS = ("digits", "mnist")
PARTITIONERS = ("iid", "dirichlet", "pathological", "shard", "size")
SIZE_FNS = {"linear": partition.linear_partition, "square": partition.square_partition,
            "exponential": partition.exponential_partition}
# Data settings read by one partitioner only.
PARTITIONER_READS = {"alpha": "dirichlet", "min_partition_size": "dirichlet",
                     "classes_per_client": "pathological", "class_assignment": "pathological",
                     "shards_per_client": "shard", "size_fn": "size"}

_IMAGES: dict = {}


def load_images(s: dict) -> tuple[np.ndarray, np.ndarray]:
    key = (s["dataset"], s["cache_dir"])
    if key not in _IMAGES:
        try:
            _IMAGES.clear()
            _IMAGES[key] = (mnist_5k(s["cache_dir"] or None) if s["dataset"] == "mnist"
                            else digits())
        except DataUnavailable as err:
            raise ValueError(str(err)) from None
    return _IMAGES[key]


def client_indices(labels: np.ndarray, s: dict, seed: int) -> list[np.ndarray]:
    """One rotation cluster's clients: the partitioner `s["partitioner"]` over every example."""
    m, p, n = s["num_clients"] // s["rotations"], s["partitioner"], len(labels)
    try:
        if p == "iid":
            return partition.iid_partition(n, m, seed=seed)
        if p == "dirichlet":
            return partition.dirichlet_partition(
                labels, m, s["alpha"], min_partition_size=s["min_partition_size"], seed=seed)
        if p == "pathological":
            return partition.pathological_partition(
                labels, m, s["classes_per_client"], class_assignment_mode=s["class_assignment"],
                seed=seed)
        if p == "shard":
            return partition.shard_partition(labels, m,
                                             num_shards_per_partition=s["shards_per_client"],
                                             seed=seed)
        return SIZE_FNS[s["size_fn"]](n, m, seed=seed)
    except ValueError as err:
        raise ValueError(f"setting partitioner={p} (Flower's names; num_clients per rotation "
                         f"cluster = {m}): {err}") from None


def seed_parts(s: dict, i: int) -> list[tuple]:
    """Seed i's clients as indices: (examples [n_i], labels [n_i], train count, cluster, noisy).

    The labels are the examples' own, but a noisy client's are redrawn with
    probability label_noise (the same draws, in the same order, whatever the clients'
    storage).
    """
    _, labels = load_images(s)
    per = s["num_clients"] // s["rotations"]
    rng = np.random.default_rng([s["seed"], i])
    parts = []
    for c in range(s["rotations"]):
        seed = int(np.random.SeedSequence([s["seed"], i, c]).generate_state(1)[0])
        for j, idx in enumerate(client_indices(labels, s, seed)):
            y = labels[idx].copy()
            noisy = j >= per - s["noisy_clients"]
            if noisy:
                flip = rng.random(len(y)) < s["label_noise"]
                y[flip] = rng.integers(0, 10, int(flip.sum()))
            parts.append((idx, y, len(y) - int(s["test_fraction"] * len(y)), c, noisy))
    return parts


def seed_clients(s: dict, i: int) -> list[tuple]:
    """Seed i's clients: (train x, train y, test x, test y, cluster, noisy) each."""
    images, _ = load_images(s)
    turns = default_rotations(s["rotations"])
    clients = []
    for idx, y, cut, c, noisy in seed_parts(s, i):
        x = rotate(images[idx], turns[c])
        clients.append((x[:cut], y[:cut], x[cut:], y[cut:], c, noisy))
    return clients


def _views(s: dict, per_seed: list[list[tuple]]) -> tuple:
    """Every seed's (train, test) clients as `ClientViews` of the images held once.

    A client's rows are its partition indices and its transform its cluster's
    rotation. A relabelled example (a noisy client's) cannot be a row of the
    images' own labels: those rows alone are appended to the base, with their new
    labels (every seed's, so all seeds share one base).
    """
    images, labels = load_images(s)
    extra_x, extra_y, rows_of = [], [], []
    total = len(labels)
    for parts in per_seed:
        seed_rows = []
        for idx, y, _, _, _ in parts:
            changed = y != labels[idx]
            rows = idx.copy()
            rows[changed] = total + np.arange(int(changed.sum()))
            total += int(changed.sum())
            extra_x.append(images[idx[changed]])
            extra_y.append(y[changed])
            seed_rows.append(rows)
        rows_of.append(seed_rows)
    base_x = np.concatenate([images, *extra_x])
    base_y = np.concatenate([labels, *extra_y])
    turns = default_rotations(s["rotations"])
    maps = rotation_maps(images.shape[1:], turns) if len(turns) > 1 else None

    def views(cut_rows, width):
        out = []
        for parts, seed_rows in zip(per_seed, rows_of, strict=True):
            rows = np.zeros((len(parts), width), np.int64)
            counts = np.zeros(len(parts), np.int32)
            for i, (p, r) in enumerate(zip(parts, seed_rows, strict=True)):
                mine = cut_rows(r, p[2])
                rows[i, :len(mine)], counts[i] = mine, len(mine)
            cluster = np.array([p[3] for p in parts], np.int32)
            out.append(ClientViews.from_indices(
                base_x, base_y, rows, counts, cluster,
                transform=None if maps is None else cluster, maps=maps))
        return stack_views(out)

    width = max(max(max(p[2] for p in parts), 1) for parts in per_seed)
    test_width = max(max(max(len(p[1]) - p[2] for p in parts), 1) for parts in per_seed)
    train = views(lambda r, cut: r[:cut], width)
    test = views(lambda r, cut: r[cut:], test_width)  # the same base: one buffer for both
    return train, test.replace(base_x=train.base_x, base_y=train.base_y, maps=train.maps)


def build_problem(s: dict) -> dict:
    """Train and test clients of every seed, stacked on a leading [seeds] axis, the
    held-out clients apart (`hold_out`).

    clients=views: `ClientViews` (partition indices and a rotation into the images,
    gathered per cohort chunk inside the round) with the same numbers as the copies.
    """
    return hold_out(s, _all_clients(s))


def _all_clients(s: dict) -> dict:
    """Every client of every seed (`build_problem` before the held-out clients go)."""
    images, _ = load_images(s)
    if s.get("clients", "views") == "views":
        per_seed = [seed_parts(s, i) for i in range(s["seeds"])]
        train, test = _views(s, per_seed)
        first = per_seed[0]
        return {"train": train, "test": test, "cluster": np.array([p[3] for p in first]),
                "noisy": np.array([p[4] for p in first]), "input_shape": images.shape[1:]}
    per_seed = [seed_clients(s, i) for i in range(s["seeds"])]
    widths = [max(max(len(c[1]) for c in cl), 1) for cl in per_seed]
    test_widths = [max(max(len(c[3]) for c in cl), 1) for cl in per_seed]

    def stack(part: int, width: int) -> FederatedData:
        feds = [FederatedData.from_clients([c[part] for c in cl], [c[part + 1] for c in cl],
                                           [c[4] for c in cl], n_max=width) for cl in per_seed]
        return stack_seeds(feds)

    first = per_seed[0]
    return {"train": stack(0, max(widths)), "test": stack(2, max(test_widths)),
            "cluster": np.array([c[4] for c in first]), "noisy": np.array([c[5] for c in first]),
            "input_shape": first[0][0].shape[1:]}


def unseen_count(s: dict) -> int:
    """The clients held out of training: unseen_clients · num_clients rounded, at least 1
    when unseen_clients > 0 (`unseen.held_out_count`; ValueError when none is left)."""
    return held_out_count(s.get("unseen_clients", 0.0), s["num_clients"])


def unseen_ids(s: dict, i: int) -> np.ndarray:
    """Seed i's held-out clients (sorted ids, `unseen_count(s)` of them): a draw without
    replacement from the seed's own stream, whatever the methods."""
    return held_out_ids(s["seed"], i, s["num_clients"], unseen_count(s))


def hold_out(s: dict, problem: dict) -> dict:
    """`problem` with each seed's `unseen_ids` moved out of "train" and "test" into
    "unseen_train" and "unseen_test"; "cluster" and "noisy" become [seeds, seen] (and
    "unseen_cluster", "unseen_noisy" [seeds, unseen]), and "unseen" [seeds, unseen] holds
    the ids. As it is when unseen_clients is 0."""
    if not unseen_count(s):
        return problem
    m = s["num_clients"]
    seen, unseen = split_ids(s["seed"], s["seeds"], m, unseen_count(s))
    cluster = np.broadcast_to(problem["cluster"], (s["seeds"], m))
    noisy = np.broadcast_to(problem["noisy"], (s["seeds"], m))
    rows = np.arange(s["seeds"])[:, None]
    return {**problem, "train": pick_clients(problem["train"], seen),
            "test": pick_clients(problem["test"], seen),
            "unseen_train": pick_clients(problem["train"], unseen),
            "unseen_test": pick_clients(problem["test"], unseen),
            "cluster": cluster[rows, seen], "noisy": noisy[rows, seen],
            "unseen_cluster": cluster[rows, unseen], "unseen_noisy": noisy[rows, unseen],
            "seen": seen, "unseen": unseen}
