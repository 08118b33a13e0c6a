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
