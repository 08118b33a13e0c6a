"""Per-cluster weighted averaging of client pytrees (a segment reduction)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnames=("num_segments", "normalize", "client_chunk"))
def segment_average(
    values,
    segment_ids: jax.Array,
    num_segments: int,
    weights: jax.Array | None = None,
    fallback=None,
    normalize: str = "segment",
    client_chunk: int | None = None,
):
    """Weighted per-segment average of a client-stacked pytree.

    Args:
      values: pytree, leaves [m, ...] (one entry per client).
      segment_ids: [m] ints in [0, num_segments); ids outside are dropped.
      num_segments: k.
      weights: [m] non-negative client weights (default 1; use num_examples for
        a sample-weighted mean, 0 to leave a client out).
      fallback: pytree, leaves [k, ...], returned for a segment of zero weight
        (IFCA keeps an empty cluster's model). Default: zeros.
      normalize: "segment" divides each segment's weighted sum by that
        segment's weight (IFCA option II, FedAvg); "total" divides by the
        total weight of all clients (IFCA option I divides by m).
      client_chunk: as in `segment_totals`.

    Returns:
      (averages, segment_weights): pytree with leaves [k, ...], and [k] weights.
    """
    if normalize not in ("segment", "total"):
        raise ValueError(f"normalize must be 'segment' or 'total'; got {normalize!r}.")
    m = segment_ids.shape[0]
    if weights is None:
        weights = jnp.ones((m,), jnp.float32)
    totals, seg_weight = segment_totals(values, segment_ids, num_segments, weights,
                                        client_chunk=client_chunk)
    if normalize == "segment":
        denom = seg_weight
    else:
        denom = jnp.full((num_segments,), jnp.sum(weights.astype(jnp.float32)))
    if fallback is None:
        fallback = jax.tree.map(
            lambda v: jnp.zeros((num_segments,) + v.shape[1:], v.dtype), values
        )
    return divide_segments(totals, seg_weight, fallback, denom), seg_weight


def segment_totals(values, segment_ids: jax.Array, num_segments: int, weights: jax.Array,
                   client_chunk: int | None = None):
    """Per-segment weighted sums Σ_{i: id_i = j} w_i values[i], and Σ w_i.

    The additive half of `segment_average`: sums over chunks of clients add
    up to the sums over all of them, so a chunked round accumulates these and
    divides once (`divide_segments`).

    Args:
      values: pytree, leaves [m, ...].
      segment_ids: [m] ints; ids outside [0, num_segments) are dropped.
      num_segments: k.
      weights: [m] non-negative weights.
      client_chunk: None weighs all m clients' values at once (the scatter's
        [m, ...] operand w_i values[i] is a copy of `values`); else this many
        at a time, each chunk scattered into the running totals: the same sums,
        added in the same order, with one chunk's weighted copy.

    Returns:
      (totals with leaves [k, ...], [k] float32 segment weights).
    """
    m = segment_ids.shape[0]
    weights = weights.astype(jnp.float32)
    seg_weight = jax.ops.segment_sum(weights, segment_ids, num_segments)

    def total(leaf):
        w = weights.reshape((m,) + (1,) * (leaf.ndim - 1)).astype(leaf.dtype)
        if client_chunk is None or client_chunk >= m:
            return jax.ops.segment_sum(w * leaf, segment_ids, num_segments)
        out = jnp.zeros((num_segments,) + leaf.shape[1:], leaf.dtype)
        for start in range(0, m, client_chunk):  # static slices: chunks never padded
            stop = min(start + client_chunk, m)
            out = _scatter_add(out, segment_ids[start:stop], w[start:stop] * leaf[start:stop])
        return out

    return jax.tree.map(total, values), seg_weight


def _scatter_add(totals, segment_ids, updates):
    """totals[segment_ids[i]] += updates[i] in order of i, ids outside [0, k) dropped: the
    scatter `jax.ops.segment_sum` makes (into zeros), here into running totals."""
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=tuple(range(1, updates.ndim)), inserted_window_dims=(0,),
        scatter_dims_to_operand_dims=(0,))
    return jax.lax.scatter_add(totals, segment_ids[:, None], updates, dims,
                               mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def divide_segments(totals, seg_weight: jax.Array, fallback, denom: jax.Array | None = None):
    """totals / denom per segment (denom: the segment weights by default).

    A segment of zero weight gets `fallback` (leaves [k, ...]) whatever the
    denominator: IFCA keeps an empty cluster's model.
    """
    if denom is None:
        denom = seg_weight
    nonempty = seg_weight > 0

    def divide(total, fb):
        shape = (denom.shape[0],) + (1,) * (total.ndim - 1)
        mean = total / jnp.maximum(denom, 1e-30).reshape(shape).astype(total.dtype)
        return jnp.where(nonempty.reshape(shape), mean, fb)

    return jax.tree.map(divide, totals, fallback)


def weighted_sum(values, weights: jax.Array):
    """Σ_i w_i values[i] over the leading (client) axis of every leaf."""
    return jax.tree.map(lambda v: jnp.tensordot(weights.astype(v.dtype), v, axes=1), values)


def mean_or_keep(total, weight: jax.Array, fallback):
    """total / weight, or `fallback` where the (scalar) weight is 0: a model nobody trained."""
    return jax.tree.map(
        lambda t, f: jnp.where(weight > 0, t / jnp.maximum(weight, 1e-30).astype(t.dtype), f),
        total, fallback)
