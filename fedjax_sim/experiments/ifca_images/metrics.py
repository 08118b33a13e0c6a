"""Metrics of the rotated-image experiments: accuracy, loss, cluster identity.

`metrics_fn` evaluates one method on every seed (the official local-baseline
accuracy included); `participant_identity_accuracy` is the paper's Fig. 4
cluster identity over the clients that have taken part.

Unseen clients (setting unseen_clients > 0: training clients held out, `data.hold_out`)
give the participation gap (Yuan et al., ICLR 2022) between two populations of the same
kind, each training client's held-out data being its paired test client:

    seen   = the participating (seen) training clients' paired test clients
    unseen = the held-out training clients' paired test clients
    gap    = seen_test_accuracy − unseen_test_accuracy   (per seed)

both served by one rule per method kind (`Method.kind`): a global model as it is; cluster
models (clustered and fixed: one-shot's too) by the cluster of lowest loss on the client's
*training* part (`unseen.assign_unseen`), on both sides; personal models: a seen client
its own model, an unseen one the global model adapted by `adapt_steps` local steps of the
method's client training (local models: from the mean of the seen clients' models). They
add `seen_test_accuracy`, `seen_test_loss`, `unseen_test_accuracy`, `unseen_test_loss` and
`participation_gap`. The preset's headline `test_accuracy` stays the paper's metric
(cluster models: every test client choosing by its own test loss, setting selection;
local models: each on all its cluster's test data), now over the seen training clients'
models; it is not a side of the gap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.algorithms.base import Algorithm
from fedjax_sim.algorithms.ifca import evaluate_clusters
from fedjax_sim.data import FederatedData, copies_axes
from fedjax_sim.experiments.base import ADAPT, client_mean, stream_key
from fedjax_sim.experiments.methods import Method
from fedjax_sim.experiments.unseen import adapt, adapt_start, assign_unseen, evaluate_each
from fedjax_sim.metrics import cluster_identity_accuracy

TABLE = ["test_accuracy", "local_paired_accuracy", "cluster_accuracy", "train_loss",
         "test_loss"]
UNSEEN_TABLE = ["seen_test_accuracy", "unseen_test_accuracy", "seen_test_loss",
                "unseen_test_loss", "participation_gap"]


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


ROWS_PER_PRODUCT = 256
"""Test rows one product of the local baseline's evaluation takes (whole test clients):
the m/k models of a cluster share them, so each layer is one [rows, features] ×
[features, m/k · width] GEMM. 50-row test clients alone made small-M products at a third
of the CPU's matmul rate; 1000 rows (all of a cluster's) cost more in activations than
they gained (benchmarks/README.md, "Session 15")."""


def local_on_cluster_tests(model, test_of_client, per_test: int, k: int):
    """(params [m, ...], test clients) -> (correct [m], weight [m]) of one seed.

    Local model i on every test client of its cluster, i.e. on all its cluster's
    test data: correct_i = the number of its right predictions over the real rows of
    the cluster's test clients, weight_i = their number of rows. Clients are
    cluster-major (training client i of cluster j is paired with a test client of
    cluster j), so the models are grouped [k, m/k] and the test clients of each
    cluster are taken a few at a time (about `ROWS_PER_PRODUCT` rows), their rows
    shared by the m/k models of the cluster: one GEMM per layer, no per-model copy of
    the test data; a `lax.scan` over the groups holds one at a time.
    """
    m = len(test_of_client)
    per = m // k
    cluster = np.asarray(test_of_client) // per_test
    if m % k or not np.array_equal(cluster, np.arange(m) // per):
        raise ValueError("the local baseline's evaluation needs cluster-major clients, "
                         f"{per} per cluster (build_problem's layout); got clusters "
                         f"{cluster.tolist()}.")

    def hits(params, x, y, real):  # params [per, ...]; rows x [g·n_max, ...] of g test clients
        def one(p):
            right = model.correct(model.apply(p, x), y)
            return jnp.sum(jnp.where(real, right, 0.0))
        return jax.vmap(one)(params)

    def official(params, test):
        if not isinstance(test, FederatedData):  # views: gathered, every test client
            test = test.materialize()
        n_max = test.y.shape[1]
        group = max(g for g in range(1, per_test + 1)
                    if per_test % g == 0 and (g == 1 or g * n_max <= ROWS_PER_PRODUCT))
        steps = per_test // group

        def by_group(a):  # [k·per_test, n_max, ...] -> [steps, k, group·n_max, ...]
            return jnp.swapaxes(a.reshape((k, steps, group * n_max) + a.shape[2:]), 0, 1)

        real = jnp.arange(n_max) < test.num_examples[:, None]  # [k·per_test, n_max]
        rows = (jax.tree.map(by_group, test.x), by_group(test.y), by_group(real))
        grouped = jax.tree.map(lambda a: a.reshape((k, per) + a.shape[1:]), params)

        def step(total, part):
            return total + jax.vmap(hits)(grouped, *part), None

        correct, _ = jax.lax.scan(step, jnp.zeros((k, per), jnp.float32), rows)
        weight = jnp.sum(test.num_examples.reshape(k, per_test), axis=1).astype(jnp.float32)
        return correct.reshape(m), jnp.repeat(weight, per)

    return official


def on_seen(official, m: int):
    """`local_on_cluster_tests`' function for the seen clients' models (params [seen, ...]
    with their ids [seen]): placed at their slots of all m (the others zero) and read back
    from there."""

    def seen_only(params, test, ids):
        full = jax.tree.map(
            lambda p: jnp.zeros((m,) + p.shape[1:], p.dtype).at[ids].set(p), params)
        correct, weight = official(full, test)
        return correct[ids], weight[ids]

    return seen_only


def summarize(out: dict, data) -> dict:
    """{"loss", "accuracy"}: (per-client values, weights) of an evaluation's outputs; the
    accuracy is Σ_i correct_i / Σ_i n_i over clients with data (official
    get_inference_stats)."""
    n = out["client_weight"] * data.num_examples
    return {"loss": (out["client_loss"], out["client_weight"]),
            "accuracy": (out["client_accuracy"], n)}


def cluster_trunk(model, state):
    """(the cluster models' trunk: frozen or shared, {} without one; the network they run
    in: the split model with a trunk, else the whole one) of one seed's state."""
    trunk = state.frozen_params if jax.tree.leaves(getattr(state, "frozen_params", {})) else (
        getattr(state, "shared_params", {}))
    return trunk, (model if jax.tree.leaves(trunk) else model.unsplit())


def serve_clusters(model, state, data, assignment=None) -> dict:
    """One seed's cluster models as IFCA serves them, on their trunk if any (frozen or
    shared): each client the lowest-loss cluster on `data`, or `assignment`'s."""
    trunk, net = cluster_trunk(model, state)
    return evaluate_clusters(net, state.cluster_params, data, shared=trunk,
                             assignment=assignment)


def metrics_fn(method: Method, algorithm: Algorithm, model, problem, s: dict,
               total_rounds: int, training=None):
    """state -> {metric: [seeds]} for one method (vmapped over seeds), by its kind.

    Clustering methods: cluster_accuracy from the state's assignment (each
    client's most recent choice, over the clients that have taken part:
    `participant_identity_accuracy`, Fig. 4) on every call; the accuracy and loss metrics
    of every method only every eval_every rounds and at the last round (other
    calls return no more). All evaluations of a call are one compiled function.
    Test data: a global model every test client; cluster models as IFCA serves them
    (setting selection); per-client models and fixed clusters each training client's
    paired test client; per-client models also the official local-baseline accuracy
    (each on all test data of its cluster). With held-out clients (problem "unseen_train",
    "unseen_paired") the module's seen / unseen metrics and participation gap too;
    training: the method's client training for adapting a personal method (`adapt_steps`
    steps).
    """
    kind = method.kind
    train, test, paired = problem["train"], problem["test"], problem["paired"]
    truth = np.asarray(train.cluster)
    k = s["k"]
    per_test = problem["test_clients"] // k

    summary = summarize

    unseen = "unseen_train" in problem
    seen_ids = (jnp.asarray(problem["seen"], jnp.int32),) if unseen else ()
    if kind == "personal":
        official = local_on_cluster_tests(model, problem["test_of_client"], per_test, k)
        if unseen:
            official = on_seen(official, len(problem["test_of_client"]))

    def trunk_of(st):  # the cluster models' trunk (frozen or shared; none: {}) and network
        return cluster_trunk(model, st)

    def served(st, d, a=None):  # cluster models as IFCA serves them, on their trunk if any
        return serve_clusters(model, st, d, a)

    @jax.jit
    def evaluate_all(state, train, test, paired):
        tr = algorithm.evaluate(state, train)
        out = {"train": summary(tr, train)}
        if kind in ("personal", "fixed"):  # per-client models or fixed clusters: the test twin
            out["test"] = summary(algorithm.evaluate(state, paired), paired)
        elif kind == "clustered" and s["selection"] == "train_loss":
            out["test"] = summary(jax.vmap(served, in_axes=(0, copies_axes(paired), 0))(
                state, paired, tr["assignment"]), paired)
        elif kind == "clustered":
            out["test"] = summary(jax.vmap(served, in_axes=(0, copies_axes(test)))(state, test),
                                  test)
        else:
            out["test"] = summary(algorithm.evaluate(state, test), test)
        if kind == "personal":
            out["official"] = jax.vmap(official, in_axes=(0, copies_axes(test),
                                                          *(0,) * len(seen_ids)))(
                getattr(state, method.personal), test, *seen_ids)
        return out

    def by_training_loss(st, tr, te):  # each client the cluster of lowest loss on tr, on te
        trunk, net = trunk_of(st)
        return served(st, te, assign_unseen(net, st, tr, shared=trunk))

    def per_unseen(state, tr, te, key, ids):  # one seed's held-out clients: adapted/served
        if kind == "personal":
            params = adapt(model, training, adapt_start(method, state), tr, key, ids)
            return evaluate_each(model, params, te)
        return by_training_loss(state, tr, te)

    @jax.jit
    def evaluate_seen(state, tr, te):  # the gap's seen side: the seen clients' test twins
        if kind in ("clustered", "fixed"):  # the unseen side's rule: training-part loss
            return jax.vmap(by_training_loss, in_axes=(0, copies_axes(tr), copies_axes(te)))(
                state, tr, te)
        return algorithm.evaluate(state, te)  # a global model as it is; personal: its own

    @jax.jit
    def evaluate_unseen(state, tr, te, keys, ids):
        if kind in ("personal", "clustered", "fixed"):
            return jax.vmap(per_unseen, in_axes=(0, copies_axes(tr), copies_axes(te), 0, 0))(
                state, tr, te, keys, ids)
        return algorithm.evaluate(state, te)  # a global model as it is (over the seeds)

    if unseen:
        held_train, held_test = problem["unseen_train"], problem["unseen_paired"]
        held_keys = jax.random.split(stream_key(s["seed"], ADAPT), s["seeds"])
        held_ids = jnp.asarray(problem["unseen"], jnp.int32)

    def identity(state):
        assignment = np.asarray(state.assignment)
        return np.array([participant_identity_accuracy(a, t, k)
                         for a, t in zip(assignment, truth, strict=True)])

    clustering = kind in ("clustered", "fixed")

    def metrics(state):
        out = {}
        if clustering:
            out["cluster_accuracy"] = identity(state)
        done = int(np.asarray(state.round).ravel()[0])
        if done % s["eval_every"] and done < total_rounds:
            return out
        ev = evaluate_all(state, train, test, paired)
        for split in ("train", "test"):
            out[f"{split}_loss"] = client_mean(*ev[split]["loss"])
            out[f"{split}_accuracy"] = client_mean(*ev[split]["accuracy"])
        if kind == "personal":
            out["local_paired_accuracy"] = out["test_accuracy"]
            correct, weight = (np.asarray(a, np.float64) for a in ev["official"])
            out["test_accuracy"] = correct.sum(-1) / weight.sum(-1)
        if unseen:
            sides = {"seen": summary(evaluate_seen(state, train, paired), paired),
                     "unseen": summary(evaluate_unseen(state, held_train, held_test, held_keys,
                                                       held_ids), held_test)}
            for side, values in sides.items():
                out[f"{side}_test_loss"] = client_mean(*values["loss"])
                out[f"{side}_test_accuracy"] = client_mean(*values["accuracy"])
            out["participation_gap"] = out["seen_test_accuracy"] - out["unseen_test_accuracy"]
        return out

    return metrics


def first_round_at_one(rows: list[dict], seeds: int) -> list:
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

