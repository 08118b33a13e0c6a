"""Cluster losses [m, k] and the argmin cluster assignment (IFCA's E-step)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from fedjax_sim.data.federated import FederatedData
from fedjax_sim.execution import plan_of
from fedjax_sim.models.core import Model, client_loss, combine, masked_mean
from fedjax_sim.ops import linear
from fedjax_sim.ops.chunking import map_client_chunks


def _stacked_losses(model: Model, shared):
    """(cluster_params [k, ...], x, y, num_examples) -> [m, k] losses, for m clients."""
    if linear.supports(model, shared):
        return linear.linear_cluster_losses
    if model.is_split and jax.tree.leaves(shared):
        # Weight sharing: the trunk's features once per client, then every head.
        def one_client(heads, x, y, n):
            f = model.features(shared, x)

            def per_head(h):
                return masked_mean(model.example_loss(model.head(h, f), y), n)

            return jax.vmap(per_head)(heads)

        return jax.vmap(one_client, in_axes=(None, 0, 0, 0))

    def one(params, x, y, n):
        return client_loss(model, combine(model, shared, params), x, y, n)

    over_clusters = jax.vmap(one, in_axes=(0, None, None, None))
    return jax.vmap(over_clusters, in_axes=(None, 0, 0, 0))


@functools.partial(jax.jit, static_argnames=("model", "client_chunk"))
def cluster_losses(
    model: Model,
    cluster_params,
    data: FederatedData,
    client_chunk: int | None = None,
    shared=None,
) -> jax.Array:
    """F_i(θ_j) for every client i and cluster model j.

    Args:
      model: the model whose `client_loss` is evaluated.
      cluster_params: params pytree, leaves [k, ...] (the per-cluster part
        when `shared` is given).
      data: m clients.
      client_chunk: None evaluates all clients at once; else this many
        clients at a time (static), bounding the [m, k, n, ...] activations.
      shared: the params every cluster shares (a split model's trunk under
        weight sharing); None or {}: the clusters share nothing.

    Returns:
      [m, k] losses (masked means over each client's real rows).
    """
    shared = {} if shared is None else shared
    stacked = _stacked_losses(model, shared)
    return map_client_chunks(
        lambda part: stacked(cluster_params, part.x, part.y, part.num_examples),
        data,
        client_chunk,
    )


def cluster_gradient_sums(
    model: Model,
    cluster_params,
    data: FederatedData,
    choose: Callable[[jax.Array], jax.Array] | None = None,
    weights: jax.Array | None = None,
):
    """IFCA option I's E-step and summed gradients in one pass.

    Args:
      model: the cluster model.
      cluster_params: params pytree, leaves [k, ...].
      data: m clients.
      choose: [m, k] losses -> [m] int assignment (default `assign_clusters`).
      weights: [m] client weights (default 1; 0 leaves a client out).

    Returns:
      (losses [m, k], assignment [m], sums) with sums (leaves [k, ...]) equal
      to Σ_{i: assignment_i = j} weights_i ∇F_i(θ_j). Uses the fused linear
      kernel (`ops/linear.py`, in the form of the data's execution plan) for a
      model of structure "linear"; otherwise
      the VJP of `cluster_losses` with the weighted one-hot assignment as
      cotangent.
    """
    if choose is None:
        choose = assign_clusters
    if weights is None:
        weights = jnp.ones((data.num_clients,), jnp.float32)
    if linear.supports(model, {}):
        return linear.linear_cluster_grad_sums(
            cluster_params, data.x, data.y, data.num_examples, choose, weights,
            form=plan_of(data).linear_form)
    losses, vjp = jax.vjp(lambda p: cluster_losses(model, p, data), cluster_params)
    assignment = choose(losses)
    k = losses.shape[1]
    cotangent = jax.nn.one_hot(assignment, k, dtype=losses.dtype) * weights[:, None]
    (sums,) = vjp(cotangent.astype(losses.dtype))
    return losses, assignment, sums


@jax.jit
def assign_clusters(losses: jax.Array) -> jax.Array:
    """ĵ_i = argmin_j losses[i, j]; [m, k] -> [m] int32.

    Ties go to the lowest cluster index; a NaN loss counts as +inf, so a
    diverged cluster model is never chosen over a finite one.
    """
    safe = jnp.where(jnp.isnan(losses), jnp.inf, losses)
    # argmin as two plain reductions, the minimum and then the first column holding it:
    # XLA:CPU emits argmin as a variadic (value, index) reduce, a scalar loop that took
    # 2/3 of the traced kernel time of a (10³, 10, 10, 4) IFCA round. (A running minimum
    # over the columns, elementwise, was worse: XLA fused it into every consumer, the
    # gradient's loop over X among them, and recomputed it per element.)
    k = safe.shape[-1]
    best = jnp.min(safe, axis=-1, keepdims=True)
    columns = jnp.arange(k, dtype=jnp.int32)
    return jnp.min(jnp.where(safe == best, columns, jnp.int32(k)), axis=-1)


def cosine_similarity(vectors: jax.Array, eps: float = 1e-12) -> jax.Array:
    """α_ij = ⟨v_i, v_j⟩ / (‖v_i‖ ‖v_j‖ + eps) for [s, d] vectors; [s, s] (0 for a zero vector)."""
    norms = jnp.linalg.norm(vectors, axis=1)
    return (vectors @ vectors.T) / (norms[:, None] * norms[None, :] + eps)


def optimal_bipartition(similarity: jax.Array, member: jax.Array) -> jax.Array:
    """The bipartition of the members minimising the largest similarity across it.

    argmin_{c₁ ∪ c₂ = members} max_{i∈c₁, j∈c₂} similarity_ij (CFL's split,
    Sattler et al. 2021): the single-linkage cut. Prim's algorithm grows a
    maximum spanning tree of the members' similarity graph from the first
    member (s − 1 steps, O(s) each), the tree's weakest edge is cut, and the
    side below that edge is returned. Every edge across this cut is at most
    the cut edge, and any bipartition is crossed by some tree edge, which is
    at least the weakest: so no bipartition does better. Shapes are static:
    non-members are masked out.

    Args:
      similarity: [s, s] symmetric similarities.
      member: [s] bool, the points to split (at least 2 for a split).

    Returns:
      [s] bool: True on c₂, the side not holding the first member; all False
      with fewer than two members.
    """
    s = member.shape[0]
    idx = jnp.arange(s)
    root = jnp.argmax(member)
    outside = jnp.where(member, similarity[root], -jnp.inf)  # best link of each point to the tree

    def grow(_, carry):
        in_tree, best, parent, link = carry
        waiting = member & ~in_tree
        v = jnp.argmax(jnp.where(waiting, best, -jnp.inf))
        ok = waiting[v]
        in_tree = in_tree.at[v].set(in_tree[v] | ok)
        link = link.at[v].set(jnp.where(ok, best[v], link[v]))
        closer = ok & member & ~in_tree & (similarity[v] > best)
        return in_tree, jnp.where(closer, similarity[v], best), jnp.where(closer, v, parent), link

    init = (idx == root, outside, jnp.full((s,), root), jnp.full((s,), jnp.inf, similarity.dtype))
    _, _, parent, link = jax.lax.fori_loop(0, s - 1, grow, init)
    cut = jnp.argmin(jnp.where(member & (idx != root), link, jnp.inf))
    # The subtree below the cut edge: every point whose chain of parents reaches it.
    below = jax.lax.fori_loop(0, s, lambda _, b: b | b[parent], idx == cut)
    return below & member & (jnp.sum(member) >= 2)
