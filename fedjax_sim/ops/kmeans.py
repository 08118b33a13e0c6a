"""k-means (Lloyd) on stacked vectors, for one-shot clustering of local models.

The points can be long (one-shot clusters flattened models: 159 010 floats per
client for the rotated-MNIST MLP), so the squared distances of all points to
all centers of every restart are one GEMM per leaf, ‖x − μ‖² − 2 (x − μ)·(c − μ) +
‖c − μ‖² about the points' mean μ, never an [m, k, p] tensor (which
XLA on CPU runs as a broadcast-subtract-square-reduce over m·k·p elements
per restart and iteration: about 180 CPU seconds for one seed of 320 local
models × 8 restarts × 50 iterations on the 2-core AMD EPYC, against about 2 as
GEMMs with the early stop; benchmarks/README.md, "A comparison's wall time per
phase"). Measuring from μ leaves every distance unchanged and keeps
the expansion's cancellation small when the points share a large common part
(local models trained from one shared init); the points are read in place (a
pytree of stacked models needs no flattened copy, nor a centred one). Lloyd
stops once the labels no longer change: the next center update would
reproduce the same centers exactly (a fixed point), so stopping early returns
what `iters` iterations would.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _rows(points) -> list:
    """The leaves of a pytree of [m, ...] arrays as [m, p_leaf] views (no copy)."""
    leaves = jax.tree.leaves(points)
    return [a.reshape(a.shape[0], -1) for a in leaves]


def _dot(a, b):
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def _sq_distances(rows, mean, sq_norms, centers):
    """[m, k] squared distances of the points (rows, leaves [m, p]) to centers (leaves [k, p]).

    ‖x − c‖² = ‖x − μ‖² − 2 (x − μ)·(c − μ) + ‖c − μ‖², with (x − μ)·(c − μ) = x·(c − μ) −
    μ·(c − μ): a GEMM on the points as they are, with the centers shifted (no shifted copy
    of the points).
    """
    d2 = sq_norms[:, None]
    for x, mu, c in zip(rows, mean, centers, strict=True):
        shifted = c - mu  # [k, p]
        cross = _dot(x, shifted.T) - _dot(shifted, mu)[None, :]
        d2 = d2 - 2.0 * cross + jnp.sum(jnp.square(shifted), axis=-1)[None, :]
    return jnp.maximum(d2, 0.0)


def _lloyd(rows, mean, sq_norms, weights, centers, iters):
    k = centers[0].shape[0]

    def assign(c):
        d2 = _sq_distances(rows, mean, sq_norms, c)
        return jnp.argmin(d2, axis=1).astype(jnp.int32), jnp.min(d2, axis=1)

    def update(labels, c):
        onehot = jax.nn.one_hot(labels, k, dtype=weights.dtype) * weights[:, None]
        counts = onehot.sum(0)
        keep = counts[:, None] > 0  # an empty cluster keeps its center
        return [jnp.where(keep, _dot(onehot.T, x) / jnp.maximum(counts, 1)[:, None], old)
                for x, old in zip(rows, c, strict=True)]

    def cond(carry):
        i, _, _, changed = carry
        return (i < iters) & changed

    def body(carry):
        i, c, labels, _ = carry
        new, _ = assign(c)
        return i + 1, update(new, c), new, jnp.any(new != labels)

    m = sq_norms.shape[0]
    start = (jnp.int32(0), centers, jnp.full((m,), -1, jnp.int32), jnp.bool_(True))
    _, centers, _, _ = jax.lax.while_loop(cond, body, start)
    labels, d2 = assign(centers)
    return labels, jnp.sum(weights * d2)


@functools.partial(jax.jit, static_argnames=("k", "iters", "restarts"))
def kmeans(key, points, k: int, iters: int = 50, restarts: int = 8, weights=None):
    """Lloyd's k-means from `restarts` random initial centers; keeps the best.

    Each restart runs at most `iters` Lloyd iterations (fewer once its labels
    stop changing: the rest would change nothing).

    Args:
      key: PRNG key.
      points: [m, p] vectors, or a pytree of [m, ...] arrays (e.g. m stacked
        models) whose point i is the concatenation of every leaf's row i,
        flattened; nothing is concatenated in memory.
      k: number of clusters (<= the number of points of non-zero weight).
      weights: optional [m] 0/1 (or non-negative) point weights; a point of
        weight 0 moves no center, adds no inertia and is never an initial
        center (its label is still its nearest center).

    Returns:
      (labels [m] int32, inertia scalar) of the restart with the lowest inertia.
    """
    rows = _rows(points)
    m = rows[0].shape[0]
    dtype = jnp.result_type(*rows)
    weights = jnp.ones((m,), dtype) if weights is None else weights.astype(dtype)
    keys = jax.random.split(key, restarts)
    probs = (weights > 0) / jnp.maximum(jnp.sum(weights > 0), 1)
    picks = jax.vmap(lambda kk: jax.random.choice(kk, m, (k,), replace=False, p=probs))(keys)
    # Distances do not change under a shift; measuring them from the mean of the weighted
    # points keeps the expansion's terms close to the distances themselves.
    present = (weights > 0).astype(dtype)
    mean = [_dot(present, x) / jnp.maximum(jnp.sum(present), 1.0) for x in rows]
    sq_norms = sum(jnp.sum(jnp.square(x - mu), axis=-1) for x, mu in zip(rows, mean, strict=True))
    labels, inertia = jax.vmap(lambda c: _lloyd(rows, mean, sq_norms, weights, c, iters))(
        [x[picks] for x in rows])
    best = jnp.argmin(inertia)
    return labels[best], inertia[best]
