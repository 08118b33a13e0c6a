"""The rotated image federations: images read once, clients cut per seed, the models.

`load_split_images` reads a dataset (cached, one at a time), `build_problem`
cuts it into k rotated clusters of clients for every seed (seeds stacked on a
leading axis) with each training client's paired test client, `build_model`
is the MLP (mnist/digits) or the TF-tutorial CNN (cifar).

Unseen clients (setting unseen_clients > 0): seed i holds out `unseen_count(s)` of
its m training clients (`experiments.unseen`: the seed's own stream, the same for
every method); the methods train on the others, and a held-out client keeps its
training part and its paired test client for the evaluation (`metrics.py`). The test
clients are never trained on, and stay as they are.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from fedjax_sim.data import stack_views
from fedjax_sim.data.archives import DataUnavailable
from fedjax_sim.data.cifar import DATA_DIR_HELP, load_cifar10
from fedjax_sim.data.images import digits, fixed_split, mnist_5k, rotated_clusters, rotated_views
from fedjax_sim.experiments.base import stack_seeds
from fedjax_sim.experiments.unseen import held_out_count, pick_clients, split_ids
from fedjax_sim.models import mlp_classifier
from fedjax_sim.models.augment import CROP
from fedjax_sim.models.zoo import cifar_cnn

DATASETS = ("mnist", "digits", "cifar")


_DATA_CACHE: dict = {}


def load_split_images(s: dict):
    """(train images, train labels, test images, test labels) of the setting's dataset.

    float32 images in [0, 1]; CIFAR stays 32×32: its model center-crops to 24×24
    and standardizes per image (the tutorial's test-time input), and with the
    augment setting its local steps train on the tutorial's distorted views
    (`models.augment`).

    Raises:
      ValueError: the data cannot be read (the message names the files and
        how to prepare them).
    """
    key = (s["dataset"], s.get("cache_dir", ""), s.get("data_dir", ""), s.get("test_per_class"))
    if key in _DATA_CACHE:
        return _DATA_CACHE[key]
    try:
        if s["dataset"] == "cifar":
            if not s["data_dir"]:
                raise ValueError(f"setting data_dir is empty: {DATA_DIR_HELP}.")
            parts = []
            for split in ("train", "test"):
                images, labels = load_cifar10(s["data_dir"], split,
                                              cache_dir=s.get("cache_dir") or None)
                images = np.asarray(images)
                if images.ndim == 3:
                    images = images[..., None]
                parts += [images.astype(np.float32) / 255.0, np.asarray(labels, np.int32)]
            out = tuple(parts)
        else:
            images, labels = (mnist_5k(s["cache_dir"] or None) if s["dataset"] == "mnist"
                              else digits())
            train, test = fixed_split(labels, s["test_per_class"])
            out = (images[train], labels[train], images[test], labels[test])
    except DataUnavailable as err:
        raise ValueError(str(err)) from None
    _DATA_CACHE.clear()  # keep one dataset in memory
    _DATA_CACHE[key] = out
    return out


def build_problem(s: dict):
    """Seed-stacked train / test / paired-test data (leading [seeds] axis) and the pairing.

    With clients=views the clients are `ClientViews` (index rows and a rotation into
    the images, gathered per cohort chunk inside the round) with the same numbers:
    only the index rows are stacked per seed, the images are held once for all
    seeds (`stack_views`), where copies hold seeds × k rotated copies.
    """
    tx, ty, vx, vy = load_split_images(s)
    views = s.get("clients", "views") == "views"
    build = rotated_views if views else rotated_clusters
    per_seed = [build(tx, ty, vx, vy, n=s["n"], k=s["k"], seed=s["seed"] + i, n_test=s["n"])
                for i in range(s["seeds"])]
    first = per_seed[0]
    stack = stack_views if views else stack_seeds
    train = stack([p.train for p in per_seed])
    test = stack([p.test for p in per_seed])
    pair = (lambda p: p.test.subset(jnp.asarray(p.test_of_client))) if views else (
        lambda p: p.test.take(jnp.asarray(p.test_of_client)))
    paired = stack([pair(p) for p in per_seed])
    return hold_out(s, {"train": train, "test": test, "paired": paired,
                        "test_of_client": first.test_of_client,
                        "test_clients": first.test.num_clients, "rotations": first.rotations})


def training_clients(s: dict) -> int:
    """m = k·⌊training images / n⌋, the training clients of every seed."""
    return s["k"] * (len(load_split_images(s)[0]) // s["n"])


def unseen_count(s: dict) -> int:
    """The training clients held out: unseen_clients · m rounded, at least 1 when
    unseen_clients > 0 (`unseen.held_out_count`; ValueError when none is left)."""
    share = s.get("unseen_clients", 0.0)
    return held_out_count(share, training_clients(s), "m (k·⌊train images / n⌋)") if share \
        else 0


def hold_out(s: dict, problem: dict) -> dict:
    """`problem` with each seed's held-out training clients moved out of "train" and
    "paired" into "unseen_train" and "unseen_paired" (their paired test clients);
    "seen" [seeds, m − u] and "unseen" [seeds, u] hold the ids ("test_of_client" stays
    over all m). As it is when unseen_clients is 0."""
    count = unseen_count(s)
    if not count:
        return problem
    m = len(problem["test_of_client"])
    seen, unseen = split_ids(s["seed"], s["seeds"], m, count)
    return {**problem, "train": pick_clients(problem["train"], seen),
            "paired": pick_clients(problem["paired"], seen),
            "unseen_train": pick_clients(problem["train"], unseen),
            "unseen_paired": pick_clients(problem["paired"], unseen),
            "seen": seen, "unseen": unseen}


def build_model(s: dict, input_shape, split: bool = False):
    """The MLP (mnist/digits) or the TF-tutorial CNN (cifar); split=True for weight sharing.

    The CNN's local steps stay in `lax.scan` (ops/local_update.py): on this 2-core AMD EPYC,
    10 minibatch-50 steps of this CNN took 21.5 s in a scan vs 20.0 s as a Python loop of one
    jitted step (loaded machine, benchmark in the issue-8 report): at batch 50 each step is
    compute-bound, so the CPU conv-in-scan slowdown seen elsewhere (10×, measured on smaller
    steps) does not show here, and unrolling 50 steps would only multiply compile time.
    """
    if s["dataset"] == "cifar":
        return cifar_cnn(10, input_shape, split=split, crop=CROP, augment=s["augment"])
    return mlp_classifier(input_shape, [s["hidden"]], 10, split=split,
                          weight_init=s["weight_init"])


