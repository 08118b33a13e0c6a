"""Metrics of a run: cluster recovery, distance to the truth, per-client loss summaries."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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
    a, t = np.asarray(assignment), np.asarray(truth)
    if a.shape != t.shape:
        raise ValueError(f"assignment {a.shape} and truth {t.shape} must have the same shape.")
    return float(cluster_identity_accuracies(a.reshape(-1), t.reshape(-1), num_clusters))


def cluster_identity_accuracies(assignment, truth, num_clusters: int | None = None) -> np.ndarray:
    """`cluster_identity_accuracy` of every row of a batch: [..., m] -> [...] float64.

    Each row is matched on its own (its own relabeling); the confusion
    matrices of all rows are counted at once, and only the Hungarian method
    runs per row. Zero-padding a confusion matrix to the batch's label space
    does not change its best matching, so every value equals the per-row one.

    Args:
      assignment: [..., m] predicted cluster ids.
      truth: [..., m] true cluster ids (-1 = unknown), the same shape.
      num_clusters: size of the label space (default: inferred).
    """
    a, t = np.asarray(assignment), np.asarray(truth)
    if a.shape != t.shape or a.ndim < 1:
        raise ValueError(f"assignment {a.shape} and truth {t.shape} must have the same shape "
                         "[..., m].")
    known = t >= 0
    size = max(int(np.max(a, where=known, initial=0)),
               int(np.max(t, where=known, initial=0))) + 1
    if num_clusters is not None:
        size = max(size, num_clusters)
    return matched_accuracies(confusion_counts(a, t, size), known.sum(axis=-1))


def confusion_counts(assignment, truth, size: int) -> np.ndarray:
    """[..., size, size] int64: clients of each (assigned, true) pair, per row of a batch.

    Counts the clients whose truth is known (>= 0) and who are assigned (>= 0);
    additive over clients, so chunks of clients can be counted apart and summed
    (`matched_accuracies` then gives `cluster_identity_accuracies`).

    Args:
      assignment, truth: [..., m] cluster ids below `size` (-1: unassigned / unknown).
      size: the label space.
    """
    a = np.asarray(assignment).astype(np.int64)
    t = np.asarray(truth).astype(np.int64)
    if a.shape != t.shape or a.ndim < 1:
        raise ValueError(f"assignment {a.shape} and truth {t.shape} must have the same shape "
                         "[..., m].")
    if np.any(a >= size) or np.any(t >= size):
        raise ValueError(f"cluster ids must be below size={size}.")
    batch = a.shape[:-1]
    a, t = a.reshape(-1, a.shape[-1]), t.reshape(-1, t.shape[-1])
    rows = np.arange(a.shape[0])[:, None]
    valid = (t >= 0) & (a >= 0)
    flat = ((rows * size + np.where(valid, a, 0)) * size + np.where(valid, t, 0))[valid]
    confusion = np.bincount(flat, minlength=a.shape[0] * size * size)
    return confusion.reshape(batch + (size, size))


def matched_accuracies(confusion, known) -> np.ndarray:
    """Cluster-identity accuracies from `confusion_counts` ([..., size, size]) and the
    clients of known truth ([...]): the best relabeling's matches (Hungarian method, row
    by row) over `known`; NaN where known is 0."""
    confusion = np.asarray(confusion)
    batch = confusion.shape[:-2]
    flat = confusion.reshape((-1,) + confusion.shape[-2:])
    matched = np.zeros(flat.shape[0], np.int64)
    from scipy.optimize import linear_sum_assignment  # scipy takes ~0.5 s to import: on use

    for i, c in enumerate(flat):
        r, col = linear_sum_assignment(-c)
        matched[i] = c[r, col].sum()
    count = np.asarray(known).reshape(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(count > 0, matched / np.maximum(count, 1), np.nan)
    return out.reshape(batch)


def min_dist(cluster_params: jax.Array, theta_star: jax.Array) -> jax.Array:
    """mean_j min_j' ‖θ_j − θ*_j'‖₂, the official IFCA synthetic metric.

    Args:
      cluster_params: [k, d] estimated cluster models.
      theta_star: [k', d] true models.

    Returns:
      Scalar; NaN if any estimate is NaN.

    Raises:
      ValueError: the arguments are not 2-D with the same d (checked on their
        shapes, so also when they are traced).
    """
    a, b = jnp.shape(cluster_params), jnp.shape(theta_star)
    if len(a) != 2 or len(b) != 2 or a[1] != b[1] or not a[0] or not b[0]:
        raise ValueError(
            f"cluster_params [k, d] and theta_star [k', d] must be non-empty 2-D arrays with "
            f"the same d; got shapes {tuple(a)} and {tuple(b)}.")
    return _min_dist(cluster_params, theta_star)


@jax.jit
def _min_dist(cluster_params, theta_star):
    diff = cluster_params[:, None, :] - theta_star[None, :, :]
    dist = jnp.sqrt(jnp.sum(jnp.square(diff), axis=-1))
    return jnp.mean(jnp.min(dist, axis=1))


def summarize_clients(evaluation: dict, prefix: str = "") -> dict:
    """Average and worst case of the per-client losses (and accuracies).

    Averages are weighted by the evaluation's `client_weight` (the algorithm
    decides: 1 per client with data for most, examples per client for
    one-shot clustering); clients of weight 0 (no data) are left out of the
    averages and of the worst case.
    """
    loss = to_host(evaluation["client_loss"]).astype(np.float64)
    weight = to_host(evaluation.get("client_weight", np.ones_like(loss))).astype(np.float64)
    counted = weight > 0

    def average(values):
        total = np.sum(weight, axis=-1)
        return np.sum(np.where(counted, values, 0.0) * weight, axis=-1) / np.where(
            total > 0, total, np.nan)

    def worst(values, reduce):
        fill = -np.inf if reduce is np.max else np.inf
        extreme = reduce(np.where(counted, values, fill), axis=-1)
        # No client with data has no worst case (NaN like the average), not ±inf.
        return np.where(np.any(counted, axis=-1), extreme, np.nan)

    def scalar(v):
        return float(v) if np.ndim(v) == 0 else v

    out = {f"{prefix}loss": scalar(average(loss)),
           f"{prefix}loss_worst": scalar(worst(loss, np.max))}
    if "client_accuracy" in evaluation:
        acc = to_host(evaluation["client_accuracy"]).astype(np.float64)
        out[f"{prefix}accuracy"] = scalar(average(acc))
        out[f"{prefix}accuracy_worst"] = scalar(worst(acc, np.min))
    return out
