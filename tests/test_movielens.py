"""MovieLens-100K loader on tiny atomic files inside a fake recbole wheel; client builder."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest

from fedjax_sim.data import archives, movielens

INTER = """user_id:token\titem_id:token\trating:float\ttimestamp:float
10\t5\t4\t300
2\t5\t3\t100
10\t30\t1\t100
2\t7\t5\t50
10\t7\t2\t200
"""
USER = """user_id:token\tage:token\tgender:token
2\t24\tM
10\t53\tF
99\t30\tF
"""
ITEM = """item_id:token\tmovie_title:token_seq
5\tToy Story
7\tGoldenEye
30\tFour Rooms
41\tNever Rated
"""


@pytest.fixture
def fake_cache(tmp_path):
    (tmp_path / "archives").mkdir()
    wheel = tmp_path / "archives" / "recbole-1.2.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for ext, body in (("inter", INTER), ("user", USER), ("item", ITEM)):
            zf.writestr(f"recbole/dataset_example/ml-100k/ml-100k.{ext}", body)
        zf.writestr("recbole/__init__.py", "")
    return tmp_path


def test_load_ml100k_from_a_fake_wheel(fake_cache):
    r = movielens.load_ml100k(cache_dir=fake_cache, download=False)
    # Raw ids sorted as numbers: users 2, 10, 99 -> 0, 1, 2; items 5, 7, 30, 41 -> 0..3.
    assert (r.num_users, r.num_items) == (3, 4)
    np.testing.assert_array_equal(r.user, [1, 0, 1, 0, 1])
    np.testing.assert_array_equal(r.item, [0, 0, 2, 1, 1])
    np.testing.assert_array_equal(r.rating, [4, 3, 1, 5, 2])
    np.testing.assert_array_equal(r.timestamp, [300, 100, 100, 50, 200])
    assert r.user.dtype == np.int32 and r.item.dtype == np.int32
    assert list(fake_cache.glob("extracted/**/ml-100k.*.npz"))
    again = movielens.load_ml100k(cache_dir=fake_cache, download=False)  # from the .npz
    for a, b in zip(r, again, strict=True):
        np.testing.assert_array_equal(a, b)


def test_missing_wheel_names_package_and_version(tmp_path):
    with pytest.raises(archives.DataUnavailable, match=r"recbole==1\.2\.1.*pip"):
        movielens.load_ml100k(cache_dir=tmp_path, download=False)


def _random_ratings(seed=0, users=6, items=15):
    rng = np.random.default_rng(seed)
    user, item = [], []
    for u in range(users):
        count = int(rng.integers(1, 9))
        user += [u] * count
        item += rng.choice(items, count, replace=False).tolist()
    r = len(user)
    return movielens.Ratings(
        np.asarray(user, np.int32), np.asarray(item, np.int32),
        rng.integers(1, 6, r).astype(np.float32), rng.integers(0, 5, r).astype(np.int64),
        users, items)


def _reference(r, c, test_fraction, min_rating=None, max_examples=None):
    """A plain loop over users: sort by (time, item), one example per rating after the first."""
    out = []
    for u in range(r.num_users):
        rows = [j for j in range(len(r.user)) if r.user[j] == u
                and (min_rating is None or r.rating[j] >= min_rating)]
        rows.sort(key=lambda j: (r.timestamp[j], r.item[j]))
        seq = [int(r.item[j]) for j in rows]
        ex = []
        for t in range(1, len(seq)):
            hist = seq[max(0, t - c): t]
            ex.append(([-1] * (c - len(hist)) + hist, seq[t]))
        if max_examples is not None:
            ex = ex[-max_examples:]
        if len(ex) < 2:
            continue
        n_test = min(len(ex) - 1, max(1, round(test_fraction * len(ex))))
        train, test = ex[: len(ex) - n_test], ex[len(ex) - n_test:]
        owned = sorted({i for ctx, lab in train for i in [*ctx, lab] if i >= 0})
        out.append((u, train, test, owned))
    return out


@pytest.mark.parametrize("min_rating,max_examples", [(None, None), (3, None), (None, 4)])
def test_clients_match_a_loop(min_rating, max_examples):
    r = _random_ratings()
    cl = movielens.movielens_clients(r, context_len=3, test_fraction=0.3, min_rating=min_rating,
                                     max_examples=max_examples)
    ref = _reference(r, 3, 0.3, min_rating, max_examples)
    np.testing.assert_array_equal(cl.users, [u for u, *_ in ref])
    for i, (_, train, test, owned) in enumerate(ref):
        for part, x, y, n in ((train, cl.x_train, cl.y_train, cl.n_train),
                              (test, cl.x_test, cl.y_test, cl.n_test)):
            assert n[i] == len(part)
            np.testing.assert_array_equal(x["context"][i, : n[i]], [ctx for ctx, _ in part])
            np.testing.assert_array_equal(x["label"][i, : n[i]], [lab for _, lab in part])
            np.testing.assert_array_equal(y[i, : n[i]], [lab for _, lab in part])
            assert np.all(y[i, n[i]:] == -1) and np.all(x["context"][i, n[i]:] == -1)
        assert cl.num_client_items[i] == len(owned)
        np.testing.assert_array_equal(cl.items[i, : len(owned)], owned)
        assert np.all(cl.items[i, len(owned):] == -1)
    assert cl.num_items == r.num_items


def test_clients_validate_settings():
    r = _random_ratings()
    with pytest.raises(ValueError, match="test_fraction"):
        movielens.movielens_clients(r, test_fraction=1.0)
    with pytest.raises(ValueError, match="context_len"):
        movielens.movielens_clients(r, context_len=0)


def test_movielens_preset_ranks_only_movies_not_known_watched(tmp_path):
    """The preset's test examples exclude the user's training movies and the example's
    context from the candidates, never the label; the popularity reference equals a loop
    over the same examples."""
    from fedjax_sim.experiments import mixed

    rng = np.random.default_rng(0)
    lines = ["user_id:token\titem_id:token\trating:float\ttimestamp:float"]
    for u in range(6):
        for t, item in enumerate(rng.permutation(40)[:9]):
            lines.append(f"{u + 1}\t{item + 1}\t4\t{100 * t + u}")
    (tmp_path / "archives").mkdir()
    with zipfile.ZipFile(tmp_path / "archives" / "recbole-1.2.1-py3-none-any.whl", "w") as zf:
        zf.writestr("recbole/dataset_example/ml-100k/ml-100k.inter", "\n".join(lines) + "\n")
        zf.writestr("recbole/dataset_example/ml-100k/ml-100k.user", USER)
        zf.writestr("recbole/dataset_example/ml-100k/ml-100k.item", "item_id:token\n" + "".join(
            f"{j + 1}\n" for j in range(40)))
    s = {**mixed.MOVIELENS.defaults(), "cache_dir": str(tmp_path), "context_len": 3,
         "max_examples": 6, "clients_per_round": 0, "test_examples": 100}
    (data, _, test), info = mixed.movielens.seed_data(s, [0])
    clients = movielens.movielens_clients(movielens.load_ml100k(tmp_path, download=False),
                                          context_len=3, max_examples=6)
    test = {k: np.asarray(v[0]) for k, v in test.items()}
    counts = np.bincount(clients.y_train[clients.y_train >= 0], minlength=clients.num_items)
    hits = []
    for context, label, seen in zip(test["context"], test["label"], test["seen"], strict=True):
        owner = [i for i in range(len(clients.users))
                 if label in clients.y_test[i] and set(context[context >= 0]) <= set(
                     clients.x_test["context"][i].ravel())]
        assert owner, "a test example belongs to a user"
        seen = set(seen[seen >= 0])
        assert label not in seen
        assert set(clients.items[owner[0]][clients.items[owner[0]] >= 0]) <= seen
        assert set(context[context >= 0]) <= seen
        candidates = sorted((j for j in range(clients.num_items) if j not in seen),
                            key=lambda j: (-counts[j], j))
        hits.append(label in candidates[:10])
    assert 0 < np.mean(hits) < 1  # the top 10 of about 30 candidates discriminates
    assert info["popularity_recall10"] == pytest.approx(np.mean(hits))
