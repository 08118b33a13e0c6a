"""Local models: every client trains only on its own data (IFCA's "local model" baseline)."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_sim.algorithms.base import (
    Algorithm,
    broadcast_to_clients,
    check_inputs,
    check_same_clients,
    mean_over,
    per_client_fields,
)
from fedjax_sim.algorithms.training import ClientTraining, check_training
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.core import Model, client_accuracy, client_loss
from fedjax_sim.ops import client_keys, map_client_chunks

# Clients' own inits are drawn this many parameter bytes at a time: drawing all m at once
# holds the random bits and temporaries of every model together (2.8 GB of XLA temp for
# 5 seeds × 320 rotated-MNIST MLPs of 159k parameters, against 0.95 GB of models).
INIT_BATCH_BYTES = 2**24


def init_per_client(model: Model, keys, batch_bytes: int = INIT_BATCH_BYTES):
    """model.init(keys[i]) for every client i (leaves [m, ...]), a batch of clients at a time.

    The same values as `jax.vmap(model.init)(keys)`. Batches of about `batch_bytes` of
    parameters are written in place into the [m, ...] result (a `fori_loop` of
    dynamic_update_slice, which stays in place under `with_seeds`' vmap, where a stacked
    `lax.map` output would be transposed into a second copy); the last batch is shifted
    back to end at m, redrawing a few clients' identical values.
    """
    shapes = jax.eval_shape(model.init, keys[0])
    per_client = sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(shapes))
    m = keys.shape[0]
    batch = max(1, batch_bytes // max(per_client, 1))
    if batch >= m:
        return jax.vmap(model.init)(keys)

    def draw(i, params):
        start = jnp.minimum(i * batch, m - batch)
        new = jax.vmap(model.init)(jax.lax.dynamic_slice_in_dim(keys, start, batch))
        return jax.tree.map(lambda p, n: jax.lax.dynamic_update_slice_in_dim(p, n, start, 0),
                            params, new)

    empty = jax.tree.map(lambda a: jnp.zeros((m,) + a.shape, a.dtype), shapes)
    return jax.lax.fori_loop(0, -(-m // batch), draw, empty)


class LocalState(NamedTuple):
    params: object  # pytree, leaves [m, ...]: one model per client
    round: jax.Array  # int32


def local_models(model: Model, training: ClientTraining, *, shared_init: bool = True
                 ) -> Algorithm:
    """Builds the local-only baseline: one "round" is τ local steps on every client.

    Args:
      model: the model each client trains alone.
      training: how each client trains (`ClientTraining`).
      shared_init: start every client from the same `model.init(key)` (as the
        one-shot baseline needs, so local models are comparable); otherwise
        client i starts from `model.init(fold_in(key, i))`.

    A client without data keeps its initial model and has weight 0 in every
    average.

    Returns:
      Algorithm with state LocalState (`params` on the client axis, leaves [m, ...]).

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import local_models, sgd
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = local_models(linear_regression(3), sgd(0.1, steps=5))
      >>> state = alg.init(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> state.params.shape  # one model per client, [m, d]
      (8, 3)
      >>> jax.jit(alg.evaluate)(state, data)["client_loss"].shape
      (8,)

    References:
      The "local model" baseline of Avishek Ghosh, Jichan Chung, Dong Yin, Kannan
      Ramchandran, "An Efficient Framework for Clustered Federated Learning",
      NeurIPS 2020, https://arxiv.org/abs/2006.04088.
    """
    check_training("local_models", training)

    def init(key, data: FederatedData) -> LocalState:
        m = data.num_clients
        p = model.init(key)
        check_inputs(model, p, data)
        if shared_init:
            params = broadcast_to_clients(p, m)
        else:
            params = init_per_client(model, client_keys(key, jnp.arange(m)))
        return LocalState(params, jnp.zeros((), jnp.int32))

    def round_(state: LocalState, data: FederatedData, key):
        ids = jnp.arange(data.num_clients)
        training_t = training.at_round(state.round)  # the round's rate η_t
        params, _, losses = training_t.update_clients(model, state.params, data,
                                                      client_keys(key, ids), ids=ids)
        return LocalState(params, state.round + 1), {
            "cohort_loss": mean_over(losses[:, 0], data.active())}

    def evaluate(state: LocalState, data: FederatedData) -> dict:
        check_same_clients("The local models", state.params, data)

        def evaluate_part(part) -> dict:
            params, rows = part
            x, y, n = rows.x, rows.y, rows.num_examples

            def per_client(fn):
                return jax.vmap(lambda p, x, y, n: fn(model, p, x, y, n))(params, x, y, n)

            out = {
                "client_loss": per_client(client_loss),
                "assignment": jnp.full((n.shape[0],), -1, jnp.int32),
                "client_weight": (n > 0).astype(jnp.float32),
            }
            if model.correct is not None:
                out["client_accuracy"] = per_client(client_accuracy)
            return out

        return map_client_chunks(evaluate_part, (state.params, data))

    return Algorithm(init, round_, evaluate, per_client_fields("params"))
