"""Cohort sampling with static cohort size, so shapes stay fixed under jit."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnames=("num_clients", "cohort_size"))
def sample_uniform(key, num_clients: int, cohort_size: int) -> jax.Array:
    """cohort_size distinct client ids, uniformly without replacement. [s] int32."""
    if not 1 <= cohort_size <= num_clients:
        raise ValueError(
            f"cohort_size must be in [1, num_clients={num_clients}]; got {cohort_size}."
        )
    return jax.random.choice(key, num_clients, (cohort_size,), replace=False).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames="cohort_size")
def sample_weighted(key, probs: jax.Array, cohort_size: int) -> jax.Array:
    """cohort_size client ids drawn i.i.d. ∝ probs, with replacement. [s] int32.

    DRFA samples its cohort by λ this way; duplicates are kept (a client drawn
    twice trains twice), which keeps the λ-weighted average unbiased.
    """
    return jax.random.choice(
        key, probs.shape[0], (cohort_size,), replace=True, p=probs
    ).astype(jnp.int32)
