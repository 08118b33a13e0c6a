"""Ditto: a global model by FedAvg and a personal model per client, pulled toward it.

Tian Li, Shengyuan Hu, Ahmad Beirami, Virginia Smith. "Ditto: Fair and Robust
Federated Learning Through Personalization". ICML 2021, arXiv:2012.04221.

Client k's personal model solves min_v F_k(v) + (λ/2)‖v − w*‖², w* the
global (FedAvg) model. One round (the paper's Algorithm 1, FedAvg as the
global solver), with the cohort S drawn uniformly without replacement:

    every k ∈ S: w_k ← τ local steps of F_k from w^t           (FedAvg's local solve)
                 v_k ← s steps of v − η(∇F_k(v) + λ(v − w^t))  (from its own v_k)
    w^{t+1} ← mean_{k∈S} w_k                                  (uniform, as the paper)
                      (`with_dp`: the clipped, noised mean of w_k − w^t; v_k never leave)

Choices: a client without data keeps its personal model; the personal
steps are pulled toward w^t, the model the client received (Algorithm 1),
not toward its own w_k; v_k starts at the initial global model w^0 (the
paper) and only clients of the cohort update theirs;
the personal steps are `personal`'s (default: the global steps' training) on
their own minibatches (key fold_in(client key, 1)), while the
global steps use the client key itself, so the global model is FedAvg's
exactly (same key layout, same cohort). Both follow the slot's work: τ_i
and a straggler's share are drawn from the client key for the personal
steps too, so a client takes as many of each. Evaluation scores every client
with its personal model (assignment −1: no cluster).

Under `with_dp` (or `with_dp_ftrl`) the global model is DP-FedAvg's: each client's
w_k − w^t is clipped, summed, noised and divided by the expected cohort. The
personal models never leave their clients and are not noised; v_k reads the
private w^t only, and its evaluation on the client's own data is an instrument
of the simulator, not a released output.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_sim.algorithms.base import (
    Algorithm,
    broadcast_to_clients,
    check_inputs,
    check_same_clients,
    cohorts,
    mean_over,
    per_client_fields,
)
from fedjax_sim.algorithms.training import ClientTraining, check_learning_rate, check_training
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.core import Model, client_accuracy, client_loss
from fedjax_sim.ops import cohort_sums, map_client_chunks, put, take

PERSONAL_STREAM = 1  # a client's personal steps use fold_in(its key, 1)


class DittoState(NamedTuple):
    params: object  # pytree, the global model w
    personal: object  # pytree, leaves [m, ...]: the personal models v_k
    round: jax.Array  # int32
    aggregation: object = ()  # the server's rule (`with_dp`'s); (): the weighted mean


def ditto(model: Model, training: ClientTraining, *, ditto_lambda=1.0,
          personal: ClientTraining | None = None, participation: float = 1.0,
          weighting: str = "uniform") -> Algorithm:
    """Builds Ditto (Li et al. 2021) with FedAvg as the global solver.

    Args:
      model: the model (global and personal).
      training: how each client trains the global model (FedAvg's local steps).
      ditto_lambda: λ ≥ 0, the pull of a personal model toward the global one
        (may be traced). λ = 0: each client trains alone (personal = local
        models); large λ: personal ≈ global.
      personal: the personal steps on F_k(v) + (λ/2)‖v − w‖² each round
        (default: `training`).
      participation: fraction of clients per round, uniform without replacement.
      weighting: the global mean, "uniform" (the paper) or "examples".

    Returns:
      Algorithm with state DittoState (`personal` on the client axis).

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import ditto, sgd
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = ditto(linear_regression(3), sgd(0.1, steps=5), ditto_lambda=0.1)
      >>> state = alg.init(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> state.params.shape, state.personal.shape  # the global model; one per client
      ((3,), (8, 3))
      >>> jax.jit(alg.evaluate)(state, data)["assignment"].tolist()  # personal models: no cluster
      [-1, -1, -1, -1, -1, -1, -1, -1]

    References:
      Tian Li, Shengyuan Hu, Ahmad Beirami, Virginia Smith, "Ditto: Fair and Robust
      Federated Learning Through Personalization", ICML 2021,
      https://arxiv.org/abs/2012.04221.
    """
    check_training("ditto", training)
    if personal is not None:
        check_training("ditto", personal, "personal")
    personal_training = training if personal is None else personal
    clients = cohorts(participation, weighting)
    check_learning_rate("ditto_lambda", ditto_lambda)

    def init(key, data: FederatedData) -> DittoState:
        params = model.init(key)
        check_inputs(model, params, data)
        return DittoState(params, broadcast_to_clients(params, data.num_clients),
                          jnp.zeros((), jnp.int32))

    def round_(state: DittoState, data: FederatedData, key):
        cohort = clients.draw(key, data, round=state.round)
        training_t = training.at_round(state.round)  # the round's rate η_t
        personal_t = personal_training.at_round(state.round)
        w = state.params

        def personal_loss(v, xb, yb, mb, _key):  # F_k(v) + (λ/2)‖v − w^t‖² on a minibatch
            fit = jnp.sum(mb * model.example_loss(model.apply(v, xb), yb)) / jnp.maximum(
                jnp.sum(mb), 1.0)
            return fit + 0.5 * ditto_lambda * optax.tree.norm(optax.tree.sub(v, w), squared=True)

        def client_step(batch):
            start = broadcast_to_clients(w, batch.keys.shape[0])
            trained, _, losses = training_t.update_clients(model, start, batch.data,
                                                           batch.keys, **batch.work())

            def personalize(v, x, y, n, k, taking_part, work):  # (a slot with data that reports)
                v_new, _, _ = personal_t.update(
                    model, v, x, y, n, jax.random.fold_in(k, PERSONAL_STREAM),
                    batch_loss=personal_loss, work_key=k, **work)
                return jax.tree.map(lambda a, b: jnp.where(taking_part, a, b), v_new, v)

            personal = jax.vmap(personalize)(batch.inputs, batch.data.x, batch.data.y,
                                             batch.data.num_examples, batch.keys, batch.active,
                                             batch.slot_work())
            weights = clients.weights(batch.active, batch.data.num_examples)
            return clients.sums(state.aggregation, trained, w, weights, batch), (
                personal, losses[:, 0], batch.active)

        sums, (personal, losses, active) = cohort_sums(
            client_step, data, cohort, inputs=take(cohort, state.personal))
        params, aggregation, server_metrics = clients.mean(state.aggregation, sums, w, key,
                                                           cohort, data)
        metrics = {"cohort_loss": mean_over(losses, active), **clients.participants(data, active),
                   **server_metrics}
        return DittoState(params, put(cohort, state.personal, personal), state.round + 1,
                          aggregation), metrics

    def evaluate(state: DittoState, data: FederatedData) -> dict:
        check_same_clients("Ditto's personal models", state.personal, data)

        def evaluate_part(part) -> dict:
            part, personal = part

            def per_client(fn):
                return jax.vmap(lambda p, x, y, n: fn(model, p, x, y, n))(
                    personal, part.x, part.y, part.num_examples)

            out = {
                "client_loss": per_client(client_loss),
                "assignment": jnp.full(part.num_examples.shape, -1, jnp.int32),
                "client_weight": part.active().astype(jnp.float32),
            }
            if model.correct is not None:
                out["client_accuracy"] = per_client(client_accuracy)
            return out

        return map_client_chunks(evaluate_part, (data, state.personal))

    return Algorithm(init, round_, evaluate, per_client_fields("personal"))
