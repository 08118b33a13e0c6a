"""SCAFFOLD: stochastic controlled averaging, local steps corrected for client drift.

Sai Praneeth Karimireddy, Satyen Kale, Mehryar Mohri, Sashank J. Reddi,
Sebastian U. Stich, Ananda Theertha Suresh. "SCAFFOLD: Stochastic Controlled
Averaging for Federated Learning". ICML 2020, arXiv:1910.06378.

One round (the paper's Algorithm 1, control-variate option II):

    S    ← a cohort of the N clients
    each i ∈ S, from y_i ← x, K times:  y_i ← y_i − η_l (g_i(y_i) − c_i + c)
           c_i⁺ ← c_i − c + (x − y_i) / (K η_l)                    (option II)
           Δy_i ← y_i − x;  Δc_i ← c_i⁺ − c_i;  c_i ← c_i⁺
    x    ← x + η_g mean_{i∈S} Δy_i
    c    ← c + (|S| / N) mean_{i∈S} Δc_i

Only the cohort's c_i change, so c stays the mean of all N client variates
(with c_i = c = 0 at the start) under partial participation.

Choices [I]:
- The client step is SGD at η_l = learning_rate on the minibatch gradient
  (option II's (x − y_i)/(K η_l) is the mean corrected gradient only for
  SGD): no other client optimizer is taken.
- The server step x + η_g Δx is FedOpt's SGD at server_lr = η_g
  (algorithms/server.py); another server_optimizer may replace it.
- A client without data takes no part: weight 0 in both means, its c_i kept,
  and N counts the clients holding data. weighting="examples" weighs client
  i by its examples in both sums, c ← c + Σ_{i∈S} p_i Δc_i with p_i its share
  of all examples, so c stays Σ_i p_i c_i; "uniform" (default) is the paper's.
- c_i and c start at 0 (the paper allows any start; its experiments use 0).
"""

from __future__ import annotations

import math
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
    client_weights,
    cohort_size,
    mean_over,
    per_client_fields,
)
from fedjax_sim.algorithms.fedavg import evaluate_shared
from fedjax_sim.algorithms.server import apply_server_update, make_server_optimizer
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.core import Model
from fedjax_sim.ops import (
    check_client_chunk,
    client_update,
    cohort_sums,
    mean_or_keep,
    put,
    sample_cohort,
    take,
    weighted_sum,
)


class ScaffoldState(NamedTuple):
    params: object  # pytree, the server model x
    control: object  # pytree like params, the server control variate c
    client_controls: object  # pytree, leaves [N, ...]: the client control variates c_i
    server_state: object  # the server optimizer's state (η_g)
    round: jax.Array  # int32


def _rows(mask, leaf):
    """[c] mask shaped to broadcast against a [c, ...] leaf."""
    return mask.reshape(mask.shape + (1,) * (leaf.ndim - 1))


def add_correction(correction) -> optax.GradientTransformation:
    """g ↦ g + correction (a pytree like the params): SCAFFOLD's g_i(y) − c_i + c."""
    return optax.GradientTransformation(
        lambda params: optax.EmptyState(),
        lambda grads, state, params=None: (optax.tree.add(grads, correction), state))


def scaffold(
    model: Model,
    *,
    learning_rate,
    local_steps: int = 1,
    batch_size: int | None = None,
    participation: float = 1.0,
    weighting: str = "uniform",
    client_chunk: int | None = None,
    server_optimizer="sgd",
    server_lr=None,
) -> Algorithm:
    """Builds SCAFFOLD (option II).

    Args:
      model: the shared model.
      learning_rate: η_l > 0, the clients' SGD step; may be traced.
      local_steps: K.
      batch_size: None for full-batch steps, else the minibatch size.
      participation: |S| / N, the cohort drawn uniformly without replacement.
      weighting: "uniform" (the paper) or "examples" (see the module notes).
      client_chunk: None trains the whole cohort at once; else this many
        clients at a time (sums accumulated; c_i⁺ kept per slot).
      server_optimizer: "sgd" (default: x + η_g Δx, the paper) or any FedOpt
        server optimizer (algorithms/server.py) stepping on Δx.
      server_lr: η_g (default 1 for "sgd").

    Returns:
      Algorithm(init, round, evaluate, client_axes) with state ScaffoldState;
      c_i lie on the client axis.
    """
    if learning_rate is None or (
        isinstance(learning_rate, (int, float, np.number))
        and not (math.isfinite(float(learning_rate)) and learning_rate > 0)
    ):
        raise ValueError(f"learning_rate (η_l) must be a finite number > 0; "
                         f"got {learning_rate!r}.")
    check_steps("local_steps", local_steps)
    if batch_size is not None:
        check_steps("batch_size", batch_size)
    check_fraction("participation", participation)
    check_choice("weighting", weighting, ("uniform", "examples"))
    check_client_chunk(client_chunk)
    if server_optimizer is None:
        raise ValueError("server_optimizer must be given ('sgd' is the paper's x + η_g Δx).")
    server = make_server_optimizer(server_optimizer, server_lr)

    def init(key, data: FederatedData) -> ScaffoldState:
        params = model.init(key)
        check_inputs(model, params, data)
        zeros = optax.tree.zeros_like(params)
        return ScaffoldState(params, zeros, broadcast_to_clients(zeros, data.num_clients),
                             server.init(params), jnp.zeros((), jnp.int32))

    def client(x, c, c_i, features, y, count, key):  # one client: K corrected steps, option II
        sgd = optax.chain(add_correction(optax.tree.sub(c, c_i)), optax.sgd(learning_rate))
        y_i, _, losses = client_update(model, sgd, x, features, y, count, key,
                                       num_steps=local_steps, batch_size=batch_size)
        delta_y = optax.tree.sub(y_i, x)
        # Δc_i = c_i⁺ − c_i = −c + (x − y_i) / (K η_l)
        delta_c = jax.tree.map(lambda c, d: -c - d / (local_steps * learning_rate), c, delta_y)
        return delta_y, delta_c, losses[0]

    def round_(state: ScaffoldState, data: FederatedData, key):
        m = data.num_clients
        cohort = sample_cohort(key, m, cohort_size(m, participation))

        def client_step(batch):
            delta_y, delta_c, first_loss = jax.vmap(
                client, in_axes=(None, None, 0, 0, 0, 0, 0))(
                state.params, state.control, batch.inputs, batch.data.x, batch.data.y,
                batch.data.num_examples, batch.keys)
            weights = client_weights(batch.active, batch.data.num_examples, weighting)
            new_c_i = jax.tree.map(  # c_i ← c_i⁺ for the clients holding data
                lambda c_i, d: jnp.where(_rows(batch.active, d), c_i + d, c_i),
                batch.inputs, delta_c)
            sums = (weighted_sum(delta_y, weights), weighted_sum(delta_c, weights),
                    jnp.sum(weights))
            return sums, (new_c_i, first_loss, batch.active)

        (dy_total, dc_total, weight), (client_controls, first_losses, active) = cohort_sums(
            client_step, data, cohort, inputs=take(cohort, state.client_controls),
            client_chunk=client_chunk)
        # Δx = Σ_S w_i Δy_i / Σ_S w_i;  c ← c + Σ_S w_i Δc_i / Σ_N w_i
        delta_x = mean_or_keep(dy_total, weight, optax.tree.zeros_like(state.params))
        params, server_state = apply_server_update(server, state.params, state.server_state,
                                                   delta_x, weight > 0)
        all_weight = jnp.sum(client_weights(data.active(), data.num_examples, weighting))
        control = jax.tree.map(lambda c, d: c + d / jnp.maximum(all_weight, 1e-30),
                               state.control, dc_total)
        metrics = {"train_loss": mean_over(first_losses, active)}
        return ScaffoldState(params, control, put(cohort, state.client_controls, client_controls),
                             server_state, state.round + 1), metrics

    def evaluate(state: ScaffoldState, data: FederatedData) -> dict:
        return evaluate_shared(model, state.params, data, client_chunk)

    return Algorithm(init, round_, evaluate, per_client_fields("client_controls"))
