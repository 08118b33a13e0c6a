"""Robust IFCA: clustered FL whose cluster models minimise their worst member's loss.

IFCA: Avishek Ghosh, Jichan Chung, Dong Yin, Kannan Ramchandran. "An Efficient
Framework for Clustered Federated Learning". NeurIPS 2020, arXiv:2006.04088.
DRFA: Yuyang Deng, Mohammad Mahdi Kamani, Mehrdad Mahdavi. "Distributionally
Robust Federated Averaging". NeurIPS 2020, arXiv:2102.12660.

The problem: IFCA averages a cluster's members uniformly, so a cluster model
fits its typical member. When the members of one cluster differ in difficulty
(a few clients with label noise, fewer examples or a shifted input
distribution inside an otherwise homogeneous group), the hard members are
outvoted: their loss stays high while the cluster's mean loss looks fine.
Robust IFCA keeps IFCA's cluster choice and replaces its within-cluster mean
by DRFA's min-max: cluster j solves

    min_{θ_j} max_{λ ∈ Δ(C_j)} Σ_{i ∈ C_j} λ_i F_i(θ_j),

C_j the clients whose last choice was j. One round, cohort S uniform without
replacement (IFCA option II with λ-weighted averaging):

    every i ∈ S: ĵ_i = argmin_j F_i(θ_j);  θ̃_i = τ local steps from θ_ĵi
    θ_j ← Σ_{i∈S, ĵ_i=j} λ_i θ̃_i / Σ_{i∈S, ĵ_i=j} λ_i      (empty or weightless: kept)
    v_i ← (|C_j| / |S ∩ C_j|) F_i(θ_ĵi) for i ∈ S, 0 elsewhere
    λ_{C_j} ← Π_Δ(λ_{C_j} + γ τ v_{C_j})   for every cluster j

With γ = 0 the weights stay uniform within every cluster and the round is
IFCA option II with uniform weighting (`ifca(option="model")`), equal to float
rounding (the mean is Σ λθ / Σ λ instead of Σ θ / count; tested).

Choices [I]:
- λ is one [m] vector, each cluster's part on its own simplex
  (`ops.simplex.project_segments`). A client that changes cluster enters
  its new cluster with weight 1/|C_j| of that cluster's membership before the
  round (the uniform share; so uniform weights stay uniform), and every
  cluster's weights are renormalised to sum to 1 before the ascent.
- The cohort is drawn uniformly (IFCA) and the models are averaged with
  weights λ (AFL's / FedJAX's form), not drawn ∝ λ as DRFA does: the
  clusters are only known after the clients have chosen.
- The ascent uses the losses the cluster choice already computed (each
  client's whole training loss of its chosen model at the start of the
  round), scaled by |C_j|/|S ∩ C_j| so it is unbiased for the cluster's loss
  vector; DRFA instead probes an averaged snapshot model on one minibatch of a
  second cohort. No extra communication is needed. The step is γ τ v, DRFA's.
- Clients without data take no part: never assigned, weight 0.
Kernels reused: IFCA's cluster losses and assignment, the local update and
per-segment sums (`ops`), DRFA's simplex projection (per cluster), IFCA's
evaluation (each client scored with its argmin-loss cluster model).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_sim.algorithms.base import (
    Algorithm,
    check_inputs,
    cohorts,
    mean_over,
    per_client_fields,
)
from fedjax_sim.algorithms.ifca import evaluate_clusters
from fedjax_sim.algorithms.training import ClientTraining, check_learning_rate, check_training
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.core import Model
from fedjax_sim.ops import (
    assign_clusters,
    cluster_losses,
    cohort_sums,
    divide_segments,
    put,
    segment_totals,
    take,
    taking_part,
)
from fedjax_sim.ops.simplex import project_segments


class RobustIFCAState(NamedTuple):
    cluster_params: object  # pytree, leaves [k, ...]
    assignment: jax.Array  # [m] int32, last cluster of each client; -1 before it took part
    lam: jax.Array  # [m] float32, weight within its cluster (each cluster's sum 1; 0 unassigned)
    round: jax.Array  # int32


def robust_ifca(model: Model, training: ClientTraining, *, num_clusters: int,
                participation: float = 1.0, lambda_lr=0.01) -> Algorithm:
    """Builds robust IFCA: IFCA option II with a DRFA λ inside every cluster.

    Args:
      model: the model of every cluster.
      training: how each client trains (τ steps from its cluster's model).
      num_clusters: k.
      participation: fraction of clients per round, uniform without replacement.
      lambda_lr: γ, the λ step (may be traced); 0 gives IFCA option II.

    Start from given cluster models with `ifca.with_initial_params`.

    Returns:
      Algorithm with state RobustIFCAState; evaluate adds `client_lambda` [m].

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import robust_ifca, sgd
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = robust_ifca(linear_regression(3), sgd(0.1, steps=5), num_clusters=2)
      >>> state = alg.init(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> state.cluster_params.shape, state.lam.shape  # [k, d]; λ over the m clients
      ((2, 3), (8,))
      >>> jax.jit(alg.evaluate)(state, data)["client_lambda"].shape
      (8,)

    References:
      New in fedjax_sim: IFCA's cluster choice (Avishek Ghosh, Jichan Chung, Dong
      Yin, Kannan Ramchandran, "An Efficient Framework for Clustered Federated
      Learning", NeurIPS 2020, https://arxiv.org/abs/2006.04088) with DRFA's
      min-max inside each cluster (Yuyang Deng, Mohammad Mahdi Kamani, Mehrdad
      Mahdavi, "Distributionally Robust Federated Averaging", NeurIPS 2020,
      https://arxiv.org/abs/2102.12660).
    """
    check_training("robust_ifca", training)
    if not isinstance(num_clusters, int) or isinstance(num_clusters, bool) or num_clusters < 1:
        raise ValueError(f"num_clusters (k) must be an integer >= 1; got {num_clusters!r}.")
    clients = cohorts(participation)
    check_learning_rate("lambda_lr", lambda_lr)
    model = model.unsplit()
    k = num_clusters

    def init(key, data: FederatedData) -> RobustIFCAState:
        params = jax.vmap(model.init)(jax.random.split(key, k))
        check_inputs(model, jax.tree.map(lambda p: p[0], params), data)
        m = data.num_clients
        return RobustIFCAState(params, jnp.full((m,), -1, jnp.int32),
                               jnp.zeros((m,), jnp.float32), jnp.zeros((), jnp.int32))

    def members(assignment):
        """[k] clients per cluster (segment k collects the unassigned)."""
        return jax.ops.segment_sum(jnp.ones_like(assignment, jnp.float32),
                                   jnp.where(assignment >= 0, assignment, k), k + 1)[:k]

    def round_(state: RobustIFCAState, data: FederatedData, key):
        m = data.num_clients
        cohort = clients.draw(key, data, round=state.round)
        training_t = training.at_round(state.round)  # the round's rate η_t
        prev, lam_prev = take(cohort, (state.assignment, state.lam))
        entry_weight = 1.0 / jnp.maximum(members(state.assignment), 1.0)  # [k]

        def client_step(batch):  # IFCA option II's client, λ-weighted per cluster
            prev_b, lam_b = batch.inputs
            losses = cluster_losses(model, state.cluster_params, batch.data)
            chosen = assign_clusters(losses)
            start = jax.tree.map(lambda p: p[chosen], state.cluster_params)
            trained, _, _ = training_t.update_clients(model, start, batch.data, batch.keys,
                                                       **batch.work())
            weight = jnp.where(chosen == prev_b, lam_b, entry_weight[chosen])
            weight = jnp.where(batch.active, weight, 0.0)
            segment = jnp.where(batch.active, chosen, k)  # id k is dropped
            return segment_totals(trained, segment, k, weight), (losses, chosen, weight)

        (totals, cluster_weight), (losses, chosen, weight) = cohort_sums(
            client_step, data, cohort, inputs=(prev, lam_prev))
        params = divide_segments(totals, cluster_weight, fallback=state.cluster_params)

        active = taking_part(cohort, data)
        assignment = put(cohort, state.assignment, jnp.where(active, chosen, prev))
        lam = put(cohort, state.lam, jnp.where(active, weight, lam_prev))
        segment = jnp.where(assignment >= 0, assignment, k)
        lam_total = jax.ops.segment_sum(lam, segment, k + 1)
        lam = jnp.where(assignment >= 0, lam / jnp.maximum(lam_total[segment], 1e-30), 0.0)

        chosen_loss = jnp.take_along_axis(losses, chosen[:, None], axis=1)[:, 0]
        in_cohort = jax.ops.segment_sum(active.astype(jnp.float32),
                                        jnp.where(active, chosen, k), k + 1)[:k]
        scale = members(assignment)[chosen] / jnp.maximum(in_cohort[chosen], 1.0)
        v = put(cohort, jnp.zeros((m,), jnp.float32), jnp.where(active, scale * chosen_loss, 0.0))
        lam = project_segments(lam + lambda_lr * training.steps * v,
                               jnp.where(assignment >= 0, assignment, -1), k)
        metrics = {
            "cohort_loss": mean_over(chosen_loss, active),
            **clients.participants(data, active),
            "worst_client_loss": jnp.max(jnp.where(active, chosen_loss, 0.0)),
            "cluster_sizes": in_cohort.astype(jnp.int32),
            "lambda_max": jnp.max(lam),
        }
        return RobustIFCAState(params, assignment, lam, state.round + 1), metrics

    def evaluate(state: RobustIFCAState, data: FederatedData) -> dict:
        out = evaluate_clusters(model, state.cluster_params, data)
        out["client_lambda"] = state.lam
        return out

    return Algorithm(init, round_, evaluate, per_client_fields("assignment", "lam"))
