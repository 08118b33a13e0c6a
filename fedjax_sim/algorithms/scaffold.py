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
           (`with_dp`: the pair (Δy_i, Δc_i) clipped as one update, both means noised)

Only the cohort's c_i change, so c stays the mean of all N client variates
(with c_i = c = 0 at the start) under partial participation.

Choices [I]:
- The client step is SGD at η_l = learning_rate on the minibatch gradient
  (option II's (x − y_i)/(K η_l) is the mean corrected gradient only for
  SGD): no other client optimizer is taken.
- The server step x + η_g Δx is FedOpt's SGD at server_lr = η_g
  (algorithms/server.py); `with_server_optimizer` around SCAFFOLD at η_g = 1
  puts another server optimizer on Δx.
- A client without data takes no part: weight 0 in both means, its c_i kept,
  and N counts the clients holding data. weighting="examples" weighs client
  i by its examples in both sums, c ← c + Σ_{i∈S} p_i Δc_i with p_i its share
  of all examples, so c stays Σ_i p_i c_i; "uniform" (default) is the paper's.
- c_i and c start at 0 (the paper allows any start; its experiments use 0).
- With per-client work (`ClientTraining.work`, stragglers) K is the client's
  own number of steps K_i; a client that took none keeps its c_i (Δc_i = 0).

Under `with_dp` (or `with_dp_ftrl`) a client's message is the pair (Δy_i, Δc_i):
it is clipped as one update, ‖(Δy_i, Δc_i)‖₂ ≤ C over both pytrees, so adding or
removing a client moves the pair of sums by at most C, and one Gaussian N(0, σ²C²)
per coordinate noises both (`algorithms.private`). With S̃_y, S̃_c the noised sums and
D the expected cohort (`base.expected_clients`, or with_dp's `expected_clients`):

    x    ← x + η_g S̃_y / D
    c    ← c + (D / N) · S̃_c / D  = c + S̃_c / N      (N: the clients holding data)

N, the population's size, is public (the accountant's q presumes it); with
`denominator="count"` the rule's means divide by the reporting count n instead, and c
moves by n/N times its mean (the rule's `divisor`; a robust rule's is n too). Every
reporting client counts 1 (no `weighting="examples"`), the server step is taken
also when nobody reported (the noise moves x), and c_i stays on its client.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_sim.algorithms.base import (
    Algorithm,
    broadcast_to_clients,
    check_inputs,
    cohorts,
    expected_clients,
    is_plain,
    mean_over,
    per_client_fields,
)
from fedjax_sim.algorithms.fedavg import evaluate_shared
from fedjax_sim.algorithms.server import apply_server_update, make_server_optimizer
from fedjax_sim.algorithms.training import ClientTraining, check_training, sgd_rate
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.core import Model
from fedjax_sim.ops import cohort_sums, mean_or_keep, put, take


class ScaffoldState(NamedTuple):
    params: object  # pytree, the server model x
    control: object  # pytree like params, the server control variate c
    client_controls: object  # pytree, leaves [N, ...]: the client control variates c_i
    round: jax.Array  # int32
    server_state: object = ()  # `with_server_optimizer`'s state; () without one
    aggregation: object = ()  # the server's rule (`with_dp`'s); (): the weighted means


def _rows(mask, leaf):
    """[c] mask shaped to broadcast against a [c, ...] leaf."""
    return mask.reshape(mask.shape + (1,) * (leaf.ndim - 1))


def _cohort_denominator(aggregation, sums, cohort, data):
    """What the rule's mean of the cohort's changes divided by (`divisor`): with_dp's fixed
    D (its `expected_clients`, else the cohort's expected size), a robust rule's count of
    reporting clients."""
    return aggregation.divisor(sums, expected_clients(cohort, data))


def add_correction(correction) -> optax.GradientTransformation:
    """g ↦ g + correction (a pytree like the params): SCAFFOLD's g_i(y) − c_i + c."""
    return optax.GradientTransformation(
        lambda params: optax.EmptyState(),
        lambda grads, state, params=None: (optax.tree.add(grads, correction), state))


def scaffold(model: Model, training: ClientTraining, *, participation: float = 1.0,
             weighting: str = "uniform", server_lr=None) -> Algorithm:
    """Builds SCAFFOLD (option II).

    Args:
      model: the shared model.
      training: the clients' K local steps, plain SGD at η_l > 0 (`sgd(η_l, ...)`):
        option II's (x − y_i)/(K η_l) is the mean corrected gradient only for SGD.
      participation: |S| / N, the cohort drawn uniformly without replacement.
      weighting: "uniform" (the paper) or "examples" (see the module notes).
      server_lr: η_g, the server step x + η_g Δx (None: 1; may be traced). Another
        server optimizer on Δx: `with_server_optimizer(scaffold(...), ...)` at η_g = 1.

    Returns:
      Algorithm(init, round, evaluate, client_axes) with state ScaffoldState;
      c_i lie on the client axis.

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import scaffold, sgd
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = scaffold(linear_regression(3), sgd(0.05, steps=10), participation=0.5)
      >>> state = alg.init(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> state.control.shape, state.client_controls.shape  # c [d]; c_i [m, d]
      ((3,), (8, 3))

    References:
      Sai Praneeth Karimireddy, Satyen Kale, Mehryar Mohri, Sashank J. Reddi,
      Sebastian U. Stich, Ananda Theertha Suresh, "SCAFFOLD: Stochastic Controlled
      Averaging for Federated Learning", ICML 2020, https://arxiv.org/abs/1910.06378.
    """
    check_training("scaffold", training)
    sgd_rate(training, "scaffold", "option II's control variates are the mean corrected gradient")
    clients = cohorts(participation, weighting)
    server = make_server_optimizer("sgd", server_lr)

    def init(key, data: FederatedData) -> ScaffoldState:
        params = model.init(key)
        check_inputs(model, params, data)
        zeros = optax.tree.zeros_like(params)
        return ScaffoldState(params, zeros, broadcast_to_clients(zeros, data.num_clients),
                             jnp.zeros((), jnp.int32))

    def client(training_t, x, c, c_i, features, y, count, key, work):  # K corrected steps
        learning_rate = training_t.learning_rate  # η_l of the round
        corrected = training_t.replace(optimizer=optax.chain(
            add_correction(optax.tree.sub(c, c_i)), optax.sgd(learning_rate)))
        y_i, _, losses = corrected.update(model, x, features, y, count, key, **work)
        delta_y = optax.tree.sub(y_i, x)
        # Δc_i = c_i⁺ − c_i = −c + (x − y_i) / (K_i η_l), K_i the steps it took (τ_i of
        # per-client work; a client that took none learns nothing: Δc_i = 0)
        steps = corrected.client_steps(key, work["client_id"], count, work["straggles"])
        steps = training_t.steps if steps is None else steps
        delta_c = jax.tree.map(
            lambda c, d: jnp.where(steps > 0, -c - d / (jnp.maximum(steps, 1) * learning_rate),
                                   0.0), c, delta_y)
        return delta_y, delta_c, losses[0]

    def round_(state: ScaffoldState, data: FederatedData, key):
        cohort = clients.draw(key, data, round=state.round)
        training_t = training.at_round(state.round)  # the round's rate η_l

        def client_step(batch):
            delta_y, delta_c, first_loss = jax.vmap(
                functools.partial(client, training_t), in_axes=(None, None, 0, 0, 0, 0, 0, 0))(
                state.params, state.control, batch.inputs, batch.data.x, batch.data.y,
                batch.data.num_examples, batch.keys, batch.slot_work())
            weights = clients.weights(batch.active, batch.data.num_examples)
            new_c_i = jax.tree.map(  # c_i ← c_i⁺ for the clients holding data
                lambda c_i, d: jnp.where(_rows(batch.active, d), c_i + d, c_i),
                batch.inputs, delta_c)
            # one message per client, (Δy_i, Δc_i): a rule clips the pair as one update
            sums = clients.sums(state.aggregation, (delta_y, delta_c), None, weights,
                                batch)
            return sums, (new_c_i, first_loss, batch.active)

        sums, (client_controls, first_losses, active) = cohort_sums(
            client_step, data, cohort, inputs=take(cohort, state.client_controls))
        if is_plain(state.aggregation):
            # Δx = Σ_S w_i Δy_i / Σ_S w_i;  c ← c + Σ_S w_i Δc_i / Σ_N w_i
            (dy_total, dc_total), weight = sums
            delta_x = mean_or_keep(dy_total, weight, optax.tree.zeros_like(state.params))
            moved = weight > 0
            all_weight = jnp.sum(clients.weights(data.active(), data.num_examples))
            control = jax.tree.map(lambda c, d: c + d / jnp.maximum(all_weight, 1e-30),
                                   state.control, dc_total)
            aggregation, server_metrics = state.aggregation, {}
        else:  # Δx = S̃_y / D;  c ← c + (D / N) S̃_c / D (module docstring)
            zeros = optax.tree.zeros_like((state.params, state.control))
            (delta_x, mean_c), aggregation, server_metrics = clients.mean(
                state.aggregation, sums, zeros, key, cohort, data)
            moved = None  # the noised mean moves x whoever reported
            fraction = _cohort_denominator(state.aggregation, sums, cohort, data) / jnp.maximum(
                jnp.sum(data.active().astype(jnp.float32)), 1.0)
            control = jax.tree.map(lambda c, d: c + fraction * d, state.control, mean_c)
        params, _ = apply_server_update(server, state.params, server.init(state.params),
                                        delta_x, moved)
        metrics = {"cohort_loss": mean_over(first_losses, active),
                   **clients.participants(data, active), **server_metrics}
        return state._replace(params=params, control=control,
                              client_controls=put(cohort, state.client_controls,
                                                  client_controls),
                              round=state.round + 1, aggregation=aggregation), metrics

    def evaluate(state: ScaffoldState, data: FederatedData) -> dict:
        return evaluate_shared(model, state.params, data)

    return Algorithm(init, round_, evaluate, per_client_fields("client_controls"))
