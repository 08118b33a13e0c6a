"""Fused kernels for linear regression (models of structure "linear"), IFCA's hot path.

The synthetic IFCA sweeps spend all their time here. `ops.cluster_losses` and
`ops.cluster_gradient_sums` pick these when the model declares
`structure="linear"`; they equal the generic vmap/VJP kernels to float
rounding (tests check both against a per-client loop).
"""

from __future__ import annotations

import functools

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


# The forms of the option-I gradient sums (`linear_cluster_grad_sums`): the same sums,
# computed by different programs, whose speed depends on the CPU, the sizes and whether
# rounds are called one by one or scanned. `fedjax_sim.tuning` picks one per machine and
# round shape; the compiler options that go with each are `backend.compiler_options`'s.
#   "loop"     the per-client gradient as a multiply-and-reduce loop fusion (at d < 64;
#              a batched dot from 64) and the per-cluster sums selected out of an
#              [m, k, d] array; narrow features without YNNPACK. The default.
#   "dot"      the per-client gradient as a batched [1, n]·[n, d] dot and the per-cluster
#              sums as one [k, m] × [m, d] product with the 0/1 assignment; narrow
#              features without YNNPACK.
#   "dot_ynn"  "dot", with YNNPACK running the single dots of narrow features.
LINEAR_FORMS = ("loop", "dot", "dot_ynn")
DEFAULT_LINEAR_FORM = "loop"
LOOP_MAX_FEATURES = 64  # "loop" reduces per-client gradients in a loop fusion below this d


def check_linear_form(form) -> str:
    """`form`, or DEFAULT_LINEAR_FORM for None; ValueError naming the forms otherwise."""
    if form is None:
        return DEFAULT_LINEAR_FORM
    if form not in LINEAR_FORMS:
        raise ValueError(f"the linear kernel's form must be one of {', '.join(LINEAR_FORMS)}; "
                         f"got {form!r}.")
    return form


def linear_cluster_grad_sums(theta, x, y, num_examples, choose, weights, form=None):
    """IFCA option I's losses, assignment and Σ_{i: ĵ_i = j} w_i ∇F_i(θ_j), fused.

    ∇F_i(θ_j) = (2/n_i) Σ_rows r_ij x. Each client contributes to one cluster
    only, so its chosen residual column is picked first and the gradient is a
    per-client [n] · [n, d] product: one pass over X after the forward one.
    (The generic VJP contracts the one-hot cotangent with X over m and n for
    every cluster: k times the multiply-adds and a transposed read of X.)
    How the per-client gradients are formed and added into their clusters is
    the `form` (`LINEAR_FORMS`): every form gives the same sums up to float
    rounding. A NaN cluster model nobody chose leaves the others finite in
    every form; a client whose chosen model gives it a non-finite gradient
    (all its losses non-finite) makes every sum NaN in the "dot" forms (its
    row enters every cluster's product) and its own cluster's in "loop", as
    in the generic VJP path.

    Args:
      theta: [k, d]; x: [m, n, d]; y: [m, n]; num_examples: [m].
      choose: [m, k] losses -> [m] assignment.
      weights: [m]; 0 leaves a client out.
      form: one of LINEAR_FORMS (static); None: DEFAULT_LINEAR_FORM.

    Returns:
      (losses [m, k], assignment [m], sums [k, d]).
    """
    form = check_linear_form(form)
    r = _residuals(theta, x, y, num_examples)
    inv = _inverse_counts(num_examples)
    losses = _mean_squares(r, inv)
    assignment = choose(losses)
    sums = _grad_sums(r, assignment, inv, weights, x, form=form)
    return losses, assignment, sums


@functools.partial(jax.jit, static_argnames=("form",))
def _grad_sums(r, assignment, inv, weights, x, *, form: str):
    """[k, d] per-cluster gradient sums from the [m, n, k] residuals, in `form`.

    Its own (inlined) jitted function: the lowered program names it, which is how
    `fedjax_sim.tuning` knows that a round has a form to choose (`tuning.MARKER`).
    """
    k = r.shape[2]
    taking_part = weights != 0
    safe = jnp.clip(assignment, 0, k - 1)  # an unassigned (-1) client is not taking part
    r_chosen = jnp.take_along_axis(r, safe[:, None, None], axis=2)[:, :, 0]  # [m, n]
    coef = jnp.where(taking_part[:, None], r_chosen * (2.0 * inv * weights)[:, None], 0.0)
    picked = (assignment[:, None] == jnp.arange(k)) & taking_part[:, None]
    if form == "loop":
        if x.shape[-1] < LOOP_MAX_FEATURES:
            client_grads = jnp.sum(coef[:, :, None] * x, axis=1)
        else:
            client_grads = jnp.einsum("mn,mnd->md", coef, x)
        return jnp.sum(jnp.where(picked[:, :, None], client_grads[:, None, :], 0.0), axis=0)
    client_grads = jnp.einsum("mn,mnd->md", coef, x)
    return jnp.einsum("mk,md->kd", picked.astype(client_grads.dtype), client_grads)


def supports(model, shared) -> bool:
    """Whether the fused kernels apply: a linear model, no shared (trunk) params."""
    return model.structure == "linear" and not jax.tree.leaves(shared)
