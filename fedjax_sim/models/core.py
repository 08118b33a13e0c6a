"""A model is three pure functions: init, apply and a per-example loss.

Algorithms only ever call `client_loss`, which masks padded rows, so any flax
module plugs in through `from_flax`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_sim import backend

Params = Any


class Model(NamedTuple):
    """Pure functions of one model.

    init: key -> params.
    apply: (params, x [n, ...]) -> predictions [n, ...].
    example_loss: (predictions [n, ...], y [n, ...]) -> losses [n].
    correct: optional (predictions, y) -> [n] 1.0 where a prediction is right
      (classification); None for regression.
    cluster_losses: optional stacked form of F_i(θ_j) for all clients and
      clusters at once, (params [k, ...], x [m, n, ...], y [m, n, ...],
      num_examples [m]) -> [m, k]. It must equal the vmapped `client_loss`
      (tests check it); a model supplies it when a hand-laid-out version
      compiles to faster code. None: `ops.cluster_losses` vmaps client_loss.
    cluster_grad_sums: optional fused IFCA option-I step, (params [k, ...], x,
      y, num_examples, choose, weights [m]) -> (losses [m, k], assignment [m],
      sums), where assignment = choose(losses) and sums (leaves [k, ...]) is
      Σ_{i: assignment_i = j} weights_i ∇F_i(θ_j). None: `ops.cluster_gradient_sums`
      takes the VJP of the cluster losses with the one-hot assignment.
    """

    init: Callable[[jax.Array], Params]
    apply: Callable[[Params, jax.Array], jax.Array]
    example_loss: Callable[[jax.Array, jax.Array], jax.Array]
    correct: Callable[[jax.Array, jax.Array], jax.Array] | None = None
    cluster_losses: Callable | None = None
    cluster_grad_sums: Callable | None = None


def masked_mean(values: jax.Array, num_examples) -> jax.Array:
    """Mean of values[:num_examples] ([n] -> scalar); 0 for an empty client."""
    mask = jnp.arange(values.shape[0]) < num_examples
    return jnp.sum(jnp.where(mask, values, 0.0)) / jnp.maximum(num_examples, 1)


def client_loss(model: Model, params, x, y, num_examples) -> jax.Array:
    """F_i(params): the mean loss over one client's real rows. Scalar."""
    return masked_mean(model.example_loss(model.apply(params, x), y), num_examples)


def client_accuracy(model: Model, params, x, y, num_examples) -> jax.Array:
    """Fraction of correct predictions over one client's real rows. Scalar."""
    if model.correct is None:
        raise ValueError("this model has no accuracy (regression); use the loss instead.")
    return masked_mean(model.correct(model.apply(params, x), y), num_examples)


def squared_error(pred, y):
    """(y − ŷ)², no ½: the official IFCA code uses torch MSELoss."""
    return jnp.square(pred - y)


def _linear_residuals(theta, x, y, num_examples):
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


def linear_cluster_losses(theta, x, y, num_examples):
    """[m, k] mean squared residuals (no ½) of k linear models on m clients."""
    r = _linear_residuals(theta, x, y, num_examples)
    return _mean_squares(r, _inverse_counts(num_examples))


def linear_cluster_grad_sums(theta, x, y, num_examples, choose, weights):
    """Fused IFCA option-I step for linear regression (see `Model.cluster_grad_sums`).

    ∇F_i(θ_j) = (2/n_i) Σ_rows r_ij x. Each client contributes to one cluster
    only, so its chosen residual column is picked first and the gradient is a
    per-client [n] · [n, d] product: one pass over X after the forward one.
    (The generic VJP contracts the one-hot cotangent with X over m and n for
    every cluster: k times the multiply-adds and a transposed read of X.)
    Picking selects (a gather and `where`s), never multiplies by a 0/1 mask,
    so a diverged (NaN) model that nobody chose does not spill into the
    other clusters.
    """
    k = theta.shape[0]
    r = _linear_residuals(theta, x, y, num_examples)
    inv = _inverse_counts(num_examples)
    losses = _mean_squares(r, inv)
    assignment = choose(losses)
    taking_part = weights != 0
    picked = (assignment[:, None] == jnp.arange(k)[None, :]) & taking_part[:, None]
    r_chosen = jnp.take_along_axis(r, assignment[:, None, None], axis=2)[:, :, 0]  # [m, n]
    r_chosen = jnp.where(taking_part[:, None], r_chosen, 0.0)
    coef = r_chosen * (2.0 * inv * weights)[:, None]
    if x.shape[-1] < backend.YNN_MIN_FEATURES:
        # Narrow features compile without YNN fusions (`fedjax_sim.backend`),
        # where XLA's loop fusion of this product-sum beats a batched [1, n]·[n, d] dot.
        client_grads = jnp.sum(coef[:, :, None] * x, axis=1)
    else:
        client_grads = jnp.einsum("mn,mnd->md", coef, x)
    sums = jnp.sum(jnp.where(picked[:, :, None], client_grads[:, None, :], 0.0), axis=0)
    return losses, assignment, sums


def linear_regression(d: int) -> Model:
    """y = xᵀθ, no bias; θ^(0) ~ Bernoulli(0.5)^d as in the official IFCA code.

    Carries the stacked `cluster_losses` and fused `cluster_grad_sums` above;
    they equal the generic vmapped/VJP path to float rounding (tested).
    """

    def init(key):
        return jax.random.bernoulli(key, 0.5, (d,)).astype(jnp.float32)

    def apply(theta, x):
        return x @ theta

    return Model(
        init,
        apply,
        squared_error,
        cluster_losses=linear_cluster_losses,
        cluster_grad_sums=linear_cluster_grad_sums,
    )


def softmax_cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def argmax_correct(logits, labels):
    return (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)


def from_flax(
    module: nn.Module,
    example_input: jax.Array,
    example_loss=softmax_cross_entropy,
    correct=argmax_correct,
) -> Model:
    """Wraps a flax module taking a batch [n, ...] into a Model."""

    def init(key):
        return module.init(key, example_input)["params"]

    def apply(params, x):
        return module.apply({"params": params}, x)

    return Model(init, apply, example_loss, correct)


class MLP(nn.Module):
    """ReLU multilayer perceptron on flattened inputs."""

    hidden: Sequence[int]
    outputs: int

    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.outputs)(x)


def mlp_classifier(input_shape: Sequence[int], hidden: Sequence[int], num_classes: int) -> Model:
    """An MLP with softmax cross-entropy (e.g. 784-200-10 for rotated MNIST)."""
    return from_flax(
        MLP(tuple(hidden), num_classes), jnp.zeros((1, *input_shape), jnp.float32)
    )
