"""FEMNIST from a user's copy: LEAF's JSON files and .npz read alike, and the ifca-femnist
preset end to end, on tiny files the tests write (no FEMNIST ships; nothing downloads)."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from fedjax_sim import cli
from fedjax_sim.data import tfds_local as T
from fedjax_sim.experiments import compare_preset
from fedjax_sim.experiments import ifca_femnist as F
from fedjax_sim.experiments.registry import get_preset
from fedjax_sim.experiments.settings import resolve

WRITERS = ("f0003_07", "f0001_41", "f0002_12", "f0000_14", "f0004_33")


def _writer_images(seed: int, rows: int):
    """uint8 [rows, 28, 28] 'scans' in LEAF's polarity (white background, dark ink) with an
    asymmetric mark, so a transposed or flipped read would differ."""
    rng = np.random.default_rng(seed)
    x = np.full((rows, 28, 28), 255, np.uint8)
    x[:, 3:9, 2:5] = rng.integers(0, 60, (rows, 6, 3))
    x[:, 20, 10:27] = 0
    return x, rng.integers(0, 62, rows)


def write_tiny_femnist(root, rows=(9, 3), layout="leaf"):
    """A tiny FEMNIST in `root`: LEAF JSON (femnist/train/, femnist/test/: two files each, as
    LEAF's -t sample writes), LEAF's unsplit all_data, or .npz. Returns {split: arrays}."""
    arrays = {}
    for s, (split, n) in enumerate(zip(("train", "test"), rows, strict=True)):
        parts = [_writer_images(100 * s + i, n) for i in range(len(WRITERS))]
        x = np.concatenate([p[0] for p in parts])
        y = np.concatenate([p[1] for p in parts])
        w = np.repeat(np.array(WRITERS), n)
        arrays[split] = (x, y, w)
        if layout == "npz":
            (root / "femnist").mkdir(parents=True, exist_ok=True)
            np.savez(root / "femnist" / f"{split}.npz", x=x, y=y, writer_id=w)
            continue
        if layout == "all_data" and split == "test":
            continue
        folder = root / "femnist" / ("all_data" if layout == "all_data" else split)
        folder.mkdir(parents=True, exist_ok=True)
        for f, users in enumerate((WRITERS[:2], WRITERS[2:])):
            doc = {"users": list(users), "num_samples": [n] * len(users), "user_data": {
                u: {"x": (parts[WRITERS.index(u)][0].reshape(n, 784) / 255).tolist(),
                    "y": parts[WRITERS.index(u)][1].tolist()} for u in users}}
            (folder / f"all_data_{f}_niid_05_keep_0_{split}_9.json").write_text(json.dumps(doc))
    return arrays


# ----------------------------------------------------------------------------- reader


def test_leaf_json_and_npz_give_the_same_arrays(tmp_path):
    want = write_tiny_femnist(tmp_path / "leaf", layout="leaf")
    write_tiny_femnist(tmp_path / "npz", layout="npz")
    for split in ("train", "test"):
        x, y, w = T.load_femnist(tmp_path / "leaf", split)
        nx, ny, nw = T.load_femnist(tmp_path / "npz", split)
        assert x.dtype == np.uint8 and x.shape == (5 * (9 if split == "train" else 3), 28, 28)
        assert y.dtype == np.int32
        for got in ((x, y, w), (nx, ny, nw)):
            np.testing.assert_array_equal(got[0], want[split][0])  # upright, LEAF's polarity
            np.testing.assert_array_equal(got[1], want[split][1])
            np.testing.assert_array_equal(got[2].astype(str), want[split][2])
        assert x[0, 0, 0] == 255 and x[0, 20, 26] == 0  # background white, the mark's row


def test_leaf_all_data_is_the_training_split(tmp_path):
    want = write_tiny_femnist(tmp_path, layout="all_data")
    x, _, w = T.load_femnist(tmp_path, "train")
    np.testing.assert_array_equal(x, want["train"][0])
    assert sorted(set(w)) == sorted(WRITERS)
    with pytest.raises(T.DataUnavailable, match="LEAF"):
        T.load_femnist(tmp_path, "test")


def test_bad_leaf_file_names_itself(tmp_path):
    (tmp_path / "femnist" / "train").mkdir(parents=True)
    bad = tmp_path / "femnist" / "train" / "all_data_0.json"
    bad.write_text(json.dumps({"users": ["u"], "user_data": {"u": {"x": [[0.5] * 10],
                                                                   "y": [1]}}}))
    with pytest.raises(ValueError, match="784"):
        T.load_femnist(tmp_path, "train")


# ----------------------------------------------------------------------------- the preset


def test_writers_and_their_splits(tmp_path):
    write_tiny_femnist(tmp_path, rows=(9, 3))
    preset = get_preset("ifca-femnist")
    s = resolve(preset.experiment.declared, preset.defaults,
                {"data_dir": str(tmp_path), "min_samples": 12})
    w = F.writer_splits(s)
    assert list(w["writers"]) == sorted(WRITERS) and w["leaf_split"]
    assert [len(p) for p in w["train"]] == [9] * 5 and [len(p) for p in w["test"]] == [3] * 5
    assert all(p.min() >= 45 for p in w["test"])  # test rows follow the 45 training rows
    s = {**s, "min_samples": 13}
    with pytest.raises(ValueError, match="min_samples=13"):
        preset.experiment.validate(s)
    # no test split: each writer's rows cut train_fraction / rest
    only = tmp_path / "only_train"
    write_tiny_femnist(only, rows=(10, 3), layout="all_data")
    w = F.writer_splits({**s, "data_dir": str(only), "min_samples": 10, "max_writers": 3})
    assert not w["leaf_split"] and len(w["writers"]) == 3
    assert [len(p) for p in w["train"]] == [9] * 3 and [len(p) for p in w["test"]] == [1] * 3
    for a, b in zip(w["train"], w["test"], strict=True):
        assert not set(a) & set(b)


@pytest.mark.parametrize("data_dir", [None, "missing", "empty"])
def test_without_data_refused_in_one_line_before_writing(tmp_path, data_dir):
    out = tmp_path / "out"
    settings = {}
    if data_dir is not None:
        (tmp_path / "empty").mkdir()
        settings["data_dir"] = str(tmp_path / data_dir)
    with pytest.raises(ValueError, match=r"^setting data_dir=.*LEAF.*no copy ships") as err:
        compare_preset("ifca-femnist", settings, out_dir=out, progress=False)
    assert "\n" not in str(err.value)
    assert not out.exists()


def test_compare_end_to_end_tiny(tmp_path):
    """The real LEAF CNN, 5 writers, 2 rounds after 1 round of pretraining: every column of
    the paper's Table 2 that this tiny run trains (global, IFCA with a frozen trunk)."""
    data, out = tmp_path / "data", tmp_path / "out"
    write_tiny_femnist(data, rows=(9, 3))
    tiny = {"data_dir": str(data), "min_samples": 10, "rounds": 2, "pretrain_rounds": 1,
            "warm_start_rounds": 1, "local_steps": 1, "batch_size": 5, "seeds": 2,
            "eval_every": 1, "clients_per_round": 3, "methods": "fedavg,ifca_frozen"}
    assert cli.main(["compare", "ifca-femnist", "--set", *(f"{k}={v}" for k, v in tiny.items()),
                     "--out", str(out), "--no-progress"]) == 0
    with open(out / "results.csv") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"fedavg", "ifca_frozen"}
    for r in rows.values():
        assert 0.0 <= float(r["test_accuracy_mean"]) <= 1.0


@pytest.mark.slow
def test_compare_every_table_2_method_tiny(tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    write_tiny_femnist(data, rows=(9, 3))
    tiny = {"data_dir": str(data), "min_samples": 10, "rounds": 2, "pretrain_rounds": 1,
            "warm_start_rounds": 1, "local_rounds": 1, "local_steps": 1, "batch_size": 5,
            "seeds": 2, "eval_every": 1, "clients_per_round": 3}
    assert cli.main(["compare", "ifca-femnist", "--set", *(f"{k}={v}" for k, v in tiny.items()),
                     "--out", str(out), "--no-progress"]) == 0
    with open(out / "results.csv") as f:
        assert {r["method"] for r in csv.DictReader(f)} == {
            "fedavg", "local", "oneshot", "ifca_ws", "ifca_frozen"}
    # `run` trains the headline method, IFCA on the frozen pretrained trunk
    run = tmp_path / "run"
    del tiny["local_rounds"]  # read by local and one-shot only: refused for ifca_frozen
    assert cli.main(["run", "ifca-femnist", "--set", *(f"{k}={v}" for k, v in tiny.items()),
                     "--out", str(run), "--no-progress"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["method"] == "ifca_frozen"
