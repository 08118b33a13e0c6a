"""k-means (Lloyd) on stacked vectors, for one-shot clustering of local models."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _lloyd(points, weights, centers, iters):
    def assign(c):
        d2 = jnp.sum(jnp.square(points[:, None, :] - c[None, :, :]), axis=-1)
        return jnp.argmin(d2, axis=1), jnp.min(d2, axis=1)

    def step(c, _):
        labels, _ = assign(c)
        onehot = jax.nn.one_hot(labels, c.shape[0], dtype=points.dtype) * weights[:, None]
        counts = onehot.sum(0)
        sums = onehot.T @ points
        # An empty cluster keeps its center.
        return jnp.where(counts[:, None] > 0, sums / jnp.maximum(counts, 1)[:, None], c), None

    centers, _ = jax.lax.scan(step, centers, None, length=iters)
    labels, d2 = assign(centers)
    return labels.astype(jnp.int32), jnp.sum(weights * d2)


@functools.partial(jax.jit, static_argnames=("k", "iters", "restarts"))
def kmeans(key, points: jax.Array, k: int, iters: int = 50, restarts: int = 8, weights=None):
    """Lloyd's k-means from `restarts` random initial centers; keeps the best.

    Args:
      key: PRNG key.
      points: [m, p] vectors.
      k: number of clusters (<= the number of points of non-zero weight).
      weights: optional [m] 0/1 (or non-negative) point weights; a point of
        weight 0 moves no center, adds no inertia and is never an initial
        center (its label is still its nearest center).

    Returns:
      (labels [m] int32, inertia scalar) of the restart with the lowest inertia.
    """
    m = points.shape[0]
    weights = jnp.ones((m,), points.dtype) if weights is None else weights.astype(points.dtype)
    keys = jax.random.split(key, restarts)
    probs = (weights > 0) / jnp.maximum(jnp.sum(weights > 0), 1)
    init = jax.vmap(lambda kk: points[jax.random.choice(kk, m, (k,), replace=False, p=probs)])(
        keys
    )
    labels, inertia = jax.vmap(lambda c: _lloyd(points, weights, c, iters))(init)
    best = jnp.argmin(inertia)
    return labels[best], inertia[best]
