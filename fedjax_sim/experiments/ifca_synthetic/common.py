"""The synthetic mixture of linear regressions and what every command on it shares.

Data (`make_problem`), the methods of the one method table with the experiment's
settings (`build_algorithm`), their metrics (`metrics_fn`: losses, cluster identity,
min_dist to θ*), the choice of the restart to report, and the shape settings.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim import backend, logs, parallel
from fedjax_sim.algorithms import sgd
from fedjax_sim.data import generated_mixture, linear_mixture
from fedjax_sim.execution import plan_of, planned
from fedjax_sim.experiments.base import client_mean, evaluate_in_chunks
from fedjax_sim.experiments.methods import FLOAT_TARGETS, METHODS, build, fits, setting_of
from fedjax_sim.experiments.settings import Setting, count
from fedjax_sim.metrics import (
    cluster_identity_accuracies,
    confusion_counts,
    matched_accuracies,
    min_dist,
)
from fedjax_sim.models import linear_regression

ALGORITHM_NAMES = ("ifca", "fedavg", "local", "oneshot", "hypcluster", "cfl")  # compared
TRIAL_METRICS = ("train_loss", "test_loss", "cluster_accuracy", "min_dist")
PROVIDES = frozenset({FLOAT_TARGETS})


def success_threshold(sigma: float, offset: float = 0.0) -> float:
    """The official success threshold on min_dist: 0.6σ (+offset)."""
    return 0.6 * sigma + offset


def least_squares_floor(s: dict) -> float:
    """σ·√(d / (N − d)), N = m·n/k: the error of least squares with the true clusters.

    JSON has no infinity: None when N <= d (no finite floor).
    """
    big_n = s["m"] * s["n"] / s["k"]
    if big_n <= s["d"]:
        return None
    return s["sigma"] * math.sqrt(s["d"] / (big_n - s["d"]))


def problem_shapes(s: dict, n_test: int):
    return jax.eval_shape(
        lambda key: linear_mixture(key, k=s["k"], m=s["m"], n=s["n"], d=s["d"], sigma=0.0,
                                   R=0.0, n_test=n_test),
        jax.random.key(0),
    )


def generated(s: dict) -> bool:
    """Whether the clients are drawn inside the round (setting clients=generated)."""
    return s.get("clients", "copies") == "generated"


def client_sample_shapes(s: dict, n_test: int):
    """(shapes of one training client, of one test client) of generated clients:
    what memory planning counts per client (nothing is drawn)."""
    def one(key):
        p = generated_mixture(key, k=s["k"], m=s["m"], n=s["n"], d=s["d"], sigma=0.0, R=0.0,
                              n_test=n_test)
        return p.train.take(jnp.arange(1)), p.test.take(jnp.arange(1))

    return jax.eval_shape(one, jax.random.key(0))


def make_problem(s: dict, key, mesh=None):
    """One data seed; with a mesh under several processes each builds only its own clients.

    With clients=generated nothing per client is stored: the train and test
    clients are `GeneratedClients`, drawn chunk by chunk inside the round (the
    same rows as the copies for the same key)."""
    sizes = dict(k=s["k"], m=s["m"], n=s["n"], d=s["d"], sigma=s["sigma"], R=s["R"],
                 n_test=s["n_test"])
    if generated(s):
        return generated_mixture(key, **sizes)
    if mesh is None or jax.process_count() == 1:
        return linear_mixture(key, **sizes)
    ids = parallel.process_client_ids(s["m"], mesh)
    local = linear_mixture(key, client_ids=jnp.asarray(ids), **sizes)
    return local._replace(
        train=parallel.assemble_clients(local.train, s["m"], mesh),
        test=parallel.assemble_clients(local.test, s["m"], mesh),
    )


# The method table (`experiments.methods`): every method fits the linear mixture (a
# regression, no server data, no split model). Each reads its own step-size setting where
# it has one: a local model fits n < d rows alone, whose Hessian 2XᵀX/n has eigenvalues up
# to ~2(√d + √n)²/n (35 at d = 1000, n = 100), so the IFCA/FedAvg step γ = 0.1, stable for
# cluster-pooled data, diverges there (`local_lr`; one-shot's pre-training: `oneshot_lr`).
TABLE = {name: m for name, m in METHODS.items() if fits(m, PROVIDES) is None}


def kind_of(name: str) -> str:
    """How method `name` is evaluated (`methods.KINDS`)."""
    return TABLE[name].kind


def clustering(name: str) -> bool:
    """Whether method `name` assigns clients to clusters (cluster identity is measured)."""
    return kind_of(name) in ("clustered", "fixed")


def per_client_models(name: str) -> bool:
    """Whether method `name`'s clients keep (or pre-train) models of their own."""
    return kind_of(name) in ("personal", "fixed")


def trains_locally(name: str, s: dict) -> bool:
    """Whether clients of method `name` train their own model copies (what memory
    planning counts): all but IFCA's option I, whose gradients are summed over clients."""
    return not (TABLE[name].algorithm == "ifca" and s["option"] == "gradient")


def client_training(name: str, s: dict):
    """Method `name`'s local training: full-batch SGD at its own step size, local_steps
    steps (IFCA option I: one gradient, `methods.Method.training`)."""
    method = TABLE[name]
    return sgd(s[setting_of(method, "lr", s)], steps=s["local_steps"])


def build_algorithm(name: str, s: dict):
    """Method `name` of the table with the experiment's settings (its own step size)."""
    if name not in TABLE:
        raise ValueError(f"setting algorithm must be one of {', '.join(TABLE)}; got {name!r}.")
    return build(name, TABLE, linear_regression(s["d"]), client_training(name, s), s)


def keeps_client_state(s: dict) -> bool:
    """Whether a run's rounds read the clients' previous clusters back (partial
    participation, or IFCA's communication reduction)."""
    return s["participation"] < 1.0 or bool(s.get("stable_rounds"))


def keeping_client_state(problem, s: dict):
    """The problem with its training clients saying whether per-client state no round
    reads back may be dropped (with every client in every round IFCA reads no client's
    previous cluster: the metrics take it from the evaluation; the communication
    reduction, `stable_rounds`, reads it). How many clients a round processes at once is
    the executor's (`Execution.planned`)."""
    return problem._replace(
        train=planned(problem.train, keep_client_state=keeps_client_state(s)))


def cluster_models(name: str, state):
    """[..., k, d] models to measure min_dist on (a global model as k = 1); None for
    methods of per-client models."""
    kind = kind_of(name)
    if kind in ("clustered", "fixed"):
        return state.cluster_params
    if kind == "global":
        return state.params[..., None, :]
    return None


def metrics_fn(name: str, algorithm, problem, k: int, *, progress: bool = False,
               description: str = "evaluation"):
    """state -> {metric: [copies...]} on train and test data, for a (vmapped) algorithm.

    When the executor planned the training clients in chunks (`plan_of(...).client_chunk`,
    data without a seed axis, more clients than a chunk) they are evaluated and summed
    up chunk by chunk (`chunked_metrics_fn`): no per-client value of every client exists
    at once; `progress` and `description` are its progress lines'."""
    d = problem.theta_star.shape[-1]
    lead = problem.theta_star.ndim - 2  # a leading seed axis on the data
    client_chunk = plan_of(problem.train).client_chunk
    if client_chunk is not None and not lead and problem.train.num_clients > client_chunk:
        return chunked_metrics_fn(name, algorithm, problem, k, client_chunk, progress=progress,
                                  description=description)
    truth = parallel.to_host(problem.train.cluster)

    def dist(models, theta_star):
        fn = min_dist
        for _ in range(models.ndim - 2 - lead):
            fn = jax.vmap(fn, in_axes=(0, None))
        for _ in range(lead):
            fn = jax.vmap(fn, in_axes=(0, 0))
        return fn(models, theta_star)

    def on_device(state, train_data, test_data, theta_star):
        """What the metrics need, as one program (one dispatch, one transfer)."""
        train, test = algorithm.evaluate(state, train_data), algorithm.evaluate(state, test_data)
        out = {split: (e["client_loss"], e["client_weight"])
               for split, e in (("train", train), ("test", test))}
        if clustering(name):
            out["assignment"] = train["assignment"]
        models = cluster_models(name, state)
        if models is not None:
            out["min_dist"] = dist(models, theta_star)
        return out

    # θ*'s last axis is d: generated clients' x would be drawn (all m) to read its shape
    evaluate = backend.jit(on_device, d)

    def averages(loss, weight):
        loss, weight = loss.astype(np.float64), weight.astype(np.float64)
        worst = np.where(weight > 0, loss, -np.inf).max(-1)
        return client_mean(loss, weight), worst

    def metrics(state):
        found = parallel.tree_to_host(
            evaluate(state, problem.train, problem.test, problem.theta_star))
        out = {}
        out["train_loss"], out["train_loss_worst"] = averages(*found["train"])
        out["test_loss"], out["test_loss_worst"] = averages(*found["test"])
        if clustering(name):
            assignment = found["assignment"]
            shape = truth.shape[:-1] + (1,) * (assignment.ndim - truth.ndim) + truth.shape[-1:]
            truths = np.broadcast_to(truth.reshape(shape), assignment.shape)
            out["cluster_accuracy"] = cluster_identity_accuracies(assignment, truths, k)
        if "min_dist" in found:
            out["min_dist"] = found["min_dist"]
        return out

    return metrics


def _cluster_distance(name: str, state, theta_star):
    models = cluster_models(name, state)
    if models is None:
        return None
    fn = min_dist
    for _ in range(models.ndim - 2):
        fn = jax.vmap(fn, in_axes=(0, None))
    return parallel.to_host(jax.jit(fn)(models, theta_star))


def chunked_metrics_fn(name: str, algorithm, problem, k: int, client_chunk: int, *,
                       progress: bool = False, description: str = "evaluation"):
    """`metrics_fn`'s metrics, the clients evaluated `client_chunk` at a time.

    Each chunk's per-client values are added into the means' numerators and
    denominators (float64, on the host), the maxima and the confusion counts
    of cluster identity, then dropped: O(copies × chunk) memory, not
    O(copies × m). The values equal `metrics_fn`'s up to float64 summation
    order (cluster identity exactly).

    A pass over the clients can take many minutes (10⁸ generated clients: each
    chunk's rows are drawn again); with `progress`, a pass still running after
    `logs.progress_every()` seconds reports its chunks (`logs.Progress`, unit
    "chunk"), e.g. "ifca-synthetic: evaluating test clients: 1200/5589 chunks".
    """
    d = problem.theta_star.shape[-1]
    train_chunks = evaluate_in_chunks(algorithm, problem.train, client_chunk, d,
                                      extra=lambda rows: rows.cluster)
    test_chunks = evaluate_in_chunks(algorithm, problem.test, client_chunk, d)
    passes = -(-problem.train.num_clients // client_chunk)  # chunks per pass

    def reported(chunks, split: str):
        """The chunks of one pass, with progress lines once the pass has run for a while."""
        started, bar = time.monotonic(), None
        try:
            for done, chunk in enumerate(chunks, 1):
                yield chunk
                if bar is not None:
                    bar.advance(1)
                elif progress and time.monotonic() - started >= logs.progress_every():
                    bar = logs.Progress(passes, initial=done, unit="chunk",
                                        description=f"{description}: evaluating {split} clients")
        finally:
            if bar is not None:
                bar.close()

    def summed(chunks, state, clustering: bool, split: str):
        total = weight = known = confusion = 0
        worst = -np.inf
        for evaluation, truth in reported(chunks(state), split):
            loss = evaluation["client_loss"].astype(np.float64)
            w = evaluation["client_weight"].astype(np.float64)
            total = total + (np.where(w > 0, loss, 0.0) * w).sum(-1)
            weight = weight + w.sum(-1)
            worst = np.maximum(worst, np.where(w > 0, loss, -np.inf).max(-1))
            if clustering:
                assignment = evaluation["assignment"]
                truths = np.broadcast_to(truth, assignment.shape)
                confusion = confusion + confusion_counts(assignment, truths, k)
                known = known + (truths >= 0).sum(-1)
        mean = total / np.where(weight > 0, weight, np.nan)
        accuracy = matched_accuracies(confusion, known) if clustering else None
        return mean, worst, accuracy

    def metrics(state):
        out = {}
        clustered = clustering(name)
        out["train_loss"], out["train_loss_worst"], accuracy = summed(train_chunks, state,
                                                                      clustered, "train")
        out["test_loss"], out["test_loss_worst"], _ = summed(test_chunks, state, False, "test")
        if clustered:
            out["cluster_accuracy"] = accuracy
        distance = _cluster_distance(name, state, problem.theta_star)
        if distance is not None:
            out["min_dist"] = distance
        return out

    return metrics


def best_restart(final: dict) -> tuple[int | None, np.ndarray]:
    """(index of the lowest final train loss among restarts that stayed finite, diverged mask)."""
    diverged = np.zeros(np.shape(final["train_loss"]), bool)
    for value in final.values():
        if np.ndim(value) == diverged.ndim and np.shape(value) == diverged.shape:
            diverged |= ~np.isfinite(np.asarray(value, np.float64))
    losses = np.where(diverged, np.inf, np.asarray(final["train_loss"], np.float64))
    if diverged.all():
        return None, diverged
    return int(np.argmin(losses)), diverged


def per_restart_rows(rows: list[dict]) -> list[dict]:
    """History rows with [restarts] values -> one metrics.csv row per (round, restart)."""
    out = []
    for row in rows:
        values = {k: np.asarray(v) for k, v in row.items() if k != "round"}
        restarts = max((v.shape[0] for v in values.values() if v.ndim), default=1)
        for r in range(restarts):
            out.append({"round": row["round"], "restart": r, **{
                k: float(v[r]) if v.ndim else float(v) for k, v in values.items()}})
    return out


def best_restart_rows(history: list[dict]) -> list[dict]:
    """History rows with [seeds, restarts] values -> per-seed rows of each seed's restart
    of lowest final training loss; a seed whose every restart diverged keeps restart 0
    (whose values go non-finite where it diverged)."""
    final = history[-1]
    seeds = np.shape(final["train_loss"])[0]
    chosen = [best_restart({m: np.asarray(v)[i] for m, v in final.items() if m != "round"})[0]
              or 0 for i in range(seeds)]
    out = []
    for row in history:
        picked = {}
        for m, v in row.items():
            if m == "round":
                continue
            v = np.asarray(v, np.float64)
            picked[m] = v[np.arange(seeds), chosen] if v.ndim == 2 else v
        for metric in COMPARE_METRICS:  # NaN where a method has none (local: no min_dist)
            picked.setdefault(metric, np.full(seeds, np.nan))
        out.append({"round": row["round"], **picked})
    return out

COMPARE_METRICS = ("test_loss", "train_loss", "cluster_accuracy", "min_dist")  # table order

SHAPE = (
    Setting("k", int, 2, "clusters", minimum=1, maximum=1024),
    count("m", 100, "clients (machines); a multiple of k"),
    count("n", 100, "training examples per client"),
    count("d", 1000, "dimension of x and θ", maximum=10**6),
    Setting("sigma", float, 0.1, "noise standard deviation σ", minimum=0.0, traced=True),
    Setting("R", float, 0.5, "cluster separation: θ*_j = R · Bernoulli(0.5)^d", minimum=0.0,
            traced=True),
)

SHAPE_NAMES = tuple(st.name for st in SHAPE)

