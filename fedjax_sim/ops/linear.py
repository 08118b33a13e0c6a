"""Fused kernels for linear regression (models of structure "linear"), IFCA's hot path.

The synthetic IFCA sweeps spend all their time here. `ops.cluster_losses` and
`ops.cluster_gradient_sums` pick these when the model declares
`structure="linear"`; they equal the generic vmap/VJP kernels to float
rounding (tests check both against a per-client loop).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _residuals(theta, x, y, num_examples):
    """Residuals x·θ_j − y of every client and cluster, [m, n, k], 0 on padding rows.

    One [m·n, d] × [d, k] product with k minor: the layout XLA:CPU runs
    fastest. (vmapping `client_loss` over clusters, then clients, asks for
    [m, k, n] and costs a transposed copy per pass.)
    """
    predictions = jnp.einsum("mnd,kd->mnk", x, theta)
    real = jnp.arange(x.shape[1])[None, :] < num_examples[:, None]
    return jnp.where(real[:, :, None], predictions - y[:, :, None], 0.0)


def _inverse_counts(num_examples):
    return 1.0 / jnp.maximum(num_examples, 1).astype(jnp.float32)


def _mean_squares(r, inv):
    """[m, n, k] masked residuals, [m] 1/n_i -> [m, k] mean squared residuals."""
    return jnp.sum(r * r, axis=1) * inv[:, None]


def _cluster_losses(theta, x, y, num_examples):
    r = _residuals(theta, x, y, num_examples)
    return _mean_squares(r, _inverse_counts(num_examples))


@jax.custom_batching.custom_vmap
def linear_cluster_losses(theta, x, y, num_examples):
    """[m, k] mean squared residuals (no ½) of k linear models θ [k, d] on m clients.

    Vmapped over copies of the models alone (restarts: θ [R, k, d], one set of
    clients), the R·k models are one [R·k, d] matrix: one product, and the
    [m, n, R·k] residuals reduced over n where the product leaves them. (The
    plain vmap computes the same product, then copies the residuals into
    [R, m, n, k] order before reducing them: a transposing pass over the
    largest array of the evaluation, 28 % of a chunk of 10⁸ generated clients'
    test evaluation.)
    """
    return _cluster_losses(theta, x, y, num_examples)


@linear_cluster_losses.def_vmap
def _losses_vmapped(axis_size, in_batched, theta, x, y, num_examples):
    theta_batched, *data_batched = in_batched
    if theta_batched and not any(data_batched):
        k, d = theta.shape[1:]
        flat = linear_cluster_losses(theta.reshape(axis_size * k, d), x, y, num_examples)
        return jnp.moveaxis(flat.reshape(flat.shape[0], axis_size, k), 1, 0), True
    in_axes = tuple(0 if b else None for b in in_batched)
    return jax.vmap(_cluster_losses, in_axes=in_axes)(theta, x, y, num_examples), True


def linear_cluster_grad_sums(theta, x, y, num_examples, choose, weights):
    """IFCA option I's losses, assignment and Σ_{i: ĵ_i = j} w_i ∇F_i(θ_j), fused.

    ∇F_i(θ_j) = (2/n_i) Σ_rows r_ij x. Each client contributes to one cluster
    only, so its chosen residual column is picked first and the gradient is a
    per-client [n] · [n, d] product: one pass over X after the forward one.
    (The generic VJP contracts the one-hot cotangent with X over m and n for
    every cluster: k times the multiply-adds and a transposed read of X.)
    The per-client gradients are then added into their clusters by one
    [k, m] × [m, d] product with the 0/1 assignment. (A select-then-sum over
    an [m, k, d] array, the earlier form, made XLA:CPU write that array and
    sum it in a tree of reduce-windows: 4·m·k·d bytes written and read again
    for m·d of data; a segment sum is a scatter, 3 more thunks.) A NaN
    cluster model nobody chose still leaves the others finite, as the
    clients' gradients are all finite; a client whose chosen model gives it
    a non-finite gradient (all its losses non-finite) makes every sum NaN,
    as in the generic VJP path.

    Args:
      theta: [k, d]; x: [m, n, d]; y: [m, n]; num_examples: [m].
      choose: [m, k] losses -> [m] assignment.
      weights: [m]; 0 leaves a client out.

    Returns:
      (losses [m, k], assignment [m], sums [k, d]).
    """
    k = theta.shape[0]
    r = _residuals(theta, x, y, num_examples)
    inv = _inverse_counts(num_examples)
    losses = _mean_squares(r, inv)
    assignment = choose(losses)
    taking_part = weights != 0
    safe = jnp.clip(assignment, 0, k - 1)  # an unassigned (-1) client is not taking part
    r_chosen = jnp.take_along_axis(r, safe[:, None, None], axis=2)[:, :, 0]  # [m, n]
    coef = jnp.where(taking_part[:, None], r_chosen * (2.0 * inv * weights)[:, None], 0.0)
    # A batched [1, n]·[n, d] product per client: XLA's batched-dot loop reads X once and
    # beat the multiply-and-reduce loop fusion (d = 10, m = 10⁵: 3.6 against 7.7 ms CPU).
    client_grads = jnp.einsum("mn,mnd->md", coef, x)
    picked = (assignment[:, None] == jnp.arange(k)) & taking_part[:, None]
    sums = jnp.einsum("mk,md->kd", picked.astype(client_grads.dtype), client_grads)
    return losses, assignment, sums


def supports(model, shared) -> bool:
    """Whether the fused kernels apply: a linear model, no shared (trunk) params."""
    return model.structure == "linear" and not jax.tree.leaves(shared)
