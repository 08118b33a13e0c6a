"""Metrics of a run: cluster recovery, distance to the truth, per-client loss summaries."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from scipy.optimize import linear_sum_assignment

from fedjax_sim.parallel import to_host


def cluster_identity_accuracy(assignment, truth, num_clusters: int | None = None) -> float:
    """Fraction of clients whose cluster is right, up to a relabeling of clusters.

    The best one-to-one map from predicted labels to true labels is found by
    the Hungarian method on the confusion matrix. Clients with truth -1
    (unknown) or assignment -1 (unassigned) count as wrong only where truth is
    known; clients with unknown truth are ignored.

    Args:
      assignment: [m] predicted cluster ids.
      truth: [m] true cluster ids (-1 = unknown).
      num_clusters: size of the label space (default: inferred).

    Returns:
      Accuracy in [0, 1] (NaN when no client has a known truth).
    """
    a = np.asarray(assignment).astype(np.int64)
    t = np.asarray(truth).astype(np.int64)
    if a.shape != t.shape:
        raise ValueError(f"assignment {a.shape} and truth {t.shape} must have the same shape.")
    known = t >= 0
    if not known.any():
        return float("nan")
    a, t = a[known], t[known]
    size = max(int(a.max(initial=0)), int(t.max(initial=0))) + 1
    if num_clusters is not None:
        size = max(size, num_clusters)
    confusion = np.zeros((size, size), np.int64)
    valid = a >= 0
    np.add.at(confusion, (a[valid], t[valid]), 1)
    rows, cols = linear_sum_assignment(-confusion)
    return float(confusion[rows, cols].sum() / len(t))


@jax.jit
def min_dist(cluster_params: jax.Array, theta_star: jax.Array) -> jax.Array:
    """mean_j min_j' ‖θ_j − θ*_j'‖₂, the official IFCA synthetic metric.

    Args:
      cluster_params: [k, d] estimated cluster models.
      theta_star: [k', d] true models.

    Returns:
      Scalar; NaN if any estimate is NaN.
    """
    diff = cluster_params[:, None, :] - theta_star[None, :, :]
    dist = jnp.sqrt(jnp.sum(jnp.square(diff), axis=-1))
    return jnp.mean(jnp.min(dist, axis=1))


def summarize_clients(evaluation: dict, prefix: str = "") -> dict:
    """Average and worst case of the per-client losses (and accuracies)."""
    loss = to_host(evaluation["client_loss"]).astype(np.float64)
    out = {f"{prefix}loss": float(np.mean(loss)), f"{prefix}loss_worst": float(np.max(loss))}
    if "client_accuracy" in evaluation:
        acc = to_host(evaluation["client_accuracy"]).astype(np.float64)
        out[f"{prefix}accuracy"] = float(np.mean(acc))
        out[f"{prefix}accuracy_worst"] = float(np.min(acc))
    return out
