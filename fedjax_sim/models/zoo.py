"""Flax modules of the papers' experiments."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp

from fedjax_sim.models.core import Model, from_flax, split_model


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


class MLPTrunk(nn.Module):
    """The hidden layers of `MLP`: flattened input -> last hidden activations."""

    hidden: Sequence[int]

    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
        return x


def mlp_classifier(
    input_shape: Sequence[int], hidden: Sequence[int], num_classes: int, *, split: bool = False
) -> Model:
    """An MLP with softmax cross-entropy (e.g. 784-200-10 for rotated MNIST).

    split=True makes the hidden layers the trunk and the last Dense layer the
    head (IFCA weight sharing clusters only the head).
    """
    example = jnp.zeros((1, *input_shape), jnp.float32)
    if split:
        return split_model(MLPTrunk(tuple(hidden)), nn.Dense(num_classes), example)
    return from_flax(MLP(tuple(hidden), num_classes), example)
