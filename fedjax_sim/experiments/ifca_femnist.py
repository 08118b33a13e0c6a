"""IFCA on FEMNIST from a user's local copy (the paper's Table 2; docs/protocols.md#ifca-femnist).

Ghosh, Chung, Yin, Ramchandran, NeurIPS 2020, Table 2: IFCA with weight sharing
(k = 2, 3) against global (FedAvg), local and one-shot models on LEAF FEMNIST.
Clients are writers (`natural_id_partition` of the writer ids); each writer
trains on its training rows and is tested on its own test rows: LEAF's per-user
split when `data_dir` holds a test split, else `train_fraction` of each writer's
rows (a fixed per-writer permutation from `seed`, LEAF's `-t sample` rule).
Writers with fewer than `min_samples` rows (train + test) are left out (LEAF's
`-k 100`); `max_writers` keeps a random subset (LEAF's `--sf` sampled 5 %).

The model is the LEAF CNN (`models.zoo.femnist_cnn`, trunk and 2048 → 62 head).
`ifca_frozen` is the official run: FedAvg pretrains `pretrain_rounds` rounds, the
trunk is frozen, the heads are clustered after a `warm_start_rounds` warm start;
`ifca_ws` trains a shared trunk by FedAvg with IFCA heads. A test writer is
served the cluster its training rows choose by training loss (the official FEMNIST
code's rule); local and one-shot models test each writer's own model.

No FEMNIST ships or can be downloaded: the data come from the `data_dir` setting
through `fedjax_sim.data.tfds_local.load_femnist` (.npz, LEAF JSON, or a build of
this package's tfds builder); without them the preset refuses in one line before
anything is written.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from fedjax_sim.data import ClientViews, copies_axes, stack_views
from fedjax_sim.data.archives import DataUnavailable
from fedjax_sim.data.partition import natural_id_partition
from fedjax_sim.experiments import settings as st
from fedjax_sim.experiments.base import Experiment, Metrics, Preset, Trained, client_mean
from fedjax_sim.experiments.ifca_images.experiment import footprint
from fedjax_sim.experiments.ifca_images.methods import TABLE
from fedjax_sim.experiments.ifca_images.metrics import serve_clusters, summarize
from fedjax_sim.experiments.methods import SPLIT_MODEL
from fedjax_sim.models.zoo import femnist_cnn

FEMNIST_HELP = (
    "to get the data, run LEAF (github.com/TalwalkarLab/leaf, in data/femnist: ./preprocess.sh "
    "-s niid --sf 0.05 -k 100 -t sample) and copy its data/train and data/test folders to "
    "<data_dir>/femnist/train/ and <data_dir>/femnist/test/ (or its unsplit data/all_data to "
    "<data_dir>/femnist/all_data/), or <data_dir>/femnist/train.npz and test.npz (x uint8 "
    "[N, 28, 28], y labels in [0, 62), writer_id), see fedjax_sim.data.tfds_local; no copy "
    "ships with fedjax_sim and nothing is downloaded; set it with --set data_dir=DIR"
)

_CACHE: dict = {}


def _unavailable(s: dict, reason: str) -> ValueError:
    return ValueError(f"setting data_dir={s['data_dir']!r}: {reason}; {FEMNIST_HELP}.")


def load_splits(s: dict):
    """(train, test) of the data_dir's FEMNIST, each (images, labels, writers); test None when
    the directory has no test split. ValueError in one line when there is no FEMNIST."""
    from fedjax_sim.data.tfds_local import load_femnist

    if not s["data_dir"]:
        raise _unavailable(s, "no FEMNIST directory was given")
    if not Path(s["data_dir"]).expanduser().is_dir():
        raise _unavailable(s, "the directory does not exist")
    cache = s.get("cache_dir") or None
    try:
        train = load_femnist(s["data_dir"], "train", cache_dir=cache)
    except DataUnavailable:
        raise _unavailable(s, "it holds no FEMNIST training split") from None
    try:
        test = load_femnist(s["data_dir"], "test", cache_dir=cache)
    except DataUnavailable:
        test = None
    return train, test


def writer_splits(s: dict) -> dict:
    """The writers kept and each one's train / test rows (cached per data settings).

    Returns {"images": float32 [N, 28, 28] in [0, 1] (train rows then test rows),
    "labels": int32 [N], "train": m index arrays, "test": m index arrays,
    "writers": [m] ids, "leaf_split": whether the test rows are the data's own}.
    """
    key = tuple(s.get(n) for n in ("data_dir", "cache_dir", "min_samples", "max_writers",
                                   "train_fraction", "seed"))
    if key in _CACHE:
        return _CACHE[key]
    (tx, ty, tw), test = load_splits(s)
    train_parts, ids = natural_id_partition(tw)
    images, labels = [tx], [ty]
    if test is None:  # LEAF's per-user "sample" split: a fraction of each writer's rows
        rng = np.random.default_rng(s["seed"])
        train_rows, test_rows = [], []
        for rows in train_parts:
            rows = rng.permutation(rows)
            cut = max(1, int(s["train_fraction"] * len(rows)))
            train_rows.append(np.sort(rows[:cut]))
            test_rows.append(np.sort(rows[cut:]))
    else:
        vx, vy, vw = test
        test_parts, test_ids = natural_id_partition(vw)
        where = {str(w): i for i, w in enumerate(test_ids)}
        empty = np.zeros(0, np.int64)
        train_rows = train_parts
        test_rows = [test_parts[where[str(w)]] + len(tx) if str(w) in where else empty
                     for w in ids]
        images.append(vx)
        labels.append(vy)
    sizes = np.array([len(a) + len(b) for a, b in zip(train_rows, test_rows, strict=True)])
    keep = np.flatnonzero((sizes >= s["min_samples"])
                          & np.array([len(b) > 0 for b in test_rows]))
    if s["max_writers"] and len(keep) > s["max_writers"]:
        pick = np.random.default_rng([s["seed"], 1]).choice(len(keep), s["max_writers"],
                                                            replace=False)
        keep = keep[np.sort(pick)]
    out = {"images": np.concatenate(images).astype(np.float32) / 255.0,
           "labels": np.concatenate(labels).astype(np.int32),
           "train": [train_rows[i] for i in keep], "test": [test_rows[i] for i in keep],
           "writers": ids[keep], "leaf_split": test is not None,
           "all_writers": len(ids)}
    _CACHE.clear()
    _CACHE[key] = out
    return out


def _views(images, labels, parts, seeds: int):
    """The writers' rows as views into the images held once, stacked for every seed."""
    n_max = max(len(p) for p in parts)
    rows = np.zeros((len(parts), n_max), np.int64)
    for i, p in enumerate(parts):
        rows[i, :len(p)] = p
    one = ClientViews.from_indices(images, labels, rows,
                                   num_examples=np.array([len(p) for p in parts]))
    return stack_views([one] * seeds)


METRICS = ["test_accuracy", "train_accuracy", "train_loss", "test_loss"]


def metrics_fn(kind: str, algorithm, model, problem, s: dict, total_rounds: int):
    """state -> {metric: [seeds]} every eval_every rounds and at the last: sample-weighted
    accuracy and client-mean loss on the writers' train and test rows. Cluster models serve
    each writer's test rows with the cluster its training rows pick (lowest training loss);
    per-client models and fixed clusters test each writer's own model."""
    train, test = problem["train"], problem["test"]

    @jax.jit
    def evaluate_all(state, train, test):
        tr = algorithm.evaluate(state, train)
        if kind == "clustered":
            te = jax.vmap(lambda st, d, a: serve_clusters(model, st, d, a),
                          in_axes=(0, copies_axes(test), 0))(state, test, tr["assignment"])
        else:
            te = algorithm.evaluate(state, test)
        return {"train": summarize(tr, train), "test": summarize(te, test)}

    def metrics(state):
        done = int(np.asarray(state.round).ravel()[0])
        if done % s["eval_every"] and done < total_rounds:
            return {}
        ev = evaluate_all(state, train, test)
        return {f"{split}_{what}": client_mean(*ev[split][what])
                for split in ("train", "test") for what in ("loss", "accuracy")}

    return metrics


SETTINGS = (
    st.Setting("data_dir", str, "", "directory with FEMNIST (LEAF JSON in femnist/train and "
            "femnist/test, or femnist/train.npz and test.npz; nothing ships or downloads)",
            result=False),
    st.Setting("cache_dir", str, "", "decoded-array cache of a tfds build (default: "
            "$FEDJAX_SIM_CACHE or ~/.cache/fedjax_sim)", result=False),
    st.count("min_samples", 100, "writers with at least this many rows (train + test; LEAF "
          "-k 100)", minimum=2, maximum=10**6),
    st.count("max_writers", 0, "keep this many writers at random (0: all; LEAF's --sf 0.05 "
          "sampled 5 % of them)", minimum=0, maximum=10**6),
    st.Setting("train_fraction", float, 0.9, "each writer's training share when data_dir "
            "has no test split (LEAF -tf 0.9)", minimum=1e-9, maximum=1.0),
    st.Setting("k", int, 2, "cluster models (paper Table 2: 2 and 3)", minimum=1,
            maximum=100),
    st.count("clients_per_round", 6, "writers per round (0: all; official 6)", minimum=0,
          maximum=10**6),
    st.lr_setting(0.004),
    st.local_steps_setting(20, "local steps per round (official: one epoch at batch 10, "
                        "~20 steps for a writer of 200 rows)"),
    st.batch_size_setting(10),
    st.sampling_setting("epochs", help="local minibatches: epochs (each a fresh permutation "
                     "of the writer's rows) or with_replacement"),
    st.rounds_setting(4000, "communication rounds (IFCA's after pretraining; the others')"),
    st.count("pretrain_rounds", 2000, "ifca_frozen: FedAvg rounds that pretrain the trunk",
          minimum=0, methods=("ifca_frozen",)),
    st.count("warm_start_rounds", 20, "ifca_frozen: rounds training each head on its random "
          "writer group", minimum=0, methods=("ifca_frozen",)),
    st.count("local_rounds", 100, "local baseline: rounds of τ steps; one-shot pretrains as "
          "long", methods=("local", "oneshot")),
    st.seeds_setting(3, "seeds (init, cohorts, minibatches), one vmapped axis", maximum=1000),
    st.seed_setting(),
    st.eval_every_setting(50, "evaluate every this many rounds"),
    st.checkpoint_setting(200),
    st.Setting("memory_budget_gb", float, 0.0, "GiB for the client axis; 0: on a CPU, "
            "writers in chunks of 256 MiB working memory; elsewhere no chunking but "
            "per-client models in chunks of 1 GiB", minimum=0.0, result=False),
)


def validate(s: dict, command: str = "compare") -> None:
    """The data exist and leave enough writers, before anything is written."""
    w = writer_splits(s)
    m = len(w["writers"])
    if m < max(2, s["k"]):
        raise ValueError(
            f"setting min_samples={s['min_samples']}: {m} of the {w['all_writers']} "
            f"writers in data_dir have that many rows and test rows; k={s['k']} needs at "
            "least max(2, k); lower min_samples or k.")


def problem(s: dict) -> dict:
    """The kept writers' train and test rows (views, stacked for every seed) and the LEAF
    CNN, whole (False) and split into trunk and head (True)."""
    w = writer_splits(s)
    return {"train": _views(w["images"], w["labels"], w["train"], s["seeds"]),
            "test": _views(w["images"], w["labels"], w["test"], s["seeds"]),
            "writers": w["writers"], "leaf_split": w["leaf_split"],
            "all_writers": w["all_writers"],
            "model": {split: femnist_cnn(62, split=split) for split in (False, True)}}


def with_cohort(s: dict, problem) -> dict:
    """s with participation = clients_per_round / m (0 or more than m: every writer)."""
    m = len(problem["writers"])
    cohort = s["clients_per_round"] or m
    return {**s, "participation": min(1.0, cohort / m)}


def metrics(t: Trained) -> Metrics:
    """Called every round, evaluating every eval_every rounds and at the last (`metrics_fn`)."""
    return Metrics(metrics_fn(t.method.kind, t.algorithm, t.model, t.problem, t.s, t.rounds),
                   every=1)


def notes(s: dict, problem, results: dict) -> dict:
    m = len(problem["writers"])
    train_rows = np.asarray(problem["train"].num_examples)[0]
    test_rows = np.asarray(problem["test"].num_examples)[0]
    cohort = round(with_cohort(s, problem)["participation"] * m)
    notes = {
        "data": f"FEMNIST from data_dir: {m} of {problem['all_writers']} writers (≥ "
                f"{s['min_samples']} rows" + (f", {s['max_writers']} drawn at random"
                                               if s["max_writers"] else "") +
                f"), {int(train_rows.sum())} train / {int(test_rows.sum())} test rows; "
                + ("LEAF's per-user split" if problem["leaf_split"] else
                   f"each writer's rows split {s['train_fraction']:g} train / rest test "
                   f"(seed {s['seed']})"),
        "training": f"LEAF CNN, {cohort} writers per round, τ={s['local_steps']} local "
                    f"steps of batch {s['batch_size'] or 'all'} ({s['sampling']}), lr "
                    f"{s['lr']}, {s['rounds']} rounds, {s['seeds']} seeds",
        "test_accuracy": "sample-weighted over the writers' test rows; cluster models: "
                         "each writer the cluster its training rows pick by training loss "
                         "(official FEMNIST code); local and one-shot: the writer's own "
                         "model; the final evaluation (the paper reports the best one)",
        "paper": "Table 2 (recalled, approximate): IFCA (k = 2, 3) ≈ 87.5–88 %, global and "
                 "one-shot ≈ 84–85 %, local ≈ 75–76 %",
        "accuracy units": "fractions in [0, 1]",
    }
    if "ifca_frozen" in results:
        notes["ifca_frozen"] = (
            f"FedAvg pretrains {s['pretrain_rounds']} rounds, its trunk frozen in every "
            f"cluster, only the last layer clustered; warm start {s['warm_start_rounds']} "
            f"rounds on random equal writer groups; then {s['rounds']} rounds")
    if "local" in results or "oneshot" in results:
        notes["local"] = (f"local and one-shot pretraining: {s['local_rounds']}×τ steps on "
                          "each writer alone")
    return notes


FEMNIST = Experiment(
    name="ifca_femnist",
    description="IFCA with weight sharing and a frozen pretrained trunk vs global, local "
                "and one-shot models on FEMNIST (writers as clients, from data_dir)",
    settings=(*SETTINGS, st.method_setting(tuple(TABLE), "ifca_frozen")),
    problem=problem,
    metrics=metrics,
    methods=("fedavg", "local", "oneshot", "ifca_ws", "ifca_frozen"),
    baseline="fedavg",
    table=lambda s: list(METRICS),
    notes=notes,
    validate=validate,
    panels=(("test_accuracy", "test accuracy"), ("train_loss", "train loss (avg client)")),
    log_metrics=("train_loss",),
    method_table=TABLE,
    provides=frozenset({SPLIT_MODEL}),
    unscoped=("k",),
    derived=with_cohort,
    # The writers' round holds what the rotated images' does (the plan on train and test).
    footprint=footprint,
)

PRESETS = [
    Preset("ifca-femnist", FEMNIST,
           "Table 2: FEMNIST from data_dir (LEAF niid, writers with ≥ 100 rows), LEAF CNN, "
           "k=2, 6 writers per round, batch 10, lr 0.004, FedAvg pretraining 2000 rounds then "
           "4000 rounds of the clustered last layer, against global, local and one-shot.",
           {}),
]
