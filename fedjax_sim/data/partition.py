"""Non-IID client partitions of a labelled dataset, named after Flower Datasets' partitioners.

Researchers describe splits by the names of Flower Datasets (flwr-datasets)
partitioners; these functions keep those names, parameters and semantics, as
pure numpy functions of a label array (or a count, or natural ids) that return
one int64 index array per client, deterministic for a seed.

=============================  ===========================================  ================
function                       Flower Datasets counterpart                  cluster labels
=============================  ===========================================  ================
`iid_partition`                `IidPartitioner`                             none
`dirichlet_partition`          `DirichletPartitioner`                       none
`pathological_partition`       `PathologicalPartitioner`                    none
`shard_partition`              `ShardPartitioner`                           none
`size_partition`               `SizePartitioner`                            none
`linear_partition`             `LinearPartitioner`                          none
`square_partition`             `SquarePartitioner`                          none
`exponential_partition`        `ExponentialPartitioner`                     none
`id_to_size_partition`         `IdToSizeFncPartitioner`                     none
`natural_id_partition`         `NaturalIdPartitioner`                       none
`assign_clusters`              (none: IFCA's contiguous/random clusters)    yes
`replicated_clusters`          (none: IFCA's rotated-MNIST protocol)        yes
`rotation_clusters`            (none: rotated-MNIST/CIFAR feature shift)    yes
`feature_shift_clusters`       (none: any per-cluster transform)            yes
`to_federated`                 (FederatedDataset.load_partition, stacked)   passed through
=============================  ===========================================  ================

Where these differ from Flower, and why:

- Flower partitions a Hugging Face dataset that `FederatedDataset` has already
  shuffled (shuffle=True, seed=42) and takes each class's (or the whole
  dataset's) examples in that order. A function here is the whole pipeline:
  with `shuffle=True` (the default) it draws that preliminary permutation from
  its own seed, so the result never depends on how the source arrays happen to
  be sorted. `shuffle=False` keeps the source order where Flower would.
- One seed drives everything (one `np.random.default_rng(seed)`); Flower's
  partitioner and FederatedDataset hold two. Same distribution, other draws:
  the index lists are not bit-identical to Flower's.
- `dirichlet_partition` refuses up front a `min_partition_size` that no draw
  can satisfy (num_clients · min_partition_size > number of examples) instead
  of retrying; its retry loop draws at most `max_attempts` (default 10) times
  and raises ValueError, naming the smallest size reached, without Flower's
  warning per failed attempt (Flower makes up to 11 draws, its counter
  running 0..10; here the count is the setting).
- The size-skew partitioners refuse a client left with 0 examples and a
  size function that overflows (ExponentialPartitioner with many clients), as
  Flower does, but say which setting to change.
- `natural_id_partition` also returns the natural id of each client (Flower's
  `partition_id_to_natural_id`), in sorted order as Flower numbers them.

Bad requests raise ValueError naming the setting and what is allowed: more
classes per client than classes, more clients than examples, alpha <= 0, a
shard configuration that leaves a client empty, sizes beyond the dataset.

Example (label skew, then IFCA's rotated clusters)::

    parts = dirichlet_partition(labels, num_clients=20, alpha=0.3, seed=0)
    data = to_federated(images, labels, parts)                # cluster = -1
    idx, cluster = replicated_clusters(len(labels), 4, clients_per_cluster=80)
    data = to_federated(images, labels, idx, cluster,
                        transforms=rotations(default_quarter_turns(4)))
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import jax
import numpy as np

from fedjax_sim.data.federated import FederatedData

Indices = list  # list[np.ndarray]: client i's int64 indices into the source arrays

CLASS_ASSIGNMENT_MODES = ("random", "deterministic", "first-deterministic")
CLUSTER_MODES = ("contiguous", "random")


# ---------------------------------------------------------------------------- checks


def _check_count(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}.")
    return int(value)


def _labels_1d(labels) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be a 1-D array [N]; got shape {labels.shape}.")
    if labels.size == 0:
        raise ValueError("labels must hold at least one example; got an empty array.")
    return labels


def _check_clients_fit(num_clients: int, num_examples: int) -> None:
    if num_clients > num_examples:
        raise ValueError(
            f"num_clients={num_clients} exceeds the number of examples ({num_examples}); "
            f"use at most {num_examples} clients (each needs at least one example)."
        )


def _shuffle_lists(parts: Indices, rng: np.random.Generator, shuffle: bool) -> Indices:
    out = [np.asarray(p, np.int64) for p in parts]
    if shuffle:
        for p in out:
            rng.shuffle(p)
    return out


def _class_members(labels: np.ndarray, rng: np.random.Generator, shuffle: bool):
    """(sorted classes, each class's indices), in a random order when shuffling."""
    order = rng.permutation(labels.size) if shuffle else np.arange(labels.size)
    classes = np.unique(labels)
    by_class = [order[labels[order] == c] for c in classes]
    return classes, by_class


# ---------------------------------------------------------------------------- IID


def iid_partition(num_examples: int, num_clients: int, *, shuffle: bool = True,
                  seed: int = 42) -> Indices:
    """Flower's IidPartitioner: contiguous, near-equal shards of a shuffled dataset.

    Sizes differ by at most one, the first `num_examples % num_clients` clients
    holding one more (Hugging Face `Dataset.shard(contiguous=True)`).

    Args:
      num_examples: N, the size of the dataset.
      num_clients: m >= 1, at most N.
      shuffle: permute the dataset first (what FederatedDataset does); False
        cuts the source order.
      seed: seed of the permutation.

    Returns:
      m int64 arrays of indices in [0, N), disjoint, covering every example.
    """
    n = _check_count("num_examples", num_examples)
    m = _check_count("num_clients", num_clients)
    _check_clients_fit(m, n)
    rng = np.random.default_rng(seed)
    order = rng.permutation(n) if shuffle else np.arange(n)
    return [np.asarray(p, np.int64) for p in np.array_split(order, m)]


# ---------------------------------------------------------------------------- Dirichlet


def _dirichlet_alpha(alpha, num_clients: int) -> np.ndarray:
    a = np.asarray(alpha, np.float64)
    if a.ndim == 0:
        a = np.full((num_clients,), float(a))
    elif a.ndim == 1 and a.shape[0] != num_clients:
        raise ValueError(
            f"alpha given per client must have num_clients={num_clients} values; "
            f"got {a.shape[0]}."
        )
    elif a.ndim > 1:
        raise ValueError(f"alpha must be a number or a [num_clients] vector; got shape {a.shape}.")
    if not np.all(np.isfinite(a)) or not np.all(a > 0):
        raise ValueError(f"alpha must be finite and > 0 (Dirichlet concentration); got {alpha!r}.")
    return a


def dirichlet_partition(
    labels,
    num_clients: int,
    alpha,
    *,
    min_partition_size: int = 10,
    self_balancing: bool = False,
    shuffle: bool = True,
    seed: int = 42,
    max_attempts: int = 10,
) -> Indices:
    """Flower's DirichletPartitioner: label skew with proportions drawn from Dir(alpha).

    For each class (in sorted order) a vector p ~ Dir(alpha) over the clients
    splits that class's examples: client j receives the slice between
    floor(N_c · cumsum(p)[j-1]) and floor(N_c · cumsum(p)[j]). With
    `self_balancing`, a client already holding more than N/m examples gets
    p_j = 0 for the later classes (renormalized), as in the code of
    Yurochkin et al. 2019. The draw is repeated until every client holds at
    least `min_partition_size` examples, at most `max_attempts` times.

    Large alpha tends to IID (every client near N/m examples of each class in
    proportion); small alpha gives clients dominated by a few classes.

    Args:
      labels: [N] class labels (any sortable values).
      num_clients: m >= 1, at most N.
      alpha: concentration > 0, a number or an [m] vector.
      min_partition_size: the smallest acceptable client, 0 <= it <= N/m.
      self_balancing: stop filling clients past the average size.
      shuffle: permute each class's examples before splitting (Flower relies on
        FederatedDataset having shuffled the dataset) and each client's list
        after.
      seed: seed of the single generator behind every draw.
      max_attempts: how many Dirichlet draws to try before giving up.

    Returns:
      m int64 index arrays, disjoint, covering every example.

    Raises:
      ValueError: a bad setting, or no draw met min_partition_size.
    """
    labels = _labels_1d(labels)
    n = labels.size
    m = _check_count("num_clients", num_clients)
    _check_clients_fit(m, n)
    a = _dirichlet_alpha(alpha, m)
    min_size = _check_count("min_partition_size", min_partition_size, minimum=0)
    attempts = _check_count("max_attempts", max_attempts)
    if m * min_size > n:
        raise ValueError(
            f"min_partition_size={min_size} cannot hold for num_clients={m}: that needs "
            f"{m * min_size} examples and there are {n}; use min_partition_size <= {n // m}."
        )
    rng = np.random.default_rng(seed)
    _, by_class = _class_members(labels, rng, shuffle)
    average = n / m
    smallest = 0
    for _ in range(attempts):
        sizes = np.zeros(m, np.int64)
        parts: list[list[np.ndarray]] = [[] for _ in range(m)]
        for members in by_class:
            p = rng.dirichlet(a)
            if self_balancing:
                # Never all zero: the clients over the average cannot hold all N examples.
                p = np.where(sizes > average, 0.0, p)
                p = p / p.sum()
            cuts = (np.cumsum(p) * members.size).astype(np.int64)[:-1]
            for j, piece in enumerate(np.split(members, cuts)):
                parts[j].append(piece)
                sizes[j] += piece.size
        smallest = int(sizes.min())
        if smallest >= min_size:
            return _shuffle_lists([np.concatenate(p) for p in parts], rng, shuffle)
    raise ValueError(
        f"min_partition_size={min_size} was not met in max_attempts={attempts} Dirichlet "
        f"draws with alpha={alpha!r} (the smallest client had {smallest} examples); raise "
        f"alpha, lower min_partition_size or num_clients, or allow more max_attempts."
    )


# ---------------------------------------------------------------------------- pathological


def _pathological_classes(num_classes: int, m: int, c: int, mode: str,
                          rng: np.random.Generator) -> list[np.ndarray]:
    """Which class positions (into the sorted classes) each client holds."""
    if mode == "deterministic":
        return [(j + np.arange(c)) % num_classes for j in range(m)]
    if mode == "random":
        return [rng.choice(num_classes, size=c, replace=False) for _ in range(m)]
    out = []
    for j in range(m):
        first = j % num_classes
        rest = np.delete(np.arange(num_classes), first)
        out.append(np.concatenate([[first], rng.choice(rest, size=c - 1, replace=False)]))
    return out


def pathological_partition(
    labels,
    num_clients: int,
    num_classes_per_partition: int,
    *,
    class_assignment_mode: str = "random",
    shuffle: bool = True,
    seed: int = 42,
) -> Indices:
    """Flower's PathologicalPartitioner: each client holds exactly c classes.

    Classes are chosen per client by `class_assignment_mode`:
    "random" (c distinct classes uniformly), "deterministic" (client j holds
    classes (j + i) mod K, i < c) or "first-deterministic" (the first is
    j mod K, the other c-1 random; Li et al. 2021's setting). Each class's
    examples are then cut into near-equal parts, one per client holding it,
    clients in order. A class no client drew is left out, with a warning.

    Args:
      labels: [N] class labels; K = the number of distinct labels.
      num_clients: m >= 1, at most N.
      num_classes_per_partition: c, 1 <= c <= K.
      class_assignment_mode: one of "random", "deterministic", "first-deterministic".
      shuffle: permute each class's examples before cutting, and each client's
        list after.
      seed: seed of the class choice and of the shuffles.

    Returns:
      m int64 index arrays, disjoint; client j's labels take exactly c values.
    """
    labels = _labels_1d(labels)
    m = _check_count("num_clients", num_clients)
    _check_clients_fit(m, labels.size)
    c = _check_count("num_classes_per_partition", num_classes_per_partition)
    if class_assignment_mode not in CLASS_ASSIGNMENT_MODES:
        raise ValueError(
            f"class_assignment_mode must be one of {CLASS_ASSIGNMENT_MODES}; "
            f"got {class_assignment_mode!r}."
        )
    rng = np.random.default_rng(seed)
    classes, by_class = _class_members(labels, rng, shuffle)
    if c > classes.size:
        raise ValueError(
            f"num_classes_per_partition={c} exceeds the {classes.size} classes in labels; "
            f"use at most {classes.size}."
        )
    chosen = _pathological_classes(classes.size, m, c, class_assignment_mode, rng)
    holders = [[j for j in range(m) if k in chosen[j]] for k in range(classes.size)]
    for k, h in enumerate(holders):
        if len(h) > by_class[k].size:
            raise ValueError(
                f"class {classes[k]!r} has {by_class[k].size} examples but "
                f"{len(h)} clients need one; lower num_clients or num_classes_per_partition, "
                f"or try class_assignment_mode='deterministic'."
            )
    unused = [classes[k].item() for k, h in enumerate(holders) if not h]
    if unused:
        warnings.warn(
            f"classes {unused} are held by no client under this configuration "
            f"(num_clients={m}, num_classes_per_partition={c}, "
            f"class_assignment_mode={class_assignment_mode!r}); their examples are left out.",
            stacklevel=2,
        )
    parts: list[list[np.ndarray]] = [[] for _ in range(m)]
    for k, h in enumerate(holders):
        if h:
            for j, piece in zip(h, np.array_split(by_class[k], len(h)), strict=True):
                parts[j].append(piece)
    return _shuffle_lists([np.concatenate(p) for p in parts], rng, shuffle)


# ---------------------------------------------------------------------------- shards


def shard_partition(
    labels,
    num_clients: int,
    *,
    num_shards_per_partition: int | None = None,
    shard_size: int | None = None,
    keep_incomplete_shard: bool = False,
    shuffle: bool = True,
    seed: int = 42,
) -> Indices:
    """Flower's ShardPartitioner: sort by label, cut into shards, deal shards to clients.

    The FedAvg paper's split (McMahan et al. 2017: 200 shards of 300 MNIST
    images, 2 per client). The three ways to specify it, as in Flower:

    1. `num_shards_per_partition` (and optionally `shard_size`): every client
       gets that many shards of one size; with no `shard_size` it is
       floor(N / (m · shards per client)).
    2. `shard_size` with `keep_incomplete_shard=False`: floor(N / shard_size)
       equal shards are dealt out, the first clients taking one extra.
    3. `shard_size` with `keep_incomplete_shard=True`: the last, smaller shard
       is dealt too, so every example is used.

    Args:
      labels: [N] labels to sort by (stable, after the preliminary shuffle).
      num_clients: m >= 1, at most N.
      num_shards_per_partition: shards per client, or None (then shard_size).
      shard_size: examples per shard, or None (computed, case 1).
      keep_incomplete_shard: deal the last, incomplete shard (cases 1 and 3).
      shuffle: shuffle the dataset before the stable sort (ties in random
        order, as FederatedDataset's shuffle gives Flower) and each client's
        list after.
      seed: seed of the shuffles and of the random dealing of shards.

    Returns:
      m int64 index arrays, disjoint; every client receives at least one shard.
    """
    labels = _labels_1d(labels)
    n = labels.size
    m = _check_count("num_clients", num_clients)
    _check_clients_fit(m, n)
    if num_shards_per_partition is not None:
        num_shards_per_partition = _check_count("num_shards_per_partition",
                                                num_shards_per_partition)
    if shard_size is not None:
        shard_size = _check_count("shard_size", shard_size)
    rng = np.random.default_rng(seed)
    order = rng.permutation(n) if shuffle else np.arange(n)
    order = order[np.argsort(labels[order], kind="stable")]

    if num_shards_per_partition is not None:
        used = m * num_shards_per_partition
        per_client = np.full(m, num_shards_per_partition)
        if shard_size is None:
            shard_size = n // used
            if shard_size == 0:
                raise ValueError(
                    f"num_clients={m} x num_shards_per_partition={num_shards_per_partition} = "
                    f"{used} shards exceed the {n} examples; use at most {n} shards in all."
                )
            usable = math.ceil(n / shard_size) if keep_incomplete_shard else n // shard_size
        else:
            if shard_size * used > n:
                raise ValueError(
                    f"shard_size={shard_size} x num_shards_per_partition="
                    f"{num_shards_per_partition} x num_clients={m} = {shard_size * used} "
                    f"examples are needed and there are {n}; lower one of them."
                )
            usable = n // shard_size
    else:
        if shard_size is None:
            raise ValueError(
                "shard_partition needs num_shards_per_partition or shard_size; got neither."
            )
        used = math.ceil(n / shard_size) if keep_incomplete_shard else n // shard_size
        usable = used
        per_client = np.full(m, used // m)
        per_client[: used - m * (used // m)] += 1
    if usable < m or used < m:
        raise ValueError(
            f"shard_size={shard_size} leaves {min(usable, used)} shards for num_clients={m}, "
            f"so some client would be empty; lower shard_size or num_clients."
        )
    picked = rng.permutation(usable)[:used]
    parts = []
    for shards in np.split(picked, np.cumsum(per_client)[:-1]):
        pieces = [order[s * shard_size: min((s + 1) * shard_size, n)] for s in shards]
        parts.append(np.concatenate(pieces))
    return _shuffle_lists(parts, rng, shuffle)


# ---------------------------------------------------------------------------- size skew


def size_partition(num_examples: int, partition_sizes: Sequence[int], *, shuffle: bool = True,
                   seed: int = 42) -> Indices:
    """Flower's SizePartitioner: client j receives exactly partition_sizes[j] examples.

    Consecutive slices of the (shuffled) dataset; examples beyond the sum are
    left out (Flower warns; so does this).

    Args:
      num_examples: N.
      partition_sizes: m sizes >= 1 with sum <= N.
      shuffle: slice a permutation of the dataset (False: the source order).
      seed: seed of the permutation.
    """
    n = _check_count("num_examples", num_examples)
    sizes = np.asarray(partition_sizes)
    if sizes.ndim != 1 or sizes.size == 0 or not np.issubdtype(sizes.dtype, np.integer):
        raise ValueError(
            f"partition_sizes must be a non-empty sequence of integers; got {partition_sizes!r}."
        )
    if sizes.min() < 1:
        raise ValueError(f"partition_sizes must all be >= 1; got {sizes.tolist()}.")
    if sizes.sum() > n:
        raise ValueError(
            f"partition_sizes sum to {int(sizes.sum())}, more than the {n} examples; "
            f"lower them to a sum <= {n}."
        )
    if sizes.sum() < n:
        warnings.warn(
            f"partition_sizes sum to {int(sizes.sum())} of {n} examples; the rest are left out.",
            stacklevel=2,
        )
    rng = np.random.default_rng(seed)
    order = rng.permutation(n) if shuffle else np.arange(n)
    return [np.asarray(p, np.int64) for p in np.split(order[: sizes.sum()], np.cumsum(sizes)[:-1])]


def id_to_size_partition(num_examples: int, num_clients: int,
                         partition_id_to_size_fn: Callable[[np.ndarray], np.ndarray], *,
                         shuffle: bool = True, seed: int = 42) -> Indices:
    """Flower's IdToSizeFncPartitioner: client j's size proportional to f(j + 1).

    Sizes are floor(N · f(j) / Σ f) for ids j = 1..m, the remainder going to
    the last client, so every example is used; consecutive slices of the
    (shuffled) dataset, in client order.

    Args:
      num_examples: N.
      num_clients: m >= 1.
      partition_id_to_size_fn: f, vectorized over an array of ids 1..m (float).
      shuffle, seed: as in `size_partition`.

    Raises:
      ValueError: f gives a non-finite or negative value, or a client gets 0 examples.
    """
    n = _check_count("num_examples", num_examples)
    m = _check_count("num_clients", num_clients)
    _check_clients_fit(m, n)
    with np.errstate(over="ignore"):
        units = np.asarray(partition_id_to_size_fn(np.linspace(1, m, m)), np.float64)
    if units.shape != (m,) or not np.all(np.isfinite(units)) or np.any(units < 0) \
            or units.sum() <= 0:
        raise ValueError(
            f"partition_id_to_size_fn must give {m} finite, non-negative values (not all 0) "
            f"for ids 1..{m}; it overflows or fails for num_clients={m}."
        )
    sizes = (units / units.sum() * n).astype(np.int64)
    sizes[-1] += n - sizes.sum()
    if sizes.min() < 1:
        raise ValueError(
            f"num_clients={m} leaves client {int(np.argmin(sizes))} with 0 of the {n} "
            f"examples under this size function; lower num_clients."
        )
    rng = np.random.default_rng(seed)
    order = rng.permutation(n) if shuffle else np.arange(n)
    return [np.asarray(p, np.int64) for p in np.split(order, np.cumsum(sizes)[:-1])]


def linear_partition(num_examples: int, num_clients: int, *, shuffle: bool = True,
                     seed: int = 42) -> Indices:
    """Flower's LinearPartitioner: client j (1-based) gets ∝ j examples."""
    return id_to_size_partition(num_examples, num_clients, lambda ids: ids,
                                shuffle=shuffle, seed=seed)


def square_partition(num_examples: int, num_clients: int, *, shuffle: bool = True,
                     seed: int = 42) -> Indices:
    """Flower's SquarePartitioner: client j (1-based) gets ∝ j² examples."""
    return id_to_size_partition(num_examples, num_clients, np.square, shuffle=shuffle, seed=seed)


def exponential_partition(num_examples: int, num_clients: int, *, shuffle: bool = True,
                          seed: int = 42) -> Indices:
    """Flower's ExponentialPartitioner: client j (1-based) gets ∝ e^j examples."""
    return id_to_size_partition(num_examples, num_clients, np.exp, shuffle=shuffle, seed=seed)


# ---------------------------------------------------------------------------- natural ids


def natural_id_partition(ids) -> tuple[Indices, np.ndarray]:
    """Flower's NaturalIdPartitioner: one client per distinct id (writer, user, speaker).

    Clients are numbered by the sorted distinct ids, as Flower numbers them;
    each client's indices are in dataset order.

    Args:
      ids: [N] natural ids (ints or strings).

    Returns:
      (indices, natural_ids): m int64 index arrays, and the [m] id of each client.
    """
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"ids must be a non-empty 1-D array [N]; got shape {ids.shape}.")
    natural, codes = np.unique(ids, return_inverse=True)
    order = np.argsort(codes, kind="stable")
    counts = np.bincount(codes, minlength=natural.size)
    return [np.asarray(p, np.int64) for p in np.split(order, np.cumsum(counts)[:-1])], natural


# ---------------------------------------------------------------------------- clusters


def assign_clusters(num_clients: int, num_clusters: int, *, mode: str = "contiguous",
                    seed: int = 0) -> np.ndarray:
    """Ground-truth clusters of m clients in k near-equal groups.

    "contiguous": client i in cluster floor(i·k / m), clients numbered
    cluster-major (IFCA's official code). "random": the same group sizes in
    a random order.

    Returns:
      [m] int32 cluster ids in [0, k).
    """
    m = _check_count("num_clients", num_clients)
    k = _check_count("num_clusters", num_clusters)
    if k > m:
        raise ValueError(f"num_clusters={k} exceeds num_clients={m}; use at most {m} clusters.")
    if mode not in CLUSTER_MODES:
        raise ValueError(f"mode must be one of {CLUSTER_MODES}; got {mode!r}.")
    cluster = (np.arange(m) * k // m).astype(np.int32)
    if mode == "random":
        cluster = np.random.default_rng(seed).permutation(cluster).astype(np.int32)
    return cluster


def replicated_clusters(num_examples: int, num_clusters: int, clients_per_cluster: int, *,
                        shuffle: bool = True, seed: int = 0) -> tuple[Indices, np.ndarray]:
    """IFCA's rotated-MNIST split: every cluster holds the whole dataset, cut its own way.

    For each cluster an independent permutation of all N examples is cut
    into `clients_per_cluster` near-equal clients, so every example appears
    once in every cluster (transformed by that cluster's map, see `to_federated`);
    clients are numbered cluster-major. `shuffle=False` cuts every cluster in
    the source order (IFCA's test clients).

    Returns:
      (indices, cluster): k · clients_per_cluster index arrays and their [m] clusters.
    """
    n = _check_count("num_examples", num_examples)
    k = _check_count("num_clusters", num_clusters)
    per = _check_count("clients_per_cluster", clients_per_cluster)
    _check_clients_fit(per, n)
    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(k):
        order = rng.permutation(n) if shuffle else np.arange(n)
        parts.extend(np.asarray(p, np.int64) for p in np.array_split(order, per))
    return parts, np.repeat(np.arange(k, dtype=np.int32), per)


def rotations(quarter_turns: Sequence[int]) -> tuple[Callable[[np.ndarray], np.ndarray], ...]:
    """Per-cluster transforms rotating [B, H, W, ...] images by q · 90° counter-clockwise.

    `np.rot90` over the (H, W) axes, as IFCA's official code rotates (exact,
    no interpolation).
    """
    turns = [int(q) for q in quarter_turns]
    return tuple(lambda x, q=q: np.rot90(x, q, axes=(1, 2)) for q in turns)


def default_quarter_turns(num_clusters: int) -> tuple[int, ...]:
    """Rotations spread evenly over the circle: k=4 -> 0/90/180/270°, k=2 -> 0/180°, k=1 -> 0°."""
    k = _check_count("num_clusters", num_clusters)
    if 4 % k:
        raise ValueError(
            f"num_clusters={k} has no evenly spaced right-angle rotations; use 1, 2 or 4, "
            f"or pass quarter_turns (k values in 0..3) explicitly."
        )
    return tuple(range(0, 4, 4 // k))


def feature_shift_clusters(
    x,
    client_indices: Indices,
    transforms: Sequence[Callable[[np.ndarray], np.ndarray]],
    *,
    cluster=None,
    mode: str = "contiguous",
    seed: int = 0,
) -> tuple[list[np.ndarray], np.ndarray]:
    """Feature-shift clusters: each client's examples x[idx], transformed by its cluster's map.

    Args:
      x: [N, ...] source features.
      client_indices: m index arrays (from any partitioner or `replicated_clusters`).
      transforms: k callables [B, ...] -> [B, ...'] (one output shape for all).
      cluster: [m] ground-truth clusters in [0, k); default `assign_clusters(m, k,
        mode=mode, seed=seed)`.
      mode, seed: how clients fall into clusters when `cluster` is None.

    Returns:
      (client_x, cluster): m arrays [n_i, ...'] of transformed examples, and the
      [m] int32 ground-truth clusters.
    """
    x = np.asarray(x)
    k = len(transforms)
    m = len(client_indices)
    if cluster is None:
        cluster = assign_clusters(m, k, mode=mode, seed=seed)
    cluster = _check_cluster(cluster, m, k)
    client_x = [np.ascontiguousarray(transforms[c](x[np.asarray(idx, np.int64)]))
                for idx, c in zip(client_indices, cluster, strict=True)]
    return client_x, cluster.astype(np.int32)


def rotation_clusters(
    images,
    client_indices: Indices,
    *,
    num_clusters: int = 4,
    quarter_turns: Sequence[int] | None = None,
    cluster=None,
    mode: str = "contiguous",
    seed: int = 0,
) -> tuple[list[np.ndarray], np.ndarray]:
    """Rotated-image clusters (IFCA's rotated MNIST / CIFAR): cluster c's images turned q_c·90°.

    Args:
      images: [N, H, W] or [N, H, W, C].
      client_indices: m index arrays (from any partitioner or `replicated_clusters`).
      num_clusters: k.
      quarter_turns: k rotations in quarter turns counter-clockwise; default
        evenly spaced (`default_quarter_turns`: 0/90/180/270° for k = 4).
      cluster, mode, seed: as in `feature_shift_clusters`.

    Returns:
      (client_images, cluster): m arrays of rotated images and the [m] clusters.
    """
    images = np.asarray(images)
    if images.ndim not in (3, 4):
        raise ValueError(f"images must be [N, H, W] or [N, H, W, C]; got shape {images.shape}.")
    k = _check_count("num_clusters", num_clusters)
    turns = default_quarter_turns(k) if quarter_turns is None else tuple(quarter_turns)
    if len(turns) != k:
        raise ValueError(
            f"quarter_turns must give one rotation per cluster (num_clusters={k}); got {turns}."
        )
    if images.shape[1] != images.shape[2] and any(q % 2 for q in turns):
        raise ValueError(
            f"odd quarter turns of non-square images {images.shape[1:3]} change their shape; "
            f"use even quarter_turns or square images."
        )
    return feature_shift_clusters(images, client_indices, rotations(turns), cluster=cluster,
                                  mode=mode, seed=seed)


def _check_cluster(cluster, m: int, k: int | None = None) -> np.ndarray:
    cluster = np.asarray(cluster)
    if cluster.shape != (m,) or not np.issubdtype(cluster.dtype, np.integer):
        raise ValueError(f"cluster must be [m]=({m},) integers; got {cluster.dtype} "
                         f"{cluster.shape}.")
    upper = k if k is not None else np.iinfo(np.int32).max
    if cluster.size and (cluster.min() < (0 if k is not None else -1) or cluster.max() >= upper):
        raise ValueError(
            f"cluster ids must lie in [0, {upper}) (one transform per cluster); got range "
            f"[{cluster.min()}, {cluster.max()}]."
        )
    return cluster


# ---------------------------------------------------------------------------- FederatedData


def to_federated(x, y, client_indices: Indices, cluster=None, *,
                 transforms: Sequence[Callable] | None = None,
                 n_max: int | None = None) -> FederatedData:
    """Stacks a partition into FederatedData: x[idx_i], y[idx_i] per client, padded.

    Args:
      x: [N, ...] features, or a pytree (dict, tuple) of [N, ...] arrays.
      y: [N, ...] targets.
      client_indices: m index arrays into the N examples (a client may be empty;
        indices may repeat across clients, as in `replicated_clusters`).
      cluster: optional [m] ground-truth clusters (-1 = unknown); with
        `transforms`, ids in [0, len(transforms)).
      transforms: optional per-cluster feature transforms [B, ...] -> [B, ...]
        applied to each cluster's examples (e.g. `rotations((0, 1, 2, 3))`);
        x must then be one array.
      n_max: pad to this many rows (default: the largest client).

    Returns:
      FederatedData with x [m, n_max, ...], y [m, n_max, ...], num_examples [m]
      and cluster [m].
    """
    m = len(client_indices)
    if m == 0:
        raise ValueError("client_indices must list at least one client; got none.")
    idx = [np.asarray(i, np.int64).reshape(-1) for i in client_indices]
    counts = np.array([i.size for i in idx], np.int32)
    y = np.asarray(y)
    leaves = jax.tree.leaves(x)
    if not leaves:
        raise ValueError("x must hold at least one array; got an empty pytree.")
    n = y.shape[0] if y.ndim else 0
    for a in leaves + [y]:
        if np.ndim(a) == 0 or np.shape(a)[0] != n:
            raise ValueError(
                f"x and y must share their first axis [N]; got shapes "
                f"{[np.shape(a) for a in leaves]} and {y.shape}."
            )
    bad = [i for i, ix in enumerate(idx) if ix.size and (ix.min() < 0 or ix.max() >= n)]
    if bad:
        raise ValueError(f"client_indices of clients {bad[:5]} fall outside [0, {n}).")
    width = int(counts.max()) if n_max is None else int(n_max)
    if width < counts.max():
        raise ValueError(f"n_max={width} is smaller than the largest client ({counts.max()}).")
    width = max(width, 1)
    rows = np.arange(width)[None, :] < counts[:, None]  # [m, n_max]
    gather = np.zeros((m, width), np.int64)
    for i, ix in enumerate(idx):
        gather[i, : ix.size] = ix
    if cluster is not None:
        cluster = _check_cluster(cluster, m, None if transforms is None else len(transforms))

    def stack(a):
        out = np.asarray(a)[gather]
        out[~rows] = 0
        return out

    xs = jax.tree.map(stack, x)
    if transforms is not None:
        if cluster is None:
            raise ValueError("transforms need cluster: one transform per ground-truth cluster.")
        if not isinstance(xs, np.ndarray):
            raise ValueError("transforms need x to be one array, not a pytree.")
        shifted = None
        for c in range(len(transforms)):
            sel = cluster == c
            if not sel.any():
                continue
            block = xs[sel]
            out = np.asarray(transforms[c](block.reshape((-1,) + block.shape[2:])))
            out = out.reshape(block.shape[:2] + out.shape[1:])
            if shifted is None:
                shifted = np.zeros((m, width) + out.shape[2:], out.dtype)
            if out.shape[2:] != shifted.shape[2:]:
                raise ValueError(
                    f"transforms must agree on the output shape; cluster {c} gives "
                    f"{out.shape[2:]}, an earlier one {shifted.shape[2:]}."
                )
            shifted[sel] = out
        shifted[~rows] = 0
        xs = shifted
    return FederatedData.from_arrays(xs, stack(y), counts, cluster)
