"""One-shot clustering: local models, k-means on their parameters, then per-cluster FedAvg.

The "one-shot centralized clustering" baseline of Ghosh et al. 2020
(arXiv:2006.04088, §5; official code femnist/oneshot). The official FEMNIST
run clusters per-client logistic-regression coefficients fitted with
scikit-learn; here the local models are the simulated model itself, trained
with `pretrain_steps` local steps from a shared init [I: a choice that keeps
the baseline model-agnostic]. The cluster models start from the mean of
their members' local models [I].

As in the official code, the clusters are fixed once: every client, in
training and in evaluation (its test twin), uses the cluster k-means gave it
(the official code evaluates with the training cluster labels), never the
lowest-loss model; averages over clients (the cluster models' updates and the
reported loss/accuracy) are sample-weighted, as the official FEMNIST code
weights by client sample counts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_sim.algorithms.base import Algorithm
from fedjax_sim.algorithms.ifca import IFCAState, ifca, with_fixed_assignment
from fedjax_sim.algorithms.local import local_models
from fedjax_sim.algorithms.training import ClientTraining, check_training
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.execution import plan_of
from fedjax_sim.models.core import Model
from fedjax_sim.ops import kmeans, segment_average

PRETRAIN_STEPS = 100  # the local pre-training's steps when no `pretraining` is given


def one_shot_clustering(model: Model, training: ClientTraining, *, num_clusters: int,
                        pretraining: ClientTraining | None = None, participation: float = 1.0,
                        weighting: str = "examples", kmeans_restarts: int = 8) -> Algorithm:
    """Builds one-shot clustering; its rounds are per-cluster FedAvg with fixed assignments.

    Args:
      model: the model of every client and cluster.
      training: how clients train in the rounds (per-cluster FedAvg).
      num_clusters: k, the clusters k-means finds.
      pretraining: the local pre-training each client runs alone before k-means
        (default: `training` for PRETRAIN_STEPS steps). One client's rows alone
        can need a smaller step than a cluster's pooled data.
      participation, weighting: the rounds', as in `ifca` option II.
      kmeans_restarts: k-means restarts (the best inertia is kept).

    The local pre-training, the cluster means of the local models, the rounds and
    the evaluation run in chunks of the data's execution plan; k-means itself
    sees all m local models (in place, leaf by leaf). Clients without data take
    no part in k-means (assignment -1) nor in any average.

    Returns:
      Algorithm with state IFCAState (the clusters fixed by k-means at init).

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import one_shot_clustering, sgd
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = one_shot_clustering(linear_regression(3), sgd(0.1, steps=5), num_clusters=2,
      ...                           pretraining=sgd(0.1, steps=20))
      >>> state = jax.jit(alg.init)(jax.random.key(1), data)  # local models, then k-means
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> state.cluster_params.shape, state.assignment.shape  # [k, d], [m]
      ((2, 3), (8,))
      >>> sorted(set(state.assignment.tolist())) == [0, 1]  # k-means found both clusters
      True

    References:
      The one-shot clustering baseline of Avishek Ghosh, Jichan Chung, Dong Yin,
      Kannan Ramchandran, "An Efficient Framework for Clustered Federated Learning",
      NeurIPS 2020, https://arxiv.org/abs/2006.04088.
    """
    check_training("one_shot_clustering", training)
    if pretraining is not None:
        check_training("one_shot_clustering", pretraining, "pretraining")
    if pretraining is None:
        pretraining = training.replace(steps=PRETRAIN_STEPS)
    local = local_models(model, pretraining)
    clustered = with_fixed_assignment(
        ifca(model, training, num_clusters=num_clusters, option="model",
             participation=participation, weighting=weighting), model)

    def init(key, data: FederatedData) -> IFCAState:
        if num_clusters > data.num_clients:
            raise ValueError(
                f"num_clusters={num_clusters} exceeds the number of clients {data.num_clients}."
            )
        k_init, k_train, k_means = jax.random.split(key, 3)
        state, _ = local.round(local.init(k_init, data), data, k_train)
        active = data.active()
        # k-means on the flattened models, read leaf by leaf (no [m, P] copy).
        labels, _ = kmeans(k_means, state.params, num_clusters, restarts=kmeans_restarts,
                           weights=active)
        labels = jnp.where(active, labels, -1)
        fallback = jax.tree.map(
            lambda a: jnp.broadcast_to(a[0], (num_clusters,) + a.shape[1:]), state.params
        )
        cluster_params, _ = segment_average(
            state.params, labels, num_clusters, weights=data.num_examples.astype(jnp.float32),
            fallback=fallback, client_chunk=plan_of(data).client_chunk,
        )
        base = clustered.init(k_init, data)
        return base._replace(cluster_params=cluster_params, assignment=labels)

    def evaluate(state: IFCAState, data: FederatedData) -> dict:
        out = clustered.evaluate(state, data)
        return {**out, "client_weight": data.num_examples.astype(jnp.float32)}

    return Algorithm(init, clustered.round, evaluate, clustered.client_axes)
