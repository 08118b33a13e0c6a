"""HypCluster: k hypotheses, each client trains the one that fits its data best.

Yishay Mansour, Mehryar Mohri, Jae Ro, Ananda Theertha Suresh. "Three
Approaches for Personalization with Applications to Federated Learning".
arXiv:2002.10619, 2020 (Algorithm "HypCluster").

One round, with the cohort S drawn uniformly without replacement:

    every i ∈ S: f(i) = argmin_j F_i(h_j)            (its training loss, before the round)
                 h̃_i = τ local steps from h_f(i)
    h_j ← Σ_{i∈S: f(i)=j} n_i h̃_i / Σ_{i∈S: f(i)=j} n_i   (a hypothesis nobody chose is kept)
          (`with_dp`: h_j + (Σ_{f(i)=j} clip(h̃_i − h_j) + N(0, σ²C²)) / (D/k) instead)

This is the paper's algorithm in FedJAX's form (`fedjax/algorithms/hyp_cluster.py`:
maximization step by the average training loss, expectation step by the
clients' example-weighted mean delta, "None" — no change — for a cluster that
saw no examples), with the server step being the plain mean (FedJAX's server
optimizer at SGD, rate 1).

How it differs from IFCA option II (`ifca(option="model")`), whose round has
the same shape:

- weighting: HypCluster weighs a client's model by its number of examples
  (FedJAX); IFCA's default is uniform (its MNIST/CIFAR code).
- init: `init="random"` (the paper: k independent draws of the model, as
  IFCA), or `init="kmeans++"`, FedJAX's `kmeans_init`: every client trains
  `init_steps` local steps from one shared draw; a random client's model is
  the first hypothesis, then repeatedly the model of the client whose best
  loss under the hypotheses so far is the worst (a farthest-point k-means++
  on losses). We draw the first client among those holding data [I].
- evaluation: each client is scored with the hypothesis of lowest loss on the
  evaluated data under the current hypotheses (those after the last round's
  update), f(i) = argmin_j F_i(h_j) by the round's rule (`assign_clusters`:
  ties to the lowest index, NaN as +inf). On the training data — `simulate.run`'s default
  evaluation and every experiment's train pass — this is the paper's and
  FedJAX's `HypClusterEvaluator` (assign on the train split with the current
  models); to serve a test split with that choice, pass the train evaluation's
  `assignment` to `ifca.evaluate_clusters(..., assignment=)` (the hetero
  experiments do); evaluating a test split itself chooses by its own loss
  (IFCA's official evaluation). `state.assignment` keeps the choice each
  client made at the start of its last round, with the hypotheses before that
  round's update: a training-time record, not what evaluation uses
  (docs/protocols.md#baseline-evaluation).
- the choice is made on the training loss of the hypotheses before the
  round (as IFCA), and an empty hypothesis keeps its model (as IFCA).
- no IFCA extras: no option I, weight sharing, stable-assignment freezing or
  warm start.

Under `with_dp` each hypothesis is updated as IFCA option II's clusters are: a
client's f(i) is its own choice among the public hypotheses, so it adds its
clipped change to exactly one of the k sums, and the k noised sums cost what one
does (`algorithms.private`); each is divided by D/k, D the expected cohort. The
"kmeans++" init is refused under DP: its hypotheses are clients' trained models.
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
    is_plain,
    mean_over,
    per_client_fields,
)
from fedjax_sim.algorithms.ifca import evaluate_clusters
from fedjax_sim.algorithms.training import ClientTraining, check_training
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.core import Model, client_loss
from fedjax_sim.ops import (
    assign_clusters,
    client_keys,
    cluster_losses,
    cohort_sums,
    map_client_chunks,
    put,
    take,
    taking_part,
)
from fedjax_sim.ops.work import UNIFORM_WORK

INITS = ("random", "kmeans++")


class HypClusterState(NamedTuple):
    cluster_params: object  # pytree, leaves [k, ...]: the hypotheses h_j
    assignment: jax.Array  # [m] int32, f(i) chosen at the start of each client's last round
    #   (the hypotheses before its update; evaluation recomputes it); -1 before it took part
    round: jax.Array  # int32
    aggregation: object = ()  # the server's rule (`with_dp`'s); (): each hypothesis's mean


def hypcluster(model: Model, training: ClientTraining, *, num_clusters: int,
               participation: float = 1.0, weighting: str = "examples", init: str = "random",
               init_steps: int | None = None) -> Algorithm:
    """Builds HypCluster (Mansour et al. 2020; FedJAX's `hyp_cluster`).

    Args:
      model: the model of every hypothesis.
      training: how each client trains its hypothesis (τ steps from h_f(i)).
      num_clusters: k, the number of hypotheses.
      participation: fraction of clients per round, uniform without replacement.
      weighting: "examples" (default, FedJAX) or "uniform".
      init: "random" or "kmeans++" (module docstring).
      init_steps: local steps of the clients' models for "kmeans++" (default τ).

    Returns:
      Algorithm with state HypClusterState.

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import hypcluster, sgd
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = hypcluster(linear_regression(3), sgd(0.1, steps=5), num_clusters=2)
      >>> state = alg.init(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> state.cluster_params.shape, metrics["cluster_sizes"].shape  # [k, d], [k]
      ((2, 3), (2,))
      >>> int(metrics["cluster_sizes"].sum())  # every client chose one hypothesis
      8

    References:
      Yishay Mansour, Mehryar Mohri, Jae Ro, Ananda Theertha Suresh, "Three
      Approaches for Personalization with Applications to Federated Learning",
      arXiv 2020, https://arxiv.org/abs/2002.10619.
    """
    check_training("hypcluster", training)
    if not isinstance(num_clusters, int) or isinstance(num_clusters, bool) or num_clusters < 1:
        raise ValueError(f"num_clusters (k) must be an integer >= 1; got {num_clusters!r}.")
    clients = cohorts(participation, weighting)
    check_choice("init", init, INITS)
    # (an explicit init_steps: every client that many steps, whatever the training's work;
    # at round 0's rate, the seeding coming before the first round)
    seeding = (training if init_steps is None
               else training.replace(steps=init_steps, work=UNIFORM_WORK)).at_round(0)
    model = model.unsplit()
    k = num_clusters

    def kmeans_plus_plus(key, data: FederatedData):
        # FedJAX's kmeans_init: client models from one draw, then farthest points by loss.
        key_model, key_first, key_train = jax.random.split(key, 3)
        m = data.num_clients
        start = broadcast_to_clients(model.init(key_model), m)
        trained, _, _ = seeding.update_clients(model, start, data,
                                               client_keys(key_train, jnp.arange(m)),
                                               ids=jnp.arange(m))
        active = data.active()
        first = jax.random.choice(key_first, m, p=active / jnp.maximum(jnp.sum(active), 1))
        centers, best = [first], jnp.full((m,), jnp.inf)
        for _ in range(1, k):
            center = jax.tree.map(lambda p, c=centers[-1]: p[c], trained)
            losses = map_client_chunks(
                lambda part, c=center: jax.vmap(
                    lambda x, y, n: client_loss(model, c, x, y, n))(part.x, part.y,
                                                                    part.num_examples),
                data)
            best = jnp.minimum(best, losses)
            centers.append(jnp.argmax(jnp.where(active, best, -jnp.inf)))
        return jax.tree.map(lambda p: p[jnp.stack(centers)], trained)

    def init_(key, data: FederatedData) -> HypClusterState:
        if init == "random":
            params = jax.vmap(model.init)(jax.random.split(key, k))
        else:
            params = kmeans_plus_plus(key, data)
        check_inputs(model, jax.tree.map(lambda p: p[0], params), data)
        m = data.num_clients
        return HypClusterState(params, jnp.full((m,), -1, jnp.int32), jnp.zeros((), jnp.int32))

    def round_(state: HypClusterState, data: FederatedData, key):
        if init == "kmeans++" and not is_plain(state.aggregation):
            raise ValueError("with_dp on HypCluster needs init='random': 'kmeans++' makes "
                             "clients' own trained models the hypotheses, which no noise "
                             "covers.")
        cohort = clients.draw(key, data, round=state.round)
        training_t = training.at_round(state.round)  # the round's rate η_t

        def client_step(batch):  # f(i) = argmin_j F_i(h_j), then τ steps from h_f(i)
            losses = cluster_losses(model, state.cluster_params, batch.data)
            chosen = assign_clusters(losses)
            start = jax.tree.map(lambda p: p[chosen], state.cluster_params)
            trained, _, _ = training_t.update_clients(model, start, batch.data, batch.keys,
                                                       **batch.work())
            weights = clients.weights(batch.active, batch.data.num_examples)
            segment = jnp.where(batch.active, chosen, k)  # id k is dropped
            sums = clients.cluster_sums(state.aggregation, trained, start, segment, k, weights,
                                        batch)
            return sums, (losses, chosen)

        sums, (losses, chosen) = cohort_sums(client_step, data, cohort)
        params, aggregation, server_metrics = clients.cluster_means(
            state.aggregation, sums, state.cluster_params, key, cohort, data)
        active = taking_part(cohort, data)
        assignment = jnp.where(active, chosen, take(cohort, state.assignment))
        chosen_loss = jnp.take_along_axis(losses, chosen[:, None], axis=1)[:, 0]
        counts = jax.ops.segment_sum(active.astype(jnp.int32), chosen, k)
        metrics = {"cohort_loss": mean_over(chosen_loss, active), "cluster_sizes": counts,
                   **clients.participants(data, active), **server_metrics}
        return HypClusterState(params, put(cohort, state.assignment, assignment),
                               state.round + 1, aggregation), metrics

    def evaluate(state: HypClusterState, data: FederatedData) -> dict:
        # f(i) recomputed on `data` under the current hypotheses, not state.assignment
        return evaluate_clusters(model, state.cluster_params, data)

    return Algorithm(init_, round_, evaluate, per_client_fields("assignment"))
