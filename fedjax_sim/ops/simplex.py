"""Euclidean projection onto the probability simplex (DRFA's λ step)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

FLOOR_METHODS = ("exact", "clip")


@functools.partial(jax.jit, static_argnames="floor_method")
def project_simplex(v: jax.Array, floor: float | jax.Array = 0.0,
                    floor_method: str = "clip") -> jax.Array:
    """argmin_{λ ∈ Δ} ‖λ − v‖₂, optionally with every entry kept >= floor.

    Wraps `optax.projections.projection_simplex` (the sort method, as in
    FedTorch's `projection_simplex_sort`): O(N log N), one sort.

    Two ways to keep weights away from zero:

    - "exact": the Euclidean projection onto the floored simplex
      {λ ≥ floor, Σ λ = 1}, i.e. floor + Π_{(1 − N·floor)Δ}(v − floor). The
      floor then holds exactly (needs N·floor <= 1).
    - "clip" (default, as before "exact" existed): FedTorch's rule,
      project, raise entries below the floor to it and renormalise (so
      entries end a little below the floor). FedTorch's distributed code
      floors every entry; its centered code only the first
      one, a bug we do not copy.

    Args:
      v: [N] vector.
      floor: lower bound (0 disables); may be traced.
      floor_method: "exact" or "clip" (static).

    Returns:
      [N] vector on the simplex.
    """
    if floor_method not in FLOOR_METHODS:
        raise ValueError(f"floor_method must be one of {FLOOR_METHODS}; got {floor_method!r}.")
    floor = jnp.asarray(floor, v.dtype)
    if floor_method == "exact":
        n = v.shape[0]
        scale = 1.0 - n * floor
        # N·floor = 1 leaves one point, every entry at the floor.
        safe = jnp.where(scale > 0, scale, 1.0)
        proj = optax.projections.projection_simplex(v - floor, safe)
        return jnp.where(scale > 0, floor + proj, jnp.full_like(v, 1.0 / n))
    lam = optax.projections.projection_simplex(v)
    lam = jnp.maximum(lam, floor)
    return lam / jnp.sum(lam)


@functools.partial(jax.jit, static_argnames="num_segments")
def project_segments(v: jax.Array, segment_ids: jax.Array, num_segments: int) -> jax.Array:
    """Each segment projected onto its own simplex: λ[ids = j] = Π_Δ(v[ids = j]) for every j.

    The projection onto a product of simplices, one per segment (a cluster's clients in
    robust IFCA, the clients holding data in AFL). Entries whose id lies outside
    [0, num_segments) get 0, and a segment without entries has nothing to project.

    Args:
      v: [N] vector.
      segment_ids: [N] ints.
      num_segments: static.

    Returns:
      [N]: on each non-empty segment, non-negative entries summing to 1; 0 elsewhere.
    """

    def one(j):
        member = segment_ids == j
        # Entries outside the segment are put 2 below its largest: the projection's
        # threshold is at least (largest − 1), so they come out 0 and leave the rest alone.
        low = jnp.max(jnp.where(member, v, -jnp.inf)) - 2.0
        low = jnp.where(jnp.isfinite(low), low, 0.0)
        return jnp.where(member, optax.projections.projection_simplex(jnp.where(member, v, low)),
                         0.0)

    return jnp.sum(jax.vmap(one)(jnp.arange(num_segments)), axis=0)
