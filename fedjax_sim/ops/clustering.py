"""Cluster losses [m, k] and the argmin cluster assignment (IFCA's E-step)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.core import Model, client_loss


@functools.partial(jax.jit, static_argnames="model")
def cluster_losses(model: Model, cluster_params, data: FederatedData) -> jax.Array:
    """F_i(θ_j) for every client i and cluster model j.

    Args:
      model: the model whose `client_loss` is evaluated.
      cluster_params: params pytree, leaves [k, ...].
      data: m clients.

    Returns:
      [m, k] losses (masked means over each client's real rows).
    """
    one = functools.partial(client_loss, model)
    over_clusters = jax.vmap(one, in_axes=(0, None, None, None))
    return jax.vmap(over_clusters, in_axes=(None, 0, 0, 0))(
        cluster_params, data.x, data.y, data.num_examples
    )


@jax.jit
def assign_clusters(losses: jax.Array) -> jax.Array:
    """ĵ_i = argmin_j losses[i, j]; [m, k] -> [m] int32.

    Ties go to the lowest cluster index; a NaN loss counts as +inf, so a
    diverged cluster model is never chosen over a finite one.
    """
    safe = jnp.where(jnp.isnan(losses), jnp.inf, losses)
    return jnp.argmin(safe, axis=-1).astype(jnp.int32)
