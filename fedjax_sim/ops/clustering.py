"""Cluster losses [m, k] and the argmin cluster assignment (IFCA's E-step)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.core import Model, client_loss
from fedjax_sim.ops.chunking import map_client_chunks


@functools.partial(jax.jit, static_argnames=("model", "client_chunk"))
def cluster_losses(
    model: Model, cluster_params, data: FederatedData, client_chunk: int | None = None
) -> jax.Array:
    """F_i(θ_j) for every client i and cluster model j.

    Args:
      model: the model whose `client_loss` is evaluated.
      cluster_params: params pytree, leaves [k, ...].
      data: m clients.
      client_chunk: None evaluates all clients at once; else this many
        clients at a time (static), bounding the [m, k, n, ...] activations.

    Returns:
      [m, k] losses (masked means over each client's real rows).
    """
    one = functools.partial(client_loss, model)
    over_clusters = jax.vmap(one, in_axes=(0, None, None, None))
    over_clients = jax.vmap(over_clusters, in_axes=(None, 0, 0, 0))
    return map_client_chunks(
        lambda part: over_clients(cluster_params, part.x, part.y, part.num_examples),
        data,
        client_chunk,
    )


@jax.jit
def assign_clusters(losses: jax.Array) -> jax.Array:
    """ĵ_i = argmin_j losses[i, j]; [m, k] -> [m] int32.

    Ties go to the lowest cluster index; a NaN loss counts as +inf, so a
    diverged cluster model is never chosen over a finite one.
    """
    safe = jnp.where(jnp.isnan(losses), jnp.inf, losses)
    return jnp.argmin(safe, axis=-1).astype(jnp.int32)
