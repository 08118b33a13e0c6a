"""What the heterogeneous-FL experiments measure.

Metrics (averages unweighted over the clients holding data): test accuracy
(mean, worst client), the evaluated model's training loss, test loss (mean,
worst client) and, with clusters, each cluster's worst-client and mean test
loss. A method whose state holds `cluster_params` (IFCA, robust_ifca,
HypCluster) serves a client's test set with the cluster its training data is
assigned to (FedJAX's HypCluster evaluation), never by the test loss itself;
Ditto and local models evaluate each client's own model.
"""

from __future__ import annotations

import jax
import numpy as np

from fedjax_sim.algorithms.ifca import evaluate_clusters
from fedjax_sim.data import copies_axes
from fedjax_sim.experiments.base import client_mean


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

    evaluate = jax.jit(jax.vmap(per_seed, in_axes=(0, copies_axes(train), copies_axes(test))))
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
