"""pfl-research's CIFAR-10 benchmark as an experiment: settings, checks, metrics, notes, presets."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.algorithms import ClientTraining, sgd, with_server_optimizer
from fedjax_sim.algorithms.base import WEIGHTINGS, cohort_size
from fedjax_sim.data import FederatedData, copy_at
from fedjax_sim.execution import Footprint
from fedjax_sim.experiments import settings as st
from fedjax_sim.experiments.base import Experiment, Preset
from fedjax_sim.experiments.methods import METHODS, Build
from fedjax_sim.experiments.pfl_cifar10.data import (
    DATASETS,
    PIXEL_LAYOUTS,
    build_problem,
    load_split_images,
)
from fedjax_sim.models.core import argmax_correct, softmax_cross_entropy
from fedjax_sim.models.zoo import simple_cnn
from fedjax_sim.ops.work import Work


def central_sgd(algorithm, b: Build):
    """pfl's central optimizer: SGD at central_lr on the cohort's mean model change
    (FedOpt's "sgd"); at 1.0 the new model is the cohort's mean (FedAvg itself)."""
    lr = b.s.get("central_lr", 1.0)
    return algorithm if lr == 1.0 else with_server_optimizer(algorithm, "sgd", lr)


def _read_by_wrap(value, b: Build) -> dict:
    """central_lr is read by `central_sgd`, not passed to the algorithm's factory."""
    return {}


# pfl applies its central optimizer (SGD at `learning_rate`) to every algorithm it runs on
# this benchmark: FedAvg and FedProx, its two choices in baseline.yaml.
TABLE = {**METHODS, **{name: METHODS[name].replace(
    reads={**METHODS[name].reads, "central_lr": _read_by_wrap}, wrap=central_sgd)
    for name in ("fedavg", "fedprox")}}

METRICS = ["test_accuracy", "test_loss"]


def metrics_fn(model, problem: dict, s: dict):
    """state -> {"test_loss", "test_accuracy": [seeds]}: the global model (`state.params`,
    [seeds, ...]) on every test image, means over images (pfl's central evaluation),
    `eval_batch_size` images at a time."""
    x, y = problem["test_x"], problem["test_y"]
    total = len(y)
    size = min(s["eval_batch_size"], total)
    blocks = math.ceil(total / size)
    pad = blocks * size - total
    xb = jnp.asarray(np.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))).reshape(
        blocks, size, *x.shape[1:])
    yb = jnp.asarray(np.pad(y, (0, pad))).reshape(blocks, size)
    real = jnp.asarray(np.arange(blocks * size) < total).reshape(blocks, size)

    @jax.jit
    def central(params, xb, yb, real):
        def one_seed(p):
            def block(sums, part):
                xs, ys, keep = part
                logits = model.apply(p, xs)
                loss = jnp.sum(jnp.where(keep, softmax_cross_entropy(logits, ys), 0.0))
                correct = jnp.sum(jnp.where(keep, argmax_correct(logits, ys), 0.0))
                return (sums[0] + loss, sums[1] + correct), None

            zero = jnp.zeros((), jnp.float32)
            (loss, correct), _ = jax.lax.scan(block, (zero, zero), (xb, yb, real))
            return loss, correct

        return jax.vmap(one_seed)(params)

    def metrics(state):  # sums over the images on the device, means on the host (float64)
        loss, correct = central(state.params, xb, yb, real)
        return {"test_loss": np.asarray(loss, np.float64) / total,
                "test_accuracy": np.asarray(correct, np.float64) / total}

    return metrics


def user_count(s: dict, num_images: int) -> int:
    """Users pfl makes of `num_images`: iid ⌈N / size⌉ (a smaller last one), Dirichlet
    ⌊N / size⌋ (the remainder dropped)."""
    per = s["datapoints_per_user"]
    return -(-num_images // per) if s["dataset"] == "cifar10_iid" else num_images // per


SETTINGS = (
    st.Setting("data_dir", str, "", "directory with CIFAR-10: cifar-10-python.tar.gz "
               "(or cifar-10-batches-py/), pfl-research's cifar10_train.p/cifar10_test.p, "
               "cifar10/train.npz and test.npz, or a tfds build; nothing downloads",
               result=False),
    st.Setting("cache_dir", str, "", "decoded-array cache of a tfds build (default: "
               "$FEDJAX_SIM_CACHE or ~/.cache/fedjax_sim)", result=False),
    st.Setting("dataset", str, "cifar10_iid", "pfl's users: cifar10_iid (a permutation "
               "cut into users) or cifar10 (Dirichlet class shares per user)",
               choices=DATASETS),
    st.Setting("partition_alpha", float, 0.1, "cifar10: Dirichlet α of each user's class "
               "shares (pfl's partition_alpha)", minimum=1e-6,
               when=("dataset", ("cifar10",))),
    st.count("datapoints_per_user", 50, "images per user (pfl's "
             "mean_datapoints_per_user, constant)", maximum=60_000),
    st.count("cohort_size", 50, "users per central iteration (pfl's cohort_size)",
             maximum=60_000),
    st.count("local_epochs", 1, "passes over a user's images per iteration (pfl's "
             "local_num_epochs)", maximum=1000),
    st.batch_size_setting(10, "local minibatch size (pfl's local_batch_size); 0: a "
                          "user's every image"),
    st.lr_setting(0.1, "local SGD learning rate (pfl's local_learning_rate)"),
    st.Setting("central_lr", float, 1.0, "central SGD learning rate on the cohort's "
               "mean model change (pfl's learning_rate); 1: plain FedAvg",
               minimum=0.0),
    st.Setting("weighting", str, "uniform", "uniform: every user's update alike (pfl's "
               "weight_by_samples=false); examples: ∝ its images", choices=WEIGHTINGS),
    st.Setting("model_dropout", bool, True, "local steps train simple_cnn with its dropout "
               "(0.25, 0.5) active, a fresh key per step, as pfl does; false: without "
               "(evaluation never drops)"),
    st.rounds_setting(1500, "central iterations (pfl's central_num_iterations)"),
    st.eval_every_setting(10, "evaluate on the test set every this many iterations "
                          "(pfl's evaluation_frequency)"),
    st.count("eval_batch_size", 1000, "test images per evaluation step (memory only)",
             maximum=10**6, result=False),
    st.Setting("pixel_layout", str, "images", "images: the pictures; pfl: as pfl's "
               "preprocessed pickles lay them out (the archive's channel planes "
               "reshaped to 32×32×3 as they lie)", choices=PIXEL_LAYOUTS),
    st.seeds_setting(1, "seeds (users, init, cohorts), one vmapped axis", maximum=100),
    st.seed_setting(),
    st.checkpoint_setting(100),
    st.method_setting(tuple(TABLE), "fedavg"),
)


def validate(s: dict, command: str = "run") -> None:
    """The data exist and make enough users for a cohort, before anything is written."""
    tx, _, vx, _ = load_split_images(s)
    if s["datapoints_per_user"] > len(tx):
        raise ValueError(f"setting datapoints_per_user={s['datapoints_per_user']} exceeds "
                         f"the {len(tx)} training images in data_dir.")
    users = user_count(s, len(tx))
    if s["cohort_size"] > users:
        raise ValueError(f"setting cohort_size={s['cohort_size']} exceeds the {users} users "
                         f"of {s['datapoints_per_user']} images that the {len(tx)} training "
                         "images make.")
    if len(vx) == 0:
        raise ValueError(f"setting data_dir={s['data_dir']!r}: the test split is empty.")


def derived(s: dict, problem: dict) -> dict:
    """s with participation = cohort_size / users and whether users differ in size."""
    users = max(problem["users"])
    participation = s["cohort_size"] / users
    if cohort_size(users, participation) != s["cohort_size"]:
        raise ValueError(f"setting cohort_size={s['cohort_size']} cannot be drawn from "
                         f"{users} users.")
    return {**s, "participation": participation, "ragged_users": len(problem["sizes"]) > 1}


def client_training(s: dict, learning_rate) -> ClientTraining:
    """Plain SGD, `local_epochs` passes over the user's images in batches of batch_size:
    ⌈n / b⌉ steps per epoch, each epoch a permutation (pfl: in the user's order, which
    its own permutation of the images made random). Users of unequal size (an iid
    remainder) each take their own ⌈E·n_i / b⌉ steps."""
    b = s["batch_size"] or None
    per_epoch = -(-s["datapoints_per_user"] // b) if b else 1
    work = Work(epochs=s["local_epochs"]) if s.get("ragged_users") else Work()
    return sgd(learning_rate, steps=s["local_epochs"] * per_epoch, batch_size=b,
               sampling="epochs" if b else "with_replacement", work=work)


def footprint(name: str, s: dict, problem) -> Footprint:
    """What a method's round holds, for the executor's client chunk: one seed's users
    (shapes), × seeds, each training its own copy of simple_cnn. Not checked against the
    machine (`Footprint.fit_machine` False): on a CPU the executor trains the cohort
    `memory.CPU_ROUND_WORK_BYTES` of working memory at a time, which for simple_cnn's
    users of 50 images (a local step's activations and the model's copies, well over
    that bound per user) is one user at a time; elsewhere the whole cohort at once."""
    shapes = jax.eval_shape(lambda d: _as_copies(copy_at(d, 0)), problem["train"])
    return Footprint(problem["model"], shapes, copies=s["seeds"], applies_to=("train",))


def _as_copies(data):
    """Client data as FederatedData (views gathered; for shapes only)."""
    return data if isinstance(data, FederatedData) else data.materialize()


def problem(s: dict, arrays=None) -> dict:
    """pfl's users of every seed, the test images and simple_cnn; `arrays` (train images,
    train labels, test images, test labels) stand in for data_dir's (benchmarks, tests)."""
    problem = build_problem(s, arrays)
    problem["model"] = simple_cnn(10, problem["test_x"].shape[1:], mean=problem["mean"],
                                  std=problem["std"], dropout=s.get("model_dropout", True))
    return problem


def notes(s: dict, problem, results: dict) -> dict:
    users = max(problem["users"])
    sizes = problem["sizes"]
    split = ("iid: a permutation cut into users" if s["dataset"] == "cifar10_iid" else
             f"Dirichlet(α={s['partition_alpha']}) class shares per user (pfl's "
             "partition_by_dirichlet_class_distribution)")
    b = s["batch_size"] or "all"
    dropout = ("dropout 0.25 and 0.5 in local steps" if s.get("model_dropout", True)
               else "dropout off")
    return {
        "data": f"CIFAR-10 from data_dir: {users} users of "
                f"{'–'.join(map(str, (sizes[0], sizes[-1]))) if len(sizes) > 1 else sizes[0]} "
                f"training images ({split}); central evaluation on all "
                f"{len(problem['test_y'])} test images; pixel layout {s['pixel_layout']}",
        "training": f"simple_cnn (1,626,442 parameters, {dropout}), cohort "
                    f"{s['cohort_size']} uniformly without replacement, {s['local_epochs']} "
                    f"local epoch(s) of batch {b} at lr {s['lr']}, central SGD at "
                    f"{s['central_lr']}, {s['weighting']} average, {s['rounds']} "
                    f"iterations, evaluated every {s['eval_every']}, {s['seeds']} seed(s)",
        "pfl": "pfl-research's pfl:benchmarks/image_classification/configs/baseline.yaml; "
               "docs/protocols.md#cifar-10-pfl-research lists what matches and what differs",
    }


PFL = Experiment(
    name="pfl_cifar10",
    description="pfl-research's CIFAR-10 FedAvg benchmark (simple_cnn, 1,000 users of 50 "
                "images, central evaluation on the test set)",
    settings=SETTINGS,
    problem=problem,
    metrics=lambda t: metrics_fn(t.model, t.problem, t.s),
    methods=("fedavg", "fedprox"),
    baseline="fedavg",
    table=lambda s: list(METRICS),
    notes=notes,
    validate=validate,
    panels=(("test_accuracy", "central test accuracy"), ("test_loss", "central test loss")),
    method_table=TABLE,
    kinds=("global",),  # central evaluation of the one global model
    client_training=client_training,
    derived=derived,
    footprint=footprint,
)

PRESETS = [
    Preset("fedavg-cifar10-pfl", PFL,
           "pfl-research's CIFAR-10 benchmark (its baseline.yaml) from data_dir: 1,000 iid users "
           "of 50 images, simple_cnn (1.63 M parameters, dropout 0.25 and 0.5 in local "
           "steps), cohort 50, one local epoch of batch 10 at lr 0.1, central SGD at 1.0, "
           "unweighted average, 1,500 iterations, central test evaluation every 10."),
    Preset("fedavg-cifar10-pfl-dirichlet", PFL,
           "The same with pfl's non-iid users (dataset cifar10: Dirichlet(0.1) class shares per "
           "user) and its README's 3,000 iterations.",
           {"dataset": "cifar10", "rounds": 3000}),
]
