"""FedAvg, the "global model" baseline of IFCA.

H. Brendan McMahan, Eider Moore, Daniel Ramage, Seth Hampson, Blaise Agüera y
Arcas. "Communication-Efficient Learning of Deep Networks from Decentralized
Data". AISTATS 2017, arXiv:1602.05629.

One round (the paper's Algorithm 1):

    S    ← round(participation · m) clients (at least 1), uniformly without replacement
    each i ∈ S:  w_i ← LocalUpdate(w)              (`training`: τ optimizer steps)
    w    ← Σ_{i∈S} p_i w_i / Σ_{i∈S} p_i           (p_i = 1, or n_i: weighting="examples")
                                                   (`with_dp`: the clipped, noised mean instead)

A client without data has p_i = 0; a round whose cohort holds no data keeps w.
FedOpt (FedAvgM, FedAdam, ...) is `with_server_optimizer(fedavg(...), ...)`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_sim.algorithms.base import (
    Algorithm,
    broadcast_to_clients,
    check_inputs,
    cohorts,
    mean_over,
)
from fedjax_sim.algorithms.training import ClientTraining, check_training
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.core import Model, client_accuracy, client_loss
from fedjax_sim.ops import cohort_sums, map_client_chunks


class FedAvgState(NamedTuple):
    params: object  # pytree, one model
    round: jax.Array  # int32
    server_state: object = ()  # `with_server_optimizer`'s state; () without one
    aggregation: object = ()  # the server's rule (`with_dp`'s); (): the weighted mean


def evaluate_shared(model: Model, params, data: FederatedData) -> dict:
    """Every client uses the same params (in chunks of the data's execution plan)."""

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

    return map_client_chunks(evaluate_part, data)


def fedavg(model: Model, training: ClientTraining, *, participation: float = 1.0,
           weighting: str = "uniform") -> Algorithm:
    """Builds FedAvg.

    Args:
      model: the shared model.
      training: how each client trains (`ClientTraining`, e.g. `sgd(0.1, steps=5)`).
      participation: fraction of clients per round, uniform without replacement.
      weighting: "uniform" or "examples" (weights ∝ num_examples: the
        sample-weighted mean Σ_k n_k w_k / Σ_k n_k over the cohort, as in
        McMahan et al.'s FedAvg and DRFLM's objective).

    Returns:
      Algorithm(init, round, evaluate) with state FedAvgState.

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import fedavg, sgd
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = fedavg(linear_regression(3), sgd(0.1, steps=5), participation=0.5)
      >>> state = alg.init(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> sorted(metrics)
      ['cohort_loss']

    References:
      H. Brendan McMahan, Eider Moore, Daniel Ramage, Seth Hampson, Blaise Agüera y
      Arcas, "Communication-Efficient Learning of Deep Networks from Decentralized
      Data", AISTATS 2017, https://arxiv.org/abs/1602.05629.
    """
    check_training("fedavg", training)
    clients = cohorts(participation, weighting)

    def init(key, data: FederatedData) -> FedAvgState:
        params = model.init(key)
        check_inputs(model, params, data)
        return FedAvgState(params, jnp.zeros((), jnp.int32))

    def round_(state: FedAvgState, data: FederatedData, key):
        cohort = clients.draw(key, data, round=state.round)
        training_t = training.at_round(state.round)  # the round's rate η_t

        def client_step(batch):  # τ local steps from the global model, weighted sum
            start = broadcast_to_clients(state.params, batch.keys.shape[0])
            trained, _, losses = training_t.update_clients(model, start, batch.data,
                                                           batch.keys, **batch.work())
            weights = clients.weights(batch.active, batch.data.num_examples)
            sums = clients.sums(state.aggregation, trained, state.params, weights, batch)
            return sums, (losses[:, 0], batch.active)

        sums, (first_losses, active) = cohort_sums(client_step, data, cohort)
        params, aggregation, server_metrics = clients.mean(state.aggregation, sums,
                                                           state.params, key, cohort, data)
        metrics = {"cohort_loss": mean_over(first_losses, active),
                   **clients.participants(data, active), **server_metrics}
        return state._replace(params=params, round=state.round + 1,
                              aggregation=aggregation), metrics

    def evaluate(state: FedAvgState, data: FederatedData) -> dict:
        return evaluate_shared(model, state.params, data)

    return Algorithm(init, round_, evaluate)
