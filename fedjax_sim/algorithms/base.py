"""An algorithm is a NamedTuple of pure functions, like optax's GradientTransformation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

State = Any


class Algorithm(NamedTuple):
    """init(key, data) -> state; round(state, data, key) -> (state, metrics);
    evaluate(state, data) -> per-client metrics.

    `round` is one communication round: pure and jit-able. `evaluate` returns a
    dict with at least `client_loss` [m] and `assignment` [m] (the cluster
    model each client uses, -1 where the notion does not apply), and
    `client_accuracy` [m] for classification models.
    """

    init: Callable[..., State]
    round: Callable[..., tuple[State, dict]]
    evaluate: Callable[..., dict]


def client_optimizer(optimizer, learning_rate) -> optax.GradientTransformation:
    """The given optax optimizer, or plain SGD at learning_rate.

    learning_rate may be a traced value (a sweep vmaps over it), so it is only
    range-checked when it is a concrete number.
    """
    if optimizer is not None:
        return optimizer
    if learning_rate is None:
        raise ValueError("give either an optax optimizer or a learning_rate.")
    if isinstance(learning_rate, (int, float, np.number)) and not (learning_rate >= 0):
        raise ValueError(f"learning_rate must be a number >= 0; got {learning_rate!r}.")
    return optax.sgd(learning_rate)


def cohort_size(num_clients: int, participation: float) -> int:
    """Clients per round for a participation fraction (at least 1)."""
    return max(1, int(round(participation * num_clients)))


def check_fraction(name: str, value: float) -> None:
    if not (0.0 < float(value) <= 1.0):
        raise ValueError(f"{name} must be in (0, 1]; got {value!r}.")


def num_params(params) -> int:
    """Floats in one model (static)."""
    return sum(int(x.size) for x in jax.tree.leaves(params))


def tree_weighted_mean(tree, weights):
    """Σ_i w_i tree[i] / Σ_i w_i over the leading axis of every leaf."""
    w = weights / jnp.sum(weights)
    return jax.tree.map(lambda a: jnp.tensordot(w.astype(a.dtype), a, axes=1), tree)


def with_restarts(algorithm: Algorithm, restarts: int) -> Algorithm:
    """Runs `restarts` independent copies of an algorithm at once (vmap).

    Every copy shares the data; copy r's keys are fold_in(key, r). The state,
    round metrics and evaluation outputs gain a leading [restarts] axis.
    """
    if restarts < 1:
        raise ValueError(f"restarts must be >= 1; got {restarts}.")
    ids = jnp.arange(restarts)

    def fold(key):
        return jax.vmap(lambda r: jax.random.fold_in(key, r))(ids)

    def init(key, data):
        return jax.vmap(algorithm.init, in_axes=(0, None))(fold(key), data)

    def round_(state, data, key):
        return jax.vmap(algorithm.round, in_axes=(0, None, 0))(state, data, fold(key))

    def evaluate(state, data):
        return jax.vmap(algorithm.evaluate, in_axes=(0, None))(state, data)

    return Algorithm(init, round_, evaluate)
