"""AFL: Agnostic Federated Learning, min over the model, max over the clients' mixture.

Mehryar Mohri, Gary Sivek, Ananda Theertha Suresh. "Agnostic Federated
Learning". ICML 2019, arXiv:1902.00146.

AFL minimises the loss of the worst mixture of the clients,
min_w max_{λ ∈ Δ} Σ_i λ_i F_i(w), by the paper's stochastic mirror-descent
ascent/descent (its Stochastic-AFL, with the Euclidean mirror map: projected
gradient steps). One round, with the cohort S of s clients drawn uniformly
without replacement:

    every i ∈ S: F_i(w) and τ local steps from w (τ = 1: one gradient step)
    w ← Σ_{i∈S} λ_i w_i / Σ_{i∈S} λ_i             (λ-weighted model average)
    v_i ← (m/s) F_i(w) for i ∈ S, 0 elsewhere     (unbiased estimate of ∇_λ)
    λ ← Π_Δ(λ + γ v)                               (projected ascent)

With τ = 1 and plain SGD at rate η the model step is
w − η Σ_S λ_i ∇F_i(w) / Σ_S λ_i: the paper's descent step on the λ-weighted
loss, and exactly it under full participation (Σ λ_i = 1). The λ step and the
model step use the same w^t and the same losses (the paper's simultaneous
update of (w, λ) at (w^t, λ^t)).

Where we follow FedJAX's `agnostic_fed_avg` (Ro et al. 2021, the federated
form of AFL): the weights are read at the start of the round, the losses that
drive them are the clients' losses of the round's starting model, and the
cohort's models are averaged with weights ∝ their mixture weight and
normalised over the cohort (FedJAX's β^k / Σ β). Where we differ: our
mixture is over clients (FedJAX's over per-example domain ids, so one client
can hold several domains); the ascent is the paper's projected gradient
step (`optax.projections.projection_simplex`), not FedJAX's default
exponentiated-gradient step; the loss estimate is scaled by m/s, so it is
unbiased for the full vector of losses (FedJAX averages each domain's loss
over the examples it saw); no server optimizer and no sliding window of
domain counts. [I] Clients without data take no part: their λ is 0 from the
start and stays 0 (the projection runs over the clients holding data).

Output and evaluation: the paper's Stochastic-AFL outputs the averaged
iterates, w^A = (1/T) Σ_{t=1..T} w_t and λ^A = (1/T) Σ_{t=1..T} λ_t, where
w_t, λ_t are the iterates after the t-th update: the start w_0, λ_0 is not
among them (its algorithm box; [R]: recalled, not re-read); its convergence
bound is for w^A. The state keeps both running means (`params_avg`,
`lam_avg`: after round t the means of w_1..w_t and of λ_1..λ_t; before the
first round w_0 and λ_0), and evaluation reports w^A (and `client_lambda` =
λ^A) by default; `evaluate_iterate="last"` reports the last iterates w_T,
λ_T instead, the model the next round starts from
(docs/protocols.md#baseline-evaluation).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_sim.algorithms.base import (
    Algorithm,
    broadcast_to_clients,
    check_choice,
    check_inputs,
    cohorts,
    mean_over,
    per_client_fields,
)
from fedjax_sim.algorithms.fedavg import evaluate_shared
from fedjax_sim.algorithms.training import ClientTraining, check_learning_rate, check_training
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.core import Model
from fedjax_sim.ops import cohort_sums, mean_or_keep, put, take, weighted_sum
from fedjax_sim.ops.simplex import project_segments

ITERATES = ("average", "last")


class AFLState(NamedTuple):
    params: object  # pytree, the global model w_t (the last iterate)
    params_avg: object  # pytree like params, w^A: mean of w_1..w_t (w_0 before any round)
    lam: jax.Array  # [m] float32, λ_t on the simplex over the clients holding data
    lam_avg: jax.Array  # [m] float32, λ^A: mean of λ_1..λ_t (λ_0 before any round)
    round: jax.Array  # int32


def running_mean(mean, value, rounds):
    """The mean of the iterates 1..t from that of 1..t-1 (t = rounds + 1): the first
    iterate itself at t = 1, whatever `mean` held before it."""
    t = (rounds + 1).astype(jnp.float32)
    return jax.tree.map(lambda a, w: jnp.where(rounds == 0, w, a + (w - a) / t), mean, value)


def project_active(v, active):
    """Π_Δ over the clients with data (entries of the others are 0)."""
    return project_segments(v, jnp.where(active, 0, -1), 1)


def afl(model: Model, training: ClientTraining, *, participation: float = 1.0,
        lambda_lr=0.01, evaluate_iterate: str = "average") -> Algorithm:
    """Builds AFL (Mohri et al. 2019): projected ascent on the client mixture λ.

    Args:
      model: the shared model.
      training: how each client trains; `sgd(η)` with one full-batch step is the
        paper's one gradient step per round (then F_i(w) is the client's whole
        loss; with minibatches it is the first step's minibatch loss, the
        paper's stochastic estimate).
      participation: s/m, clients per round, uniform without replacement.
      lambda_lr: γ, the λ step size (may be traced); γ = 0 keeps λ uniform.
      evaluate_iterate: the iterates evaluation reports: "average" (default, the
        paper's output w^A, λ^A: the means of the iterates after each round) or
        "last" (w_T, λ_T); the state keeps both.

    Returns:
      Algorithm with state AFLState; evaluate adds `client_lambda` [m].

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import afl, sgd
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = afl(linear_regression(3), sgd(0.1), lambda_lr=0.01)
      >>> state = alg.init(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> state.lam.shape, round(float(state.lam.sum()), 4)  # λ on the simplex, [m]
      ((8,), 1.0)
      >>> jax.jit(alg.evaluate)(state, data)["client_lambda"].shape
      (8,)

    References:
      Mehryar Mohri, Gary Sivek, Ananda Theertha Suresh, "Agnostic Federated
      Learning", ICML 2019, https://arxiv.org/abs/1902.00146.
    """
    check_training("afl", training)
    clients = cohorts(participation)
    check_learning_rate("lambda_lr", lambda_lr)
    check_choice("evaluate_iterate", evaluate_iterate, ITERATES)

    def init(key, data: FederatedData) -> AFLState:
        params = model.init(key)
        check_inputs(model, params, data)
        active = data.active()
        lam = active / jnp.maximum(jnp.sum(active), 1).astype(jnp.float32)
        return AFLState(params, params, lam, lam, jnp.zeros((), jnp.int32))

    def round_(state: AFLState, data: FederatedData, key):
        m = data.num_clients
        cohort = clients.draw(key, data, round=state.round)
        s = cohort.size
        training_t = training.at_round(state.round)  # the round's rate η_t

        def client_step(batch):  # τ steps from w; F_i(w) is the first step's loss
            start = broadcast_to_clients(state.params, batch.keys.shape[0])
            trained, _, losses = training_t.update_clients(model, start, batch.data,
                                                           batch.keys, **batch.work())
            weights = jnp.where(batch.active, batch.inputs, 0.0)
            return (weighted_sum(trained, weights), jnp.sum(weights)), (losses[:, 0],
                                                                       batch.active)

        (total, weight), (losses, active) = cohort_sums(
            client_step, data, cohort, inputs=take(cohort, state.lam))
        params = mean_or_keep(total, weight, state.params)
        params_avg = running_mean(state.params_avg, params, state.round)
        v = put(cohort, jnp.zeros((m,), jnp.float32), jnp.where(active, (m / s) * losses, 0.0))
        lam = project_active(state.lam + lambda_lr * v, data.active())
        lam_avg = running_mean(state.lam_avg, lam, state.round)
        metrics = {
            "cohort_loss": mean_over(losses, active),
            **clients.participants(data, active),
            "worst_client_loss": jnp.max(jnp.where(active, losses, 0.0)),
            "lambda_max": jnp.max(lam),
        }
        return AFLState(params, params_avg, lam, lam_avg, state.round + 1), metrics

    def evaluate(state: AFLState, data: FederatedData) -> dict:
        if evaluate_iterate == "last":
            params, lam = state.params, state.lam
        else:  # w^A, λ^A; before any round the start w_0, λ_0 (whatever the means hold)
            started = state.round > 0
            params, lam = jax.tree.map(lambda a, w: jnp.where(started, a, w),
                                       (state.params_avg, state.lam_avg),
                                       (state.params, state.lam))
        out = evaluate_shared(model, params, data)
        out["client_lambda"] = lam
        return out

    return Algorithm(init, round_, evaluate, per_client_fields("lam", "lam_avg"))
