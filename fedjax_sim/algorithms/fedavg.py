"""FedAvg, the "global model" baseline of IFCA.

H. Brendan McMahan, Eider Moore, Daniel Ramage, Seth Hampson, Blaise Agüera y
Arcas. "Communication-Efficient Learning of Deep Networks from Decentralized
Data". AISTATS 2017, arXiv:1602.05629.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_sim.algorithms.base import (
    Algorithm,
    check_fraction,
    client_optimizer,
    cohort_size,
    tree_weighted_mean,
)
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.core import Model, client_accuracy, client_loss
from fedjax_sim.ops import client_keys, local_update, sample_uniform


class FedAvgState(NamedTuple):
    params: object  # pytree, one model
    round: jax.Array  # int32


def evaluate_shared(model: Model, params, data: FederatedData) -> dict:
    """Every client uses the same params."""

    def per_client(fn):
        return jax.vmap(lambda x, y, n: fn(model, params, x, y, n))(
            data.x, data.y, data.num_examples
        )

    out = {
        "client_loss": per_client(client_loss),
        "assignment": jnp.zeros((data.num_clients,), jnp.int32),
    }
    if model.correct is not None:
        out["client_accuracy"] = per_client(client_accuracy)
    return out


def fedavg(
    model: Model,
    optimizer: optax.GradientTransformation | None = None,
    *,
    learning_rate=None,
    local_steps: int = 1,
    batch_size: int | None = None,
    participation: float = 1.0,
    weighting: str = "uniform",
) -> Algorithm:
    """Builds FedAvg: τ local steps on a cohort, then the (weighted) mean model.

    Args:
      model: the shared model.
      optimizer: client optimizer (default SGD at learning_rate).
      learning_rate: client lr when optimizer is None; may be traced.
      local_steps: τ.
      batch_size: None for full-batch steps, else the minibatch size.
      participation: fraction of clients per round, uniform without replacement.
      weighting: "uniform" or "examples" (weights ∝ num_examples).
    """
    if not isinstance(local_steps, int) or local_steps < 1:
        raise ValueError(f"local_steps must be an integer >= 1; got {local_steps!r}.")
    check_fraction("participation", participation)
    if weighting not in ("uniform", "examples"):
        raise ValueError(f"weighting must be 'uniform' or 'examples'; got {weighting!r}.")
    opt = client_optimizer(optimizer, learning_rate)

    def init(key, data: FederatedData) -> FedAvgState:
        del data
        return FedAvgState(model.init(key), jnp.zeros((), jnp.int32))

    def round_(state: FedAvgState, data: FederatedData, key):
        m = data.num_clients
        s = cohort_size(m, participation)
        key_cohort, key_local = jax.random.split(key)
        ids = sample_uniform(key_cohort, m, s) if s < m else jnp.arange(m, dtype=jnp.int32)
        cohort = data.take(ids) if s < m else data
        start = jax.tree.map(lambda p: jnp.broadcast_to(p, (s,) + p.shape), state.params)
        trained, _, losses = local_update(
            model, opt, start, cohort, client_keys(key_local, ids),
            num_steps=local_steps, batch_size=batch_size,
        )
        weights = (
            cohort.num_examples.astype(jnp.float32)
            if weighting == "examples"
            else jnp.ones((s,), jnp.float32)
        )
        params = tree_weighted_mean(trained, weights)
        metrics = {"train_loss": jnp.mean(losses[:, 0])}
        return FedAvgState(params, state.round + 1), metrics

    def evaluate(state: FedAvgState, data: FederatedData) -> dict:
        return evaluate_shared(model, state.params, data)

    return Algorithm(init, round_, evaluate)
