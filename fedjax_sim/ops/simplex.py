"""Euclidean projection onto the probability simplex (DRFA's λ step)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


@jax.jit
def project_simplex(v: jax.Array, floor: float | jax.Array = 0.0) -> jax.Array:
    """argmin_{λ ∈ Δ} ‖λ − v‖₂, optionally floored.

    Wraps `optax.projections.projection_simplex` (the sort method, as in
    FedTorch's `projection_simplex_sort`). With floor > 0, entries below it are
    raised to it and the vector renormalised: FedTorch floors at 1e-3 so no
    client's weight ever reaches zero (its distributed version floors every
    entry; the centered version only the first, a bug we do not copy).

    Args:
      v: [N] vector.
      floor: lower bound for every entry after projection (0 disables).

    Returns:
      [N] vector on the simplex.
    """
    lam = optax.projections.projection_simplex(v)
    lam = jnp.maximum(lam, floor)
    return lam / jnp.sum(lam)
