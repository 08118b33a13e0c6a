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

Params = Any


class Model(NamedTuple):
    """Pure functions of one model.

    init: key -> params.
    apply: (params, x [n, ...]) -> predictions [n, ...].
    example_loss: (predictions [n, ...], y [n, ...]) -> losses [n].
    correct: optional (predictions, y) -> [n] 1.0 where a prediction is right
      (classification); None for regression.
    """

    init: Callable[[jax.Array], Params]
    apply: Callable[[Params, jax.Array], jax.Array]
    example_loss: Callable[[jax.Array, jax.Array], jax.Array]
    correct: Callable[[jax.Array, jax.Array], jax.Array] | None = None


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


def linear_regression(d: int) -> Model:
    """y = xᵀθ, no bias; θ^(0) ~ Bernoulli(0.5)^d as in the official IFCA code."""

    def init(key):
        return jax.random.bernoulli(key, 0.5, (d,)).astype(jnp.float32)

    def apply(theta, x):
        return x @ theta

    return Model(init, apply, squared_error)


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
