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
    broadcast_to_clients,
    check_choice,
    check_fraction,
    check_inputs,
    check_steps,
    client_optimizer,
    client_weights,
    cohort_size,
    mean_over,
)
from fedjax_sim.algorithms.server import apply_server_update, make_server_optimizer
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.core import Model, client_accuracy, client_loss
from fedjax_sim.ops import (
    check_client_chunk,
    check_sampling,
    cohort_sums,
    local_update,
    map_client_chunks,
    mean_or_keep,
    sample_cohort,
    weighted_sum,
)


class FedAvgState(NamedTuple):
    params: object  # pytree, one model
    round: jax.Array  # int32
    server_state: object = ()  # FedOpt's server optimizer state; () without one


def evaluate_shared(
    model: Model, params, data: FederatedData, client_chunk: int | None = None
) -> dict:
    """Every client uses the same params (evaluated client_chunk clients at a time if set)."""

    def evaluate_part(part: FederatedData) -> dict:
        def per_client(fn):
            return jax.vmap(lambda x, y, n: fn(model, params, x, y, n))(
                part.x, part.y, part.num_examples
            )

        active = part.active()
        out = {
            "client_loss": per_client(client_loss),
            "assignment": jnp.where(active, 0, -1).astype(jnp.int32),
            "client_weight": active.astype(jnp.float32),
        }
        if model.correct is not None:
            out["client_accuracy"] = per_client(client_accuracy)
        return out

    return map_client_chunks(evaluate_part, data, client_chunk)


def fedavg(
    model: Model,
    optimizer: optax.GradientTransformation | None = None,
    *,
    learning_rate=None,
    local_steps: int = 1,
    batch_size: int | None = None,
    participation: float = 1.0,
    weighting: str = "uniform",
    client_chunk: int | None = None,
    sampling: str = "with_replacement",
    server_optimizer=None,
    server_lr=None,
) -> Algorithm:
    """Builds FedAvg: τ local steps on a cohort, then the (weighted) mean model.

    Args:
      model: the shared model.
      optimizer: client optimizer (default SGD at learning_rate).
      learning_rate: client lr when optimizer is None; may be traced.
      local_steps: τ.
      batch_size: None for full-batch steps, else the minibatch size.
      participation: fraction of clients per round, uniform without replacement.
      weighting: "uniform" or "examples" (weights ∝ num_examples: the
        sample-weighted mean Σ_k n_k w_k / Σ_k n_k over the cohort, as in
        McMahan et al.'s FedAvg and DRFLM's objective). Clients without data
        have weight 0; when the whole cohort has none the model is kept.
      client_chunk: None trains the whole cohort at once; else this many
        clients at a time, accumulating the weighted sum of trained models
        (never holding [s, ...] of them).
      sampling: minibatches "with_replacement" (independent draws per step)
        or in "epochs" (every row once per epoch; `ops.client_update`).
      server_optimizer: None: the new model is the mean (McMahan et al.);
        else FedOpt (Reddi et al. 2021, algorithms/server.py): "sgd", "sgdm"
        (FedAvgM), "adam", "yogi", "adagrad" or an optax transformation, stepping
        on the mean client delta.
      server_lr: the server learning rate η of a named server_optimizer.
    """
    check_steps("local_steps", local_steps)
    if batch_size is not None:
        check_steps("batch_size", batch_size)
    check_fraction("participation", participation)
    check_choice("weighting", weighting, ("uniform", "examples"))
    check_client_chunk(client_chunk)
    check_sampling(sampling)
    opt = client_optimizer(optimizer, learning_rate)
    server = make_server_optimizer(server_optimizer, server_lr)

    def init(key, data: FederatedData) -> FedAvgState:
        params = model.init(key)
        check_inputs(model, params, data)
        return FedAvgState(params, jnp.zeros((), jnp.int32),
                           () if server is None else server.init(params))

    def round_(state: FedAvgState, data: FederatedData, key):
        m = data.num_clients
        cohort = sample_cohort(key, m, cohort_size(m, participation))

        def client_step(batch):  # τ local steps from the global model, weighted sum
            start = broadcast_to_clients(state.params, batch.keys.shape[0])
            trained, _, losses = local_update(model, opt, start, batch.data, batch.keys,
                                              num_steps=local_steps, batch_size=batch_size,
                                              sampling=sampling)
            weights = client_weights(batch.active, batch.data.num_examples, weighting)
            sums = (weighted_sum(trained, weights), jnp.sum(weights))
            return sums, (losses[:, 0], batch.active)

        (total, weight), (first_losses, active) = cohort_sums(
            client_step, data, cohort, client_chunk=client_chunk)
        params = mean_or_keep(total, weight, state.params)
        server_state = state.server_state
        if server is not None:  # FedOpt: a server step on the mean delta Δ = mean − w
            params, server_state = apply_server_update(
                server, state.params, server_state, optax.tree.sub(params, state.params),
                weight > 0)
        metrics = {"train_loss": mean_over(first_losses, active)}
        return FedAvgState(params, state.round + 1, server_state), metrics

    def evaluate(state: FedAvgState, data: FederatedData) -> dict:
        return evaluate_shared(model, state.params, data, client_chunk)

    return Algorithm(init, round_, evaluate)
