"""Ditto: a global model by FedAvg and a personal model per client, pulled toward it.

Tian Li, Shengyuan Hu, Ahmad Beirami, Virginia Smith. "Ditto: Fair and Robust
Federated Learning Through Personalization". ICML 2021, arXiv:2012.04221.

Client k's personal model solves min_v F_k(v) + (λ/2)‖v − w*‖², w* the
global (FedAvg) model. One round (the paper's Algorithm 1, FedAvg as the
global solver), with the cohort S drawn uniformly without replacement:

    every k ∈ S: w_k ← τ local steps of F_k from w^t           (FedAvg's local solve)
                 v_k ← s steps of v − η(∇F_k(v) + λ(v − w^t))  (from its own v_k)
    w^{t+1} ← mean_{k∈S} w_k                                  (uniform, as the paper)

Choices: a client without data keeps its personal model; the personal
steps are pulled toward w^t, the model the client received (Algorithm 1),
not toward its own w_k; v_k starts at the initial global model w^0 (the
paper) and only clients of the cohort update theirs;
the personal steps use the client optimizer (SGD at `personal_learning_rate`,
default η) on their own minibatches (key fold_in(client key, 1)), while the
global steps use the client key itself, so the global model is FedAvg's
exactly (same key layout, same cohort). Evaluation scores every client
with its personal model (assignment −1: no cluster).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
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
    per_client_fields,
)
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.core import Model, client_accuracy, client_loss
from fedjax_sim.ops import (
    check_client_chunk,
    client_update,
    cohort_sums,
    local_update,
    map_client_chunks,
    mean_or_keep,
    put,
    sample_cohort,
    take,
    weighted_sum,
)

PERSONAL_STREAM = 1  # a client's personal steps use fold_in(its key, 1)


class DittoState(NamedTuple):
    params: object  # pytree, the global model w
    personal: object  # pytree, leaves [m, ...]: the personal models v_k
    round: jax.Array  # int32


def ditto(
    model: Model,
    optimizer: optax.GradientTransformation | None = None,
    *,
    learning_rate=None,
    ditto_lambda=1.0,
    local_steps: int = 1,
    personal_steps: int | None = None,
    personal_learning_rate=None,
    batch_size: int | None = None,
    participation: float = 1.0,
    weighting: str = "uniform",
    client_chunk: int | None = None,
) -> Algorithm:
    """Builds Ditto (Li et al. 2021) with FedAvg as the global solver.

    Args:
      model: the model (global and personal).
      optimizer: client optimizer of the global local steps (default SGD at
        learning_rate).
      learning_rate: η when optimizer is None; may be traced.
      ditto_lambda: λ ≥ 0, the pull of a personal model toward the global one
        (may be traced). λ = 0: each client trains alone (personal = local
        models); large λ: personal ≈ global.
      local_steps: τ, FedAvg's local steps.
      personal_steps: s, the personal steps per round (default τ).
      personal_learning_rate: the personal steps' SGD rate (default η; with
        an optax `optimizer` and no rate given, the personal steps use that
        optimizer too).
      batch_size: None for full-batch steps, else the minibatch size.
      participation: fraction of clients per round, uniform without replacement.
      weighting: the global mean, "uniform" (the paper) or "examples".
      client_chunk: None trains the whole cohort at once; else this many
        clients at a time.

    Returns:
      Algorithm with state DittoState (`personal` on the client axis).
    """
    check_steps("local_steps", local_steps)
    personal_steps = local_steps if personal_steps is None else personal_steps
    check_steps("personal_steps", personal_steps)
    if batch_size is not None:
        check_steps("batch_size", batch_size)
    check_fraction("participation", participation)
    check_choice("weighting", weighting, ("uniform", "examples"))
    check_client_chunk(client_chunk)
    if isinstance(ditto_lambda, (int, float, np.number)) and not (
            np.isfinite(ditto_lambda) and ditto_lambda >= 0):
        raise ValueError(f"ditto_lambda must be a finite number >= 0; got {ditto_lambda!r}.")
    opt = client_optimizer(optimizer, learning_rate)
    personal_opt = (opt if personal_learning_rate is None
                    else client_optimizer(None, personal_learning_rate))

    def init(key, data: FederatedData) -> DittoState:
        params = model.init(key)
        check_inputs(model, params, data)
        return DittoState(params, broadcast_to_clients(params, data.num_clients),
                          jnp.zeros((), jnp.int32))

    def round_(state: DittoState, data: FederatedData, key):
        m = data.num_clients
        cohort = sample_cohort(key, m, cohort_size(m, participation))
        w = state.params

        def personal_loss(v, xb, yb, mb, _key):  # F_k(v) + (λ/2)‖v − w^t‖² on a minibatch
            fit = jnp.sum(mb * model.example_loss(model.apply(v, xb), yb)) / jnp.maximum(
                jnp.sum(mb), 1.0)
            return fit + 0.5 * ditto_lambda * optax.tree.norm(optax.tree.sub(v, w), squared=True)

        def client_step(batch):
            start = broadcast_to_clients(w, batch.keys.shape[0])
            trained, _, losses = local_update(model, opt, start, batch.data, batch.keys,
                                              num_steps=local_steps, batch_size=batch_size)

            def personalize(v, x, y, n, k):
                v_new, _, _ = client_update(model, personal_opt, v, x, y, n,
                                            jax.random.fold_in(k, PERSONAL_STREAM),
                                            num_steps=personal_steps, batch_size=batch_size,
                                            batch_loss=personal_loss)
                return jax.tree.map(lambda a, b: jnp.where(n > 0, a, b), v_new, v)

            personal = jax.vmap(personalize)(batch.inputs, batch.data.x, batch.data.y,
                                             batch.data.num_examples, batch.keys)
            weights = client_weights(batch.active, batch.data.num_examples, weighting)
            return (weighted_sum(trained, weights), jnp.sum(weights)), (
                personal, losses[:, 0], batch.active)

        (total, weight), (personal, losses, active) = cohort_sums(
            client_step, data, cohort, inputs=take(cohort, state.personal),
            client_chunk=client_chunk)
        params = mean_or_keep(total, weight, w)
        metrics = {"train_loss": mean_over(losses, active)}
        return DittoState(params, put(cohort, state.personal, personal), state.round + 1), metrics

    def evaluate(state: DittoState, data: FederatedData) -> dict:
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

        return map_client_chunks(evaluate_part, (data, state.personal), client_chunk)

    return Algorithm(init, round_, evaluate, per_client_fields("personal"))
