"""What the heterogeneous-FL experiments measure.

Metrics (averages unweighted over the clients holding data): test accuracy
(mean, worst client), the evaluated model's training loss, test loss (mean,
worst client) and, with clusters, each cluster's worst-client and mean test
loss. A method whose state holds `cluster_params` (IFCA, robust_ifca,
HypCluster) serves a client's test set with the cluster its training data is
assigned to (FedJAX's HypCluster evaluation), never by the test loss itself;
Ditto and local models evaluate each client's own model; a fine-tuned method
(kind "fine_tuned": fedavg_ft) evaluates each client's copy of the global model
after `adapt_steps` local steps on the client's training data.

Unseen clients (setting unseen_clients > 0: clients held out of training,
`data.hold_out`) are scored beside the seen ones, the same metrics prefixed
`unseen_`, by the method's kind (`Method.kind`):

- global: the global model as it is;
- clustered and fixed: the cluster model of lowest loss on the client's
  training part (CFL: among the clusters in use), tested on its test part;
- personal: adapted, `adapt_steps` local steps of the method's client training
  on the client's training part from the global model (Ditto's `params`; local
  models: the mean of the seen clients' models), then tested;
- fine_tuned: fine-tuned as the seen clients are.

`participation_gap` = test_accuracy − unseen_test_accuracy, per seed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.algorithms import ClientTraining
from fedjax_sim.algorithms.ifca import evaluate_clusters
from fedjax_sim.data import copies_axes
from fedjax_sim.experiments.base import ADAPT, client_mean, stream_key
from fedjax_sim.experiments.methods import Method
from fedjax_sim.experiments.unseen import adapt, adapt_start, assign_unseen, evaluate_each


def _outputs(ev: dict, out: dict) -> tuple:
    return ev["client_loss"], ev["client_weight"], out["client_loss"], \
        out["client_accuracy"], out["client_weight"]


def metrics_fn(algorithm, model, problem: dict, s: dict, method: Method | None = None,
               training: ClientTraining | None = None):
    """state -> {metric: [seeds]}: accuracy, losses (mean, worst client, per cluster), and
    with held-out clients (problem "unseen_train", "unseen_test") the same over them,
    prefixed `unseen_`, and the participation gap.

    method: the evaluated method's table entry (its kind; None: read from the state);
    training: its client training for fine-tuning and adapting (`adapt_steps` steps).
    """
    train, test = problem["train"], problem["test"]
    kind = method.kind if method is not None else None
    seeds, m = np.shape(train.num_examples)
    keys = jax.random.split(stream_key(s.get("seed", 0), ADAPT), seeds)
    seen_ids = jnp.asarray(problem.get("seen", np.broadcast_to(np.arange(m), (seeds, m))),
                           jnp.int32)

    def per_seed(state, tr, te, key, ids):
        if kind == "fine_tuned":
            params = adapt(model, training, state.params, tr, key, ids)
            return _outputs(evaluate_each(model, params, tr), evaluate_each(model, params, te))
        ev = algorithm.evaluate(state, tr)
        if hasattr(state, "cluster_params"):  # the cluster the client's training data uses
            out = evaluate_clusters(model, state.cluster_params, te,
                                    shared=getattr(state, "shared_params", None),
                                    assignment=ev["assignment"])
        else:
            out = algorithm.evaluate(state, te)
        return _outputs(ev, out)

    def per_unseen(state, tr, te, key, ids):
        if kind in ("personal", "fine_tuned"):
            params = adapt(model, training, adapt_start(method, state), tr, key, ids)
            return _outputs(evaluate_each(model, params, tr), evaluate_each(model, params, te))
        if hasattr(state, "cluster_params"):
            assignment = assign_unseen(model, state, tr)
            shared = getattr(state, "shared_params", None)
            return _outputs(
                evaluate_clusters(model, state.cluster_params, tr, shared=shared,
                                  assignment=assignment),
                evaluate_clusters(model, state.cluster_params, te, shared=shared,
                                  assignment=assignment))
        return _outputs(algorithm.evaluate(state, tr), algorithm.evaluate(state, te))

    def vmapped(fn, tr, te):
        return jax.jit(jax.vmap(fn, in_axes=(0, copies_axes(tr), copies_axes(te), 0, 0)))

    evaluate = vmapped(per_seed, train, test)
    unseen = "unseen_train" in problem
    if unseen:
        evaluate_unseen = vmapped(per_unseen, problem["unseen_train"], problem["unseen_test"])
        unseen_ids = jnp.asarray(problem["unseen"], jnp.int32)
    clusters = np.unique(problem["cluster"])
    noisy = problem["noisy"]

    def worst(values, weights, sign=1.0):
        """The largest (sign -1: smallest) value over clients with data; NaN when none has."""
        x = (sign * np.where(weights > 0, values, -np.inf * sign)).max(-1)
        return np.where((weights > 0).any(-1), sign * x, np.nan)

    def summary(outputs, prefix=""):
        tr_loss, tr_w, loss, acc, w = (np.asarray(a, np.float64) for a in outputs)
        return {f"{prefix}test_accuracy": client_mean(acc, w),
                f"{prefix}test_accuracy_worst": worst(acc, w, -1.0),
                f"{prefix}train_loss": client_mean(tr_loss, tr_w),
                f"{prefix}test_loss": client_mean(loss, w),
                f"{prefix}test_loss_worst": worst(loss, w)}, loss, w

    def metrics(state):
        out, loss, w = summary(evaluate(state, train, test, keys, seen_ids))
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
        if unseen:
            held, _, _ = summary(evaluate_unseen(state, problem["unseen_train"],
                                                 problem["unseen_test"], keys, unseen_ids),
                                 "unseen_")
            out.update(held)
            out["participation_gap"] = out["test_accuracy"] - out["unseen_test_accuracy"]
        return out

    return metrics
