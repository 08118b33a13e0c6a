"""MovieLens-100K ratings, users as clients, for next-movie prediction.

The ratings come from the `recbole==1.2.1` wheel, which ships
`recbole/dataset_example/ml-100k/ml-100k.{inter,user,item}` (RecBole's atomic
files: tab-separated, with a typed header such as `user_id:token`). They are
read out of the archive through `data/archives.py` and never installed nor
committed to this repository (GroupLens' terms forbid redistribution).

The client task follows the Mixed FL paper's (and Ning et al. 2021's)
next-movie prediction with a dual encoder: a user's ratings, ordered by time,
give one example per rating after the first: the context is the previous
`context_len` movies, the label the movie rated next. Every rating counts as a
positive ("movies the user watched"), whatever its value, unless
`min_rating` is set. Each user's last examples in time are held out as its
test set.

Everything here is plain numpy; `movielens_federated` wraps the arrays into
`FederatedData`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

from fedjax_sim.data import archives
from fedjax_sim.data.federated import FederatedData

PACKAGE, VERSION = "recbole", "1.2.1"
MEMBER = "recbole/dataset_example/ml-100k/ml-100k.{}"
_CACHE_NAME = "ml-100k.v1.npz"


class Ratings(NamedTuple):
    """All ratings, ids contiguous and 0-based.

    user, item: [r] int32 in [0, num_users) / [0, num_items).
    rating: [r] float32; timestamp: [r] int64 (seconds).
    num_users, num_items: the sizes of the id spaces (every user/item of the
      .user/.item files and of the ratings, in increasing order of the raw id).
    """

    user: np.ndarray
    item: np.ndarray
    rating: np.ndarray
    timestamp: np.ndarray
    num_users: int
    num_items: int


class MovieLensClients(NamedTuple):
    """Per-user next-movie examples, padded; ids are GLOBAL item ids, -1 = padding.

    x_train: {"context": [m, n_max, c] int32 (the previous c movies, most recent
      last; -1 where the history is shorter), "label": [m, n_max] int32};
    y_train: [m, n_max] int32, the label again (-1 on padding rows);
    n_train: [m] int32. x_test, y_test, n_test likewise ([m, t_max, ...]); a test
      example's context may hold training movies (the history before it).
    items: [m, u_max] int32, the distinct movies client i's TRAINING examples touch
      (contexts and labels), sorted, -1 padded: the only rows of the item table a
      client receives and whose gradient is nonzero.
    num_client_items: [m] int32, the real entries of `items`.
    users: [m] int32, the user id of each client.
    num_items: the size of the item table.
    """

    x_train: dict
    y_train: np.ndarray
    n_train: np.ndarray
    x_test: dict
    y_test: np.ndarray
    n_test: np.ndarray
    items: np.ndarray
    num_client_items: np.ndarray
    users: np.ndarray
    num_items: int


def read_atomic(path: Path) -> dict[str, list[str]]:
    """Columns of a RecBole atomic file (header `name:type` tab-separated), as strings."""
    with open(path, encoding="utf-8", errors="replace") as f:
        header = f.readline().rstrip("\n").split("\t")
        names = [h.split(":", 1)[0] for h in header]
        columns: dict[str, list[str]] = {n: [] for n in names}
        for line in f:
            if not line.strip():
                continue
            fields = line.rstrip("\n").split("\t")
            fields += [""] * (len(names) - len(fields))
            for n, v in zip(names, fields, strict=False):
                columns[n].append(v)
    return columns


def _id_order(tokens: set[str]) -> list[str]:
    # MovieLens ids are integers: sort them as numbers so id 0 is raw id 1.
    if all(t.isdigit() for t in tokens):
        return sorted(tokens, key=int)
    return sorted(tokens)


def parse_ml100k(inter: Path, user: Path | None = None, item: Path | None = None) -> Ratings:
    """Ratings from the .inter file, ids mapped over the union with the .user/.item files."""
    cols = read_atomic(inter)
    for need in ("user_id", "item_id"):
        if need not in cols:
            raise ValueError(f"{inter} has no {need!r} column; its header names {list(cols)}.")
    users = set(cols["user_id"])
    items = set(cols["item_id"])
    if user is not None:
        users |= set(read_atomic(user).get("user_id", []))
    if item is not None:
        items |= set(read_atomic(item).get("item_id", []))
    user_index = {t: i for i, t in enumerate(_id_order(users))}
    item_index = {t: i for i, t in enumerate(_id_order(items))}
    r = len(cols["user_id"])
    rating = np.asarray(cols.get("rating", ["1"] * r), np.float64).astype(np.float32)
    timestamp = np.asarray(cols.get("timestamp", ["0"] * r), np.float64).astype(np.int64)
    return Ratings(
        user=np.fromiter((user_index[t] for t in cols["user_id"]), np.int32, r),
        item=np.fromiter((item_index[t] for t in cols["item_id"]), np.int32, r),
        rating=rating, timestamp=timestamp,
        num_users=len(user_index), num_items=len(item_index),
    )


def load_ml100k(cache_dir=None, *, download: bool = True) -> Ratings:
    """MovieLens-100K (943 users, 1682 movies, 100 000 ratings) from the recbole wheel.

    The parsed arrays are cached as an .npz beside the extracted files (written
    atomically), so later calls read neither the archive nor the text.

    Raises:
      archives.DataUnavailable: the wheel is not cached and cannot be fetched; the
        message names recbole==1.2.1 and the pip command.
    """
    paths = {ext: archives.member_path(PACKAGE, VERSION, MEMBER.format(ext), cache_dir=cache_dir,
                                       download=download)
             for ext in ("inter", "user", "item")}
    cache = paths["inter"].parent / _CACHE_NAME
    if cache.is_file():
        with np.load(cache) as z:
            return Ratings(z["user"], z["item"], z["rating"], z["timestamp"],
                           int(z["num_users"]), int(z["num_items"]))
    ratings = parse_ml100k(paths["inter"], paths["user"], paths["item"])
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}.npz")
    np.savez(tmp, **ratings._asdict())
    os.replace(tmp, cache)
    return ratings


def movielens_clients(ratings: Ratings, *, context_len: int = 10, test_fraction: float = 0.2,
                      min_rating: float | None = None, min_examples: int = 2,
                      max_examples: int | None = None) -> MovieLensClients:
    """One client per user: time-ordered next-movie examples, split in time.

    Args:
      ratings: as from `load_ml100k`.
      context_len: c, the number of previous movies in an example's context.
      test_fraction: the share of a user's examples held out, its last ones in time:
        round(test_fraction · e), at least 1 and never all of them.
      min_rating: when set, only ratings >= min_rating are positives (the rest are
        dropped); None keeps every rating.
      min_examples: users with fewer examples (ratings − 1) are dropped.
      max_examples: keep at most this many examples of a user (its latest ones, so
        the test examples stay the last in time); None keeps all.

    Returns:
      MovieLensClients; clients in increasing user id. Ties in time are ordered by
      item id.
    """
    if not isinstance(context_len, int) or context_len < 1:
        raise ValueError(f"context_len must be an integer >= 1; got {context_len!r}.")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie in (0, 1); got {test_fraction}.")
    if min_examples < 2:
        raise ValueError(f"min_examples must be >= 2 (one train and one test); got {min_examples}.")
    keep = np.ones(len(ratings.user), bool) if min_rating is None else ratings.rating >= min_rating
    user, item, ts = ratings.user[keep], ratings.item[keep], ratings.timestamp[keep]
    order = np.lexsort((item, ts, user))
    user, item = user[order], item[order]
    bounds = np.searchsorted(user, np.arange(ratings.num_users + 1))
    c = context_len
    clients = []
    for u in range(ratings.num_users):
        seq = item[bounds[u]: bounds[u + 1]]
        e = len(seq) - 1
        if e < min_examples:
            continue
        padded = np.concatenate([np.full(c, -1, np.int32), seq.astype(np.int32)])
        # example j (j = 1..e) predicts seq[j] from seq[max(0, j-c):j]
        context = padded[np.arange(1, e + 1)[:, None] + np.arange(c)[None, :]]
        label = seq[1:].astype(np.int32)
        if max_examples is not None:
            context, label = context[-max_examples:], label[-max_examples:]
            e = len(label)
        n_test = min(e - 1, max(1, round(test_fraction * e)))
        clients.append((u, context, label, e - n_test))
    if not clients:
        raise ValueError(f"no user has at least min_examples={min_examples} examples.")
    m = len(clients)
    n_max = max(split for _, _, _, split in clients)
    t_max = max(len(lab) - split for _, _, lab, split in clients)
    ctx_tr = np.full((m, n_max, c), -1, np.int32)
    lab_tr = np.full((m, n_max), -1, np.int32)
    ctx_te = np.full((m, t_max, c), -1, np.int32)
    lab_te = np.full((m, t_max), -1, np.int32)
    n_tr = np.zeros(m, np.int32)
    n_te = np.zeros(m, np.int32)
    owned = []
    for i, (_, context, label, split) in enumerate(clients):
        ctx_tr[i, :split], lab_tr[i, :split] = context[:split], label[:split]
        ctx_te[i, : len(label) - split], lab_te[i, : len(label) - split] = (
            context[split:], label[split:])
        n_tr[i], n_te[i] = split, len(label) - split
        seen = np.union1d(context[:split].ravel(), label[:split])
        owned.append(seen[seen >= 0])
    counts = np.array([len(o) for o in owned], np.int32)
    items = np.full((m, int(counts.max())), -1, np.int32)
    for i, o in enumerate(owned):
        items[i, : len(o)] = o
    return MovieLensClients(
        x_train={"context": ctx_tr, "label": lab_tr}, y_train=lab_tr.copy(), n_train=n_tr,
        x_test={"context": ctx_te, "label": lab_te}, y_test=lab_te.copy(), n_test=n_te,
        items=items, num_client_items=counts,
        users=np.array([u for u, *_ in clients], np.int32), num_items=ratings.num_items,
    )


def movielens_federated(clients: MovieLensClients) -> tuple[FederatedData, FederatedData]:
    """(train, test) FederatedData: x {"context": [m, n, c], "label": [m, n]}, y [m, n]."""
    train = FederatedData.from_arrays(clients.x_train, clients.y_train, clients.n_train)
    test = FederatedData.from_arrays(clients.x_test, clients.y_test, clients.n_test)
    return train, test


__all__ = [
    "MovieLensClients", "Ratings", "load_ml100k", "movielens_clients", "movielens_federated",
    "parse_ml100k", "read_atomic",
]
